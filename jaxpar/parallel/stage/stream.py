"""PipeDream over an endless stream: one window of micro-batches a call, never flushed.

``pipeline.pipedream_train`` runs a finite stream from an empty pipeline to an empty one. Here the
pipeline stays full from one call to the next: a call runs the 2m ticks in which m new
micro-batches enter stage 0 (the asynchronous schedule's steady state, which repeats every 2m
ticks), while later stages go on with the micro-batches still in flight from the call before. What
a stage holds between calls — its weights and optimizer state, the inputs and weights stashed for
the micro-batches in flight, the gradients on their way back, the window's micro-batches — is
the stream's state, a pytree carried from call to call (``init`` makes it, ``step`` returns it).

The window's tables come from the schedule of 4m micro-batches (``window_tables``): the ticks from stage
0's forward of micro-batch m to its forward of 2m, checked to repeat in the next window. Buffer
slots are given by micro-batch number modulo the slots a stage needs (the micro-batches live on a
stage are consecutive), so they repeat too. In the first window the micro-batches before the
stream's start are masked (their actions idle): the weight versions each micro-batch reads are
then PipeDream's from the first one on (``pipeline.stash_versions``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxpar import marks
from jaxpar.parallel.stage import schedules
from jaxpar.parallel.stage.pipeline import (STAGE_AXIS, PipelineModel, Program, _Actions, _at, _check_pieces, _initial_carry,
                                            _tick_fn, _typed_branches, check_microbatches, link_wait_seconds, lower,
                                            stacked_layers)
from jaxpar.parallel.stage.schedules import BACKWARD, FORWARD, IDLE, ScheduleError
from jaxpar.rules import vary_over, varying_axes


@dataclasses.dataclass(frozen=True)
class Window:
    """One window's tables. ``program``'s ``microbatch`` column numbers the window's 2m
    micro-batches (m..2m-1: those entering now; below m: the call before's, still in flight);
    ``act_slot`` / ``cot_slot`` say whether an action reads a slot (1) and ``recv_act`` /
    ``recv_cot`` which micro-batch arrives (-1: none): slots are resolved per call (``_resolve``).
    ``reported``: the micro-batches whose loss the window computes (the last stage's forwards)."""

    program: Program
    microbatches: int
    reported: np.ndarray


def window_tables(stages: int, microbatches: int, latency: int = 1) -> Window:
    m = microbatches
    schedule = schedules.pipedream(stages, 4 * m, latency)
    program = lower(schedule)
    entered = {int(schedule.microbatch[t, 0]): t for t in range(schedule.ticks) if schedule.kind[t, 0] == FORWARD}
    windows = [slice(entered[m], entered[2 * m]), slice(entered[2 * m], entered[3 * m])]
    columns = [_columns(schedule, program, w, shift, m) for w, shift in zip(windows, (m, 2 * m))]
    if any(not np.array_equal(columns[0][name], columns[1][name]) for name in columns[0]):
        raise ScheduleError(f"pipedream on {stages} stages with {m} micro-batches a window does not repeat from one window "
                            f"to the next; give at least microbatches={stages}")
    col = columns[0]
    if col["microbatch"][col["kind"] != IDLE].min() < 0:
        raise ScheduleError(f"pipedream on {stages} stages keeps more micro-batches in flight than a window of {m} holds; "
                            f"give at least microbatches={stages}")
    window = Program(col["kind"], col["first"], col["last"], col["chunk"], col["microbatch"], col["act_slot"],
                     col["cot_slot"], col["recv_act"], col["recv_cot"], program.act_slots, program.cot_slots,
                     program.forward_sends, program.backward_sends, col["forward_send"], col["backward_send"])
    reported = np.sort(col["microbatch"][(col["kind"] == FORWARD) & (col["last"] > 0)])
    return Window(window, m, reported)


def _columns(schedule, program: Program, ticks: slice, shift: int, m: int) -> dict:
    """The tables of ``ticks``, micro-batches numbered from ``shift - m`` (see ``Window``)."""
    kind = schedule.kind[ticks].astype(np.int32)
    busy = kind != IDLE
    number = lambda mb: np.where(mb >= 0, mb - shift + m, -1)  # noqa: E731
    recv_act, recv_cot = np.full(kind.shape, -1, np.int32), np.full(kind.shape, -1, np.int32)
    S = schedule.stages
    for t, s in zip(*np.nonzero(busy)):
        i = schedule.microbatch[ticks][t, s]
        if kind[t, s] == FORWARD and s < S - 1:
            recv_act[t, s + 1] = number(i)
        if kind[t, s] == BACKWARD and s > 0:
            recv_cot[t, s - 1] = number(i)
    return {
        "kind": kind, "first": program.first[ticks], "last": program.last[ticks], "chunk": program.chunk[ticks],
        "microbatch": np.where(busy, number(schedule.microbatch[ticks]), 0).astype(np.int32),
        "act_slot": (program.act_slot[ticks] != program.act_slots).astype(np.int32),
        "cot_slot": (program.cot_slot[ticks] != program.cot_slots).astype(np.int32),
        "recv_act": recv_act, "recv_cot": recv_cot,
        "forward_send": program.forward_send[ticks], "backward_send": program.backward_send[ticks],
    }


def _resolve(rows: dict, window, m: int, act_slots: int, cot_slots: int) -> dict:
    """A tick's rows for call number ``window``: slots by micro-batch number modulo the slots,
    and the actions on micro-batches before the stream's start idle."""
    number = window * m + rows["microbatch"] - m  # in the stream
    slot = lambda has, x, n: jnp.where(has, jnp.mod(window * m + x - m, n), n)  # noqa: E731
    return dict(rows, kind=jnp.where(number < 0, IDLE, rows["kind"]),
                act_slot=slot(rows["act_slot"] > 0, rows["microbatch"], act_slots),
                cot_slot=slot(rows["cot_slot"] > 0, rows["microbatch"], cot_slots),
                recv_act=slot(rows["recv_act"] >= 0, rows["recv_act"], act_slots),
                recv_cot=slot(rows["recv_cot"] >= 0, rows["recv_cot"], cot_slots))


def start(model, window: Window, params, edge, batch, optimizer, axis: str = STAGE_AXIS):
    """Per device, inside a ``shard_map`` where ``axis`` is manual: the stream's carry before its
    first micro-batch. ``params``: this device's one chunk (leaves (1, k, ...)); ``edge``: its
    copy of the edge weights; ``batch``: one call's micro-batches (leaves (m, ...): shapes read)."""
    edge = jax.tree.map(lambda e: vary_over(e, {axis}), edge)
    two = jax.tree.map(lambda b: jnp.concatenate([b, b]), batch)
    flow, flows = _check_pieces(model, params, edge, two, axis)
    actions = _Actions(model, params, edge, two, flow, 1.0, optimizer)
    carry = _initial_carry(actions, window.program, flows, axis)
    carry.update(window=vary_over(jnp.zeros((), jnp.int32), {axis}),
                 previous=jax.tree.map(lambda b: vary_over(jnp.zeros_like(b), varying_axes(b) | {axis}), batch))
    return carry


def advance(model, window: Window, carry, batch, optimizer, *, loss_scale=1.0, axis: str = STAGE_AXIS, link=None,
            batch_axes: tuple = (), reduce_dtype=jnp.float32):
    """Per device, as ``start``: (the carry after one call's window, this device's losses of the
    micro-batches ``window.reported`` (non-zero on the last stage only; summed over ``axis`` they
    are the losses), their numbers in the stream (negative: before its start)). Each backward's
    gradient is that of ``loss_scale`` times its micro-batch's loss; ``carry["grad_norm"]`` is
    the largest norm of the gradients the window applied on this device. ``link``: as
    ``run_schedule``'s (slow links, for real); ``batch_axes``: the axes each update's gradient is
    summed over, in ``reduce_dtype``, the rows being split over them (the weights alike on them)."""
    m, program = window.microbatches, window.program
    here = jax.lax.axis_index(axis)
    carry = dict(carry)
    both = jax.tree.map(lambda p, b: jnp.concatenate([p, b]), carry.pop("previous"), batch)
    calls = carry.pop("window")
    carry["grad_norm"] = jnp.zeros_like(carry["grad_norm"])
    flow, _ = _check_pieces(model, carry["params"], carry["edge"], both, axis)
    actions = _Actions(model, carry["params"], carry["edge"], both, flow, loss_scale, optimizer, batch_axes, reduce_dtype)
    table = {name: jnp.asarray(col) for name, col in program.columns().items()}
    example = {name: _at(col[0], here) for name, col in table.items()}
    raw = [actions.branch(IDLE)] + [_each_of(actions.branch(kind), m, 2 * m) for kind in (FORWARD, BACKWARD)]
    branches, carry = _typed_branches(raw, carry, example)
    tick = _tick_fn(branches, here, axis, program, link_wait_seconds(flow, link))
    carry, _ = jax.lax.scan(lambda c, rows: tick(c, _resolve(rows, calls, m, program.act_slots, program.cot_slots)),
                            carry, table)
    losses = jnp.where(here == program.kind.shape[1] - 1, carry["losses"][window.reported], 0.0)
    shift = lambda x: jnp.concatenate([x[m:], jnp.zeros_like(x[m:])])  # noqa: E731  (the next call's numbering)
    carry.update(losses=shift(carry["losses"]), versions=shift(carry["versions"]), window=calls + 1,
                 previous=jax.tree.map(lambda b: vary_over(b, varying_axes(b) | {axis}), batch))
    numbers = jax.lax.pmax(calls, axis) * m + jnp.asarray(window.reported) - m
    return carry, losses, numbers


def _each_of(branch, runs: int, ticks: int):
    """``branch`` named as taken on ``runs`` of the window's ``ticks`` (a stage runs m forwards and m
    backwards in its 2m ticks), for ``analysis/hlo.py`` to count the collectives inside it."""
    def named(carry, row):
        with jax.named_scope(marks.branch_runs(runs, ticks)):
            return branch(carry, row)
    return named


class PipeDreamStream:
    """PipeDream (asynchronous 1F1B, weight stashing, an ``optimizer`` step on a stage after each of
    its backwards) over an endless stream of micro-batches on ``mesh`` (manual over ``stage``,
    every other axis Auto), ``microbatches`` entering per call; see the module docstring.

    ``first_fn(edge, mb)``, ``stage_fn(chunk, x)``, ``last_fn(edge, x, mb)`` as for
    ``pipedream_train``: the first and the last stage each keep and step their own copy of the
    edge weights."""

    def __init__(self, mesh, microbatches: int, *, first_fn, stage_fn, last_fn, optimizer, latency: int = 1):
        if STAGE_AXIS not in mesh.axis_names:
            raise ScheduleError("a PipeDream stream runs over the mesh's stage axis; give the mesh stage=S")
        self.mesh, self.stages, self.optimizer = mesh, int(mesh.shape[STAGE_AXIS]), optimizer
        self.window = window_tables(self.stages, microbatches, latency)
        self.model = PipelineModel(first_fn, stage_fn, last_fn)
        self._step = None

    @property
    def microbatches(self) -> int:
        return self.window.microbatches

    def init(self, stage_params, edge_params, example_batch):
        """The stream's state before its first micro-batch: ``stage_params`` stacked on layers (the
        stage s's chunk: layers s*k .. s*k + k - 1), ``edge_params`` (copied to every stage),
        ``example_batch`` one call's micro-batches (leaves (m, ...): only their shapes are read)."""
        m, S = self.microbatches, self.stages
        check_microbatches(example_batch, m)
        if stacked_layers(stage_params) % S:
            raise ScheduleError(f"{stacked_layers(stage_params)} layers do not split over {S} stages")

        def body(params, edge, batch):
            params = jax.tree.map(lambda x: x[None], params)  # (one chunk a stage)
            carry = start(self.model, self.window, params, edge, batch, self.optimizer)
            return jax.tree.map(lambda x: x[None], carry)

        stage_spec = jax.tree.map(lambda _: PartitionSpec(STAGE_AXIS), stage_params)
        replicated = lambda tree: jax.tree.map(lambda _: PartitionSpec(), tree)  # noqa: E731
        return jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=(stage_spec, replicated(edge_params),
                                                                      replicated(example_batch)),
                                     out_specs=PartitionSpec(STAGE_AXIS), axis_names={STAGE_AXIS}))(
            stage_params, edge_params, example_batch)

    def step(self, state, batch):
        """(state, losses, numbers): one window. ``losses`` (m,): the loss of each micro-batch whose
        forward the last stage ran in this window, ``numbers`` (m,) its number in the stream
        (negative: before the stream's start, its loss 0)."""
        check_microbatches(batch, self.microbatches)
        if self._step is None:
            self._step = self._compile(batch)
        return self._step(state, batch)

    def _compile(self, batch):
        def body(carry, batch):
            carry = jax.tree.map(lambda x: x[0], carry)
            carry, losses, numbers = advance(self.model, self.window, carry, batch, self.optimizer)
            return jax.tree.map(lambda x: x[None], carry), jax.lax.psum(losses, STAGE_AXIS), numbers

        replicated = jax.tree.map(lambda _: PartitionSpec(), batch)
        return jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=(PartitionSpec(STAGE_AXIS), replicated),
                                     out_specs=(PartitionSpec(STAGE_AXIS), PartitionSpec(), PartitionSpec()),
                                     axis_names={STAGE_AXIS}), donate_argnums=0)

    def weights(self, state):
        """(stacked weights in layer order, each stage's copy of the edge weights (S, ...))."""
        stacked = jax.tree.map(lambda x: x.reshape(-1, *x.shape[3:]), state["params"])  # (S, 1 chunk, k, ...)
        return stacked, state["edge"]
