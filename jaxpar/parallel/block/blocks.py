"""A device's share of a block diffusion batch under block parallelism (this folder's ``__init__``),
inside jaxpar's shard_map.

Every device of the block axes receives its rows whole ([x_t ; x_0], 2L tokens) and keeps the
noisy blocks it owns, then the clean half: under BP all of it but the last block, which no noisy
block reads; under CSBP its piece of its ring rank's zigzag share (the clean half split over the
``context`` ring, each rank's share over the rank's devices). ``owned_blocks`` says which noisy blocks, in
dual-end pairs: with N blocks and P devices, device r owns the pairs (i, N-1-i) for i = r, r+P,
r+2P... below N/2. Noisy block g attends to itself and to the g clean blocks before it, so a pair
costs (i+1) + (N-i) = N+1 blocks of keys: every device the same.

The attention mask is the model's, evaluated at each held token's place in [x_t ; x_0]
(``attention.Mask.at``): the mask sees the global noisy block indices. Under CSBP the keys of
the noisy blocks stay where they are and the clean keys travel the ring, each ring rank's at the
places ``Share.ring_places`` gives. With ``clean_kv=fetch`` (a sliding window: a block reads the
few clean blocks before it, so every block costs the same past the first window) a device owns
noisy blocks inside its own clean chunks instead (``local_blocks``) and fetches, in one
all-to-all over ``context``, just the clean tokens before its chunks that its windows read
(``fetch_plan``). The loss is the mean over the tokens a device holds;
``Share.loss_scale`` turns the sum of those means over the devices into the mean over the rows'
noisy half that one device computes.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.attention import Fetch, Mask
from jaxpar.errors import LayoutError
from jaxpar.parallel.context.split_attention import FETCH, RING, sequence_order
from jaxpar.rules import _ACTIVE, _called

# the layout's role (``Layout.role``): the mesh axes the noisy blocks are split over
BLOCKS = "noisy_blocks"


def check_degree(num_blocks: int, ranks: int) -> None:
    """Refuse a BP degree whose devices cannot own the same number of dual-end pairs."""
    if ranks > 1 and num_blocks % (2 * ranks):
        valid = [p for p in range(1, num_blocks // 2 + 1) if num_blocks % (2 * p) == 0]
        raise LayoutError(
            f"block={ranks} cannot split {num_blocks} diffusion blocks per row: each device owns whole pairs of blocks "
            f"(i, {num_blocks}-1-i), so the number of blocks must be a multiple of 2 x {ranks} = {2 * ranks}"
            f"{' (more devices than pairs)' if ranks > num_blocks // 2 else ''}. With {num_blocks} blocks use block= one of "
            f"{', '.join(map(str, valid)) or 'none (fewer than 2 blocks)'}, or a --seq-len that gives a multiple of {2 * ranks} blocks")


def check_ring(length: int, ring: int) -> None:
    """Refuse a clean half the context ring's zigzag cannot split."""
    if ring > 1 and length % (2 * ring):
        raise LayoutError(f"context={ring} splits the clean half of {length} tokens into 2 x {ring} zigzag chunks: use a "
                          f"--seq-len that is a multiple of {2 * ring}, e.g. {(length // (2 * ring) + 1) * 2 * ring}")


def owned_blocks(num_blocks: int, ranks: int) -> np.ndarray:
    """(ranks, num_blocks // ranks) int: the noisy blocks each device owns, ascending."""
    check_degree(num_blocks, ranks)
    pairs = num_blocks // 2
    return np.array([sorted(b for i in range(r, pairs, ranks) for b in (i, num_blocks - 1 - i)) for r in range(ranks)],
                    dtype=np.int32).reshape(ranks, num_blocks // ranks)


def local_blocks(num_blocks: int, ranks: int, ring: int) -> np.ndarray:
    """(ranks, num_blocks // ranks) int: under ``clean_kv=fetch``, the noisy blocks each device
    owns: those of its ring rank's two zigzag chunks of the clean half, dealt round-robin over the
    ranks / ring devices that share that ring rank."""
    if num_blocks % (2 * ring) or num_blocks % ranks:
        raise LayoutError(f"clean_kv=fetch deals the {num_blocks} blocks of a row in 2 x {ring} zigzag chunks over {ranks} "
                          f"devices: the number of blocks must be a multiple of {math.lcm(2 * ring, ranks)}; change --seq-len "
                          f"or --block-size")
    chunk, groups = num_blocks // (2 * ring), ranks // ring
    out = []
    for r in range(ranks):
        group, c = divmod(r, ring)
        mine = [*range(c * chunk, (c + 1) * chunk), *range((2 * ring - 1 - c) * chunk, (2 * ring - c) * chunk)]
        out.append(mine[group::groups])
    return np.array(out, dtype=np.int32)


def clean_places(length: int, ring: int, replicas: int = 1) -> np.ndarray:
    """(ring, length / ring) int: the places in [x_t ; x_0] of each ring rank's clean tokens, in
    the order its ``replicas`` devices' pieces (``held_places``) put them side by side."""
    check_ring(length, ring)
    if length % (2 * ring * replicas):
        raise LayoutError(f"block parallelism splits each of the clean half's 2 x {ring} zigzag chunks over {replicas} devices: "
                          f"use a --seq-len that is a multiple of {2 * ring * replicas}")
    chunks = (length + sequence_order(length, ring)).reshape(ring, 2, replicas, -1)
    # replica g takes piece g of its rank's early chunk and piece R-1-g of the late one: every
    # piece then does about the same causal work
    pieces = np.concatenate([chunks[:, 0], chunks[:, 1, ::-1]], axis=2)  # (ring, replicas, tokens)
    return pieces.reshape(ring, -1).astype(np.int32)


def clean_prefix(length: int, block_size: int) -> int:
    """The clean tokens pure BP computes: no noisy block reads the last clean block (block g reads
    the g before it), so every device stops one block short of the clean half."""
    return length - block_size


def held_places(length: int, block_size: int, ranks: int, ring: int = 1, fetch: bool = False) -> np.ndarray:
    """(ranks, tokens held) int: the places in [x_t ; x_0] each device holds, its noisy blocks then
    its clean tokens; ``fetch``: the noisy blocks of ``clean_kv=fetch`` (``local_blocks``). Device
    r is ring rank r % ring (the ring is the inner axis) and replica r // ring of that rank.
    Without a ring every device holds the clean prefix (``clean_prefix``); on a ring the ranks / ring
    replicas of a rank each hold a piece of its share (the fetch: each the whole share)."""
    owned = local_blocks(length // block_size, ranks, ring) if fetch else owned_blocks(length // block_size, ranks)
    noisy = (owned[:, :, None] * block_size + np.arange(block_size)).reshape(ranks, -1)
    if ring == 1:
        clean = np.broadcast_to(length + np.arange(clean_prefix(length, block_size)), (ranks, clean_prefix(length, block_size)))
    elif fetch:
        clean = clean_places(length, ring)[np.arange(ranks) % ring]
    else:
        replicas = ranks // ring
        pieces = clean_places(length, ring, replicas).reshape(ring, replicas, -1)
        clean = pieces[np.arange(ranks) % ring, np.arange(ranks) // ring]
    return np.concatenate([noisy, clean], axis=1).astype(np.int32)


def keys_read(places: np.ndarray, length: int, block_size: int, window: int | None = None) -> np.ndarray:
    """The keys the query at each place of [x_t ; x_0] reads under the three-part mask: a noisy
    token of block g its own block and g clean blocks, a clean token of block c the c+1 clean
    blocks up to its own; at most ``window`` / B clean blocks before their own under a window."""
    before = np.where(places < length, places // block_size, (places - length) // block_size)
    if window is not None:
        before = np.minimum(before, window // block_size)
    return (before + 1) * block_size


def attention_work(length: int, block_size: int, ranks: int, ring: int = 1, window: int | None = None, fetch: bool = False) -> np.ndarray:
    """(ranks,) query-key pairs each device's share attends over, per head and row."""
    return keys_read(held_places(length, block_size, ranks, ring, fetch), length, block_size, window).sum(axis=1)


def fetch_plan(reads, length: int, block_size: int, ranks: int, ring: int) -> tuple[np.ndarray, np.ndarray]:
    """What each device sends and receives in the one all-to-all over the ring (``clean_kv=fetch``):
    (send (ranks, ring, S): indices of a device's keys it sends each ring rank of its group,
    received (ranks, ring x S): the places of the keys it gets, -1 for padding). ``reads(qb)``:
    the clean mask blocks (N..2N-1) query block ``qb`` reads. S, the slot, is the most tokens one
    device needs from another."""
    places = held_places(length, block_size, ranks, ring, fetch=True)
    clean = clean_places(length, ring)
    owner = {int(p): (c, i) for c in range(ring) for i, p in enumerate(clean[c])}  # place -> (ring rank, index in its share)
    before = length // ranks  # a device's keys: its noisy tokens, then its clean share
    wanted = [[[] for _ in range(ring)] for _ in range(ranks)]  # [device][source ring rank]: (key index there, place)
    for r in range(ranks):
        own = set(clean[r % ring].tolist())
        blocks = sorted({kb for qb in set((places[r] // block_size).tolist()) for kb in reads(qb)})
        for p in (p for kb in blocks for p in range(kb * block_size, (kb + 1) * block_size) if p not in own):
            src, i = owner[p]
            wanted[r][src].append((before + i, p))
    slot = max(1, max(len(w) for row in wanted for w in row))
    send = np.zeros((ranks, ring, slot), np.int32)
    received = np.full((ranks, ring, slot), -1, np.int32)
    for r in range(ranks):
        for src in range(ring):
            got = wanted[r][src]
            sender = r // ring * ring + src  # the device of ring rank src in r's group
            send[sender, r % ring, : len(got)] = [i for i, _ in got]
            received[r, src, : len(got)] = [p for _, p in got]
    return send, received.reshape(ranks, ring * slot)


@dataclasses.dataclass(frozen=True)
class Share:
    """This device's share of the rows: ``places`` (traced int, (tokens held,)) in the whole
    rows' [x_t ; x_0] of ``length`` tokens per half, of which the first ``noisy`` are its noisy
    blocks; ``ring_places`` (ring size, clean tokens per rank) under CSBP, else None; the loss
    scale (see the module doc); under ``clean_kv=fetch`` the ``block_size``, ranks and this
    device's index, from which ``mask`` plans the fetch."""

    places: jax.Array
    length: int
    noisy: int
    ring_places: jax.Array | None
    loss_scale: float
    fetch: tuple | None = None  # (block_size, ranks, ring, device index) under clean_kv=fetch

    def mask(self, mask: Mask) -> Mask:
        """``mask`` (over [x_t ; x_0]) evaluated at the held tokens' places."""
        if self.fetch is not None:
            block_size, ranks, ring, device = self.fetch
            send, received = fetch_plan(mask.blocks.allowed.clean_reads, self.length, block_size, ranks, ring)
            return mask.at(self.places, kv_fetch=Fetch(jnp.asarray(send)[device], jnp.asarray(received)[device]))
        if self.ring_places is None:
            return mask.at(self.places)
        return mask.at(self.places, self.places[: self.noisy], kv_ring=self.ring_places)


def _index(layout, axes) -> jax.Array:
    index = 0
    for axis in axes:  # mesh order: the first axis major
        index = index * layout.mesh.shape[axis] + jax.lax.axis_index(axis)
    return index


def share(batch: dict, block_size: int) -> tuple[dict, Share | None]:
    """(the batch cut to this device's share, its ``Share``) under block parallelism, else
    (``batch``, None). ``batch``: (rows, 2L) arrays of a block diffusion batch."""
    _called("block_share")
    active = _ACTIVE.get()
    layout = active.layout if active is not None and active.manual else None
    if layout is None or not layout.role(BLOCKS):
        return batch, None
    widths = {x.shape[1] for x in jax.tree.leaves(batch)}
    if len(widths) != 1 or next(iter(widths)) % 2:
        raise LayoutError(f"block parallelism cuts (rows, 2L) block diffusion batches; got widths {sorted(widths)}")
    length = next(iter(widths)) // 2
    ranks = math.prod(layout.mesh.shape[a] for a in layout.role(BLOCKS))
    ring = math.prod(layout.mesh.shape[a] for a in layout.role(RING))
    device = _index(layout, layout.role(BLOCKS))
    fetching = ring > 1 and bool(layout.role(FETCH))
    places = jnp.asarray(held_places(length, block_size, ranks, ring, fetching))[device]
    noisy = length // ranks
    ring_places = jnp.asarray(clean_places(length, ring, 1 if fetching else ranks // ring)) if ring > 1 else None
    fetch = (block_size, ranks, ring, device) if fetching else None
    held = places.shape[0]
    # each device's mean is over `held` tokens and the step sums the means over the P devices;
    # one device means over the 2L tokens of a row
    return ({key: jnp.take(x, places, axis=1) for key, x in batch.items()},
            Share(places, length, noisy, ring_places, held * ranks / (2 * length), fetch))
