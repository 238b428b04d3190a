"""Cross-mesh resharding: move an array from any sharding on one mesh to any sharding on another.

The two meshes may have disjoint or overlapping devices, other shapes and other axis names (a
pipeline stage handing activations to the next stage is the usual case). After Alpa's
cross-mesh resharding (Zhuang et al., "On Optimizing the Communication of Model Parallelism",
MLSys 2023):

**Plan** (``plan_reshard``, pure Python, touches no device). Every source shard's index box is
intersected with every destination shard's box; each non-empty intersection is a *tile*, held by
the source replicas of its box (its *holders*) and needed by the destination replicas of its box
(its *receivers*). A receiver that already holds the tile (a device in both meshes) copies it
locally and nothing crosses. For the others (the plan's *cross-mesh bytes* are these holder ->
receiver sends; with disjoint meshes every one goes from a device of one mesh to the other):

- broadcast (default): the tile is split along its largest dim into one piece per receiver
  (uneven when the dim does not divide), each piece crosses once, and the receivers then
  exchange their pieces among themselves (an all-gather inside the destination group). Each
  needed element crosses between the meshes once per destination group, not once per receiver.
- naive (``broadcast=False``): every receiver gets the whole tile from a holder.

Senders are balanced greedily: pieces, largest first, go to the least-loaded of their holders.
Replicas of one source box share a holder set, so their loads end within one piece of each other.

**Execution** (``compile_reshard``): one ``shard_map`` over a 1-D mesh of the union of both
meshes' devices, compiled once per (shape, dtype, source sharding, destination sharding,
broadcast). Transfers are grouped into rounds; a round is one ``jax.lax.ppermute`` in which every
device sends at most one piece and receives at most one, all of one shape (so no padding: the
bytes in the compiled HLO are exactly the plan's). Local copies first, then the cross-mesh
rounds, then the all-gather rounds. Each device reads its piece out of its block with a
``dynamic_slice`` at an offset looked up by ``axis_index`` and writes what it receives into its
destination block. ``all_gather`` with ``axis_index_groups`` is not used: the receiver groups
differ per tile, do not partition the union of devices and may hold uneven pieces.

SPMD cost: every device of the union holds one source-block-sized input and one
destination-block-sized output during the program (zeros / discarded where a device is only in
one mesh). The input is assembled from the source array's own device buffers and the result from
the destination devices' output buffers, with ``jax.make_array_from_single_device_arrays``.
Single-process only (every device of both meshes addressable).
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, Sharding

from jaxpar.errors import JaxparError, LayoutError

AXIS = "devices"  # the one axis of the execution mesh over the union of both meshes' devices

Box = tuple[tuple[int, int], ...]  # (start, stop) per dim, in global indices


# ---------------------------------------------------------------- boxes


def _box_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def _intersect(a: Box, b: Box) -> Box | None:
    box = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return box if all(start < stop for start, stop in box) else None


def _split(box: Box, parts: int) -> list[Box]:
    """``box`` cut into at most ``parts`` non-empty pieces along its largest dim (the first
    pieces one longer when the dim does not divide; fewer pieces when the dim is shorter)."""
    if parts <= 1 or not box:
        return [box]
    dim = int(np.argmax(_box_shape(box)))
    start, stop = box[dim]
    sizes = [(stop - start) // parts + (i < (stop - start) % parts) for i in range(parts)]
    cuts = np.cumsum([start, *sizes])
    return [box[:dim] + ((int(lo), int(hi)),) + box[dim + 1:] for lo, hi in zip(cuts, cuts[1:]) if hi > lo]


def _format_box(box: Box) -> str:
    return "[" + ", ".join(f"{start}:{stop}" for start, stop in box) + "]"


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Send:
    """One piece moved from one device to another (ids are ``Device.id``)."""

    box: Box
    sender: int
    receiver: int
    nbytes: int


@dataclass(frozen=True)
class Tile:
    """The intersection of one source box and one destination box."""

    box: Box
    nbytes: int
    holders: tuple[int, ...]  # source devices that hold it (replicas of its source box)
    receivers: tuple[int, ...]  # destination devices that need it (replicas of its destination box)
    sends: tuple[Send, ...]  # holder -> receiver: these cross between the meshes
    gathers: tuple[Send, ...]  # receiver -> receiver, inside the destination group

    @property
    def local(self) -> tuple[int, ...]:
        """Receivers that already hold the tile (devices in both meshes): they copy it locally."""
        return tuple(d for d in self.receivers if d in self.holders)


@dataclass(frozen=True)
class Round:
    """One step of the execution: every device sends at most one piece and receives at most one,
    all pieces of one shape. ``phase``: "local" (copies, sender == receiver), "cross" (holders to
    receivers) or "gather" (among the receivers of a tile)."""

    phase: str
    shape: tuple[int, ...]
    sends: tuple[Send, ...]


@dataclass(frozen=True)
class ReshardPlan:
    """What moves where; ``str(plan)`` prints it. Byte counts are per array, over all devices."""

    shape: tuple[int, ...]
    dtype: np.dtype
    src: Sharding
    dst: Sharding
    broadcast: bool
    tiles: tuple[Tile, ...]
    rounds: tuple[Round, ...]
    devices: tuple[int, ...]  # the execution mesh: source devices, then the destination-only ones

    @property
    def cross_mesh_bytes(self) -> int:
        """Bytes sent from holders to receivers that lacked them."""
        return sum(s.nbytes for t in self.tiles for s in t.sends)

    @property
    def gather_bytes(self) -> int:
        """Bytes exchanged among the receivers of a tile (broadcast only)."""
        return sum(s.nbytes for t in self.tiles for s in t.gathers)

    @property
    def naive_bytes(self) -> int:
        """Cross-mesh bytes of naive delivery: the whole tile to every receiver lacking it."""
        return sum(t.nbytes * (len(t.receivers) - len(t.local)) for t in self.tiles)

    @property
    def sender_load(self) -> dict[int, int]:
        """Cross-mesh bytes each source device sends (0 for holders that send nothing)."""
        load = dict.fromkeys((d.id for d in _ordered_devices(self.src)), 0)
        for t in self.tiles:
            for s in t.sends:
                load[s.sender] += s.nbytes
        return load

    def link_bytes(self) -> dict[tuple[int, int], int]:
        """(sender, receiver) -> bytes over that link, both phases; local copies left out."""
        out: dict[tuple[int, int], int] = defaultdict(int)
        for t in self.tiles:
            for s in (*t.sends, *t.gathers):
                out[(s.sender, s.receiver)] += s.nbytes
        return dict(out)

    def describe(self) -> str:
        dtype = np.dtype(self.dtype).name
        lines = [
            f"reshard {dtype}{list(self.shape)}, {'broadcast' if self.broadcast else 'naive per-receiver sends'}",
            f"  from {_describe_sharding(self.src)}",
            f"  to   {_describe_sharding(self.dst)}",
        ]
        for t in self.tiles:
            lines.append(f"tile {_format_box(t.box)} {t.nbytes} B  holders {list(t.holders)}  "
                         f"receivers {list(t.receivers)}" + (f"  (local on {list(t.local)})" if t.local else ""))
            for s in t.sends:
                lines.append(f"  send {_format_box(s.box)} {s.sender} -> {s.receiver}  {s.nbytes} B")
            if t.gathers:
                lines.append(f"  then all-gather among {sorted({s.receiver for s in t.gathers})}: "
                             f"{len(t.gathers)} sends, {sum(s.nbytes for s in t.gathers)} B")
        load = self.sender_load
        phases = defaultdict(int)
        for r in self.rounds:
            phases[r.phase] += 1
        lines += [
            f"cross-mesh bytes: {self.cross_mesh_bytes} (naive per-receiver sends: {self.naive_bytes})",
            f"within-destination all-gather bytes: {self.gather_bytes}",
            "sender load: " + ", ".join(f"{d}: {b} B" for d, b in load.items()),
            "rounds: " + ", ".join(f"{n} {p}" for p, n in phases.items()) if phases else "rounds: none",
        ]
        return "\n".join(lines)

    __str__ = describe


def _ordered_devices(sharding: Sharding) -> list[jax.Device]:
    if isinstance(sharding, NamedSharding):
        return list(sharding.mesh.devices.flat)
    return sorted(sharding.device_set, key=lambda d: d.id)


def _describe_sharding(sharding: Sharding) -> str:
    ids = [d.id for d in _ordered_devices(sharding)]
    if isinstance(sharding, NamedSharding):
        axes = ", ".join(f"{a}={n}" for a, n in sharding.mesh.shape.items())
        return f"mesh ({axes}) on devices {ids}, {sharding.spec}"
    return f"{type(sharding).__name__} on devices {ids}"


def _boxes(sharding: Sharding, shape: tuple[int, ...]) -> dict[int, Box]:
    """Device id -> the box of the array it holds, in the sharding's device order."""
    index = sharding.devices_indices_map(shape)
    return {d.id: tuple(s.indices(n)[:2] for s, n in zip(index[d], shape)) for d in _ordered_devices(sharding)}


def _group_by_box(boxes: dict[int, Box]) -> dict[Box, tuple[int, ...]]:
    groups: dict[Box, list[int]] = defaultdict(list)
    for d, box in boxes.items():
        groups[box].append(d)
    return {box: tuple(ds) for box, ds in groups.items()}


def plan_reshard(shape: Sequence[int], dtype, src_sharding: Sharding, dst_sharding: Sharding, *,
                 broadcast: bool = True) -> ReshardPlan:
    """The tile transfers that move a ``shape``/``dtype`` array from ``src_sharding`` to
    ``dst_sharding``, with senders balanced, and the rounds that execute them."""
    shape = tuple(int(n) for n in shape)
    for role, sharding in (("source", src_sharding), ("destination", dst_sharding)):
        _check_sharding(role, sharding, shape)
    itemsize = np.dtype(dtype).itemsize
    nbytes = lambda box: math.prod(_box_shape(box)) * itemsize  # noqa: E731
    src_boxes, dst_boxes = _boxes(src_sharding, shape), _boxes(dst_sharding, shape)
    holders_of, receivers_of = _group_by_box(src_boxes), _group_by_box(dst_boxes)

    # Tiles, and the pieces that must cross: (tile index, piece box, receiver).
    raw_tiles, pieces = [], []
    for dst_box, receivers in receivers_of.items():
        turn = 0  # tiles of this destination box so far
        for src_box, holders in holders_of.items():
            box = _intersect(src_box, dst_box)
            if box is None:
                continue
            lacking = [r for r in receivers if r not in holders]
            # Rotate which receiver gets which piece from tile to tile, so that uneven (larger)
            # pieces spread over the receivers and rounds of one piece shape fill up.
            turn, first = turn + 1, turn % max(len(lacking), 1)
            lacking = lacking[first:] + lacking[:first]
            cut = _split(box, len(lacking)) if broadcast else [box] * len(lacking)
            pieces += [(len(raw_tiles), piece, r) for piece, r in zip(cut, lacking)]
            raw_tiles.append((box, holders, receivers, lacking, cut))

    # Balance: largest pieces first, each to the least-loaded of its holders (then the lowest id).
    load: dict[int, int] = defaultdict(int)
    sends_of: dict[int, list[Send]] = defaultdict(list)
    for i, piece, receiver in sorted(pieces, key=lambda p: -nbytes(p[1])):
        holders = raw_tiles[i][1]
        sender = min(holders, key=lambda h: (load[h], h))
        load[sender] += nbytes(piece)
        sends_of[i].append(Send(piece, sender, receiver, nbytes(piece)))

    tiles = []
    for i, (box, holders, receivers, lacking, cut) in enumerate(raw_tiles):
        sends = tuple(sorted(sends_of[i], key=lambda s: lacking.index(s.receiver)))
        gathers = _all_gather_sends(cut, lacking, nbytes) if broadcast else ()
        tiles.append(Tile(box, nbytes(box), holders, receivers, sends, gathers))

    devices = tuple(dict.fromkeys([*src_boxes, *dst_boxes]))
    local = [Send(t.box, d, d, t.nbytes) for t in tiles for d in t.local]
    rounds = (*_rounds("local", local), *_rounds("cross", [s for t in tiles for s in t.sends]),
              *_rounds("gather", [s for t in tiles for s in t.gathers]))
    return ReshardPlan(shape, np.dtype(dtype), src_sharding, dst_sharding, broadcast, tuple(tiles), rounds, devices)


def _all_gather_sends(pieces: list[Box], receivers: list[int], nbytes) -> tuple[Send, ...]:
    """Receiver j holds piece j (there may be fewer pieces than receivers); each sends its piece
    to every other receiver, ordered by shift so that one shift is one permutation."""
    k = len(receivers)
    return tuple(Send(piece, receivers[j], receivers[(j + shift) % k], nbytes(piece))
                 for shift in range(1, k) for j, piece in enumerate(pieces))


def _rounds(phase: str, sends: Iterable[Send]) -> list[Round]:
    """Group sends into permutations of one piece shape each (first fit)."""
    rounds: list[tuple[tuple[int, ...], set, set, list]] = []
    for s in sends:
        shape = _box_shape(s.box)
        for r_shape, senders, receivers, members in rounds:
            if r_shape == shape and s.sender not in senders and s.receiver not in receivers:
                break
        else:
            rounds.append((shape, set(), set(), []))
            r_shape, senders, receivers, members = rounds[-1]
        senders.add(s.sender)
        receivers.add(s.receiver)
        members.append(s)
    return [Round(phase, shape, tuple(members)) for shape, _, _, members in rounds]


# ---------------------------------------------------------------- checks


def _check_sharding(role: str, sharding, shape: tuple[int, ...]) -> None:
    """Errors before any device memory is touched, naming the value and the fix."""
    if not isinstance(sharding, Sharding):
        raise JaxparError(f"the {role} sharding is a {type(sharding).__name__} ({sharding!r}), not a "
                          f"jax.sharding.Sharding; pass e.g. NamedSharding(mesh, PartitionSpec(...))")
    if isinstance(sharding, NamedSharding):
        if not isinstance(sharding.mesh, Mesh):
            raise JaxparError(f"the {role} sharding's mesh is abstract ({sharding.mesh}): it names no devices; "
                              f"build it on concrete devices, e.g. jax.make_mesh(..., devices=...)")
        spec = sharding.spec
        if len(spec) > len(shape):
            raise LayoutError(f"the {role} sharding's {spec} has {len(spec)} entries but the array has shape "
                              f"{shape} ({len(shape)} dims); use a PartitionSpec with at most {len(shape)} entries")
        for dim, axes in enumerate(spec):
            axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
            shards = math.prod(sharding.mesh.shape[a] for a in axes)
            if shape[dim] % shards:
                raise LayoutError(f"dim {dim} of shape {shape} has {shape[dim]} elements, which the {role} "
                                  f"sharding's mesh axes {axes} cannot split into {shards} equal shards; use a "
                                  f"size divisible by {shards} or leave dim {dim} unsharded")
    known = {d.id: d for d in jax.devices()}
    for d in sharding.device_set:
        if known.get(d.id) != d:
            raise JaxparError(f"device {d} of the {role} sharding is not one of this process's devices "
                              f"{list(known.values())}; build the {role} mesh from jax.devices()")
    sizes = {_box_shape(tuple(s.indices(n)[:2] for s, n in zip(idx, shape)))
             for idx in sharding.devices_indices_map(shape).values()}
    if len(sizes) > 1:
        raise LayoutError(f"the {role} sharding splits shape {shape} into shards of unequal shapes {sorted(sizes)}; "
                          f"use a shape that every sharded dim divides evenly")


# ---------------------------------------------------------------- execution


@dataclass(frozen=True)
class ReshardProgram:
    """A plan, the mesh over the union of devices, and the compiled program that executes it. The
    program's collective-permutes move exactly ``plan.link_bytes()`` (read back from its HLO text
    by the analysis: ``hlo.link_bytes(program.compiled.as_text(), program.mesh)``)."""

    plan: ReshardPlan
    mesh: Mesh  # 1-D, axis AXIS, devices in plan.devices order (HLO logical ids are positions in it)
    compiled: jax.stages.Compiled
    src_block: tuple[int, ...]
    dst_block: tuple[int, ...]

    def __call__(self, x: jax.Array) -> jax.Array:
        by_device = {s.device.id: s.data for s in x.addressable_shards}
        blocks = [by_device[d.id] if d.id in by_device else jnp.zeros(self.src_block, x.dtype, device=d)
                  for d in self.mesh.devices.flat]
        # Zero-copy: the source array's own buffers; zeros on devices only in the destination mesh.
        stacked = jax.make_array_from_single_device_arrays(
            (self.mesh.size * self.src_block[0], *self.src_block[1:]), NamedSharding(self.mesh, P(AXIS)), blocks)
        out = {s.device.id: s.data for s in self.compiled(stacked).addressable_shards}
        dst = self.plan.dst
        return jax.make_array_from_single_device_arrays(
            self.plan.shape, dst, [out[d.id] for d in _ordered_devices(dst)])


def compile_reshard(shape: Sequence[int], dtype, src_sharding: Sharding, dst_sharding: Sharding, *,
                    broadcast: bool = True) -> ReshardProgram:
    """Plan and compile once per (shape, dtype, shardings, broadcast); cached."""
    return _compile(tuple(int(n) for n in shape), np.dtype(dtype), src_sharding, dst_sharding, bool(broadcast))


@functools.lru_cache(maxsize=64)
def _compile(shape: tuple[int, ...], dtype: np.dtype, src_sharding: Sharding, dst_sharding: Sharding,
             broadcast: bool) -> ReshardProgram:
    plan = plan_reshard(shape, dtype, src_sharding, dst_sharding, broadcast=broadcast)
    by_id = {d.id: d for d in (*src_sharding.device_set, *dst_sharding.device_set)}
    mesh = Mesh(np.array([by_id[i] for i in plan.devices]), (AXIS,))
    position = {d: i for i, d in enumerate(plan.devices)}
    src_boxes, dst_boxes = _boxes(src_sharding, plan.shape), _boxes(dst_sharding, plan.shape)
    src_block = _box_shape(next(iter(src_boxes.values())))
    dst_block = _box_shape(next(iter(dst_boxes.values())))

    steps = []
    for r in plan.rounds:
        # Per device (row = position): where its piece starts in its own block, where the piece it
        # receives goes in its destination block, and whether it receives one this round.
        read = np.zeros((len(plan.devices), len(plan.shape)), np.int32)
        write = np.zeros_like(read)
        receives = np.zeros(len(plan.devices), bool)
        read_from = dst_boxes if r.phase == "gather" else src_boxes
        for s in r.sends:
            read[position[s.sender]] = [a - b for (a, _), (b, _) in zip(s.box, read_from[s.sender])]
            write[position[s.receiver]] = [a - b for (a, _), (b, _) in zip(s.box, dst_boxes[s.receiver])]
            receives[position[s.receiver]] = True
        perm = [(position[s.sender], position[s.receiver]) for s in r.sends] if r.phase != "local" else None
        steps.append((r.phase, r.shape, read, write, receives, perm))

    def body(src):
        me = jax.lax.axis_index(AXIS)
        out = jnp.zeros(dst_block, src.dtype)
        for phase, piece_shape, read, write, receives, perm in steps:
            source = out if phase == "gather" else src
            piece = jax.lax.dynamic_slice(source, tuple(jnp.asarray(read)[me]), piece_shape)
            if perm is not None:
                piece = jax.lax.ppermute(piece, AXIS, perm)
            at = tuple(jnp.asarray(write)[me])
            # A device that receives nothing this round writes back what is already there.
            kept = jnp.where(jnp.asarray(receives)[me], piece, jax.lax.dynamic_slice(out, at, piece_shape))
            out = jax.lax.dynamic_update_slice(out, kept, at)
        return out

    # Blocks stacked along dim 0, one per device of the union (see ReshardProgram.__call__).
    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
    stacked = (mesh.size * src_block[0], *src_block[1:])
    arg = jax.ShapeDtypeStruct(stacked, dtype, sharding=NamedSharding(mesh, P(AXIS)))
    return ReshardProgram(plan, mesh, run.lower(arg).compile(), src_block, dst_block)


def reshard(x: jax.Array, dst_sharding: Sharding, *, broadcast: bool = True) -> jax.Array:
    """``x`` moved to ``dst_sharding``, which may live on other devices (another mesh).

    ``broadcast=False`` sends each receiver its whole tile (for comparison; see the module doc)."""
    if not isinstance(x, jax.Array):
        raise JaxparError(f"reshard takes a jax.Array, got {type(x).__name__}; place it first with jax.device_put")
    if x.ndim == 0:
        raise JaxparError(f"reshard moves arrays with at least one dim, got a scalar of shape {x.shape}; "
                          f"use jax.device_put(x, dst_sharding) for scalars")
    if not x.is_fully_addressable:
        raise JaxparError("reshard runs in one process: x has shards on devices of other processes; "
                          "call it where every device of both meshes is addressable")
    return compile_reshard(x.shape, x.dtype, x.sharding, dst_sharding, broadcast=broadcast)(x)
