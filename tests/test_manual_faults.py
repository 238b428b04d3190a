"""A model of the user's own on jaxpar's manual path is never silently wrong.

The model is Gemma-3-like (grouped key/value heads, QK-norm, pre- and post-norms, a GeGLU MLP, tied
embeddings scaled by sqrt(width), soft-capped logits) and written the way the README's "Your own
model" shows: plain NNX modules whose weights carry logical names, jaxpar's calls on its row-parallel
matmuls and lookup, head counts read from its own kernels, a Python loop over its layers (so it never
calls ``enter_block``, where an unfinished sum used to be caught). Under ``tensor=8`` with 4 key/value
heads the layout keeps those heads whole and each device reads the one its query head uses; a model
that forgets a ``reduce_partial``, or looks rows up in the vocabulary-split table by a one-hot matmul,
by Flax's own lookup or by indexing (each device finding only its own rows), is refused before its first step, naming the op that made the partial sum.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxpar import nn
from jaxpar.errors import LayoutError
from jaxpar.parallel import build_layout, parse_strategy
from jaxpar.train.step import TrainConfig, Trainer

VOCAB, WIDTH, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, LAYERS = 64, 32, 8, 4, 8, 64, 2
init = nnx.initializers.normal(0.05)
named = nnx.with_partitioning


class RMSNorm(nnx.Module):
    def __init__(self, size, name):
        self.scale = nnx.Param(named(nnx.initializers.zeros, (name,))(jax.random.key(0), (size,)))

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6) * (1 + self.scale[...])


class Layer(nnx.Module):
    def __init__(self, variant, rngs):
        self.variant = variant
        self.q = nnx.Einsum("ble,ehd->blhd", (WIDTH, HEADS, HEAD_DIM), kernel_init=named(init, ("embed", "heads", "head_dim")), rngs=rngs)
        self.k = nnx.Einsum("ble,ekd->blkd", (WIDTH, KV_HEADS, HEAD_DIM), kernel_init=named(init, ("embed", "kv_heads", "head_dim")), rngs=rngs)
        self.v = nnx.Einsum("ble,ekd->blkd", (WIDTH, KV_HEADS, HEAD_DIM), kernel_init=named(init, ("embed", "kv_heads", "head_dim")), rngs=rngs)
        self.o = nnx.Einsum("blhd,hde->ble", (HEADS, HEAD_DIM, WIDTH), kernel_init=named(init, ("heads", "head_dim", "embed")), rngs=rngs)
        self.gate = nnx.Linear(WIDTH, HIDDEN, use_bias=False, kernel_init=named(init, ("embed", "mlp")), rngs=rngs)
        self.up = nnx.Linear(WIDTH, HIDDEN, use_bias=False, kernel_init=named(init, ("embed", "mlp")), rngs=rngs)
        self.down = nnx.Linear(HIDDEN, WIDTH, use_bias=False, kernel_init=named(init, ("mlp", "embed")), rngs=rngs)
        self.pre_attn, self.post_attn = RMSNorm(WIDTH, "embed"), RMSNorm(WIDTH, "embed")
        self.pre_mlp, self.post_mlp = RMSNorm(WIDTH, "embed"), RMSNorm(WIDTH, "embed")
        self.q_norm, self.k_norm = RMSNorm(HEAD_DIM, "head_dim"), RMSNorm(HEAD_DIM, "head_dim")

    def attend(self, x):
        b, length, _ = x.shape
        q, k, v = self.q_norm(self.q(x)), self.k_norm(self.k(x)), self.v(x)
        heads, kv_heads = self.q.kernel.shape[1], self.k.kernel.shape[1]  # read from the kernels, as a user does
        q = q.reshape(b, length, kv_heads, heads // kv_heads, HEAD_DIM)
        scores = jnp.einsum("blkgd,bskd->bkgls", q, k) / math.sqrt(HEAD_DIM)
        scores = jnp.where(jnp.tril(jnp.ones((length, length), bool)), scores, -1e9)
        out = jnp.einsum("bkgls,bskd->blkgd", jax.nn.softmax(scores, axis=-1), v).reshape(b, length, heads, HEAD_DIM)
        return nn.reduce_partial(self.o(out), ("heads", "head_dim"), ("batch", "length", "embed"))

    def __call__(self, x):
        x = x + self.post_attn(self.attend(self.pre_attn(x)))
        h = self.pre_mlp(x)
        down = self.down(jax.nn.gelu(self.gate(h)) * self.up(h))
        if self.variant != "no_reduce":  # the fault: the down projection's sum over "mlp" left unfinished
            down = nn.reduce_partial(down, ("mlp",), ("batch", "length", "embed"))
        return x + self.post_mlp(down)


class GemmaLike(nnx.Module):
    def __init__(self, variant="ok", *, rngs):
        self.variant = variant
        self.embed = nnx.Embed(VOCAB, WIDTH, embedding_init=named(init, ("vocab", "embed")), rngs=rngs)
        self.layers = nnx.List([Layer(variant, rngs) for _ in range(LAYERS)])
        self.final = RMSNorm(WIDTH, "embed")

    def __call__(self, tokens):
        table = self.embed.embedding
        if self.variant == "onehot":  # the fault: a one-hot matmul in the vocabulary-split table
            x = jax.nn.one_hot(tokens, table.shape[0]) @ table[...]
        elif self.variant == "nnx_embed":  # the fault: Flax's lookup in each device's rows alone (NaN for the others' ids)
            x = self.embed(tokens)
        elif self.variant == "indexed":  # the fault: indexing, which clamps the others' ids to this device's last row
            x = table[...][tokens]
        else:
            x = nn.embed_lookup(table, tokens, ("batch", "length", "embed"))
        x = x * math.sqrt(WIDTH)
        for layer in self.layers:
            x = layer(x)
        logits = jnp.einsum("ble,ve->blv", self.final(x), table[...])
        return 30.0 * jnp.tanh(logits / 30.0)  # Gemma's soft cap


def lm_loss(model, batch):
    return nn.cross_entropy(model(batch[:, :-1]), batch[:, 1:])


def optax_loss(model, batch):  # the fault: a softmax over the vocabulary-split logits, each device's alone
    return optax.softmax_cross_entropy_with_integer_labels(model(batch[:, :-1]), batch[:, 1:]).mean()


def make_trainer(strategy: str, variant: str = "ok") -> Trainer:
    layout = build_layout(parse_strategy(strategy, 8))
    loss = optax_loss if variant == "optax_loss" else lm_loss
    return Trainer(layout, lambda rngs: GemmaLike(variant, rngs=rngs), loss, TrainConfig(learning_rate=1e-2))


def tokens(rows=8, length=17):
    return np.asarray(jax.random.randint(jax.random.key(1), (rows, length), 0, VOCAB))


def test_kv_heads_kept_whole_under_tensor_8_equal_one_device():
    """tensor=8 over 4 key/value heads: each device reads the key/value head of its query head,
    so a model that takes its head counts from its kernels computes what one device does."""
    report = make_trainer("tensor=8").check(tokens())
    assert report.path == "manual"
    assert report.ok, report.format()
    assert abs(report.loss - report.reference_loss) <= 1e-5 * abs(report.reference_loss)


@pytest.mark.parametrize("variant, made_by", [("no_reduce", "dot_general at"), ("onehot", "dot_general at"),
                                              ("nnx_embed", "gather at"), ("indexed", "gather at"),
                                              ("optax_loss", "reduce_max at")])
def test_unfinished_partial_sums_refused_before_the_first_step(variant, made_by):
    """Each fault is named at the op that made the partial sum, in this file, before a step runs."""
    trainer = make_trainer("data=2,tensor=4", variant)
    state = trainer.init(seed=0)
    with pytest.raises(LayoutError, match="unfinished partial sum") as refused:
        trainer.step(state, trainer.put_batch(tokens()))
    message = str(refused.value)
    assert made_by in message and "test_manual_faults.py" in message and "'tensor'" in message
    assert "reduce_partial" in message and ("embed_lookup" in message)
