"""Llama: RMSNorm, RoPE, grouped-query attention, SwiGLU, tied or untied embeddings.

Every weight and the main activations carry logical names; the model imports no mesh and no
strategy. Layers are stacked on a leading ``layers`` dim and run by ``jax.lax.scan`` (compiles
fast, and FSDP gathers one layer's weights at a time inside the scan).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.attention import BIDIRECTIONAL, CAUSAL, attention
from jaxpar.models.family import Family
from jaxpar.nn import constrain, cross_entropy, embed_lookup, enter_block, finish_delayed, residual_add, start_delayed

# Activation layouts: the residual stream, and the inside of attention / MLP blocks.
RESIDUAL = ("batch", "residual_length", "embed")
BLOCK = ("batch", "length", "embed")
LOGITS = ("batch", "length", "vocab")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    embed: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def num_params(self) -> int:
        e, h, k, d, m = self.embed, self.heads, self.kv_heads, self.head_dim, self.mlp
        per_layer = 2 * e + e * h * d + 2 * e * k * d + h * d * e + 3 * e * m
        embeddings = self.vocab_size * e * (1 if self.tie_embeddings else 2)
        return self.layers * per_layer + embeddings + e

    def active_params(self) -> int:
        """Weights one token's pass reads (all of a dense model's; a mixture of experts' fewer)."""
        return self.num_params()

    def active_mlp(self) -> int:
        """The MLP hidden width one token runs through (a mixture of experts: its experts' and shared ones')."""
        return self.mlp

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per weight in matmuls plus attention scores (forward x3)."""
        matmul_weights = self.num_params() - self.vocab_size * self.embed * (0 if self.tie_embeddings else 1)
        matmul_weights -= (2 * self.layers + 1) * self.embed  # norms are not matmuls
        attention = 2 * 2 * self.layers * seq_len * self.heads * self.head_dim
        return 6 * matmul_weights + 3 * attention


CONFIGS = {
    "tiny": LlamaConfig(vocab_size=256, embed=128, layers=4, heads=8, kv_heads=4, head_dim=16, mlp=384),
    "llama-1b": LlamaConfig(vocab_size=32_000, embed=2048, layers=16, heads=32, kv_heads=8, head_dim=64, mlp=5632),
    "llama2-7b": LlamaConfig(vocab_size=32_000, embed=4096, layers=32, heads=32, kv_heads=32, head_dim=128, mlp=11_008),
    "llama3-8b": LlamaConfig(
        vocab_size=128_256, embed=4096, layers=32, heads=32, kv_heads=8, head_dim=128, mlp=14_336, rope_theta=500_000.0
    ),
    "llama2-70b": LlamaConfig(vocab_size=32_000, embed=8192, layers=80, heads=64, kv_heads=8, head_dim=128, mlp=28_672),
}


def _param(rngs, shape, names, init):
    # eager_sharding=False: the model can be built with no mesh around; jaxpar places the weights
    return nnx.Param(nnx.with_partitioning(init, names)(rngs.params(), shape), eager_sharding=False)


def fan_in(width):
    return nnx.initializers.normal(width**-0.5)


class LayerStack(nnx.Module):
    """The weights of all transformer layers, stacked on a leading ``layers`` dim."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        n, e, h, k, d = cfg.layers, cfg.embed, cfg.heads, cfg.kv_heads, cfg.head_dim
        ones = nnx.initializers.ones
        self.attn_norm = _param(rngs, (n, e), ("layers", "embed"), ones)
        self.wq = _param(rngs, (n, e, h, d), ("layers", "embed", "heads", "head_dim"), fan_in(e))
        self.wk = _param(rngs, (n, e, k, d), ("layers", "embed", "kv_heads", "head_dim"), fan_in(e))
        self.wv = _param(rngs, (n, e, k, d), ("layers", "embed", "kv_heads", "head_dim"), fan_in(e))
        self.wo = _param(rngs, (n, h, d, e), ("layers", "heads", "head_dim", "embed"), fan_in(h * d * 2 * n))
        self.mlp_norm = _param(rngs, (n, e), ("layers", "embed"), ones)
        self.mlp_weights(cfg, rngs)

    def mlp_weights(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        """The MLP sublayer's weights (the mixture-of-experts family's are its experts')."""
        n, e, m = cfg.layers, cfg.embed, cfg.mlp
        self.w_gate = _param(rngs, (n, e, m), ("layers", "embed", "mlp"), fan_in(e))
        self.w_up = _param(rngs, (n, e, m), ("layers", "embed", "mlp"), fan_in(e))
        self.w_down = _param(rngs, (n, m, e), ("layers", "mlp", "embed"), fan_in(m * 2 * n))


class Llama(nnx.Module):
    stack = LayerStack  # the layers' weights (a family on the Llama's layers may have its own)

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embedding = _param(rngs, (cfg.vocab_size, cfg.embed), ("vocab", "embed"), nnx.initializers.normal(1.0))
        self.layers = self.stack(cfg, rngs=rngs)
        self.final_norm = _param(rngs, (cfg.embed,), ("embed",), nnx.initializers.ones)
        if not cfg.tie_embeddings:
            self.unembedding = _param(
                rngs, (cfg.embed, cfg.vocab_size), ("embed", "vocab"), nnx.initializers.normal(cfg.embed**-0.5)
            )

    def __call__(self, tokens, positions=None, segments=None):
        """Logits (batch, length, vocab) for int tokens (batch, length) at ``positions`` (batch,
        length; default 0, 1, ...); ``segments`` (batch, length) ids of packed documents, which
        attend only within themselves.

        Weights arrive as the layout computes them: jaxpar's step gathers the top-level ones before
        the call and each layer's slice of the stacked ones when the scan reads it."""
        return self.call_and_extras(tokens, positions, segments)[0]

    def call_and_extras(self, tokens, positions=None, segments=None):
        """(logits as ``__call__`` gives them, the layers' extras as ``network_and_extras``)."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        return self.network_and_extras(tokens, positions, CAUSAL if segments is None else CAUSAL.with_segments(segments))

    def network(self, tokens, positions, mask):
        """Logits of the network under any attention ``mask`` (models on the Llama's weights
        choose their own: the block diffusion model's three-part mask)."""
        return self.network_and_extras(tokens, positions, mask)[0]

    def network_and_extras(self, tokens, positions, mask):
        """(logits, what each layer's MLP sublayer yields beside its output, stacked over the
        layers: None for the Llama's, the load-balancing losses of a mixture of experts)."""
        x = embed_lookup(self.embedding, tokens, RESIDUAL)
        x, extras = _layers(x, nnx.state(self.layers), self.cfg, positions, mask, self.mlp)
        return _logits(x, self._head(), self.cfg), extras

    def network_cached(self, tokens, positions, cache, cache_valid):
        """The network for serving with a KV cache: (logits (batch, n, vocab), (keys, values)) of
        ``tokens`` (batch, n) at ``positions`` (batch, n), each attending to the other n tokens
        and to the cached positions where ``cache_valid`` (batch, cached) is True.

        ``cache`` = (keys, values), each (layers, batch, cached, kv_heads, head_dim): the keys
        after RoPE, as this returns them for its own tokens (layers, batch, n, kv_heads,
        head_dim), so that a caller can append them to its cache. The same layers as ``network``
        (``_block``), the tokens' keys and values placed after the cached ones."""
        x = embed_lookup(self.embedding, tokens, RESIDUAL)
        own = jnp.ones(tokens.shape, bool)
        mask = BIDIRECTIONAL.with_segments(own, jnp.concatenate([cache_valid, own], axis=1))  # invalid slots: segment False
        x, new_kv = _layers_cached(x, nnx.state(self.layers), self.cfg, positions, mask, self.mlp, cache)
        return _logits(x, self._head(), self.cfg), new_kv

    def network_prefill(self, tokens, positions, segments):
        """The network over whole prompts for serving: (logits (batch, n, vocab), (keys, values),
        each (layers, batch, n, kv_heads, head_dim), as ``network_cached`` returns them) of
        ``tokens`` (batch, n) at ``positions``, causal, each token attending only to tokens of its
        own ``segments`` id (batch, n) (a left-padded batch gives its padding an id of its own)."""
        x = embed_lookup(self.embedding, tokens, RESIDUAL)
        x, kv = _layers_cached(x, nnx.state(self.layers), self.cfg, positions, CAUSAL.with_segments(segments), self.mlp)
        return _logits(x, self._head(), self.cfg), kv

    def mlp(self, x, pending, w, cfg):
        """The layers' MLP sublayer: ``_mlp`` (a family on the Llama's layers may have its own)."""
        return _mlp(x, pending, w, cfg)

    def _head(self):
        # the embedding is read only where it is the output layer too: inside jaxpar's step a read
        # gathers it
        head = {"final_norm": self.final_norm[...]}
        if self.cfg.tie_embeddings:
            head["embedding"] = self.embedding[...]
        else:
            head["unembedding"] = self.unembedding[...]
        return head


def loss_fn(model: Llama, batch):
    """Next-token cross-entropy on (batch, length + 1) tokens, or on a dict of (batch, length)
    arrays ``inputs``, ``targets``, ``positions`` and optionally ``segments`` and ``weights``
    (packed documents, ``train.data.packed_batch_at``; also the form a batch takes under context
    parallelism, where each device holds some positions of every row)."""
    if not isinstance(batch, dict):
        batch = {"inputs": batch[:, :-1], "targets": batch[:, 1:]}
    logits = model(batch["inputs"], batch.get("positions"), batch.get("segments"))
    return cross_entropy(logits, batch["targets"], LOGITS, batch.get("weights"))


def pipeline_pieces(cfg: LlamaConfig, mlp=None):
    """The Llama as the three pieces a pipeline runs on token batches (b, length + 1), for
    ``jaxpar.parallel.stage.pipeline.split_by_layer_stack``: ``first(edge, tokens)`` embeds,
    ``stage(layers, x)`` runs a chunk of the stacked layers (an nnx.State), ``last(edge, x,
    tokens)`` is the head and the next-token loss. ``edge`` maps the top-level weights' names to
    their values as computed. The same code as ``Llama.__call__``."""

    def first(edge, tokens):
        return embed_lookup(edge["embedding"], tokens[:, :-1], RESIDUAL)

    def stage(layers, x):
        return _layers(x, layers, cfg, jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2]), CAUSAL, mlp or _mlp)[0]

    def last(edge, x, tokens):
        return cross_entropy(_logits(x, edge, cfg), tokens[:, 1:], LOGITS)

    return first, stage, last


def _layers(x, layers, cfg, positions, mask, mlp):
    """(the residual stream after the scanned transformer layers, what ``mlp`` yields beside its
    output, stacked over the layers); ``layers``: the stacked weights. (jaxpar's step gathers each
    layer's weights when the body reads them, and checkpoints the body by the run's remat policy:
    ``jaxpar.train.remat``.) The scan carries the stream and the partial sum delayed tensor
    parallelism has not added yet (None otherwise)."""
    def layer(carry, stacked_slice):
        w = {name: var[...] for name, var in stacked_slice.items()}
        carry, _, extra = _block(*carry, w, cfg, positions, mask, mlp)
        return carry, extra

    carry, extras = jax.lax.scan(layer, start_delayed(x, RESIDUAL), layers)
    return finish_delayed(*carry), extras


def _layers_cached(x, layers, cfg, positions, mask, mlp, cache=None):
    """``_layers`` for serving: each layer also yields its own (keys, values), and with ``cache``
    reads its slice of the cached ones before them (``mask`` over [cached ; own])."""

    def layer(carry, inputs):
        stacked_slice, past = inputs if cache is not None else (inputs, None)
        w = {name: var[...] for name, var in stacked_slice.items()}
        return _block(*carry, w, cfg, positions, mask, mlp, past)[:2]

    carry, kv = jax.lax.scan(layer, start_delayed(x, RESIDUAL), layers if cache is None else (layers, cache))
    return finish_delayed(*carry), kv


def _logits(x, head, cfg):
    if cfg.tie_embeddings:
        project = lambda h: jnp.einsum("ble,ve->blv", h, head["embedding"])  # noqa: E731
    else:
        project = lambda h: jnp.einsum("ble,ev->blv", h, head["unembedding"])  # noqa: E731
    return constrain(enter_block(_rms_norm(x, head["final_norm"], cfg.norm_eps), RESIDUAL, BLOCK, then=project), LOGITS)


def _rms_norm(x, scale, eps):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * scale.astype(jnp.float32)).astype(x.dtype)


def _rope(x, positions, theta):
    """Rotary position embedding on (batch, length, heads, head_dim) at positions (batch, length),
    half-split convention."""
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[..., None].astype(jnp.float32) * freqs
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _projections(h, w, cfg):
    """The queries, keys and values of block input ``h`` (batch, length, embed), before RoPE: each
    position's alone (collective matmul computes them chunk by chunk: ``jaxpar.nn.enter_block``)."""
    # (with more tensor shards than key/value heads, the step hands each device the one its query
    # heads read: ``rules._local_replica``)
    q = jnp.einsum("ble,ehd->blhd", h, w["wq"])
    return q, jnp.einsum("ble,ekd->blkd", h, w["wk"]), jnp.einsum("ble,ekd->blkd", h, w["wv"])


def _attention(q, k, v, cfg, positions, mask, past=None):
    """(attention output per head, (keys, values) of these positions); ``past``: the (keys,
    values) of earlier positions (a KV cache), attended to before these positions' own."""
    q = constrain(_rope(q, positions, cfg.rope_theta), ("batch", "length", "heads", "head_dim"))
    k = constrain(_rope(k, positions, cfg.rope_theta), ("batch", "length", "kv_heads", "head_dim"))
    own = (k, v)
    if past is not None:
        k, v = (jnp.concatenate([cached, new], axis=1) for cached, new in zip(past, own))
    return constrain(attention(q, k, v, mask), ("batch", "length", "heads", "head_dim")), own


def _block(x, pending, w, cfg, positions, mask, mlp, past=None):
    """((the layer's output, the partial sum it leaves pending), its (keys, values), what ``mlp``
    yields beside its output); ``pending``: what the previous layer left (``jaxpar.nn.residual_add``);
    ``past`` as ``_attention`` takes it. The attention block's first matmuls are ``enter_block``'s
    ``then`` and its last ``residual_add``'s ``project``, so that collective matmul can cut them by
    position."""
    qkv = enter_block(_rms_norm(x, w["attn_norm"], cfg.norm_eps), RESIDUAL, BLOCK, then=lambda h: _projections(h, w, cfg))
    attended, kv = _attention(*qkv, cfg, positions, mask, past)
    x, pending = residual_add(x, attended, ("heads", "head_dim"), RESIDUAL, pending,
                              project=lambda out: jnp.einsum("blhd,hde->ble", out, w["wo"]))
    carry, extra = mlp(x, pending, w, cfg)
    return carry, kv, extra


def _mlp(x, pending, w, cfg):
    """((the stream after the SwiGLU sublayer, the partial sum it leaves pending), None)."""
    act = enter_block(_rms_norm(x, w["mlp_norm"], cfg.norm_eps), RESIDUAL, BLOCK,
                      then=lambda h: jax.nn.silu(jnp.einsum("ble,em->blm", h, w["w_gate"])) * jnp.einsum("ble,em->blm", h, w["w_up"]))
    act = constrain(act, ("batch", "length", "mlp"))
    return residual_add(x, act, ("mlp",), RESIDUAL, pending, project=lambda a: jnp.einsum("blm,me->ble", a, w["w_down"])), None


FAMILY = Family(name="llama", words="Llama", config_type=LlamaConfig, configs=CONFIGS,
                model=lambda cfg, rngs: Llama(cfg, rngs=rngs), loss=loss_fn)
