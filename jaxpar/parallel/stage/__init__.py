"""Pipeline parallelism over ``stage``: each stage stores and runs its own consecutive layers.

The schedules (GPipe, 1F1B, interleaved, eager, PipeDream) are data (``schedules.py``) and one
jitted program runs them (``pipeline.py``). Per step each device sends the output of each forward
it runs to the next stage and the input gradient of each backward to the previous one (m x chunks
of each), and the gradients of the edge weights (embedding, head: on the first and the last stage)
are summed over the stages once. The backward recomputes each stage's forward from its input, so
FSDP gathers the stage's layers a second time.
"""

import math

from jaxpar.errors import LayoutError, SpecError
from jaxpar.parallel import data
from jaxpar.parallel.subspace import SUBSPACE

AXES = ("stage",)
CROSSES_DCN = True
OPTIONS: dict = {}
STAGES = "pipeline_stages"  # the layout's role: the mesh axes the layers are pipelined over


def roles(strategy) -> dict[str, tuple[str, ...]]:
    return {STAGES: AXES}


def ignores(strategy) -> dict[str, str]:
    if strategy.degrees["stage"] > 1:
        return {}
    why = f"strategy {strategy} has no stage axis, so no pipeline runs; drop it or add stage=N to --strategy"
    return {"schedule": why, "chunks": why, "stage_link_mbps": why, "stage_link_latency_ms": why}


def manual_only(layout, calls) -> str | None:
    return "a pipeline (stage > 1)" if layout.role(STAGES) else None


def check_run(planned, cfg) -> None:
    for name, value in (("--stage-link-mbps", cfg.stage_link_mbps), ("--stage-link-latency-ms", cfg.stage_link_latency_ms)):
        if not value >= 0:
            raise SpecError(f"{name} {value}: give a speed or a latency of 0 or more (0: the links as they are)")


def check(strategy):
    """The schedule and the micro-batches are checked when the trainer is built."""


def check_model(strategy, cfg, seq_len: int) -> None:
    """Refuse a model whose layers hand the loss more than the residual stream (a mixture of
    experts' load-balancing losses or routing-bias steps): the stages pass only the stream between them."""
    extras = cfg.layer_extras() if hasattr(cfg, "layer_extras") else None
    if strategy.degrees.get("stage", 1) > 1 and extras:
        raise LayoutError(f"stage={strategy.degrees['stage']}: a pipeline passes only the residual stream between "
                          f"stages, and this model's layers also hand its loss their {extras}; train it pipelined "
                          f"with --balance-weight 0 --bias-rate 0, or without stage=")


def rules(strategy, compute: dict, stored: dict):
    if strategy.degrees["stage"] > 1:
        for rules_ in stored.values():
            rules_["layers"] = rules_["layers"] + AXES


def traffic(strategy, ctx) -> dict:
    schedule = ctx.schedule
    if schedule is None:
        return {}
    out = {}
    if ctx.model is not None:
        layout = ctx.layout
        ways = lambda name: math.prod(layout.mesh.shape[a] for a in layout.axes_of(name))  # noqa: E731
        rows = ctx.batch // (schedule.microbatches * ways("batch"))
        width = layout.settings.get(SUBSPACE) or ctx.model.embed  # a position's values at a boundary
        activation = rows * ctx.length // ways("residual_length") * width * ctx.compute_bytes
        # each of the V - 1 boundaries between virtual stages carries every micro-batch's activation
        # forward and its gradient back; per device, the mean over the S stages
        boundaries = schedule.stages * schedule.chunks - 1
        out[("collective-permute", "stage")] = 2 * schedule.microbatches * boundaries * activation / schedule.stages
    # the gathers' backward has reduce-scattered the edge gradients over the axes weights are stored on
    edge = ctx.stored("param", layers=False)
    out[("all-reduce", "stage")] = data.grad_allreduce_bytes(edge * ctx.reduce_bytes, schedule.stages)
    return out
