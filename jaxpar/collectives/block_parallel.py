"""A device's share of a block diffusion batch under block parallelism (``parallel/block.py``),
inside jaxpar's shard_map.

Every device of the ``block`` axes receives its rows whole ([x_t ; x_0], 2L tokens) and keeps the
noisy blocks it owns, then the whole clean half: N/P + N blocks. ``owned_blocks`` says which, in
dual-end pairs: with N blocks and P devices, device r owns the pairs (i, N-1-i) for i = r, r+P,
r+2P... below N/2. Noisy block g attends to itself and to the g clean blocks before it, so a pair
costs (i+1) + (N-i) = N+1 blocks of keys: every device the same.

The attention mask is the model's, evaluated at each held token's place in [x_t ; x_0]
(``attention.Mask.at``): the mask sees the global noisy block indices. The loss is the mean over
the tokens a device holds; ``Share.loss_scale`` turns the sum of those means over the devices
into the mean over the rows' noisy half that one device computes.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.errors import LayoutError
from jaxpar.rules import _ACTIVE, _called


def check_degree(num_blocks: int, ranks: int) -> None:
    """Refuse a BP degree whose devices cannot own the same number of dual-end pairs."""
    if ranks > 1 and num_blocks % (2 * ranks):
        valid = [p for p in range(1, num_blocks // 2 + 1) if num_blocks % (2 * p) == 0]
        raise LayoutError(
            f"block={ranks} cannot split {num_blocks} diffusion blocks per row: each device owns whole pairs of blocks "
            f"(i, {num_blocks}-1-i), so the number of blocks must be a multiple of 2 x {ranks} = {2 * ranks}"
            f"{' (more devices than pairs)' if ranks > num_blocks // 2 else ''}. With {num_blocks} blocks use block= one of "
            f"{', '.join(map(str, valid)) or 'none (fewer than 2 blocks)'}, or a --seq-len that gives a multiple of {2 * ranks} blocks")


def owned_blocks(num_blocks: int, ranks: int) -> np.ndarray:
    """(ranks, num_blocks // ranks) int: the noisy blocks each device owns, ascending."""
    check_degree(num_blocks, ranks)
    pairs = num_blocks // 2
    return np.array([sorted(b for i in range(r, pairs, ranks) for b in (i, num_blocks - 1 - i)) for r in range(ranks)],
                    dtype=np.int32).reshape(ranks, num_blocks // ranks)


def held_places(length: int, block_size: int, ranks: int) -> np.ndarray:
    """(ranks, length / ranks + length) int: the places in [x_t ; x_0] each device holds."""
    owned = owned_blocks(length // block_size, ranks)
    noisy = (owned[:, :, None] * block_size + np.arange(block_size)).reshape(ranks, -1)
    clean = np.broadcast_to(length + np.arange(length), (ranks, length))
    return np.concatenate([noisy, clean], axis=1).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class Share:
    """This device's share of the rows: ``places`` (traced int, (tokens held,)) in the whole
    rows' [x_t ; x_0] of ``length`` tokens per half, and the loss scale (see the module doc)."""

    places: jax.Array
    length: int
    loss_scale: float


def share(batch: dict, block_size: int) -> tuple[dict, Share | None]:
    """(the batch cut to this device's share, its ``Share``) under block parallelism, else
    (``batch``, None). ``batch``: (rows, 2L) arrays of a block diffusion batch."""
    _called("block_share")
    active = _ACTIVE.get()
    layout = active.layout if active is not None and active.manual else None
    if layout is None or not layout.block_axes:
        return batch, None
    widths = {x.shape[1] for x in jax.tree.leaves(batch)}
    if len(widths) != 1 or next(iter(widths)) % 2:
        raise LayoutError(f"block parallelism cuts (rows, 2L) block diffusion batches; got widths {sorted(widths)}")
    length = next(iter(widths)) // 2
    ranks = math.prod(layout.mesh.shape[a] for a in layout.block_axes)
    rank = 0
    for axis in layout.block_axes:
        rank = rank * layout.mesh.shape[axis] + jax.lax.axis_index(axis)
    places = jnp.asarray(held_places(length, block_size, ranks))[rank]
    held = places.shape[0]
    # each device's mean is over `held` tokens and the step sums the means over the P devices;
    # one device means over the 2L tokens of a row
    return {key: jnp.take(x, places, axis=1) for key, x in batch.items()}, Share(places, length, held * ranks / (2 * length))
