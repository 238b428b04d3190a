"""Each part of the Trainer on its own, at small sizes and without a training step: the state and
its layout checks (train/state.py), the gradient's reductions (train/reductions.py), gradient
accumulation (train/accumulate.py) and batch placement (train/placement.py).

Oracles: the reduction plans are the ZeRO table (parallel/fsdp.py, parallel/hierarchical_zero.py)
written out; every computed figure is compared with the same computation on the whole arrays on one
device (optax's global norm and clipping, jax.grad per micro-batch, numpy sums), in float32 to
|a - b| <= 1e-6 + 1e-5 * |b|, except the int8-compressed reduction (relative error of the whole
result below 2%: one 8-bit quantization per value, measured ~0.3%).
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.traverse_util import flatten_dict as flatten
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.errors import LayoutError
from jaxpar.parallel import build_layout, parse_strategy
from jaxpar.train import grad_sync, reductions
from jaxpar.train.accumulate import accumulate, local_microbatches
from jaxpar.train.placement import BatchPlacement
from jaxpar.train.state import ShardedState, abstract_model
from jaxpar.train.step import TrainConfig, Trainer

TOL = dict(rtol=1e-5, atol=1e-6)


def layout(text):
    return build_layout(parse_strategy(text, 8))


class Tiny(nnx.Module):
    """Three weights with logical names; ``embed`` wide."""

    def __init__(self, rngs, embed=16):
        part = nnx.with_partitioning
        self.up = nnx.Param(part(nnx.initializers.normal(1.0), ("embed", "mlp"))(rngs.params(), (embed, 8)))
        self.scale = nnx.Param(part(nnx.initializers.normal(1.0), ("embed",))(rngs.params(), (embed,)))
        self.bias = nnx.Param(part(nnx.initializers.normal(1.0), ("mlp",))(rngs.params(), (8,)))

    def __call__(self, x):
        return (x * self.scale[...]) @ self.up[...] + self.bias[...]


def tiny_loss(model, x):
    return jnp.mean(model(x) ** 2)


def sharded_state(text, embed=16):
    model_fn = lambda rngs: Tiny(rngs, embed)  # noqa: E731
    return ShardedState(layout(text), model_fn, optax.adam(1e-3), *abstract_model(model_fn))


def per_device(mesh):
    """The spec of an array stacked on dim 0 with one row per device."""
    return P(tuple(a for a in mesh.axis_names if mesh.shape[a] > 1))


# --- state.py ----------------------------------------------------------------------------------


def test_state_refuses_an_indivisible_weight_before_touching_memory():
    sharded_state("data=8", embed=12)  # embed kept whole: fine
    before = len(jax.live_arrays())
    with pytest.raises(LayoutError) as info:
        sharded_state("fsdp=8", embed=12)
    assert len(jax.live_arrays()) == before
    msg = str(info.value)
    assert "weight " in msg and "'embed'" in msg and "size 12" in msg and "('fsdp',)" in msg, msg


@pytest.mark.parametrize("text", ["fsdp=4,tensor=2", "data=2,fsdp=4,zero=1"])
def test_state_specs_shardings_and_init_follow_the_layout(text):
    state = sharded_state(text)
    lay = state.layout
    for path, names in {("up",): ("embed", "mlp"), ("scale",): ("embed",), ("bias",): ("mlp",)}.items():
        assert state.names[path] == state.written_names[path] == names
        want = {m: lay.spec(names, m) for m in ("param", "optimizer", "grad")}
        got = {"param": flatten(state.param_specs)[path], "optimizer": flatten(state.opt_specs_by_param)[path],
               "grad": flatten(state.grad_specs_by_param)[path]}
        assert got == want, path
        # Adam's moments lie like the optimizer mapping says, its step count replicated
        assert flatten(state.opt_specs[0].mu)[path] == flatten(state.opt_specs[0].nu)[path] == want["optimizer"]
    assert state.opt_specs[0].count == P()

    init = state.init(seed=3)
    with nnx.use_eager_sharding(False):  # the oracle: the same seed on one device
        want = nnx.to_pure_dict(nnx.state(Tiny(nnx.Rngs(jax.random.key(3)))))
    for path, value in flatten(init.params).items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(flatten(want)[path]))
        assert value.sharding.is_equivalent_to(flatten(state.state_shardings.params)[path], value.ndim)
    abstract = state.abstract_state()
    assert jax.tree.map(lambda a: (a.shape, a.dtype), abstract) == jax.tree.map(lambda a: (a.shape, a.dtype), init)
    assert state.merge(jax.device_get(init.params)).up[...].shape == (16, 8)
    assert state.stacked_marks() == {"up": False, "scale": False, "bias": False}


# --- reductions.py -------------------------------------------------------------------------------

FSDP = [(0, ("fsdp",))]


@pytest.mark.parametrize(
    "text, gathered, per_micro, final, rest",
    [
        ("data=8", [], [], [], ("data",)),  # DP: one all-reduce
        ("fsdp=8", FSDP, [], [], ()),  # ZeRO-3: the gather's backward reduce-scatters
        ("fsdp=8,zero=1", [], [], FSDP, ()),  # ZeRO-1: one reduce-scatter after the loop
        ("fsdp=8,zero=2", [], FSDP, [], ()),  # ZeRO-2: a reduce-scatter per micro-batch
        ("data=2,fsdp=4", FSDP, [], [], ("data",)),  # HSDP: ZeRO-3 inside, all-reduce across
        ("data=2,fsdp=4,zero=2", [], FSDP, [], ("data",)),
        ("fsdp=8,param_shards=4", FSDP, [(0, ("fsdp_group",))], [], ()),  # hierarchical ZeRO
    ],
)
def test_reduction_plan_is_the_zero_table(text, gathered, per_micro, final, rest):
    lay = layout(text)
    plan = reductions.reduction_plan(lay, ("embed", "mlp"))
    assert plan == reductions.ReductionPlan(gathered, per_micro, final, rest)
    # a stacked weight: the same axes, one dim further; a weight with no embed dim: all-reduced
    shifted = [[(dim + 1, axes) for dim, axes in part] for part in (gathered, per_micro, final)]
    assert reductions.reduction_plan(lay, ("layers", "embed", "mlp")) == reductions.ReductionPlan(*shifted, rest)
    assert reductions.reduction_plan(lay, ("mlp",)) == reductions.ReductionPlan([], [], [], lay.batch_axes)


GRAD_NAMES = {("w",): ("embed", "mlp"), ("b",): ("mlp",), ("s",): ("embed",), ("r",): (None,),
              ("stack",): ("layers", "embed", "heads")}
GRAD_SHAPES = {("w",): (16, 8), ("b",): (8,), ("s",): (16,), ("r",): (3,), ("stack",): (2, 16, 4)}


def whole_gradient(seed=0):
    rng = np.random.default_rng(seed)
    return {p[0]: rng.standard_normal(shape).astype(np.float32) for p, shape in GRAD_SHAPES.items()}


@pytest.mark.parametrize("clip_norm", [0.0, 1.0, 100.0])
def test_global_norm_from_shards_equals_the_whole_gradients_norm(clip_norm):
    lay = layout("data=2,fsdp=2,tensor=2")
    whole = whole_gradient()
    specs = {p[0]: lay.spec(names, "optimizer") for p, names in GRAD_NAMES.items()}
    assert specs["w"] == P("fsdp", "tensor") and specs["stack"] == P(None, "fsdp", "tensor")  # sharded, really
    shards = {k: jax.device_put(v, NamedSharding(lay.mesh, specs[k])) for k, v in whole.items()}
    fn = jax.shard_map(lambda g: reductions.clip(g, lay, GRAD_NAMES, clip_norm), mesh=lay.mesh,
                       in_specs=(specs,), out_specs=(P(), specs))
    norm, clipped = jax.jit(fn)(shards)
    np.testing.assert_allclose(float(norm), float(optax.tree.norm(whole)), **TOL)
    want = optax.clip_by_global_norm(clip_norm).update(whole, optax.EmptyState())[0] if clip_norm else whole
    assert 1.0 < float(norm) < 100.0  # clip_norm=1 scales the gradient down, 100 leaves it
    for k in whole:
        np.testing.assert_allclose(np.asarray(clipped[k]), np.asarray(want[k]), **TOL)


def reduce_on_devices(lay, names, sync=None):
    """Every device's own gradient (rows of a (8, ...) array per weight) reduced by the plan:
    per micro-batch, then final; returned laid out like the optimizer state, with the sum over
    devices (numpy) to compare with."""
    plans = {p: reductions.reduction_plan(lay, n) for p, n in names.items()}
    rng = np.random.default_rng(1)
    local = {p[0]: rng.standard_normal((8, *GRAD_SHAPES[p])).astype(np.float32) for p in names}
    specs = {p[0]: lay.spec(n, "optimizer") for p, n in names.items()}
    rows = per_device(lay.mesh)

    def fn(grads, seed):
        grads = {k: g[0] for k, g in grads.items()}
        grads = reductions.reduce(grads, plans, "micro", jnp.float32, sync, seed)
        return reductions.reduce(grads, plans, "final", jnp.float32, sync, seed)

    mapped = jax.shard_map(fn, mesh=lay.mesh, in_specs=({k: rows for k in local}, P()), out_specs=specs)
    got = jax.jit(mapped)(local, jnp.uint32(0))
    return {k: np.asarray(v) for k, v in got.items()}, {k: v.sum(axis=0) for k, v in local.items()}


@pytest.mark.parametrize("text", ["data=2,fsdp=4,zero=1", "data=2,fsdp=4,zero=2"])
def test_exact_reduce_sums_every_devices_gradient(text):
    got, want = reduce_on_devices(layout(text), GRAD_NAMES)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], **TOL)


def test_compressed_reduce_compresses_its_axis_and_sums_the_rest_exactly():
    lay = layout("data=2,fsdp=4,zero=1")  # embed: reduce-scattered over fsdp (compressed), then all-reduced over data
    sync = grad_sync.resolve(TrainConfig(grad_sync="int8", grad_sync_axes=("fsdp",), grad_sync_min_size=1), lay)
    got, want = reduce_on_devices(lay, {p: n for p, n in GRAD_NAMES.items() if "embed" in n}, sync)
    error = np.linalg.norm(np.concatenate([(got[k] - want[k]).ravel() for k in want]))
    scale = np.linalg.norm(np.concatenate([want[k].ravel() for k in want]))
    assert 0 < error / scale < 0.02, error / scale  # compressed (not exact), and close


def test_all_reduce_buckets_group_the_compressed_all_reduces_by_axes():
    lay = layout("data=2,fsdp=4,zero=1")
    plans = {p: reductions.reduction_plan(lay, n) for p, n in GRAD_NAMES.items()}
    embed, no_embed = [("w",), ("s",), ("stack",)], [("b",), ("r",)]  # all-reduced over data; over data and fsdp
    assert reductions.all_reduce_buckets(plans, None, 1) == ([], list(plans))
    only_fsdp = grad_sync.resolve(TrainConfig(grad_sync="int8", grad_sync_axes=("fsdp",)), lay)
    assert reductions.all_reduce_buckets(plans, only_fsdp, 1) == ([(("data", "fsdp"), no_embed)], embed)
    both = grad_sync.resolve(TrainConfig(grad_sync="int8"), lay)
    assert reductions.all_reduce_buckets(plans, both, 1) == ([(("data",), embed), (("data", "fsdp"), no_embed)], [])
    # ZeRO-3 with micro-batches: every reduction over fsdp runs inside the loop, so nothing is compressed
    zero3 = layout("fsdp=8")
    plans = {p: reductions.reduction_plan(zero3, n) for p, n in GRAD_NAMES.items() if "embed" in n}
    with pytest.raises(LayoutError, match="would compress nothing"):
        reductions.all_reduce_buckets(plans, grad_sync.resolve(TrainConfig(grad_sync="int8"), zero3), 2)
    assert reductions.all_reduce_buckets(plans, grad_sync.resolve(TrainConfig(grad_sync="int8"), zero3), 1) == ([], list(plans))


# --- accumulate.py -------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["data=8", "fsdp=8,zero=2", "data=2,fsdp=4,zero=2"])
def test_accumulation_is_the_sum_of_each_micro_batchs_gradient(text):
    lay, k, rows = layout(text), 2, 32
    names = {("w",): ("embed", "mlp")}
    plans = {p: reductions.reduction_plan(lay, n) for p, n in names.items()}
    rng = np.random.default_rng(2)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    x, y = rng.standard_normal((rows, 16)).astype(np.float32), rng.standard_normal((rows, 8)).astype(np.float32)
    batch_spec, param_spec, opt_spec = P(lay.batch_axes), lay.spec(names[("w",)], "param"), lay.spec(names[("w",)], "optimizer")
    nbytes = {}

    def loss(params, mb):  # the mean over this device's rows of one micro-batch, / devices
        return jnp.mean((mb[0] @ params["w"] - mb[1]) ** 2) / lay.batch_shards

    def fn(params, x, y):
        params = {"w": jax.lax.pcast(params["w"], lay.batch_axes, to="varying")}
        reduce = lambda g: reductions.reduce(g, plans, "micro", jnp.float32)  # noqa: E731
        losses, acc = accumulate(jax.value_and_grad(loss), params, local_microbatches((x, y), k), reduce, plans, lay)
        nbytes["acc"] = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(acc))  # the buffer the loop carried
        return jax.lax.psum(losses, lay.batch_axes), reductions.reduce(acc, plans, "final", jnp.float32)

    mapped = jax.shard_map(fn, mesh=lay.mesh, in_specs=({"w": param_spec}, batch_spec, batch_spec),
                           out_specs=(P(), {"w": opt_spec}))
    losses, acc = jax.jit(mapped)({"w": w}, x, y)

    # the oracle: micro-batch j holds the j-th slice of every device's rows; its gradient on one device
    per_device_rows = rows // lay.batch_shards
    whole_loss = lambda w, x, y: jnp.mean((x @ w - y) ** 2)  # noqa: E731
    want_losses, want = [], np.zeros_like(w)
    for j in range(k):
        idx = np.concatenate([d * per_device_rows + np.arange(j * per_device_rows // k, (j + 1) * per_device_rows // k)
                              for d in range(lay.batch_shards)])
        value, grad = jax.value_and_grad(whole_loss)(w, x[idx], y[idx])
        want_losses.append(float(value))
        want += np.asarray(grad)
    np.testing.assert_allclose(np.asarray(losses), want_losses, **TOL)
    np.testing.assert_allclose(np.asarray(acc["w"]), want, **TOL)
    # the buffer is the gradient mapping's shard, in float32
    shard = NamedSharding(lay.mesh, lay.spec(names[("w",)], "grad")).shard_shape(w.shape)
    assert nbytes["acc"] == 4 * int(np.prod(shard))


# --- placement.py --------------------------------------------------------------------------------


def test_put_process_batch_builds_the_same_global_array_as_put_batch():
    lay = layout("data=2,fsdp=4")
    place = BatchPlacement(lay, microbatches=2)
    host = np.arange(16 * 5, dtype=np.int32).reshape(16, 5)
    asked = []

    def rows(start, stop):
        asked.append((start, stop))
        return host[start:stop]

    put, built = place.put(host), place.put_process(16, rows)
    assert built.sharding.is_equivalent_to(put.sharding, 2) and put.sharding.spec == P(("data", "fsdp"))
    np.testing.assert_array_equal(np.asarray(built), host)
    for a, b in zip(sorted(put.addressable_shards, key=lambda s: s.device.id), sorted(built.addressable_shards, key=lambda s: s.device.id)):
        np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
    assert asked == [(2 * i, 2 * i + 2) for i in range(8)]  # each device's rows once, in order
    abstract = place.abstract(16, 4)
    assert (abstract.shape, abstract.dtype) == ((16, 5), jnp.int32) and abstract.sharding.is_equivalent_to(put.sharding, 2)
    with pytest.raises(LayoutError, match="does not split evenly over 16 = batch axes"):
        place.put(np.zeros((24, 5), np.int32))  # 8 devices x 2 micro-batches


# --- the Trainer reads its parts --------------------------------------------------------------------


def test_trainer_reads_what_its_parts_hold():
    trainer = Trainer(layout("fsdp=8,zero=2"), Tiny, tiny_loss, TrainConfig(microbatches=2))
    state, place = trainer.sharded_state, trainer.placement
    for name in ("names", "written_names", "param_specs", "opt_specs", "opt_specs_by_param", "grad_specs_by_param",
                 "state_shardings", "graphdef", "abstract"):
        assert getattr(trainer, name) is getattr(state, name), name
    assert trainer.abstract_leaf(("up",)).shape == (16, 8) and trainer.stacked_marks() == state.stacked_marks()
    assert trainer.batch_sharding(np.zeros((16, 1))) == place.sharding(np.zeros((16, 1)))
    with pytest.raises(LayoutError, match="over 16 = batch axes"):
        trainer.check_batch(np.zeros((8, 1)))
    assert trainer.plan.reductions[("up",)] == reductions.reduction_plan(trainer.layout, ("embed", "mlp"))
