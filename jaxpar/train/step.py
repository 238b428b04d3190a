"""The jitted training step, for any Flax NNX model with logical names: ``Trainer`` composes the
parts of ``train/`` and chooses who places the collectives.

On the manual path the gradient is computed inside one ``shard_map`` over every mesh axis: each
device runs the model on its slice of the batch with its weights gathered per the layout
(``rules.gather_params``), accumulates over micro-batches (``accumulate.py``), and the gradient is
reduced by hand, so every collective is the one the strategy calls for (``reductions.py``). Under
a compressed ``TrainConfig.grad_sync`` (``grad_sync.py``), the all-reduces over a compressed axis,
whose results the shard_map's type checks cannot see are the same on every device, run in a
second, unchecked shard_map together with the clipping. On the GSPMD path (``gspmd.py``) XLA's
partitioner places them.

The optimizer update then runs on the stored shards (optax, outside the shard_map); where weights
are stored whole but updated in shards (ZeRO-1/2), XLA all-gathers the updated weights.

The other parts: ``state.py`` (the state, its layout checks, specs, shardings and initialisers),
``placement.py`` (where batches go).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.traverse_util import flatten_dict as flatten
from flax.traverse_util import unflatten_dict as nest
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar import attention, parallel
from jaxpar.errors import JaxparError, LayoutError, NonFiniteStep
from jaxpar.parallel import STRATEGIES
from jaxpar.parallel.stage import pipeline as pipeline_lib
from jaxpar.rules import Layout, gather_layers_when_read, gather_params, record_model_calls, use_layout, vary_over, varying_axes
from jaxpar.train import check as check_lib
from jaxpar.train import grad_sync, gspmd, partial_sums, reductions, remat
from jaxpar.train.accumulate import accumulate, local_microbatches
from jaxpar.train.config import TrainConfig
from jaxpar.train.pipedream import PipeDreamStep
from jaxpar.train.plan import Plan, check_calls, make_plan
from jaxpar.train.state import TrainState




class _Part:
    """A ``Trainer`` attribute that one of its parts holds: ``names = _Part("sharded_state")``
    reads ``trainer.sharded_state.names`` (``_Part(part, name)``: under another name there)."""

    def __init__(self, part: str, name: str | None = None):
        self.part, self.name = part, name

    def __set_name__(self, owner, name):
        self.name = self.name or name

    def __get__(self, trainer, owner=None):
        return self if trainer is None else getattr(getattr(trainer, self.part), self.name)


class Trainer:
    """Everything needed to train ``model_fn`` under ``layout``.

    ``loss_fn(model, batch)`` returns the mean loss over its (local) batch; every device gets an
    equal slice of the batch, so the mean of the slices' means is the global mean. ``batch`` is an
    array (or a pytree of arrays) whose dim 0 is the batch.
    """

    # what the layout makes of the weights (state.py)
    graphdef = _Part("sharded_state")
    abstract = _Part("sharded_state")
    names = _Part("sharded_state")  # path -> logical names as laid out (replicated short dims unnamed)
    written_names = _Part("sharded_state")  # path -> logical names as the model wrote them
    param_specs = _Part("sharded_state")
    opt_specs = _Part("sharded_state")
    opt_specs_by_param = _Part("sharded_state")
    grad_specs_by_param = _Part("sharded_state")
    init_programs = _Part("sharded_state")
    init_shapes = _Part("sharded_state")
    abstract_leaf = _Part("sharded_state")
    merge = _Part("sharded_state")
    _with_values = _Part("sharded_state", "with_values")
    stacked_marks = _Part("sharded_state")
    stored_bytes_per_device = _Part("sharded_state")
    # where batches go (placement.py)
    batch_sharding = _Part("placement", "sharding")
    abstract_batch = _Part("placement", "abstract")
    check_batch = _Part("placement", "check")
    put_batch = _Part("placement", "put")
    put_process_batch = _Part("placement", "put_process")

    def __init__(self, layout: Layout, model_fn, loss_fn, cfg: TrainConfig = TrainConfig(), optimizer=None, batch=None):
        """Plans (``plan.make_plan``) and runs a step of ``model_fn``'s ``loss_fn`` under ``layout``;
        ``batch`` (arrays or ShapeDtypeStructs) decides the path now rather than at the first step."""
        self._run(make_plan(layout, model_fn, loss_fn, cfg, optimizer, batch))

    @classmethod
    def from_plan(cls, plan: Plan) -> Trainer:
        trainer = cls.__new__(cls)
        trainer._run(plan)
        return trainer

    def _run(self, plan: Plan):
        self.plan = plan  # every decision; replaced once, when the path is decided
        self.layout, self.model_fn, self.loss_fn, self.cfg, self.optimizer = plan.layout, plan.model_fn, plan.loss_fn, plan.cfg, plan.optimizer
        self.sharded_state, self.placement = plan.sharded_state, plan.placement
        asynchronous = plan.schedule is not None and plan.schedule.asynchronous
        self.pipedream = PipeDreamStep(plan) if asynchronous else None  # the step is a PipeDream window
        self._step = None
        self._sums_checked = False  # the forward pass is searched for unfinished partial sums once

    # --- the state: the layout's (state.py), with PipeDream's pipeline between steps ----------

    @property
    def state_shardings(self) -> TrainState:
        shardings = self.sharded_state.state_shardings
        return shardings if self.pipedream is None else self.pipedream.state_shardings(shardings)

    def init(self, seed: int = 0) -> TrainState:
        """Sharded parameters and optimizer state; the same seed gives the same values on any layout."""
        if self.pipedream is None:
            return self.sharded_state.init(seed)
        return self.pipedream.start(self.sharded_state.init_programs()[0](jax.random.key(seed)))

    def start_from(self, params) -> TrainState:
        """Step 0 with these parameters (laid out as the state's) and a fresh optimizer state."""
        return self.sharded_state.start_from(params) if self.pipedream is None else self.pipedream.start(params)

    def abstract_state(self) -> TrainState:
        """ShapeDtypeStructs with shardings: enough to compile a step without allocating anything."""
        abstract = self.sharded_state.abstract_state()
        return abstract if self.pipedream is None else self.pipedream.abstract_state(abstract)

    def choose_path(self, params, batch) -> str:
        """The plan's path (``plan.choose_path``), decided on the first call from ``params`` and ``batch``."""
        self.plan = self.plan.decide_path(params, batch)
        return self.plan.path

    def _check_partial_sums(self, model_loss, params, micro):
        """Refuse, from one trace of the forward pass (nothing compiled), a partial sum the model
        never finishes (``partial_sums.py``): a weight's split dims seed the search."""
        axes = partial_sums.tracked_axes(self.layout)
        if axes:
            one = jax.tree.map(lambda x: x[0], micro)
            jaxpr = jax.make_jaxpr(model_loss)(params, one)
            by_path = {tuple(k.key for k in path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
            seeds = [tuple(map(frozenset, self.layout.dim_axes(self.names[p], "param"))) for p in by_path]
            seeds += [(frozenset(),) * x.ndim for x in jax.tree.leaves(one)]
            partial_sums.check(jaxpr, seeds, axes)
        self._sums_checked = True

    def _local_grads(self, params, batch, seed=None, plans=None):
        """Runs on every device inside shard_map: mean loss and reduced gradient shards (under a
        compressed sync, the weights in the plan's buckets are left for ``grad_fn`` to all-reduce).
        ``seed``: the compressed sync's dither seed this step; ``plans``: other reductions than
        the layout's (``local_grad_fn``: none)."""
        layout, cfg, plan = self.layout, self.cfg, self.plan
        plans = plan.reductions if plans is None else plans
        k = cfg.microbatches
        shards = layout.loss_shards * k

        # Make every weight vary over the axes the tokens are split over: its gradient is then the
        # unreduced local one, and the reductions below are the only ones (no implicit all-reduce).
        varying = nest({p: vary_over(v, layout.loss_axes) for p, v in flatten(params).items()})
        for module in STRATEGIES:  # this device's part of each row (context parallelism's positions)
            batch = module.local_batch(layout, batch)
        micro = local_microbatches(batch, k)

        def model_loss(p, mb):
            state = gather_params(self._with_values(p))  # the top-level weights, whole
            gather_layers_when_read(state)  # stacked ones, one layer at a time in the model's loop
            return self.loss_fn(nnx.merge(self.graphdef, state), mb) / shards

        if plan.pipeline is None and not self._sums_checked:
            self._check_partial_sums(model_loss, varying, micro)
        objective = remat.checkpoint_layer_loops(model_loss, plan.remat_policy, self.stacked_marks())

        def reduce(grads, which):
            return reductions.reduce(grads, plans, which, jnp.dtype(cfg.grad_reduce_dtype), plan.grad_sync, seed, k)

        with record_model_calls() as calls:
            if plan.pipeline is not None:  # the schedule runs the micro-batches through the stages
                stacked, edge = plan.pipeline.split(varying)
                loss, stacked_grads, edge_grads = pipeline_lib.stage_grads(
                    plan.program, plan.pipeline.pieces, stacked, edge, micro, chunks=cfg.chunks, loss_scale=1.0 / shards,
                    link=(cfg.stage_link_mbps, cfg.stage_link_latency_ms))
                acc = plan.pipeline.merge(stacked_grads, edge_grads)
                losses = loss[None]
            else:
                losses, acc = accumulate(jax.value_and_grad(objective), varying, micro, lambda g: reduce(g, "micro"), plans, layout)
        check_calls(layout, calls)
        loss = jax.lax.psum(jnp.sum(losses), layout.loss_axes) if layout.loss_axes else jnp.sum(losses)
        if plan.pipeline is not None:
            return loss, reduce(reduce(acc, "micro"), "final")
        unfinished = sorted(varying_axes(loss))
        if unfinished:
            raise LayoutError(
                f"the loss still differs across mesh axes {unfinished}: the model sums over a logical axis "
                f"sharded on them without finishing the sum. Mark such sums (row-parallel matmul outputs) "
                f"with jaxpar.nn.reduce_partial(x, contracted_names, output_names)"
            )
        return loss, reduce(acc, "final")

    def local_grad_fn(self):
        """(params, batch) -> (mean loss, each device's own unreduced gradient, stacked on a new
        leading dim split over every device of the mesh), for a caller that adds the gradients of
        several programs and reduces them once (data-centric parallel, ``train/dcp.py``). Only for
        layouts that store every weight whole (data and context axes)."""
        layout = self.layout
        split = sorted({a for names in self.names.values() for axes in layout.dim_axes(names, "param") for a in axes})
        if split:
            raise LayoutError(f"local_grad_fn needs every weight stored whole, but this layout splits weights over {split}; "
                              f"use data and context axes only")
        devices = tuple(a for a in layout.mesh.axis_names if layout.mesh.shape[a] > 1)
        unreduced = {p: reductions.ReductionPlan([], [], [], ()) for p in self.plan.reductions}
        dtypes = {"compute_dtype": self.cfg.compute_dtype, "grad_reduce_dtype": self.cfg.grad_reduce_dtype}

        def run(params, batch):
            with use_layout(layout, manual=True, **dtypes), attention.use_implementation(self.cfg.attention):
                loss, grads = self._local_grads(params, batch, plans=unreduced)
            return loss, jax.tree.map(lambda g: g[None], grads)

        def fn(params, batch):
            if self.choose_path(params, batch) != "manual":
                raise LayoutError(f"local_grad_fn runs jaxpar's manual step, but {self.plan.path_reason}")
            out_specs = (PartitionSpec(), jax.tree.map(lambda _: PartitionSpec(devices or None), params))
            with _manual_errors():
                return jax.shard_map(run, mesh=layout.mesh, in_specs=(self.param_specs, self.placement.spec), out_specs=out_specs)(params, batch)

        return fn

    def _clip(self, grads):
        """(global norm, gradients clipped to ``cfg.clip_norm``)."""
        return reductions.clip(grads, self.layout, self.names, self.cfg.clip_norm, self.sharded_state.rule_updated)

    def grad_fn(self):
        """(params, batch, step=None) -> (loss, gradient norm, clipped gradients laid out like the
        optimizer state), under the layout. ``step`` seeds a compressed sync's dither (0 if None)."""
        mesh, layout, sync = self.layout.mesh, self.layout, self.plan.grad_sync
        batch_spec = self.placement.spec
        replicated = PartitionSpec()

        def run(params, batch, seed=None):
            # ZeRO-3's reduce-scatter (in the gather's backward) is compressed only when it runs once per step
            in_gather = {"grad_sync": sync, "grad_seed": seed} if sync is not None and self.cfg.microbatches == 1 else {}
            dtypes = {"compute_dtype": self.cfg.compute_dtype, "grad_reduce_dtype": self.cfg.grad_reduce_dtype}
            with use_layout(layout, manual=True, **dtypes, **in_gather), attention.use_implementation(self.cfg.attention):
                return self._local_grads(params, batch, seed)

        def clipped(params, batch, seed=None):
            loss, grads = run(params, batch, seed)
            return (loss, *self._clip(grads))

        def grads(params, batch, step=None):
            if self.choose_path(params, batch) == "gspmd":
                with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), attention.use_implementation(self.cfg.attention):
                    return gspmd.grads_fn(self, self.plan.explicit)(params, batch)
            with _manual_errors():
                return manual(params, batch, step)

        def manual(params, batch, step):
            in_specs = (self.param_specs, jax.tree.map(lambda _: batch_spec, batch))
            out_specs = (replicated, replicated, self.opt_specs_by_param)
            if sync is None:
                fn = jax.shard_map(clipped, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
                if self.plan.schedule is not None and self.plan.schedule.chunks > 1:  # interleaved: device s holds chunks s, s+S, ...
                    loss, norm, g = fn(self._reorder(params, pipeline_lib.to_stage_order), batch)
                    return loss, norm, self._reorder(g, pipeline_lib.to_layer_order)
                return fn(params, batch)
            seed = grad_sync.step_seed(0 if step is None else step)
            if not self.plan.buckets:
                fn = jax.shard_map(clipped, mesh=mesh, in_specs=in_specs + (replicated,), out_specs=out_specs)
                return fn(params, batch, seed)
            return self._compressed_all_reduce(run, in_specs, out_specs)(params, batch, seed)

        return grads

    def _reorder(self, params, order):
        stacked, edge = self.plan.pipeline.split(params)
        return self.plan.pipeline.merge(order(stacked, self.plan.schedule), edge)

    def _compressed_all_reduce(self, run, in_specs, out_specs):
        """The step's gradients when some all-reduces are compressed, as two shard_maps.

        The first computes the gradients and hands each bucket's unreduced vector out, one row
        per device. The compressed all-reduce leaves every device with the same bits, but its
        ppermutes make the result "varying" to shard_map's type checks, which have no cast back;
        so the second shard_map, unchecked (check_vma=False), all-reduces the buckets, splits them
        into weights, and computes the norm and the clipping."""
        mesh, sync, buckets, done_paths = self.layout.mesh, self.plan.grad_sync, self.plan.buckets, self.plan.done_paths
        per_device = PartitionSpec(tuple(a for a in mesh.axis_names if mesh.shape[a] > 1))
        specs = flatten(self.opt_specs_by_param)
        done_specs = [specs[p] for p in done_paths]
        shapes = {}  # bucket axes -> local shapes of its weights, read while the first map traces

        def local(params, batch, seed):
            loss, grads = run(params, batch, seed)
            flat = flatten(grads)
            packed = []
            for axes, paths in buckets:
                shapes[axes] = [flat[p].shape for p in paths]
                packed.append(grad_sync.pack([flat[p] for p in paths])[None])
            return loss, [flat[p] for p in done_paths], packed

        def synced(done, packed, seed):
            flat = dict(zip(done_paths, done))
            for (axes, paths), bucket in zip(buckets, packed):
                total = sync.all_reduce(bucket[0], axes, seed, ("all-reduce", axes))
                flat.update(zip(paths, grad_sync.unpack(total, shapes[axes])))
            return self._clip(nest(flat))

        bucket_specs = [per_device] * len(buckets)

        def fn(params, batch, seed):
            first = jax.shard_map(
                local, mesh=mesh, in_specs=in_specs + (PartitionSpec(),),
                out_specs=(PartitionSpec(), done_specs, bucket_specs),
            )
            loss, done, packed = first(params, batch, seed)
            second = jax.shard_map(
                synced, mesh=mesh, in_specs=(done_specs, bucket_specs, PartitionSpec()), out_specs=out_specs[1:],
                check_vma=False,
            )
            return (loss, *second(done, packed, seed))

        return fn

    def step_fn(self):
        """The un-jitted step: (state, batch) -> (state, metrics). A step whose loss or gradient
        norm is not finite leaves the weights and optimizer state as they were (``metrics["finite"]``
        says which it was); ``step`` then raises or skips by ``cfg.nonfinite``.

        With the old state donated the update runs under ``lax.cond``: a select of new or old
        would keep the old state alive past the in-place update, so XLA copies every leaf first
        (a Gemma-like model under data=8: 41 copies, temporaries 2.32 against 2.21 MB). Without
        donation the select is cheaper: the new state goes to fresh output buffers that XLA also
        lends to temporaries before they are written, which a cond's outputs never are."""
        if self.pipedream is not None:
            return self.pipedream.step_fn()
        grads_of = self.grad_fn()

        def update(params, opt_state, grads):
            updates, opt_state = self.optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        def step(state: TrainState, batch):
            loss, grad_norm, grads = grads_of(state.params, batch, state.step)
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            if self.cfg.donate:
                params, opt_state = jax.lax.cond(finite, update, lambda p, o, g: (p, o), state.params, state.opt_state, grads)
            else:
                params, opt_state = update(state.params, state.opt_state, grads)
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
            compiler_options=self.plan.compiler_options,
        )

    def jit_loss(self, batch_example):
        """(params, batch) -> the loss the step would report on ``batch``, with nothing updated or
        donated: a held-out loss between steps (``jaxpar train --eval-every``). It is the step's
        own loss computation under the layout (the gradients it also makes are dropped, and XLA
        removes what only they needed), so it is exact wherever the step is."""
        grads_of = self.grad_fn()
        replicated = NamedSharding(self.layout.mesh, PartitionSpec())
        return jax.jit(lambda params, batch: grads_of(params, batch)[0], out_shardings=replicated,
                       in_shardings=(self.state_shardings.params, self.batch_sharding(batch_example)),
                       compiler_options=self.plan.compiler_options)

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
            raise NonFiniteStep(nonfinite_message(number, float(metrics["loss"]), float(metrics["grad_norm"]),
                                                  parallel.nonfinite_cause(self.layout)),
                                number, state, metrics)
        return state, metrics

    def check(self, batch, tolerance: float | None = None, seed: int = 0):
        """One step of this layout against the same model on one device, weight by weight
        (``check.check_trainer``): a ``CheckReport`` whose ``failed`` names every weight whose
        gradient differs beyond ``tolerance``."""
        return check_lib.check_trainer(self, batch, tolerance, seed)


def nonfinite_message(step: int, loss: float, grad_norm: float, cause: str | None = None) -> str:
    """The words for a non-finite step; ``cause``: the layout's own (``parallel.nonfinite_cause``)."""
    what = "gradient" if not np.isfinite(grad_norm) else "loss"
    return (f"non-finite {what} at step {step} (loss {loss:.4g}, gradient norm {grad_norm:.4g}); the step's update "
            f"was not applied. Lower the learning rate, check the batch, or skip such steps (TrainConfig(nonfinite='skip'), "
            f"jaxpar train --skip-nonfinite)" + (f". {cause}" if cause else ""))


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

