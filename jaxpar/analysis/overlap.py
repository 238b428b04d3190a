"""Exposed communication: the part of a transfer that no compute hides, for the two shapes of overlap
jaxpar's layouts have.

- A ring (context parallelism's K/V, CSBP's clean K/V): step i computes on the chunk that arrived
  while the next chunk travels, so each of the ranks - 1 hops hides under one step's compute and
  only what a hop takes beyond it waits (``ring_exposed``); a transfer after the last step (the
  K/V gradients' hop home) has nothing left to hide under.
- A pipeline schedule (``parallel/stage/schedules.py``): each forward and backward waits for its
  input from the neighbouring stage, sent when the neighbour finished. ``schedule_seconds`` runs
  the schedule's per-device program order with real durations; a send is exposed where it lies on
  the critical path (the fill and the drain, or a send longer than the work between two actions).
  Run in lockstep (the SPMD executor: one ``lax.scan`` step per tick, each tick ending with its
  collective-permute), every tick lasts its slowest action plus its send, and no send hides.
"""

from __future__ import annotations

import numpy as np

from jaxpar.parallel.stage.schedules import BACKWARD, FORWARD, IDLE, Schedule


def ring_exposed(hop_s: float, step_s: float, ranks: int, home_s: float = 0.0) -> float:
    """Seconds a ring of ``ranks`` steps waits on its links: ranks - 1 hops of ``hop_s`` each, each
    under one step of ``step_s`` compute, plus ``home_s`` sent after the last step."""
    return (ranks - 1) * max(0.0, hop_s - step_s) + home_s


def kv_ring_exposed(chunk_bytes: float, grad_bytes: float, link: float, step_s: float, ranks: int) -> float:
    """Seconds one layer's K/V ring waits on its links, forward and backward: ``chunk_bytes`` of K/V
    a hop under ``step_s`` of a ring step's forward attention; backward the K/V and their
    gradients (``grad_bytes`` a chunk) a hop under 2.5 times it (a flash backward recomputes the
    scores), and the gradients' hop home."""
    return (ring_exposed(chunk_bytes / link, step_s, ranks)
            + ring_exposed((chunk_bytes + grad_bytes) / link, 2.5 * step_s, ranks, home_s=grad_bytes / link))


def schedule_seconds(schedule: Schedule, forward_s: float, backward_s: float, send_s: float, lockstep: bool = False) -> float:
    """Seconds from the first action to the last of ``schedule`` when a forward takes ``forward_s``,
    a backward ``backward_s`` and a send between stages ``send_s`` (``lockstep``: the SPMD
    executor's ticks, see the module doc)."""
    kind = schedule.kind
    if lockstep:
        seconds = np.where(kind == FORWARD, forward_s, np.where(kind == BACKWARD, backward_s, 0.0))
        S, V = schedule.stages, schedule.virtual_stages
        k = schedule.chunk * S + np.arange(S)
        sends = ((kind == FORWARD) & (k < V - 1)) | ((kind == BACKWARD) & (k > 0))  # what a neighbour reads
        return float(seconds.max(axis=1).sum() + send_s * sends.any(axis=1).sum())
    return float(max(times.max() for times in action_times(schedule, forward_s, backward_s, send_s)))


def action_times(schedule: Schedule, forward_s: float, backward_s: float, send_s: float = 0.0) -> tuple:
    """When each action starts and ends, every device starting its next action (in the schedule's
    program order) once it is free and its input has arrived: (forward starts, forward ends,
    backward starts, backward ends), each (microbatches, virtual stages)."""
    kind, S, V = schedule.kind, schedule.stages, schedule.virtual_stages
    start_f, end_f, start_b, end_b = (np.zeros((schedule.microbatches, V)) for _ in range(4))
    free = np.zeros(S)  # when each device finishes its last action
    for t, s in zip(*np.nonzero(kind != IDLE)):  # tick order: every input is placed before its reader
        i, k = schedule.microbatch[t, s], schedule.chunk[t, s] * S + s
        if kind[t, s] == FORWARD:
            start_f[i, k] = max(free[s], end_f[i, k - 1] + send_s if k > 0 else 0.0)
            end_f[i, k] = free[s] = start_f[i, k] + forward_s
        else:
            start_b[i, k] = max(free[s], end_f[i, k], end_b[i, k + 1] + send_s if k < V - 1 else 0.0)
            end_b[i, k] = free[s] = start_b[i, k] + backward_s
    return start_f, end_f, start_b, end_b


def update_delays(schedule: Schedule, forward_s: float = 1.0, backward_s: float = 1.0) -> tuple[float, ...]:
    """Per stage (one chunk each), the median over the stream of the weight updates of all stages
    (each backward's end) after a micro-batch's forward starts reading the stage's weights and
    before its backward there updates them, every action timed (``action_times``): PipeDream's
    delay as stale block-SGD, which arXiv 2606.03498 proves S^2 - S/2 + O(1) on stage 0."""
    start_f, _, _, end_b = action_times(schedule, forward_s, backward_s)
    updates = end_b.ravel()
    return tuple(float(np.median([np.sum((updates > start_f[i, s]) & (updates < end_b[i, s]))
                                  for i in range(schedule.microbatches)])) for s in range(schedule.stages))


def schedule_exposed(schedule: Schedule, forward_s: float, backward_s: float, send_s: float, lockstep: bool = False) -> float:
    """Seconds the sends add to ``schedule``'s step: with them against without."""
    return (schedule_seconds(schedule, forward_s, backward_s, send_s, lockstep)
            - schedule_seconds(schedule, forward_s, backward_s, 0.0, lockstep))
