"""Block parallelism (BP) for block diffusion models (``models/bd3lm.py``), ``block=P``.

A BD3-LM reads [x_t ; x_0]: N noisy blocks, each denoised from itself and the clean blocks before
it, and the clean sequence, block-causal. Under BP every device of the ``block`` axis owns N / P
whole noisy blocks of every row of its batch shard, in dual-end pairs (block i with block N-1-i:
a pair sees N+1 blocks' keys whatever i, so every device does the same attention work), and
computes the whole clean half itself: the clean keys and values its blocks read are its own, and
nothing but the weights' gradients crosses ``block``. Which blocks a device owns and how its
share of a row is cut are in ``collectives/block_parallel.py``.

The layout: ``length`` and ``residual_length`` are split over ``block`` (a device holds its
noisy blocks then the clean half: N/P + N blocks of every row), so the loss and the weights'
gradients are summed over ``block`` as over the batch axes (``Layout.loss_axes``); the batch's
rows reach every device of a ``block`` group whole. Per device and step the only traffic is that
gradient all-reduce, which ``block`` joins (a ring all-reduce over data x block instead of data).
The clean half's work is repeated on every device: the price of sending no keys and values.
"""

from jaxpar.errors import SpecError
from jaxpar.parallel import data

AXES = ("block",)
CROSSES_DCN = True  # only the gradient all-reduce crosses it, as over data
OPTIONS: dict = {}


def check(strategy):
    degrees = strategy.degrees
    if degrees["block"] == 1:
        return
    for axis, why in (("stage", "a pipeline's stages would each hold a share of a different row"),
                      ("context", "the clean half sharded over context (CSBP) is not built yet"),
                      ("expert", "a block diffusion model has no experts")):
        if degrees[axis] > 1:
            raise SpecError(f"block={degrees['block']} with {axis}={degrees[axis]}: {why}; drop {axis}= or block=")


def rules(strategy, compute: dict, stored: dict):
    compute["length"] = compute["length"] + AXES
    compute["residual_length"] = compute["residual_length"] + AXES


def traffic(strategy, ctx) -> dict:
    """The gradient all-reduce's bytes that ``block`` adds to the data axes' (and context's)."""
    p = ctx.mesh["block"]
    if p == 1:
        return {}
    shard = ctx.psi / ctx.grad_shards * ctx.reduce_bytes
    n = ctx.mesh["data"] * ctx.mesh["context"] * ctx.mesh["context_a2a"]
    return {("all-reduce", "block"): data.grad_allreduce_bytes(shard, n * p) - data.grad_allreduce_bytes(shard, n)}


def memory(strategy, mesh) -> dict:
    return {}  # every device holds the weights as the other axes split them
