"""One plan pass: every decision of a training step under a layout, made once, before anything is
compiled or placed on a device, in ``make_plan``; ``Trainer`` runs a ``Plan`` and decides nothing.

The decisions, in order, each refusal with the value and the fix:

- the options themselves (path, attention kernel, non-finite policy, remat), and each strategy's
  refusals of them (``check_run``: a kernel the context ring would not run);
- the weights against the layout (``state.ShardedState``: a dim its axes cannot split) and each
  strategy's (``check_weights``: heads the context all-to-all cannot split);
- FSDP's regather (as asked, or under ``regather=auto`` by memory) and the layer loops' remat policy;
- the gradient sync (exact or compressed), the pipeline's split, schedule and program;
- per weight the mesh axes its gradient is reduced over, and where (``reductions.ReductionPlan``),
  and the compressed all-reduces' buckets;
- who places the collectives (``decide_path``: manual or GSPMD, and why), from one abstract
  trace of the loss on the batch; with it what only the manual path runs is refused, and what
  the model must call (a strategy's ``check_calls``);
- the compile options (``parallel.compiler_options``) and the bytes of the gradient buffer.

The path needs the batch's shapes: given them (``make_plan(..., batch=)``, as the main job,
``jaxpar compile`` and ``jaxpar check`` do) every decision is made at once; without them (a
``Trainer`` built before its first batch) the path is decided when the first batch is seen.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.traverse_util import flatten_dict as flatten
from jax.sharding import NamedSharding

from jaxpar import attention, parallel
from jaxpar.errors import JaxparError, LayoutError
from jaxpar.parallel import STRATEGIES
from jaxpar.parallel.stage import pipeline as pipeline_lib
from jaxpar.parallel.stage import schedules
from jaxpar.rules import Layout, record_model_calls, use_layout
from jaxpar.train import grad_sync, gspmd, pipedream, reductions, remat
from jaxpar.train.config import NONFINITE, PATHS, TrainConfig
from jaxpar.train.placement import BatchPlacement
from jaxpar.train.state import ShardedState, abstract_model, leave_to_rules, make_optimizer, variables


@dataclasses.dataclass(frozen=True)
class Plan:
    """A training step's decisions (``make_plan``). ``path`` is None until ``decide_path``."""

    layout: Layout
    model_fn: Callable
    loss_fn: Callable
    cfg: TrainConfig
    optimizer: Any
    sharded_state: ShardedState  # the weights as the layout stores and computes them
    placement: BatchPlacement  # where batches go
    regather: bool  # FSDP: gather the layers' weights again for the backward pass
    regather_reason: str
    remat_policy: Any  # each layer loop's checkpoint policy (None: no checkpoint)
    grad_sync: Any  # the compressed gradient sync (None: exact)
    pipeline: Any  # the model cut into pipeline pieces (None: no stage axis)
    schedule: Any
    program: Any
    reductions: dict  # weight path -> reductions.ReductionPlan
    buckets: list  # compressed all-reduces, one per set of axes: [(axes, [paths])]
    done_paths: list  # the weights whose reductions all run in the step's shard_map
    path: str | None = None  # manual | gspmd
    path_reason: str | None = None
    explicit: bool = False  # GSPMD path: the model needs explicit mesh axes (its own out_sharding)
    calls: tuple[str, ...] | None = None  # the jaxpar calls the model makes (None: not traced yet)
    example: Any = None  # the batch's shapes (ShapeDtypeStructs) where make_plan was given them

    @property
    def compiler_options(self) -> dict | None:
        return parallel.compiler_options(self.layout)

    @property
    def accumulator_bytes(self) -> int:
        """Per-device bytes of the float32 gradient buffer the step carries (the memory report's
        ``gradient_accumulation``): on the manual path each weight's stored shard less the
        per-micro-batch reduce-scatters, or, under a pipeline, the stages' gradients; on the GSPMD
        path the gradient mapping's shard."""
        state, mesh = self.sharded_state, self.layout.mesh
        specs = flatten(state.grad_specs_by_param if self.path == "gspmd" else state.param_specs)
        total = 0
        for path, var in variables(state.abstract).items():
            shape = list(NamedSharding(mesh, specs[path]).shard_shape(var.get_value().shape))
            if self.path != "gspmd" and self.pipeline is None:
                for dim, axes in self.reductions[path].per_micro:
                    shape[dim] //= math.prod(mesh.shape[a] for a in axes)
            total += 4 * math.prod(shape)
        return total

    def decide_path(self, params, batch) -> Plan:
        """This plan with its path decided (``choose_path``), from an abstract trace of the loss on
        ``params`` and ``batch`` (arrays or ShapeDtypeStructs)."""
        if self.calls is not None or self.cfg.path == "manual":
            return self
        return choose_path(self, params, batch)


def make_plan(layout: Layout, model_fn, loss_fn, cfg: TrainConfig = TrainConfig(), optimizer=None, batch=None) -> Plan:
    """Every decision of a step of ``model_fn``'s ``loss_fn`` under ``layout`` (see the module doc);
    ``batch`` (arrays or ShapeDtypeStructs) decides the path too."""
    check_options(layout, cfg)
    graphdef, abstract = abstract_model(model_fn)
    optimizer = leave_to_rules(optimizer or make_optimizer(cfg, _updates_per_step(layout, cfg)), abstract)
    state = ShardedState(layout, model_fn, optimizer, graphdef, abstract)  # every weight against the layout
    shapes = {p: v.get_value().shape for p, v in variables(state.abstract).items()}
    for module in STRATEGIES:  # e.g. heads the context all-to-all cannot split
        module.check_weights(layout, {p: (state.written_names[p], shapes[p]) for p in shapes})
    regather, regather_reason = _choose_regather(layout, state, cfg)
    policy = remat.policy(cfg.remat, regather)
    remat.check_layer_loops(cfg.remat, state.stacked_marks())
    sync = grad_sync.resolve(cfg, layout)
    pipeline, schedule, program = _pipeline(layout, loss_fn, state, cfg, sync, policy, batch)
    plans = {p: reductions.reduction_plan(layout, names) for p, names in state.names.items()}
    buckets, done = reductions.all_reduce_buckets(plans, sync, cfg.microbatches)
    asked = None if cfg.path == "auto" else cfg.path
    plan = Plan(layout, model_fn, loss_fn, cfg, optimizer, state, BatchPlacement(layout, cfg.microbatches), regather,
                regather_reason, policy, sync, pipeline, schedule, program, plans, buckets, done, asked,
                None if asked is None else f"path={cfg.path!r} was asked for",
                example=None if batch is None else jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch))
    if batch is None:
        return plan
    return plan.decide_path(state.abstract_state().params, batch)


def check_options(layout: Layout, cfg: TrainConfig) -> None:
    """Refuse options that are unknown or that these devices or the layout's strategies cannot run."""
    if cfg.path not in PATHS:
        raise JaxparError(f"path={cfg.path!r} is unknown; use {', '.join(PATHS)}")
    if cfg.attention not in attention.IMPLEMENTATIONS:
        raise JaxparError(f"attention={cfg.attention!r} is unknown; use {', '.join(attention.IMPLEMENTATIONS)}")
    width_axes = layout.axes_of("embed")  # (AxoNN's tp_x)
    if width_axes and cfg.path == "manual":
        raise LayoutError(f"path='manual' was asked for, but the layout splits the model width (embed) over "
                          f"{'/'.join(width_axes)} while computing, which only the GSPMD path runs (jaxpar's manual "
                          f"step keeps embed whole inside a block); use path='auto' or 'gspmd', or tp_x=1")
    parallel.check_run(layout, cfg)  # e.g. a kernel the context ring would not run
    attention.check_platform(cfg.attention, layout.mesh.devices.flat[0].platform, "this mesh")
    if cfg.nonfinite not in NONFINITE:
        raise JaxparError(f"nonfinite={cfg.nonfinite!r} is unknown; use stop (raise NonFiniteStep) or skip (drop the step's update)")
    remat.policy(cfg.remat, False)  # refuses an unknown cfg.remat


def _choose_regather(layout: Layout, state: ShardedState, cfg: TrainConfig) -> tuple[bool, str]:
    """The layout's regather, or under regather=auto the strategies' choice by memory."""
    if layout.regather is not None:
        return layout.regather, f"regather={'on' if layout.regather else 'off'} was asked for"
    kept = state.gathered_layer_bytes(jnp.dtype(cfg.compute_dtype).itemsize)
    if not kept:
        return False, "the layout gathers no stacked layer weights"
    memory = cfg.memory_bytes
    if memory is None:
        try:
            stats = layout.mesh.devices.flat[0].memory_stats()
        except Exception:  # compile-only devices (an ahead-of-time TPU target) hold no memory to report
            stats = None
        memory = (stats or {}).get("bytes_limit")  # CPUs report none
    return parallel.choose_regather(kept, sum(state.stored_bytes_per_device().values()), memory)


def _updates_per_step(layout: Layout, cfg: TrainConfig) -> int:
    """Optimizer updates a weight gets per step: one, or under PipeDream one per micro-batch."""
    asynchronous = dict(layout.mesh.shape).get("stage", 1) > 1 and schedules.SCHEDULES.get(cfg.schedule) is schedules.pipedream
    return cfg.microbatches if asynchronous else 1


def _pipeline(layout: Layout, loss_fn, state: ShardedState, cfg: TrainConfig, sync, policy, batch):
    """(model split into pipeline pieces, schedule, lowered program) when the mesh has a stage
    axis: any model is cut at its layer scan (``pipeline.split_at_layer_scan``), each stage's
    chunk of that scan checkpointed by the remat policy. Under PipeDream the program is 1F1B's,
    which the held-out loss runs (the step runs ``train/pipedream.py``'s window)."""
    stages = dict(layout.mesh.shape).get("stage", 1)
    if stages == 1:
        return None, None, None
    if sync is not None:
        raise LayoutError(f"grad_sync={cfg.grad_sync!r} is not supported with a pipeline (stage={stages}) yet; use grad_sync='exact'")
    split = pipeline_lib.split_at_layer_scan(loss_fn, state.graphdef, state.abstract, wrap_body=remat.checkpoint(policy))
    split = dataclasses.replace(split, pieces=parallel.pipeline_pieces(layout, split.pieces))  # (subspace boundaries)
    schedule = schedules.make(cfg.schedule, stages, cfg.microbatches, cfg.chunks)
    stacked, _ = split.split(nnx.to_pure_dict(state.abstract))
    pipeline_lib.layers_per_chunk(pipeline_lib.stacked_layers(stacked), schedule)
    if schedule.asynchronous:
        pipedream.check(layout, state, batch)
        return split, schedule, pipeline_lib.lower(schedules.one_f_one_b(stages, cfg.microbatches))
    return split, schedule, pipeline_lib.lower(schedule)


def model_calls(plan: Plan, params, batch) -> tuple[list[str], bool]:
    """(the jaxpar calls the model makes, whether it needs explicit mesh axes), from an abstract
    trace of the loss on ``params`` and ``batch``."""
    layout = plan.layout
    avals = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)  # noqa: E731
    probe = lambda p, b: plan.loss_fn(plan.sharded_state.merge(p), b)  # noqa: E731
    explicit, calls = False, []
    with use_layout(layout), jax.sharding.use_abstract_mesh(layout.mesh.abstract_mesh):
        try:
            with record_model_calls() as calls:
                jax.eval_shape(probe, avals(params), avals(batch))
        except ValueError as error:
            if not gspmd.needs_explicit_axes(error):
                raise
            explicit = True
    if explicit:  # trace again with the batch axes explicit, to see every call the model makes
        explicit_mesh = layout.mesh.abstract_mesh.update_axis_types(
            {a: jax.sharding.AxisType.Explicit for a in gspmd.explicit_axes_of(layout)})
        with use_layout(layout), jax.sharding.use_abstract_mesh(explicit_mesh), record_model_calls() as calls:
            jax.eval_shape(probe, avals(params), avals(batch))
    return sorted(set(calls)), explicit


def choose_path(plan: Plan, params, batch) -> Plan:
    """Who places the collectives, and why.

    ``manual`` when the model calls jaxpar's model-facing functions (``jaxpar.nn``:
    ``reduce_partial``, ``enter_block``, ``cross_entropy``...): the step runs in one shard_map and
    every collective is placed on purpose, at the analytic optimum. ``gspmd`` when it makes no
    such call (a model written for plain Flax): XLA's partitioner places them (``gspmd.py``)."""
    # a model width split while computing (AxoNN's tp_x) only XLA's partitioner can run: jaxpar's
    # manual step keeps ``embed`` whole inside a block (a model's norm takes its mean locally)
    width_axes = plan.layout.axes_of("embed")
    used, explicit = model_calls(plan, params, batch)
    check_calls(plan.layout, used)
    path, reason = plan.path, plan.path_reason
    if path is None:
        path, reason = _path_by_calls(plan, used, width_axes)
    explicit = explicit and path == "gspmd"
    if explicit:
        reason += ("; its out_sharding needs explicit mesh axes, so the batch axes are explicit inside the "
                   "model and every weight enters gathered over them (stacked layers are not gathered one at a time)")
    plan = dataclasses.replace(plan, path=path, path_reason=reason, explicit=explicit, calls=tuple(used))
    if path != "gspmd":
        return plan
    if plan.layout.regather is None and plan.regather:  # regather=auto: only the manual step gathers again
        plan = dataclasses.replace(plan, regather=False, remat_policy=remat.policy(plan.cfg.remat, False),
                                   regather_reason=plan.regather_reason + "; but the GSPMD path cannot gather again, so they are kept")
    check_gspmd(plan, used)
    return plan


def _path_by_calls(plan: Plan, used: list[str], width_axes) -> tuple[str, str]:
    if width_axes:
        return "gspmd", (f"the layout splits the model width (embed) over {'/'.join(width_axes)} while computing "
                         f"(AxoNN's tp_x), which jaxpar's manual step does not: XLA's partitioner places the "
                         f"collectives (GSPMD), the model's constraints holding its layout")
    if used or plan.pipeline is not None:
        return "manual", (f"the model calls jaxpar's {', '.join(used)}: one shard_map, every collective placed by jaxpar"
                          if used else "the layout pipelines the model's layers")
    return "gspmd", "the model makes no jaxpar call: XLA's partitioner places the collectives (GSPMD)"


def check_calls(layout: Layout, calls) -> None:
    """Refuse a model that never made a call a strategy needs (context parallelism: jaxpar's
    attention op; block parallelism: the batch's share; delayed TP: ``residual_add``)."""
    for module in STRATEGIES:
        module.check_calls(layout, calls)


def check_gspmd(plan: Plan, calls) -> None:
    """Refuse what only the manual path runs (``calls``: the jaxpar calls the model makes)."""
    asked = ["a compressed grad_sync"] if plan.grad_sync is not None else []
    asked += [what for module in STRATEGIES if (what := module.manual_only(plan.layout, calls))]
    if asked:
        where = (" (sequence parallelism and collective matmul split and gather the sequence where the model calls "
                 "jaxpar.nn.enter_block and reduce_partial)" if any(a.endswith("=on)") for a in asked) else "")
        raise LayoutError(f"{' and '.join(asked)} needs jaxpar's manual step{where}, but {plan.path_reason}. "
                          f"Write the model with jaxpar's model-facing calls (jaxpar.nn), or drop {asked[0]}")

