"""Data parallelism (DP) over ``data``: every device of a group keeps the same weights; the batch is
split over ``data`` (and over every other batch axis: ``fsdp``, ``fsdp_group``).

Gradients are all-reduced over ``data`` once per step, after the reductions inside a group: a ring
all-reduce sends 2*Psi_b*(N-1)/N bytes per device, Psi_b being the bytes of the gradient shard each
device still holds. Under HSDP (``data=R,fsdp=F``: shard inside groups of F on fast links,
replicate across R groups, which may cross DCN) that shard is 1/F of the gradient.
"""

AXES = ("data",)
CROSSES_DCN = True  # light enough traffic for the slow links between slices / nodes
OPTIONS: dict = {}


def check(strategy):
    """Nothing to refuse: any degree works."""


def rules(strategy, compute: dict, stored: dict):
    compute["batch"] = compute["batch"] + AXES


def grad_allreduce_bytes(psi_bytes: float, n: int) -> float:
    """Bytes one device sends to all-reduce ``psi_bytes`` over ``n`` devices (ring)."""
    return 2.0 * psi_bytes * (n - 1) / n if n > 1 else 0.0


def traffic(strategy, ctx) -> dict:
    n = ctx.mesh["data"]
    return {("all-reduce", "data"): grad_allreduce_bytes(ctx.all_reduced("data") * ctx.reduce_bytes, n)} if n > 1 else {}
