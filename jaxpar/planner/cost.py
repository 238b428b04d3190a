"""The planner's cost model: memory, traffic and step time of one candidate on one kind of chip.

- **Traffic** per device and step, by (collective kind, mesh axis): the strategies' own formulas
  (``jaxpar.analysis.traffic``, the same the report compares with compiled programs), on the
  candidate's layout over stand-in devices.
- **Memory** per device (``memory``): the ZeRO table's weights, gradients and optimizer state
  (``jaxpar.analysis.memory.zero_table``), the gathered weights FSDP keeps for the backward pass
  (all layers', or two layers' under regather), the activations the remat policy saves, one layer's
  working set and the float32 logits. The compiled program's code is not counted.
- **Time**: the roofline (``jaxpar.analysis.roofline.estimate_step``: matmuls at the chip's
  efficiency, attention, HBM-bound parts, collectives split into overlapped and exposed) on the
  model's active weights (``roofline``: a mixture of experts runs top_k of its experts per token), plus a latency
  (alpha) per collective message on each link tier and, for a pipeline, the schedule's bubble, and
  where the topology's stage links are slow (``stage_link_mbps``), the schedule run with its sends
  on them (``stage_link_seconds``).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from jaxpar.analysis import memory as memory_lib
from jaxpar.analysis import overlap
from jaxpar.analysis import roofline
from jaxpar.analysis.traffic import traffic_context
from jaxpar.parallel import STRATEGIES
from jaxpar.parallel.tensor import activation_passes

# Seconds one collective message waits before its first byte moves (alpha of the alpha-beta model;
# the beta is ``roofline.collective_seconds``): a few microseconds on ICI / NVLink, tens across a
# data-centre network (NCCL's and Google's published small-message latencies are of these orders).
ALPHA_S = {"ici": 5e-6, "dcn": 25e-6}
# Collectives on every layer's critical path (their latency is never hidden)
ACTIVATION_AXES = ("tensor", "context", "context_a2a", "expert")


def summed_traffic(step, strategy, batch: int, length: int, cfg) -> dict[tuple[str, str], float]:
    """Bytes per device per step by (kind, axis): every strategy's formula on ``step``'s layout."""
    ctx = traffic_context(step, (batch, length), cfg)
    total: dict[tuple[str, str], float] = {}
    for module in STRATEGIES:
        for key, value in module.traffic(strategy, ctx).items():
            total[key] = total.get(key, 0.0) + value
    return {k: v for k, v in total.items() if v}


def messages(kind: str, axis: str, layers: int, microbatches: int, remat: str) -> int:
    """Collective messages per step over ``axis``: per layer and micro-batch for the layers' own
    collectives (a rerun forward sends its activation collectives again), once for the rest."""
    if axis == "fsdp" and kind in ("all-gather", "reduce-scatter"):
        return layers * microbatches
    if axis in ACTIVATION_AXES:
        reruns = 1 + (remat != "none")
        return layers * microbatches * (activation_passes(1) if axis == "tensor" else 2) * reruns
    if axis == "stage":
        return 2 * microbatches
    return 1


def latency_seconds(traffic: dict, dcn_axes, layers: int, microbatches: int, remat: str) -> tuple[float, float]:
    """(exposed, hidden) alpha seconds: activation collectives and everything over the slow links
    wait on the critical path; the weights' gathers and reductions are hidden behind compute."""
    exposed = hidden = 0.0
    for kind, axis in traffic:
        tier = "dcn" if axis in dcn_axes else "ici"
        seconds = ALPHA_S[tier] * messages(kind, axis, layers, microbatches, remat)
        if tier == "dcn" or axis in ACTIVATION_AXES:
            exposed += seconds
        else:
            hidden += seconds
    return exposed, hidden


@dataclasses.dataclass(frozen=True)
class GroupTime:
    """One device group's step under a candidate, by term (seconds)."""

    compute_s: float  # matmuls, attention, HBM-bound work (the roofline's compute_s)
    overlapped_comm_s: float  # weight gathers and reductions, ring and pipeline sends, hidden latency
    exposed_comm_s: float  # first gather, last reduction, activation collectives, slow links, their latency
    bubble_s: float  # a pipeline's idle share of the compute
    model_flops: float
    peak_flops: float  # all the group's chips

    @property
    def step_s(self) -> float:
        return max(self.compute_s + self.bubble_s, self.overlapped_comm_s) + self.exposed_comm_s


def group_time(cfg, rows: int, length: int, traffic: dict, view, chips: int, *, layout, state: dict, remat: str,
               microbatches: int, attention: str, compute_dtype: str, schedule=None) -> GroupTime:
    """The step of ``chips`` chips of ``view``'s kind running ``cfg``'s layers on ``rows`` sequences;
    ``schedule``: a pipeline's (its bubble, and its sends where ``view`` has slow stage links)."""
    dcn = set(layout.dcn_axes)
    slow = schedule is not None and view.stage_link_bandwidth > 0
    stage_sends = traffic.get(STAGE_SENDS, 0.0) if slow else 0.0
    traffic = {key: sent for key, sent in traffic.items() if not (slow and key == STAGE_SENDS)}  # (priced below)
    rows_in = [(kind, axis, sent, axis in dcn) for (kind, axis), sent in traffic.items()]
    est = roofline.estimate_step(
        cfg, rows, length, rows_in, view, chips, state_bytes=state, batch_axes=layout.batch_axes,
        tensor=layout.mesh.shape["tensor"], recompute=roofline.RECOMPUTE[remat], attention=attention, compute_dtype=compute_dtype)
    layers_here = cfg.layers // layout.mesh.shape["stage"]
    exposed_alpha, hidden_alpha = latency_seconds(traffic, dcn, layers_here, microbatches, remat)
    bubble = schedule.bubble_fraction() if schedule is not None else 0.0
    bubble_s = est.compute_s * bubble / (1 - bubble) if bubble else 0.0
    stage_links_s = stage_link_seconds(schedule, est.compute_s, stage_sends, view) if slow else 0.0
    return GroupTime(est.compute_s, est.overlapped_comm_s + hidden_alpha, est.exposed_comm_s + exposed_alpha + stage_links_s,
                     bubble_s, est.model_flops, chips * view.peak_bf16_flops)


STAGE_SENDS = ("collective-permute", "stage")


def stage_link_seconds(schedule, compute_s: float, sent: float, view) -> float:
    """What slow stage links (``view.stage_link_bandwidth`` / ``stage_link_latency``) add to a
    step: ``schedule`` run with real durations (``analysis.overlap.schedule_exposed``), a forward
    a third of a micro-batch's share of ``compute_s`` (a backward twice it), each send the latency
    plus one micro-batch's activation over the bandwidth. ``sent``: a device's bytes over stage a
    step, the mean over the stages of the 2 m (V - 1) sends between the V virtual stages."""
    m = schedule.microbatches
    per_send = sent * schedule.stages / (2 * m * (schedule.virtual_stages - 1))
    forward_s = compute_s / (3 * m * schedule.chunks)
    send_s = view.stage_link_latency + per_send / view.stage_link_bandwidth
    return overlap.schedule_exposed(schedule, forward_s, 2 * forward_s, send_s)


def memory(step, cfg, rows: int, length: int, compute_dtype: str) -> dict[str, float]:
    """Predicted bytes per device by part (the module doc); their sum is the predicted peak."""
    layout, m = step.layout, step.cfg.microbatches
    shape = layout.mesh.shape
    cb = jnp.dtype(compute_dtype).itemsize
    state = memory_lib.zero_table(step)
    # kept for the backward pass; gathered again instead, only the layer in flight (its working set)
    kept = not (step.plan.regather or step.plan.schedule is not None)
    gathered = _gathered_weights(step) * cb if kept else 0.0
    tokens = rows // m * length  # one micro-batch's tokens on this device
    tokens //= math.prod(shape[a] for a in layout.axes_of("length") if a not in layout.batch_axes) or 1
    layer = layer_activation_bytes(cfg, tokens, shape["tensor"], cb)
    layers = cfg.layers // shape["stage"]
    in_flight = min(m, shape["stage"]) if shape["stage"] > 1 else 1  # a 1F1B stage holds up to `stages` micro-batches
    saved = {"none": layer["kept_by_none"], "dots": layer["matmul_outputs"], "full": layer["input"]}[step.cfg.remat]
    return {
        "parameters": state["parameters"],
        "optimizer": state["optimizer"],
        "gradients": state["gradient_accumulation"] * (2 if m > 1 else 1),  # and an accumulator across micro-batches
        "gathered_weights": gathered,
        "activations": in_flight * layers * saved + layer["all"],  # saved per layer, and one layer's working set
        "logits": LOGIT_COPIES * tokens * cfg.vocab_size / shape["tensor"] * 4,
    }


LOGIT_COPIES = 1.5  # float32 logits and their gradient, one partly in place of the other (calibrated below)


def _gathered_weights(step) -> float:
    """Weights per device of the stacked layers as computed (after tensor, expert and stage split
    them): what FSDP's gathers bring in; 0 when the stored layout is the computed one."""
    layout = step.layout
    stored_split = [a for a in layout.axes_of("embed", "param") if a in layout.batch_axes and layout.mesh.shape[a] > 1]
    if not stored_split:
        return 0.0
    return memory_lib.tensor_local_params(step, only_layers=True)


def layer_activation_bytes(cfg, tokens: int, tensor: int, cb: int) -> dict[str, float]:
    """One layer's activations per device for ``tokens`` tokens: its input (what full remat saves),
    the matmul outputs (what dots saves) and everything its backward pass reads (what none saves)."""
    e, q, kv = cfg.embed, cfg.heads * cfg.head_dim / tensor, max(1, cfg.kv_heads // tensor) * cfg.head_dim
    experts = getattr(cfg, "experts", None)
    hidden = (cfg.top_k + cfg.shared_experts) * cfg.mlp / tensor if experts else cfg.mlp / tensor
    copies = cfg.top_k if experts else 1  # tokens sent to top_k experts are copied
    matmul_outputs = 2 * q + 2 * kv + e + 2 * hidden + copies * e
    every = matmul_outputs + 3 * e + 2 * q + hidden  # norms' inputs and outputs, attention's output, SwiGLU
    # with nothing recomputed the norms and SwiGLU keep their float32 intermediates too: about twice
    # the bytes (measured on XLA:TPU compiles of a 160M Llama, tests/test_planner.py)
    return {"input": tokens * e * cb, "matmul_outputs": tokens * matmul_outputs * cb, "all": tokens * every * cb,
            "kept_by_none": 2 * tokens * every * cb}
