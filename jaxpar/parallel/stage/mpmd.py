"""MPMD pipeline parallelism: each stage on its own devices, with its own layout.

The SPMD pipeline (``pipeline.py``) runs every stage in one program over a ``stage`` mesh axis, so
every stage has the same layout. Here each stage is a ``Layout`` of its own over its own devices
(e.g. stage 0 ``tensor=4`` on devices 0-3, stage 1 ``data=2,tensor=2`` on devices 4-7), and the
activations and their gradients move between stages by cross-mesh resharding
(``collectives.reshard``): from the sending stage's compute layout of the activation to the
receiving stage's, with broadcast delivery where the receiver replicates what the sender splits.

The same schedule tables drive it (``schedules.py``: GPipe, 1F1B, eager 1F1B, interleaved 1F1B);
the driver walks the table tick by tick and dispatches each action as a jitted program on its
stage's devices. JAX dispatches asynchronously, so stages on different devices compute at the
same time: the table orders the work, the data dependencies do the waiting. That is why the stages
must not share devices: two stages on one device would run one after the other.

Each stage's programs are ``shard_map``s with every axis of its mesh manual, under its layout, as
``Trainer`` runs a step: the model's layout-aware calls place the FSDP and TP collectives inside a
stage. Per action:

- forward of virtual stage k: ``stage_fn`` (after ``first_fn`` on k = 0); the output is resharded
  to the stage of k + 1. The last virtual stage's forward runs inside its backward;
- backward: ``jax.vjp`` of the same function at the stored input (the forward is recomputed, no
  residuals are kept between actions), gradients accumulated in place, the input gradient
  resharded to the stage of k - 1.

Edge weights (``first_fn``'s and ``last_fn``'s, e.g. embedding and head) live on the stage of the
first virtual stage and on the stage of the last; their gradients are summed over both (the last
stage's moved to the first's devices) and each copy takes the same update, so they stay equal.

With ``subspace=k`` (``parallel/subspace``) the stages send the residual stream's k coordinates:
every stage then computes the embedding again and holds a copy of the edge weights, whose
gradients are summed over all of them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.collectives.reshard import compile_reshard
from jaxpar.errors import LayoutError
from jaxpar.parallel import OPTIONS, build_layout, parse_strategy
from jaxpar.parallel.subspace import SUBSPACE
from jaxpar.parallel.subspace.codec import SubspacePieces
from jaxpar.parallel.stage.pipeline import (PipelineModel, check_microbatches, layers_per_chunk, stacked_layers, sum_over_batch,
                                           weight_names)
from jaxpar.parallel.stage.schedules import BACKWARD, FORWARD, IDLE, Schedule, ScheduleError
from jaxpar.rules import Layout, gather_layers_when_read, gather_params, unfinished_axes, use_layout, vary_over

_is_names = lambda x: isinstance(x, tuple)  # noqa: E731  (a leaf of a logical-names tree)


def _devices_of(spec: str) -> int:
    """Devices a stage's parallel spec asks for; every degree must be written out."""
    degrees = [part.partition("=") for part in spec.split(",") if part.strip()]
    sizes = [value.strip() for key, _, value in degrees if key.strip() not in OPTIONS]
    if not all(re.fullmatch(r"\d+", n) and int(n) > 0 for n in sizes):
        raise LayoutError(f"stage spec {spec!r}: give every axis a positive degree (e.g. 'data=2,tensor=2'); "
                          f"-1 cannot fill 'the rest' when the devices are split between stages")
    return math.prod(int(n) for n in sizes)


def stage_layouts(specs: Sequence[str], devices=None) -> list[Layout]:
    """One layout per stage spec, over consecutive disjoint groups of ``devices`` (default: all),
    e.g. ``stage_layouts(["tensor=4", "data=2,tensor=2"])`` on 8 devices."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = [_devices_of(spec) for spec in specs]
    if sum(sizes) != len(devices):
        raise LayoutError(f"stage specs {list(specs)} need {' + '.join(map(str, sizes))} = {sum(sizes)} devices, "
                          f"but {len(devices)} were given; make the degrees add up to {len(devices)}")
    starts = np.cumsum([0, *sizes])
    return [build_layout(parse_strategy(spec, n), devices[a:a + n]) for spec, n, a in zip(specs, sizes, starts)]


def check_disjoint(layouts: Sequence[Layout]) -> None:
    """Raise unless no two stages share a device (the stages run at the same time)."""
    owner: dict[Any, int] = {}
    for s, layout in enumerate(layouts):
        if layout.mesh.shape.get("stage", 1) > 1:
            raise LayoutError(f"stage {s}'s layout has stage={layout.mesh.shape['stage']}: in an MPMD pipeline each "
                              f"stage is a layout of its own; drop the stage axis from its spec")
        shared = sorted(d.id for d in layout.mesh.devices.flat if d in owner)
        if shared:
            other = owner[next(d for d in layout.mesh.devices.flat if d in owner)]
            raise LayoutError(
                f"stages {other} and {s} share devices {shared}: an MPMD pipeline runs its stages at the same "
                f"time, so each needs devices of its own; split the devices between them (stage_layouts does)")
        owner.update({d: s for d in layout.mesh.devices.flat})


def _copy_to(tree, shardings):
    """``tree`` in new buffers laid out by ``shardings`` (``device_put`` may reuse the caller's
    buffer for a replicated shard, even with ``may_alias=False``)."""
    return jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=shardings)(tree)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StageWeights:
    """Weights (or gradients, or optimizer states) as the stages hold them: ``chunks[s][j]`` is
    stage s's chunk j (virtual stage j*S + s), ``edge[s]`` stage s's copy of the edge weights
    (only the stages of the first and the last virtual stage hold one). A pytree."""

    chunks: list[list[Any]]
    edge: dict[int, Any]

    def stage(self, s: int):
        return {"chunks": self.chunks[s], "edge": self.edge.get(s, {})}


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Bytes that crossed between stages in one step, by direction, and what naive per-receiver
    sends of the same transfers would have cost."""

    forward_bytes: int
    backward_bytes: int
    naive_bytes: int
    transfers: int


class MPMDPipeline:
    """A pipelined model over stages with layouts of their own (see the module docstring).

    ``names``: (logical names of the stacked weights, of the edge weights), shaped like them (a
    ``pipeline.SplitModel`` has them); ``activation_names``: logical names of what flows between
    stages (the Llama's residual stream: ``llama.RESIDUAL``); ``batch_names``: of each batch leaf
    (default: batch on dim 0). ``subspace``: k, the residual stream's coordinates the stages send
    (``parallel/subspace``: every write the model marks with ``nn.residual_add`` projected onto a
    fixed k-dimensional subspace, on every stage), 0 for the stream itself."""

    def __init__(self, model: PipelineModel, layouts: Sequence[Layout], schedule: Schedule, *, names,
                 activation_names, batch_names=None, broadcast: bool = True, subspace: int = 0):
        if schedule.asynchronous:
            raise ScheduleError("pipedream updates weights as it goes; run it with pipeline.pipedream_train")
        if len(layouts) != schedule.stages:
            raise ScheduleError(f"schedule {schedule.name!r} is for {schedule.stages} stages but {len(layouts)} stage "
                                f"layouts were given; give one layout per stage")
        check_disjoint(layouts)
        split = [i for i, layout in enumerate(layouts) if layout.sequence_axes]
        if split:  # the stages' programs do not cut each device's positions out of the batch
            raise LayoutError(f"stage layout {split[0]} splits the sequence (context > 1), which MPMD pipelines do not do yet; "
                              f"use context parallelism in an SPMD pipeline (Trainer with stage=N, context_algorithm=all-to-all)")
        schedule.validate()
        if subspace:  # each stage's layout projects the writes; the pieces send coordinates
            layouts = [dataclasses.replace(layout, settings={**layout.settings, SUBSPACE: subspace}) for layout in layouts]
            model = SubspacePieces(model, subspace)
        self.model, self.layouts, self.schedule = model, list(layouts), schedule
        self.stage_names, self.edge_names = names
        self.activation_names, self.batch_names, self.broadcast = tuple(activation_names), batch_names, broadcast
        S, V = schedule.stages, schedule.virtual_stages
        # the stages that read the edge weights: the first and the last, or every one
        self.edge_everywhere = model is not None and model.reads_edge_everywhere
        self.edge_holders = list(range(S)) if self.edge_everywhere else sorted({0, (V - 1) % S})
        self._programs: dict[tuple, Any] = {}
        self.traffic: Traffic | None = None  # of the last value_and_grad

    # --- placement ------------------------------------------------------------------------------

    def _param_shardings(self, s: int, names, tree):
        layout = self.layouts[s]
        return jax.tree.map(lambda n, x: layout.sharding(n, "param", x.shape, what=f"stage {s} weight"), names, tree,
                            is_leaf=_is_names)

    def place(self, stage_params, edge_params) -> StageWeights:
        """Weights stacked on layers (layer order) and edge weights -> each stage's share, laid out
        by its layout's stored (``param``) mapping. Always copies (``apply_gradients`` donates
        the placed weights; the caller's arrays stay valid)."""
        S, v = self.schedule.stages, self.schedule.chunks
        k = layers_per_chunk(stacked_layers(stage_params), self.schedule)
        chunks = []
        for s in range(S):
            mine = [jax.tree.map(lambda x, j=j: x[(j * S + s) * k:(j * S + s + 1) * k], stage_params) for j in range(v)]
            chunks.append([_copy_to(c, self._param_shardings(s, self.stage_names, c)) for c in mine])
        edge = {s: _copy_to(edge_params, self._param_shardings(s, self.edge_names, edge_params))
                for s in self.edge_holders}
        return StageWeights(chunks, edge)

    def to_layer_order(self, weights: StageWeights):
        """(stacked weights in layer order, the first stage's edge weights), on the host."""
        S, v = self.schedule.stages, self.schedule.chunks
        ordered = [weights.chunks[k % S][k // S] for k in range(S * v)]
        stacked = jax.tree.map(lambda *xs: np.concatenate([np.asarray(x) for x in xs]), *ordered)
        return stacked, jax.tree.map(np.asarray, weights.edge[0])

    # --- the per-stage programs -----------------------------------------------------------------

    def _names(self, s: int):
        """Logical names of stage s's chunk weights."""
        return self.stage_names

    def _received(self, s: int):
        """Logical names of what stage s receives (what its forward's input is laid out as)."""
        return self.activation_names

    def _sent(self, s: int):
        """Logical names of what stage s sends on."""
        return self.activation_names

    def _apply(self, s: int, first: bool, last: bool):
        """``apply(chunk, edge, x, micro-batch)`` of one virtual stage on stage s: what it sends on,
        or the loss if it is the last."""
        model = self.model

        def apply(chunk, edge, x, mb):
            h = model.first(edge, chunk, mb) if first else x
            h = model.stage(edge, chunk, h, mb)
            return model.last(edge, chunk, h, mb) if last else h

        return apply

    def _specs(self, s: int):
        layout = self.layouts[s]
        stage = jax.tree.map(lambda n: layout.spec(n, "param"), self._names(s), is_leaf=_is_names)
        edge = jax.tree.map(lambda n: layout.spec(n, "param"), self.edge_names, is_leaf=_is_names)
        return stage, edge, layout.spec(self._received(s)), layout.spec(self._sent(s))

    def _batch_specs(self, s: int, batch):
        layout = self.layouts[s]
        if self.batch_names is None:
            return jax.tree.map(lambda x: layout.spec(("batch",) + (None,) * (x.ndim - 1)), batch)
        return jax.tree.map(lambda n: layout.spec(n), self.batch_names, is_leaf=_is_names)

    def _program(self, s: int, first: bool, last: bool, kind: int, batch):
        """Stage s's jitted forward or backward of one virtual stage (first / last: whether it is
        the model's first / last), cached."""
        key = (s, first, last, kind)
        if key in self._programs:
            return self._programs[key]
        layout, names = self.layouts[s], self._names(s)
        stage_spec, edge_spec, received_spec, sent_spec = self._specs(s)
        uses_edge = first or last or self.edge_everywhere
        edge_spec = edge_spec if uses_edge else {}
        x_spec = () if first else received_spec
        batch_spec = self._batch_specs(s, batch)
        loss_scale = 1.0 / (self.schedule.microbatches * layout.batch_shards)
        batch_axes = set(layout.batch_axes)

        stage_apply = self._apply(s, first, last)

        def apply(chunk, edge, x, mb):
            out = stage_apply(chunk, edge, x, mb)
            _refuse_unfinished(out, () if last else self._sent(s), layout, s, last)
            return out * loss_scale if last else out

        if kind == FORWARD:
            def body(chunk, edge, x, mb):
                with use_layout(layout, manual=True):
                    return apply(chunk, edge, x, mb)

            program = jax.jit(jax.shard_map(body, mesh=layout.mesh, in_specs=(stage_spec, edge_spec, x_spec, batch_spec),
                                            out_specs=sent_spec))
        else:
            def body(chunk, edge, x, mb, g, acc_chunk, acc_edge):
                # weights vary over the batch axes: the vjp gives each device its own shard's gradient
                chunk = jax.tree.map(lambda w: vary_over(w, batch_axes), chunk)
                edge = jax.tree.map(lambda w: vary_over(w, batch_axes), edge)
                with use_layout(layout, manual=True):
                    out, vjp = jax.vjp(lambda c, e, x_: apply(c, e, x_, mb), chunk, edge, x)
                    g_chunk, g_edge, g_x = vjp(jnp.ones_like(out) if last else g)
                g_chunk = sum_over_batch(layout, g_chunk, names)
                g_edge = sum_over_batch(layout, g_edge, self.edge_names) if uses_edge else g_edge
                loss = jax.lax.psum(out, tuple(batch_axes)) if last and batch_axes else (out if last else ())
                add = lambda a, b: jax.tree.map(jnp.add, a, b)  # noqa: E731
                return loss, add(acc_chunk, g_chunk), add(acc_edge, g_edge), g_x

            g_spec = sent_spec if not last else ()
            program = jax.jit(jax.shard_map(
                body, mesh=layout.mesh,
                in_specs=(stage_spec, edge_spec, x_spec, batch_spec, g_spec, stage_spec, edge_spec),
                out_specs=(PartitionSpec() if last else (), stage_spec, edge_spec, x_spec)),
                donate_argnums=(5, 6))  # the gradient accumulators
        self._programs[key] = program
        return program

    # --- one step ---------------------------------------------------------------------------------

    def _move(self, x, s: int, counter: list):
        """``x`` resharded to stage s's compute layout of the activation."""
        dst = NamedSharding(self.layouts[s].mesh, self.layouts[s].spec(self._received(s)))
        program = compile_reshard(x.shape, x.dtype, x.sharding, dst, broadcast=self.broadcast)
        counter.append((program.plan.cross_mesh_bytes, program.plan.naive_bytes))
        return program(x)

    def _zeros(self, s: int, names, tree):
        shardings = self._param_shardings(s, names, tree)
        return jax.tree.map(lambda x, sh: jnp.zeros(x.shape, x.dtype, device=sh), tree, shardings)

    def value_and_grad(self, weights: StageWeights, batch):
        """Mean loss over the micro-batches (``batch`` leaves shaped (m, ...), on the host or
        anywhere) and its gradients, shaped like ``weights`` (every edge copy holds the sum)."""
        schedule = self.schedule
        S, V, m = schedule.stages, schedule.virtual_stages, schedule.microbatches
        check_microbatches(batch, m)
        placed_batches: dict[tuple[int, int], Any] = {}

        def microbatch(i, s):
            if (i, s) not in placed_batches:
                mb = jax.tree.map(lambda x: x[i], batch)
                specs = self._batch_specs(s, mb)
                placed_batches[(i, s)] = jax.device_put(
                    mb, jax.tree.map(lambda p: NamedSharding(self.layouts[s].mesh, p), specs))
            return placed_batches[(i, s)]

        grads = StageWeights([[self._zeros(s, self._names(s), c) for c in weights.chunks[s]] for s in range(S)],
                             {s: self._zeros(s, self.edge_names, e) for s, e in weights.edge.items()})
        inputs, cotangents, losses = {}, {}, []
        sent = {FORWARD: [], BACKWARD: []}
        for t in range(schedule.ticks):
            for s in range(S):
                kind = int(schedule.kind[t, s])
                if kind == IDLE:
                    continue
                i, j = int(schedule.microbatch[t, s]), int(schedule.chunk[t, s])
                k = j * S + s
                first, last = k == 0, k == V - 1
                if kind == FORWARD and last:  # the last virtual stage's forward runs inside its backward
                    continue
                uses_edge = first or last or self.edge_everywhere
                edge = weights.edge[s] if uses_edge else {}
                x = () if first else inputs[(i, k)]
                program = self._program(s, first, last, kind, microbatch(i, s))
                if kind == FORWARD:
                    y = program(weights.chunks[s][j], edge, x, microbatch(i, s))
                    inputs[(i, k + 1)] = self._move(y, (k + 1) % S, sent[FORWARD])
                    continue
                acc_edge = grads.edge[s] if uses_edge else {}
                g = () if last else cotangents.pop((i, k))
                loss, grads.chunks[s][j], acc_edge, g_x = program(
                    weights.chunks[s][j], edge, x, microbatch(i, s), g, grads.chunks[s][j], acc_edge)
                if uses_edge:
                    grads.edge[s] = acc_edge
                inputs.pop((i, k), None)
                if last:
                    losses.append(loss)
                if not first:
                    cotangents[(i, k - 1)] = self._move(g_x, (k - 1) % S, sent[BACKWARD])
        self._sum_edge_grads(grads)
        self.traffic = Traffic(sum(b for b, _ in sent[FORWARD]), sum(b for b, _ in sent[BACKWARD]),
                               sum(n for _, n in sent[FORWARD] + sent[BACKWARD]),
                               len(sent[FORWARD]) + len(sent[BACKWARD]))
        return sum(losses), grads

    def _sum_edge_grads(self, grads: StageWeights) -> None:
        """Every edge copy's gradients become their sum: the other holders' are resharded to the
        first holder's devices, added there, and the sum resharded back."""
        a, *others = self.edge_holders
        total = grads.edge[a]
        for b in others:
            total = jax.tree.map(lambda n, x, y: x + self._reshard_param(y, a, n), self.edge_names, total, grads.edge[b],
                                 is_leaf=_is_names)
        grads.edge[a] = total
        for b in others:
            grads.edge[b] = jax.tree.map(lambda n, x: self._reshard_param(x, b, n), self.edge_names, total,
                                         is_leaf=_is_names)

    def _reshard_param(self, x, s: int, names):
        """A weight-shaped array moved to stage s's stored layout of the weight ``names``."""
        dst = self.layouts[s].sharding(names, "param", x.shape)
        if x.ndim == 0:  # reshard moves arrays; a scalar is just copied
            return jax.device_put(x, dst)
        return compile_reshard(x.shape, x.dtype, x.sharding, dst)(x)

    # --- optimizer ----------------------------------------------------------------------------------

    def init_optimizer(self, optimizer: optax.GradientTransformation, weights: StageWeights) -> list:
        """One optimizer state per stage, on the stage's devices (laid out like its weights)."""
        return [jax.jit(optimizer.init)(weights.stage(s)) for s in range(self.schedule.stages)]

    def apply_gradients(self, optimizer: optax.GradientTransformation, weights: StageWeights, grads: StageWeights,
                        states: list):
        """Each stage's weights updated by its own optimizer state. The optimizer must work entry by
        entry (SGD, Adam, AdamW...): a transform that mixes entries (global-norm clipping) would see
        only one stage. ``weights`` and ``states`` are donated. Returns (weights, states)."""
        update = _jitted_update(optimizer)
        chunks, edge, new_states = [], {}, []
        for s in range(self.schedule.stages):
            params, state = update(weights.stage(s), grads.stage(s), states[s])
            chunks.append(params["chunks"])
            if s in weights.edge:
                edge[s] = params["edge"]
            new_states.append(state)
        return StageWeights(chunks, edge), new_states


def _refuse_unfinished(value, names, layout: Layout, s: int, last: bool):
    """Raise, in words, where a stage's loss or output differs across a model-parallel mesh axis it
    is not split over (shard_map's own check would stop it later, in JAX's words)."""
    unfinished = unfinished_axes(value, names, layout)
    if unfinished:
        what = "loss" if last else f"output (laid out as {tuple(names)})"
        raise LayoutError(
            f"stage {s}'s {what} differs across mesh axis {'/'.join(unfinished)} of its layout: a sum over a logical axis "
            f"split there was not finished (a row-parallel matmul: add its output with jaxpar.nn.residual_add or "
            f"reduce_partial), or a lookup table split by vocab was read whole (nnx.Embed: read it with "
            f"jaxpar.nn.embed_lookup, or do not split its vocab)")


@dataclasses.dataclass(frozen=True)
class ModuleStage:
    """One stage of a pipeline of different modules (``ModulePipeline``): ``module``, an
    ``nnx.Module`` (real or from ``nnx.eval_shape``: only its structure and the logical names of its
    weights are read), run as ``apply(module, x, micro-batch)``: ``x`` is ``()`` on the first stage
    and what the stage before sent after it. Every stage but the last returns what it sends on,
    laid out as the logical names ``sends``; the last returns the loss (the mean over its rows)."""

    module: Any
    apply: Callable
    sends: tuple = ()


class ModulePipeline(MPMDPipeline):
    """An MPMD pipeline whose stages are different modules, each under its own layout on its own
    devices (say a vision encoder under ``data=4`` and a language model under
    ``tensor=2,data=2``): stage s runs ``stages[s]`` on its weights alone, and what crosses a
    boundary is resharded from the sender's layout of its ``sends`` to the receiver's by the
    cross-mesh planner, forward and (its gradient) backward. No edge weights: each module holds
    its own. Weights are a list of per-stage pure dicts (``nnx.to_pure_dict(nnx.state(module))``)."""

    def __init__(self, stages: Sequence[ModuleStage], layouts: Sequence[Layout], schedule: Schedule, *,
                 batch_names=None, broadcast: bool = True):
        if len(stages) != schedule.stages:
            raise ScheduleError(f"schedule {schedule.name!r} is for {schedule.stages} stages but {len(stages)} modules were "
                                f"given; give one ModuleStage per stage")
        if schedule.chunks != 1:
            raise ScheduleError(f"schedule {schedule.name!r} gives each device {schedule.chunks} chunks, but a pipeline of "
                                f"modules has one module a stage; use gpipe, 1f1b or eager-1f1b")
        silent = [s for s, stage in enumerate(stages[:-1]) if not stage.sends]
        if silent:
            raise LayoutError(f"stage {silent[0]} sends its output to stage {silent[0] + 1} but names no layout for it; "
                              f"give ModuleStage(..., sends=(logical names of its dims, e.g. 'batch', None, 'embed'))")
        super().__init__(None, layouts, schedule, names=(None, {}), activation_names=(), batch_names=batch_names,
                         broadcast=broadcast)
        self.stages = list(stages)
        self._split = [nnx.split(stage.module) for stage in stages]
        self._stage_names = [weight_names(state) for _, state in self._split]

    def _names(self, s: int):
        return self._stage_names[s]

    def _received(self, s: int):
        return self.stages[s - 1].sends

    def _sent(self, s: int):
        return self.stages[s].sends

    def _apply(self, s: int, first: bool, last: bool):
        graphdef, abstract = self._split[s]
        run = self.stages[s].apply

        def apply(chunk, edge, x, mb):
            state = jax.tree.map(lambda v: v, abstract)  # (a copy to fill)
            nnx.replace_by_pure_dict(state, chunk)
            state = gather_params(state)  # the weights in their compute layout
            gather_layers_when_read(state)  # stacked ones, one layer at a time in the module's loop
            return run(nnx.merge(graphdef, state), x, mb)

        return apply

    def place(self, weights: Sequence[Any]) -> StageWeights:
        """Per-stage pure dicts -> each stage's weights on its devices, laid out by its layout's
        stored mapping (copies, as ``MPMDPipeline.place``)."""
        if len(weights) != len(self.stages):
            raise LayoutError(f"{len(weights)} weight trees for {len(self.stages)} stages; give one per stage, in order")
        chunks = [[_copy_to(w, self._param_shardings(s, self._stage_names[s], w))] for s, w in enumerate(weights)]
        return StageWeights(chunks, {s: {} for s in self.edge_holders})

    def stage_weights(self, weights: StageWeights) -> list:
        """Each stage's weights (or gradients) as a pure dict on the host, in stage order."""
        return [jax.tree.map(np.asarray, chunks[0]) for chunks in weights.chunks]


@functools.lru_cache(maxsize=8)
def _jitted_update(optimizer: optax.GradientTransformation):
    """One jitted update per optimizer, traced once per stage's shapes rather than at every step."""
    def update(params, grads, state):
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(update, donate_argnums=(0, 2))
