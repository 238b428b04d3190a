"""Data parallelism (DP): every device keeps all weights; the batch is split over ``data``.

Gradients are all-reduced over ``data`` once per step: 2*Psi_b*(N-1)/N bytes per device
(ring all-reduce), Psi_b being the bytes of the gradients that cross it.
"""

BATCH_AXES = ("data",)


def grad_allreduce_bytes(psi_bytes: float, n: int) -> float:
    """Bytes one device sends to all-reduce ``psi_bytes`` of gradients over ``n`` replicas."""
    return 2.0 * psi_bytes * (n - 1) / n if n > 1 else 0.0
