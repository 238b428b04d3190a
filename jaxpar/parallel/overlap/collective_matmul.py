"""Collective matmul: an all-gather or reduce-scatter along the sequence decomposed into a ring of
``ppermute``s, each hop's chunk computed on while the next hop travels (``tp_overlap=on``, see
this folder's ``__init__``). Inside jaxpar's shard_map, over one mesh axis of T devices.

Both rings run both ways at once: each device's chunk of the sequence is cut in two halves, the
first half going round one way and the second the other, so each link carries half a chunk per
hop in each direction (a chunk of odd length goes round one way, whole). The bytes are those of
the all-gather or reduce-scatter they replace: T - 1 chunks per device.

- ``gather_then(x, then, axis, dim)``: ``then(all_gather(x))`` where ``then`` acts on each position
  of ``dim`` alone (the block's column-parallel matmuls): ``then`` runs on every chunk as it
  arrives, and the results are put in sequence order;
- ``project_then_scatter(x, project, axis, dim)``: ``psum_scatter(project(x))`` along ``dim``
  where ``project`` acts on each position alone (a row-parallel matmul): each hop adds this
  device's projection of the chunk the travelling partial sum belongs to.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# the name scope of the rings that finish a sum by collective-permutes (no psum): a check of
# unfinished partial sums (``jaxpar/train/partial_sums.py``) takes what they return as finished
FINISHED_SCOPE = "jaxpar_finished_sum"


def _halves(length: int) -> list[tuple[int, int, int]]:
    """(offset inside a chunk, size, direction) of the pieces that go round: +1 to the next device."""
    if length % 2:
        return [(0, length, 1)]
    return [(0, length // 2, 1), (length // 2, length // 2, -1)]


def _shift(x, axis: str, devices: int, direction: int):
    return jax.lax.ppermute(x, axis, [(j, (j + direction) % devices) for j in range(devices)])


def gather_then(x, then, axis: str, dim: int):
    """``then(x gathered along dim over axis)``, its ring hops overlapping ``then``'s work."""
    devices, me = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    length = x.shape[dim]
    pieces = []
    for offset, size, direction in _halves(length):
        held = jax.lax.slice_in_dim(x, offset, offset + size, axis=dim)
        outs = []
        for hop in range(devices):
            outs.append(then(held))  # the piece of chunk (me - direction * hop) % devices
            if hop < devices - 1:
                held = _shift(held, axis, devices, direction)
        # in chunk order: chunk c arrived at hop (me - c) * direction
        order = ((me - jnp.arange(devices)) * direction) % devices
        pieces.append(jax.tree.map(lambda *hops: jnp.take(jnp.stack(hops), order, axis=0), *outs))

    def assemble(*parts):  # each (devices, ..., size, ...): the chunks' pieces side by side, then chunks in a row
        whole = jnp.concatenate(parts, axis=dim + 1)
        whole = jnp.moveaxis(whole, 0, dim)
        return whole.reshape(whole.shape[:dim] + (devices * length,) + whole.shape[dim + 2:])

    return jax.tree.map(assemble, *pieces)


def project_then_scatter(x, project, axis: str, dim: int):
    """``psum_scatter(project(x), axis, scatter_dimension=dim, tiled=True)``, each hop's matmul
    overlapping the previous hop's transfer."""
    with jax.named_scope(FINISHED_SCOPE):
        return _ring_scatter(x, project, axis, dim)


def _ring_scatter(x, project, axis: str, dim: int):
    devices, me = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    length = x.shape[dim] // devices  # of this device's chunk of the result
    parts = []
    for offset, size, direction in _halves(length):
        def piece(hop):  # this device's projection of the piece the partial sum holds at this hop
            chunk = (me - direction * (hop + 1)) % devices
            return project(jax.lax.dynamic_slice_in_dim(x, chunk * length + offset, size, axis=dim))

        total = piece(0)
        for hop in range(1, devices):
            total = _shift(total, axis, devices, direction) + piece(hop)
        parts.append(total)  # after the last hop: this device's own chunk, summed over all
    return jnp.concatenate(parts, axis=dim) if len(parts) > 1 else parts[0]
