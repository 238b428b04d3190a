"""Pipeline schedules as data: a table of ticks x stages, each entry an action.

An action is the forward (F) or backward (B) of one micro-batch through one *chunk* of layers, or
idle. Device ``s`` of the ``stage`` mesh axis holds ``chunks`` (v) chunks; chunk ``j`` of device
``s`` is *virtual stage* ``j*S + s`` of the model's ``S*v`` virtual stages (v = 1 except for the
interleaved schedule, where micro-batches go round the ring of devices v times).

Tick model (what the SPMD executor in ``pipeline.py`` runs, one ``lax.scan`` step per tick):
- every device does at most one action per tick, and every action, F or B, takes one tick. The
  executor runs in lockstep (each tick ends with a collective-permute), so a tick lasts as long as
  its slowest action: slots, not FLOPs, are the unit. The bubble fraction is therefore
  ``idle slots / (ticks x stages)`` over the schedule's span, with F = B = 1;
- a result is usable by the neighbouring device ``latency`` ticks after the tick that produced it.
  ``latency=1`` (default): the send happens at the tick boundary (the executor's ppermute), so the
  forward of micro-batch i on virtual stage k may run the tick after its forward on k-1, and the
  backward on k the tick after the backward on k+1 (and after its own forward). ``latency=2``
  models a send that occupies a whole compute slot; that is where eager 1F1B pays off.

Each schedule is generated as a per-device *program order* (which actions, in which order); the
table is then the earliest time each device can run its next action under the tick model (a
device never reorders its program, it idles until the next action is ready). With
``latency=1`` this gives exactly: GPipe and 1F1B bubble (S-1)/(m+S-1), interleaved
(S-1)/(v*m+S-1); eager 1F1B has 1F1B's bubble but, with ``latency=2``, keeps GPipe's while 1F1B's
grows (its extra warm-up forwards leave slack for every send).

PipeDream (asynchronous, no flush, weight stashing) runs 1F1B's program order over a stream of
micro-batches, each of which updates the weights of every stage; ``weight_versions`` and
``staleness`` read which weight version each micro-batch uses from the table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from jaxpar.errors import JaxparError

IDLE, FORWARD, BACKWARD = 0, 1, 2
_LETTER = {FORWARD: "F", BACKWARD: "B"}


class ScheduleError(JaxparError):
    """A schedule that cannot be built for these sizes, or a table that breaks the tick model."""


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """A pipeline schedule: ``kind[t, s]`` (IDLE/FORWARD/BACKWARD), ``microbatch[t, s]`` and
    ``chunk[t, s]`` (-1 where idle) for every tick ``t`` and device ``s`` of the stage axis."""

    name: str
    stages: int
    microbatches: int
    chunks: int
    kind: np.ndarray
    microbatch: np.ndarray
    chunk: np.ndarray
    latency: int = 1
    asynchronous: bool = False  # PipeDream: every micro-batch's backward updates its stage's weights

    @property
    def ticks(self) -> int:
        return self.kind.shape[0]

    @property
    def virtual_stages(self) -> int:
        return self.stages * self.chunks

    def bubble_fraction(self) -> float:
        """Idle slots / all slots over the schedule's span (F and B one slot each)."""
        return float(np.mean(self.kind == IDLE))

    def in_flight(self) -> np.ndarray:
        """(ticks, stages): micro-batch chunks whose forward has run on the device and whose
        backward has not, after each tick (their stage inputs are what the executor keeps)."""
        started = np.cumsum(self.kind == FORWARD, axis=0)
        finished = np.cumsum(self.kind == BACKWARD, axis=0)
        return started - finished

    def peak_in_flight(self) -> tuple[int, ...]:
        """Per device, the most micro-batch chunks in flight at once."""
        return tuple(int(x) for x in self.in_flight().max(axis=0))

    def times(self) -> tuple[np.ndarray, np.ndarray]:
        """(forward tick, backward tick), each shaped (microbatches, virtual stages)."""
        shape = (self.microbatches, self.virtual_stages)
        tf, tb = np.full(shape, -1), np.full(shape, -1)
        for t, s in zip(*np.nonzero(self.kind != IDLE)):
            k, i, j = self.kind[t, s], self.microbatch[t, s], self.chunk[t, s]
            target = tf if k == FORWARD else tb
            target[i, j * self.stages + s] = t
        return tf, tb

    def validate(self) -> Schedule:
        """Raise ``ScheduleError`` unless every forward and backward runs exactly once, on the
        device that holds its chunk, after what it depends on (see the module's tick model)."""
        S, m, v, lat = self.stages, self.microbatches, self.chunks, self.latency
        if not (self.kind.shape == self.microbatch.shape == self.chunk.shape and self.kind.ndim == 2
                and self.kind.shape[1] == S):
            raise ScheduleError(f"{self.name}: kind, microbatch and chunk must all be (ticks, {S}) tables")
        busy = self.kind != IDLE
        if np.any(self.kind[busy] > BACKWARD) or np.any(self.kind < 0):
            raise ScheduleError(f"{self.name}: action kinds must be IDLE={IDLE}, FORWARD={FORWARD} or BACKWARD={BACKWARD}")
        bad = busy & ((self.microbatch < 0) | (self.microbatch >= m) | (self.chunk < 0) | (self.chunk >= v))
        if bad.any():
            t, s = np.argwhere(bad)[0]
            raise ScheduleError(
                f"{self.name}: tick {t}, stage {s} names micro-batch {self.microbatch[t, s]} chunk {self.chunk[t, s]}; "
                f"there are {m} micro-batches and {v} chunks per stage"
            )
        for kind in (FORWARD, BACKWARD):
            count = np.zeros((m, S * v), int)
            for t, s in zip(*np.nonzero(self.kind == kind)):
                count[self.microbatch[t, s], self.chunk[t, s] * S + s] += 1
            if np.any(count != 1):
                i, k = np.argwhere(count != 1)[0]
                raise ScheduleError(
                    f"{self.name}: the {_LETTER[kind]} of micro-batch {i} on virtual stage {k} runs {count[i, k]} "
                    f"times; every forward and backward must run exactly once"
                )
        tf, tb = self.times()
        V = S * v
        for i in range(m):
            for k in range(V):
                if k > 0 and tf[i, k] < tf[i, k - 1] + lat:
                    raise ScheduleError(
                        f"{self.name}: F of micro-batch {i} on virtual stage {k} at tick {tf[i, k]} comes before its input "
                        f"from virtual stage {k - 1} (F at tick {tf[i, k - 1]}, latency {lat})"
                    )
                if tb[i, k] <= tf[i, k]:
                    raise ScheduleError(
                        f"{self.name}: B of micro-batch {i} on virtual stage {k} at tick {tb[i, k]} is not after its "
                        f"forward (tick {tf[i, k]})"
                    )
                if k < V - 1 and tb[i, k] < tb[i, k + 1] + lat:
                    raise ScheduleError(
                        f"{self.name}: B of micro-batch {i} on virtual stage {k} at tick {tb[i, k]} comes before its "
                        f"gradient from virtual stage {k + 1} (B at tick {tb[i, k + 1]}, latency {lat})"
                    )
        return self

    def chart(self) -> str:
        """The table as text: one row per device, ``F3`` / ``B3`` (``F3.1``: chunk 1), ``.`` idle."""
        width = 2 + len(str(self.microbatches - 1)) + (2 if self.chunks > 1 else 0)
        rows = []
        for s in range(self.stages):
            cells = []
            for t in range(self.ticks):
                k = self.kind[t, s]
                if k == IDLE:
                    cells.append(".".ljust(width))
                    continue
                cell = f"{_LETTER[k]}{self.microbatch[t, s]}" + (f".{self.chunk[t, s]}" if self.chunks > 1 else "")
                cells.append(cell.ljust(width))
            rows.append(f"stage {s}: " + "".join(cells).rstrip())
        return "\n".join(rows)


# --- program orders -------------------------------------------------------------------------

Action = tuple[int, int, int]  # (kind, micro-batch, chunk)


def _warmup_then_alternate(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    """``warmup`` forwards, then one backward and one forward in turn, then the last backwards."""
    order = forwards[:warmup]
    rest = iter(forwards[warmup:])
    for b in backwards:
        order.append(b)
        f = next(rest, None)
        if f is not None:
            order.append(f)
    return order


def _place(name: str, stages: int, microbatches: int, chunks: int, orders: list[list[Action]], latency: int,
           asynchronous: bool = False) -> Schedule:
    """Run each device's program order as early as the tick model allows (list scheduling)."""
    S, V = stages, stages * chunks
    tf: dict[tuple[int, int], int] = {}
    tb: dict[tuple[int, int], int] = {}
    never = np.iinfo(np.int64).max // 2
    position = [0] * S
    rows: list[list[Action | None]] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        t = len(rows)
        row: list[Action | None] = []
        for s in range(S):
            if position[s] == len(orders[s]):
                row.append(None)
                continue
            kind, i, j = orders[s][position[s]]
            k = j * S + s
            if kind == FORWARD:
                ready = k == 0 or tf.get((i, k - 1), never) + latency <= t
            else:
                ready = tf.get((i, k), never) < t and (k == V - 1 or tb.get((i, k + 1), never) + latency <= t)
            row.append(orders[s][position[s]] if ready else None)
        if not any(row) and not any(any(r) for r in rows[-latency:]):  # nothing in transit either
            stuck = {s: orders[s][position[s]] for s in range(S) if position[s] < len(orders[s])}
            raise ScheduleError(f"{name}: the program orders deadlock at tick {t}; next actions per stage: {stuck}")
        for s, action in enumerate(row):
            if action is not None:
                kind, i, j = action
                (tf if kind == FORWARD else tb)[(i, j * S + s)] = t
                position[s] += 1
                remaining -= 1
        rows.append(row)
    kind = np.array([[a[0] if a else IDLE for a in r] for r in rows], np.int8).reshape(-1, S)
    mb = np.array([[a[1] if a else -1 for a in r] for r in rows], np.int32).reshape(-1, S)
    ch = np.array([[a[2] if a else -1 for a in r] for r in rows], np.int32).reshape(-1, S)
    return Schedule(name, S, microbatches, chunks, kind, mb, ch, latency, asynchronous).validate()


def _check_sizes(name: str, stages: int, microbatches: int, chunks: int = 1, latency: int = 1):
    for what, value in (("stages", stages), ("microbatches", microbatches), ("chunks", chunks), ("latency", latency)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ScheduleError(f"{name}: {what}={value!r}; it must be a positive integer")


def _check_fills(name: str, stages: int, microbatches: int):
    if microbatches < stages:
        raise ScheduleError(
            f"{name} with {microbatches} micro-batches on {stages} stages: the pipeline never fills. Stage 0 needs "
            f"{stages} forwards in flight before the first backward comes back to it, so with fewer micro-batches than "
            f"stages {name} is only GPipe with a bubble of (S-1)/(m+S-1) = {(stages - 1) / (microbatches + stages - 1):.0%}. "
            f"Use at least microbatches={stages} (several times that keeps the bubble small), or the gpipe schedule"
        )


def _simple(kind: int, m: int) -> list[Action]:
    return [(kind, i, 0) for i in range(m)]


def gpipe(stages: int, microbatches: int, latency: int = 1) -> Schedule:
    """All forwards, then all backwards (every stage holds all m micro-batches' inputs)."""
    _check_sizes("gpipe", stages, microbatches, latency=latency)
    orders = [_simple(FORWARD, microbatches) + _simple(BACKWARD, microbatches) for _ in range(stages)]
    return _place("gpipe", stages, microbatches, 1, orders, latency)


def one_f_one_b(stages: int, microbatches: int, latency: int = 1) -> Schedule:
    """PipeDream-flush: stage s runs S-s forwards, then a backward and a forward in turn, then the
    last backwards. At most S-s micro-batches in flight on stage s."""
    _check_sizes("1f1b", stages, microbatches, latency=latency)
    _check_fills("1f1b", stages, microbatches)
    f, b = _simple(FORWARD, microbatches), _simple(BACKWARD, microbatches)
    orders = [_warmup_then_alternate(f, b, stages - s) for s in range(stages)]
    return _place("1f1b", stages, microbatches, 1, orders, latency)


def eager_one_f_one_b(stages: int, microbatches: int, latency: int = 1) -> Schedule:
    """1F1B with 2(S-s)-1 warm-up forwards on stage s (clipped by m): exactly the forwards that fit
    before the first backward reaches s, so each send has a compute slot to hide behind. More
    memory (2(S-s)-1 in flight), same bubble as 1F1B at latency 1, GPipe's at latency 2."""
    _check_sizes("eager-1f1b", stages, microbatches, latency=latency)
    _check_fills("eager-1f1b", stages, microbatches)
    f, b = _simple(FORWARD, microbatches), _simple(BACKWARD, microbatches)
    orders = [_warmup_then_alternate(f, b, min(2 * (stages - s) - 1, microbatches)) for s in range(stages)]
    return _place("eager-1f1b", stages, microbatches, 1, orders, latency)


def interleaved_one_f_one_b(stages: int, microbatches: int, chunks: int, latency: int = 1) -> Schedule:
    """Megatron's interleaved 1F1B: each device holds ``chunks`` (v) chunks of layers and every
    micro-batch goes round the ring of devices v times.

    Devices take micro-batches in rounds of S: S micro-batches through chunk 0, the same S through
    chunk 1, ... The first of a round comes back to device 0 for its next chunk exactly S ticks
    after it left, just as the device finishes the round, so m must be a multiple of S. Warm-up on
    device s: the 2(S-s-1) + (v-1)S + 1 forwards that fit before its first backward arrives."""
    name = "interleaved-1f1b"
    _check_sizes(name, stages, microbatches, chunks, latency)
    if chunks < 2:
        raise ScheduleError(f"{name} with chunks={chunks}: interleaving needs at least 2 chunks per stage; use 1f1b for one")
    if microbatches % stages:
        lower = max(stages, microbatches - microbatches % stages)
        raise ScheduleError(
            f"{name} with {microbatches} micro-batches on {stages} stages: micro-batches go round the stages in groups "
            f"of S={stages}, so each group comes back to stage 0 exactly when the stage has finished the group; "
            f"{microbatches} is not a multiple of {stages}, which would leave a partial group and stall the ring. "
            f"Use microbatches={lower} or {lower + stages}"
        )
    group = stages * chunks

    def action(kind: int, k: int) -> Action:
        rnd, within = divmod(k, group)
        chunk = within // stages if kind == FORWARD else chunks - 1 - within // stages
        return kind, rnd * stages + within % stages, chunk

    n = microbatches * chunks
    f = [action(FORWARD, k) for k in range(n)]
    b = [action(BACKWARD, k) for k in range(n)]
    orders = [_warmup_then_alternate(f, b, min(2 * (stages - s - 1) + (chunks - 1) * stages + 1, n)) for s in range(stages)]
    return _place(name, stages, microbatches, chunks, orders, latency)


def pipedream(stages: int, microbatches: int, latency: int = 1) -> Schedule:
    """Asynchronous PipeDream: 1F1B's program order over a stream of ``microbatches`` micro-batches
    with no flush; each micro-batch's backward updates its stage's weights at once, and its forward
    and backward use the same (stashed) weight version. See ``weight_versions`` and ``staleness``."""
    _check_sizes("pipedream", stages, microbatches, latency=latency)
    if microbatches < stages:
        raise ScheduleError(
            f"pipedream with {microbatches} micro-batches on {stages} stages: the stream never fills, so stage s never "
            f"trains with the S-s-1 updates of staleness PipeDream has (here {stages - 1} on stage 0), and its updates "
            f"follow no stale-SGD model; give at least microbatches={stages} (several times that keeps the fill short)")
    f, b = _simple(FORWARD, microbatches), _simple(BACKWARD, microbatches)
    orders = [_warmup_then_alternate(f, b, min(stages - s, microbatches)) for s in range(stages)]
    return _place("pipedream", stages, microbatches, 1, orders, latency, asynchronous=True)


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "eager-1f1b": eager_one_f_one_b,
    "interleaved-1f1b": interleaved_one_f_one_b,
    "pipedream": pipedream,
}


def check_chunks(name: str, chunks: int):
    """Refuse, before any work, a ``--chunks`` below what schedule ``name`` runs, suggesting one
    that it runs (interleaving needs 2 chunks per stage; the others run 1)."""
    if name == "interleaved-1f1b" and chunks < 2:
        raise ScheduleError(f"--chunks {chunks} is too small for --schedule interleaved-1f1b: it interleaves at least 2 "
                            f"chunks of layers per stage (--chunks defaults to 1); pass --chunks 2 or more, or use "
                            f"--schedule 1f1b for one chunk")
    if chunks < 1:
        raise ScheduleError(f"--chunks {chunks} is too small: a stage holds at least 1 chunk of layers, and more only "
                            f"under --schedule interleaved-1f1b; drop --chunks (1 chunk), or pass --schedule "
                            f"interleaved-1f1b --chunks 2")


def make(name: str, stages: int, microbatches: int, chunks: int = 1, latency: int = 1) -> Schedule:
    """The schedule called ``name`` (one of ``SCHEDULES``); ``chunks`` only for interleaved-1f1b."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown pipeline schedule {name!r}; the schedules are {', '.join(SCHEDULES)}")
    if name == "interleaved-1f1b":
        return interleaved_one_f_one_b(stages, microbatches, chunks, latency)
    if chunks != 1:
        raise ScheduleError(f"schedule {name!r} runs one chunk per stage, not chunks={chunks}; use interleaved-1f1b")
    return SCHEDULES[name](stages, microbatches, latency)


# --- PipeDream's weight versions --------------------------------------------------------------


def weight_versions(schedule: Schedule) -> np.ndarray:
    """(stages, microbatches): how many updates stage s had applied when micro-batch i's forward
    ran there. Weight stashing makes the backward of i use that same version."""
    if schedule.chunks != 1:
        raise ScheduleError("weight versions are defined for one chunk per stage")
    tf, tb = schedule.times()
    # updates applied before tick t on stage s = backwards of stage s at earlier ticks
    return np.array([[np.sum(tb[:, s] < tf[i, s]) for i in range(schedule.microbatches)] for s in range(schedule.stages)])


def staleness(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most updates of that stage between the weights a micro-batch's gradient was
    computed at and the weights it is applied to: S-s-1 for PipeDream (0 on the last stage)."""
    tf, tb = schedule.times()
    versions = weight_versions(schedule)
    applied_before = np.array([[np.sum(tb[:, s] < tb[i, s]) for i in range(schedule.microbatches)]
                               for s in range(schedule.stages)])
    return tuple(int(x) for x in (applied_before - versions).max(axis=1))
