"""Sharded data parallelism over ``fsdp``: ZeRO stages 1, 2 and 3 (= FSDP).

The batch is split over ``fsdp`` as over ``data``; what else is split is the ZeRO stage
(``zero=1|2|3``, default 3):

| stage | optimizer state | gradient accumulation buffer | weights |
|-------|-----------------|------------------------------|---------|
| 1     | sharded         | full                         | full    |
| 2     | sharded         | sharded                      | full    |
| 3     | sharded         | sharded                      | sharded |

Sharding means the ``embed`` dim of every weight (all of a Llama's weights have one) over ``fsdp``.
ZeRO-3 gathers each weight just before use and reduce-scatters its gradient (the backward of the
gather); ZeRO-1/2 reduce-scatter the gradients and all-gather the updated weights after the
optimizer step. Either way 2*Psi_b*(N-1)/N bytes per device per step, or 3*Psi_b*(N-1)/N under
ZeRO-3 when the weights are gathered again for the backward pass (``regather=on``, also what a
pipeline's recompute does).
"""

from jaxpar.errors import SpecError
from jaxpar.mesh import parse_flag

AXES = ("fsdp",)
CROSSES_DCN = False
SHARDED_LOGICAL_AXIS = "embed"
STAGES = (1, 2, 3)
# which stored mappings shard ``embed`` over fsdp, from the stage on (memory kinds named alike)
SHARDED_FROM = {"optimizer": 1, "grad": 2, "param": 3}
MEMORY_KIND = {"optimizer": "optimizer", "grad": "gradient_accumulation", "param": "parameters"}


def _stage(key: str, text: str) -> int:
    try:
        stage = int(text)
    except ValueError:
        stage = None
    if stage not in STAGES:
        raise SpecError(f"zero={text} is not a ZeRO stage; use zero=1 (optimizer state), 2 (+gradients) or 3 (+weights, FSDP)")
    return stage


OPTIONS = {"zero": (_stage, 3), "regather": (parse_flag, False)}  # key -> (parse(key, text), default)


def check(strategy):
    f = strategy.degrees["fsdp"]
    for key in ("zero", "regather"):
        if key in strategy.given and f == 1:
            raise SpecError(f"{key}={strategy.given[key]} acts on the fsdp axis, but strategy {strategy} has fsdp=1; add e.g. fsdp=-1")


def rules(strategy, compute: dict, stored: dict):
    compute["batch"] = compute["batch"] + AXES
    if strategy.degrees["fsdp"] > 1:
        for mapping, first in SHARDED_FROM.items():
            if strategy.options["zero"] >= first:
                rules_ = stored[mapping]  # fsdp major: see hierarchical_zero.rules
                rules_[SHARDED_LOGICAL_AXIS] = AXES + rules_[SHARDED_LOGICAL_AXIS]


def traffic(strategy, ctx) -> dict:
    """Bytes per device per step over ``fsdp`` (n devices) for the ``ctx.psi`` weights a device
    holds after tensor parallelism and the pipeline divide them.

    ZeRO-3 gathers in the compute dtype and reduce-scatters in the reduction dtype each micro-batch,
    gathering ``ctx.regathered`` weights a second time for the backward pass; ZeRO-1/2
    reduce-scatter gradients (ZeRO-2 every micro-batch, ZeRO-1 once) and all-gather the updated
    weights in their stored dtype."""
    n, k = ctx.mesh["fsdp"], ctx.microbatches
    if n == 1:
        return {}
    share = (n - 1) / n
    if strategy.options["zero"] == 3:
        gathered = k * (ctx.psi + ctx.regathered) * share * ctx.compute_bytes
        return {("all-gather", "fsdp"): gathered, ("reduce-scatter", "fsdp"): k * ctx.psi * share * ctx.reduce_bytes}
    reduce_scatters = k if strategy.options["zero"] == 2 else 1
    return {("reduce-scatter", "fsdp"): reduce_scatters * ctx.psi * share * ctx.reduce_bytes,
            ("all-gather", "fsdp"): ctx.psi * share * ctx.stored_bytes}


def memory(strategy, mesh) -> dict:
    """Ways each kind of state is split over ``fsdp`` at this stage."""
    return {MEMORY_KIND[m]: mesh["fsdp"] for m, first in SHARDED_FROM.items() if strategy.options["zero"] >= first}
