"""Quantizers for compressed collectives: what one hop of a compressed all-reduce puts on the wire.

A message is a float32 vector of whole blocks (``BLOCK`` = 256 values, ``GROUPS_PER_BLOCK`` groups
of ``GROUP`` = 32). DynamiQ-style (``dynamiq``):

- hierarchical scales: one float32 scale per block (its largest magnitude) and one uint8 code per
  group, the group's scale being ``block_scale * code / 255`` rounded up, so every value lies
  inside its group's range: nothing clips and no scale can overflow;
- a bit width per group (``MIN_BITS``..``MAX_BITS``) chosen over the whole message to spend a
  fixed budget of ``bits`` per value where it cuts the error most: a group's error is
  ~ (scale / levels)^2, so wide groups get more bits and near-empty ones fewer. Gradients mix
  layers whose magnitudes differ by orders of magnitude, and this is where most of the accuracy
  comes from. The receiver recomputes the same widths from the scales and codes: they cost
  nothing on the wire;
- rounding with a subtractive dither that sender and receiver draw from a shared seed (a counter
  hash, so a kernel can draw it too): unbiased, and half the error variance of plain stochastic
  rounding;
- bit-plane packing: plane ``p`` of a group is one uint32 word holding bit ``p`` of each of its 32
  values; a group's planes go back to back, so a message is exactly its budget of words.

The naive baseline (``uniform``): one float32 scale per block and the same width everywhere, with
the same dither and packing (the per-hop quantizer compressed all-reduces are usually built from).

The per-group work (``encode_groups`` / ``decode_groups``) is what the Pallas kernels in
``jaxpar.kernels.quantize`` do; these functions are their pure-JAX twins. Scales and widths are
cheap reductions over the group scales and stay in XLA.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.rules import varying_axes

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


def budget_words(values: int, bits: float) -> int:
    """Bit-plane words of a message of ``values`` values at an average ``bits`` per value."""
    return math.floor(bits * values / GROUP + 1e-9)


def wire_bits_per_value(bits: float, scheme: str) -> float:
    """Bits on the wire per coordinate, scales included."""
    scale_bits = (8 * GROUPS_PER_BLOCK + 32) / BLOCK if scheme == "dynamiq" else 32 / BLOCK
    return bits + scale_bits


def check_bits(bits: float, scheme: str) -> None:
    if scheme == "uniform" and (bits != int(bits) or not MIN_BITS <= bits <= MAX_BITS):
        raise ValueError(f"bits={bits}: the uniform quantizer needs a whole width in [{MIN_BITS}, {MAX_BITS}]")
    if not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"bits={bits} must be in [{MIN_BITS}, {MAX_BITS}] (average bits per value)")


def _levels(width):
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
    levels = _levels(width)[:, None]
    step = group_step(group_scale[:, None], levels)
    d = 0.0 if mseed is None else dither(mseed, start, values.shape)
    # |value| <= group scale = (L - 1/2) steps and |d| <= 1/2, so |q| <= L: the clip never binds
    q = jnp.clip(jnp.round(values / step + d), -levels, levels)
    unsigned = (q + levels).astype(jnp.uint32)  # in [0, 2L] < 2 ** width
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
    levels = _levels(width)[:, None]
    d = 0.0 if mseed is None else dither(mseed, start, unsigned.shape)
    q = unsigned.astype(jnp.float32) - levels - d
    scale = group_scale[:, None]
    values = jnp.where(scale > 0, q * group_step(scale, levels), 0.0 * scale)
    return values if local is None else values + local


# --- scales, widths and the message layout (XLA) -------------------------------------------------


def block_scales(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """float32 [blocks * BLOCK] -> (block scales float32 [blocks], group codes uint8 [groups]).

    A block holding a NaN or an infinity gets scale NaN and codes 0: it decodes as NaN, and the
    width allocation of the other groups does not see it."""
    blocks = x.reshape(-1, GROUPS_PER_BLOCK, GROUP)
    group_max = jnp.max(jnp.abs(blocks), axis=-1)
    finite = jnp.all(jnp.isfinite(group_max), axis=-1)
    scale = jnp.where(finite, jnp.max(group_max, axis=-1), jnp.nan)
    safe = jnp.where(finite & (scale > 0), scale, 1.0)[:, None]
    codes = jnp.where(finite[:, None], jnp.clip(jnp.ceil(group_max / safe * 255.0), 0, 255), 0)
    return scale, codes.astype(jnp.uint8).reshape(-1)


def group_scales(scales: jax.Array, codes: jax.Array) -> jax.Array:
    """Each group's scale, from its block's scale and its code (NaN in a non-finite block)."""
    return (jnp.repeat(scales, GROUPS_PER_BLOCK) * codes.astype(jnp.float32)) / 255.0


def _gain_factors() -> np.ndarray:
    """c_k: cut in a group's squared step (per unit scale^2) from widening it from k - 1 to k bits."""
    inv2 = lambda w: 1.0 / (_levels(w) - 0.5) ** 2  # noqa: E731
    return np.array([inv2(k - 1) - inv2(k) for k in range(MIN_BITS + 1, MAX_BITS + 1)], np.float32)


def allocate_bits(group_scale: jax.Array, budget: int) -> jax.Array:
    """Per-group widths (int32) summing to at most ``budget``: the greedy optimum, found at once.

    Widening a group from k - 1 to k bits cuts its error by scale^2 c_k, and c_k falls with k,
    so the best widths take every step whose cut passes a threshold t; t is found by bisection
    on its float bit pattern (exact, 31 rounds, no transcendental functions, so sender and
    receiver agree to the bit). Budget left over by ties goes to the first tied groups."""
    groups = group_scale.shape[0]
    if budget < MIN_BITS * groups:
        raise ValueError(f"a budget of {budget} planes cannot give {groups} groups {MIN_BITS} bits each")
    usable = jnp.where(jnp.isfinite(group_scale), group_scale, 0.0)
    top = jnp.max(usable)
    rel = usable / jnp.where(top > 0, top, 1.0)  # in [0, 1]: the squares below cannot overflow
    cuts = jnp.square(rel)[:, None] * _gain_factors()  # [groups, MAX_BITS - MIN_BITS]
    extra = budget - MIN_BITS * groups

    def steps_taken(t_bits):
        return jnp.sum(cuts >= jax.lax.bitcast_convert_type(t_bits, jnp.float32), axis=-1, dtype=jnp.int32)

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        fits = jnp.sum(steps_taken(mid)) <= extra
        return jnp.where(fits, lo, mid + 1), jnp.where(fits, mid, hi)

    # the smallest positive threshold whose steps fit; +inf (0x7F800000) takes none, so one fits
    bounds = (jnp.int32(1), jnp.int32(0x7F800000))
    varying = tuple(sorted(varying_axes(top)))  # inside shard_map: the carry must vary like the scales
    _, t = jax.lax.fori_loop(0, 31, halve, jax.lax.pcast(bounds, varying, to="varying") if varying else bounds)
    taken = steps_taken(t)
    tied = (steps_taken(t - 1) > taken) & (rel > 0)  # would widen at the next lower threshold
    left = extra - jnp.sum(taken)
    bonus = tied & (jnp.cumsum(tied.astype(jnp.int32)) <= left)
    return MIN_BITS + taken + bonus.astype(jnp.int32)


def compact(planes: jax.Array, width: jax.Array, budget: int) -> jax.Array:
    """[groups, MAX_BITS] planes -> [budget] words: each group's first ``width`` planes, back to
    back (unused words at the end stay zero). A gather: word s belongs to the group whose span
    holds it."""
    ends = jnp.cumsum(width)
    slot = jnp.arange(budget, dtype=ends.dtype)
    group = jnp.searchsorted(ends, slot, side="right")
    inside = group < width.shape[0]
    group = jnp.minimum(group, width.shape[0] - 1)
    plane = slot - (ends[group] - width[group])
    return jnp.where(inside, planes[group, jnp.clip(plane, 0, MAX_BITS - 1)], 0)


def expand(words: jax.Array, width: jax.Array) -> jax.Array:
    """[budget] words -> [groups, MAX_BITS] planes (zero beyond each group's width)."""
    starts = jnp.cumsum(width) - width
    plane = jnp.arange(MAX_BITS, dtype=width.dtype)
    used = plane < width[:, None]
    return jnp.where(used, words[jnp.where(used, starts[:, None] + plane, 0)], 0)


# --- whole messages ------------------------------------------------------------------------------

# The per-group implementation the four functions below use: the twins, or the Pallas kernels
# that ``jaxpar.kernels.quantize.use_kernels`` swaps in. Read when a function is traced.
_group_impl = (encode_groups, decode_groups)


def set_group_impl(encode, decode):
    """Route the whole-message quantizers' per-group work to ``encode`` / ``decode`` (the twins'
    signatures); returns the previous pair, to restore."""
    global _group_impl
    previous, _group_impl = _group_impl, (encode, decode)
    return previous


def quantize_dynamiq(x: jax.Array, bits: float, mseed) -> Packed:
    """float32 [blocks * BLOCK] -> Packed (see the module doc)."""
    scales, codes = block_scales(x)
    gscale = group_scales(scales, codes)
    budget = budget_words(x.size, bits)
    width = allocate_bits(gscale, budget)
    planes = _group_impl[0](x.reshape(-1, GROUP), gscale, width, mseed)
    return Packed(compact(planes, width, budget), codes, scales)


def dequantize_dynamiq(packed: Packed, bits: float, mseed, local=None) -> jax.Array:
    """Packed -> float32 [blocks * BLOCK] (+ ``local``); ``mseed`` must be the sender's."""
    gscale = group_scales(packed.scales, packed.codes)
    width = allocate_bits(gscale, packed.words.shape[0])
    planes = expand(packed.words, width)
    local = None if local is None else local.reshape(-1, GROUP)
    return _group_impl[1](planes, gscale, width, mseed, local=local).reshape(-1)


def quantize_uniform(x: jax.Array, bits: float, mseed) -> Packed:
    """The naive baseline: one scale per block, ``bits`` everywhere."""
    scales, _ = block_scales(x)
    gscale = jnp.repeat(scales, GROUPS_PER_BLOCK)
    width = jnp.full(gscale.shape, int(bits), jnp.int32)
    planes = _group_impl[0](x.reshape(-1, GROUP), gscale, width, mseed)
    return Packed(planes[:, : int(bits)].reshape(-1), jnp.zeros((0,), jnp.uint8), scales)


def dequantize_uniform(packed: Packed, bits: float, mseed, local=None) -> jax.Array:
    gscale = jnp.repeat(packed.scales, GROUPS_PER_BLOCK)
    width = jnp.full(gscale.shape, int(bits), jnp.int32)
    planes = jnp.pad(packed.words.reshape(-1, int(bits)), ((0, 0), (0, MAX_BITS - int(bits))))
    local = None if local is None else local.reshape(-1, GROUP)
    return _group_impl[1](planes, gscale, width, mseed, local=local).reshape(-1)


QUANTIZERS = {"dynamiq": (quantize_dynamiq, dequantize_dynamiq), "uniform": (quantize_uniform, dequantize_uniform)}
