"""Sharded data parallelism over the ``fsdp`` axis: ZeRO stages 1, 2 and 3 (= FSDP).

The batch is split over ``fsdp`` as over ``data``; what else is split is the ZeRO stage:

| stage | optimizer state | gradient accumulation buffer | weights |
|-------|-----------------|------------------------------|---------|
| 1     | sharded         | full                         | full    |
| 2     | sharded         | sharded                      | full    |
| 3     | sharded         | sharded                      | sharded |

Sharding means the ``embed`` dim of every weight (all of a Llama's weights have one) over ``fsdp``.
ZeRO-3 gathers each weight just before use and reduce-scatters its gradient (the backward of the
gather); ZeRO-1/2 reduce-scatter the gradients and all-gather the updated weights after the
optimizer step. Either way 2*Psi_b*(N-1)/N bytes per device per step, or 3*Psi_b*(N-1)/N under
ZeRO-3 when weights are gathered again for the backward pass (``regather``).
"""

from jaxpar.errors import SpecError

SHARDED_LOGICAL_AXIS = "embed"
STAGES = (1, 2, 3)


def check_stage(stage: int) -> int:
    if stage not in STAGES:
        raise SpecError(f"ZeRO stage {stage!r} is unknown; use zero=1 (optimizer state), 2 (+gradients) or 3 (+weights, FSDP)")
    return stage


def mappings(stage: int) -> dict[str, bool]:
    """Which of the stored mappings shard ``embed`` over ``fsdp`` at this stage."""
    return {"optimizer": stage >= 1, "grad": stage >= 2, "param": stage >= 3}


def traffic_bytes(psi_bytes: float, n: int, stage: int, regather: bool, microbatches: int = 1) -> float:
    """Analytic bytes per device per step over the ``fsdp`` axis for ``psi_bytes`` of weights."""
    if n == 1:
        return 0.0
    one_pass = psi_bytes * (n - 1) / n
    if stage == 3:
        # every micro-batch gathers (once or twice) and reduce-scatters
        return microbatches * (3 if regather else 2) * one_pass
    reduce_scatters = microbatches if stage == 2 else 1
    return (reduce_scatters + 1) * one_pass  # + the all-gather of updated weights
