"""Sums over several mesh axes at once, compressed only across the slow ones, inside ``shard_map``.

A pod has fast links inside a slice or node (ICI, NVLink) and slow ones between them (DCN,
InfiniBand). Compressing where bandwidth is plentiful only adds error, so:

- ``all_reduce``: exact ``psum_scatter`` inside the fast axes, a compressed all-reduce across each
  slow axis on the 1/fast-size shard that is left, exact ``all_gather`` inside the fast axes. The
  slow links carry 1/fast-size of the tensor, compressed; the fast ones carry it whole, exactly.
- ``reduce_scatter``: ``psum_scatter`` over all the axes, the exact ones first (they shrink what the
  slow ones carry), then the compressed ones.

With no fast axes, several slow axes are reduced one after another (each compressed on the whole
tensor: an exact all-gather would cost more than the compressed one it replaces). The compressed
collective gives every rank bit-identical bits, and so do these. ``seed`` may be traced (the
training step folds its step number in); each slow axis gets its own seed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.collectives import compressed
from jaxpar.kernels.wire import GOLDEN, TWINS, GroupImpl


def fold_seed(seed, i: int):
    """A seed for the i-th of several compressed collectives sharing ``seed`` (int or traced)."""
    return jnp.asarray(seed).astype(jnp.uint32) * GOLDEN + np.uint32(i)  # odd multiplier: distinct (seed, i), distinct seeds


def _size(axes: Sequence[str]) -> int:
    return math.prod(jax.lax.axis_size(a) for a in axes)


def all_reduce(
    x: jax.Array, fast_axes: Sequence[str], slow_axes: Sequence[str], *, scheme: str = "dynamiq",
    bits: float | None = None, seed=0, min_size: int = 4096, impl: GroupImpl = TWINS,
) -> jax.Array:
    """``psum(x, fast_axes + slow_axes)``, compressed across ``slow_axes`` only (float32 result);
    ``impl``: the compressed collective's per-group encode / decode."""
    fast, slow = tuple(fast_axes), tuple(slow_axes)
    if not slow:
        return jax.lax.psum(x, fast) if fast else x
    flat = x.reshape(-1).astype(jnp.float32)
    if fast:
        ranks = _size(fast)
        flat = jnp.pad(flat, (0, -flat.size % ranks))  # psum_scatter needs a multiple of the ranks
        flat = jax.lax.psum_scatter(flat, fast, scatter_dimension=0, tiled=True)
    for i, axis in enumerate(slow):
        flat = compressed.all_reduce(flat, axis, scheme=scheme, bits=bits, seed=fold_seed(seed, i), min_size=min_size, impl=impl)
    if fast:
        flat = jax.lax.all_gather(flat, fast, axis=0, tiled=True)[: x.size]
    return flat.reshape(x.shape)


def reduce_scatter(
    x: jax.Array, axes: Sequence[str], slow_axes: Sequence[str], *, scheme: str = "dynamiq",
    bits: float | None = None, seed=0, min_size: int = 4096, impl: GroupImpl = TWINS,
) -> jax.Array:
    """``psum_scatter(x, axes, scatter_dimension=0, tiled=True)``, compressed over the axes of
    ``axes`` that are in ``slow_axes`` (float32 result). ``x.shape[0]`` must divide over ``axes``."""
    axes = tuple(axes)
    sizes = [jax.lax.axis_size(a) for a in axes]
    if x.shape[0] % math.prod(sizes):
        raise ValueError(f"leading dimension {x.shape[0]} of a reduce-scatter must divide over {axes} ({math.prod(sizes)} ranks)")
    # Tiled over (a, b, ...): block index = a_index * size(b) + b_index ...; splitting the leading
    # dim into one dim per axis lets each axis be reduced on its own dim, in any order.
    y = x.astype(jnp.float32).reshape(*sizes, -1)
    exact_first = sorted(range(len(axes)), key=lambda d: axes[d] in slow_axes)
    for n, d in enumerate(exact_first):
        y = jnp.moveaxis(y, d, 0)
        if axes[d] in slow_axes:
            y = compressed.reduce_scatter(y, axes[d], scheme=scheme, bits=bits, seed=fold_seed(seed, n), min_size=min_size, impl=impl)
        else:
            y = jax.lax.psum_scatter(y, axes[d], scatter_dimension=0, tiled=True)
        y = jnp.moveaxis(y, 0, d)
    return y.reshape((x.shape[0] // math.prod(sizes),) + x.shape[1:])
