"""PipeDream, its randomized model and LocalSGD as optimizers on one device, in simulated time.

A pipeline of S stages trains S blocks of weights. How its updates meet the loss depends on the
schedule, not on where the blocks live, so each method is simulated here on a list of blocks and
a gradient function, and timed by the schedule's own clock (``overlap.action_times``: a forward
takes ``forward_s``, a backward ``backward_s``):

- ``pipedream``: the asynchronous schedule exactly. Micro-batch i reads stage s's weights after
  ``pipeline.stash_versions`` of its updates (weight stashing: the same version forward and
  backward) and its gradient steps the stage's current weights at once; each update is timed by
  its backward's end.
- ``randomized_pipedream``: the stale block-SGD model of arXiv 2606.03498 (Randomized PipeDream):
  each update picks a block uniformly at random and steps it with the gradient at the iterate
  ``delays[s]`` updates old; the stages' S updates per forward-and-backward make its clock.
- ``flushed``: a synchronous schedule (1F1B, GPipe): one update a step with the gradient averaged
  over its micro-batches, each step timed by the schedule (its bubble included).
- ``local_sgd``: S workers (the pipeline's devices), each with the whole model, each local step
  one micro-batch through all S blocks (S forward-and-backwards of time), averaged every
  ``period`` steps at ``sync_s`` seconds a merge.

``grad(blocks, i)`` returns (loss, per-block gradients) of micro-batch i at ``blocks`` (each block
an array or a pytree of them). Every
method is plain SGD (the theory's) and returns ``Trajectory``: the blocks after each update (or
merge) and the simulated seconds at which they hold.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jaxpar.analysis.overlap import action_times, schedule_seconds
from jaxpar.parallel.stage.pipeline import stash_versions
from jaxpar.parallel.stage.schedules import Schedule

Grad = Callable[[list, int], tuple[float, list]]


@dataclasses.dataclass
class Trajectory:
    """``blocks[j]``: the weights at ``seconds[j]`` of simulated time (``blocks[0]`` the start, at 0)."""

    seconds: list[float]
    blocks: list[list]


def _step(blocks: list, s: int, g, lr: float) -> list:
    return blocks[:s] + [_sgd(blocks[s], g, lr)] + blocks[s + 1:]


def _sgd(block, g, lr: float):
    return jax.tree.map(lambda w, d: w - lr * d, block, g)


def _mean(trees: list):
    return jax.tree.map(lambda *xs: sum(xs) / len(xs), *trees)


def pipedream(grad: Grad, blocks: Sequence, schedule: Schedule, lr: float, forward_s: float = 1.0,
              backward_s: float = 2.0) -> Trajectory:
    """The asynchronous ``schedule`` (``schedules.pipedream``) on ``blocks``, one per stage."""
    S, m = schedule.stages, schedule.microbatches
    if not schedule.asynchronous or len(blocks) != S:
        raise ValueError(f"pipedream simulates the asynchronous schedule over one block a stage, not {schedule.name!r} "
                         f"over {len(blocks)} blocks")
    _, _, _, end_b = action_times(schedule, forward_s, backward_s)
    versions = stash_versions(S, m)
    history = [[b] for b in blocks]  # each stage's weights after n of its updates
    now = list(blocks)
    trajectory = Trajectory([0.0], [list(blocks)])
    for i in range(m):
        _, grads = grad([history[s][versions[s, i]] for s in range(S)], i)
        for s in range(S):
            now = _step(now, s, grads[s], lr)
            history[s].append(now[s])
        trajectory.seconds.append(float(end_b[i].max()))
        trajectory.blocks.append(list(now))
    return trajectory


def randomized_pipedream(grad: Grad, blocks: Sequence, delays: Sequence[float], updates: int, lr: float,
                         seed: int = 0, forward_s: float = 1.0, backward_s: float = 2.0) -> Trajectory:
    """Randomized PipeDream: ``updates`` block updates, each of a block drawn uniformly, with the
    gradient at the iterate ``round(delays[s])`` updates old (``overlap.update_delays``)."""
    rng = np.random.default_rng(seed)
    S, lags = len(blocks), [int(round(d)) for d in delays]
    past = collections.deque([list(blocks)], maxlen=max(lags) + 1)  # past[-1 - j]: the iterate j updates old
    trajectory = Trajectory([0.0], [list(blocks)])
    for k in range(updates):
        s = int(rng.integers(S))
        stale = past[max(0, len(past) - 1 - lags[s])]
        _, grads = grad(stale, k)
        past.append(_step(past[-1], s, grads[s], lr))
        trajectory.seconds.append((k + 1) * (forward_s + backward_s) / S)  # S stages update at once
        trajectory.blocks.append(past[-1])
    return trajectory


def flushed(grad: Grad, blocks: Sequence, schedule: Schedule, steps: int, lr: float, forward_s: float = 1.0,
            backward_s: float = 2.0) -> Trajectory:
    """A synchronous ``schedule``: ``steps`` updates, each with the mean gradient of its
    micro-batches (the i-th step's are ``i*m .. i*m + m - 1``)."""
    m, step_s = schedule.microbatches, schedule_seconds(schedule, forward_s, backward_s, 0.0)
    now = list(blocks)
    trajectory = Trajectory([0.0], [list(blocks)])
    for step in range(steps):
        grads = [grad(now, step * m + i)[1] for i in range(m)]
        now = [_sgd(b, _mean([g[s] for g in grads]), lr) for s, b in enumerate(now)]
        trajectory.seconds.append((step + 1) * step_s)
        trajectory.blocks.append(now)
    return trajectory


def local_sgd(grad: Grad, blocks: Sequence, workers: int, period: int, rounds: int, lr: float, sync_s: float = 0.0,
              forward_s: float = 1.0, backward_s: float = 2.0) -> Trajectory:
    """LocalSGD: ``workers`` copies of the whole model, ``period`` local steps each (worker w's
    j-th on micro-batch ``(round * period + j) * workers + w``), then their mean, ``rounds``
    times. A local step runs every block on one device: S forward-and-backwards."""
    S = len(blocks)
    step_s = S * (forward_s + backward_s)
    now = list(blocks)
    trajectory = Trajectory([0.0], [list(blocks)])
    for r in range(rounds):
        copies = []
        for w in range(workers):
            mine = list(now)
            for j in range(period):
                _, grads = grad(mine, (r * period + j) * workers + w)
                mine = [_sgd(b, g, lr) for b, g in zip(mine, grads)]
            copies.append(mine)
        now = [_mean([c[s] for c in copies]) for s in range(S)]
        trajectory.seconds.append((r + 1) * (period * step_s + sync_s))
        trajectory.blocks.append(now)
    return trajectory


def at_seconds(trajectory: Trajectory, seconds: float) -> list:
    """The blocks the trajectory holds at ``seconds`` of simulated time (the last update by then)."""
    j = int(np.searchsorted(trajectory.seconds, seconds, side="right")) - 1
    return trajectory.blocks[max(j, 0)]
