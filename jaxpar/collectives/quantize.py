"""Quantizers for compressed collectives: what one hop of a compressed all-reduce puts on the wire.

DynamiQ-style (``dynamiq``), per block of ``GROUPS_PER_BLOCK`` groups of ``GROUP`` values:

- hierarchical scales: one float32 block scale (the block's largest magnitude) and one uint8 code
  per group, so a group's scale is ``block_scale * code / 255``, rounded up: every value of the
  group lies inside its own range, so nothing clips and no scale can overflow;
- a bit width per group, chosen from the group scales by greedy water-filling of a fixed budget
  of ``bits`` x ``GROUPS_PER_BLOCK`` bit planes per block: wide groups get more bits, narrow ones
  fewer, so the error is spent where the values are. The receiver recomputes the same widths from
  the codes, so they cost nothing on the wire;
- rounding with a subtractive dither drawn from a key that sender and receiver share (the caller
  folds in hop and chunk): unbiased, and half the error variance of plain stochastic rounding;
- bit-plane packing: plane ``p`` of a group of 32 values is one uint32 word holding bit ``p`` of
  each value, so a block is a fixed ``bits x GROUPS_PER_BLOCK`` words whatever the widths.

The naive baseline (``uniform``): one float32 scale per block and the same width for every value
(the per-hop uniform quantizer compressed all-reduces are usually built from).

A ``Packed`` block list is what travels: its arrays' bytes are the wire bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

GROUP = 32  # values per group: one uint32 word per bit plane
GROUPS_PER_BLOCK = 8
BLOCK = GROUP * GROUPS_PER_BLOCK  # values per block (256)
MIN_BITS, MAX_BITS = 2, 12  # per-group widths the water-filling may choose


class Packed(NamedTuple):
    """Quantized blocks: ``words`` uint32 [blocks, planes, ...]; ``codes`` uint8 group scale codes
    (empty for the uniform quantizer); ``scales`` float32 block scales."""

    words: jax.Array
    codes: jax.Array
    scales: jax.Array


def wire_bits_per_value(bits: int, scheme: str) -> float:
    """Bits on the wire per coordinate, scales included."""
    if scheme == "dynamiq":
        return bits + (8 * GROUPS_PER_BLOCK + 32) / BLOCK
    return bits + 32 / BLOCK


def _levels(bits):
    """Positive levels of a signed ``bits``-bit code: values run over [-L, L]."""
    return 2.0 ** (bits - 1) - 1.0


def allocate_bits(codes: jax.Array, bits: int) -> jax.Array:
    """Per-group widths [blocks, GROUPS_PER_BLOCK] from the uint8 scale codes: every group starts
    at MIN_BITS; each further plane of the budget goes to the group whose error it cuts most
    (error of a group ~ (scale / levels)^2). Deterministic: ties go to the lowest group."""
    if not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"bits={bits} must be in [{MIN_BITS}, {MAX_BITS}]")
    scale2 = jnp.square(codes.astype(jnp.float32))
    width = jnp.full(codes.shape, MIN_BITS, jnp.int32)

    def add_plane(_, width):
        now = scale2 / jnp.square(_levels(width))
        after = scale2 / jnp.square(_levels(jnp.minimum(width + 1, MAX_BITS)))
        gain = jnp.where(width < MAX_BITS, now - after, -1.0)
        pick = jax.nn.one_hot(jnp.argmax(gain, axis=-1), GROUPS_PER_BLOCK, dtype=jnp.int32)
        return width + pick

    return jax.lax.fori_loop(0, (bits - MIN_BITS) * GROUPS_PER_BLOCK, add_plane, width)


def _pack_planes(unsigned: jax.Array, planes: int) -> jax.Array:
    """[..., GROUP] non-negative ints -> [..., planes] uint32 words, word p = bit p of each value."""
    bit = jnp.arange(GROUP, dtype=jnp.uint32)
    shifted = (unsigned[..., None, :].astype(jnp.uint32) >> jnp.arange(planes, dtype=jnp.uint32)[:, None]) & 1
    return jnp.sum(shifted << bit, axis=-1, dtype=jnp.uint32)


def _unpack_planes(words: jax.Array) -> jax.Array:
    """[..., planes] uint32 -> [..., GROUP] values (inverse of _pack_planes)."""
    planes = words.shape[-1]
    bit = jnp.arange(GROUP, dtype=jnp.uint32)
    bits = (words[..., :, None] >> bit) & 1  # [..., planes, GROUP]
    return jnp.sum(bits << jnp.arange(planes, dtype=jnp.uint32)[:, None], axis=-2, dtype=jnp.uint32)


def _dither(key: jax.Array | None, shape) -> jax.Array:
    """The shared dither: uniform in [-1/2, 1/2) from ``key`` (zero without a key: plain rounding).

    Subtractive dithering: the sender rounds ``x + d``, the receiver, who derives the same ``d``
    from the same key, subtracts it. The error is then uniform on [-1/2, 1/2) steps whatever x
    is: unbiased, with half the variance of stochastic rounding."""
    if key is None:
        return jnp.zeros(shape, jnp.float32)
    return jax.random.uniform(key, shape, jnp.float32) - 0.5


def _block_scale(blocks: jax.Array) -> jax.Array:
    """Largest magnitude per block; NaN when the block holds a NaN or an infinity, so that a
    non-finite input comes out as NaN instead of as finite garbage."""
    finite = jnp.all(jnp.isfinite(blocks), axis=-1)
    return jnp.where(finite, jnp.max(jnp.abs(blocks), axis=-1), jnp.nan)


def quantize_dynamiq(x: jax.Array, bits: int, key: jax.Array | None) -> Packed:
    """x: float32 [blocks * BLOCK] -> Packed (see the module doc)."""
    blocks = x.reshape(-1, GROUPS_PER_BLOCK, GROUP)
    scale = _block_scale(blocks.reshape(blocks.shape[0], -1))
    group_max = jnp.max(jnp.abs(blocks), axis=-1)
    safe = jnp.where(scale > 0, scale, 1.0)[:, None]
    codes = jnp.clip(jnp.ceil(group_max / safe * 255.0), 0, 255).astype(jnp.uint8)
    width = allocate_bits(codes, bits)
    levels = _levels(width)
    step = _step(scale[:, None] * codes.astype(jnp.float32) / 255.0, levels)
    # |value| <= group_scale = (levels - 1/2) steps, and |dither| <= 1/2: |q| <= levels, no clipping
    q = jnp.round(blocks / step[..., None] + _dither(key, blocks.shape))
    unsigned = (q + levels[..., None]).astype(jnp.uint32)  # in [0, 2 * levels] < 2 ** width
    words = _pack_planes(unsigned, MAX_BITS)  # [blocks, groups, MAX_BITS]
    # keep each group's first `width` planes, back to back: a fixed bits * GROUPS_PER_BLOCK words
    offsets = jnp.cumsum(width, axis=-1) - width
    plane = jnp.arange(MAX_BITS)
    slot = jnp.where(plane < width[..., None], offsets[..., None] + plane, bits * GROUPS_PER_BLOCK)
    budget = jnp.zeros((blocks.shape[0], bits * GROUPS_PER_BLOCK + 1), jnp.uint32)
    rows = jnp.arange(blocks.shape[0])[:, None, None]
    packed = budget.at[rows, slot].set(words, mode="drop")[:, :-1]
    return Packed(packed, codes, scale)


def _step(group_scale, levels):
    """Quantization step of a group: its range spread over levels - 1/2 steps (room for the
    dither); 1 for an all-zero group, so that nothing divides by zero."""
    return jnp.where(group_scale > 0, group_scale / (levels - 0.5), 1.0)


def dequantize_dynamiq(packed: Packed, bits: int, key: jax.Array | None) -> jax.Array:
    """Packed -> float32 [blocks * BLOCK]; ``key`` must be the one it was quantized with."""
    width = allocate_bits(packed.codes, bits)
    levels = _levels(width)
    offsets = jnp.cumsum(width, axis=-1) - width
    plane = jnp.arange(MAX_BITS)
    slot = jnp.where(plane < width[..., None], offsets[..., None] + plane, 0)
    rows = jnp.arange(packed.words.shape[0])[:, None, None]
    words = jnp.where(plane < width[..., None], packed.words[rows, slot], 0)
    unsigned = _unpack_planes(words)  # [blocks, groups, GROUP]
    group_scale = packed.scales[:, None] * packed.codes.astype(jnp.float32) / 255.0
    step = _step(group_scale, levels)
    q = unsigned.astype(jnp.float32) - levels[..., None] - _dither(key, unsigned.shape)
    return jnp.where(group_scale[..., None] > 0, q * step[..., None], 0.0 * group_scale[..., None]).reshape(-1)


def quantize_uniform(x: jax.Array, bits: int, key: jax.Array | None) -> Packed:
    """The naive baseline: one scale per block, ``bits`` everywhere."""
    blocks = x.reshape(-1, BLOCK // GROUP, GROUP)
    scale = _block_scale(blocks.reshape(blocks.shape[0], -1))
    levels = _levels(bits)
    step = _step(scale, levels)[:, None, None]
    q = jnp.round(blocks / step + _dither(key, blocks.shape))
    words = _pack_planes((q + levels).astype(jnp.uint32), bits)
    return Packed(words, jnp.zeros((blocks.shape[0], 0), jnp.uint8), scale)


def dequantize_uniform(packed: Packed, bits: int, key: jax.Array | None) -> jax.Array:
    levels = _levels(bits)
    unsigned = _unpack_planes(packed.words)
    q = unsigned.astype(jnp.float32) - levels - _dither(key, unsigned.shape)
    scale = packed.scales[:, None, None]
    return jnp.where(scale > 0, q * _step(scale, levels), 0.0 * scale).reshape(-1)


QUANTIZERS = {"dynamiq": (quantize_dynamiq, dequantize_dynamiq), "uniform": (quantize_uniform, dequantize_uniform)}
