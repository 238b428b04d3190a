"""Expert parallelism (parallel/expert/): the MoE family's tokens exchanged over the expert axis.

Every layout trains like one device: the oracle and the comparison are test_equivalence's (3
steps, SGD with momentum, losses, first-step gradients and final weights within |a - b| <= 1e-5 +
1e-4 |b| in float32), dropless and with a capacity factor (the oracle drops the same copies: the
capacity is per row, earlier tokens first).
"""
import dataclasses
import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.traverse_util import flatten_dict, unflatten_dict

from jaxpar import aot
from jaxpar.analysis import hlo, memory
from jaxpar.errors import JaxparError, LayoutError
from jaxpar.experts import bias_steering
from jaxpar.models import moe
from jaxpar.nn import RuleUpdated
from jaxpar.parallel import build_layout, check_model, parse_strategy
from jaxpar.parallel.expert import exchange
from jaxpar.topology import load_topology
from jaxpar.train.state import TrainState
from jaxpar.train.step import Trainer
from tests.test_equivalence import BATCH, CFG, LEARNING_RATE, OPTIMIZER, SEQ, assert_same, batches, initial_weights, oracle, sharded, tokens  # noqa: F401 (tokens: a fixture)

TINY = moe.CONFIGS["moe-tiny"]
CAPPED = dataclasses.replace(TINY, capacity_factor=1.0)
STEERED = dataclasses.replace(TINY, bias_rate=0.01)  # with DeepSeek-V3's routing bias (10x its step: it moves in 3 steps)


def tiny_moe(rngs):
    return moe.MoE(TINY, rngs=rngs)


def capped_moe(rngs):
    return moe.MoE(CAPPED, rngs=rngs)


MODELS = {"dropless": tiny_moe, "capacity": capped_moe}


@pytest.fixture(scope="module")
def moe_oracles(tokens):  # noqa: F811
    return {name: oracle(fn, moe.loss_fn, batches(tokens)) for name, fn in MODELS.items()}


LAYOUTS = ["expert=8", "expert=4,fsdp=2", "expert=2,tensor=2,fsdp=2", "expert=2,context=2,fsdp=2"]


@pytest.mark.parametrize("routing", list(MODELS))
@pytest.mark.parametrize("strategy", LAYOUTS)
def test_expert_layout_matches_one_device(strategy, routing, tokens, moe_oracles):  # noqa: F811
    assert_same(sharded(strategy, MODELS[routing], moe.loss_fn, batches(tokens)), moe_oracles[routing])


def test_expert_layout_under_a_pipeline_matches_one_device(tokens):  # noqa: F811
    # 1F1B over 2 stages with 2 micro-batches; a pipeline passes only the residual stream, so the
    # model leaves its balance losses out (balance_weight=0: refused otherwise, below)
    cfg = dataclasses.replace(TINY, balance_weight=0.0)
    model_fn = lambda rngs: moe.MoE(cfg, rngs=rngs)  # noqa: E731
    assert_same(sharded("stage=2,expert=2,fsdp=2", model_fn, moe.loss_fn, batches(tokens), dataclasses.replace(CFG, microbatches=2)),
                oracle(model_fn, moe.loss_fn, batches(tokens)))


def test_exchange_bytes_equal_the_formula_and_experts_are_never_reduced_over_expert():
    """On the compiled step of expert=4,fsdp=2: the all-to-alls over expert carry what the formula
    says for the batch (per MoE layer: the copies' slots out and back, forward and backward, and the
    counts). The experts' gradients are reduce-scattered over fsdp alone (E/P experts' gate, up and
    down per layer), every other weight's over fsdp x expert, where it is stored; no weight's
    gradient is all-reduced (only the balance sums are)."""
    trainer = Trainer(build_layout(parse_strategy("expert=4,fsdp=2", 8)), tiny_moe, moe.loss_fn, CFG, optimizer=OPTIMIZER)
    batch = trainer.abstract_batch(BATCH, SEQ)
    compiled = trainer.jit_step(batch).lower(trainer.abstract_state(), batch).compile()
    by_axes = hlo.by_axes(hlo.collectives(compiled.as_text(), trainer.layout.mesh))
    rows, devices, local = BATCH // 8, 4, TINY.experts // 4
    tokens = rows * SEQ
    slot = tokens * min(TINY.top_k, local)  # dropless: the most copies one device can send another
    per_layer = 4 * (devices - 1) * slot * TINY.embed * 4 + (devices - 1) * local * 4  # float32 rows; int32 counts
    assert by_axes[("all-to-all", ("expert",))]["bytes_per_device"] == TINY.layers * per_layer
    experts_local = TINY.layers * local * 3 * TINY.embed * TINY.mlp
    # (the token table is read at its shards: its rows travel, its gradient is never reduce-scattered)
    others = sum(math.prod(leaf.shape) for path, leaf in flatten_dict(initial_weights(tiny_moe)).items()
                 if path[-1] not in ("w_gate", "w_up", "w_down", "embedding"))
    assert by_axes[("reduce-scatter", ("fsdp",))]["bytes_per_device"] == experts_local * 4 / 2
    assert by_axes[("reduce-scatter", ("fsdp", "expert"))]["bytes_per_device"] == others * 4 * 7 / 8
    balance = TINY.layers * 2 * (2 * TINY.experts * 4) * 7 / 8  # the balance sums over all 8 devices' tokens
    allreduce = [v["bytes_per_device"] for (kind, axes), v in by_axes.items() if kind == "all-reduce"]
    assert sum(allreduce) == pytest.approx(balance, abs=64)  # (and the scalars: the loss, the norm)
    # stored: every weight 1/8 per device (the experts 1/4 over expert x 1/2 over fsdp, the others
    # 1/8 over fsdp x expert), as the compiled initialisation lays them out and the ZeRO table says;
    # SGD's momentum (4 bytes a weight) lies alike (stored over fsdp alone, the others would hold 4x)
    measured, table = memory.measured_memory(trainer, compiled), memory.zero_table(trainer)
    whole = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(initial_weights(tiny_moe)))
    assert table["parameters"] == 4 * whole / 8
    assert measured["parameters"] == pytest.approx(table["parameters"], rel=0.01)
    assert measured["optimizer"] == pytest.approx(table["optimizer"] / 2, rel=0.01)  # (the table's: Adam's two moments)


def test_a_pipeline_refuses_a_balance_loss_and_expert_degrees_must_divide_the_experts():
    with pytest.raises(LayoutError, match=r"stage=2: a pipeline passes only the residual stream.*--balance-weight 0"):
        check_model(parse_strategy("stage=2,expert=2,fsdp=2", 8), TINY, SEQ)
    with pytest.raises(LayoutError, match=r"also hand its loss their routing-bias steps \(bias_rate=0.01\).*--bias-rate 0"):
        check_model(parse_strategy("stage=2,expert=2,fsdp=2", 8), dataclasses.replace(STEERED, balance_weight=0.0), SEQ)
    with pytest.raises(LayoutError, match=r"expert=8 does not divide the model's 6 experts.*one of 1, 2, 3, 6"):
        check_model(parse_strategy("expert=8", 8), dataclasses.replace(TINY, experts=6), SEQ)
    with pytest.raises(JaxparError, match=r"top_k=9 must be between 1 and the number of experts \(8\)"):
        dataclasses.replace(TINY, top_k=9)


class PlainMoE(nnx.Module):
    """A mixture of experts as a plain Flax user writes one (no jaxpar import): a router, top-2 of 8
    experts, every expert run on every token and weighed by its routing weight (zero where not chosen)."""

    def __init__(self, vocab=64, d=32, hidden=64, experts=8, *, rngs):
        init = nnx.initializers.normal(0.1)
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.router = nnx.Linear(d, experts, use_bias=False, rngs=rngs)
        self.w_in = nnx.Param(nnx.with_partitioning(init, ("experts", "embed", "mlp"))(rngs.params(), (experts, d, hidden)))
        self.w_out = nnx.Param(nnx.with_partitioning(init, ("experts", "mlp", "embed"))(rngs.params(), (experts, hidden, d)))
        self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        probs = jax.nn.softmax(self.router(x), axis=-1)
        top, chosen = jax.lax.top_k(probs, 2)
        weights = jnp.sum(jax.nn.one_hot(chosen, probs.shape[-1]) * (top / top.sum(-1, keepdims=True))[..., None], axis=-2)
        hidden = jax.nn.gelu(jnp.einsum("bld,xdh->blxh", x, self.w_in[...]))
        x = x + jnp.einsum("blxh,xhd,blx->bld", hidden, self.w_out[...], weights)
        return self.head(x)


def plain_loss(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch[:, :-1]), batch[:, 1:]).mean()


def test_a_plain_flax_moe_under_expert_parallelism_matches_one_device(tokens):  # noqa: F811
    model_fn = lambda rngs: PlainMoE(rngs=rngs)  # noqa: E731
    host = [b % 64 for b in batches(tokens)]
    trainer = Trainer(build_layout(parse_strategy("expert=4,fsdp=2", 8)), model_fn, plain_loss, CFG, optimizer=OPTIMIZER)
    assert_same(sharded(trainer, model_fn, plain_loss, host), oracle(model_fn, plain_loss, host))
    assert trainer.plan.path == "gspmd"
    assert trainer.state_shardings.params["w_in"].spec[0] == "expert"  # the experts are split, not replicated


class SteeredPlainMoE(PlainMoE):
    """``PlainMoE`` with a routing bias trained by its rule: a ``RuleUpdated`` weight and the steering
    term in the loss, and no jaxpar call in the model, so the GSPMD path runs it."""

    def __init__(self, *, rngs):
        super().__init__(rngs=rngs)
        self.bias = RuleUpdated(jnp.zeros(8), out_sharding=(None,))

    def __call__(self, tokens):
        x = self.embed(tokens)
        probs = jax.nn.softmax(self.router(x), axis=-1)
        _, chosen = jax.lax.top_k(probs + self.bias[...], 2)
        top = jnp.take_along_axis(probs, chosen, axis=-1)
        weights = jnp.sum(jax.nn.one_hot(chosen, probs.shape[-1]) * (top / top.sum(-1, keepdims=True))[..., None], axis=-2)
        hidden = jax.nn.gelu(jnp.einsum("bld,xdh->blxh", x, self.w_in[...]))
        x = x + jnp.einsum("blxh,xhd,blx->bld", hidden, self.w_out[...], weights)
        copies = jnp.sum(jax.nn.one_hot(chosen, probs.shape[-1]), axis=(0, 1, 2))
        return self.head(x), bias_steering(self.bias[...], copies, 0.01)


def steered_plain_loss(model, batch):
    logits, steering = model(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean() + steering


def test_a_plain_flax_moe_with_a_rule_updated_bias_on_the_gspmd_path_matches_one_device(tokens):  # noqa: F811
    # the bias's step comes from the loss's gradient there too (XLA's reductions), out of the clip norm
    model_fn = lambda rngs: SteeredPlainMoE(rngs=rngs)  # noqa: E731
    host = [b % 64 for b in batches(tokens)]
    cfg = dataclasses.replace(CFG, clip_norm=1e-3)  # the trained weights' gradient clipped: the bias's must not be
    one = Trainer(build_layout(parse_strategy("data=1", 1), jax.devices()[:1]), model_fn, steered_plain_loss, cfg, optimizer=OPTIMIZER)
    split = Trainer(build_layout(parse_strategy("expert=4,fsdp=2", 8)), model_fn, steered_plain_loss, cfg, optimizer=OPTIMIZER)
    ours, reference = sharded(split, model_fn, steered_plain_loss, host), sharded(one, model_fn, steered_plain_loss, host)
    assert split.plan.path == "gspmd"
    assert_same(ours, reference)
    assert split.sharded_state.rule_updated == {("bias",)}
    # the first step moved the bias by exactly the rule, unclipped: -0.01 x sign(copies - mean)
    with nnx.use_eager_sharding(False):
        model = model_fn(nnx.Rngs(jax.random.key(0)))  # (the weights initial_weights made)
    _, chosen = jax.lax.top_k(jax.nn.softmax(model.router(model.embed(jnp.asarray(host[0][:, :-1]))), axis=-1), 2)
    copies = np.bincount(np.asarray(chosen).ravel(), minlength=8)
    np.testing.assert_allclose(-ours[1]["bias"] * LEARNING_RATE, -0.01 * np.sign(copies - copies.mean()), atol=1e-6)


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """``jax.lax.ragged_all_to_all`` as its documentation defines it, from all-gathers (XLA:CPU's
    runtime lacks the op): sender s's rows input_offsets[s][j] .. + send_sizes[s][j] land in
    receiver j's output at output_offsets[s][j]."""
    me = jax.lax.axis_index(axis_name)
    rows = jnp.arange(operand.shape[0])
    everyone = [jax.lax.all_gather(a, axis_name, tiled=False) for a in (operand, input_offsets, send_sizes, output_offsets)]
    for s in range(everyone[0].shape[0]):
        data, start, size, land = (a[s] for a in everyone)
        source = jnp.take(data, jnp.clip(start[me] + rows, 0, operand.shape[0] - 1), axis=0)
        target = jnp.where(rows < size[me], land[me] + rows, output.shape[0])  # past the end: dropped
        output = output.at[target].set(source, mode="drop")
    return output


@pytest.mark.parametrize("strategy, model", [("expert=8,expert_exchange=ragged", "dropless"),
                                             ("expert=4,fsdp=2,expert_exchange=ragged", "capacity")])
def test_the_ragged_exchange_matches_one_device_with_the_op_emulated(strategy, model, tokens, moe_oracles, monkeypatch):  # noqa: F811
    # the offsets and sizes the ragged exchange computes, run through the op's documented semantics
    # (megablox, which TPU runs the experts by, cannot run here: its interpret mode refuses the
    # step's typed shard_map; test_experts checks it against ragged_dot alone)
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    assert_same(sharded(strategy, MODELS[model], moe.loss_fn, batches(tokens)), moe_oracles[model])


def test_the_experts_run_by_megablox_on_tpu_where_the_shapes_tile_and_by_ragged_dot_otherwise():
    on = lambda platform: SimpleNamespace(mesh=SimpleNamespace(devices=np.array([SimpleNamespace(platform=platform)])))  # noqa: E731
    assert exchange.grouped_kernel(on("tpu"), 32768, 4096, 14336) == "megablox"  # Mixtral's landing buffer on v5p-512
    assert exchange.grouped_kernel(on("tpu"), 1000, 64, 64) == "ragged_dot"  # 1000 rows: no whole tiles
    assert exchange.grouped_kernel(on("cpu"), 32768, 4096, 14336) == "ragged_dot"


def test_the_routing_report_counts_every_copy_and_drops_beyond_each_rows_capacity(tokens):  # noqa: F811
    # one layer: its routing does not depend on what earlier layers dropped
    cfg = dataclasses.replace(CAPPED, layers=1)
    model = moe.MoE(cfg, rngs=nnx.Rngs(0))
    batch = batches(tokens)[0]
    report = moe.routing_report(model, batch, devices=4)
    copies = np.array(report["copies_per_expert"])
    assert (copies.sum(axis=1) == BATCH * SEQ * cfg.top_k).all()
    per_row = [np.asarray(model.routing_counts(batch[i:i + 1, :-1])[0][0]) for i in range(BATCH)]
    np.testing.assert_array_equal(copies[0], np.sum(per_row, axis=0))
    kept = sum(np.minimum(row, cfg.routing.capacity(SEQ)).sum() for row in per_row)  # each row's copies, capped per expert
    assert report["dropped_fraction"] == pytest.approx(1 - kept / copies.sum())
    assert report["dropped_fraction"] > 0  # (the case the test is about)
    loads = copies.reshape(1, 4, -1).sum(-1)
    assert report["device_max_over_mean"] == pytest.approx((loads.max(-1) / loads.mean(-1)).tolist())
    assert moe.routing_report(moe.MoE(dataclasses.replace(cfg, capacity_factor=None), rngs=nnx.Rngs(0)), batch, 4)["dropped_fraction"] == 0


def _pod_report(model, pod, strategy, batch, seq):
    """``jaxpar compile``'s report with MaxText's pod settings: bf16 compute and gradient reduction,
    full remat, splash attention. (With float32 reduction XLA:TPU sends the gradients of the
    experts' gate and up, born bf16 in the grouped matmuls' backward, as bf16 into a float32 sum:
    measured 0.74 of the float32 formula on the reduce-scatters of Mixtral below.)"""
    pytest.importorskip("libtpu", reason="pip install -e .[tpu] brings the TPU compiler")
    cfg = dataclasses.replace(aot.POD_DEFAULTS, grad_reduce_dtype="bfloat16")
    report = aot.compile_report(model, load_topology(pod), strategy, batch, seq, cfg, alternatives=0)
    assert report["compiler"] == "tpu"
    return report


def _assert_traffic_is_the_formulas(report, kinds):
    for kind in kinds:  # (all-reduce and reduce-scatter: within the scalars' and the balance sums' bytes)
        row = report["communication"][kind]
        assert row["measured_bytes"] == pytest.approx(row["optimal_bytes"], rel=2e-3), (kind, row)


@pytest.mark.tpu_aot
@pytest.mark.slow
def test_mixtral_8x7b_compiles_for_256_v5p_chips_with_the_ragged_exchange():
    """Mixtral-8x7B on v5p-512 (256 chips), fsdp=32 x expert=8, a sequence of 4096 tokens per chip,
    MaxText's settings: it fits, the ragged exchange runs out and back in each layer's forward, its
    recomputation and its backward, and every collective kind carries what its formula says (the
    experts' gradients reduced over fsdp only, the other weights' over fsdp x expert, where they
    are stored: the state as the ZeRO table has it)."""
    report = _pod_report("mixtral-8x7b", "v5p-512", "fsdp=32,expert=8", 256, 4096)
    memory = report["memory_per_chip"]
    assert memory["fits"] and memory["peak"] < 0.15 * memory["hbm"]
    assert report["communication"]["ragged-all-to-all"]["count"] == moe.CONFIGS["mixtral-8x7b"].layers * 6
    for kind in ("parameters", "optimizer"):
        assert memory[kind] == pytest.approx(memory["zero_table"][kind], rel=0.01), kind
    print(f"\nmixtral-8x7b v5p-512 fsdp=32,expert=8: peak {memory['peak'] / 1e9:.3f} GB, collectives "
          f"{sum(r['bytes_per_chip'] for r in report['collectives'].values()) / 1e9:.2f} GB per chip")
    _assert_traffic_is_the_formulas(report, ("ragged-all-to-all", "all-to-all", "all-gather", "reduce-scatter", "all-reduce"))


def test_shared_experts_and_sigmoid_group_limited_routing_under_expert_tensor_parallelism(tokens):  # noqa: F811
    # DeepSeek's kind of layer: a shared expert every token goes through (its width over tensor, as
    # a dense MLP's), sigmoid scores, the top 2 from the best 2 of 4 groups
    cfg = dataclasses.replace(TINY, shared_experts=1, score="sigmoid", groups=4, top_groups=2)
    model_fn = lambda rngs: moe.MoE(cfg, rngs=rngs)  # noqa: E731
    assert_same(sharded("expert=2,tensor=2,fsdp=2", model_fn, moe.loss_fn, batches(tokens)), oracle(model_fn, moe.loss_fn, batches(tokens)))


def steered_oracle(cfg, host_batches):
    """One device, DeepSeek-V3's rule written out: the weights trained as the oracle trains them
    (gradient clipped by the norm of the trained weights' gradients alone), and each layer's routing
    bias moved by -rate x sign(copies - mean copies) of the step's batch as routed before the step
    (``MoE.routing_counts``), by no optimizer. (losses, first gradients and norm, final weights)."""
    model_fn = lambda rngs: moe.MoE(cfg, rngs=rngs)  # noqa: E731
    graphdef, state = nnx.split(model_fn(nnx.Rngs(jax.random.key(0))))
    params = initial_weights(model_fn)
    trained = lambda tree: {k: v for k, v in flatten_dict(tree).items() if k != ("layers", "router_bias")}  # noqa: E731
    opt_state = OPTIMIZER.init(trained(params))

    def model(p):
        nnx.replace_by_pure_dict(state, p)
        return nnx.merge(graphdef, state)

    @jax.jit
    def step(p, o, batch):
        loss, grads = jax.value_and_grad(lambda q: moe.loss_fn(model(q), batch))(p)
        norm = optax.tree.norm(trained(grads))
        clipped = jax.tree.map(lambda g: g * jnp.minimum(1.0, CFG.clip_norm / norm), trained(grads))
        updates, o = OPTIMIZER.update(clipped, o, trained(p))
        copies, _ = model(p).routing_counts(batch[:, :-1])
        copies = copies.astype(jnp.float32)
        bias = p["layers"]["router_bias"] - cfg.bias_rate * jnp.sign(copies - copies.mean(-1, keepdims=True))
        new = optax.apply_updates(trained(p), updates) | {("layers", "router_bias"): bias}
        return unflatten_dict(new), o, loss, unflatten_dict(clipped), norm

    losses, first = [], None
    for batch in host_batches:
        params, opt_state, loss, grads, norm = step(params, opt_state, jnp.asarray(batch))
        losses.append(float(loss))
        first = first or (grads, float(norm))
    return losses, first, jax.device_get(params)


@pytest.mark.parametrize("strategy", ["expert=2,tensor=2,fsdp=2", "data=2,expert=2,context=2"])
def test_the_routing_bias_steps_by_its_rule_and_no_optimizer_under_expert_layouts(strategy, tokens):  # noqa: F811
    model_fn = lambda rngs: moe.MoE(STEERED, rngs=rngs)  # noqa: E731
    host = batches(tokens)
    losses, (grads, norm), params = steered_oracle(STEERED, host)
    trainer = Trainer(build_layout(parse_strategy(strategy, 8)), model_fn, moe.loss_fn, CFG, optimizer=OPTIMIZER)
    ours_losses, ours_grads, ours_params = sharded(trainer, model_fn, moe.loss_fn, host)
    np.testing.assert_allclose(ours_losses, losses, rtol=1e-4, atol=1e-5)
    ours_grads = flatten_dict(ours_grads)
    for path, g in flatten_dict(grads).items():  # the trained weights' first (clipped) gradients
        np.testing.assert_allclose(ours_grads[path], g, rtol=1e-4, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), ours_params, params)
    moved = params["layers"]["router_bias"]
    assert np.abs(moved).max() > 0 and set(np.round(np.abs(moved.ravel()) / STEERED.bias_rate, 4)) <= {0.0, 1.0, 2.0, 3.0}
    # the bias holds no optimizer state, and the gradient norm is the trained weights'
    opt_leaves = jax.tree.leaves(trainer.abstract_state().opt_state)
    assert sum(x.size for x in opt_leaves) == sum(x.size for x in jax.tree.leaves(trained_only(params)))  # (momentum: one per weight)
    state = TrainState(*(jax.device_put(x, s) for x, s in zip(
        (initial_weights(model_fn), trainer.optimizer.init(initial_weights(model_fn)), np.int32(0)), trainer.state_shardings)))
    np.testing.assert_allclose(float(trainer.step(state, trainer.put_batch(host[0]))[1]["grad_norm"]), norm, rtol=1e-4)


def trained_only(params):
    return {k: v for k, v in flatten_dict(params).items() if k[-1] != "router_bias"}


def test_a_resume_that_would_route_otherwise_is_refused_naming_what_differs():
    saved = moe._meta(TINY)
    assert moe.changed(TINY, saved, {}) is None
    why = moe.changed(CAPPED, saved, {"capacity_factor": 1.0})
    assert why.startswith("was trained routing with capacity_factor None (now 1.0)") and "--capacity-factor" in why
    why = moe.changed(STEERED, saved, {"bias_rate": 0.01})
    assert why.startswith("was trained without a routing bias, and this run has one") and "--bias-rate 0" in why
    assert moe.changed(dataclasses.replace(STEERED, bias_rate=0.002), moe._meta(STEERED), {}) is None  # another step size: the same weights
    assert moe.FAMILY.saved(TINY, moe._meta(STEERED)).bias_rate == 0.01 and moe.FAMILY.saved(STEERED, {}).bias_rate == 0.0
