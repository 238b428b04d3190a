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
        raise SpecError(f"zero={stage!r} is not a ZeRO stage; use zero=1 (optimizer state), 2 (+gradients) or 3 (+weights, FSDP)")
    return stage


def mappings(stage: int) -> dict[str, bool]:
    """Which of the stored mappings shard ``embed`` over ``fsdp`` at this stage."""
    return {"optimizer": stage >= 1, "grad": stage >= 2, "param": stage >= 3}


def traffic(psi: float, n: int, stage: int, microbatches: int, compute_bytes: int, reduce_bytes: int, stored_bytes: int, regathered_psi: float = 0.0) -> dict[str, float]:
    """Analytic bytes per device per step over ``fsdp`` (n devices) for ``psi`` weights, by collective.

    ZeRO-3 gathers in the compute dtype and reduce-scatters in the reduction dtype each micro-batch,
    gathering ``regathered_psi`` of the weights a second time for the backward pass; ZeRO-1/2
    reduce-scatter gradients (ZeRO-2 every micro-batch, ZeRO-1 once) and all-gather the updated
    weights in their stored dtype.
    """
    if n == 1:
        return {}
    share = (n - 1) / n
    if stage == 3:
        gathered = microbatches * (psi + regathered_psi) * share * compute_bytes
        return {"all-gather": gathered, "reduce-scatter": microbatches * psi * share * reduce_bytes}
    reduce_scatters = microbatches if stage == 2 else 1
    return {"reduce-scatter": reduce_scatters * psi * share * reduce_bytes, "all-gather": psi * share * stored_bytes}
