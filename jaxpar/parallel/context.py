"""Context parallelism (CP): the sequence split over devices, ``context=N``, with attention across
the split by one of three algorithms (``context_algorithm=``):

- ``ring`` (the default): K/V travel a ring over ``context`` (ring attention; zigzag chunks so a
  causal mask costs every device the same);
- ``all-to-all`` (DeepSpeed-Ulysses): around attention the sequence split becomes a heads split
  over ``context``, so the heads must divide by N;
- ``hybrid`` (USP): ``context=N,context_algorithm=hybrid,a2a=U`` runs the all-to-all inside groups
  of U neighbouring devices (mesh axis ``context_a2a``) and the ring across the N/U groups
  (``context``).

The logical axes ``length`` and ``residual_length`` are split over the context axes (ring major),
so every activation of a block holds 1/N of the positions; the loss and the weights' gradients are
summed over them like over the batch axes (``Layout.loss_axes``). The algorithms and their traffic
are in ``collectives/context_attention.py``; per layer and device, with K/V the layer's key and
value bytes for this device's batch rows over the whole sequence and Q/O its query and output
bytes (compute dtype):

- ring over R devices: forward (R-1)/R x K/V sent by collective-permute; backward (R-1)/R x K/V
  again plus the K/V gradients in float32 going round and home, R/R x K/V x 4 / compute bytes;
- all-to-all over U devices: forward each of q, k, v and the output sends (U-1)/U of its local
  share, (U-1)/U x (Q + K/V + O) / (R x U) in all; backward the same for their cotangents;
- hybrid: both, the ring's with the K/V of 1/U of the heads.

Recomputation (``remat=full`` or ``dots``) runs the all-to-alls of the forward once more; the ring
(a custom VJP whose residuals JAX keeps) it does not.
"""

import math

from jaxpar import attention
from jaxpar.collectives import context_attention
from jaxpar.errors import SpecError
from jaxpar.mesh import divisors
from jaxpar.parallel import data

# jaxpar.attention's op runs the ring or the all-to-all where a layout splits the sequence
attention.register_split_sequence(context_attention.attention)

AXES = ("context", "context_a2a")  # the ring across groups, the all-to-all inside one (neighbours)
CROSSES_DCN = False
ALGORITHMS = ("ring", "all-to-all", "hybrid")


def _algorithm(key: str, text: str) -> str:
    if text not in ALGORITHMS:
        raise SpecError(f"option {key}={text!r}: choose one of {', '.join(ALGORITHMS)}")
    return text


def _degree(key: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise SpecError(f"option {key}={text!r}: give the number of devices of each all-to-all group, e.g. {key}=2") from None


OPTIONS = {"context_algorithm": (_algorithm, "ring"), "a2a": (_degree, 0)}


def reshape(degrees: dict, options: dict) -> dict:
    """``context=N,context_algorithm=hybrid,a2a=U`` -> ``context=N/U`` (ring), ``context_a2a=U``."""
    if options["context_algorithm"] != "hybrid":
        return degrees
    u, n = options["a2a"], degrees["context"]
    if n == 1:
        raise SpecError(no_context_axis("hybrid"))
    groups = [d for d in divisors(n) if 1 < d < n]  # all-to-all group sizes that leave a ring of at least 2
    if u not in groups:
        fix = f"e.g. a2a={groups[-1]}" if groups else f"context={n} has no such divisor: use context_algorithm=ring or all-to-all"
        raise SpecError(f"context_algorithm=hybrid with context={n} needs a2a=U, the size of each all-to-all group: a divisor "
                        f"of {n} strictly between 1 and {n} (the ring runs across the {n}/U groups); got a2a={u or 'nothing'}, "
                        f"{fix}")
    return dict(degrees, context=n // u, context_a2a=u)


def no_context_axis(algorithm: str) -> str:
    """The refusal of an attention algorithm for a sequence the strategy does not split."""
    return (f"context_algorithm={algorithm} (--context-algorithm) chooses how attention crosses a sequence split by "
            f"context=N, but the strategy has no context axis, so it would change nothing; add context=N or drop it")


def check(strategy):
    algorithm = strategy.options["context_algorithm"]
    if "context_algorithm" in strategy.given and strategy.degrees["context"] * strategy.degrees["context_a2a"] == 1:
        raise SpecError(no_context_axis(algorithm))
    if strategy.degrees["context"] * strategy.degrees["context_a2a"] > 1 and strategy.degrees["stage"] > 1 and algorithm != "all-to-all":
        # measured on 8 simulated devices: wrong losses, different from run to run, and a deadlock
        # when only some devices take a branch holding a collective-permute
        raise SpecError(f"context_algorithm={algorithm} with stage={strategy.degrees['stage']}: the ring's collective-permutes would "
                        f"run inside the pipeline's per-tick branch, which the stages take at different ticks, while XLA "
                        f"pairs a collective-permute across every device of the program. Use context_algorithm=all-to-all "
                        f"with a pipeline")
    if strategy.degrees["context_a2a"] > 1 and strategy.options["context_algorithm"] != "hybrid":
        raise SpecError(f"context_a2a is set by the hybrid algorithm: write context=N,context_algorithm=hybrid,a2a=U instead of "
                        f"context_a2a=... in {strategy}")
    if "a2a" in strategy.given and strategy.options["context_algorithm"] != "hybrid":
        raise SpecError(f"a2a= sizes the all-to-all groups of context_algorithm=hybrid, but {strategy} uses "
                        f"{strategy.options['context_algorithm']}; add context_algorithm=hybrid or drop a2a")


def check_attention(implementation: str, ring_axes: tuple[str, ...]):
    """Refuse a kernel the ring would not run: each pair of sequence chunks the ring meets runs
    the blockwise kernel, whose log-sum-exp merges the partial results."""
    if ring_axes and implementation in ("naive", "splash", "cudnn"):
        raise SpecError(f"--attention {implementation} does nothing under the context ring over {'/'.join(ring_axes)}: the ring "
                        f"runs the blockwise kernel on each pair of sequence chunks whatever --attention (their partial "
                        f"results merged by log-sum-exp); use --attention auto or blockwise, or context_algorithm=all-to-all, "
                        f"which runs {implementation} on whole sequences of fewer heads")


def rules(strategy, compute: dict, stored: dict):
    compute["length"] = compute["length"] + AXES
    compute["residual_length"] = compute["residual_length"] + AXES


def attention_axes(strategy) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(ring axes, all-to-all axes) of the strategy's attention."""
    algorithm = strategy.options["context_algorithm"]
    if algorithm == "all-to-all":
        return (), ("context",)
    return ("context",), (("context_a2a",) if algorithm == "hybrid" else ())


def traffic(strategy, ctx) -> dict:
    """Ring and all-to-all bytes per device per step (see the module doc), from the Llama's shapes."""
    layout, model = ctx.layout, ctx.model
    ring = math.prod(ctx.mesh[a] for a in layout.ring_axes)
    a2a = math.prod(ctx.mesh[a] for a in layout.a2a_axes)
    if ring * a2a == 1:
        return {}
    # the weights' gradients are summed over data and the context axes in one all-reduce: what
    # that adds to data's own (``data.traffic``)
    shard = ctx.psi / ctx.grad_shards * ctx.reduce_bytes
    n = ctx.mesh["data"]
    out: dict = {("all-reduce", "context"): data.grad_allreduce_bytes(shard, n * ring * a2a) - data.grad_allreduce_bytes(shard, n)}
    if model is None:
        return out
    t = ctx.mesh["tensor"]
    heads, kv_heads = model.heads // t, max(1, model.kv_heads // t)
    rows = ctx.batch // ctx.batch_shards  # this device's rows, over all micro-batches
    # Recomputation (remat) runs the all-to-alls of a layer's forward again; the ring, a custom
    # VJP, keeps its residuals (measured: the same collective-permutes with and without remat)
    forwards = 1 + (ctx.remat != "none")
    if ring > 1 and not layout.diffusion_fetch:  # (CSBP's fetch instead: parallel/block.py)
        # under CSBP (block parallelism with context) only the clean half of [x_t ; x_0] travels
        travelling = ctx.length // 2 if layout.block_axes else ctx.length
        kv = rows * travelling * kv_heads // a2a * model.head_dim * 2  # elements, whole sequence, the heads held after the all-to-all
        per_layer = 2 * (ring - 1) / ring * kv * ctx.compute_bytes + kv * 4  # forward, backward, + the float32 K/V gradients' R hops
        out[("collective-permute", layout.ring_axes[0])] = model.layers * per_layer
    if a2a > 1:
        local = rows * ctx.length // (ring * a2a) * model.head_dim * ctx.compute_bytes
        moved = (a2a - 1) / a2a * (2 * heads + 2 * kv_heads) * local  # q, out and k, v (or their cotangents)
        out[("all-to-all", layout.a2a_axes[0])] = model.layers * (forwards + 1) * moved
    return out


def memory(strategy, mesh) -> dict:
    return {}
