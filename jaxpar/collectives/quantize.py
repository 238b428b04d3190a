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

The group-level format (sizes, ``Packed``, the dither) and the per-group work live in
``jaxpar.kernels.wire``. The whole-message functions here are given that work as ``impl`` (a
``GroupImpl``): the pure-JAX twins (``TWINS``, the default) or the Pallas kernels
(``jaxpar.kernels.quantize.pallas_impl``), equal to the bit. Scales and widths are cheap
reductions over the group scales and stay in XLA.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.kernels.wire import BLOCK, GROUP, GROUPS_PER_BLOCK, MAX_BITS, MIN_BITS, TWINS, GroupImpl, Packed, levels
from jaxpar.rules import vary_over, varying_axes


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
    inv2 = lambda w: 1.0 / (levels(w) - 0.5) ** 2  # noqa: E731
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
    bounds = tuple(vary_over(b, varying_axes(top)) for b in bounds)  # inside shard_map: the carry varies like the scales
    _, t = jax.lax.fori_loop(0, 31, halve, bounds)
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


# --- whole messages: ``impl`` does the per-group work (the twins, or the kernels' GroupImpl) ------


def quantize_dynamiq(x: jax.Array, bits: float, mseed, *, impl: GroupImpl = TWINS) -> Packed:
    """float32 [blocks * BLOCK] -> Packed (see the module doc)."""
    scales, codes = block_scales(x)
    gscale = group_scales(scales, codes)
    budget = budget_words(x.size, bits)
    width = allocate_bits(gscale, budget)
    planes = impl.encode(x.reshape(-1, GROUP), gscale, width, mseed)
    return Packed(compact(planes, width, budget), codes, scales)


def dequantize_dynamiq(packed: Packed, bits: float, mseed, local=None, *, impl: GroupImpl = TWINS) -> jax.Array:
    """Packed -> float32 [blocks * BLOCK] (+ ``local``); ``mseed`` must be the sender's."""
    gscale = group_scales(packed.scales, packed.codes)
    width = allocate_bits(gscale, packed.words.shape[0])
    planes = expand(packed.words, width)
    local = None if local is None else local.reshape(-1, GROUP)
    return impl.decode(planes, gscale, width, mseed, local=local).reshape(-1)


def quantize_uniform(x: jax.Array, bits: float, mseed, *, impl: GroupImpl = TWINS) -> Packed:
    """The naive baseline: one scale per block, ``bits`` everywhere."""
    scales, _ = block_scales(x)
    gscale = jnp.repeat(scales, GROUPS_PER_BLOCK)
    width = jnp.full(gscale.shape, int(bits), jnp.int32)
    planes = impl.encode(x.reshape(-1, GROUP), gscale, width, mseed)
    return Packed(planes[:, : int(bits)].reshape(-1), jnp.zeros((0,), jnp.uint8), scales)


def dequantize_uniform(packed: Packed, bits: float, mseed, local=None, *, impl: GroupImpl = TWINS) -> jax.Array:
    gscale = jnp.repeat(packed.scales, GROUPS_PER_BLOCK)
    width = jnp.full(gscale.shape, int(bits), jnp.int32)
    planes = jnp.pad(packed.words.reshape(-1, int(bits)), ((0, 0), (0, MAX_BITS - int(bits))))
    local = None if local is None else local.reshape(-1, GROUP)
    return impl.decode(planes, gscale, width, mseed, local=local).reshape(-1)


QUANTIZERS = {"dynamiq": (quantize_dynamiq, dequantize_dynamiq), "uniform": (quantize_uniform, dequantize_uniform)}
