"""Pallas kernels for the per-group work of the compressed all-reduce's quantizer.

``encode_groups_kernel`` / ``decode_groups_kernel`` compute exactly what their pure-JAX twins
``jaxpar.kernels.wire.encode_groups`` / ``decode_groups`` compute (the twins' arguments plus the
backend; equal to the bit on the backends the tests cover), in one pass over the values: encode =
scale, dither, round and bit-plane pack; decode = unpack, undither, scale and, on a reduce hop,
add the local values (the fused dequantize-accumulate). The dither is drawn inside the kernel from
``mseed`` and each value's index in the message, with the twins' own hash (``wire.dither_at``).
``pallas_impl(backend)`` hands the pair to the quantizers and compressed collectives (their
``impl=`` argument).

Two lowerings:

- ``backend="tpu"`` (Mosaic). Values [groups, 32] are viewed, for free, as lane-dense rows of 128
  lanes = 4 groups ([groups / 4, 128]); a tile of ``R`` rows (R a multiple of 128) is transposed in
  VMEM (XLU) to [128, R], so that slab ``k`` (rows 32k..32k+31) holds group ``4r + k`` in lane
  ``r`` with its 32 values on sublanes. Packing a plane is then a sublane reduction and every
  vector op runs on full (8, 128) vregs. The 48 words of a row's 4 groups go through a [128, R]
  VMEM scratch and one transpose back, so planes leave as [groups / 4, 48] = [groups, 12] with no
  XLA transpose of the values or the planes. Per-group scales and widths travel as [4, groups / 4]
  (group 4r + k at [k, r]): that transpose is done by XLA on arrays 1/32 of the values' size
  (8 bytes per group, against 176 (encode) or 304 (decode + accumulate) bytes of values and
  planes per group).
- ``backend="gpu"`` (Triton). A program takes a tile of ``GPU_TILE`` groups as [tile, 32]; a
  plane is a reduction over the 32 lanes of a group, stored as column ``p`` of the [tile, 12]
  output block (power-of-two loads and stores only, as Triton wants).

Group counts that are not a multiple of the tile are padded in the wrappers (padded groups have
scale 0) and sliced back. On a machine without the accelerator the kernels run in Pallas's
interpret mode (``interpret=True``), which is what the CPU tests do.

Numerics that keep the kernels bitwise equal to the twins: the levels 2^(w-1) - 1 are built from
the float exponent bits (exact, as the twins' ``2.0 ** (w - 1)`` is); rounding is
round-half-to-even (``lax.round`` on TPU; on GPU, where Triton has no rounding op, from ``floor``);
a NaN value encodes as code 0, as XLA's saturating float -> uint32 conversion gives; divisions
keep the twins' operands and order (Triton and XLA:GPU both divide with ``div.full.f32``). The
accumulate stays a separate float32 add after the multiply (on GPU an ``add.rn`` the compiler
cannot fuse): the twin's result run op by op. Under jit XLA may contract the twin's multiply,
select and add into an FMA (XLA:CPU does), so a jitted twin's decode + accumulate can differ from
the kernels in the last bit of some sums; nothing else does, and no rank needs another rank's sums
to the bit (ranks agree on what crosses the wire: the encoded planes, which match exactly).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxpar.kernels.wire import GROUP, MAX_BITS, GroupImpl, dither_at, group_step

LANES = 128
GROUPS_PER_ROW = LANES // GROUP  # 4 groups per 128-lane row (TPU layout)
TPU_ROWS = 512  # rows of 128 values per TPU tile: 2048 groups, 256 KiB of float32
GPU_TILE = 128  # groups per Triton program: 4096 values
GPU_WARPS = 4
GPU_UNFUSED_ADD = True  # the accumulate as PTX add.rn (see _add_unfused); False: a plain add
BACKENDS = ("tpu", "gpu")


# --- the per-value arithmetic, shared by both lowerings --------------------------------------------


def _levels(width):
    """2^(w-1) - 1 as float32, from the exponent bits: exact, and no pow or vector shift."""
    return jax.lax.bitcast_convert_type((width + 126) << 23, jnp.float32) - 1.0


def _round_even(x, backend):
    """jnp.round's round-half-to-even (inf and NaN pass through)."""
    if backend == "tpu":
        return jax.lax.round(x, jax.lax.RoundingMethod.TO_NEAREST_EVEN)
    # Triton has no rounding op (and XLA folds the add-and-subtract-2^23 trick away in interpret
    # mode), so from floor: x - floor(x) is exact for |x| >= 1, and in (-1, 0) it can only round to
    # a fraction > 1/2 or to a tie that goes to 0 anyway
    f = jnp.floor(x)
    frac = x - f
    odd = f - 2.0 * jnp.floor(0.5 * f) == 1.0
    return jnp.where((frac > 0.5) | ((frac == 0.5) & odd), f + 1.0, f)


def _codes(v, scale, width, d, backend):
    """float32 values -> int32 codes q + L in [0, 2L] (the twins' ``unsigned``)."""
    levels = _levels(width)
    x = v / group_step(scale, levels)
    if d is not None:
        x = x + d
    r = jnp.minimum(jnp.maximum(_round_even(x, backend), -levels), levels)
    # a NaN value: code 0, what XLA's float -> uint32 conversion gives the twin (Triton's maximum
    # drops NaN, Mosaic's keeps it: so say it explicitly)
    return jnp.where(r == r, r + levels, 0.0).astype(jnp.int32)


def _values(u, scale, width, d):
    """int32 codes -> float32 values, in the twins' order: (u - L) - d, then times the step."""
    levels = _levels(width)
    x = u.astype(jnp.float32) - levels
    if d is not None:
        x = x - d
    return jnp.where(scale > 0, x * group_step(scale, levels), 0.0 * scale)


def _dither(seeds, index):
    """Dither at int32 value ``index`` (relative to ``start``), from the [[mseed, start]] words ref."""
    mseed = seeds[0, 0].astype(jnp.uint32)
    start = seeds[0, 1].astype(jnp.uint32)
    return dither_at(mseed, start + index.astype(jnp.uint32))


def _seed_words(mseed, start):
    """[[mseed, start]] as int32 words (their uint32 bits), as the kernels read them. Shape [1, 2]:
    under vmap it becomes [batch, 1, 2], whose blocks Mosaic accepts (a [batch, 2] it would not)."""
    start = jnp.asarray(start).astype(jnp.uint32)  # as the twins' dither converts it
    words = jnp.stack([jnp.asarray(mseed).astype(jnp.uint32), start])[None]
    return jax.lax.bitcast_convert_type(words, jnp.int32)


def _check(values_or_planes, minor, group_scale, width, what):
    shape = values_or_planes.shape
    if values_or_planes.ndim != 2 or shape[1] != minor:
        raise ValueError(f"{what}: expected shape [groups, {minor}], got {shape}")
    if group_scale.shape != (shape[0],) or width.shape != (shape[0],):
        raise ValueError(
            f"{what}: group_scale {group_scale.shape} and width {width.shape} must both be [{shape[0]}] "
            f"(one per group of {what})"
        )


def _pad_groups(n, tile, *arrays):
    """Pad axis 0 of each array to a multiple of ``tile`` with zeros (so padded groups have scale
    0); the wrappers slice them off again."""
    extra = -n % tile
    if not extra:
        return arrays
    return tuple(jnp.pad(a, [(0, extra)] + [(0, 0)] * (a.ndim - 1)) for a in arrays)


# --- TPU (Mosaic) -----------------------------------------------------------------------------------


def _tpu_rows(groups: int) -> int:
    """Rows of 128 lanes per tile: TPU_ROWS, or fewer (a multiple of 128) for a small message."""
    rows = -(-groups // GROUPS_PER_ROW)
    return min(TPU_ROWS, -(-rows // LANES) * LANES)


def _tpu_group_major(a, groups_padded):
    """[groups] per-group values -> [4, groups / 4]: group 4r + k at [k, r], as a tile's slabs
    hold them (an XLA transpose of 1/32 of the values' bytes)."""
    return a.reshape(groups_padded // GROUPS_PER_ROW, GROUPS_PER_ROW).T


def _tpu_params(interpret):
    from jax.experimental.pallas import tpu as pltpu

    if interpret:
        return {"interpret": pltpu.InterpretParams()}
    return {"compiler_params": pltpu.CompilerParams(dimension_semantics=("parallel",))}


def _tpu_slab_index(rows, k):
    """int32 [32, rows]: index in the message, less ``start``, of slab ``k``'s values."""
    r = jax.lax.broadcasted_iota(jnp.int32, (GROUP, rows), 1)
    j = jax.lax.broadcasted_iota(jnp.int32, (GROUP, rows), 0)
    group = (pl.program_id(0) * rows + r) * GROUPS_PER_ROW + k
    return group * GROUP + j


def _tpu_encode_kernel(seeds_ref, values_ref, scale_ref, width_ref, out_ref, words_ref, *, seeded):
    rows = values_ref.shape[0]
    vt = values_ref[...].T  # [128, rows]: slab k = rows 32k.., group 4r + k in lane r
    j = jax.lax.broadcasted_iota(jnp.int32, (GROUP, rows), 0)
    plane = jax.lax.broadcasted_iota(jnp.int32, (MAX_BITS, 1, 1), 0)
    for k in range(GROUPS_PER_ROW):
        d = _dither(seeds_ref, _tpu_slab_index(rows, k)) if seeded else None
        u = _codes(vt[k * GROUP : (k + 1) * GROUP], scale_ref[k : k + 1], width_ref[k : k + 1], d, "tpu")
        # bit p of value j goes to bit j of word p: a sublane reduction (no carries: the bits are
        # disjoint, so int32 wrap-around of bit 31 is harmless)
        bits = ((u[None] >> plane) & 1) << j[None]  # [12, 32, rows]
        words_ref[k * MAX_BITS : (k + 1) * MAX_BITS, :] = jnp.sum(bits, axis=1)
    # rows 12k + p -> [rows, 48]: the [groups, 12] layout of the twin (rows 48.. are not read back)
    out_ref[...] = jax.lax.bitcast_convert_type(words_ref[...].T[:, : GROUPS_PER_ROW * MAX_BITS], jnp.uint32)


def _tpu_decode_kernel(seeds_ref, planes_ref, scale_ref, width_ref, *rest, seeded, accumulate):
    if accumulate:
        local_ref, out_ref, planes_scr, words_scr, values_scr = rest
    else:
        local_ref, (out_ref, planes_scr, words_scr, values_scr) = None, rest
    rows = planes_ref.shape[0]
    planes_scr[:, : GROUPS_PER_ROW * MAX_BITS] = jax.lax.bitcast_convert_type(planes_ref[...], jnp.int32)
    words_scr[...] = planes_scr[...].T  # row 12k + p: plane p of group 4r + k in lane r
    j = jax.lax.broadcasted_iota(jnp.int32, (1, GROUP, rows), 1)
    plane = jax.lax.broadcasted_iota(jnp.int32, (MAX_BITS, 1, 1), 0)
    for k in range(GROUPS_PER_ROW):
        words = words_scr[k * MAX_BITS : (k + 1) * MAX_BITS, :][:, None, :]  # [12, 1, rows]
        u = jnp.sum(((words >> j) & 1) << plane, axis=0)  # [32, rows]: disjoint bits again
        d = _dither(seeds_ref, _tpu_slab_index(rows, k)) if seeded else None
        values_scr[k * GROUP : (k + 1) * GROUP, :] = _values(u, scale_ref[k : k + 1], width_ref[k : k + 1], d)
    values = values_scr[...].T  # back to [rows, 128] = [groups, 32] order
    out_ref[...] = values + local_ref[...] if accumulate else values


def _encode_tpu(values, group_scale, width, mseed, start, interpret):
    from jax.experimental.pallas import tpu as pltpu

    groups = values.shape[0]
    rows = _tpu_rows(groups)
    tile = rows * GROUPS_PER_ROW
    values, group_scale, width = _pad_groups(groups, tile, values, group_scale, width)
    padded = values.shape[0]
    row_spec = lambda minor: pl.BlockSpec((rows, minor), lambda i: (i, 0))  # noqa: E731
    group_spec = pl.BlockSpec((GROUPS_PER_ROW, rows), lambda i: (0, i))
    out = pl.pallas_call(
        functools.partial(_tpu_encode_kernel, seeded=mseed is not None),
        out_shape=jax.ShapeDtypeStruct((padded // GROUPS_PER_ROW, GROUPS_PER_ROW * MAX_BITS), jnp.uint32),
        grid=(padded // tile,),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), row_spec(LANES), group_spec, group_spec],
        out_specs=row_spec(GROUPS_PER_ROW * MAX_BITS),
        scratch_shapes=[pltpu.VMEM((LANES, rows), jnp.int32)],
        name="dynamiq_encode_groups",
        **_tpu_params(interpret),
    )(
        _seed_words(0 if mseed is None else mseed, start),
        values.reshape(-1, LANES),
        _tpu_group_major(group_scale, padded),
        _tpu_group_major(width, padded),
    )
    return out.reshape(padded, MAX_BITS)[:groups]


def _decode_tpu(planes, group_scale, width, mseed, start, local, interpret):
    from jax.experimental.pallas import tpu as pltpu

    groups = planes.shape[0]
    rows = _tpu_rows(groups)
    tile = rows * GROUPS_PER_ROW
    arrays = (planes, group_scale, width) + (() if local is None else (local,))
    arrays = _pad_groups(groups, tile, *arrays)
    planes, group_scale, width = arrays[:3]
    padded = planes.shape[0]
    row_spec = lambda minor: pl.BlockSpec((rows, minor), lambda i: (i, 0))  # noqa: E731
    group_spec = pl.BlockSpec((GROUPS_PER_ROW, rows), lambda i: (0, i))
    inputs = [
        _seed_words(0 if mseed is None else mseed, start),
        planes.reshape(-1, GROUPS_PER_ROW * MAX_BITS),
        _tpu_group_major(group_scale, padded),
        _tpu_group_major(width, padded),
    ]
    in_specs = [pl.BlockSpec(memory_space=pltpu.SMEM), row_spec(GROUPS_PER_ROW * MAX_BITS), group_spec, group_spec]
    if local is not None:
        inputs.append(arrays[3].reshape(-1, LANES))
        in_specs.append(row_spec(LANES))
    out = pl.pallas_call(
        functools.partial(_tpu_decode_kernel, seeded=mseed is not None, accumulate=local is not None),
        out_shape=jax.ShapeDtypeStruct((padded // GROUPS_PER_ROW, LANES), jnp.float32),
        grid=(padded // tile,),
        in_specs=in_specs,
        out_specs=row_spec(LANES),
        scratch_shapes=[
            pltpu.VMEM((rows, LANES), jnp.int32),  # the planes, lane-padded for the transpose
            pltpu.VMEM((LANES, rows), jnp.int32),  # ... transposed: one row per (group slot, plane)
            pltpu.VMEM((LANES, rows), jnp.float32),  # decoded slabs, before the transpose back
        ],
        name="dynamiq_decode_groups",
        **_tpu_params(interpret),
    )(*inputs)
    return out.reshape(padded, GROUP)[:groups]


# --- GPU (Triton) -----------------------------------------------------------------------------------


def _gpu_params(interpret):
    if interpret:
        return {"interpret": True}
    from jax.experimental.pallas import triton as plt

    return {"compiler_params": plt.CompilerParams(num_warps=GPU_WARPS, num_stages=1)}


def _gpu_index(tile):
    """int32 [tile, 32]: index in the message, less ``start``, of this program's values."""
    g = pl.program_id(0) * tile + jax.lax.broadcasted_iota(jnp.int32, (tile, GROUP), 0)
    return g * GROUP + jax.lax.broadcasted_iota(jnp.int32, (tile, GROUP), 1)


def _gpu_encode_kernel(seeds_ref, values_ref, scale_ref, width_ref, out_ref, *, seeded):
    tile = values_ref.shape[0]
    d = _dither(seeds_ref, _gpu_index(tile)) if seeded else None
    u = _codes(values_ref[...], scale_ref[...][:, None], width_ref[...][:, None], d, "gpu")
    lane = jax.lax.broadcasted_iota(jnp.int32, (tile, GROUP), 1)
    for p in range(MAX_BITS):
        out_ref[:, p] = jnp.sum(((u >> p) & 1) << lane, axis=1).astype(jnp.uint32)  # disjoint bits


def _add_unfused(a, b):
    """a + b that the compiler cannot contract with the multiply before it into an FMA: PTX
    ``add.rn`` is never fused (plain ``add.f32`` may be), and LLVM does not look into inline asm."""
    from jax.experimental.pallas import triton as plt

    (out,) = plt.elementwise_inline_asm(
        "add.rn.f32 $0, $1, $2;",
        args=[a, b],
        constraints="=r,r,r",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)],
    )
    return out


def _gpu_decode_kernel(seeds_ref, planes_ref, scale_ref, width_ref, *rest, seeded, accumulate, unfused_add):
    local_ref, out_ref = rest if accumulate else (None, rest[0])
    tile = planes_ref.shape[0]
    lane = jax.lax.broadcasted_iota(jnp.int32, (tile, GROUP), 1)
    u = jnp.zeros((tile, GROUP), jnp.int32)
    for p in range(MAX_BITS):
        word = planes_ref[:, p].astype(jnp.int32)[:, None]
        u = u | (((word >> lane) & 1) << p)
    d = _dither(seeds_ref, _gpu_index(tile)) if seeded else None
    values = _values(u, scale_ref[...][:, None], width_ref[...][:, None], d)
    if accumulate:
        values = _add_unfused(values, local_ref[...]) if unfused_add else values + local_ref[...]
    out_ref[...] = values


def _encode_gpu(values, group_scale, width, mseed, start, interpret):
    groups = values.shape[0]
    tile = GPU_TILE
    values, group_scale, width = _pad_groups(groups, tile, values, group_scale, width)
    padded = values.shape[0]
    out = pl.pallas_call(
        functools.partial(_gpu_encode_kernel, seeded=mseed is not None),
        out_shape=jax.ShapeDtypeStruct((padded, MAX_BITS), jnp.uint32),
        grid=(padded // tile,),
        in_specs=[
            pl.BlockSpec((1, 2), lambda i: (0, 0)),
            pl.BlockSpec((tile, GROUP), lambda i: (i, 0)),
            pl.BlockSpec((tile,), lambda i: (i,)),
            pl.BlockSpec((tile,), lambda i: (i,)),
        ],
        out_specs=pl.BlockSpec((tile, MAX_BITS), lambda i: (i, 0)),
        name="dynamiq_encode_groups",
        **_gpu_params(interpret),
    )(_seed_words(0 if mseed is None else mseed, start), values, group_scale, width)
    return out[:groups]


def _decode_gpu(planes, group_scale, width, mseed, start, local, interpret):
    groups = planes.shape[0]
    tile = GPU_TILE
    arrays = _pad_groups(groups, tile, *((planes, group_scale, width) + (() if local is None else (local,))))
    padded = arrays[0].shape[0]
    in_specs = [
        pl.BlockSpec((1, 2), lambda i: (0, 0)),
        pl.BlockSpec((tile, MAX_BITS), lambda i: (i, 0)),
        pl.BlockSpec((tile,), lambda i: (i,)),
        pl.BlockSpec((tile,), lambda i: (i,)),
    ] + ([] if local is None else [pl.BlockSpec((tile, GROUP), lambda i: (i, 0))])
    kernel = functools.partial(
        _gpu_decode_kernel, seeded=mseed is not None, accumulate=local is not None, unfused_add=GPU_UNFUSED_ADD and not interpret
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((padded, GROUP), jnp.float32),
        grid=(padded // tile,),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((tile, GROUP), lambda i: (i, 0)),
        name="dynamiq_decode_groups",
        **_gpu_params(interpret),
    )(_seed_words(0 if mseed is None else mseed, start), *arrays)
    return out[:groups]


# --- entry points -----------------------------------------------------------------------------------


def _check_backend(backend):
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: the quantizer kernels exist for {BACKENDS}")


def encode_groups_kernel(values, group_scale, width, mseed, start=0, *, backend="tpu", interpret=False):
    """``wire.encode_groups`` as a Pallas kernel for ``backend`` ("tpu" or "gpu"):
    float32 [groups, 32] -> uint32 bit planes [groups, MAX_BITS]."""
    _check_backend(backend)
    _check(values, GROUP, group_scale, width, "values")
    values = values.astype(jnp.float32)
    group_scale, width = group_scale.astype(jnp.float32), width.astype(jnp.int32)
    if backend == "tpu":
        return _encode_tpu(values, group_scale, width, mseed, start, interpret)
    return _encode_gpu(values, group_scale, width, mseed, start, interpret)


def decode_groups_kernel(planes, group_scale, width, mseed, start=0, local=None, *, backend="tpu", interpret=False):
    """``wire.decode_groups`` as a Pallas kernel for ``backend``: uint32 [groups, MAX_BITS]
    -> float32 [groups, 32], plus ``local`` [groups, 32] in the same pass when given."""
    _check_backend(backend)
    _check(planes, MAX_BITS, group_scale, width, "planes")
    if local is not None and local.shape != (planes.shape[0], GROUP):
        raise ValueError(f"local: expected shape [{planes.shape[0]}, {GROUP}] like the decoded groups, got {local.shape}")
    planes = planes.astype(jnp.uint32)
    group_scale, width = group_scale.astype(jnp.float32), width.astype(jnp.int32)
    local = None if local is None else local.astype(jnp.float32)
    if backend == "tpu":
        return _decode_tpu(planes, group_scale, width, mseed, start, local, interpret)
    return _decode_gpu(planes, group_scale, width, mseed, start, local, interpret)


def pallas_impl(backend: str | None = None, interpret: bool | None = None) -> GroupImpl:
    """These kernels as the per-group work of the whole-message quantizers and the compressed
    collectives: pass it as their ``impl=`` (``quantize_dynamiq(x, bits, mseed, impl=...)``,
    ``compressed.all_reduce(..., impl=...)``). ``backend`` None: the default device's ("gpu" on a
    GPU, else "tpu"); ``interpret`` None: only on CPU."""
    backend = ("gpu" if jax.default_backend() == "gpu" else "tpu") if backend is None else backend
    _check_backend(backend)
    interpret = jax.default_backend() == "cpu" if interpret is None else interpret
    return GroupImpl(
        functools.partial(encode_groups_kernel, backend=backend, interpret=interpret),
        functools.partial(decode_groups_kernel, backend=backend, interpret=interpret),
    )


__all__ = [
    "BACKENDS",
    "GPU_TILE",
    "TPU_ROWS",
    "decode_groups_kernel",
    "encode_groups_kernel",
    "pallas_impl",
]
