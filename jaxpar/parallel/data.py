"""Data parallelism (DP) over ``data``: every device of a group keeps the same weights; the batch is
split over ``data`` (and over every other batch axis: ``fsdp``, ``fsdp_group``).

Gradients are all-reduced over ``data`` once per step, after the reductions inside a group: a ring
all-reduce sends 2*Psi_b*(N-1)/N bytes per device, Psi_b being the bytes of the gradient shard each
device still holds. Under HSDP (``data=R,fsdp=F``: shard inside groups of F on fast links,
replicate across R groups, which may cross DCN) that shard is 1/F of the gradient.
"""

import math

AXES = ("data",)
ZERO_AXES = ("data", "fsdp_group", "fsdp")  # the axes a weight no batch axis splits is all-reduced over at once
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
    """The gradients' all-reduce over ``data``. A weight no batch axis splits (a bias over a dim
    ZeRO does not split) has its gradient all-reduced once over data, fsdp_group and fsdp together, counted
    under the first. On the GSPMD path a gradient split over another batch axis is reduce-scattered
    over data too and then gathered over it (``train/gspmd.py``): the same bytes as the all-reduce
    of its shard, half of them in each kind. Under PipeDream each micro-batch's update sums its own."""
    n, rb = ctx.mesh["data"], ctx.reduce_bytes
    whole, out = ctx.whole_reduced(), {}
    if n > 1:
        chained = sum(w.stored("grad") for w in ctx.weights if w.stored_over["grad"] and "data" not in w.stored_over["grad"]) if ctx.gspmd else 0.0
        out[("all-reduce", "data")] = grad_allreduce_bytes((ctx.all_reduced("data") - whole - chained) * rb, n)
        if chained:
            out[("reduce-scatter", "data")] = out[("all-gather", "data")] = chained * rb * (n - 1) / n
    axes = [a for a in ctx.layout.batch_axes if a in ZERO_AXES and ctx.mesh[a] > 1]  # (other axes have formulas of their own)
    if axes and whole:
        key = ("all-reduce", axes[0])
        out[key] = out.get(key, 0.0) + grad_allreduce_bytes(whole * rb, math.prod(ctx.mesh[a] for a in axes))
    schedule = ctx.schedule
    if schedule is not None and schedule.asynchronous:  # PipeDream sums each micro-batch's gradient at its update
        out = {key: value * schedule.microbatches for key, value in out.items()}
    return out
