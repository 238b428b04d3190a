"""The compressed wire format, one group of 32 values at a time: what the Pallas kernels in
``quantize.py`` compute, and the pure-JAX twins they must equal bit for bit.

The collectives' ``quantize.py`` builds whole messages from these (scales, width allocation,
plane compaction) and their ``compressed.py`` sends them; nothing here or in the kernels imports
the collectives, so the dependency runs one way: collectives -> kernels.

- sizes: ``GROUP`` = 32 values (one uint32 word per bit plane), ``GROUPS_PER_BLOCK`` groups per
  block scale, widths ``MIN_BITS``..``MAX_BITS`` per group;
- ``Packed``: one compressed message (bit planes, group codes, block scales);
- the shared dither: a counter hash of (seed, hop, chunk, value index) that sender, receiver and
  kernel compute alike;
- ``encode_groups`` / ``decode_groups``: the per-group work (scale, dither, round, bit-plane pack,
  and back), and ``GroupImpl``, the pair the whole-message quantizers are given: ``TWINS`` (these),
  or the kernels' (``jaxpar.kernels.quantize.pallas_impl``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

GROUP = 32  # values per group: one uint32 word per bit plane
GROUPS_PER_BLOCK = 8
BLOCK = GROUP * GROUPS_PER_BLOCK  # values per block scale (256)
MIN_BITS, MAX_BITS = 2, 12  # per-group widths the allocation may choose


class Packed(NamedTuple):
    """One compressed message: ``words`` uint32 [budget] bit planes, ``codes`` uint8 [groups] group
    scale codes (empty for the uniform quantizer), ``scales`` float32 [blocks]."""

    words: jax.Array
    codes: jax.Array
    scales: jax.Array


def levels(width):
    """Positive levels of a signed ``width``-bit code: codes run over [-L, L]."""
    return 2.0 ** (width - 1) - 1.0


def group_step(group_scale, levels):
    """Quantization step of a group: its range spread over L - 1/2 steps, which leaves room for the
    dither; 1 for an empty group so that nothing divides by zero. (The kernels use it too.)"""
    return jnp.where(group_scale > 0, group_scale / (levels - 0.5), 1.0)


# --- the shared dither: a counter hash both ends (and a kernel) can compute -----------------------

GOLDEN = np.uint32(0x9E3779B9)


def mix32(h: jax.Array) -> jax.Array:
    """A 32-bit integer finaliser (murmur3's): every input bit changes about half the output bits."""
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def message_seed(seed, hop, chunk) -> jax.Array:
    """uint32 seed of one message, from the run's seed, the hop and the chunk it carries (any of
    them may be traced: a chunk id often depends on the rank)."""
    u = lambda v: jnp.asarray(v).astype(jnp.uint32)  # noqa: E731
    return mix32(mix32(mix32(u(seed)) ^ (u(hop) * GOLDEN)) + u(chunk))


def dither(mseed: jax.Array, start, shape) -> jax.Array:
    """The dither of values ``start``, ``start + 1``, ... of a message: uniform in [-1/2, 1/2).

    Subtractive dithering: the sender rounds ``x / step + d``, the receiver, who draws the same
    ``d``, subtracts it. The error is then uniform on [-1/2, 1/2) steps whatever x is: unbiased,
    with half the variance of stochastic rounding."""
    index = jnp.asarray(start).astype(jnp.uint32) + jax.lax.broadcasted_iota(jnp.uint32, shape, len(shape) - 1)
    if len(shape) > 1:  # [groups, GROUP]: value index = group * GROUP + lane
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, 0) * np.uint32(shape[-1])
    return dither_at(mseed, index)


def dither_at(mseed: jax.Array, index: jax.Array) -> jax.Array:
    """The dither of the values at uint32 ``index`` (their position in the message): the one
    definition ``dither`` and the Pallas kernels (on their own index tiles) share."""
    h = mix32(mix32(index * GOLDEN + mseed) ^ mseed)
    # h >> 8 < 2^24, so going through int32 is exact; Mosaic (TPU) cannot convert uint32 to float
    return (h >> 8).astype(jnp.int32).astype(jnp.float32) * np.float32(2.0**-24) - np.float32(0.5)


# --- per-group encode / decode: the kernels' twins ----------------------------------------------


def encode_groups(values, group_scale, width, mseed, start=0) -> jax.Array:
    """float32 [groups, GROUP] -> uint32 bit planes [groups, MAX_BITS] (planes >= width are zero).

    ``mseed`` None: nearest rounding, no dither. ``start``: index of the first value in the
    message, for the dither."""
    top = levels(width)[:, None]
    step = group_step(group_scale[:, None], top)
    d = 0.0 if mseed is None else dither(mseed, start, values.shape)
    # |value| <= group scale = (L - 1/2) steps and |d| <= 1/2, so |q| <= L: the clip never binds
    q = jnp.clip(jnp.round(values / step + d), -top, top)
    unsigned = (q + top).astype(jnp.uint32)  # in [0, 2L] < 2 ** width
    shifts = jnp.arange(MAX_BITS, dtype=jnp.uint32)[:, None]
    lanes = jnp.arange(GROUP, dtype=jnp.uint32)
    bits = (unsigned[:, None, :] >> shifts) & 1  # [groups, MAX_BITS, GROUP]
    return jnp.sum(bits << lanes, axis=-1, dtype=jnp.uint32)


def decode_groups(planes, group_scale, width, mseed, start=0, local=None) -> jax.Array:
    """uint32 [groups, MAX_BITS] -> float32 [groups, GROUP] (+ ``local``, the accumulate of a hop).

    A group whose scale is NaN (its block held a NaN or an infinity) decodes as NaN."""
    lanes = jnp.arange(GROUP, dtype=jnp.uint32)
    shifts = jnp.arange(MAX_BITS, dtype=jnp.uint32)[:, None]
    unsigned = jnp.sum(((planes[:, :, None] >> lanes) & 1) << shifts, axis=1, dtype=jnp.uint32)
    top = levels(width)[:, None]
    d = 0.0 if mseed is None else dither(mseed, start, unsigned.shape)
    q = unsigned.astype(jnp.float32) - top - d
    scale = group_scale[:, None]
    values = jnp.where(scale > 0, q * group_step(scale, top), 0.0 * scale)
    return values if local is None else values + local


@dataclasses.dataclass(frozen=True)
class GroupImpl:
    """The per-group work of the quantizers: ``encode`` and ``decode`` take the arguments of
    ``encode_groups`` / ``decode_groups`` and must give their bits."""

    encode: Callable
    decode: Callable


TWINS = GroupImpl(encode_groups, decode_groups)
