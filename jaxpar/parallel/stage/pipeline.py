"""SPMD pipeline parallelism over the ``stage`` mesh axis: one jitted program runs any schedule.

The model is three functions and two sets of weights:

- ``first_fn(edge, batch) -> x`` (e.g. the embedding) runs on virtual stage 0;
- ``stage_fn(chunk, x) -> x`` runs one chunk of consecutive layers; ``chunk`` holds the chunk's
  slice of the weights stacked on ``layers`` (leading dim = layers per chunk);
- ``last_fn(edge, x, batch) -> loss`` (head and loss) runs on the last virtual stage.

(A model need not write these: ``split_at_layer_scan`` cuts any model's traced loss at its
layer scan, and ``Trainer`` does so by default. The executors call the pieces through
``PipelineModel.first`` / ``stage`` / ``last``, which hand each piece all a device holds for the
micro-batch; ``PipelineModel``'s pass on the part its functions take.)

``edge`` weights (embedding, head: also tied ones) are kept whole on every stage and their
gradient is summed over ``stage`` at the end (only the first and the last stage add to it).
Stacked weights are split over ``stage``: device s holds chunks j = 0..v-1, chunk j being virtual
stage j*S + s, i.e. layers [(j*S+s)*k, (j*S+s+1)*k) with k = layers / (S*v).

Executor (``run_schedule``, per device inside ``shard_map``): a ``lax.scan`` over the schedule's
ticks. Each tick every device looks up its action in the table (indexed by
``axis_index('stage')``) and runs it through ``lax.switch``; then one ``ppermute`` moves this tick's
forward outputs to the next device and one moves input gradients to the previous device
(circularly when v > 1), so each arrives for the next tick (the tick model of ``schedules.py``).
Each ``ppermute`` spans only the stages that send a micro-batch on that tick (the table's send
sets, one ``lax.switch`` branch per set, the same on every device); a tick on which nothing
crosses a boundary sends nothing. Per step a boundary carries m activations forward and m
gradients back: 2m(V-1)/S activations per device on average, V = S x v virtual stages.

Memory: a device keeps the *input* of each micro-batch chunk in flight (from arrival until its
backward) and the gradients that arrived before their backward runs, in buffers whose slots are
assigned at trace time from the table (interval colouring, so the buffer size is the peak in-flight
count, not m). The backward recomputes the chunk's forward from the stored input (``jax.vjp`` at
it): one more forward per backward, and no residuals kept between ticks.

Other mesh axes inside a stage, two ways (both checked on jax 0.10):

- ``pipeline_value_and_grad(..., mesh=...)``: ``shard_map`` manual only over ``stage``
  (``axis_names={'stage'}``); the other axes stay Auto, so ``stage_fn`` is ordinary global-view code
  and XLA partitions it by the shardings of the weights and the batch (sharding constraints inside
  must use ``jax.sharding.get_abstract_mesh()``, not the concrete mesh);
- ``pipeline_value_and_grad(..., layout=...)``: manual over every axis, as ``Trainer`` runs its step:
  the model's layout-aware calls (``rules.gather_params``, ``reduce_partial``...) place the FSDP and
  TP collectives, and gradients are summed over the batch axes here.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import io_callback
from jax.sharding import PartitionSpec

from flax import nnx

from jaxpar import layer_scan, marks
from jaxpar.errors import LayoutError
from jaxpar.parallel.stage.schedules import BACKWARD, FORWARD, IDLE, Schedule, ScheduleError
from jaxpar.rules import (Layout, gather_layers_when_read, gather_params, gather_plan, gathered, logical_names, stored_shape,
                          use_layout, vary_over, varying_axes)

STAGE_AXIS = "stage"


@dataclasses.dataclass(frozen=True)
class PipelineModel:
    """The three pieces of a pipelined model (see the module docstring)."""

    first_fn: Callable
    stage_fn: Callable
    last_fn: Callable
    reads_edge_everywhere = False  # only the first and the last stage read the edge weights

    def first(self, edge, chunk, batch):
        return self.first_fn(edge, batch)

    def stage(self, edge, chunk, x, batch):
        return self.stage_fn(chunk, x)

    def last(self, edge, chunk, x, batch):
        return self.last_fn(edge, x, batch)


# --- the schedule lowered to per-tick instructions -------------------------------------------


@dataclasses.dataclass(frozen=True)
class Program:
    """Per tick and device: the action's kind (IDLE/FORWARD/BACKWARD), whether its chunk is the
    first / last virtual stage (embedding / head and loss run there), its chunk and micro-batch,
    the buffer slots it reads, and the slots this tick's arrivals go to. Slot ``act_slots`` /
    ``cot_slots`` is a scratch slot taking the writes nobody reads (nothing arrives)."""

    kind: np.ndarray
    first: np.ndarray
    last: np.ndarray
    chunk: np.ndarray
    microbatch: np.ndarray
    act_slot: np.ndarray  # stored stage input the action reads (and PipeDream's stashed weights)
    cot_slot: np.ndarray  # stored incoming gradient a backward reads
    recv_act: np.ndarray  # slot for the activation arriving from the previous device after this tick
    recv_cot: np.ndarray  # slot for the gradient arriving from the next device after this tick
    act_slots: int
    cot_slots: int
    # the (sender, receiver) stage pairs that send after a tick: the distinct sets, and per tick
    # (ticks,) the index of its set, forward (outputs) and backward (input gradients); set 0 is empty
    forward_sends: tuple
    backward_sends: tuple
    forward_send: np.ndarray
    backward_send: np.ndarray

    def columns(self) -> dict[str, np.ndarray]:
        """The (ticks, stages) tables the executor scans over (a tick's send sets: one per column)."""
        names = ("kind", "first", "last", "chunk", "microbatch", "act_slot", "cot_slot", "recv_act", "recv_cot")
        out = {name: getattr(self, name).astype(np.int32) for name in names}
        for name in ("forward_send", "backward_send"):
            out[name] = np.repeat(getattr(self, name)[:, None], self.kind.shape[1], axis=1).astype(np.int32)
        return out


def _colour(intervals: dict[Any, tuple[int, int]]) -> tuple[dict[Any, int], int]:
    """Slots for half-open [start, end) intervals (times: ends of ticks) so that no two live
    intervals share one; as few slots as the peak overlap."""
    slots, free, live, count = {}, [], [], 0
    for key, (start, end) in sorted(intervals.items(), key=lambda kv: kv[1]):
        while live and live[0][0] <= start:
            heapq.heappush(free, heapq.heappop(live)[1])
        slot = heapq.heappop(free) if free else count
        count = max(count, slot + 1)
        slots[key] = slot
        heapq.heappush(live, (end, slot))
    return slots, count


def lower(schedule: Schedule) -> Program:
    """Turn a validated schedule into the executor's instructions and buffer sizes."""
    schedule.validate()
    S, V = schedule.stages, schedule.virtual_stages
    tf, tb = schedule.times()
    per_device_acts: list[dict] = [{} for _ in range(S)]
    per_device_cots: list[dict] = [{} for _ in range(S)]
    for i in range(schedule.microbatches):
        for k in range(V):
            s = k % S
            if k > 0:  # kept from its arrival (end of the sender's tick) until the backward has run
                per_device_acts[s][(i, k)] = (tf[i, k - 1], tb[i, k])
            elif schedule.asynchronous:  # PipeDream stashes stage 0's weights per micro-batch too
                per_device_acts[s][(i, k)] = (tf[i, k], tb[i, k])
            if k < V - 1:
                per_device_cots[s][(i, k)] = (tb[i, k + 1], tb[i, k])
    act = [_colour(d) for d in per_device_acts]
    cot = [_colour(d) for d in per_device_cots]
    act_slots = max(1, max(n for _, n in act))
    cot_slots = max(1, max(n for _, n in cot))

    T = schedule.ticks
    shape = (T, S)
    chunk, mb = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
    k_of = schedule.chunk * S + np.arange(S)[None, :]  # virtual stage of each action
    busy = schedule.kind != IDLE
    first, last = busy & (k_of == 0), busy & (k_of == V - 1)
    act_slot, cot_slot = np.full(shape, act_slots, np.int32), np.full(shape, cot_slots, np.int32)
    recv_act, recv_cot = np.full(shape, act_slots, np.int32), np.full(shape, cot_slots, np.int32)
    sends = [[set() for _ in range(T)] for _ in range(2)]  # forward, backward: a tick's (sender, receiver) pairs
    for t, s in zip(*np.nonzero(busy)):
        kind, i, j = int(schedule.kind[t, s]), int(schedule.microbatch[t, s]), int(schedule.chunk[t, s])
        k = j * S + s
        chunk[t, s], mb[t, s] = j, i
        if (i, k) in act[s][0]:
            act_slot[t, s] = act[s][0][(i, k)]
        if kind == BACKWARD and k < V - 1:
            cot_slot[t, s] = cot[s][0][(i, k)]
        if kind == FORWARD and k < V - 1:  # the output goes to the device of virtual stage k+1
            recv_act[t, (k + 1) % S] = act[(k + 1) % S][0][(i, k + 1)]
            sends[0][t].add((int(s), (k + 1) % S))
        if kind == BACKWARD and k > 0:
            recv_cot[t, (k - 1) % S] = cot[(k - 1) % S][0][(i, k - 1)]
            sends[1][t].add((int(s), (k - 1) % S))
    (forward_sends, forward_send), (backward_sends, backward_send) = (_send_sets(ticks) for ticks in sends)
    return Program(schedule.kind.astype(np.int32), first, last, chunk, mb, act_slot, cot_slot, recv_act, recv_cot,
                   act_slots, cot_slots, forward_sends, backward_sends, forward_send, backward_send)


def _send_sets(ticks: list[set]) -> tuple[tuple, np.ndarray]:
    """(the distinct sets of sending pairs, the empty one first; each tick's index into them)."""
    sets = [()] + sorted({tuple(sorted(pairs)) for pairs in ticks if pairs})
    return tuple(sets), np.array([sets.index(tuple(sorted(pairs))) for pairs in ticks], np.int32)


# --- checks ------------------------------------------------------------------------------------


def layers_per_chunk(num_layers: int, schedule: Schedule) -> int:
    """Layers in one chunk; raises unless the stacked layers split evenly over the virtual stages."""
    S, v = schedule.stages, schedule.chunks
    if num_layers % (S * v):
        fits = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
        what = f"{S} stages" if v == 1 else f"{S} stages x {v} chunks = {S * v} virtual stages"
        raise ScheduleError(
            f"{num_layers} layers cannot be split over {what}: each {'stage' if v == 1 else 'virtual stage'} holds "
            f"the same number of consecutive layers. Use a {'stage count' if v == 1 else 'stages x chunks'} that "
            f"divides {num_layers} ({', '.join(map(str, fits))})"
        )
    return num_layers // (S * v)


def stacked_layers(stage_params) -> int:
    sizes = {x.shape[0] for x in jax.tree.leaves(stage_params)}
    if len(sizes) != 1:
        raise LayoutError(f"stacked weights disagree on the number of layers (leading dims {sorted(sizes)})")
    return sizes.pop()


# --- layer order <-> stage order ---------------------------------------------------------------


def _regroup(stacked, outer: int, inner: int, k: int):
    """Layers grouped (outer, inner, k) -> grouped (inner, outer, k), flat again."""
    def one(x):
        x = x.reshape(outer, inner, k, *x.shape[1:])
        return jnp.swapaxes(x, 0, 1).reshape(outer * inner * k, *x.shape[3:])

    return jax.tree.map(one, stacked)


def to_stage_order(stage_params, schedule: Schedule):
    """Stacked weights (layers first, in layer order) -> the order ``shard_map`` splits over
    ``stage``: device s's chunks j = 0..v-1 next to each other. A reshape when v = 1."""
    k = layers_per_chunk(stacked_layers(stage_params), schedule)
    return _regroup(stage_params, schedule.chunks, schedule.stages, k)


def to_layer_order(stage_ordered, schedule: Schedule):
    """Inverse of ``to_stage_order`` (for gradients and updated weights)."""
    k = layers_per_chunk(stacked_layers(stage_ordered), schedule)
    return _regroup(stage_ordered, schedule.stages, schedule.chunks, k)


# --- the executor, per device ------------------------------------------------------------------



def _unify(fns, *operands):
    """Wrap ``fns`` (branches of one switch) so that each output leaf varies over the union of the
    axes it varies over in any branch."""
    shapes = [jax.eval_shape(f, *operands) for f in fns]
    # an abstract value's type (jax.typeof) cannot be read under a partly manual shard_map
    axes = jax.tree.map(lambda *xs: set().union(*(x.manual_axis_type.varying for x in xs)), *shapes)

    def wrap(f):
        return lambda *args: jax.tree.map(vary_over, f(*args), axes)

    return [wrap(f) for f in fns], axes


def _cond(pred, true_fn, false_fn, *operands):
    """``lax.cond`` whose branches may differ in the axes their outputs vary over."""
    (on_true, on_false), _ = _unify([true_fn, false_fn], *operands)
    return jax.lax.cond(pred, on_true, on_false, *operands)


def _at(buf, slot):
    """Entry ``slot`` (a traced index) of ``buf``'s leading dim."""
    return jax.lax.dynamic_index_in_dim(buf, slot, keepdims=False)


def _put(buf, slot, value):
    """``buf`` with entry ``slot`` of its leading dim set to ``value`` (in the buffer's dtype)."""
    return jax.lax.dynamic_update_index_in_dim(buf, value.astype(buf.dtype), slot, 0)


def _check_pieces(model: PipelineModel, stage_params, edge_params, batch, axis: str):
    """Shape of what flows between stages and the axes it varies over, from the pieces traced
    abstractly on micro-batch 0 and chunk 0. Raises unless ``stage_fn`` keeps that shape (one
    buffer holds every stage's input) and ``last_fn`` returns a scalar loss."""
    def flowing(edge, mb, chunk):
        x = model.first(edge, chunk, mb)
        return x, model.stage(edge, chunk, x, mb)

    mb0, chunk0 = jax.tree.map(lambda b: b[0], batch), jax.tree.map(lambda p: p[0], stage_params)
    x0, y0 = jax.eval_shape(flowing, edge_params, mb0, chunk0)
    if (y0.shape, y0.dtype) != (x0.shape, x0.dtype):
        raise LayoutError(
            f"stage_fn must keep the shape of what flows between stages: first_fn gives {x0.dtype}{list(x0.shape)}, "
            f"stage_fn turns it into {y0.dtype}{list(y0.shape)}"
        )
    loss0 = jax.eval_shape(lambda edge, mb, chunk: model.last(edge, chunk, flowing(edge, mb, chunk)[1], mb),
                           edge_params, mb0, chunk0)
    if loss0.shape != ():
        raise LayoutError(f"last_fn must return the micro-batch's loss as a scalar, not shape {loss0.shape}")
    # what flows between stages varies over the stage axis and whatever the model makes it vary over
    return x0, {axis} | x0.manual_axis_type.varying | y0.manual_axis_type.varying


def _senders(axis: str, sets: tuple, per_tick: np.ndarray):
    """The branches of a tick's send, one per set of sending pairs: a ``ppermute`` over just those
    pairs (named with how many ticks take it, for ``analysis/hlo.py``), nothing for the empty set."""
    ticks = len(per_tick)

    def send(pairs, runs):
        def branch(x):
            with jax.named_scope(marks.branch_runs(runs, ticks)):
                return jax.lax.ppermute(x, axis, list(pairs))
        return branch

    runs = np.bincount(per_tick, minlength=len(sets))
    return [jnp.zeros_like] + [send(pairs, int(n)) for pairs, n in zip(sets[1:], runs[1:])]


@dataclasses.dataclass(frozen=True, eq=False)
class _Actions:
    """The three ``lax.switch`` branches of a tick (IDLE, FORWARD, BACKWARD) and what they share:
    the model, this device's weights and micro-batches, and the abstract value (``flow``) of what
    passes between stages. A branch maps (carry, table row) to (carry, output for the next device,
    input gradient for the previous one); see ``_initial_carry`` for the carry's entries."""

    model: PipelineModel
    stage_params: Any
    edge_params: Any
    batch: Any
    flow: Any
    loss_scale: Any
    optimizer: Any  # None: synchronous; an optax GradientTransformation: PipeDream's, stepped after each backward
    # PipeDream with batch axes: a backward differentiates at weights made to vary over them, and
    # its gradients are summed over them in this dtype before the update (not in the compute dtype
    # a transpose would sum in)
    batch_axes: tuple = ()
    reduce_dtype: Any = jnp.float32

    @property
    def asynchronous(self) -> bool:
        return self.optimizer is not None

    def branch(self, kind):
        """The switch branch for actions of ``kind``: read the micro-batch, stored input and weights
        the table row names, run the chunk (a backward recomputes it), update the carry."""
        def run(carry, row):
            carry = dict(carry)  # the branch returns a new carry; the one it was given stays as it was
            nothing = jnp.zeros(self.flow.shape, self.flow.dtype)  # sent when there is nothing to send
            if kind == IDLE:
                return carry, nothing, nothing
            j, i, first, last = row["chunk"], row["microbatch"], row["first"] > 0, row["last"] > 0
            mb_batch = jax.tree.map(lambda b: _at(b, i), self.batch)
            x = _at(carry["acts"], row["act_slot"])
            params, edge = self._weights(carry, row, kind)
            p = jax.tree.map(lambda w: _at(w, j), params)

            def action(p, edge, x):  # this action's chunk, as a function of what its backward differentiates
                return self._chunk(p, edge, x, mb_batch, first, last)

            if kind == FORWARD:
                y, loss = action(p, edge, x)
                self._add_loss(carry, i, loss)
                return carry, y, nothing
            dp, dedge, dx = self._pull_back(action, p, edge, x, carry, row, last)
            # only the ends give edge gradients, unless every stage reads the edge weights
            self._apply_gradients(carry, j, dp, dedge, first | last | self.model.reads_edge_everywhere)
            return carry, nothing, dx

        return run

    def _chunk(self, p, edge, x, mb_batch, first, last):
        """(output, loss) of a chunk: the embedding before it on the first virtual stage, head and
        loss after it on the last (zero loss elsewhere)."""
        model = self.model
        h = _cond(first, lambda e, x: model.first(e, p, mb_batch), lambda e, x: x, edge, x)
        y = model.stage(edge, p, h, mb_batch)
        loss = _cond(last, lambda e, y: model.last(e, p, y, mb_batch).astype(jnp.float32),
                     lambda e, y: jnp.zeros((), jnp.float32), edge, y)
        return y, loss

    def _weights(self, carry, row, kind):
        """(stacked, edge) weights an action uses; PipeDream's forward stashes them for its backward,
        which must differentiate at the weights its forward ran with (and records their version)."""
        if not self.asynchronous:
            return self.stage_params, self.edge_params
        if kind == FORWARD:
            slot = row["act_slot"]
            carry["stash"] = jax.tree.map(lambda b, w: _put(b, slot, w), carry["stash"], carry["params"])
            carry["stash_edge"] = jax.tree.map(lambda b, w: _put(b, slot, w), carry["stash_edge"], carry["edge"])
            carry["versions"] = _put(carry["versions"], row["microbatch"], carry["updates"])
            return carry["params"], carry["edge"]
        # (how many updates old those weights are: the staleness this stage trains with)
        carry["staleness"] = jnp.maximum(carry["staleness"], carry["updates"] - _at(carry["versions"], row["microbatch"]))
        return (jax.tree.map(lambda b: _at(b, row["act_slot"]), carry["stash"]),
                jax.tree.map(lambda b: _at(b, row["act_slot"]), carry["stash_edge"]))

    def _add_loss(self, carry, i, loss):
        if self.asynchronous:  # PipeDream reports each micro-batch's loss
            carry["losses"] = carry["losses"].at[i].add(loss)
        else:
            carry["loss"] = carry["loss"] + loss * self.loss_scale

    def _pull_back(self, action, p, edge, x, carry, row, last):
        """Gradients (chunk, edge, input) of a backward: recompute the forward from the stored input
        (no residuals are kept between ticks) and pull through it the gradient that arrived from
        the next device, or, on the last virtual stage, ``loss_scale`` on the loss."""
        if self.batch_axes:
            p, edge = (jax.tree.map(lambda w: vary_over(w, set(self.batch_axes)), t) for t in (p, edge))
        (y, loss), pull = jax.vjp(action, p, edge, x)
        dy = jnp.where(last, jnp.zeros_like(y), vary_over(_at(carry["cots"], row["cot_slot"]), varying_axes(y)))
        dloss = jnp.where(last, jnp.asarray(self.loss_scale, loss.dtype), jnp.zeros_like(loss))
        return pull((dy, dloss))

    def _apply_gradients(self, carry, j, dp, dedge, ends):
        """Synchronous: add the gradients to chunk ``j``'s and the edge accumulators. PipeDream:
        an optimizer step on this device's live weights at once (its one chunk), and on its copy
        of the edge weights on the first and the last stage."""
        if self.asynchronous:
            step = lambda w, g, state: _optimizer_step(self.optimizer, w, g, state)  # noqa: E731
            dp = self._batch_sum(jax.tree.map(lambda g: g[None], dp))  # (PipeDream runs one chunk per stage: j is 0)
            nothing = lambda g: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), g)  # noqa: E731  (not summed)
            dedge = _cond(ends, self._batch_sum, nothing, dedge)
            carry["params"], carry["opt_state"] = step(carry["params"], dp, carry["opt_state"])
            carry["edge"], carry["edge_opt_state"] = _cond(ends, step, lambda w, g, state: (w, state),
                                                           carry["edge"], dedge, carry["edge_opt_state"])
            carry["updates"] = carry["updates"] + 1
            norm = jnp.sqrt(optax.tree.norm(dp, squared=True) + optax.tree.norm(dedge, squared=True))
            carry["grad_norm"] = jnp.maximum(carry["grad_norm"], norm)
        else:
            carry["grads"] = jax.tree.map(lambda a, g: a.at[j].add(g.astype(a.dtype)), carry["grads"], dp)
            carry["edge_grads"] = _cond(ends, lambda a, g: jax.tree.map(lambda a, g: a + g.astype(a.dtype), a, g),
                                        lambda a, g: a, carry["edge_grads"], dedge)

    def _batch_sum(self, grads):
        if not self.batch_axes:
            return grads
        return jax.tree.map(lambda g: jax.lax.psum(g.astype(self.reduce_dtype), self.batch_axes).astype(g.dtype), grads)


def _initial_carry(actions: _Actions, program: Program, flows, axis: str):
    """The scan's carry before the first tick, all zeros: buffers of stored stage inputs (``acts``)
    and arrived gradients (``cots``), each with one scratch slot more than the program assigns;
    then the loss and float32 gradient accumulators, or for PipeDream the live weights, their
    optimizer states, their per-slot stash, the update count, per micro-batch losses and
    weight versions, the largest norm of a gradient applied and the largest staleness read."""
    x0, stage_params, edge_params = actions.flow, actions.stage_params, actions.edge_params
    carry = {
        "acts": jnp.zeros((program.act_slots + 1, *x0.shape), x0.dtype),
        "cots": jnp.zeros((program.cot_slots + 1, *x0.shape), x0.dtype),
    }
    if actions.asynchronous:
        slots = program.act_slots + 1
        num_microbatches = jax.tree.leaves(actions.batch)[0].shape[0]
        carry.update(
            params=stage_params, edge=edge_params,
            opt_state=actions.optimizer.init(stage_params), edge_opt_state=actions.optimizer.init(edge_params),
            stash=jax.tree.map(lambda w: jnp.zeros((slots, *w.shape), w.dtype), stage_params),
            stash_edge=jax.tree.map(lambda w: jnp.zeros((slots, *w.shape), w.dtype), edge_params),
            updates=jnp.zeros((), jnp.int32), versions=jnp.zeros((num_microbatches,), jnp.int32),
            losses=jnp.zeros((num_microbatches,), jnp.float32), grad_norm=jnp.zeros((), jnp.float32),
            staleness=jnp.zeros((), jnp.int32),
        )
    else:
        accumulator = lambda w: jnp.zeros(w.shape, jnp.float32)  # noqa: E731
        carry.update(grads=jax.tree.map(accumulator, stage_params), edge_grads=jax.tree.map(accumulator, edge_params),
                     loss=jnp.zeros((), jnp.float32))
    # every device holds its own values; the buffers also vary over whatever what flows varies over
    carry = jax.tree.map(lambda c: vary_over(c, {axis}), carry)
    carry["acts"], carry["cots"] = vary_over(carry["acts"], flows), vary_over(carry["cots"], flows)
    return carry


def _typed_branches(raw_branches, carry, example_row):
    """The switch branches made to agree on types, and the carry widened to match them.

    shard_map's types: all switch branches must return the same types, and a tick must return
    the carry it was given. Widen the carry until a tick no longer widens it."""
    while True:
        branches, (carry_axes, _, _) = _unify(raw_branches, carry, example_row)
        widened = jax.tree.map(lambda c, a: vary_over(c, varying_axes(c) | a), carry, carry_axes)
        if all(varying_axes(a) == varying_axes(b) for a, b in zip(jax.tree.leaves(widened), jax.tree.leaves(carry))):
            return branches, carry
        carry = widened


def _tick_fn(branches, here, axis: str, program: Program, wait_s: float = 0.0):
    """The scan's body: this device runs its action of the tick, then a ``ppermute`` each way from
    the stages that carry a micro-batch (the tick's send sets; none on ticks nothing crosses) moves
    the outputs and input gradients, which land in the slots the table names for them. With
    ``wait_s``, a tick that sends waits that long for real (``_wait``: slow links simulated)."""
    forward = _senders(axis, program.forward_sends, program.forward_send)
    backward = _senders(axis, program.backward_sends, program.backward_send)

    def tick(carry, rows):
        row = {name: _at(col, here) for name, col in rows.items()}  # this device's column
        carry, send_fwd, send_bwd = jax.lax.switch(row["kind"], branches, carry, row)
        arrived = jax.lax.switch(row["forward_send"], forward, send_fwd)
        returned = jax.lax.switch(row["backward_send"], backward, send_bwd)
        if wait_s:  # (both ways at once: a link sends each way on its own)
            sends = (row["forward_send"] > 0) | (row["backward_send"] > 0)
            arrived, returned = _wait((arrived, returned), jnp.where(sends, wait_s, 0.0))
        carry["acts"] = _put(carry["acts"], row["recv_act"], vary_over(arrived, varying_axes(carry["acts"])))
        carry["cots"] = _put(carry["cots"], row["recv_cot"], vary_over(returned, varying_axes(carry["cots"])))
        return carry, None

    return tick


def _wait(values, seconds):
    """``values`` once ``seconds`` have passed on the host (a callback that sleeps; every device's
    runs at once), so that what reads them waits too: a slow link, for real."""
    def sleep(seconds):
        time.sleep(float(seconds))
        return np.zeros((), np.float32)

    done = io_callback(sleep, jax.ShapeDtypeStruct((), jnp.float32), seconds)  # (a side effect: never dropped)
    return jax.lax.optimization_barrier((values, done))[0]  # (the values themselves, once the wait is done)


def link_wait_seconds(flow, link) -> float:
    """Seconds one send of ``flow`` (the abstract value a stage sends) takes on ``link`` =
    (megabits per second, milliseconds of latency); 0 where neither is set."""
    mbps, latency_ms = link or (0.0, 0.0)
    sent = flow.size * jnp.dtype(flow.dtype).itemsize
    return latency_ms / 1e3 + (sent * 8 / (mbps * 1e6) if mbps else 0.0)


def run_schedule(program: Program, model: PipelineModel, stage_params, edge_params, batch, *,
                 loss_scale=1.0, optimizer=None, axis: str = STAGE_AXIS, link=None):
    """Run a lowered schedule on this device (call inside ``shard_map`` with ``axis`` manual).

    ``stage_params``: this device's chunks, leaves shaped (v, k, ...); ``edge_params``: whole;
    ``batch``: every micro-batch, leaves shaped (m, ...). Weights the caller wants unreduced
    gradients of must already vary over the axes it sums over itself (as in ``Trainer``).

    Synchronous (``optimizer`` None): returns (sum of the micro-batch losses times
    ``loss_scale``, gradients of that sum shaped like ``stage_params``, gradients w.r.t.
    ``edge_params`` from this device only). Loss and edge gradients are non-zero only on the
    devices of the first / last virtual stage: the caller sums them over ``axis``.

    Asynchronous (PipeDream, an optax ``optimizer``): every backward steps this device's
    weights at once, computed at the weights its forward used (stashed per micro-batch). Returns
    (loss per micro-batch (m,) [last stage only], updated ``stage_params``, this device's updated
    copy of ``edge_params``, the update count (weight version) each micro-batch's forward used).

    ``link``: (megabits per second, milliseconds) the sends between stages are slowed to, for real
    (``_wait``), to compare wall clocks over links slower than this machine's."""
    here = jax.lax.axis_index(axis)
    flow, flows = _check_pieces(model, stage_params, edge_params, batch, axis)
    actions = _Actions(model, stage_params, edge_params, batch, flow, loss_scale, optimizer)
    carry = _initial_carry(actions, program, flows, axis)
    # the (ticks, stages) tables, scanned over ticks; each device reads its own column
    table = {name: jnp.asarray(col) for name, col in program.columns().items()}
    example_row = {name: _at(col[0], here) for name, col in table.items()}  # to trace the branches' types
    branches, carry = _typed_branches([actions.branch(kind) for kind in (IDLE, FORWARD, BACKWARD)], carry, example_row)
    carry, _ = jax.lax.scan(_tick_fn(branches, here, axis, program, link_wait_seconds(flow, link)), carry, table)
    if actions.asynchronous:
        return carry["losses"], carry["params"], carry["edge"], carry["versions"]
    return carry["loss"], carry["grads"], carry["edge_grads"]


# --- whole-mesh entry points -------------------------------------------------------------------


def check_microbatches(batch, m):
    sizes = {x.shape[0] for x in jax.tree.leaves(batch)}
    if sizes != {m}:
        raise ScheduleError(
            f"the batch must be split into the schedule's {m} micro-batches along dim 0 (leading dims {sorted(sizes)}); "
            f"reshape it to (m, batch / m, ...)"
        )


def _check_mesh(mesh, schedule: Schedule):
    if STAGE_AXIS not in mesh.axis_names or mesh.shape[STAGE_AXIS] != schedule.stages:
        have = dict(mesh.shape).get(STAGE_AXIS)
        raise ScheduleError(
            f"schedule {schedule.name!r} is for {schedule.stages} stages but the mesh has "
            f"{'no stage axis' if have is None else f'stage={have}'}; give the mesh stage={schedule.stages}"
        )


def _stage_spec(layout: Layout, names) -> PartitionSpec:
    """Stored spec of a stacked weight with its ``layers`` dim (dim 0) split over ``stage``."""
    if not names or names[0] != "layers":
        raise LayoutError(f"a pipelined weight must be stacked on a leading 'layers' dim; its logical names are {names}")
    inner = layout.spec((None, *names[1:]), "param")
    return PartitionSpec(STAGE_AXIS, *tuple(inner)[1:])


def _chunked(stage_ordered, chunks: int):
    """This device's stacked weights (v*k, ...) as chunks (v, k, ...)."""
    return jax.tree.map(lambda x: x.reshape(chunks, x.shape[0] // chunks, *x.shape[1:]), stage_ordered)


def _unchunked(chunked):
    return jax.tree.map(lambda x: x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]), chunked)


def pipeline_value_and_grad(stage_fn, stage_params, batch, mesh, schedule: Schedule, *, first_fn, last_fn,
                            edge_params=None, layout: Layout | None = None, names=None):
    """Mean loss over the micro-batches and its gradients, computed by ``schedule`` on ``mesh``.

    ``stage_params``: weights stacked on layers (dim 0, layer order); ``batch``: leaves shaped
    (m, ...), micro-batch i being ``batch[i]``; ``edge_params``: weights of ``first_fn`` and
    ``last_fn``. Returns (loss, (stage gradients in layer order, edge gradients)). Call under
    ``jax.jit``.

    Without ``layout``, only ``stage`` is manual and ``stage_fn`` is global-view code on the other
    axes. With ``layout`` (``mesh`` must be ``layout.mesh``; ``names`` = (logical names of the stage
    weights, of the edge weights)), every axis is manual as in ``Trainer``: weights enter as stored
    (stacked ones split over ``stage`` on ``layers``), the batch is split over the layout's batch
    axes, the model's layout-aware calls place the collectives, and gradients are summed over the
    batch axes that the weight gathers have not already reduced."""
    if schedule.asynchronous:
        raise ScheduleError("pipedream updates weights as it goes; run it with pipedream_train, not pipeline_value_and_grad")
    edge_params = {} if edge_params is None else edge_params
    check_microbatches(batch, schedule.microbatches)
    if layout is not None and mesh is not layout.mesh:
        raise LayoutError("pipeline_value_and_grad: pass the layout's own mesh (layout.mesh) as mesh")
    _check_mesh(mesh, schedule)
    ordered = to_stage_order(stage_params, schedule)
    model = PipelineModel(first_fn, stage_fn, last_fn)
    if layout is None:
        fn = _stage_manual_program(mesh, lower(schedule), model, schedule, ordered, edge_params, batch)
    else:
        fn = _all_manual_program(layout, names, lower(schedule), model, schedule)
    loss, grads, edge_grads = fn(ordered, edge_params, batch)
    return loss, (to_layer_order(grads, schedule), edge_grads)


def stage_grads(program: Program, model: PipelineModel, stacked, edge, batch, *, chunks: int, loss_scale,
                axis: str = STAGE_AXIS, link=None):
    """Per device, inside a ``shard_map`` where ``axis`` is manual (``Trainer``'s step calls this in
    place of its micro-batch loop): (loss summed over the stages, gradients of this device's
    stacked weights laid out like its stored shard (v*k, ...), edge gradients summed over the
    stages). ``stacked``: this device's shard in stage order (``to_stage_order``)."""
    edge = jax.tree.map(lambda e: vary_over(e, {axis}), edge)  # local gradients: summed here, once
    loss, grads, edge_grads = run_schedule(program, model, _chunked(stacked, chunks), edge, batch, loss_scale=loss_scale,
                                           axis=axis, link=link)
    return jax.lax.psum(loss, axis), _unchunked(grads), jax.lax.psum(edge_grads, axis)


def _stage_manual_program(mesh, program, model, schedule, ordered, edge_params, batch):
    """``pipeline_value_and_grad``'s shard_map when only ``stage`` is manual."""

    def body(params, edge, batch):
        return stage_grads(program, model, params, edge, batch, chunks=schedule.chunks,
                           loss_scale=1.0 / schedule.microbatches)

    stage_spec = jax.tree.map(lambda _: PartitionSpec(STAGE_AXIS), ordered)
    edge_spec = jax.tree.map(lambda _: PartitionSpec(), edge_params)
    batch_spec = jax.tree.map(lambda _: PartitionSpec(), batch)
    return jax.shard_map(body, mesh=mesh, in_specs=(stage_spec, edge_spec, batch_spec),
                         out_specs=(PartitionSpec(), stage_spec, edge_spec), axis_names={STAGE_AXIS})


def sum_over_batch(layout: Layout, grads, names):
    """Inside an all-manual ``shard_map``: gradients computed per batch shard, summed over the
    batch axes each weight still needs, i.e. all but those its gather's backward has already
    reduce-scattered over (stored sharded there, computed whole). ``names``: the weights' logical
    names, shaped like ``grads``."""
    def unreduced(names_):
        gathered = {a for _, axes in gather_plan(names_, layout) for a in axes}
        return tuple(a for a in layout.batch_axes if a not in gathered)

    return jax.tree.map(lambda g, n: jax.lax.psum(g, unreduced(n)) if unreduced(n) else g, grads, names,
                        is_leaf=lambda x: isinstance(x, tuple))


def _all_manual_program(layout, names, program, model, schedule):
    """``pipeline_value_and_grad``'s shard_map when every axis is manual (``layout=``)."""
    if names is None:
        raise LayoutError("pipeline_value_and_grad(layout=...) needs names=(stage weight names, edge weight names)")
    if layout.sequence_axes:  # the batch is not cut into each device's positions here
        raise LayoutError("pipeline_value_and_grad(layout=...) does not split the sequence (context > 1); "
                          "train such a layout with Trainer, which does")
    stage_names, edge_names = names
    is_names = lambda x: isinstance(x, tuple)  # noqa: E731
    stage_spec = jax.tree.map(lambda n: _stage_spec(layout, n), stage_names, is_leaf=is_names)
    edge_spec = jax.tree.map(lambda n: layout.spec(n, "param"), edge_names, is_leaf=is_names)
    batch_axes = layout.batch_axes

    def body(params, edge, batch):
        # weights vary over the batch axes: autodiff then gives each device its unreduced gradient
        # and the sums below are the only reductions
        params = jax.tree.map(lambda p: vary_over(p, set(batch_axes)), params)
        edge = jax.tree.map(lambda e: vary_over(e, set(batch_axes)), edge)
        with use_layout(layout, manual=True):
            loss, grads, edge_grads = stage_grads(program, model, params, edge, batch, chunks=schedule.chunks,
                                                  loss_scale=1.0 / (schedule.microbatches * layout.batch_shards))
        loss = jax.lax.psum(loss, batch_axes) if batch_axes else loss
        return loss, sum_over_batch(layout, grads, stage_names), sum_over_batch(layout, edge_grads, edge_names)

    def fn(params, edge, batch):
        batch_spec = jax.tree.map(lambda _: PartitionSpec(None, batch_axes or None), batch)
        return jax.shard_map(body, mesh=layout.mesh, in_specs=(stage_spec, edge_spec, batch_spec),
                             out_specs=(PartitionSpec(), stage_spec, edge_spec))(params, edge, batch)

    return fn


def pipedream_train(stage_fn, stage_params, batch, mesh, schedule: Schedule, *, first_fn, last_fn, edge_params,
                    optimizer):
    """Asynchronous PipeDream with weight stashing and an optax ``optimizer`` over a stream of
    micro-batches (``batch`` leaves (m, ...)), on a mesh whose only manual axis is ``stage`` (others
    Auto).

    Every stage steps its own weights (and optimizer state) after each backward; the first and the
    last stage each keep and update their own copy of ``edge_params`` (first_fn's and last_fn's
    gradients; one copy, both gradients, on one stage). Returns (loss of each micro-batch (m,),
    updated stacked weights in layer order, edge copies stacked per stage (S, ...), weight version
    each micro-batch's forward used per stage (S, m))."""
    if not schedule.asynchronous:
        raise ScheduleError(f"pipedream_train runs the asynchronous pipedream schedule, not {schedule.name!r}")
    m = schedule.microbatches
    check_microbatches(batch, m)
    _check_mesh(mesh, schedule)
    program = lower(schedule)
    layers_per_chunk(stacked_layers(stage_params), schedule)
    model = PipelineModel(first_fn, stage_fn, last_fn)

    def body(params, edge, batch):
        edge = jax.tree.map(lambda e: vary_over(e, {STAGE_AXIS}), edge)
        losses, new, new_edge, versions = run_schedule(
            program, model, _chunked(params, 1), edge, batch, optimizer=optimizer)
        last = jax.lax.axis_index(STAGE_AXIS) == schedule.stages - 1
        losses = jax.lax.psum(jnp.where(last, losses, 0.0), STAGE_AXIS)
        return losses, _unchunked(new), jax.tree.map(lambda e: e[None], new_edge), versions[None]

    stage_spec = jax.tree.map(lambda _: PartitionSpec(STAGE_AXIS), stage_params)
    edge_in = jax.tree.map(lambda _: PartitionSpec(), edge_params)
    edge_out = jax.tree.map(lambda _: PartitionSpec(STAGE_AXIS), edge_params)
    fn = jax.shard_map(body, mesh=mesh, in_specs=(stage_spec, edge_in, jax.tree.map(lambda _: PartitionSpec(), batch)),
                       out_specs=(PartitionSpec(), stage_spec, edge_out, PartitionSpec(STAGE_AXIS)),
                       axis_names={STAGE_AXIS})
    return fn(stage_params, edge_params, batch)


def simulate_pipedream(stage_fn, stage_params, batch, stages: int, *, first_fn, last_fn, edge_params, optimizer,
                       applied=None):
    """The oracle for ``pipedream_train``, on one device and from PipeDream's definition alone:
    micro-batch i runs stage s with the weights after max(0, i - (S-s-1)) of that stage's updates
    (1F1B keeps S-s micro-batches in flight on stage s) and its gradient then steps stage s's
    current weights with ``optimizer``. Stage 0 owns first_fn's copy of ``edge_params``, stage S-1
    last_fn's (one copy on one stage). Returns what ``pipedream_train`` returns. ``applied``: per
    stage, how many of its updates have been made (a stream cut mid-way, ``stream.py``; default all)."""
    m = jax.tree.leaves(batch)[0].shape[0]
    applied = [m] * stages if applied is None else list(applied)
    k = stacked_layers(stage_params) // stages
    split = [jax.tree.map(lambda x: x[s * k:(s + 1) * k], stage_params) for s in range(stages)]
    # each block's weights after n of its updates (history[n]) and its optimizer state now
    blocks = [{"history": [w], "state": optimizer.init(w)} for w in split]
    edges = [{"history": [edge_params], "state": optimizer.init(edge_params)} for _ in range(min(stages, 2))]

    def loss_of(chunks, first_edge, last_edge, mb):
        x = first_fn(first_edge, mb)
        for chunk in chunks:
            x = stage_fn(chunk, x)
        return last_fn(last_edge, x, mb)

    grad = jax.jit(jax.value_and_grad(loss_of, argnums=(0, 1, 2)))
    step = jax.jit(lambda w, g, state: _optimizer_step(optimizer, w, g, state))
    losses, versions = [], stash_versions(stages, m)
    owners = list(range(stages)) + [0, stages - 1][:len(edges)]  # (blocks, then edge copies: whose update each is)
    for i in range(max(applied)):  # (micro-batches after these have changed no weights yet)
        mb = jax.tree.map(lambda b: b[i], batch)
        chunks = [blocks[s]["history"][versions[s, i]] for s in range(stages)]
        loss, (g_chunks, g_first, g_last) = grad(
            chunks, edges[0]["history"][versions[0, i]], edges[-1]["history"][versions[-1, i]], mb)
        losses.append(loss)
        edge_grads = [g_first, g_last] if stages > 1 else [jax.tree.map(jnp.add, g_first, g_last)]
        for block, g, owner in zip(blocks + edges, list(g_chunks) + edge_grads, owners):
            if i < applied[owner]:
                w, block["state"] = step(block["history"][-1], g, block["state"])
                block["history"].append(w)
    final = jax.tree.map(lambda *xs: jnp.concatenate(xs), *[block["history"][-1] for block in blocks])
    ends = [edge["history"][-1] for edge in edges]
    edge_copies = ends[:1] + [edge_params] * (stages - 2) + ends[1:]
    return jnp.stack(losses), final, jax.tree.map(lambda *xs: jnp.stack(xs), *edge_copies), versions


def stash_versions(stages: int, microbatches: int) -> np.ndarray:
    """(stages, microbatches): how many of its own updates stage s's weights have had when
    micro-batch i reads them under PipeDream (1F1B keeps S - s micro-batches in flight on stage s,
    so S - s - 1 of them update it between a micro-batch's forward there and its backward)."""
    return np.array([[max(0, i - (stages - s - 1)) for i in range(microbatches)] for s in range(stages)])


def _optimizer_step(optimizer, w, g, state):
    """(weights, optimizer state) after one step of ``optimizer`` with gradients ``g``."""
    updates, state = optimizer.update(jax.tree.map(lambda g, w: g.astype(w.dtype), g, w), state, w)
    return optax.apply_updates(w, updates), state


# --- the repo's Llama, split into pipeline pieces ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SplitModel:
    """A model's pipeline pieces and how its weights (a pure dict) split into the stacked layers
    (``params[stacked]``) and the edge weights (everything else)."""

    pieces: PipelineModel | LayerScanPieces
    stacked: str
    names: tuple[Any, Any]  # logical names of (stacked weights, edge weights), shaped like them

    def split(self, params):
        return params[self.stacked], {key: value for key, value in params.items() if key != self.stacked}

    def merge(self, stacked, edge):
        return {**edge, self.stacked: stacked}


def weight_names(state) -> dict:
    """Logical names of every weight of an nnx State, as a pure dict (None dims where a weight has none)."""
    return nnx.to_pure_dict(jax.tree.map(lambda v: logical_names(v) or (None,) * v.get_value().ndim, state,
                                         is_leaf=lambda v: isinstance(v, nnx.Variable)))


def _names_of(abstract_state, stacked):
    names = weight_names(abstract_state)
    return names[stacked], {key: n for key, n in names.items() if key != stacked}


def split_at_layer_scan(loss_fn, graphdef, abstract_state, wrap_body=None) -> SplitModel:
    """Any model whose layers run in one scan over its stacked weights (the one top-level module
    whose weights all carry the logical axis ``layers``, scanned by ``jax.lax.scan`` or
    ``nnx.scan``), split there, as a pipeline runs it: ``loss_fn(model, batch)`` is traced on each
    micro-batch and cut at that scan (``LayerScanPieces``). No model code is written for the
    pipeline. ``wrap_body``: applied to the scan's body (the step's remat, ``jax.checkpoint``)."""
    stacked = _layer_stack(abstract_state)
    pieces = LayerScanPieces(loss_fn, graphdef, abstract_state, stacked, wrap_body)
    return SplitModel(pieces, stacked, _names_of(abstract_state, stacked))


def _layer_stack(abstract_state) -> str:
    """The key of the top-level module whose weights are all stacked on ``layers``."""
    stacked: dict = {}
    for path, var in nnx.to_flat_state(abstract_state):
        stacked.setdefault(path[0], []).append("layers" in (logical_names(var) or ()))
    found = [key for key, marks in stacked.items() if all(marks)]
    if len(found) != 1:
        raise LayoutError(f"a pipeline splits a model by its layer stack: one top-level module whose weights all carry the "
                          f"logical axis 'layers' (e.g. nnx.vmap(..., transform_metadata={{nnx.PARTITION_NAME: 'layers'}})); "
                          f"this model has {len(found)}{': ' + ', '.join(map(str, found)) if found else ''}")
    return found[0]


class LayerScanPieces:
    """The pipeline pieces of a model cut at its layer scan (``layer_scan.cut``). Each piece traces
    the model's loss on its micro-batch with the weights this device holds, and evaluates only its
    part of the trace: ``first`` the scan's input, ``stage`` the scan over this chunk from what
    flowed in, ``last`` what follows the scan. Edge weights are gathered whole, stacked ones a layer
    at a time inside the scan, as in ``Trainer``'s step; a stage that holds no edge weights (an
    MPMD middle stage) traces with placeholders, which the cut never evaluates."""

    reads_edge_everywhere = False  # only the first and the last stage read the edge weights

    def __init__(self, loss_fn, graphdef, abstract_state, stacked, wrap_body=None):
        self.loss_fn, self.graphdef, self.stacked, self.wrap_body = loss_fn, graphdef, stacked, wrap_body
        self._abstract = abstract_state

    def _loss(self, edge, chunk, batch):
        state = jax.tree.map(lambda v: v, self._abstract)
        nnx.replace_by_pure_dict(state, {**edge, self.stacked: chunk})
        state = gather_params(state)  # the edge weights; one the cut does not need is never evaluated
        gather_layers_when_read(state)
        return self.loss_fn(nnx.merge(self.graphdef, state), batch)

    def _cut(self, edge, chunk, batch):
        if not edge:
            edge = self._placeholders()
        traced = layer_scan.trace(self._loss, (edge, chunk, batch), (False, True, False))
        return layer_scan.cut(traced, "the model's loss")

    def _placeholders(self):
        """The edge weights as placeholders in the shapes they are stored in here."""
        edge: dict = {}
        for path, var in nnx.to_flat_state(self._abstract):
            if path[0] != self.stacked:
                value = var.get_value()
                node = edge
                for key in path[:-1]:
                    node = node.setdefault(key, {})
                node[path[-1]] = jax.ShapeDtypeStruct(stored_shape(logical_names(var) or (None,) * value.ndim, value.shape), value.dtype)
        return edge

    def first(self, edge, chunk, batch):
        cut = self._cut(edge, chunk, batch)
        return layer_scan.evaluate_for(cut.traced, [cut.carry_in], {}, "the pipeline's first stage")[0]

    def stage(self, edge, chunk, x, batch):
        cut = self._cut(edge, chunk, batch)
        run = lambda eqn, ins: layer_scan.with_body(eqn, ins, self.wrap_body)  # noqa: E731
        return layer_scan.evaluate_for(cut.traced, [cut.carry_out], {cut.carry_in: x}, "a pipeline stage", {cut.index: run})[0]

    def last(self, edge, chunk, x, batch):
        cut = self._cut(edge, chunk, batch)
        return layer_scan.evaluate_for(cut.traced, list(cut.traced.jaxpr.outvars), {cut.carry_out: x}, "the pipeline's last stage")[0]


def split_by_layer_stack(pieces, abstract_state, stacked: str = "layers") -> SplitModel:
    """A model's pipeline pieces over its weights, split by its layer stack (``params[stacked]``).

    ``pieces`` = ``(first(edge, tokens), stage(layers, x), last(edge, x, tokens))``, the model's
    own code (e.g. ``models.llama.pipeline_pieces``); ``abstract_state`` its abstract ``nnx.State``
    (``train.state.abstract_model``), for the weights' logical names. Here the edge weights are
    handed over as computed (gathered when read), and each chunk of the stacked weights as an
    nnx.State whose layer slices are gathered when the model's loop reads them, so the pieces run
    on one device, under an all-manual layout (FSDP gathers, TP sums) or with Auto axes alike."""
    first, stage, last = pieces
    layers_abstract = abstract_state[stacked]
    edge_abstract = {key: var for key, var in abstract_state.items() if key != stacked}

    def first_fn(edge, tokens):
        return first(_EdgeWeights(edge_abstract, edge), tokens)

    def stage_fn(chunk, x):
        state = jax.tree.map(lambda v: v, layers_abstract)
        nnx.replace_by_pure_dict(state, chunk)
        gather_layers_when_read(state)
        return stage(state, x)

    def last_fn(edge, x, tokens):
        return last(_EdgeWeights(edge_abstract, edge), x, tokens)

    return SplitModel(PipelineModel(first_fn, stage_fn, last_fn), stacked, _names_of(abstract_state, stacked))


class _EdgeWeights(Mapping):
    """The edge weights by name, each gathered into its compute layout when read (a piece reads
    only the ones it uses: the others are never gathered)."""

    def __init__(self, abstract, values):
        self._abstract, self._values = abstract, values

    def __getitem__(self, name):
        return gathered(self._abstract[name].replace(value=self._values[name]))

    def __iter__(self):
        return iter(self._values)

    def __len__(self):
        return len(self._values)
