"""Sharded training state and the jitted training step, for any Flax NNX model with logical names.

The gradient is computed inside one ``shard_map`` over every mesh axis: each device runs the model
on its slice of the batch with its weights gathered per the layout (``rules.gather_params``), and
the gradient is reduced by hand, so every collective is the one the strategy calls for:

- axes the weights are stored sharded over (FSDP): reduce-scatter, the backward of the gather;
- axes the gradient accumulation buffer is sharded over (ZeRO-2): reduce-scatter per micro-batch;
- axes the optimizer state is sharded over (ZeRO-1): one reduce-scatter at the end;
- the remaining batch axes (DP, HSDP across groups): all-reduce.

``TrainConfig.grad_sync`` may compress these reductions on the wire (``grad_sync.py``): those over
a compressed axis are then bucketed (the gradients that share a reduction are summed as one flat
float32 vector), and the all-reduces, whose results the shard_map's type checks cannot see are the
same on every device, run in a second, unchecked shard_map together with the clipping.

The optimizer update then runs on the stored shards (optax, outside the shard_map); where weights
are stored whole but updated in shards (ZeRO-1/2), XLA all-gathers the updated weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.errors import JaxparError, LayoutError, NonFiniteStep
from jaxpar.parallel import pipeline as pipeline_lib
from jaxpar.parallel import schedules
from jaxpar.rules import (Layout, gather_layers_when_read, gather_params, gather_plan, logical_names, record_model_calls, use_layout,
                          varying_axes)
from jaxpar.train import check as check_lib
from jaxpar.train import grad_sync, gspmd, remat


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    total_steps: int = 300
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    b1: float = 0.9
    b2: float = 0.95
    compute_dtype: str = "float32"  # float32 | bfloat16 (weights stay float32: the master copy)
    grad_reduce_dtype: str = "float32"  # dtype gradients are summed across devices in; explicit, never implied
    microbatches: int = 1  # gradient accumulation steps per optimizer step
    donate: bool = True  # reuse the old state's buffers for the new state
    grad_sync: str = "exact"  # exact | dynamiq | int8: how gradients are summed across batch axes (grad_sync.py)
    grad_sync_bits: float | None = None  # dynamiq: average bits per value (None: the collective's default)
    grad_sync_axes: tuple[str, ...] | None = None  # batch axes to compress (None: those crossing slow links, else all)
    grad_sync_min_size: int = 4096  # values per device below which a compressed reduction stays exact
    schedule: str = "1f1b"  # pipeline schedule when the mesh has stage > 1 (parallel/schedules.py)
    chunks: int = 1  # layer chunks per stage (interleaved-1f1b: virtual stages per device)
    remat: str = "none"  # none | full | dots: what the backward pass recomputes per layer (remat.py)
    path: str = "auto"  # auto | manual | gspmd: who places the collectives (see Trainer.path_reason)
    nonfinite: str = "stop"  # stop | skip: a step whose loss or gradient is NaN/inf raises, or is skipped


PATHS = ("auto", "manual", "gspmd")
NONFINITE = ("stop", "skip")


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW with linear warm-up and cosine decay to 10%. (Clipping by the global gradient norm,
    ``cfg.clip_norm``, is done by the step itself, where the gradient shards are reduced.)"""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.learning_rate, max(cfg.warmup_steps, 1), max(cfg.total_steps, cfg.warmup_steps + 1), cfg.learning_rate * 0.1
    )
    return optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay)


class TrainState(NamedTuple):
    params: Any  # pure dict of arrays, shaped like the model's nnx.State
    opt_state: Any
    step: jax.Array


def abstract_model(model_fn: Callable[[nnx.Rngs], nnx.Module]):
    """(graphdef, abstract nnx.State) of the model: shapes and logical names, no memory."""
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: model_fn(nnx.Rngs(0)))
    return nnx.split(model)


def _paths(state) -> dict:
    """Pure dict path -> Variable, for walking weights with their names."""
    return {path: var for path, var in nnx.to_flat_state(state)}


def _nest(flat: dict) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


class Trainer:
    """Everything needed to train ``model_fn`` under ``layout``.

    ``loss_fn(model, batch)`` returns the mean loss over its (local) batch; every device gets an
    equal slice of the batch, so the mean of the slices' means is the global mean. ``batch`` is an
    array (or a pytree of arrays) whose dim 0 is the batch.
    """

    def __init__(self, layout: Layout, model_fn, loss_fn, cfg: TrainConfig = TrainConfig(), optimizer=None, pipeline=None):
        self.layout, self.model_fn, self.loss_fn, self.cfg = layout, model_fn, loss_fn, cfg
        if cfg.path not in PATHS:
            raise JaxparError(f"path={cfg.path!r} is unknown; use {', '.join(PATHS)}")
        if cfg.nonfinite not in NONFINITE:
            raise JaxparError(f"nonfinite={cfg.nonfinite!r} is unknown; use stop (raise NonFiniteStep) or skip (drop the step's update)")
        # which path places the collectives, and why; decided when the step is first traced
        self.path = None if cfg.path == "auto" else cfg.path
        self.path_reason = None if cfg.path == "auto" else f"path={cfg.path!r} was asked for"
        self._explicit = False  # GSPMD path: the model needs explicit mesh axes (its own out_sharding)
        self._path_decided = False
        self.optimizer = optimizer or make_optimizer(cfg)
        # each layer loop's checkpoint policy (None: no checkpoint); refuses an unknown cfg.remat
        self.remat_policy = remat.policy(cfg.remat, layout.regather)
        self.pipeline_pieces = pipeline
        self.graphdef, self.abstract = abstract_model(model_fn)
        flat = self._flat_abstract = _paths(self.abstract)
        self.names, self.written_names = {}, {}
        for path, var in flat.items():
            value = var.get_value()
            names = logical_names(var) or (None,) * value.ndim
            if len(names) != value.ndim:
                raise LayoutError(f"weight {'/'.join(map(str, path))} has shape {value.shape} but {len(names)} logical names {names}")
            self.written_names[path] = names
            self.names[path] = layout.effective_names(names, value.shape)  # replicated short dims unnamed
        self._check_layout(flat)
        self.grad_sync = grad_sync.resolve(cfg, layout)  # None: exact
        self.pipeline, self.schedule, self.program = self._pipeline(pipeline)
        # compressed all-reduces, one bucket per set of axes: [(axes, [paths])]; other paths are done in the step's shard_map
        self._buckets, self._done_paths = self._all_reduce_buckets(flat)
        self.param_specs = _nest({p: self._spec(p, "param") for p in flat})
        self.opt_specs_by_param = _nest({p: self._spec(p, "optimizer") for p in flat})
        self.grad_specs_by_param = _nest({p: self._spec(p, "grad") for p in flat})
        abstract_params = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), nnx.to_pure_dict(self.abstract))
        abstract_opt = jax.eval_shape(self.optimizer.init, abstract_params)
        self.opt_specs = optax.tree_map_params(
            self.optimizer, lambda _, spec: spec, abstract_opt, self.opt_specs_by_param,
            transform_non_params=lambda _: PartitionSpec(), is_leaf=lambda x: isinstance(x, PartitionSpec),
        )
        shard = lambda specs: jax.tree.map(  # noqa: E731
            lambda s: NamedSharding(layout.mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
        )
        self.state_shardings = TrainState(shard(self.param_specs), shard(self.opt_specs), NamedSharding(layout.mesh, PartitionSpec()))
        self._step = None
        self._init_programs = None
        self.accumulator_bytes = None  # set when the step is traced

    def _pipeline(self, pieces):
        """(model split into pipeline pieces, schedule, lowered program) when the mesh has a stage
        axis; ``pieces(abstract_state)`` gives the split (``pipeline.split_by_layer_stack``)."""
        stages = dict(self.layout.mesh.shape).get("stage", 1)
        if stages == 1:
            return None, None, None
        if pieces is None:
            raise LayoutError(f"stage={stages} runs the layers as a pipeline, but this model gives no pipeline pieces; "
                              f"pass Trainer(..., pipeline=functools.partial(pipeline.split_by_layer_stack, pieces)) with the "
                              f"model's (first, stage, last) pieces (e.g. models.llama.pipeline_pieces(cfg))")
        if self.grad_sync is not None:
            raise LayoutError(f"grad_sync={self.cfg.grad_sync!r} is not supported with a pipeline (stage={stages}) yet; use grad_sync='exact'")
        split = pieces(self.abstract)
        stage = remat.checkpoint_layer_loops(split.pieces.stage_fn, self.remat_policy, True)
        split = dataclasses.replace(split, pieces=dataclasses.replace(split.pieces, stage_fn=stage))
        schedule = schedules.make(self.cfg.schedule, stages, self.cfg.microbatches, self.cfg.chunks)
        if schedule.asynchronous:
            raise LayoutError(f"schedule {self.cfg.schedule!r} updates each stage's weights after every micro-batch, "
                              f"which a training step with one optimizer update does not do; use gpipe, 1f1b, "
                              f"eager-1f1b or interleaved-1f1b here, or pipeline.pipedream_train "
                              f"(examples/pipedream.py)")
        stacked, _ = split.split(nnx.to_pure_dict(self.abstract))
        pipeline_lib.layers_per_chunk(pipeline_lib.stacked_layers(stacked), schedule)
        return split, schedule, pipeline_lib.lower(schedule)

    # --- layout checks, before any device memory is touched --------------------------------

    def _spec(self, path, mapping):
        return self.layout.spec(self.names[path], mapping)

    def _check_layout(self, flat):
        for path, var in flat.items():
            what = f"weight {'/'.join(map(str, path))}"
            for mapping in ("param", "optimizer", "grad", "compute"):
                names = self.names[path]
                if mapping == "compute":
                    names = tuple(None if n == "layers" else n for n in names)
                self.layout.spec(names, mapping, var.get_value().shape, what)

    def batch_sharding(self, batch) -> Any:
        spec = PartitionSpec(self.layout.batch_axes or None)
        return jax.tree.map(lambda _: NamedSharding(self.layout.mesh, spec), batch)

    def abstract_batch(self, batch_size: int, seq_len: int):
        """A (batch_size, seq_len + 1) int32 token batch as a sharded ShapeDtypeStruct, for
        compiling a step without data."""
        shape = jax.ShapeDtypeStruct((batch_size, seq_len + 1), jnp.int32)
        return jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=self.batch_sharding(shape))

    def check_batch(self, batch):
        shards = self.layout.batch_shards * self.cfg.microbatches
        for leaf in jax.tree.leaves(batch):
            if leaf.shape[0] % shards:
                raise LayoutError(
                    f"batch of {leaf.shape[0]} examples does not split evenly over {shards} = batch axes "
                    f"{self.layout.batch_axes} x {self.cfg.microbatches} micro-batches; use a multiple of {shards}"
                )

    def _all_reduce_buckets(self, flat):
        """([(axes, [paths])], other paths): the weights whose final all-reduce is compressed,
        grouped by its axes. Refuses a sync that would compress nothing."""
        sync, k = self.grad_sync, self.cfg.microbatches
        if sync is None:
            return [], list(flat)
        buckets: dict[tuple, list] = {}
        reductions = []  # axes of every reduction that runs once per step, to check something is compressed
        for path in flat:
            per_micro, final, rest = self._reduction_plan(path)
            if k == 1:  # the gather's backward (ZeRO-3) and ZeRO-2's reduce-scatter run once per step too
                names = [n for n in self.names[path] if n != "layers"]  # gathered one layer at a time
                reductions += [axes for _, axes in gather_plan(names, self.layout) + per_micro]
            reductions += [axes for _, axes in final] + [rest]
            if rest and sync.compresses(rest):
                buckets.setdefault(rest, []).append(path)
        if not any(sync.compresses(axes) for axes in reductions):
            raise LayoutError(
                f"grad_sync={sync.name!r} would compress nothing: the gradient reductions over {', '.join(sync.axes)} all run "
                f"inside the micro-batch loop (ZeRO-2/3 reduce-scatters; microbatches={k}), and only the reductions "
                f"after it are compressed. Use microbatches=1, zero=1, or grad_sync='exact'"
            )
        bucketed = {p for paths in buckets.values() for p in paths}
        return list(buckets.items()), [p for p in flat if p not in bucketed]

    # --- state ---------------------------------------------------------------------------

    def init(self, seed: int = 0) -> TrainState:
        """Sharded parameters and optimizer state; the same seed gives the same values on any layout."""
        init_params, init_opt = self.init_programs()
        params = init_params(jax.random.key(seed))
        step = jax.device_put(jnp.zeros((), jnp.int32), self.state_shardings.step)
        return TrainState(params, init_opt(params), step)

    def init_programs(self):
        """The compiled initialisers of the parameters (from a key) and of the optimizer state
        (from the parameters), each writing straight into its layout. Compiled once: ``init``
        runs them, and memory analysis reads their output sizes."""
        if self._init_programs is None:

            def init_params(key):
                with nnx.use_eager_sharding(False):
                    return nnx.to_pure_dict(nnx.state(self.model_fn(nnx.Rngs(key))))

            key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
            params = jax.jit(init_params, out_shardings=self.state_shardings.params).lower(key).compile()
            opt = jax.jit(self.optimizer.init, out_shardings=self.state_shardings.opt_state)
            self._init_programs = (params, opt.lower(self.abstract_state().params).compile())
        return self._init_programs

    def abstract_state(self) -> TrainState:
        """ShapeDtypeStructs with shardings: enough to compile a step without allocating anything."""
        shapes = jax.eval_shape(lambda: self.init_shapes())
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, self.state_shardings)

    def init_shapes(self):
        params = jax.tree.map(lambda v: jnp.zeros(v.shape, v.dtype), nnx.to_pure_dict(self.abstract))
        return TrainState(params, self.optimizer.init(params), jnp.zeros((), jnp.int32))

    # --- the step ------------------------------------------------------------------------

    def abstract_leaf(self, path):
        """ShapeDtypeStruct of one weight by its path."""
        return self._flat_abstract[path].get_value()

    def _with_values(self, pure):
        state = jax.tree.map(lambda v: v, self.abstract)
        nnx.replace_by_pure_dict(state, pure)
        return state

    def merge(self, pure):
        """The model with the weights of pure dict ``pure``."""
        return nnx.merge(self.graphdef, self._with_values(pure))

    def choose_path(self, params, batch):
        """Decide (once) who places the collectives, from one abstract trace of the loss.

        ``manual`` when the model calls jaxpar's model-facing functions (``jaxpar.nn``:
        ``reduce_partial``, ``enter_block``, ``cross_entropy``...): the step runs in one shard_map and
        every collective is placed on purpose, at the analytic optimum. ``gspmd`` when it makes no
        such call (a model written for plain Flax): XLA's partitioner places them (``gspmd.py``)."""
        if self._path_decided or self.cfg.path == "manual":
            return self.path
        avals = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)  # noqa: E731
        probe = lambda p, b: self.loss_fn(self.merge(p), b)  # noqa: E731
        explicit, calls = False, []
        with use_layout(self.layout), jax.sharding.use_abstract_mesh(self.layout.mesh.abstract_mesh):
            try:
                with record_model_calls() as calls:
                    jax.eval_shape(probe, avals(params), avals(batch))
            except ValueError as error:
                if not gspmd.needs_explicit_axes(error):
                    raise
                explicit = True
        if explicit:  # trace again with the batch axes explicit, to see every call the model makes
            explicit_mesh = self.layout.mesh.abstract_mesh.update_axis_types(
                {a: jax.sharding.AxisType.Explicit for a in gspmd.explicit_axes_of(self.layout)})
            with use_layout(self.layout), jax.sharding.use_abstract_mesh(explicit_mesh), record_model_calls() as calls:
                jax.eval_shape(probe, avals(params), avals(batch))
        used = sorted(set(calls))
        if self.path is None:
            if used or self.pipeline is not None:
                self.path = "manual"
                self.path_reason = (f"the model calls jaxpar's {', '.join(used)}: one shard_map, every collective placed by jaxpar"
                                    if used else "the layout pipelines the model's layers")
            else:
                self.path = "gspmd"
                self.path_reason = "the model makes no jaxpar call: XLA's partitioner places the collectives (GSPMD)"
        self._explicit = explicit and self.path == "gspmd"
        self._path_decided = True
        if self._explicit:
            self.path_reason += ("; its out_sharding needs explicit mesh axes, so the batch axes are explicit inside the "
                                 "model and every weight enters gathered over them (stacked layers are not gathered one at a time)")
        if self.path == "gspmd":
            self._check_gspmd()
        return self.path

    def _check_gspmd(self):
        """Refuse what only the manual path does."""
        manual_only = {
            "a compressed grad_sync": self.grad_sync is not None,
            "a pipeline (stage > 1)": self.pipeline is not None,
            "regather=on": self.layout.regather,
        }
        asked = [what for what, on in manual_only.items() if on]
        if asked:
            raise LayoutError(f"{' and '.join(asked)} needs jaxpar's manual step, but {self.path_reason}. "
                              f"Write the model with jaxpar's model-facing calls (jaxpar.nn), or drop {asked[0]}")

    def stacked_marks(self):
        """A tree like the params, True at the stacked layer weights (logical axis ``layers``)."""
        return _nest({p: "layers" in names for p, names in self.names.items()})

    def _reduction_plan(self, path):
        """Per weight: mesh axes reduced by the gather's backward, per micro-batch, and at the end."""
        layout, names = self.layout, self.names[path]
        axes = lambda n, m: layout.axes_of(n, m)  # noqa: E731
        pending = list(layout.batch_axes)
        for n in names:
            for a in axes(n, "param"):
                if a not in axes(n, "compute") and a in pending:
                    pending.remove(a)  # reduce-scattered by the gather's transpose
        per_micro, final = [], []
        for stage, (src, dst) in (("micro", ("param", "grad")), ("final", ("grad", "optimizer"))):
            for dim, n in enumerate(names):
                new = tuple(a for a in axes(n, dst) if a not in axes(n, src) and a in pending)
                if new:
                    (per_micro if stage == "micro" else final).append((dim, new))
                    pending = [a for a in pending if a not in new]
        return per_micro, final, tuple(pending)

    def _local_grads(self, params, batch, seed=None):
        """Runs on every device inside shard_map: mean loss and reduced gradient shards (under a
        compressed sync, the weights in ``self._buckets`` are left for ``grad_fn`` to all-reduce).
        ``seed``: the compressed sync's dither seed this step."""
        layout, cfg, sync = self.layout, self.cfg, self.grad_sync
        k = cfg.microbatches
        shards = layout.batch_shards * k
        flat_params = _flatten(params)
        plans = {p: self._reduction_plan(p) for p in flat_params}

        # Make every weight vary over the batch axes: its gradient is then the unreduced local one,
        # and the reductions below are the only ones (no implicit all-reduce from autodiff).
        def to_varying(x):
            axes = tuple(a for a in layout.batch_axes if a not in varying_axes(x))
            return jax.lax.pcast(x, axes, to="varying") if axes else x

        varying = _nest({p: to_varying(v) for p, v in flat_params.items()})
        micro = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)

        def loss(p, mb):
            state = gather_params(self._with_values(p))  # the top-level weights, whole
            gather_layers_when_read(state)  # stacked ones, one layer at a time in the model's loop
            return self.loss_fn(nnx.merge(self.graphdef, state), mb) / shards

        objective = remat.checkpoint_layer_loops(loss, self.remat_policy, self.stacked_marks())

        def reduce(grads, which):
            if sync is not None and (which == "final" or k == 1):  # with k > 1 the per-micro-batch ones stay exact
                return _nest(self._reduce_compressed(_flatten(grads), plans, which, seed))
            out = {}
            for path, g in _flatten(grads).items():
                per_micro, final, rest = plans[path]
                for dim, axes in per_micro if which == "micro" else final:
                    g = jax.lax.psum_scatter(g.astype(self._reduce_dtype), axes, scatter_dimension=dim, tiled=True)
                if which == "final" and rest:
                    g = jax.lax.psum(g.astype(self._reduce_dtype), rest)
                out[path] = g.astype(jnp.float32)
            return _nest(out)

        if self.pipeline is not None:  # the schedule runs the micro-batches through the stages
            stacked, edge = self.pipeline.split(varying)
            loss, stacked_grads, edge_grads = pipeline_lib.stage_grads(
                self.program, self.pipeline.pieces, stacked, edge, micro, chunks=cfg.chunks, loss_scale=1.0 / shards)
            acc = self.pipeline.merge(stacked_grads, edge_grads)
            self.accumulator_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(acc))
            loss = jax.lax.psum(loss, layout.batch_axes) if layout.batch_axes else loss
            return loss, reduce(reduce(acc, "micro"), "final")

        def micro_step(acc, mb):
            loss, grads = jax.value_and_grad(objective)(varying, mb)
            grads = reduce(grads, "micro")
            return jax.tree.map(jnp.add, acc, grads), loss

        def acc_zeros(path, x):
            shape = list(x.shape)
            for dim, axes in plans[path][0]:
                shape[dim] //= math.prod(layout.mesh.shape[a] for a in axes)
            zeros = jnp.zeros(shape, jnp.float32)
            vma = varying_axes(x) | set(layout.batch_axes)
            return jax.lax.pcast(zeros, tuple(vma), to="varying") if vma else zeros

        acc = _nest({p: acc_zeros(p, v) for p, v in _flatten(varying).items()})
        # per-device bytes of the buffer the micro-batch loop carries (the memory report reads it)
        self.accumulator_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(acc))
        acc, losses = jax.lax.scan(micro_step, acc, micro)
        loss = jax.lax.psum(jnp.sum(losses), layout.batch_axes) if layout.batch_axes else jnp.sum(losses)
        unfinished = sorted(varying_axes(loss))
        if unfinished:
            raise LayoutError(
                f"the loss still differs across mesh axes {unfinished}: the model sums over a logical axis "
                f"sharded on them without finishing the sum. Mark such sums (row-parallel matmul outputs) "
                f"with jaxpar.nn.reduce_partial(x, contracted_names, output_names)"
            )
        return loss, reduce(acc, "final")

    def _reduce_compressed(self, flat, plans, which, seed):
        """``reduce`` under a compressed sync: each weight's reduce-scatters of this stage in
        order, those over a compressed axis bucketed by axes; then (final stage) the all-reduces
        that stay exact. All-reduces over a compressed axis are left to ``grad_fn``."""
        sync, rd = self.grad_sync, self._reduce_dtype
        stages = {p: list(plans[p][0] if which == "micro" else plans[p][1]) for p in flat}
        round_ = 0
        while any(stages.values()):
            buckets: dict[tuple, list] = {}
            for path, todo in stages.items():
                if todo:
                    dim, axes = todo.pop(0)
                    if sync.compresses(axes):  # a bucket per type too: see rules.gather_params
                        buckets.setdefault((axes, tuple(sorted(varying_axes(flat[path])))), []).append((path, dim))
                    else:
                        flat[path] = jax.lax.psum_scatter(flat[path].astype(rd), axes, scatter_dimension=dim, tiled=True)
            for (axes, vma), members in buckets.items():
                shards = sync.reduce_scatter_bucket([(flat[p], dim) for p, dim in members], axes, seed, (which, round_, axes, vma))
                flat.update(zip([p for p, _ in members], shards))
            round_ += 1
        if which == "final":
            for path, g in flat.items():
                rest = plans[path][2]
                if rest and not sync.compresses(rest):
                    flat[path] = jax.lax.psum(g.astype(rd), rest)
        return {p: g.astype(jnp.float32) for p, g in flat.items()}

    def _clip(self, grads):
        """(global norm, gradients clipped to ``cfg.clip_norm``)."""
        norm = self._global_norm(grads)
        if self.cfg.clip_norm:
            scale = jnp.minimum(1.0, self.cfg.clip_norm / jnp.maximum(norm, 1e-30))
            grads = jax.tree.map(lambda g: g * scale, grads)
        return norm, grads

    def _global_norm(self, grads):
        """Norm of the whole gradient from its shards: each shard's squares summed over the axes it
        is split over (once per group of leaves split alike), never over axes it is copied on."""
        by_axes: dict[tuple, jax.Array] = {}
        for path, g in _flatten(grads).items():
            axes = tuple(a for name in self.names[path] for a in self.layout.axes_of(name, "optimizer"))
            by_axes[axes] = by_axes.get(axes, 0.0) + jnp.sum(jnp.square(g))
        total = sum(jax.lax.psum(s, axes) if axes else s for axes, s in by_axes.items())
        return jnp.sqrt(total)

    @property
    def _reduce_dtype(self):
        return jnp.dtype(self.cfg.grad_reduce_dtype)

    def grad_fn(self):
        """(params, batch, step=None) -> (loss, gradient norm, clipped gradients laid out like the
        optimizer state), under the layout. ``step`` seeds a compressed sync's dither (0 if None)."""
        mesh, layout, sync = self.layout.mesh, self.layout, self.grad_sync
        batch_spec = PartitionSpec(layout.batch_axes or None)
        replicated = PartitionSpec()

        def run(params, batch, seed=None):
            # ZeRO-3's reduce-scatter (in the gather's backward) is compressed only when it runs once per step
            in_gather = {"grad_sync": sync, "grad_seed": seed} if sync is not None and self.cfg.microbatches == 1 else {}
            dtypes = {"compute_dtype": self.cfg.compute_dtype, "grad_reduce_dtype": self.cfg.grad_reduce_dtype}
            with use_layout(layout, manual=True, **dtypes, **in_gather):
                return self._local_grads(params, batch, seed)

        def clipped(params, batch, seed=None):
            loss, grads = run(params, batch, seed)
            return (loss, *self._clip(grads))

        def grads(params, batch, step=None):
            if self.choose_path(params, batch) == "gspmd":
                with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                    self.accumulator_bytes = gspmd.accumulator_bytes(self)
                    return gspmd.grads_fn(self, self._explicit)(params, batch)
            with _manual_errors():
                return manual(params, batch, step)

        def manual(params, batch, step):
            in_specs = (self.param_specs, jax.tree.map(lambda _: batch_spec, batch))
            out_specs = (replicated, replicated, self.opt_specs_by_param)
            if sync is None:
                fn = jax.shard_map(clipped, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
                if self.schedule is not None and self.schedule.chunks > 1:  # interleaved: device s holds chunks s, s+S, ...
                    loss, norm, g = fn(self._reorder(params, pipeline_lib.to_stage_order), batch)
                    return loss, norm, self._reorder(g, pipeline_lib.to_layer_order)
                return fn(params, batch)
            seed = grad_sync.step_seed(0 if step is None else step)
            if not self._buckets:
                fn = jax.shard_map(clipped, mesh=mesh, in_specs=in_specs + (replicated,), out_specs=out_specs)
                return fn(params, batch, seed)
            return self._compressed_all_reduce(run, in_specs, out_specs)(params, batch, seed)

        return grads

    def _reorder(self, params, order):
        stacked, edge = self.pipeline.split(params)
        return self.pipeline.merge(order(stacked, self.schedule), edge)

    def _compressed_all_reduce(self, run, in_specs, out_specs):
        """The step's gradients when some all-reduces are compressed, as two shard_maps.

        The first computes the gradients and hands each bucket's unreduced vector out, one row
        per device. The compressed all-reduce leaves every device with the same bits, but its
        ppermutes make the result "varying" to shard_map's type checks, which have no cast back;
        so the second shard_map, unchecked (check_vma=False), all-reduces the buckets, splits them
        into weights, and computes the norm and the clipping."""
        mesh, sync = self.layout.mesh, self.grad_sync
        per_device = PartitionSpec(tuple(a for a in mesh.axis_names if mesh.shape[a] > 1))
        specs = _flatten(self.opt_specs_by_param)
        done_specs = [specs[p] for p in self._done_paths]
        shapes = {}  # bucket axes -> local shapes of its weights, read while the first map traces

        def local(params, batch, seed):
            loss, grads = run(params, batch, seed)
            flat = _flatten(grads)
            buckets = []
            for axes, paths in self._buckets:
                shapes[axes] = [flat[p].shape for p in paths]
                buckets.append(grad_sync.pack([flat[p] for p in paths])[None])
            return loss, [flat[p] for p in self._done_paths], buckets

        def synced(done, buckets, seed):
            flat = dict(zip(self._done_paths, done))
            for (axes, paths), bucket in zip(self._buckets, buckets):
                total = sync.all_reduce(bucket[0], axes, seed, ("all-reduce", axes))
                flat.update(zip(paths, grad_sync.unpack(total, shapes[axes])))
            return self._clip(_nest(flat))

        bucket_specs = [per_device] * len(self._buckets)

        def fn(params, batch, seed):
            first = jax.shard_map(
                local, mesh=mesh, in_specs=in_specs + (PartitionSpec(),),
                out_specs=(PartitionSpec(), done_specs, bucket_specs),
            )
            loss, done, buckets = first(params, batch, seed)
            second = jax.shard_map(
                synced, mesh=mesh, in_specs=(done_specs, bucket_specs, PartitionSpec()), out_specs=out_specs[1:],
                check_vma=False,
            )
            return (loss, *second(done, buckets, seed))

        return fn

    def step_fn(self):
        """The un-jitted step: (state, batch) -> (state, metrics). A step whose loss or gradient
        norm is not finite leaves the weights and optimizer state as they were (``metrics["finite"]``
        says which it was); ``step`` then raises or skips by ``cfg.nonfinite``."""
        grads_of = self.grad_fn()

        def step(state: TrainState, batch):
            loss, grad_norm, grads = grads_of(state.params, batch, state.step)
            updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
            params, opt_state = jax.tree.map(keep, params, state.params), jax.tree.map(keep, opt_state, state.opt_state)
            metrics = {"loss": loss, "grad_norm": grad_norm, "finite": finite}
            return TrainState(params, opt_state, state.step + 1), metrics

        return step

    def jit_step(self, batch_example):
        replicated = NamedSharding(self.layout.mesh, PartitionSpec())
        return jax.jit(
            self.step_fn(),
            in_shardings=(self.state_shardings, self.batch_sharding(batch_example)),
            out_shardings=(self.state_shardings, {"loss": replicated, "grad_norm": replicated, "finite": replicated}),
            donate_argnums=(0,) if self.cfg.donate else (),
        )

    def step(self, state: TrainState, batch):
        """One optimizer step (compiled on first use). Raises ``NonFiniteStep`` (carrying the
        state, unchanged by that step) when the loss or gradient norm is NaN or infinite, unless
        ``cfg.nonfinite == "skip"``; this reads the step's result, so it waits for the step."""
        if self._step is None:
            self.check_batch(batch)
            self._step = self.jit_step(batch)
        state, metrics = self._step(state, batch)
        if self.cfg.nonfinite == "stop" and not bool(metrics["finite"]):
            number = int(state.step)  # the step just taken, counted from 1 as the training loop does
            raise NonFiniteStep(nonfinite_message(number, float(metrics["loss"]), float(metrics["grad_norm"])),
                                number, state, metrics)
        return state, metrics

    def check(self, batch, tolerance: float | None = None, seed: int = 0):
        """One step of this layout against the same model on one device, weight by weight
        (``check.check_trainer``): a ``CheckReport`` whose ``failed`` names every weight whose
        gradient differs beyond ``tolerance``."""
        return check_lib.check_trainer(self, batch, tolerance, seed)

    def put_batch(self, batch):
        """Place a host batch on the devices, split over the batch axes."""
        self.check_batch(batch)
        return jax.device_put(batch, self.batch_sharding(batch))

    def put_process_batch(self, batch_size: int, rows: Callable[[int, int], Any]):
        """Build a global batch of ``batch_size`` rows of which this process makes only its own.

        ``rows(start, stop)`` returns rows ``[start, stop)`` of the global batch as a host array.
        It is called for the row ranges held by this process's devices (in order), so with
        several processes each one reads only its shard of the data."""
        self.check_batch(np.zeros((batch_size, 1)))
        sharding = NamedSharding(self.layout.mesh, PartitionSpec(self.layout.batch_axes or None))
        held = sharding.addressable_devices_indices_map((batch_size,)).values()
        ranges = sorted({(index[0].start or 0, batch_size if index[0].stop is None else index[0].stop) for index in held})
        local = np.concatenate([rows(start, stop) for start, stop in ranges])
        return jax.make_array_from_process_local_data(sharding, local, (batch_size,) + local.shape[1:])


def nonfinite_message(step: int, loss: float, grad_norm: float) -> str:
    what = "gradient" if not np.isfinite(grad_norm) else "loss"
    return (f"non-finite {what} at step {step} (loss {loss:.4g}, gradient norm {grad_norm:.4g}); the step's update "
            f"was not applied. Lower the learning rate, check the batch, or skip such steps (TrainConfig(nonfinite='skip'), "
            f"jaxpar train --skip-nonfinite)")


@contextlib.contextmanager
def _manual_errors():
    """A model's own sharding annotations met inside the manual step's shard_map, in jaxpar's words."""
    try:
        yield
    except (NotImplementedError, ValueError) as error:
        if isinstance(error, JaxparError) or "Manual" not in str(error):
            raise
        raise LayoutError(
            "the model sets a sharding of its own (out_sharding= or jax.lax.with_sharding_constraint) inside jaxpar's "
            "manual step, where every mesh axis is manual and such annotations cannot apply. Use "
            "jaxpar.nn.constrain(x, logical_names) there, or write the model without jaxpar's model-facing calls so "
            f"that the GSPMD path takes it (TrainConfig(path='gspmd')). JAX said: {str(error).splitlines()[0]}"
        ) from error


def _flatten(tree) -> dict:
    """Pure nested dict -> {path tuple: leaf}."""
    out = {}

    def walk(node, prefix):
        if isinstance(node, dict):
            for key, child in node.items():
                walk(child, prefix + (key,))
        else:
            out[prefix] = node

    walk(tree, ())
    return out

