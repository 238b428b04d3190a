"""How the training step sums gradients across batch axes: exactly, or compressed on the wire.

``TrainConfig.grad_sync`` names the choice:

- ``exact``: ``psum`` / ``psum_scatter`` in ``grad_reduce_dtype`` (the default; the step's program
  is the one it has always been);
- ``dynamiq``: ``collectives.compressed`` with scheme ``dynamiq`` (hierarchical block scales,
  per-group widths) at its default width, or ``grad_sync_bits`` average bits per value;
- ``int8``: the same collective with the naive per-hop quantizer (scheme ``uniform``, 8 bits), the
  baseline dynamiq is measured against.

Which batch axes are compressed (``grad_sync_axes``; ``None`` = the rule below) is resolved once,
when the ``Trainer`` is built, before any device memory is touched:

- the batch axes that cross the slow links between slices or nodes (``Layout.dcn_axes``, from the
  topology) when there are any: the fast ones inside a slice stay exact (``hierarchical.py``);
- otherwise (one slice, simulated CPU devices) every batch axis.

The reductions compressed are the gradient's reduce-scatters and all-reduces over those axes that
run once per optimizer step. With ``microbatches > 1`` the ones inside the micro-batch loop
(ZeRO-2's reduce-scatter of each micro-batch's gradient, ZeRO-3's reduce-scatter in the backward
of the weight gather) stay exact, and only the final reductions (DP / HSDP all-reduce, ZeRO-1
reduce-scatter) are compressed.
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import jax
import jax.numpy as jnp

from jaxpar.collectives import compressed, hierarchical
from jaxpar.collectives.quantize import check_bits
from jaxpar.errors import JaxparError, LayoutError
from jaxpar.kernels.wire import TWINS, GroupImpl

# name -> (scheme of collectives.compressed, bits; None = the scheme's default)
GRAD_SYNCS = {"exact": None, "dynamiq": ("dynamiq", None), "int8": ("uniform", 8)}


@dataclasses.dataclass(frozen=True)
class GradSync:
    """A resolved compressed gradient sync: what to compress, and how."""

    name: str  # dynamiq | int8
    scheme: str
    bits: float | None
    axes: tuple[str, ...]  # the batch mesh axes whose reductions are compressed
    min_size: int  # values per rank below which a collective stays exact
    # the per-group encode / decode: the pure-JAX twins, or kernels.quantize.pallas_impl() (same bits)
    impl: GroupImpl = TWINS

    def compresses(self, axes) -> bool:
        return any(a in self.axes for a in axes)

    def reduce_scatter(self, x, axes, seed, tag: tuple):
        """``psum_scatter(x, axes, scatter_dimension=0, tiled=True)`` in float32, compressed over
        this sync's axes among ``axes``. ``tag`` names the reduction (see ``_tag``)."""
        return hierarchical.reduce_scatter(
            x, axes, self.axes, scheme=self.scheme, bits=self.bits, seed=hierarchical.fold_seed(seed, _tag(tag)),
            min_size=self.min_size, impl=self.impl,
        )

    def all_reduce(self, x, axes, seed, tag: tuple):
        """``psum(x, axes)`` in float32: exact inside the axes not compressed, compressed across the
        others. The result is the same on every rank, bit for bit, but typed as varying: call it
        where shard_map does not check types (``check_vma=False``)."""
        fast = tuple(a for a in axes if a not in self.axes)
        slow = tuple(a for a in axes if a in self.axes)
        return hierarchical.all_reduce(
            x, fast, slow, scheme=self.scheme, bits=self.bits, seed=hierarchical.fold_seed(seed, _tag(tag)),
            min_size=self.min_size, impl=self.impl,
        )

    def reduce_scatter_bucket(self, leaves, axes, seed, tag: tuple):
        """``reduce_scatter`` of several gradients at once, as one flat float32 buffer: one
        collective (and one set of block scales) instead of one per weight. ``leaves`` is a list
        of (gradient, scatter dim); returns the reduced shards in the same order."""
        ranks = math.prod(jax.lax.axis_size(a) for a in axes)
        moved = [jnp.moveaxis(g, dim, 0) for g, dim in leaves]
        rows = jnp.concatenate([m.reshape(ranks, -1).astype(jnp.float32) for m in moved], axis=1)
        reduced = self.reduce_scatter(rows, axes, seed, tag)[0]
        shapes = [(m.shape[0] // ranks,) + m.shape[1:] for m in moved]
        return [jnp.moveaxis(piece, 0, dim) for piece, (_, dim) in zip(unpack(reduced, shapes), leaves)]


def _tag(parts: tuple) -> int:
    """A stable 31-bit id of one reduction (from a tuple naming it), folded into its dither seed so
    that no two reductions of a step share a dither sequence. (The layers of one scanned stack do
    share theirs: their values differ, so their rounding errors do not line up.)"""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def pack(leaves) -> jax.Array:
    """Gradients flattened into one float32 vector (a bucket)."""
    return jnp.concatenate([g.reshape(-1).astype(jnp.float32) for g in leaves])


def unpack(vector, shapes) -> list:
    """The inverse of ``pack`` for leaves of these shapes."""
    out, start = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(vector[start : start + n].reshape(shape))
        start += n
    return out


def step_seed(step) -> jax.Array:
    """The dither seed of a step: a new one every step, so quantization errors do not repeat."""
    return jnp.asarray(step).astype(jnp.uint32)


def resolve(cfg, layout) -> GradSync | None:
    """The compressed sync ``cfg`` asks for under ``layout``, or None for ``exact``.

    Raises ``JaxparError`` for an unknown name or bad bits, ``LayoutError`` for axes that are not
    batch axes or a layout with no batch axis to compress."""
    if cfg.grad_sync not in GRAD_SYNCS:
        raise JaxparError(f"grad_sync={cfg.grad_sync!r} is unknown; use one of {', '.join(GRAD_SYNCS)} (--grad-sync)")
    if GRAD_SYNCS[cfg.grad_sync] is None:
        return None
    scheme, bits = GRAD_SYNCS[cfg.grad_sync]
    if cfg.grad_sync_bits is not None:
        if cfg.grad_sync == "int8" and cfg.grad_sync_bits != 8:
            raise JaxparError(
                f"grad_sync=int8 sends 8 bits per value, but grad_sync_bits={cfg.grad_sync_bits}; "
                f"leave the bits unset, or use grad_sync=dynamiq with --grad-sync-bits {cfg.grad_sync_bits}"
            )
        bits = cfg.grad_sync_bits
    if cfg.grad_sync_min_size < 1:
        raise JaxparError(f"grad_sync_min_size={cfg.grad_sync_min_size} must be a positive number of values per rank")
    batch = layout.batch_axes
    where = ", ".join(f"{a}={d}" for a, d in layout.mesh.shape.items() if d > 1) or "one device"
    if not batch:
        raise LayoutError(
            f"grad_sync={cfg.grad_sync!r} compresses the gradient reductions over batch mesh axes (data, fsdp), "
            f"but this layout ({where}) splits the batch over none, so nothing would be compressed; use "
            f"grad_sync='exact' (--grad-sync exact) or give data or fsdp a degree above 1"
        )
    if cfg.grad_sync_axes is None:
        slow = tuple(a for a in batch if a in layout.dcn_axes)
        axes = slow or batch  # one slice: no link is slower than another, compress them all
    else:
        axes = tuple(cfg.grad_sync_axes)
        wrong = [a for a in axes if a not in batch]
        if wrong or not axes:
            raise LayoutError(
                f"grad_sync_axes={axes} must name batch mesh axes of this layout ({where}), whose batch axes are "
                f"{', '.join(batch)}; {'drop ' + ', '.join(map(repr, wrong)) if wrong else 'name at least one'} "
                f"(or leave it unset for the default: the axes that cross slow links, else all)"
            )
    try:
        check_bits(compressed.DEFAULT_BITS[scheme] if bits is None else bits, scheme)
    except ValueError as err:
        raise JaxparError(f"grad_sync={cfg.grad_sync!r} with grad_sync_bits={bits}: {err}; change --grad-sync-bits") from None
    return GradSync(cfg.grad_sync, scheme, bits, axes, cfg.grad_sync_min_size)
