"""Layout-aware building blocks a model may call: they work on one device and, unchanged, on the
local shards inside jaxpar's manual step (vocab-parallel lookup and cross-entropy)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.rules import Names, reduce_partial, shard_offset, sum_over


def embed_lookup(table, tokens, out_names: Names, table_names: Names = ("vocab", "embed")):
    """Rows of ``table`` for ``tokens``; with the vocabulary sharded each device looks up the ids in
    its own range and the partial results are summed (Megatron's vocab-parallel embedding)."""
    offset = shard_offset(table_names, 0, table.shape[0])
    local = tokens - offset
    inside = (local >= 0) & (local < table.shape[0])
    rows = jnp.take(table, jnp.clip(local, 0, table.shape[0] - 1), axis=0)
    rows = jnp.where(inside[..., None], rows, jnp.zeros((), rows.dtype))
    return reduce_partial(rows, (table_names[0],), out_names)


def cross_entropy(logits, targets, names: Names = ("batch", "length", "vocab")):
    """Mean next-token cross-entropy in float32, exact when the vocabulary dim is sharded."""
    logits = logits.astype(jnp.float32)
    vocab_dim = logits.ndim - 1
    peak = sum_over(jax.lax.stop_gradient(logits), names, [vocab_dim], op="max")  # for stability only
    shifted = logits - peak[..., None]
    log_total = jnp.log(sum_over(jnp.exp(shifted), names, [vocab_dim]))
    offset = shard_offset(names, vocab_dim, logits.shape[vocab_dim])
    hit = jax.nn.one_hot(targets - offset, logits.shape[vocab_dim], dtype=logits.dtype)
    picked = sum_over(shifted * hit, names, [vocab_dim])
    return jnp.mean(log_total - picked)
