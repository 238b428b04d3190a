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
are in this folder's ``split_attention.py``; per layer and device, with K/V the layer's key and
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
from jaxpar.errors import LayoutError, SpecError
from jaxpar.mesh import divisors
from jaxpar.parallel import data
from jaxpar.parallel.base import count_option, option_of
from jaxpar.parallel.context import split_attention
from jaxpar.parallel.context.split_attention import (A2A, FETCH, RING, SHARES, check_heads, local_places, local_sequences, rank_work,
                                                     required_multiple)


def _splits(layout) -> bool:
    """Whether ``layout`` runs attention across a sequence split over devices."""
    return bool(layout.role(RING) or layout.role(A2A))


def _splits_alone(layout) -> bool:
    """Whether the sequence split is context's alone: where another strategy's loss cuts each row
    itself (``SHARES``: block parallelism), that one cuts and checks the batch."""
    return _splits(layout) and not layout.role(SHARES)


# jaxpar.attention's op runs the ring or the all-to-all where a layout splits the sequence
attention.register_split_sequence(split_attention.attention, _splits)

AXES = ("context", "context_a2a")  # the ring across groups, the all-to-all inside one (neighbours)
CROSSES_DCN = False
ALGORITHMS = ("ring", "all-to-all", "hybrid")


OPTIONS = {
    "context_algorithm": (option_of({a: a for a in ALGORITHMS}, f"choose one of {', '.join(ALGORITHMS)}"), "ring"),
    # (checked against the context degree by ``reshape``)
    "a2a": (count_option(lambda n: True, "give the number of devices of each all-to-all group, e.g. a2a=2"), 0),
}


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


def check_run(planned, cfg):
    """Refuse a kernel the ring would not run: each pair of sequence chunks the ring meets runs
    the blockwise kernel, whose log-sum-exp merges the partial results."""
    ring_axes, implementation = planned.role(RING), cfg.attention
    if ring_axes and implementation in ("naive", "splash", "cudnn"):
        raise SpecError(f"--attention {implementation} does nothing under the context ring over {'/'.join(ring_axes)}: the ring "
                        f"runs the blockwise kernel on each pair of sequence chunks whatever --attention (their partial "
                        f"results merged by log-sum-exp); use --attention auto or blockwise, or context_algorithm=all-to-all, "
                        f"which runs {implementation} on whole sequences of fewer heads")


def attention_kernel(layout) -> str | None:
    """The ring runs the blockwise kernel on each pair of chunks, whatever a run asks."""
    return "blockwise" if layout.role(RING) else None


def check_weights(layout, weights: dict):
    if layout.role(A2A):  # the all-to-all splits attention by heads
        check_heads(layout, weights)


def check_calls(layout, calls):
    if _splits(layout) and "attention" not in calls:
        raise LayoutError(
            f"the layout splits the sequence over {'/'.join(layout.axes_of('length'))} (context parallelism), but "
            f"the model never calls jaxpar.attention.attention: attention of its own would see only this device's "
            f"positions. Call jaxpar.attention.attention(q, k, v, mask) in the model, or drop context=")


def manual_only(layout, calls) -> str | None:
    return "context parallelism (context > 1)" if _splits(layout) else None


def check_batch(layout, batch, length):
    """Refuse a batch whose sequence dim the ring's zigzag chunks and the all-to-all groups cannot
    split (``length``: the sequence length where the batch is only a (batch_size, 1) stand-in)."""
    if not _splits_alone(layout):
        return
    where = "/".join(layout.axes_of("length"))
    for key, leaf in (batch.items() if isinstance(batch, dict) else [("tokens", batch)]):
        if len(leaf.shape) < 2:
            raise LayoutError(f"context parallelism splits a batch's sequence dim (dim 1) over {where}, but batch leaf "
                              f"{key!r} has shape {tuple(leaf.shape)}, with no sequence dim: give (batch, length) arrays, "
                              f"or drop context=")
    n = length if length is not None else (next(iter(batch.values())).shape[1] if isinstance(batch, dict) else batch.shape[1] - 1)
    ring, a2a = _size(layout, layout.role(RING)), _size(layout, layout.role(A2A))
    multiple = required_multiple(ring, a2a)
    if n % multiple:
        raise LayoutError(
            f"sequence length {n} does not split over {where}: the ring cuts it into 2 x {ring} zigzag "
            f"chunks and each all-to-all group of {a2a} shares its part, so it must be a multiple of "
            f"{multiple}; use --seq-len {(n // multiple + 1) * multiple}")


def local_batch(layout, batch):
    """This device's positions of each row (the batch reaches every device of a context group whole)."""
    return local_sequences(batch, layout) if _splits_alone(layout) else batch


def runtime_axes(layout) -> tuple[str, ...]:
    return layout.role(RING) + layout.role(A2A)


def places(layout, length: int):
    """This device's places in its rows (as ``local_batch`` cuts them), inside the step's shard_map."""
    return local_places(layout, length) if _splits_alone(layout) else None


def _size(layout, axes) -> int:
    return math.prod(layout.mesh.shape[a] for a in axes)


def report(layout, measured, cfg) -> dict | None:
    """Ring and all-to-all bytes per layer against their formulas, and each device's causal
    attention work (query-key pairs per head and row, whole kernel blocks) with the zigzag, next
    to a contiguous split's."""
    if not _splits_alone(layout):
        return None
    ring, a2a = _size(layout, layout.role(RING)), _size(layout, layout.role(A2A))
    communication = measured.communication
    per_layer = {kind: {"measured_bytes": communication[kind]["measured_bytes"] / cfg.layers,
                        "formula_bytes": communication[kind]["optimal_bytes"] / cfg.layers}
                 for kind in ("collective-permute", "all-to-all") if kind in communication}
    work = rank_work(attention.CAUSAL, measured.length, ring, a2a)
    contiguous = rank_work(attention.CAUSAL, measured.length, ring, a2a, zigzag=False)
    return {"ring": ring, "a2a": a2a, "per_layer": per_layer, "attention_work_per_device": work.tolist(),
            "imbalance": float(work.max() / work.mean()), "contiguous_imbalance": float(contiguous.max() / contiguous.mean())}


def rules(strategy, compute: dict, stored: dict):
    compute["length"] = compute["length"] + AXES
    compute["residual_length"] = compute["residual_length"] + AXES


def summary(section: dict) -> list[str]:
    parts = [f"{name} over {section[key]} devices" for name, key in (("ring", "ring"), ("all-to-all", "a2a")) if section[key] > 1]
    lines = ["", f"context parallelism: {' and '.join(parts)}; per layer and device"]
    for kind, row in section["per_layer"].items():
        lines.append(f"  {kind:22s} {row['measured_bytes']:14,.0f} bytes   formula {row['formula_bytes']:14,.0f}")
    lines.append(f"  causal attention work per device, max / mean: {section['imbalance']:.3f} with the zigzag "
                 f"({section['contiguous_imbalance']:.3f} for contiguous chunks)")
    return lines


def roles(strategy) -> dict[str, tuple[str, ...]]:
    """The ring's axes and the all-to-all's, by the strategy's algorithm."""
    algorithm = strategy.options["context_algorithm"]
    if algorithm == "all-to-all":
        return {A2A: ("context",)}
    return {RING: ("context",), A2A: ("context_a2a",) if algorithm == "hybrid" else ()}


def traffic(strategy, ctx) -> dict:
    """Ring and all-to-all bytes per device per step (see the module doc), from the Llama's shapes."""
    layout, model = ctx.layout, ctx.model
    ring = math.prod(ctx.mesh[a] for a in layout.role(RING))
    a2a = math.prod(ctx.mesh[a] for a in layout.role(A2A))
    if ring * a2a == 1:
        return {}
    # the weights' gradients are summed over data and the context axes in one all-reduce: what
    # that adds to data's own (``data.traffic``)
    shard = ctx.all_reduced("context") * ctx.reduce_bytes
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
    if ring > 1 and not layout.role(FETCH):  # (CSBP's fetch instead: parallel/block)
        # under CSBP (block parallelism with context) only the clean half of [x_t ; x_0] travels
        travelling = ctx.length if _splits_alone(layout) else ctx.length // 2
        kv = rows * travelling * kv_heads // a2a * model.head_dim * 2  # elements, whole sequence, the heads held after the all-to-all
        per_layer = 2 * (ring - 1) / ring * kv * ctx.compute_bytes + kv * 4  # forward, backward, + the float32 K/V gradients' R hops
        out[("collective-permute", layout.role(RING)[0])] = model.layers * per_layer
    if a2a > 1:
        local = rows * ctx.length // (ring * a2a) * model.head_dim * ctx.compute_bytes
        moved = (a2a - 1) / a2a * (2 * heads + 2 * kv_heads) * local  # q, out and k, v (or their cotangents)
        out[("all-to-all", layout.role(A2A)[0])] = model.layers * (forwards + 1) * moved
    return out

