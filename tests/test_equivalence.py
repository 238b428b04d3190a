"""Every layout trains exactly like one device.

The oracle is written here with plain JAX, Flax and optax on one device (no jaxpar step): the same
model and initial weights, the same batches, clipping and SGD with momentum. After 3 steps on 8
simulated devices, each layout's losses, its first-step gradients and its final weights must equal
the oracle's in float32: |a - b| <= 1e-5 + 1e-4 * |b| elementwise (measured differences are ~1e-7).
The first step moves each weight by exactly -LEARNING_RATE x its clipped gradient, so the gradients
are read from that move: one compiled program per layout. (Each layout starts from the oracle's
initial weights, put into its shardings; that the layout's own initialiser gives the same weights
is tested once, below. AdamW's sharded state is measured in test_analysis_report.)
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxpar import rules
from jaxpar.errors import LayoutError
from jaxpar.models import llama
from jaxpar.parallel import build_layout, parse_strategy
from jaxpar.nn import reduce_partial
from jaxpar.train import data
from jaxpar.train.step import TrainConfig, Trainer, TrainState

STEPS, BATCH, SEQ = 3, 16, 32
LEARNING_RATE = 0.1
OPTIMIZER = optax.sgd(LEARNING_RATE, momentum=0.9)
TOL = dict(rtol=1e-4, atol=1e-5)
CFG = TrainConfig(learning_rate=1e-2, warmup_steps=2, total_steps=STEPS, clip_norm=0.5)


def llama_model(rngs):
    return llama.Llama(llama.CONFIGS["tiny"], rngs=rngs)


@pytest.fixture(scope="module")
def tokens():
    return data.corpus_tokens(50_000)


def batches(tokens):
    return [data.batch_at(tokens, step, BATCH, SEQ, seed=0) for step in range(STEPS)]


@functools.cache
def initial_weights(model_fn):
    """The model's initial weights made on one device, on the host."""
    with jax.default_device(jax.devices()[0]), nnx.use_eager_sharding(False):
        return jax.device_get(nnx.to_pure_dict(nnx.state(model_fn(nnx.Rngs(jax.random.key(0))))))


def oracle(model_fn, loss_fn, host_batches, cfg=CFG):
    """Plain single-device training: (losses, first gradients, final weights)."""
    device = jax.devices()[0]
    with jax.default_device(device), nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(model_fn(nnx.Rngs(jax.random.key(0))))
        params = initial_weights(model_fn)
        optimizer = optax.chain(optax.clip_by_global_norm(cfg.clip_norm), OPTIMIZER)
        opt_state = optimizer.init(params)

        def loss_of(p, batch):
            nnx.replace_by_pure_dict(state, p)
            return loss_fn(nnx.merge(graphdef, state), batch)

        @jax.jit
        def step(p, o, batch):
            loss, grads = jax.value_and_grad(loss_of)(p, batch)
            clipped, _ = optax.clip_by_global_norm(cfg.clip_norm).update(grads, optax.EmptyState())
            updates, o = optimizer.update(grads, o, p)
            return optax.apply_updates(p, updates), o, loss, clipped

        losses, first_grads = [], None
        for batch in host_batches:
            params, opt_state, loss, grads = step(params, opt_state, jax.tree.map(jnp.asarray, batch))
            losses.append(float(loss))
            first_grads = first_grads or grads
    return losses, jax.device_get(first_grads), jax.device_get(params)


def sharded(strategy, model_fn, loss_fn, host_batches, cfg=CFG):
    """The layout's training from the oracle's initial weights: (losses, first gradients, final weights).
    ``strategy``: a strategy string, or a Trainer made with OPTIMIZER (whose compiled step a test reads after)."""
    if isinstance(strategy, Trainer):
        trainer = strategy
    else:
        trainer = Trainer(build_layout(parse_strategy(strategy, 8)), model_fn, loss_fn, cfg, optimizer=OPTIMIZER)
    start, shardings = initial_weights(model_fn), trainer.state_shardings
    # (the trainer's optimizer: OPTIMIZER, leaving any nn.RuleUpdated weight to its rule)
    state = TrainState(jax.device_put(start, shardings.params), jax.device_put(trainer.optimizer.init(start), shardings.opt_state),
                       jax.device_put(np.int32(0), shardings.step))
    losses, after = [], []
    for batch in host_batches:
        state, metrics = trainer.step(state, trainer.put_batch(batch))
        losses.append(float(metrics["loss"]))
        after.append(jax.device_get(state.params))
    grads = jax.tree.map(lambda before, moved: (before - moved) / LEARNING_RATE, start, after[0])
    return losses, grads, after[-1]


def assert_same(ours, reference):
    losses, grads, params = ours
    ref_losses, ref_grads, ref_params = reference
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), grads, ref_grads)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), params, ref_params)


@pytest.fixture(scope="module")
def llama_oracle(tokens):
    return oracle(llama_model, llama.loss_fn, batches(tokens))


_slow = pytest.mark.slow  # still run by the README's test command; left out of `-m "not slow"`
LAYOUTS = [
    pytest.param("data=8", marks=_slow),  # DP
    "fsdp=8",  # FSDP = ZeRO-3
    pytest.param("fsdp=8,zero=1", marks=_slow),
    # (fsdp=8,zero=2: with 2 micro-batches, in test_gradient_accumulation_matches_one_device)
    pytest.param("data=2,fsdp=4", marks=_slow),  # HSDP
    # (TP alone: in tensor=8, fsdp=4,tensor=2 and data=2,fsdp=2,tensor=2)
    # (TP + SP, data=2,tensor=4,sp=on: in test_collective_matmul, next to its collective matmul)
    pytest.param("fsdp=4,tensor=2", marks=_slow),
    pytest.param("data=2,fsdp=2,tensor=2", marks=_slow),  # HSDP with TP
    # data=2,fsdp=2,tensor=2,sp=on and fsdp=8,regather=on: with remat, in test_remat_policies_match_one_device
    "fsdp=8,param_shards=4",  # hierarchical ZeRO: weights in groups of 4, the rest over 8
    "tensor=8",  # TP above the 4 key/value heads: they are kept whole on every device
]


@pytest.mark.parametrize("strategy", LAYOUTS)
def test_llama_layout_matches_one_device(strategy, tokens, llama_oracle):
    assert_same(sharded(strategy, llama_model, llama.loss_fn, batches(tokens)), llama_oracle)


def test_initial_weights_are_the_same_on_every_layout():
    # each layout's compiled initialiser writes straight into its shards: bit for bit the values of
    # the same initialiser on one device, and within float32 rounding of the model made eagerly
    # (compiled, XLA fuses the initialisers' scaling: measured 1 ulp apart)
    def init(strategy, devices):
        layout = build_layout(parse_strategy(strategy, len(devices)), devices)
        return jax.device_get(Trainer(layout, llama_model, llama.loss_fn, CFG).init(seed=0).params)

    one = init("data=1", jax.devices()[:1])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), one, initial_weights(llama_model))
    for strategy in ("fsdp=8,param_shards=4", "data=2,tensor=4,sp=on"):
        jax.tree.map(np.testing.assert_array_equal, init(strategy, jax.devices()), one)


@pytest.mark.slow
def test_gradient_accumulation_matches_one_device(tokens):
    # 2 micro-batches per step: ZeRO-2 reduce-scatters each one, the oracle accumulates on one device
    cfg = dataclasses.replace(CFG, microbatches=2)
    assert_same(
        sharded("fsdp=8,zero=2", llama_model, llama.loss_fn, batches(tokens), cfg),
        oracle(llama_model, llama.loss_fn, batches(tokens), cfg),
    )


# --- a model written here, not from jaxpar.models -------------------------------------------


class Regressor(nnx.Module):
    """A two-layer MLP annotated with logical names only."""

    def __init__(self, rngs):
        named = lambda names: nnx.with_partitioning(nnx.initializers.lecun_normal(), names)  # noqa: E731
        self.up = nnx.Linear(16, 64, kernel_init=named(("embed", "mlp")), use_bias=False, rngs=rngs)
        self.down = nnx.Linear(64, 16, kernel_init=named(("mlp", "embed")), use_bias=False, rngs=rngs)
        self.scale = nnx.Param(nnx.with_partitioning(nnx.initializers.ones, ("embed",))(rngs.params(), (16,)))

    def __call__(self, x):
        hidden = jax.nn.gelu(self.up(x))
        # the down projection sums over the hidden width: under TP that sum spans devices
        return reduce_partial(self.down(hidden), ("mlp",), ("batch", "embed")) * self.scale[...]


def regression_loss(model, batch):
    return jnp.mean((model(batch[:, :16]) - batch[:, 16:]) ** 2)


def regression_batches():
    rng = np.random.default_rng(0)
    return [rng.standard_normal((16, 32)).astype(np.float32) for _ in range(STEPS)]


@pytest.mark.parametrize("strategy", ["data=8", "fsdp=8", "data=2,fsdp=4", "fsdp=4,tensor=2", "fsdp=8,zero=1"])
def test_own_nnx_model_matches_one_device(strategy):
    reference = oracle(Regressor, regression_loss, regression_batches())
    assert_same(sharded(strategy, Regressor, regression_loss, regression_batches()), reference)


class ForgetsTheSum(Regressor):
    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x))) * self.scale[...]  # no reduce_partial


def test_model_without_jaxpar_calls_takes_the_gspmd_path_exactly():
    # the same model with no reduce_partial (no jaxpar call at all): XLA's partitioner finishes the sum
    reference = oracle(Regressor, regression_loss, regression_batches())
    assert_same(sharded("fsdp=4,tensor=2", ForgetsTheSum, regression_loss, regression_batches()), reference)


def test_manual_path_refuses_a_forgotten_tensor_parallel_sum():
    cfg = dataclasses.replace(CFG, path="manual")
    trainer = Trainer(build_layout(parse_strategy("fsdp=4,tensor=2", 8)), ForgetsTheSum, regression_loss, cfg)
    state = trainer.init(seed=0)
    with pytest.raises(LayoutError, match=r"unfinished partial sum: dot_general at .*test_equivalence.py.*'tensor'.*reduce_partial"):
        trainer.step(state, trainer.put_batch(regression_batches()[0]))


@pytest.mark.slow
def test_tied_embeddings_match_one_device(tokens):
    model_fn = lambda rngs: llama.Llama(dataclasses.replace(llama.CONFIGS["tiny"], tie_embeddings=True), rngs=rngs)  # noqa: E731
    assert_same(sharded("fsdp=4,tensor=2", model_fn, llama.loss_fn, batches(tokens)), oracle(model_fn, llama.loss_fn, batches(tokens)))


@pytest.mark.slow
@pytest.mark.parametrize("strategy, remat", [("data=2,fsdp=2,tensor=2,sp=on", "full"), ("fsdp=8,regather=on", "dots")])
def test_remat_policies_match_one_device(strategy, remat, tokens, llama_oracle):
    # the step checkpoints the Llama's layer scan (train/remat.py): the same numbers as no remat
    cfg = dataclasses.replace(CFG, remat=remat)
    assert_same(sharded(strategy, llama_model, llama.loss_fn, batches(tokens), cfg), llama_oracle)


@pytest.mark.slow
def test_bf16_compute_stays_close_to_fp32(tokens, llama_oracle):
    # bf16 matmuls with float32 master weights and float32 gradient sums: losses within 1%
    cfg = dataclasses.replace(CFG, compute_dtype="bfloat16")
    losses, _, _ = sharded("fsdp=4,tensor=2", llama_model, llama.loss_fn, batches(tokens), cfg)
    np.testing.assert_allclose(losses, llama_oracle[0], rtol=1e-2)


def test_bf16_reduction_casts_the_layer_stacks_once_and_changes_no_number(tokens, monkeypatch):
    # Compute and gradient reduction both in bf16: the stacked layer weights are cast once before
    # the layer loop (rules._narrow_stack), so the backward loop stacks each layer's gradient in
    # bf16, as its reduce-scatter made it, instead of in float32. The oracle is the same step with
    # each layer cast inside the loop: bitwise the same numbers, in less memory.
    cfg = dataclasses.replace(CFG, compute_dtype="bfloat16", grad_reduce_dtype="bfloat16")

    def run():  # one step of the compiled program whose memory is read
        trainer = Trainer(build_layout(parse_strategy("fsdp=8", 8)), llama_model, llama.loss_fn, cfg, optimizer=OPTIMIZER)
        batch = trainer.put_batch(batches(tokens)[0])
        step = trainer.jit_step(batch).lower(trainer.abstract_state(), batch).compile()
        start, shardings = initial_weights(llama_model), trainer.state_shardings
        state = TrainState(jax.device_put(start, shardings.params), jax.device_put(OPTIMIZER.init(start), shardings.opt_state),
                           jax.device_put(np.int32(0), shardings.step))
        state, metrics = step(state, batch)
        return jax.device_get((metrics["loss"], state.params)), step.memory_analysis().temp_size_in_bytes

    narrowed, narrowed_temps = run()
    monkeypatch.setattr(rules, "_narrow_stack", lambda *args: False)
    per_layer, per_layer_temps = run()
    jax.tree.map(np.testing.assert_array_equal, narrowed, per_layer)
    assert narrowed_temps < per_layer_temps
