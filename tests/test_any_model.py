"""Any Flax NNX model trains under every layout: a transformer written here the way a plain Flax
user writes one (nnx.Linear, nnx.Embed, nnx.RMSNorm, tied embeddings, jax.nn.dot_product_attention,
an optax loss, out_sharding on one activation, no jaxpar import) takes jaxpar's GSPMD path and equals
one device; its variant with layers stacked by nnx.vmap / nnx.scan gathers one layer at a time."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar.analysis import hlo, traffic
from jaxpar.errors import JaxparError, LayoutError, NonFiniteStep
from jaxpar.parallel import build_layout, parse_strategy
from jaxpar.train.step import TrainConfig, Trainer, TrainState

# --- the user's model (nothing below imports jaxpar) -----------------------------------------

init = nnx.initializers.normal(0.02)
# an activation with its batch dim split over every axis jaxpar splits batches over (documented;
# degree-1 axes included, so the model is the same under every layout)
BATCH_SPLIT = P(("data", "fsdp_group", "fsdp"), None, None)
part = nnx.with_partitioning


class Block(nnx.Module):
    def __init__(self, d, heads, hidden, rngs, out_sharding=False):
        self.heads, self.out_sharding = heads, out_sharding
        self.norm1 = nnx.RMSNorm(d, scale_init=part(nnx.initializers.ones, ("embed",)), rngs=rngs)
        self.q = nnx.Linear(d, d, use_bias=False, kernel_init=part(init, ("embed", "heads")), rngs=rngs)
        self.kv = nnx.Linear(d, 2 * d, use_bias=False, kernel_init=part(init, ("embed", "heads")), rngs=rngs)
        self.o = nnx.Linear(d, d, use_bias=False, kernel_init=part(init, ("heads", "embed")), rngs=rngs)
        self.norm2 = nnx.RMSNorm(d, scale_init=part(nnx.initializers.ones, ("embed",)), rngs=rngs)
        self.up = nnx.Linear(d, hidden, kernel_init=part(init, ("embed", "hidden")),
                             bias_init=part(nnx.initializers.zeros, ("hidden",)), rngs=rngs)
        self.down = nnx.Linear(hidden, d, use_bias=False, kernel_init=part(init, ("hidden", "embed")), rngs=rngs)

    def __call__(self, x):
        b, length, d = x.shape
        h = self.norm1(x)
        q = self.q(h).reshape(b, length, self.heads, d // self.heads)
        k, v = (t.reshape(b, length, self.heads, d // self.heads) for t in jnp.split(self.kv(h), 2, axis=-1))
        attended = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, length, d)
        # JAX's explicit-sharding style: the projection says how its output is laid out
        x = x + (self.o(attended, out_sharding=BATCH_SPLIT) if self.out_sharding else self.o(attended))
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class UserModel(nnx.Module):
    def __init__(self, vocab=64, d=32, heads=4, hidden=64, layers=2, stacked=False, out_sharding=True, tied=True, *, rngs):
        self.stacked, self.out_sharding = stacked, out_sharding
        self.embed = nnx.Embed(vocab, d, embedding_init=part(init, ("vocab", "embed")), rngs=rngs)
        self.head = None if tied else nnx.Linear(d, vocab, use_bias=False, kernel_init=part(init, ("embed", "vocab")), rngs=rngs)
        if stacked:
            @nnx.split_rngs(splits=layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make(rngs):
                return Block(d, heads, hidden, rngs, out_sharding)

            self.blocks = make(rngs)
        else:
            self.blocks = nnx.List([Block(d, heads, hidden, rngs, out_sharding) for _ in range(layers)])
        self.norm = nnx.RMSNorm(d, scale_init=part(nnx.initializers.ones, ("embed",)), rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens, out_sharding=BATCH_SPLIT) if self.out_sharding else self.embed(tokens)
        if self.stacked:
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def run(x, block):
                return block(x)

            x = run(x, self.blocks)
        else:
            for block in self.blocks:
                x = block(x)
        return self.embed.attend(self.norm(x)) if self.head is None else self.head(self.norm(x))  # tied embeddings, or a head


def user_loss(model, tokens):
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

# --- the user's rules: its own logical name mapped onto jaxpar's ------------------------------


ALIASES = {"hidden": "mlp"}
LAYOUTS = ["data=8", "fsdp=8", "data=2,fsdp=4", "data=2,tensor=4", "fsdp=4,tensor=2", "data=2,fsdp=2,tensor=2"]
CFG = TrainConfig(donate=False)
LEARNING_RATE = 0.5
# plain SGD with momentum: the first step moves each weight by exactly -LEARNING_RATE x its
# (clipped) gradient, so one compiled step per layout yields the gradients too
OPTIMIZER = optax.sgd(LEARNING_RATE, momentum=0.9)
STEPS = 3


def train(spec, n, cfg=CFG, **model_kw):
    """(trainer, losses, first-step gradients, parameters after STEPS steps). The initial state is
    the one-device initialisation placed into this layout (same values on any layout)."""
    layout = build_layout(parse_strategy(spec, n), jax.devices()[:n], aliases=ALIASES)
    trainer = Trainer(layout, lambda rngs: UserModel(rngs=rngs, **model_kw), user_loss, cfg, optimizer=OPTIMIZER)
    start = initial_params(**model_kw)
    shardings = trainer.state_shardings
    state = TrainState(jax.device_put(start, shardings.params), jax.device_put(OPTIMIZER.init(start), shardings.opt_state),
                       jax.device_put(np.int32(0), shardings.step))
    batch = trainer.put_batch(np.asarray(jax.random.randint(jax.random.key(1), (8, 17), 0, 64)))
    losses, params = [], []
    for _ in range(STEPS):
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
        params.append(jax.tree.map(np.asarray, state.params))
    grads = jax.tree.map(lambda before, after: (before - after) / LEARNING_RATE, start, params[0])
    return trainer, np.array(losses), grads, params[-1]


@functools.cache
def reference(**model_kw):
    return train("data=1", 1, **model_kw)


@functools.cache
def initial_params(**model_kw):
    layout = build_layout(parse_strategy("data=1", 1), jax.devices()[:1], aliases=ALIASES)
    trainer = Trainer(layout, lambda rngs: UserModel(rngs=rngs, **model_kw), user_loss, CFG, optimizer=OPTIMIZER)
    return jax.tree.map(np.asarray, trainer.init(seed=0).params)


def assert_equal_to_one_device(got, want, start):
    """fp32; partitioned sums add in another order: losses to 1e-5, gradients and parameters to
    1e-5 of each array's largest entry (gradients read from the first step's change, plus the two
    ulps by which that subtraction may round)."""
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5)
    want_grads, want_params, starts = (dict(jax.tree_util.tree_leaves_with_path(t)) for t in (want[2], want[3], start))
    for tree_got, tree_want, rounding in ((got[2], want_grads, 2.0**-22 / LEARNING_RATE), (got[3], want_params, 0.0)):
        for path, a in jax.tree_util.tree_leaves_with_path(tree_got):
            b = tree_want[path]
            bound = 1e-5 * max(np.max(np.abs(b)), 1e-6) + rounding * np.max(np.abs(starts[path]))
            assert np.max(np.abs(a - b)) <= bound, (jax.tree_util.keystr(path), np.max(np.abs(a - b)), bound)


def test_the_step_is_no_bigger_than_plain_jit_with_the_same_shardings():
    # the user's model (its own head, no activation constraint), compiled by jaxpar and by plain
    # jax.jit with the same weight, optimizer and batch shardings: jaxpar's temporaries and
    # collective bytes are at most jit's on every layout (it lays each weight out for compute where
    # it is used, so the batch stays split; jit alone splits the activations by embed under FSDP),
    # and its report's ratios are 1.0 where the formula knows the traffic (the weights' gathers and
    # reductions: derived from the model's own weights) and say "no formula" where it does not
    # (the activations' collectives under tensor parallelism)
    for spec in ("data=8", "fsdp=8", "data=2,fsdp=4", "fsdp=4,tensor=2", "fsdp=8,param_shards=4"):
        strategy = parse_strategy(spec, 8)
        layout = build_layout(strategy, jax.devices(), aliases=ALIASES)
        trainer = Trainer(layout, lambda rngs: UserModel(rngs=rngs, out_sharding=False, tied=False), user_loss, CFG, optimizer=OPTIMIZER)
        state = trainer.init(seed=0)
        batch = trainer.put_batch(np.asarray(jax.random.randint(jax.random.key(1), (8, 17), 0, 64)))
        ours = trainer.jit_step(batch).lower(state, batch).compile()

        def plain_step(params, opt_state, tokens, graphdef=trainer.graphdef, trainer=trainer):
            loss, grads = jax.value_and_grad(lambda p: user_loss(nnx.merge(graphdef, trainer._with_values(p)), tokens))(params)
            updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        shardings = trainer.state_shardings
        plain = jax.jit(plain_step, in_shardings=(shardings.params, shardings.opt_state, batch.sharding),
                        out_shardings=(shardings.params, shardings.opt_state, None)).lower(state.params, state.opt_state, batch).compile()
        programs = {"jaxpar": ours, "jit": plain}
        temporaries = {name: c.memory_analysis().temp_size_in_bytes for name, c in programs.items()}
        sent = {name: sum(x.bytes_per_step for x in hlo.collectives(c.as_text(), layout.mesh)) for name, c in programs.items()}
        assert temporaries["jaxpar"] <= temporaries["jit"], (spec, temporaries)
        assert sent["jaxpar"] <= sent["jit"], (spec, sent)
        report = traffic.compare(ours.as_text(), trainer, strategy, (8, 17))
        rows = {kind: row for kind, row in report.items() if "ratio" in row}
        unknown = {kind for kind, row in rows.items() if row["ratio"] is None}
        assert all("no_formula" in rows[kind] for kind in unknown), rows
        assert ("all-reduce" in unknown and unknown <= {"all-reduce", "all-to-all", "collective-permute", "all-gather"}
                if "tensor" in spec else not unknown), (spec, rows)
        assert all(row["ratio"] == pytest.approx(1.0, abs=0.02) for kind, row in rows.items() if kind not in unknown), (spec, rows)


@pytest.mark.parametrize("spec", LAYOUTS)
def test_plain_flax_model_equals_one_device(spec):
    got = train(spec, 8)
    assert got[0].plan.path == "gspmd" and "out_sharding" in got[0].plan.path_reason
    assert_equal_to_one_device(got, reference(), initial_params())


# hierarchical ZeRO too (weights sharded in groups of 4, gradients and optimizer state over all 8)
@pytest.mark.parametrize("spec", LAYOUTS + ["fsdp=8,param_shards=4"])
def test_stacked_plain_flax_model_equals_one_device(spec):
    got = train(spec, 8, stacked=True, out_sharding=False)
    assert got[0].plan.path == "gspmd"
    assert_equal_to_one_device(got, reference(stacked=True, out_sharding=False), initial_params(stacked=True, out_sharding=False))


def test_stacked_plain_flax_model_runs_as_a_pipeline():
    # no pipeline code in the model: the step cuts its traced loss at the nnx.scan over its layers
    # (one layer per stage here), on jaxpar's manual path; 2 micro-batches of 4 rows
    got = train("stage=2,fsdp=4", 8, dataclasses.replace(CFG, microbatches=2), stacked=True, out_sharding=False)
    assert got[0].plan.path == "manual" and "pipelines" in got[0].plan.path_reason
    assert_equal_to_one_device(got, reference(stacked=True, out_sharding=False), initial_params(stacked=True, out_sharding=False))


def test_a_pipeline_refuses_a_loss_that_reads_the_layer_stack_outside_the_loop():
    # a stage holds only its chunk of the layers: a penalty over all of them, outside the model's
    # own scan, would silently cover one chunk
    def penalised(model, tokens):
        return user_loss(model, tokens) + 1e-3 * jnp.sum(model.blocks.down.kernel[...] ** 2)

    layout = build_layout(parse_strategy("stage=2,fsdp=4", 8), aliases=ALIASES)
    trainer = Trainer(layout, lambda rngs: UserModel(rngs=rngs, stacked=True, out_sharding=False), penalised,
                      dataclasses.replace(CFG, microbatches=2), optimizer=OPTIMIZER)
    batch = trainer.abstract_batch(8, 16)
    with pytest.raises(LayoutError, match="outside its layer scan"):
        trainer.jit_step(batch).lower(trainer.abstract_state(), batch)


def test_stacked_layers_are_gathered_one_at_a_time():
    trainer = train("fsdp=8", 8, stacked=True, out_sharding=False)[0]
    text = trainer._step.lower(trainer.abstract_state(), trainer.abstract_batch(8, 16)).compile().as_text()
    gathers = [c for c in hlo.collectives(text, trainer.layout.mesh) if c.kind == "all-gather"]
    # each layer's weights are gathered inside the compiled layer loop: executed once per layer
    assert any(c.executions == 2 for c in gathers), [(c.executions, c.operand_bytes) for c in gathers]


def test_check_passes_on_the_gspmd_path():
    # Trainer.check on a model with no jaxpar call: its layout's gradients against one device
    layout = build_layout(parse_strategy("data=2,fsdp=2,tensor=2", 8), aliases=ALIASES)
    trainer = Trainer(layout, lambda rngs: UserModel(rngs=rngs), user_loss, CFG, optimizer=OPTIMIZER)
    report = trainer.check(np.asarray(jax.random.randint(jax.random.key(1), (8, 17), 0, 64)))
    assert report.path == "gspmd" and report.ok and not report.failed, report.format()
    assert len(report.weights) == len(jax.tree.leaves(trainer.abstract_state().params))


def test_the_framework_recomputes_each_layer_of_a_stacked_model():
    # remat=full: jaxpar checkpoints each iteration of the model's own nnx.scan, so the step keeps
    # less for the backward pass (compiled memory analysis) and computes the same gradient. (One
    # device: the checkpoint is placed the same way under any layout; test_equivalence runs it sharded.)
    model_fn = lambda rngs: UserModel(rngs=rngs, stacked=True, out_sharding=False)  # noqa: E731
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (8, 65), 0, 64))
    temp, norm = {}, {}
    for remat in ("none", "full"):
        layout = build_layout(parse_strategy("data=1", 1), jax.devices()[:1], aliases=ALIASES)
        trainer = Trainer(layout, model_fn, user_loss, dataclasses.replace(CFG, remat=remat), optimizer=OPTIMIZER)
        state, batch = trainer.init(seed=0), trainer.put_batch(tokens)
        compiled = trainer.jit_step(batch).lower(state, batch).compile()
        temp[remat] = compiled.memory_analysis().temp_size_in_bytes
        norm[remat] = float(compiled(state, batch)[1]["grad_norm"])
    print(f"temporaries: remat=full {temp['full']:,} bytes, none {temp['none']:,}")
    assert trainer.plan.path == "gspmd" and temp["full"] < 0.7 * temp["none"], temp
    assert norm["full"] == pytest.approx(norm["none"], rel=1e-6)


def test_a_non_finite_step_raises_naming_it_and_keeps_the_state():
    poisoned = lambda model, tokens: user_loss(model, tokens) * jnp.where(tokens[0, 0] >= 0, jnp.nan, 1.0)  # noqa: E731
    layout = build_layout(parse_strategy("fsdp=8", 8), aliases=ALIASES)
    trainer = Trainer(layout, lambda rngs: UserModel(rngs=rngs, out_sharding=False), poisoned, CFG, optimizer=OPTIMIZER)
    state = trainer.init(seed=0)
    before = jax.tree.map(np.asarray, state.params)
    with pytest.raises(NonFiniteStep, match="non-finite (loss|gradient) at step 1 ") as caught:
        trainer.step(state, trainer.put_batch(np.ones((8, 17), np.int32)))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, caught.value.state.params), before)


def test_regather_auto_keeps_the_gathered_weights_on_the_gspmd_path():
    # memory so small that regather=auto would gather again; the GSPMD path cannot, and says so
    layout = build_layout(parse_strategy("fsdp=8", 8), aliases=ALIASES)
    tight = dataclasses.replace(CFG, memory_bytes=2**18)
    trainer = Trainer(layout, lambda rngs: UserModel(rngs=rngs, stacked=True, out_sharding=False), user_loss, tight, optimizer=OPTIMIZER)
    assert trainer.plan.regather, trainer.plan.regather_reason
    batch = trainer.abstract_batch(8, 16)
    trainer.jit_step(batch).lower(trainer.abstract_state(), batch)  # the first trace chooses the path
    assert trainer.plan.path == "gspmd" and not trainer.plan.regather
    assert "the GSPMD path cannot gather again, so they are kept" in trainer.plan.regather_reason


# --- options the GSPMD path cannot apply are refused, not silently dropped (issue 27) ------------


@pytest.mark.parametrize("spec, refused", [
    ("data=2,tensor=4,sp=on", r"sequence parallelism \(sp=on\) needs jaxpar's manual step"),
    ("data=2,tensor=4,sp=on,tp_overlap=on", r"sequence parallelism \(sp=on\) and collective matmul \(tp_overlap=on\) needs"),
])
def test_sequence_parallelism_and_collective_matmul_are_refused_on_the_gspmd_path(spec, refused):
    # both act where a model calls jaxpar.nn.enter_block and reduce_partial: a plain Flax model would
    # compile to the same program as without them. Refused by the trace that chooses the path (no compile)
    layout = build_layout(parse_strategy(spec, 8), aliases=ALIASES)
    trainer = Trainer(layout, lambda rngs: UserModel(rngs=rngs, out_sharding=False), user_loss, CFG, optimizer=OPTIMIZER)
    with pytest.raises(LayoutError, match=refused + r".*the model makes no jaxpar call"):
        trainer.choose_path(trainer.abstract_state().params, trainer.abstract_batch(8, 16))


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_is_refused_for_a_model_without_a_layer_loop(remat):
    # the policy goes on the scans over stacked layers (test_the_framework_recomputes_each_layer_of_a_stacked_model):
    # layers in a Python list have none, and the step would be the same program. Refused as the Trainer is built
    layout = build_layout(parse_strategy("fsdp=8", 8), aliases=ALIASES)
    with pytest.raises(JaxparError, match=f"remat={remat} recomputes each iteration of the model's layer loop.*no stacked layer weights"):
        Trainer(layout, lambda rngs: UserModel(rngs=rngs), user_loss, dataclasses.replace(CFG, remat=remat), optimizer=OPTIMIZER)


def test_check_blames_a_non_finite_batch_not_the_layout():
    # token 64 is past the vocabulary: nnx.Embed's lookup fills NaN for it, in the one row (one
    # device's shard under fsdp=2) that holds it; one device computes NaN too, so no weight is blamed
    tokens = np.array(jax.random.randint(jax.random.key(1), (8, 17), 0, 64))
    tokens[5, 3] = 64
    layout = build_layout(parse_strategy("fsdp=2", 2), jax.devices()[:2], aliases=ALIASES)
    trainer = Trainer(layout, lambda rngs: UserModel(rngs=rngs, out_sharding=False), user_loss, CFG, optimizer=OPTIMIZER)
    report = trainer.check(tokens)
    assert not report.ok and not report.reference_finite and report.failed == []
    assert "the batch or the loss is non-finite (NaN or inf in the batch" in report.format()
    assert "not the layout" in report.format() and "does not compute what one device computes" not in report.format()
