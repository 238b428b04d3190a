"""Every layout trains exactly like one device.

The oracle is written here with plain JAX, Flax and optax on one device (no jaxpar step): the same
model and initial weights, the same batches, AdamW with clipping. After 3 steps on 8 simulated
devices, each layout's losses, its first-step gradients and its final weights must equal the
oracle's in float32: |a - b| <= 1e-5 + 1e-4 * |b| elementwise (measured differences are ~1e-7).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxpar.errors import LayoutError
from jaxpar.models import llama
from jaxpar.parallel import build_layout, parse_strategy
from jaxpar.nn import reduce_partial
from jaxpar.train import data
from jaxpar.train.step import TrainConfig, Trainer, make_optimizer

STEPS, BATCH, SEQ = 3, 16, 32
TOL = dict(rtol=1e-4, atol=1e-5)
CFG = TrainConfig(learning_rate=1e-2, warmup_steps=2, total_steps=STEPS, clip_norm=0.5)


def llama_model(rngs):
    return llama.Llama(llama.CONFIGS["tiny"], rngs=rngs)


@pytest.fixture(scope="module")
def tokens():
    return data.corpus_tokens(50_000)


def batches(tokens):
    return [data.batch_at(tokens, step, BATCH, SEQ, seed=0) for step in range(STEPS)]


def oracle(model_fn, loss_fn, host_batches, cfg=CFG):
    """Plain single-device training: (losses, first gradients, final weights)."""
    device = jax.devices()[0]
    with jax.default_device(device), nnx.use_eager_sharding(False):
        model = model_fn(nnx.Rngs(jax.random.key(0)))
        graphdef, state = nnx.split(model)
        params = nnx.to_pure_dict(state)
        optimizer = optax.chain(optax.clip_by_global_norm(cfg.clip_norm), make_optimizer(cfg))
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
            params, opt_state, loss, grads = step(params, opt_state, jnp.asarray(batch))
            losses.append(float(loss))
            first_grads = first_grads or grads
    return losses, jax.device_get(first_grads), jax.device_get(params)


def sharded(strategy, model_fn, loss_fn, host_batches, cfg=CFG):
    layout = build_layout(parse_strategy(strategy, 8))
    trainer = Trainer(layout, model_fn, loss_fn, cfg)
    state = trainer.init(seed=0)
    first = trainer.put_batch(host_batches[0])
    _, _, grads = jax.jit(trainer.grad_fn())(state.params, first)
    grads = jax.device_get(grads)
    losses = []
    for batch in host_batches:
        state, metrics = trainer.step(state, trainer.put_batch(batch))
        losses.append(float(metrics["loss"]))
    return losses, grads, jax.device_get(state.params)


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
    pytest.param("fsdp=8,zero=2", marks=_slow),
    pytest.param("data=2,fsdp=4", marks=_slow),  # HSDP
    pytest.param("data=2,tensor=4", marks=_slow),  # TP
    pytest.param("data=2,tensor=4,sp=on", marks=_slow),  # TP + SP
    pytest.param("fsdp=4,tensor=2", marks=_slow),
    pytest.param("data=2,fsdp=2,tensor=2", marks=_slow),  # HSDP with TP
    "data=2,fsdp=2,tensor=2,sp=on",
    pytest.param("fsdp=8,regather=on", marks=_slow),
    "fsdp=8,param_shards=4",  # hierarchical ZeRO: weights in groups of 4, the rest over 8
    "tensor=8",  # TP above the 4 key/value heads: they are kept whole on every device
]


@pytest.mark.parametrize("strategy", LAYOUTS)
def test_llama_layout_matches_one_device(strategy, tokens, llama_oracle):
    assert_same(sharded(strategy, llama_model, llama.loss_fn, batches(tokens)), llama_oracle)


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
    with pytest.raises(LayoutError, match=r"\['tensor'\].*reduce_partial"):
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
