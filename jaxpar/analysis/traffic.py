"""The analytic optimum of a layout's communication per step, by collective kind, and the
comparison with what the compiled program does (``hlo.collectives``).

Composed from each strategy's own formula (jaxpar/parallel/*.py). Psi is the number of weights a
device holds after tensor parallelism; dtypes are the ones the step really uses (weights gathered
in the compute dtype, gradients summed in the reduction dtype).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jaxpar.analysis import hlo
from jaxpar.analysis.memory import tensor_local_params
from jaxpar.parallel import data, fsdp, hsdp, tensor

# Scalar reductions (the loss, the gradient norm for clipping) are not part of any formula.
SCALAR_BYTES = 16


def _add(total: dict, axis: str, part: dict):
    for kind, value in part.items():
        total[(kind, axis)] = total.get((kind, axis), 0.0) + value


def optimal_traffic_by_axis(trainer, strategy, batch_shape, model_cfg=None) -> dict[tuple[str, str], float]:
    """Bytes per device per step by (collective kind, mesh axis) for this layout.

    ``batch_shape`` = (global batch, sequence length). ``model_cfg`` (a LlamaConfig) adds the
    Megatron activation traffic, which depends on the model's structure.
    """
    mesh, cfg = trainer.layout.mesh.shape, trainer.cfg
    cb, rb = jnp.dtype(cfg.compute_dtype).itemsize, jnp.dtype(cfg.grad_reduce_dtype).itemsize
    if trainer.layout.mesh.devices.flat[0].platform == "cpu":
        cb, rb = max(cb, 4), max(rb, 4)  # XLA:CPU runs bf16 collectives in f32 (GPU and TPU do not)
    psi = tensor_local_params(trainer)
    f, r, t = mesh["fsdp"], mesh["data"], mesh["tensor"]
    total: dict[tuple[str, str], float] = {}
    # a pipeline's backward recomputes each stage's forward, gathering its layers again
    pipelined = trainer.schedule is not None
    regathered = tensor_local_params(trainer, only_layers=True) if strategy.regather or pipelined else 0.0
    _add(total, "fsdp", fsdp.traffic(psi, f, strategy.zero_stage, cfg.microbatches, cb, rb, 4, regathered))
    if r > 1:
        reduced = hsdp.cross_group_bytes(psi * rb, r, f) if f > 1 else data.grad_allreduce_bytes(psi * rb, r)
        _add(total, "data", {"all-reduce": reduced})
    if t > 1 and model_cfg is not None:
        batch, length = batch_shape
        local_tokens = batch // (r * f) * length
        activation = local_tokens * model_cfg.embed * cb
        passes = tensor.activation_passes(model_cfg.layers)
        if strategy.sequence_parallel:
            one_way = passes * activation * (t - 1) / t
            _add(total, "tensor", {"all-gather": one_way, "reduce-scatter": one_way})
            norms = (2 * model_cfg.layers + 1) * model_cfg.embed * rb  # norm-weight gradients summed over tensor
            _add(total, "tensor", {"all-reduce": data.grad_allreduce_bytes(norms, t)})
        else:
            _add(total, "tensor", {"all-reduce": passes * data.grad_allreduce_bytes(activation, t)})
        # vocab-parallel cross-entropy: max, sum of exponentials and target logit per token
        _add(total, "tensor", {"all-reduce": 3 * data.grad_allreduce_bytes(local_tokens * 4, t)})
    if pipelined:
        # ZeRO-3's gathers have reduce-scattered the edge gradients over fsdp before the stage sum
        edge_shards = f if strategy.zero_stage == 3 else 1
        _add(total, "stage", _stage_traffic(trainer, batch_shape, model_cfg, cb, rb, edge_shards))
    return total


def _stage_traffic(trainer, batch_shape, model_cfg, cb: int, rb: int, edge_shards: int) -> dict[str, float]:
    """Over ``stage``: each device sends the output of each forward it runs to the next stage
    and the input gradient of each backward to the previous one (m x chunks of each), and the
    edge weights' gradients (embedding, head; ``edge_shards`` ways split) are summed over the
    stages once."""
    layout, schedule = trainer.layout, trainer.schedule
    out = {}
    if model_cfg is not None:
        batch, length = batch_shape
        ways = lambda name: math.prod(layout.mesh.shape[a] for a in layout.axes_of(name))  # noqa: E731
        rows = batch // (schedule.microbatches * ways("batch"))
        activation = rows * length // ways("residual_length") * model_cfg.embed * cb
        out["collective-permute"] = 2 * schedule.microbatches * schedule.chunks * activation
    edge = tensor_local_params(trainer) - tensor_local_params(trainer, only_layers=True)
    out["all-reduce"] = data.grad_allreduce_bytes(edge / edge_shards * rb, schedule.stages)
    return out


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
    scalars = [c for c in cols if c.kind == "all-reduce" and c.operand_bytes <= SCALAR_BYTES]
    counted = [c for c in cols if c not in scalars]
    measured = hlo.summarize(counted)
    optimum = optimal_traffic(trainer, strategy, batch_shape, model_cfg)
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
    report["scalar all-reduce"] = {"count": sum(c.executions for c in scalars), "measured_bytes": sum(c.bytes_per_step for c in scalars)}
    if trainer.schedule is not None:
        report["note"] = ("the pipeline's collectives inside its per-tick switch are counted in every branch on "
                          "every tick: an upper bound; the optimum counts what the schedule runs")
    report["by_axes"] = {f"{k[0]} over {'+'.join(k[1]) or '-'}": v for k, v in hlo.by_axes(counted).items()}
    return report
