"""PipeDream inside ``Trainer`` (``--schedule pipedream``): a training step is one window of the
never-flushed stream (``parallel/stage/stream.py``): m micro-batches enter stage 0, and every
backward on a stage steps that stage's weights with the Trainer's optimizer at once, at the
weights its forward used (stashed).

What a stage carries from one step to the next — its optimizer state, its copy of the edge
weights (the first and the last stage each train their own) and their optimizer state, the
weights and inputs stashed for the micro-batches in flight, the gradients on their way back, the
window's micro-batches — is ``TrainState.stream``: checkpoints save it, and a resumed run goes on
with the same micro-batches in flight. ``TrainState.params`` holds the live weights as the layout
stores them: each stage's own layers, and each edge weight from the stage whose piece reads it
(the last stage's copy where both read it: a tied embedding). That view is what the held-out loss
(a 1F1B program on it), checkpoints' readers and exports see; making it costs one sum of the edge
weights over ``stage`` per step.

The layouts: ``stage`` with batch axes that store weights whole (``data``): each stage's weights
are whole on its devices, so an update is the optimizer on the stage's gradient, summed over the
batch axes in ``grad_reduce_dtype`` (each backward differentiates at weights made to vary over
them; left to shard_map's transpose, the sum would run in the compute dtype).
Clipping (``clip_norm``) clips each update by its own norm: a stage's layers, and an end's edge copy.
An optimizer's step count counts updates, m a step: the one ``TrainConfig`` makes reads its
learning-rate schedule at count // m (``make_optimizer``); one given to the Trainer is used as given.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar import attention
from jaxpar.errors import LayoutError
from jaxpar.parallel.stage import stream as stream_lib
from jaxpar.parallel.stage.pipeline import STAGE_AXIS
from jaxpar.rules import Layout, use_layout, vary_over
from jaxpar.train.accumulate import local_microbatches
from jaxpar.train.state import TrainState, bytes_per_device

# the stream's entries the devices of a stage hold alike (weights and what follows them), and
# those each device of a stage holds its own of (its rows' activations, gradients, losses, batch)
_PER_STAGE = ("edge", "opt_state", "edge_opt_state", "stash", "stash_edge", "updates", "versions", "grad_norm",
              "window", "staleness")
_PER_DEVICE = ("acts", "cots", "losses", "previous")


def check(layout: Layout, state, batch) -> None:
    """Refuse, before anything is compiled, what the Trainer's PipeDream does not run: weights
    split over another axis than ``stage`` (each stage steps its own whole weights), a split
    sequence, or a plan made without the batch's shapes (the stream's buffers are shaped by them)."""
    split = sorted({a for names in state.names.values() for mapping in ("param", "optimizer", "compute")
                    for axes in layout.dim_axes(names, mapping) for a in axes} - {STAGE_AXIS})
    if split or layout.sequence_axes:
        what = f"splits weights over {'/'.join(split)}" if split else f"splits the sequence over {'/'.join(layout.sequence_axes)}"
        raise LayoutError(f"--schedule pipedream steps each stage's whole weights after every micro-batch, and this layout "
                          f"{what}; combine stage=N with data=M only, or use --schedule 1f1b")
    if batch is None:
        raise LayoutError("--schedule pipedream shapes the pipeline it carries between steps by the batch: build the "
                          "Trainer with batch= (an example batch, or its ShapeDtypeStructs)")


class PipeDreamStep:
    """The Trainer's step, state and state shardings under PipeDream (see the module docstring)."""

    def __init__(self, plan):
        self.plan, self.layout, self.cfg = plan, plan.layout, plan.cfg
        self.window = stream_lib.window_tables(plan.schedule.stages, plan.schedule.microbatches)
        clip = [optax.clip_by_global_norm(self.cfg.clip_norm)] if self.cfg.clip_norm else []
        self.optimizer = optax.chain(*clip, plan.optimizer)
        mesh = self.layout.mesh
        self.specs = {**{k: PartitionSpec(STAGE_AXIS) for k in _PER_STAGE},
                      **{k: PartitionSpec((STAGE_AXIS, *self.layout.batch_axes)) for k in _PER_DEVICE}}
        self.shardings = {k: NamedSharding(mesh, spec) for k, spec in self.specs.items()}
        self._start, self._abstract_stream = None, None

    def _context(self):
        cfg = self.cfg
        layout = use_layout(self.layout, manual=True, compute_dtype=cfg.compute_dtype, grad_reduce_dtype=cfg.grad_reduce_dtype)
        return layout, attention.use_implementation(cfg.attention)

    def _zero_batch(self):
        """Inside the shard_map: zeros shaped like this device's micro-batches of a step's batch."""
        shards = self.layout.batch_shards
        return jax.tree.map(lambda x: vary_over(jnp.zeros((self.window.microbatches, x.shape[0] // shards // self.window.microbatches,
                                                           *x.shape[1:]), x.dtype), set(self.layout.batch_axes)),
                            self.plan.example)

    def _start_fn(self):
        split, pieces = self.plan.pipeline, self.plan.pipeline.pieces

        def body(params):
            stacked, edge = split.split(params)
            layout, kernel = self._context()
            with layout, kernel:
                carry = stream_lib.start(pieces, self.window, _chunk(stacked), edge, self._zero_batch(), self.optimizer)
            carry.pop("params")  # (TrainState.params holds them)
            return jax.tree.map(lambda x: x[None], carry)

        return jax.jit(jax.shard_map(body, mesh=self.layout.mesh, in_specs=(self.plan.sharded_state.param_specs,),
                                     out_specs=self.specs))

    def start(self, params) -> TrainState:
        """Step 0 with these parameters: the pipeline empty, each stage's optimizer state fresh."""
        if self._start is None:
            self._start = self._start_fn()
        step = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(self.layout.mesh, PartitionSpec()))
        return TrainState(params, None, step, self._start(params))

    def abstract_state(self, abstract: TrainState) -> TrainState:
        """``abstract`` (the layout's state, no memory) with PipeDream's: no optimizer state outside
        the stream, and the stream's shapes and shardings."""
        if self._abstract_stream is None:  # (a trace of the model: made once)
            if self._start is None:
                self._start = self._start_fn()
            shapes = jax.eval_shape(self._start, abstract.params)
            self._abstract_stream = {k: jax.tree.map(lambda v, k=k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self.shardings[k]),
                                                     tree) for k, tree in shapes.items()}
        return TrainState(abstract.params, None, abstract.step, self._abstract_stream)

    def state_shardings(self, shardings: TrainState) -> TrainState:
        return TrainState(shardings.params, None, shardings.step, self.shardings)

    def step_fn(self):
        """(state, batch) -> (state, metrics): one window. ``loss`` is the mean loss of the
        micro-batches whose forward the last stage ran in it, ``grad_norm`` the largest norm of a
        gradient a stage applied; a window with either non-finite leaves the state as it was."""
        layout = self.layout
        param_specs = self.plan.sharded_state.param_specs
        batch_spec = self.plan.placement.spec
        run = jax.shard_map(self._window_body, mesh=layout.mesh,
                            in_specs=(param_specs, self.specs, batch_spec),
                            out_specs=(param_specs, self.specs, PartitionSpec(), PartitionSpec()))

        def step(state: TrainState, batch):
            params, stream, loss, grad_norm = run(state.params, state.stream, batch)
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
            params, stream = jax.tree.map(keep, params, state.params), jax.tree.map(keep, stream, state.stream)
            return TrainState(params, None, state.step + 1, stream), {"loss": loss, "grad_norm": grad_norm, "finite": finite}

        return step

    def _window_body(self, params, stream, batch):
        layout, split = self.layout, self.plan.pipeline
        stacked, edge = split.split(params)
        carry = jax.tree.map(lambda x: x[0], stream)
        carry["params"] = _chunk(stacked)
        micro = local_microbatches(batch, self.window.microbatches)
        link = (self.cfg.stage_link_mbps, self.cfg.stage_link_latency_ms)
        context, kernel = self._context()
        with context, kernel:
            owners = self._edge_owners(carry, micro)
            carry, losses, numbers = stream_lib.advance(
                split.pieces, self.window, carry, micro, self.optimizer, loss_scale=1.0 / layout.loss_shards, link=link,
                batch_axes=tuple(layout.batch_axes), reduce_dtype=jnp.dtype(self.cfg.grad_reduce_dtype))
        live = jax.tree.map(lambda x: x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]), carry.pop("params"))
        here = jax.lax.axis_index(STAGE_AXIS)
        view = jax.tree.map(lambda copy, owner: jax.lax.psum(jnp.where(here == owner, copy, jnp.zeros_like(copy)), STAGE_AXIS),
                            carry["edge"], owners)
        losses = jax.lax.psum(losses, (STAGE_AXIS, *layout.loss_axes)) / layout.loss_shards
        counted = numbers >= 0
        loss = jnp.sum(jnp.where(counted, losses, 0.0)) / jnp.maximum(jnp.sum(counted), 1)
        grad_norm = jax.lax.pmax(carry["grad_norm"], STAGE_AXIS)
        return split.merge(live, view), jax.tree.map(lambda x: x[None], carry), loss, grad_norm

    def _edge_owners(self, carry, micro):
        """Per edge weight, the stage whose copy ``TrainState.params`` shows: the last stage where
        its piece (head, loss) reads the weight, else the first (from a trace of the last piece)."""
        pieces, S = self.plan.pipeline.pieces, self.plan.schedule.stages
        mb = jax.tree.map(lambda b: b[0], micro)
        chunk = jax.tree.map(lambda w: w[0], carry["params"])
        x = jnp.zeros_like(carry["acts"][0])  # (what flows between stages)
        traced = jax.make_jaxpr(lambda edge: pieces.last(edge, chunk, x, mb))(carry["edge"])
        read = {id(v) for eqn in traced.jaxpr.eqns for v in eqn.invars} | {id(v) for v in traced.jaxpr.outvars}
        owners = [S - 1 if id(v) in read else 0 for v in traced.jaxpr.invars]
        return jax.tree.unflatten(jax.tree.structure(carry["edge"]), owners)

    def stream_bytes(self, stream) -> dict[str, int]:
        """Per device, of a stream (abstract or live): the stages' optimizer states, and the rest
        (the edge copies, the weights and inputs stashed for the micro-batches in flight, the
        gradients on their way back, the window's micro-batches)."""
        optimizer = bytes_per_device((stream["opt_state"], stream["edge_opt_state"]))
        return {"optimizer": optimizer, "stream": bytes_per_device(stream) - optimizer}

    def report(self, state: TrainState) -> dict:
        """The schedule's figures for the run's report: per stage, the weight versions it keeps
        and the largest staleness it trained with (updates between a micro-batch's forward and its
        backward there), as measured in the stream."""
        S = self.plan.schedule.stages
        # (gathered to every device first: a stage's devices may belong to another process)
        everywhere = jax.jit(lambda x: x, out_shardings=NamedSharding(self.layout.mesh, PartitionSpec()))
        staleness = np.asarray(everywhere(state.stream["staleness"]).addressable_data(0)).tolist()
        return {"schedule": "pipedream", "stages": S, "microbatches_per_step": self.window.microbatches,
                "weight_versions_kept": [S - s for s in range(S)], "staleness": staleness,
                "staleness_formula": [S - s - 1 for s in range(S)]}



def _chunk(stacked):
    """This device's stacked layers (k, ...) as PipeDream's one chunk (1, k, ...)."""
    return jax.tree.map(lambda x: x[None], stacked)

