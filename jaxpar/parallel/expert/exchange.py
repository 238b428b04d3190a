"""The token exchange of expert parallelism, inside the step's shard_map.

The ``expert`` axis splits the batch (as a data axis does) and the experts: each of its P devices
holds E / P consecutive experts and its own tokens. A device routes its tokens, sorts the copies
by expert (``experts.dispatch``: the copies for device j's experts are then one segment), and:

1. sends each device the counts of the copies it will get, per expert (an all-to-all of P x E/P
   int32);
2. sends each device its segment: the ragged exchange (``jax.lax.ragged_all_to_all``, only the
   copies themselves on the wire) where the backend runs it, or the padded twin (one dense
   all-to-all of P slots of S rows, S the most copies a device can send another) where it does not
   (XLA:CPU). Both land in a (P x S, embed) buffer: the padded twin puts source s's copies in slot
   s, the ragged exchange packs the sources' copies one after another;
3. groups what it received by its own experts (with one expert per device the packed rows are its
   group already) and runs their SwiGLUs as grouped matmuls;
4. sends the outputs back the way they came (the reverse exchange), where ``experts.combine``
   weighs each token's copies together.

Expert-tensor parallelism needs nothing here: the tokens reach every device of a ``tensor`` group
alike, each runs its share of the experts' hidden width, and the outputs are partial sums over
``tensor`` that the model's residual add finishes, as after a dense MLP. The backward pass is JAX's:
an all-to-all's transpose is the reverse all-to-all, so each device's expert gradients already sum
every token that reached them, and they are never reduced over ``expert``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxpar import experts
from jaxpar.rules import vary_over, varying_axes

EXCHANGE = "expert_exchange"  # the role: mesh axes the experts are split over (Layout.role)
RAGGED = "expert_ragged"  # role present: the ragged exchange whatever the backend
PADDED = "expert_padded"  # role present: the padded twin whatever the backend
RAGGED_PLATFORMS = ("tpu", "gpu", "cuda", "rocm")  # backends whose runtime runs ragged_all_to_all


def runs_ragged(layout) -> bool:
    """Whether ``layout``'s exchange is the ragged one: as its option says, else by the devices' backend."""
    if layout.role(RAGGED) or layout.role(PADDED):
        return bool(layout.role(RAGGED))
    return layout.mesh.devices.flat[0].platform in RAGGED_PLATFORMS


def grouped_kernel(layout, rows: int, width: int, hidden: int) -> str:
    """The kernel of the local experts' grouped matmuls on the (rows, width) landing buffer, for
    experts of ``hidden`` width: megablox on TPU where the shapes are whole tiles of it, else
    ``jax.lax.ragged_dot``. (XLA:TPU lowers ragged_dot with masked copies of the whole buffer:
    Mixtral-8x7B on v5p-512 compiled 0.47 GB fewer temporaries per chip with megablox.)"""
    tiles = experts.megablox_tiling(rows, width, hidden) and experts.megablox_tiling(rows, hidden, width)
    return "megablox" if layout.mesh.devices.flat[0].platform == "tpu" and tiles else "ragged_dot"


def slot_rows(tokens: int, top_k: int, local_experts: int, rows: int, capacity: int | None) -> int:
    """S: the most copies one device can send another: each of its ``tokens`` sends at most
    min(top_k, E/P) (its experts are distinct), and under capacity each of its ``rows`` at most
    ``capacity`` per expert."""
    most = tokens * min(top_k, local_experts)
    return most if capacity is None else min(most, rows * capacity * local_experts)


def mixture(x, kept, weights, w_gate, w_up, w_down, num_experts: int, axes: tuple, ragged: bool, slot: int,
            kernel: str = "ragged_dot"):
    """The mixture's output (tokens, embed) for this device's tokens ``x`` (tokens, embed), their
    experts ``kept`` (tokens, top_k; a dropped copy marked ``num_experts``) and routing ``weights``;
    the expert weights are this device's E / P experts, run by the grouped-matmul ``kernel``."""
    top_k = kept.shape[1]
    devices = math.prod(jax.lax.axis_size(a) for a in axes)
    local = num_experts // devices
    order, group_sizes = experts.dispatch(kept, num_experts)
    copies = jnp.take(x, order // top_k, axis=0)
    per_device = group_sizes.reshape(devices, local)
    sends = jnp.sum(per_device, axis=1)
    starts = jnp.cumsum(sends) - sends
    received = jax.lax.all_to_all(per_device, axes, 0, 0, tiled=True)  # (source, my expert): copies coming
    if ragged:
        firsts = _packed_firsts(received)
        inbox = _ragged_out(copies, sends, starts, received, firsts, axes, slot)
    else:
        firsts = jnp.arange(devices) * slot
        inbox, place = _padded_out(copies, kept, order, starts, local, devices, axes, slot)
    outputs = _run_experts(inbox, received, firsts, ragged, w_gate, w_up, w_down, kernel)
    if ragged:
        back = _ragged_back(outputs, sends, starts, received, firsts, axes, copies.shape[0])
    else:
        back = _padded_back(outputs, place, devices, axes, slot)
    return experts.combine(back, order, weights)


def _padded_out(copies, kept, order, starts, local, devices, axes, slot):
    """(the (P x S, embed) buffer of the copies every device sent this one, each sorted copy's
    (device, row) in its slots); dropped copies go nowhere."""
    device = jnp.take(kept.reshape(-1), order) // local  # P for a dropped copy: out of range, dropped
    row = jnp.arange(copies.shape[0]) - jnp.take(starts, jnp.minimum(device, devices - 1))
    slots = jnp.zeros((devices, slot, copies.shape[1]), copies.dtype).at[device, row].set(copies, mode="drop")
    return jax.lax.all_to_all(slots, axes, 0, 0, tiled=True).reshape(devices * slot, -1), (device, row)


def _padded_back(outputs, place, devices, axes, slot):
    back = jax.lax.all_to_all(outputs.reshape(devices, slot, -1), axes, 0, 0, tiled=True)
    device, row = place
    return back.at[device, row].get(mode="fill", fill_value=0)


def _packed_firsts(received) -> jax.Array:
    """The row where each source's copies start in this device's ragged inbox: the sources' copies
    packed one after another, so that with one local expert they are already its one group (Mixtral-8x7B
    on v5p-512: no permutation of the 32768 x 4096 inbox, whose row gather and scatter XLA:TPU runs
    on 32-bit copies of it)."""
    totals = jnp.sum(received, axis=1)
    return (jnp.cumsum(totals) - totals).astype(jnp.int32)


def _ragged_out(copies, sends, starts, received, firsts, axes, slot):
    devices = received.shape[0]
    # the buffers the copies land in are typed as varying as what lands in them: else the backward
    # pass sums their (discarded) cotangents over every device, whole buffers at a time
    inbox = vary_over(jnp.zeros((devices * slot, copies.shape[1]), copies.dtype), varying_axes(copies))
    # where this device's copies start in each receiver's inbox: the receivers' own packed firsts
    landing = jax.lax.all_to_all(firsts.reshape(devices, 1), axes, 0, 0, tiled=True).reshape(devices)
    return jax.lax.ragged_all_to_all(copies, inbox, starts.astype(jnp.int32), sends.astype(jnp.int32), landing,
                                     jnp.sum(received, axis=1).astype(jnp.int32), axis_name=axes)


def _ragged_back(outputs, sends, starts, received, firsts, axes, copies: int):
    devices = received.shape[0]
    their_starts = jax.lax.all_to_all(starts.reshape(devices, 1), axes, 0, 0, tiled=True).reshape(devices)
    home = vary_over(jnp.zeros((copies, outputs.shape[1]), outputs.dtype), varying_axes(outputs))
    return jax.lax.ragged_all_to_all(outputs, home, firsts,
                                     jnp.sum(received, axis=1).astype(jnp.int32), their_starts.astype(jnp.int32),
                                     sends.astype(jnp.int32), axis_name=axes)


def _run_experts(inbox, received, firsts, packed: bool, w_gate, w_up, w_down, kernel: str):
    """The SwiGLUs of this device's experts on the received copies ``inbox`` (P x S, embed), back in
    the inbox's rows (zero where no copy landed); source s's copies start at row ``firsts[s]``,
    sorted by this device's experts, and ``packed``: each source's right after the one before."""
    local = received.shape[1]
    counts = jnp.sum(received, axis=0)
    if packed and local == 1:
        return experts.experts_mlp(inbox, counts, w_gate, w_up, w_down, kernel)
    ends = (firsts[:, None] + jnp.cumsum(received, axis=1)).reshape(-1)  # (source, expert) segments' ends
    rows = jnp.arange(inbox.shape[0])
    segment = jnp.searchsorted(ends, rows, side="right")
    inside = (segment < ends.shape[0]) & (rows >= jnp.take(ends - received.reshape(-1), segment, mode="clip"))
    expert = jnp.where(inside, segment % local, local)  # rows no copy landed in go last
    order = jnp.argsort(expert, stable=True)
    outputs = experts.experts_mlp(jnp.take(inbox, order, axis=0), counts, w_gate, w_up, w_down, kernel)
    return jnp.zeros_like(outputs).at[order].set(outputs)
