"""Context parallelism (parallel/context.py, collectives/context_attention.py): the sequence split
over devices, attention across the split by a ring, an all-to-all or both.

Every layout trains like one device: the oracle and the comparison are test_equivalence's (3 steps,
SGD with momentum, losses, first-step gradients and final weights within |a - b| <= 1e-5 + 1e-4 |b|
in float32; measured differences ~1e-6). The op itself is compared with the naive attention on the
whole sequence (values and gradients within 1e-5 of the largest entry). Traffic is read from the
compiled HLO and compared with the formulas written out here.
"""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar import attention as A
from jaxpar.analysis import hlo
from jaxpar.parallel.context import split_attention as context_attention
from jaxpar.errors import LayoutError, SpecError
from jaxpar.models import llama
from jaxpar.parallel import build_layout, parse_strategy
from jaxpar.rules import use_layout
from jaxpar.train.step import Trainer
from tests.test_equivalence import BATCH, CFG, OPTIMIZER, SEQ, assert_same, batches, llama_model, oracle, sharded, tokens  # noqa: F401 (tokens: a fixture)

TINY = llama.CONFIGS["tiny"]


@pytest.fixture(scope="module")
def llama_oracle(tokens):  # noqa: F811
    return oracle(llama_model, llama.loss_fn, batches(tokens))


LAYOUTS = [
    "context=8",  # ring over 8 devices (hybrid over 8: in the traffic test below)
    "context=2,fsdp=4,context_algorithm=all-to-all",  # (the ring with fsdp=4: the plain-Flax model below)
    "context=2,tensor=2,fsdp=2,context_algorithm=all-to-all",  # (the ring's K/V are whatever heads a device holds)
]


@pytest.mark.parametrize("strategy", LAYOUTS)
def test_context_layout_matches_one_device(strategy, tokens, llama_oracle):  # noqa: F811
    assert_same(sharded(strategy, llama_model, llama.loss_fn, batches(tokens)), llama_oracle)


def test_context_under_a_pipeline_matches_one_device(tokens, llama_oracle):  # noqa: F811
    # 1F1B over 2 stages with 2 micro-batches; the oracle's mean over the whole batch is the same loss
    cfg = dataclasses.replace(CFG, microbatches=2)
    assert_same(sharded("stage=2,context=2,fsdp=2,context_algorithm=all-to-all", llama_model, llama.loss_fn, batches(tokens), cfg),
                llama_oracle)


def test_hybrid_matches_one_device_and_its_ring_and_all_to_all_bytes_equal_their_formulas(tokens, llama_oracle):  # noqa: F811
    # the all-to-all in pairs (U = 2), the ring across 4 groups (R = 4)
    ring, a2a = 4, 2
    trainer = Trainer(build_layout(parse_strategy("context=8,context_algorithm=hybrid,a2a=2", 8)), llama_model, llama.loss_fn, CFG,
                      optimizer=OPTIMIZER)
    assert_same(sharded(trainer, llama_model, llama.loss_fn, batches(tokens)), llama_oracle)
    example = trainer.abstract_batch(BATCH, SEQ)
    text = trainer._step.lower(trainer.abstract_state(), example).compile().as_text()  # the program that ran
    by_axes = hlo.by_axes(hlo.collectives(text, trainer.layout.mesh))
    sent = lambda kind, axis: by_axes[(kind, (axis,))]["bytes_per_device"]  # noqa: E731
    # one layer's K/V for this device's rows (all 16: the batch is not split) over the whole
    # sequence, for the kv heads it holds after the all-to-all (float32)
    kv = BATCH * SEQ * (TINY.kv_heads // a2a) * TINY.head_dim * 2 * 4
    # forward (R-1)/R of it; backward the same again, plus the float32 K/V gradients, R hops of 1/R
    assert sent("collective-permute", "context") == pytest.approx(TINY.layers * (2 * (ring - 1) / ring * kv + kv), rel=1e-6)
    # all-to-all: q, k, v and the output forward, their cotangents backward, (U-1)/U of each local share
    local = BATCH * SEQ // (ring * a2a) * TINY.head_dim * 4
    per_layer = 2 * (a2a - 1) / a2a * (2 * TINY.heads + 2 * TINY.kv_heads) * local
    assert sent("all-to-all", "context_a2a") == pytest.approx(TINY.layers * per_layer, rel=1e-6)


def test_zigzag_gives_every_rank_the_same_causal_work():
    # per-rank query-key pairs of the ring's schedule, counted in blocks of the kernel
    length, ring, block = 4096, 8, 64
    zigzag = context_attention.rank_work(A.CAUSAL, length, ring, block=block)
    contiguous = context_attention.rank_work(A.CAUSAL, length, ring, block=block, zigzag=False)
    assert zigzag.max() - zigzag.min() <= block * block  # equal within one block (here exactly equal)
    assert contiguous.max() / contiguous.min() > 8  # the last rank sees every key, the first only its own
    assert zigzag.sum() <= contiguous.sum()  # and no more work in all


def _op_on_layout(strategy, mask_of, q, k, v, segments):
    """The op on a layout's positions (the batch's sequence permuted as the step does), mapped
    back to the natural order: (output, gradients of a weighted sum)."""
    layout = build_layout(parse_strategy(strategy, 8))
    ring = math.prod(layout.mesh.shape[a] for a in layout.role(context_attention.RING))
    order = context_attention.sequence_order(q.shape[1], ring)
    axes = layout.axes_of("length")

    def local(q, k, v, seg):
        with use_layout(layout, manual=True):
            return A.attention(q, k, v, mask_of(seg))

    run = jax.shard_map(local, mesh=layout.mesh, in_specs=(P(None, axes),) * 4, out_specs=P(None, axes))

    def total(q, k, v):
        out = run(q[:, order], k[:, order], v[:, order], segments[:, order])
        return jnp.sum(out * WEIGHTS[:, order]), out

    (_, out), grads = jax.jit(jax.value_and_grad(total, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return jnp.empty_like(out).at[:, order].set(out), grads


B, L, H, KV, D = 2, 64, 4, 4, 8
WEIGHTS = jnp.cos(jnp.arange(B * L * H * D, dtype=jnp.float32)).reshape(B, L, H, D)


@pytest.mark.parametrize("strategy,kind", [("context=4,data=2", "causal window, segments"), ("context=4,data=2", "block diffusion")])
def test_context_attention_equals_naive_for_each_mask(strategy, kind):
    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.normal(size=s), jnp.float32) for s in ((B, L, H, D), (B, L, KV, D), (B, L, KV, D)))
    segments = jnp.asarray(np.stack([np.searchsorted([9, 30, 51], np.arange(L), side="right"),
                                     np.searchsorted([20], np.arange(L), side="right")]), jnp.int32)
    if kind == "block diffusion":  # issue 16's mask: bidirectional inside noisy blocks, so no causal shortcut
        n, size = 4, L // 8

        def allowed(qb, kb):
            return (kb == qb if kb < n else kb - n < qb) if qb < n else n <= kb <= qb

        mask_of = lambda seg: A.Mask(blocks=A.BlockMask(allowed, size, num_blocks=(2 * n, 2 * n)))  # noqa: E731
    else:
        mask_of = lambda seg: A.Mask(causal=True, window=(13, 0)).with_segments(seg)  # noqa: E731
    out, grads = _op_on_layout(strategy, mask_of, q, k, v, segments)
    mask = mask_of(segments)
    ref = A.attention(q, k, v, mask, implementation="naive")
    ref_grads = jax.grad(lambda q, k, v: jnp.sum(A.attention(q, k, v, mask, implementation="naive") * WEIGHTS), argnums=(0, 1, 2))(q, k, v)
    for got, want in [(out, ref), *zip(grads, ref_grads)]:
        assert float(jnp.max(jnp.abs(got - want))) <= 1e-5 * float(jnp.max(jnp.abs(want)))


# --- a model written the plain-Flax way ----------------------------------------------------------


class TinyLM(nnx.Module):
    """One attention layer and a head, from nnx.Embed and nnx.Linear, with jaxpar's attention op."""

    def __init__(self, rngs):
        named = lambda names: nnx.with_partitioning(nnx.initializers.lecun_normal(), names)  # noqa: E731
        self.embed = nnx.Embed(64, 32, embedding_init=nnx.with_partitioning(nnx.initializers.normal(1.0), ("vocab", "embed")), rngs=rngs)
        self.qkv = nnx.Linear(32, 3 * 32, kernel_init=named(("embed", "mlp")), use_bias=False, rngs=rngs)
        self.head = nnx.Linear(32, 64, kernel_init=named(("embed", "vocab")), use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        q, k, v = jnp.split(self.qkv(x).reshape(*tokens.shape, 3 * 4, 8), 3, axis=2)
        return self.head(x + A.attention(q, k, v, A.CAUSAL).reshape(x.shape))


def lm_loss(model, batch):
    if not isinstance(batch, dict):  # one device: (batch, length + 1) tokens
        batch = {"inputs": batch[:, :-1], "targets": batch[:, 1:]}
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["inputs"]), batch["targets"]).mean()


def test_plain_flax_model_under_context_matches_one_device(tokens):  # noqa: F811
    host = [b % 64 for b in batches(tokens)]
    assert_same(sharded("context=2,fsdp=4", TinyLM, lm_loss, host), oracle(TinyLM, lm_loss, host))


# --- refused in words ----------------------------------------------------------------------------


def test_bad_context_input_is_refused_in_words():
    def trainer(strategy, model_fn=llama_model, loss_fn=llama.loss_fn):
        return Trainer(build_layout(parse_strategy(strategy, 8)), model_fn, loss_fn, CFG)

    with pytest.raises(LayoutError, match=r"sequence length 36 does not split .* multiple of 16; use --seq-len 48"):
        trainer("context=8").check_batch(np.zeros((8, 37), np.int32))
    with pytest.raises(LayoutError, match=r"layers/wk has 4 kv_heads .* cannot split 8 ways.*divides 4"):
        trainer("context=8,context_algorithm=all-to-all")
    with pytest.raises(SpecError, match=r"context_algorithm=ring with stage=2: .* Use context_algorithm=all-to-all"):
        parse_strategy("stage=2,context=2,fsdp=2", 8)
    with pytest.raises(SpecError, match=r"hybrid with context=8 needs a2a=U"):
        parse_strategy("context=8,context_algorithm=hybrid", 8)
    with pytest.raises(SpecError, match=r"a2a= sizes the all-to-all groups of context_algorithm=hybrid"):
        parse_strategy("context=8,a2a=2", 8)
    # no sequence dim to split
    with pytest.raises(LayoutError, match=r"batch leaf 'tokens' has shape \(16,\), with no sequence dim"):
        trainer("context=2,data=4").check_batch(np.zeros((16,), np.int32))

    # a sequence model whose attention is its own: it would see only this device's positions
    class OwnAttention(TinyLM):
        def __call__(self, tokens):
            x = self.embed(tokens)
            q, k, v = jnp.split(self.qkv(x).reshape(*tokens.shape, 3 * 4, 8), 3, axis=2)
            return self.head(x + jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(x.shape))

    own = trainer("context=2,data=4", OwnAttention, lm_loss)
    example = own.abstract_batch(16, 16)
    with pytest.raises(LayoutError, match=r"never calls jaxpar.attention.attention"):
        own.jit_step(example).lower(own.abstract_state(), example)
