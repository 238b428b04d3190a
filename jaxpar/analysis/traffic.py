"""The analytic optimum of a layout's communication per step, by collective kind, and the
comparison with what the compiled program does (``hlo.collectives``).

Composed from each strategy's own formula (jaxpar/parallel/*.py). Psi is the number of weights a
device holds after tensor parallelism; dtypes are the ones the step really uses (weights gathered
in the compute dtype, gradients summed in the reduction dtype).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from jaxpar.analysis import hlo
from jaxpar.analysis.memory import on_gspmd_path, replicated_params, weight_shares
from jaxpar.models import bd3lm
from jaxpar.parallel import STRATEGIES
from jaxpar.parallel.block.blocks import BLOCKS, clean_prefix
from jaxpar.parallel.context.split_attention import FETCH, RING

# Scalar reductions (the loss, the gradient norm for clipping) are not part of any formula.
SCALAR_BYTES = 16


@dataclasses.dataclass(frozen=True)
class TrafficContext:
    """What the strategies' traffic formulas read (``jaxpar.parallel``'s ``traffic(strategy, ctx)``)."""

    layout: object
    mesh: dict  # mesh axis -> degree
    psi: float  # weights one device holds after tensor / expert parallelism and the pipeline divide them
    layer_psi: float  # of which stacked layer weights
    replicated_psi: float  # weights kept whole over tensor (GQA key/value heads), gathered size
    regather: bool  # the layer weights are gathered a second time for the backward pass (regather, a pipeline's recompute)
    compute_bytes: int
    reduce_bytes: int
    stored_bytes: int
    microbatches: int
    batch_shards: int
    batch: int
    length: int  # of the whole sequence
    held_length: int  # positions of a row one device holds (context splits them, block parallelism re-cuts them)
    model: object  # the LlamaConfig, for the activation traffic (None: weights only)
    schedule: object  # the pipeline schedule, or None
    remat: str = "none"  # what the backward pass recomputes (a recomputed forward sends its traffic again)
    # every weight, with the ways each stored mapping splits it (``memory.weight_shares``)
    weights: tuple = ()
    # a block diffusion model's clean keys each noisy block reads (its mask's ``clean_reads``), for
    # clean_kv=fetch's all-to-all; None elsewhere
    clean_reads: object = None
    gspmd: bool = False  # XLA's partitioner places the collectives (``train/gspmd.py``)

    def stored(self, mapping: str, layers: bool | None = None) -> float:
        """Weights one device stores under ``mapping`` (``layers``: only the stacked layer weights,
        or only the others)."""
        return sum(w.stored(mapping) for w in self.weights if layers is None or w.layer == layers)

    def whole_reduced(self) -> float:
        """Weights one device all-reduces the gradients of over data, fsdp_group and fsdp at once:
        those no batch axis splits, in compute or in the optimizer state."""
        batch = set(self.layout.batch_axes)
        return sum(w.stored("optimizer") for w in self.weights
                   if not batch & w.computed_over and not batch & set(w.stored_over["optimizer"]))

    def all_reduced(self, axis: str) -> float:
        """Weights one device all-reduces the gradients of over ``axis``, at the end of the step, as
        the optimizer state splits them: all but those the compute layout or the optimizer state
        splits over ``axis`` (expert parallelism's experts; ZeRO's shards)."""
        return sum(w.stored("optimizer") for w in self.weights if axis not in w.computed_over and axis not in w.stored_over["optimizer"])


def traffic_context(trainer, batch_shape, model_cfg=None) -> TrafficContext:
    layout, cfg = trainer.layout, trainer.cfg
    cb, rb = jnp.dtype(cfg.compute_dtype).itemsize, jnp.dtype(cfg.grad_reduce_dtype).itemsize
    if layout.mesh.devices.flat[0].platform == "cpu":
        cb, rb = max(cb, 4), max(rb, 4)  # XLA:CPU runs bf16 collectives in f32 (GPU and TPU do not)
    weights = tuple(weight_shares(trainer))
    return TrafficContext(
        layout=layout, mesh=dict(layout.mesh.shape), psi=sum(w.psi for w in weights), layer_psi=sum(w.psi for w in weights if w.layer),
        replicated_psi=replicated_params(trainer), regather=bool(trainer.plan.regather or trainer.plan.schedule is not None),
        compute_bytes=cb, reduce_bytes=rb, stored_bytes=4,
        microbatches=cfg.microbatches, batch_shards=layout.batch_shards, batch=batch_shape[0], length=batch_shape[1],
        model=model_cfg, schedule=trainer.plan.schedule, remat=cfg.remat,
        held_length=held_length(layout, batch_shape[1], getattr(model_cfg, "block_size", None)), weights=weights,
        clean_reads=(bd3lm.block_diffusion_mask(batch_shape[1] // 2, model_cfg.block_size, model_cfg.window).blocks.allowed.clean_reads
                     if layout.role(FETCH) and model_cfg is not None else None),
        gspmd=on_gspmd_path(trainer),
    )


def held_length(layout, length: int, block_size: int | None = None) -> int:
    """Positions of a ``length``-token row one device holds: 1/C of them under context parallelism
    over C devices; under block parallelism over P devices as ``blocks.held_places`` cuts
    [x_t ; x_0] (``block_size``: the model's; without it, pure BP's clean half counted whole)."""
    split = math.prod(layout.mesh.shape[a] for a in layout.axes_of("length") if a not in layout.batch_axes)
    ranks = math.prod(layout.mesh.shape[a] for a in layout.role(BLOCKS))
    if ranks == 1:
        return length // split
    ring = math.prod(layout.mesh.shape[a] for a in layout.role(RING))
    if ring == 1:
        return length // 2 // ranks + (length // 2 if block_size is None else clean_prefix(length // 2, block_size))
    return length // 2 // ranks + length // 2 // (ring if layout.role(FETCH) else ranks)


def optimal_traffic_by_axis(trainer, strategy, batch_shape, model_cfg=None) -> dict[tuple[str, str], float]:
    """Bytes per device per step by (collective kind, mesh axis) for this layout: the sum of every
    strategy's own formula.

    ``batch_shape`` = (global batch, sequence length). ``model_cfg`` (a LlamaConfig) adds the
    Megatron activation traffic, which depends on the model's structure.
    """
    ctx = traffic_context(trainer, batch_shape, model_cfg)
    total: dict[tuple[str, str], float] = {}
    for module in STRATEGIES:
        for key, value in module.traffic(strategy, ctx).items():
            total[key] = total.get(key, 0.0) + value
    return total


def optimal_traffic(trainer, strategy, batch_shape, model_cfg=None) -> dict[str, float]:
    """Bytes per device per step by collective kind (summed over axes)."""
    by_kind: dict[str, float] = {}
    for (kind, _), value in optimal_traffic_by_axis(trainer, strategy, batch_shape, model_cfg).items():
        by_kind[kind] = by_kind.get(kind, 0.0) + value
    return by_kind


def compare(compiled_text: str, trainer, strategy, batch_shape, model_cfg=None) -> dict:
    """Measured (from the compiled HLO) against optimal bytes per device per step, by kind.

    Scalar all-reduces (loss, gradient norm) are listed apart; any other collective kind the
    optimum does not call for appears with an optimum of 0.
    """
    cols = hlo.collectives(compiled_text, trainer.layout.mesh)
    scalars = [c for c in cols if c.kind == "all-reduce" and (c.operand_bytes <= SCALAR_BYTES or c.scalars)]
    counted = [c for c in cols if c not in scalars]
    measured = hlo.summarize(counted)
    optimum = optimal_traffic(trainer, strategy, batch_shape, model_cfg)
    batch = set(trainer.layout.batch_axes)
    # without the model's config there is no formula for its activations' collectives (those over
    # an axis that splits something other than the batch): the report says so, with no ratio
    unknown = {c.kind: sorted(set(c.mesh_axes) - batch) for c in counted if set(c.mesh_axes) - batch} if model_cfg is None else {}
    report = {}
    for kind in sorted(set(measured) | set(optimum)):
        m = measured.get(kind, {}).get("bytes_per_device", 0.0)
        o = optimum.get(kind, 0.0)
        report[kind] = {
            "count": measured.get(kind, {}).get("count", 0),
            "measured_bytes": m,
            "optimal_bytes": o,
            "ratio": (m / o) if o else (math.inf if m else 1.0),
        }
        if kind in unknown:
            report[kind] |= {"optimal_bytes": None, "ratio": None,
                             "no_formula": f"it carries activations over {'+'.join(unknown[kind])}; jaxpar has formulas for the "
                                           f"activations of its own model families only"}
    report["scalar all-reduce"] = {"count": sum(c.executions for c in scalars), "measured_bytes": sum(c.bytes_per_step for c in scalars)}
    if trainer.plan.schedule is not None:
        report["note"] = ("the pipeline's collectives inside its per-tick switch are counted in every branch on "
                          "every tick: an upper bound; the optimum counts what the schedule runs")
    report["by_axes"] = {f"{k[0]} over {'+'.join(k[1]) or '-'}": v for k, v in hlo.by_axes(counted).items()}
    return report
