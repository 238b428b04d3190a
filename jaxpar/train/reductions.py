"""The gradient's reductions on the manual path: which mesh axes each weight's gradient is summed
over, where in the step, and the global norm of the result.

Inside the step's ``shard_map`` every device holds its unreduced local gradient, and each batch
axis is summed over exactly once, at the first point where a mapping splits the weight over it:

- axes the weights are stored sharded over (FSDP, ZeRO-3): reduce-scatter, the backward of the
  gather (``rules.gather_params``);
- axes the gradient accumulation buffer is sharded over (ZeRO-2): reduce-scatter per micro-batch;
- axes the optimizer state is sharded over (ZeRO-1): one reduce-scatter at the end;
- the remaining batch axes (DP, HSDP across groups): all-reduce.

The gradient then lies as the optimizer state does; its global norm is summed from those shards
and it is clipped there. ``TrainConfig.grad_sync`` may compress the reductions on the wire
(``grad_sync.py``): those over a compressed axis are then bucketed (the gradients that share a
reduction are summed as one flat float32 vector), and the all-reduces over a compressed axis are
left to the step, which runs them in a second shard_map (see ``step.Trainer``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax.traverse_util import flatten_dict as flatten
from flax.traverse_util import unflatten_dict as nest

from jaxpar.errors import LayoutError
from jaxpar.rules import Layout, varying_axes

# each part of the plan reduces the batch axes that one mapping splits a weight over and the one
# before it does not: (part, from mapping, to mapping)
PARTS = (("gathered", "compute", "param"), ("per_micro", "param", "grad"), ("final", "grad", "optimizer"))


class ReductionPlan(NamedTuple):
    """One weight's reductions: [(dim, mesh axes)] reduce-scattered at each point, then the rest."""

    gathered: list  # by the gather's backward (ZeRO-3), in each micro-batch's backward pass
    per_micro: list  # after each micro-batch (ZeRO-2: the accumulation buffer is sharded)
    final: list  # after the micro-batch loop (ZeRO-1: only the optimizer state is sharded)
    rest: tuple  # all-reduced after the loop (DP, HSDP across groups)

    def scatters(self, which: str) -> list:
        """The reduce-scatters this module runs at ``which``: "micro" or "final"."""
        return self.per_micro if which == "micro" else self.final


def reduction_plan(layout: Layout, names) -> ReductionPlan:
    """The plan of a weight with these (effective) logical names: every axis the tokens are split
    over (``layout.loss_axes``: the batch axes, and the context axes) appears in it once, except
    the axes its compute layout splits it over: each device there computes with other weights
    (expert parallelism's experts), and the exchange that brought it the tokens took their
    cotangents home in the backward pass, so its gradient is whole already."""
    split = {a for n in names for a in layout.axes_of(n)}
    pending = [a for a in layout.loss_axes if a not in split]
    parts: dict[str, list] = {}
    for part, src, dst in PARTS:
        parts[part] = []
        for dim, (before, after) in enumerate(zip(layout.dim_axes(names, src), layout.dim_axes(names, dst))):
            new = tuple(a for a in after if a not in before and a in pending)
            if new:
                parts[part].append((dim, new))
                pending = [a for a in pending if a not in new]
    return ReductionPlan(**parts, rest=tuple(pending))


def reduce(grads, plans: dict, which: str, dtype, sync=None, seed=None, microbatches: int = 1):
    """The reductions at ``which`` ("micro": of each micro-batch's gradient; "final": after the
    loop) of every weight's gradient (a pure dict; ``plans`` by path), summed in ``dtype``;
    float32 out. Under a compressed ``sync`` (``grad_sync.GradSync``, dither ``seed``) see
    ``reduce_compressed``."""
    if sync is not None and (which == "final" or microbatches == 1):  # with k > 1 the per-micro-batch ones stay exact
        return nest(reduce_compressed(flatten(grads), plans, which, sync, seed, dtype))
    return nest({path: reduce_exact(g, plans[path], which, dtype) for path, g in flatten(grads).items()})


def reduce_exact(g, plan: ReductionPlan, which: str, dtype):
    """One weight's reductions at ``which``: its reduce-scatters, then (final) its all-reduce."""
    for dim, axes in plan.scatters(which):
        g = jax.lax.psum_scatter(g.astype(dtype), axes, scatter_dimension=dim, tiled=True)
    if which == "final" and plan.rest:
        g = jax.lax.psum(g.astype(dtype), plan.rest)
    return g.astype(jnp.float32)


def reduce_compressed(flat: dict, plans: dict, which: str, sync, seed, dtype) -> dict:
    """``reduce`` under a compressed sync, on {path: gradient}: each weight's reduce-scatters at
    ``which`` in order, those over a compressed axis bucketed by axes; then (final) the
    all-reduces that stay exact. All-reduces over a compressed axis are left to the caller."""
    todo = {p: list(plans[p].scatters(which)) for p in flat}
    round_ = 0
    while any(todo.values()):
        buckets: dict[tuple, list] = {}
        for path, left in todo.items():
            if left:
                dim, axes = left.pop(0)
                if sync.compresses(axes):  # a bucket per type too: see rules.gather_params
                    buckets.setdefault((axes, tuple(sorted(varying_axes(flat[path])))), []).append((path, dim))
                else:
                    flat[path] = jax.lax.psum_scatter(flat[path].astype(dtype), axes, scatter_dimension=dim, tiled=True)
        for (axes, vma), members in buckets.items():
            shards = sync.reduce_scatter_bucket([(flat[p], dim) for p, dim in members], axes, seed, (which, round_, axes, vma))
            flat.update(zip([p for p, _ in members], shards))
        round_ += 1
    if which == "final":
        for path, g in flat.items():
            rest = plans[path].rest
            if rest and not sync.compresses(rest):
                flat[path] = jax.lax.psum(g.astype(dtype), rest)
    return {p: g.astype(jnp.float32) for p, g in flat.items()}


def all_reduce_buckets(plans: dict, sync, microbatches: int):
    """([(axes, [paths])], other paths): the weights whose final all-reduce ``sync`` compresses,
    grouped by its axes (no sync: none). Refuses a sync that would compress nothing."""
    if sync is None:
        return [], list(plans)
    buckets: dict[tuple, list] = {}
    reductions = []  # axes of every reduction that runs once per step, to check something is compressed
    for path, plan in plans.items():
        if microbatches == 1:  # the gather's backward (ZeRO-3) and ZeRO-2's reduce-scatter run once per step too
            reductions += [axes for _, axes in plan.gathered + plan.per_micro]
        reductions += [axes for _, axes in plan.final] + [plan.rest]
        if plan.rest and sync.compresses(plan.rest):
            buckets.setdefault(plan.rest, []).append(path)
    if not any(sync.compresses(axes) for axes in reductions):
        raise LayoutError(
            f"grad_sync={sync.name!r} would compress nothing: the gradient reductions over {', '.join(sync.axes)} all run "
            f"inside the micro-batch loop (ZeRO-2/3 reduce-scatters; microbatches={microbatches}), and only the reductions "
            f"after it are compressed. Use microbatches=1, zero=1, or grad_sync='exact'"
        )
    bucketed = {p for paths in buckets.values() for p in paths}
    return list(buckets.items()), [p for p in plans if p not in bucketed]


def global_norm(grads, layout: Layout, names: dict, skip=frozenset()):
    """Norm of the whole gradient from its shards (laid out like the optimizer state; ``names``
    by path) but the paths in ``skip``: each shard's squares summed over the axes it is split over
    (once per group of leaves split alike), never over axes it is copied on."""
    by_axes: dict[tuple, jax.Array] = {}
    for path, g in flatten(grads).items():
        if path in skip:
            continue
        axes = tuple(a for dim in layout.dim_axes(names[path], "optimizer") for a in dim)
        by_axes[axes] = by_axes.get(axes, 0.0) + jnp.sum(jnp.square(g))
    total = sum(jax.lax.psum(s, axes) if axes else s for axes, s in by_axes.items())
    return jnp.sqrt(total)


def clip(grads, layout: Layout, names: dict, clip_norm: float, skip=frozenset()):
    """(global norm, gradients clipped to ``clip_norm``; 0: not clipped), inside the manual step;
    the gradients at the paths in ``skip`` (``nn.RuleUpdated`` weights') neither count nor are clipped."""
    norm = global_norm(grads, layout, names, skip)
    return norm, clip_to(grads, norm, clip_norm, skip)


def norm_and_clip(grads, clip_norm: float, skip=frozenset()):
    """``clip`` of gradients XLA lays out (the GSPMD path, data-centric parallel)."""
    norm = optax.tree.norm({path: g for path, g in flatten(grads).items() if path not in skip})
    return norm, clip_to(grads, norm, clip_norm, skip)


def clip_to(grads, norm, clip_norm: float, skip=frozenset()):
    """``grads``, whose global norm is ``norm``, scaled down to norm ``clip_norm`` (0: as they
    are), but the paths in ``skip``. Every path's clipping (optax's clip_by_global_norm divides
    instead, and computes a norm of its own, which on the manual path is a sum across devices:
    ``global_norm``)."""
    if not clip_norm:
        return grads
    scale = jnp.minimum(1.0, clip_norm / jnp.maximum(norm, 1e-30))
    return nest({path: g if path in skip else g * scale for path, g in flatten(grads).items()})
