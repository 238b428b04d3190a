"""Ring all-gather of a fixed-size per-rank message as one Pallas TPU kernel: remote DMAs and
semaphores instead of ``ranks - 1`` XLA ``ppermute``s.

The all-gather phase of the compressed all-reduce (``collectives.compressed``) forwards each
owner's compressed message around the ring untouched; this kernel does that forwarding itself, in
the same order as ``compressed._ring_all_gather``: rank r sends to (r + 1) % ranks, and after hop h
holds the message of owner (r - h - 1) % ranks. Call it inside ``shard_map`` over ``axis_name``.

Buffers (per rank): the message ``x`` and the output ``out`` [ranks, ...] stay in HBM; two VMEM
receive slots take the hops in turn (hop h lands in slot h % 2). At hop h a rank, in this order:

1. waits for hop h to land in its slot h % 2 (the DMA's receive semaphore);
2. starts copying that slot into ``out[owner]`` (a local DMA);
3. waits for what still reads its other slot (hop h - 1's copy-out and the forwarding send of
   hop h, which read that slot) and then tells its left neighbour the slot is free;
4. forwards slot h % 2 to the right neighbour's other slot, once the right neighbour has said
   that slot is free.

So the copy-out of hop h, the send of hop h + 1 and the arrival of hop h + 1 from the left are in
flight together, and a sender never overwrites a slot its receiver has not consumed.

Semaphores: DMA ``send`` [2] and ``recv`` [2] (indexed by the receiving slot; a remote copy bumps
the sender's ``send`` and the receiver's ``recv``), DMA ``copy`` [2] for the copy-outs, and
REGULAR ``free`` [2]: ``free[k]`` on rank r counts "the right neighbour's slot k is free again",
signalled by that neighbour. Both slots start free, so hops 0 and 1 need no ``free``; hop h >= 2
reuses the slot of hop h - 2 and waits for it. Every signal is waited for, so each kernel leaves
its semaphores at zero. Step 3 comes before step 4's wait: a rank frees its slot before waiting
for its right neighbour's, so no cycle of waits can close around the ring.

A rank may DMA into (or signal) a neighbour only once that neighbour is inside the kernel: its
slots and semaphores are allocated only then, and it may still be running the previous call.
The barrier semaphore (``collective_id``) does that: each rank tells its left neighbour it is
here and waits for its right neighbour to say the same. The ``free`` signals a rank sends to
its left neighbour need no barrier of their own: the first comes after that neighbour's hop-0
DMA has landed, so the neighbour is inside the kernel by then.

On a machine without TPUs the kernel runs in Pallas' TPU interpreter, which simulates the
devices' memories, DMAs and semaphores: pass ``interpret=pltpu.InterpretParams()`` (or trace under
``pltpu.force_tpu_interpret_mode()``).

``ring_all_gather_packed`` gathers a ``wire.Packed`` message (its three fields packed into one
uint32 buffer); ``ring_all_gather_ppermute`` is the pure-XLA twin, with the same output.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxpar.kernels.wire import Packed

LANES = 128  # the kernel sees a message as [rows, LANES] uint32: the TPU's native row width
MAX_MESSAGE_BYTES = 4 << 20  # per slot; two slots must fit the kernel's VMEM budget below
_VMEM_LIMIT_BYTES = 2 * MAX_MESSAGE_BYTES + (4 << 20)
TRANSPORTS = ("pallas_ring", "ppermute")


def _axis_size(axis_name) -> int:
    try:
        return jax.lax.axis_size(axis_name)
    except NameError as err:  # jax: "unbound axis name: ..."
        raise ValueError(
            f"axis {axis_name!r} is not a mesh axis in scope: call the ring all-gather inside "
            f"shard_map over a mesh with that axis ({err})"
        ) from None


def _check_message(x) -> None:
    if x.ndim != 1:
        raise ValueError(f"the ring all-gather takes a 1-D message per rank; got shape {x.shape}")
    if x.dtype.itemsize != 4:
        raise ValueError(f"the ring all-gather moves 32-bit words; got dtype {x.dtype} (pack it into uint32 first)")
    if x.size * 4 > MAX_MESSAGE_BYTES:
        raise ValueError(
            f"a message of {x.size} words ({x.size * 4 / 2**20:.1f} MiB) is larger than a receive slot "
            f"({MAX_MESSAGE_BYTES >> 20} MiB of VMEM): split it into several all-gathers"
        )


def _ring_kernel(x_hbm, out_hbm, slots, send_sems, recv_sems, copy_sems, free_sems, *, axis_name, ranks):
    me = jax.lax.axis_index(axis_name)
    right = jax.lax.rem(me + 1, ranks)
    left = jax.lax.rem(me + ranks - 1, ranks)
    hops = ranks - 1

    def owner(h):  # whose message arrives at hop h (the order of compressed._ring_all_gather)
        return jax.lax.rem(me + ranks - 1 - h, ranks)

    def send(src, slot):
        """The forwarding DMA into the right neighbour's ``slot``; also the handle a receiver
        waits on for what lands in its own ``slot`` (same shape, same semaphore index)."""
        return pltpu.make_async_remote_copy(
            src, slots.at[slot], send_sems.at[slot], recv_sems.at[slot],
            device_id={axis_name: right}, device_id_type=pl.DeviceIdType.MESH,
        )

    def copy_out(src, row, sem):
        return pltpu.make_async_copy(src, out_hbm.at[row], copy_sems.at[sem])

    # the right neighbour must be inside this kernel before its slots can be written
    barrier = pltpu.get_barrier_semaphore()
    pl.semaphore_signal(barrier, 1, device_id={axis_name: left}, device_id_type=pl.DeviceIdType.MESH)
    pl.semaphore_wait(barrier, 1)

    # own message: straight to out[me], and hop 0 straight from HBM into the right's slot 0
    copy_out(x_hbm, me, 1).start()  # copy semaphore 1: "hop -1", freed like slot 1 at hop 0
    send(x_hbm, 0).start()

    @pl.loop(0, hops)
    def _hop(h):
        s = jax.lax.rem(h, 2)  # this hop's slot
        other = 1 - s  # the slot of hops h - 1 and h + 1
        # 1. hop h has landed in slot s
        send(slots.at[other], s).wait_recv()
        # 2. copy it out while it is forwarded
        copy_out(slots.at[s], owner(h), s).start()

        # 3. the other slot's readers: the send of hop h (from it, or from x at hop 0) and the
        # copy-out of hop h - 1 (or of x). Once done the slot may take hop h + 1 from the left:
        # say so, if the left has a hop h + 1 to send. Not at hop 0: slot 1 was never used, and
        # the left sends hop 1 into it without asking.
        @pl.when(h == 0)
        def _():
            send(x_hbm, 0).wait_send()
            copy_out(x_hbm, me, 1).wait()

        @pl.when(h > 0)
        def _():
            send(slots.at[other], s).wait_send()
            copy_out(slots.at[other], owner(h - 1), other).wait()

            @pl.when(h + 1 < hops)
            def _():
                pl.semaphore_signal(free_sems.at[other], 1, device_id={axis_name: left}, device_id_type=pl.DeviceIdType.MESH)

        # 4. forward hop h as hop h + 1, into the right's other slot once it is free again
        @pl.when(h + 1 < hops)
        def _():
            @pl.when(h >= 1)
            def _():
                pl.semaphore_wait(free_sems.at[other], 1)

            send(slots.at[s], other).start()

    last = (hops - 1) % 2
    copy_out(slots.at[last], owner(hops - 1), last).wait()


def ring_all_gather(x: jax.Array, axis_name, *, interpret=False, collective_id: int = 0) -> jax.Array:
    """[n] 32-bit message per rank -> [ranks, n], row r being rank r's message, gathered by the
    ring kernel. Inside ``shard_map`` over ``axis_name``.

    ``interpret``: False compiles for TPU (Mosaic); ``pltpu.InterpretParams()`` runs the TPU
    interpreter, which simulates the remote DMAs and semaphores (any backend). ``collective_id``
    names the kernel's barrier semaphore: kernels with other communication patterns that may run
    concurrently need other ids."""
    ranks = _axis_size(axis_name)
    x = jnp.asarray(x)
    _check_message(x)
    if ranks == 1:
        return x[None]
    dtype, n = x.dtype, x.size
    rows = max(1, math.ceil(n / LANES))
    words = jax.lax.bitcast_convert_type(x, jnp.uint32)
    words = jnp.pad(words, (0, rows * LANES - n)).reshape(rows, LANES)
    kernel = functools.partial(_ring_kernel, axis_name=axis_name, ranks=ranks)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((ranks, rows, LANES), jnp.uint32),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[
            pltpu.VMEM((2, rows, LANES), jnp.uint32),  # the two receive slots
            pltpu.SemaphoreType.DMA((2,)),  # send, by receiving slot
            pltpu.SemaphoreType.DMA((2,)),  # recv, by slot
            pltpu.SemaphoreType.DMA((2,)),  # copy-out, by slot
            pltpu.SemaphoreType.REGULAR((2,)),  # free: the right neighbour's slot k may be written
        ],
        compiler_params=pltpu.CompilerParams(collective_id=collective_id, vmem_limit_bytes=_VMEM_LIMIT_BYTES),
        interpret=interpret,
    )(words)
    out = out.reshape(ranks, rows * LANES)[:, :n]
    return jax.lax.bitcast_convert_type(out, dtype)


def ring_all_gather_ppermute(tree, axis_name):
    """The XLA twin: every leaf of ``tree`` (a rank's message, any shape) gathered into
    [ranks, ...] by ``ranks - 1`` ``ppermute`` hops in the kernel's ring order."""
    ranks = _axis_size(axis_name)
    me = jax.lax.axis_index(axis_name)
    to_next = [(i, (i + 1) % ranks) for i in range(ranks)]
    out = jax.tree.map(lambda a: jnp.zeros((ranks,) + a.shape, a.dtype).at[me].set(a), tree)
    for hop in range(ranks - 1):
        tree = jax.lax.ppermute(tree, axis_name, to_next)
        row = (me - hop - 1) % ranks
        out = jax.tree.map(lambda o, a: o.at[row].set(a), out, tree)
    return out


# --- a Packed message as one uint32 buffer --------------------------------------------------------


def pack(packed: Packed) -> jax.Array:
    """``Packed`` -> uint32 [words + ceil(codes / 4) + scales]: the words, the uint8 codes four to a
    word (zero-padded), the float32 scales' bits. Bit-exact both ways, NaN payloads included."""
    for name, leaf, dtype in zip(Packed._fields, packed, (jnp.uint32, jnp.uint8, jnp.float32)):
        if leaf.ndim != 1 or leaf.dtype != dtype:
            raise ValueError(f"Packed.{name} must be 1-D {jnp.dtype(dtype).name}; got {leaf.dtype} {leaf.shape}")
    codes = jnp.pad(packed.codes, (0, -packed.codes.size % 4)).reshape(-1, 4)
    return jnp.concatenate([
        packed.words,
        jax.lax.bitcast_convert_type(codes, jnp.uint32),
        jax.lax.bitcast_convert_type(packed.scales, jnp.uint32),
    ])


def unpack(buffer: jax.Array, like: Packed) -> Packed:
    """Inverse of ``pack`` over any leading dimensions: ``like`` gives the fields' sizes."""
    lead = buffer.shape[:-1]
    n_words, n_codes, n_scales = (leaf.shape[-1] for leaf in like)
    code_words = -(-n_codes // 4)
    words = buffer[..., :n_words]
    codes = jax.lax.bitcast_convert_type(buffer[..., n_words : n_words + code_words], jnp.uint8)
    codes = codes.reshape(lead + (code_words * 4,))[..., :n_codes]
    scales = jax.lax.bitcast_convert_type(buffer[..., n_words + code_words : n_words + code_words + n_scales], jnp.float32)
    return Packed(words, codes, scales)


def ring_all_gather_packed(
    packed: Packed, axis_name, *, transport: str = "pallas_ring", interpret=False, collective_id: int = 0
) -> Packed:
    """Every rank's ``Packed`` message, each field with a leading [ranks] dimension (row r: rank
    r's message), forwarded bit for bit. ``transport``: ``pallas_ring`` (the kernel, its three
    fields in one buffer) or ``ppermute`` (XLA hops, field by field)."""
    if transport == "ppermute":
        return ring_all_gather_ppermute(packed, axis_name)
    if transport != "pallas_ring":
        raise ValueError(f"transport {transport!r} is not one of {', '.join(TRANSPORTS)}")
    gathered = ring_all_gather(pack(packed), axis_name, interpret=interpret, collective_id=collective_id)
    return unpack(gathered, packed)
