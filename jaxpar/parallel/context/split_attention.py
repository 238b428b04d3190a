"""Attention over a sequence split across devices (context parallelism), inside jaxpar's shard_map.

**The order devices hold the sequence in.** With a ring of R devices the sequence is cut into 2R
chunks and ring rank r holds chunks r and 2R-1-r (a zigzag, as in Megatron-LM): under a causal
mask every rank then does the same attention work. Inside a ring rank's share the all-to-all axes
(U devices) split it into U contiguous pieces. ``sequence_order`` is that order. The batch is
permuted by it on the host (``train/placement.py``) and split contiguously over the context axes,
so each device receives its own positions and per-token work (the loss, RoPE from the batch's
positions, segment ids) needs nothing more.

**The algorithms**, by the layout's roles (``RING``, ``A2A``; this folder's ``__init__``):

- all-to-all (DeepSpeed-Ulysses) over the ``a2a`` axes: q, k and v go from split by sequence to
  split by heads, each device attends over its ring share for heads/U of the heads with any
  implementation (splash on TPU), and the output goes back. Per layer and device, forward: 4
  all-to-alls (q, k, v, out), each sending (U-1)/U of its local bytes; backward: the same 4 for
  the cotangents (dout in; dq, dk, dv out).
- ring over the ``ring`` axes: K/V (and their segment ids) travel the ring by ``ppermute``, the
  next transfer issued before the current chunk is computed so the two can overlap; partial
  results are merged by the online-softmax rule (``attention.merge``). Per layer and device,
  forward: R-1 transfers of the local K/V, (R-1)/R of the layer's K/V bytes for this device's
  batch rows. Backward (a custom VJP; autodiff would keep every step's K/V): K/V travel the ring
  again, R-1 transfers, and their float32 gradients travel with them and go home, R transfers:
  (R-1)/R x K/V bytes + R/R x K/V elements x 4 bytes. Each chunk pair runs the blockwise kernel
  whatever the implementation (splash keeps no log-sum-exp to merge by here). Under a causal mask
  each step runs the pairs its rule needs; under a block mask (block diffusion) a pair the mask
  leaves without an allowed entry is skipped whole (``chunk_pairs``, a ``lax.cond`` on the ring
  ranks: a clean query never reads a noisy key).
- hybrid (USP): the all-to-all inside groups of U, then the ring across the R groups.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import attention as att
from jaxpar.errors import LayoutError

# the layout's roles (``Layout.role``): the mesh axes K/V travel a ring over, and those the
# sequence is re-split to heads over around attention (all-to-all); the sequence is split over both
RING = "context_ring"
A2A = "context_a2a"
# played by a strategy whose loss cuts each row's share itself (block parallelism): the step then
# leaves the batch's rows whole
SHARES = "own_row_shares"
# the axes over which each device fetches, in one all-to-all, the keys and values its rows' mask
# reads instead of a ring (block parallelism's clean_kv=fetch)
FETCH = "kv_fetch"
# the axes that split each ring rank's travelling keys further (block parallelism with more devices
# than ring ranks): each device computes a piece, and the pieces' K/V are all-gathered over these
# axes before the ring (their gradients reduce-scattered back)
RING_PIECES = "ring_pieces"


def sequence_order(length: int, ring: int) -> np.ndarray:
    """The global positions in the order the context axes hold them (contiguous pieces of this)."""
    chunks = np.arange(length).reshape(2 * ring, length // (2 * ring))
    return np.concatenate([np.concatenate([chunks[r], chunks[2 * ring - 1 - r]]) for r in range(ring)])


def required_multiple(ring: int, a2a: int) -> int:
    """What a sequence length must be a multiple of: 2R zigzag chunks, each ring share split U ways."""
    return math.lcm(2 * ring, ring * a2a)


def local_places(layout, length: int):
    """Where in its rows of ``length`` the positions this device holds sit (``sequence_order``,
    then its piece of it, counted ring major as the layout splits the sequence)."""
    axes = layout.axes_of("length")
    ring = math.prod(layout.mesh.shape[a] for a in layout.role(RING))
    pieces = math.prod(layout.mesh.shape[a] for a in axes)
    index = 0
    for axis in axes:
        index = index * layout.mesh.shape[axis] + jax.lax.axis_index(axis)
    return jnp.asarray(sequence_order(length, ring).reshape(pieces, -1))[index]


def local_sequences(batch, layout):
    """This device's positions of a batch, inside the step's shard_map (rows already its own): a
    (batch, length + 1) token array becomes ``{"inputs", "targets", "positions"}`` of shape
    (batch, length); every leaf of a dict of (batch, length) arrays is cut to the positions this
    device holds (``local_places``)."""
    if not isinstance(batch, dict):
        tokens = batch
        n = tokens.shape[1] - 1
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": jnp.broadcast_to(jnp.arange(n), (tokens.shape[0], n))}
    places = {n: local_places(layout, n) for n in {x.shape[1] for x in batch.values()}}
    return {key: jnp.take(x, places[x.shape[1]], axis=1) for key, x in batch.items()}


def check_heads(layout, weights: dict):
    """Refuse, before anything runs, weights whose query or key/value heads (``weights``: path ->
    (logical names, shape)) a device cannot split over the layout's all-to-all axes."""
    ways = math.prod(layout.mesh.shape[a] for a in layout.role(A2A))
    for path, (names, shape) in weights.items():
        for dim, name in enumerate(names):
            if name not in ("heads", "kv_heads"):
                continue
            split = math.prod(layout.mesh.shape[a] for a in layout.axes_of(name))
            local = shape[dim] // split if shape[dim] >= split else 1  # fewer kv heads than tensor shards: one each
            if local % ways:
                raise LayoutError(
                    f"weight {'/'.join(map(str, path))} has {shape[dim]} {name} ({local} per device after tensor parallelism), "
                    f"which the all-to-all over {'/'.join(layout.role(A2A))} cannot split {ways} ways: attention is split by "
                    f"heads there. Use an all-to-all degree that divides {local} (context_algorithm=hybrid with a smaller a2a=), "
                    f"or context_algorithm=ring")


def attention(q, k, v, mask: att.Mask, layout, implementation: str, block_q: int, block_kv: int, interpret: bool):
    """``attention.attention`` on this device's positions of a sequence split over the layout's
    context axes (q, k, v and the segment ids as this device holds them)."""
    ring, a2a = layout.role(RING), layout.role(A2A)
    seg = mask.segments
    if a2a:
        ways = math.prod(layout.mesh.shape[a] for a in a2a)
        for name, x in (("query heads", q), ("key/value heads", k)):
            if x.shape[2] % ways:
                raise LayoutError(
                    f"the all-to-all over {'/'.join(a2a)} splits attention by heads {ways} ways, but this device holds "
                    f"{x.shape[2]} {name}: use an all-to-all degree that divides {x.shape[2]} (context_algorithm=hybrid "
                    f"with a smaller a2a=, or ring)")
        q, k, v = (jax.lax.all_to_all(x, a2a, 2, 1, tiled=True) for x in (q, k, v))  # heads split, sequence whole
        if seg is not None:
            seg = att.Segments(*(jax.lax.all_gather(s, a2a, axis=1, tiled=True) for s in (seg.q, seg.kv)))
    if mask.indices is not None:  # tokens held at given places (block parallelism over the ring: CSBP)
        return _attention_at_places(q, k, v, mask, layout)
    if ring:
        static = dataclasses.replace(mask, segments=None)
        r_size = math.prod(layout.mesh.shape[a] for a in ring)
        seg_q, seg_kv = (None, None) if seg is None else (seg.q, seg.kv)
        out = _ring(static, ring, r_size, q, k, v, seg_q, seg_kv).astype(q.dtype)
    else:
        out = att._whole(q, k, v, dataclasses.replace(mask, segments=seg), implementation, block_q, block_kv, interpret)
    return jax.lax.all_to_all(out, a2a, 1, 2, tiled=True) if a2a else out


# --- the ring ------------------------------------------------------------------------------------
# A ring rank's share is two halves, chunks (r, 2R-1-r). Each step computes some (query half, key
# half) pairs; under a causal (or causal windowed) mask the zigzag needs only these, the others
# being masked whole, and every step costs every rank the same two chunk pairs:
#   the rank's own K/V (src == r): (0,0) and (1,1) causal on the diagonal, (1,0) whole;
#   an earlier rank's (src < r):   (0,0), (1,0);
#   a later rank's (src > r):      (1,0), (1,1).
# Other masks (block masks, bidirectional) compute all four pairs. ``rel`` marks diagonal pairs,
# run at offsets (0, 0): a causal band depends only on key - query, and static offsets let the
# blockwise kernel skip the empty blocks.
_CAUSAL_STEPS = (((0, 0, True), (1, 0, False), (1, 1, True)), ((0, 0, False), (1, 0, False)), ((1, 0, False), (1, 1, False)))
_ALL_PAIRS = (((0, 0, False), (0, 1, False), (1, 0, False), (1, 1, False)),)


def _steps(mask: att.Mask):
    return _CAUSAL_STEPS if mask.causal and mask.blocks is None else _ALL_PAIRS


def _branch(mask: att.Mask, src, rank):
    if len(_steps(mask)) == 1:
        return jnp.int32(0)
    return jnp.where(src == rank, 0, jnp.where(src < rank, 1, 2))


def _half(x, i):
    if x is None:
        return None
    n = x.shape[1] // 2
    return x[:, i * n:(i + 1) * n]


def _pair_args(mask, ring_size, rank, src, pair, q, k, v, seg_q, seg_kv):
    """(q half, k half, v half, mask with their segment ids, offsets, block sizes) of one pair."""
    i, j, rel = pair
    c = q.shape[1] // 2
    offsets = (0, 0) if rel else (_chunk_of(ring_size, rank, i) * c, _chunk_of(ring_size, src, j) * c)
    sq, sk = _half(seg_q, i), _half(seg_kv, j)
    m = mask if sq is None else dataclasses.replace(mask, segments=att.Segments(sq, sk))
    block = math.gcd(c, att.DEFAULT_BLOCK)
    return _half(q, i), _half(k, j), _half(v, j), m, offsets, block


def chunk_pairs(mask: att.Mask, c: int, ring_size: int) -> np.ndarray | None:
    """(2R, 2R) bool: the pairs of c-position chunks (query chunk, key chunk) of the whole sequence
    that may hold an allowed entry under a block mask (``att.block_plan`` at chunk size); None
    where the ring's steps already skip by their own rule (causal) or nothing is static."""
    if mask.blocks is None or mask.indices is not None:
        return None
    return att.block_plan(dataclasses.replace(mask, segments=None), 2 * ring_size * c, 2 * ring_size * c, c, c)


def _chunk_of(ring_size, rank, half):
    return rank if half == 0 else 2 * ring_size - 1 - rank


def _unless_empty(pairs_table, ring_size, rank, src, pair, compute, fills, like):
    """``compute()``, or its outputs filled with ``fills`` where the block mask leaves this chunk
    pair without an allowed entry (a block diffusion mask: a clean query never reads a noisy key).
    ``like``: an array varying over the manual axes, as the outputs do."""
    if pairs_table is None or pair[2]:
        return compute()
    shapes = jax.eval_shape(compute)

    def empty():
        return tuple(att.full_varying(x.shape, f, like).astype(x.dtype) for x, f in zip(shapes, fills))

    allowed = jnp.asarray(pairs_table)[_chunk_of(ring_size, rank, pair[0]), _chunk_of(ring_size, src, pair[1])]
    return jax.lax.cond(allowed, compute, empty)


def _step_forward(mask, table, ring_size, rank, src, q, k, v, seg_q, seg_kv):
    """(out float32, lse) of the whole share's queries against the K/V of ring rank ``src``
    (``table``: ``chunk_pairs``, made once per ring)."""
    b, c, h, d = _half(q, 0).shape

    def empty():
        return att.full_varying((b, c, h, d), 0.0, q), att.full_varying((b, c, h), -jnp.inf, q)

    def run(pairs):
        halves = [None, None]
        for pair in pairs:
            qi, kj, vj, m, (qo, ko), block = _pair_args(mask, ring_size, rank, src, pair, q, k, v, seg_q, seg_kv)
            part = _unless_empty(table, ring_size, rank, src, pair, lambda qi=qi, kj=kj, vj=vj, m=m, qo=qo, ko=ko, block=block: tuple(
                att.attention_chunk(qi, kj, vj, m, q_offset=qo, kv_offset=ko, block_q=block, block_kv=block)), (0.0, -jnp.inf), q)
            i = pair[0]
            halves[i] = part if halves[i] is None else att.merge(halves[i], part)
        (o0, l0), (o1, l1) = (p if p is not None else empty() for p in halves)
        return jnp.concatenate([o0, o1], 1), jnp.concatenate([l0, l1], 1)

    return jax.lax.switch(_branch(mask, src, rank), [functools.partial(run, p) for p in _steps(mask)])


def _step_grads(mask, table, ring_size, rank, src, q, k, v, seg_q, seg_kv, out, lse, dout):
    """(dq, dk, dv) float32 of the K/V of ring rank ``src``'s part in the whole result."""

    c = q.shape[1] // 2

    def run(pairs):
        dq, dk, dv = [att.full_varying(x.shape, 0.0, q) for x in (q, k, v)]
        for pair in pairs:
            qi, kj, vj, m, (qo, ko), block = _pair_args(mask, ring_size, rank, src, pair, q, k, v, seg_q, seg_kv)
            i, j = pair[0], pair[1]

            def grads(qi=qi, kj=kj, vj=vj, m=m, qo=qo, ko=ko, block=block, i=i):
                return tuple(att.chunk_grads(qi, kj, vj, m, _half(out, i), _half(lse, i), _half(dout, i), q_offset=qo,
                                             kv_offset=ko, block_q=block, block_kv=block))

            gq, gk, gv = _unless_empty(table, ring_size, rank, src, pair, grads, (0.0, 0.0, 0.0), q)
            dq = dq.at[:, i * c:(i + 1) * c].add(gq.astype(jnp.float32))
            dk = dk.at[:, j * c:(j + 1) * c].add(gk.astype(jnp.float32))
            dv = dv.at[:, j * c:(j + 1) * c].add(gv.astype(jnp.float32))
        return dq, dk, dv

    return jax.lax.switch(_branch(mask, src, rank), [functools.partial(run, p) for p in _steps(mask)])


def _next(ring_size):
    return [(i, (i + 1) % ring_size) for i in range(ring_size)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _ring(mask, axes, ring_size, q, k, v, seg_q, seg_kv):
    return _ring_forward(mask, axes, ring_size, q, k, v, seg_q, seg_kv)[0]


def _ring_forward(mask, axes, ring_size, q, k, v, seg_q, seg_kv):
    rank = jax.lax.axis_index(axes)
    send = lambda x: jax.lax.ppermute(x, axes, _next(ring_size))  # noqa: E731
    table = chunk_pairs(mask, q.shape[1] // 2, ring_size)

    def step(carry, i):
        held, acc = carry
        arriving = jax.tree.map(send, held)  # issued before the compute below, which does not need it
        part = _step_forward(mask, table, ring_size, rank, (rank - i) % ring_size, q, *held[:2], seg_q, held[2])
        return (arriving, att.merge(acc, part)), None

    b, n, h, d = q.shape
    start = (att.full_varying((b, n, h, d), 0.0, q), att.full_varying((b, n, h), -jnp.inf, q))
    (held, acc), _ = jax.lax.scan(step, ((k, v, seg_kv), start), jnp.arange(ring_size - 1))
    out, lse = att.merge(acc, _step_forward(mask, table, ring_size, rank, (rank + 1) % ring_size, q, *held[:2], seg_q, held[2]))
    return out, (q, k, v, seg_q, seg_kv, out, lse)


def _ring_fwd(mask, axes, ring_size, q, k, v, seg_q, seg_kv):
    out, res = _ring_forward(mask, axes, ring_size, q, k, v, seg_q, seg_kv)
    return out, res


def _ring_backward(axes, ring_size, held, dq, grads_of):
    """The backward ring: the K/V (``held``: K, V and what travels with them) go round again while
    each step's gradients are computed (``grads_of(held, src ring rank) -> (dq, dk, dv)``); the K/V
    gradients travel with their K/V and one last hop sends them home. (dq, dk, dv) float32."""
    rank = jax.lax.axis_index(axes)
    send = lambda x: jax.lax.ppermute(x, axes, _next(ring_size))  # noqa: E731

    def add(held, grad_acc, dq, i):
        gq, gk, gv = grads_of(held, (rank - i) % ring_size)
        return (grad_acc[0] + gk, grad_acc[1] + gv), dq + gq

    def step(carry, i):
        held, grad_acc, dq = carry
        arriving = jax.tree.map(send, held)  # K/V move on while this step's gradients are computed
        grad_acc, dq = add(held, grad_acc, dq, i)
        return (arriving, jax.tree.map(send, grad_acc), dq), None  # the K/V gradients follow their K/V

    zeros = tuple(att.full_varying(x.shape, 0.0, dq) for x in held[:2])
    (held, grad_acc, dq), _ = jax.lax.scan(step, (held, zeros, dq), jnp.arange(ring_size - 1))
    grad_acc, dq = add(held, grad_acc, dq, ring_size - 1)
    dk, dv = jax.tree.map(send, grad_acc)  # home: the owner of these K/V
    return dq, dk, dv


def _ring_bwd(mask, axes, ring_size, res, dout):
    q, k, v, seg_q, seg_kv, out, lse = res
    rank = jax.lax.axis_index(axes)
    dout = dout.astype(jnp.float32)
    table = chunk_pairs(mask, q.shape[1] // 2, ring_size)

    def grads_of(held, src):
        return _step_grads(mask, table, ring_size, rank, src, q, held[0], held[1], seg_q, held[2], out, lse, dout)

    dq, dk, dv = _ring_backward(axes, ring_size, (k, v, seg_kv), att.full_varying(q.shape, 0.0, q), grads_of)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


# --- the ring at given places -----------------------------------------------------------------
# A device's keys are [its own (places ``kv``) ; its share of a sequence split over the ring (places
# ``kv_ring[rank]``)]. Only the share travels; the mask is evaluated at every token's place, so no
# block pair is skipped. Per layer and device the traffic is the plain ring's for the shared keys:
# forward (R-1)/R of their K/V bytes; backward the same again plus their float32 gradients, R hops.
# Under ``RING_PIECES`` (G devices) a device holds a piece of its rank's share: the pieces' K and V
# are all-gathered first, (G-1)/G of the share's K/V bytes, and autodiff reduce-scatters their
# gradients back the same way.


def _attention_at_places(q, k, v, mask: att.Mask, layout):
    where = mask.indices
    if layout.role(A2A) or mask.segments is not None:
        raise LayoutError("attention at given token places (block parallelism with context=) runs on a ring only, without "
                          "segment ids: use context_algorithm=ring and no packing")
    if where.kv_fetch is not None:
        return _fetched(q, k, v, mask, layout)
    if where.kv_ring is None:
        raise LayoutError("under context parallelism attention at given token places needs the places of the keys each ring "
                          "rank holds, or those to fetch: Mask.at(q, kv, kv_ring=...) or Mask.at(q, kv, kv_fetch=...)")
    r_size = math.prod(layout.mesh.shape[a] for a in layout.role(RING))
    static = dataclasses.replace(mask, indices=None)
    if layout.role(RING_PIECES):  # this device's piece of its rank's share, with the other pieces' K/V
        kept, d = where.kv.shape[0], k.shape[-1]
        share = jax.lax.all_gather(jnp.concatenate([k[:, kept:], v[:, kept:]], -1), layout.role(RING_PIECES), axis=1, tiled=True)
        k, v = jnp.concatenate([k[:, :kept], share[..., :d]], 1), jnp.concatenate([v[:, :kept], share[..., d:]], 1)
    return _places_ring(static, layout.role(RING), r_size, q, k, v, where.q, where.kv, where.kv_ring).astype(q.dtype)


def _fetched(q, k, v, mask: att.Mask, layout):
    """Attention over this device's keys and those it fetches in one all-to-all over the ring axes
    (``attention.Fetch``): K and V travel together, and autodiff sends their cotangents back the
    same way. Padding slots are masked out as a segment of their own."""
    where = mask.indices
    d = k.shape[-1]
    pairs = jnp.take(jnp.concatenate([k, v], axis=-1), where.kv_fetch.send.reshape(-1), axis=1)
    got = jax.lax.all_to_all(pairs, layout.role(RING), 1, 1, tiled=True)  # rank j's slots j*S..(j+1)*S-1
    keys, values = jnp.concatenate([k, got[..., :d]], 1), jnp.concatenate([v, got[..., d:]], 1)
    places = jnp.concatenate([where.kv, where.kv_fetch.places])
    real = places >= 0
    placed = dataclasses.replace(mask, indices=None).at(where.q, jnp.where(real, places, 0)).with_segments(
        jnp.ones((q.shape[0], q.shape[1]), jnp.int32), jnp.broadcast_to(real.astype(jnp.int32), (q.shape[0], places.shape[0])))
    blocks = dict(block_q=math.gcd(q.shape[1], att.DEFAULT_BLOCK), block_kv=math.gcd(keys.shape[1], att.DEFAULT_BLOCK))
    return att.attention_chunk(q, keys, values, placed, **blocks)[0].astype(q.dtype)


def _chunk(mask, q, k, v, at_q, at_kv, out=None, lse=None, dout=None):
    """``attention_chunk`` (or with ``dout``, ``chunk_grads``) of all of q against one key chunk."""
    blocks = dict(block_q=math.gcd(q.shape[1], att.DEFAULT_BLOCK), block_kv=math.gcd(k.shape[1], att.DEFAULT_BLOCK))
    placed = mask.at(at_q, at_kv)
    if dout is None:
        return att.attention_chunk(q, k, v, placed, **blocks)
    return att.chunk_grads(q, k, v, placed, out, lse, dout, **blocks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _places_ring(mask, axes, ring_size, q, k, v, at_q, at_kv, kv_ring):
    return _places_ring_forward(mask, axes, ring_size, q, k, v, at_q, at_kv, kv_ring)[0]


def _places_ring_forward(mask, axes, ring_size, q, k, v, at_q, at_kv, kv_ring):
    rank = jax.lax.axis_index(axes)
    kept = at_kv.shape[0]
    send = lambda x: jax.lax.ppermute(x, axes, _next(ring_size))  # noqa: E731
    b, n, h, d = q.shape
    acc = (att.full_varying((b, n, h, d), 0.0, q), att.full_varying((b, n, h), -jnp.inf, q))
    if kept:
        acc = att.merge(acc, _chunk(mask, q, k[:, :kept], v[:, :kept], at_q, at_kv))

    def step(carry, i):
        held, acc = carry
        arriving = jax.tree.map(send, held)  # issued before the compute below, which does not need it
        part = _chunk(mask, q, *held, at_q, kv_ring[(rank - i) % ring_size])
        return (arriving, att.merge(acc, part)), None

    (held, acc), _ = jax.lax.scan(step, ((k[:, kept:], v[:, kept:]), acc), jnp.arange(ring_size - 1))
    out, lse = att.merge(acc, _chunk(mask, q, *held, at_q, kv_ring[(rank + 1) % ring_size]))
    return out, (q, k, v, at_q, at_kv, kv_ring, out, lse)


def _places_ring_bwd(mask, axes, ring_size, res, dout):
    q, k, v, at_q, at_kv, kv_ring, out, lse = res
    kept = at_kv.shape[0]
    dout = dout.astype(jnp.float32)
    dq = att.full_varying(q.shape, 0.0, q)
    own = []
    if kept:
        gq, gk, gv = _chunk(mask, q, k[:, :kept], v[:, :kept], at_q, at_kv, out, lse, dout)
        dq, own = dq + gq, [gk, gv]

    def grads_of(held, src):
        return _chunk(mask, q, *held, at_q, kv_ring[src], out, lse, dout)

    dq, dk, dv = _ring_backward(axes, ring_size, (k[:, kept:], v[:, kept:]), dq, grads_of)
    if own:
        dk, dv = jnp.concatenate([own[0], dk], 1), jnp.concatenate([own[1], dv], 1)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


_places_ring.defvjp(_places_ring_forward, _places_ring_bwd)


# --- per-rank attention work --------------------------------------------------------------------


def rank_work(mask: att.Mask, length: int, ring: int, a2a: int = 1, block: int = att.DEFAULT_BLOCK, zigzag: bool = True) -> np.ndarray:
    """Query-key pairs each device's attention computes (in blocks of the kernel, whole blocks
    counted) for one head of one sequence, by the ring's schedule above; with ``zigzag=False`` for
    contiguous shares (chunks 2r, 2r+1), for comparison. The all-to-all divides the heads, not the
    pairs, so each device of a group does its group's pairs / U heads: reported per device as such."""
    c = length // (2 * ring)
    block = math.gcd(c, block)
    chunk = (lambda r, half: r if half == 0 else 2 * ring - 1 - r) if zigzag else (lambda r, half: 2 * r + half)
    static = dataclasses.replace(mask, segments=None)
    table = chunk_pairs(static, c, ring) if zigzag else None  # the chunk pairs the ring skips whole
    work = np.zeros(ring)
    for rank in range(ring):
        for src in range(ring):
            if zigzag:
                pairs = _steps(static)[0 if len(_steps(static)) == 1 else (0 if src == rank else 1 if src < rank else 2)]
            else:  # contiguous shares: every pair that holds an allowed entry
                pairs = [(i, j, False) for i in (0, 1) for j in (0, 1)
                         if att.block_plan(static, c, c, block, block, chunk(rank, i) * c, chunk(src, j) * c).any()]
            for i, j, rel in pairs:
                offsets = (chunk(rank, i) * c, chunk(src, j) * c)
                if table is not None and not rel and not table[chunk(rank, i), chunk(src, j)]:
                    continue
                if rel:  # the kernel skips the empty blocks of a diagonal pair
                    work[rank] += att.block_plan(static, c, c, block, block, *offsets).sum() * block * block
                else:
                    work[rank] += c * c
    return np.repeat(work / a2a, a2a)
