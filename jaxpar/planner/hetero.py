"""Plans across device groups of different kinds (a heterogeneous topology).

Every candidate is one mesh over all the groups' chips. One whose outermost axis spans the groups
(``data`` or ``stage`` a multiple of the number of groups, groups of equal size) may give each
group its own share (the others, FSDP over every chip for one, give every chip an equal share):

- ``batch``: each group's data replicas take their own number of sequences (each group's step is
  priced on its own chips at its own speed; the gradient all-reduce crosses the groups' link);
- ``layers``: each group's pipeline stages take their own number of layers (the pipeline runs at
  its slowest stage).

``even`` prices the equal split (what a planner that sees one chip kind would run); ``best_split``
finds the uneven split that minimises the slowest group's step by water-filling: every unit of
work goes to the group whose step grows least, which is optimal for a maximum of steps that grow
with their share (``exhaustive_split`` tries every split, for the tests).

A mixture of experts on two groups may also place its modules on them (HeterMoE: attention on
one group, routers and experts on the other): ``placement.py``.
"""

from __future__ import annotations

import dataclasses
import itertools

from jaxpar.analysis import memory as memory_lib
from jaxpar.planner import cost, space
from jaxpar.planner.pricing import Priced, Pricer

SPLIT_KINDS = ("batch", "layers")


@dataclasses.dataclass(frozen=True, order=True)
class Split:
    kind: str  # "batch", "layers" or "modules"
    shares: tuple[int, ...]  # sequences or layers per group ("modules": attention group, experts group)
    groups: tuple[str, ...]  # the groups' names, in the order of shares

    def describe(self) -> str:
        if self.kind == "modules":
            return f"attention on {self.groups[0]}, experts on {self.groups[1]}"
        unit = "sequences" if self.kind == "batch" else "layers"
        return f"{unit} " + " / ".join(f"{n} on {g}" for n, g in zip(self.shares, self.groups))


def group_views(topology):
    """Each group as a one-kind topology whose slow links are the slower of its own and the groups'."""
    return [dataclasses.replace(topology.group_view(g), dcn_bandwidth=min(g.dcn_bandwidth, topology.group_bandwidth))
            for g in topology.device_groups]


def split_unit(candidate: space.Candidate, kind: str, groups: int) -> int:
    """The smallest share a group can take: whole micro-batches for its replicas, whole layers per stage."""
    d = dict(zip(space.SEARCHED_AXES, candidate.degrees))
    if kind == "batch":
        return d["data"] // groups * d["fsdp"] * d["expert"] * candidate.microbatches
    return d["stage"] // groups


def kinds_for(candidate: space.Candidate, groups: int) -> list[str]:
    return [k for k in SPLIT_KINDS if candidate.degree("data" if k == "batch" else "stage") % groups == 0
            and candidate.degree("data" if k == "batch" else "stage") >= groups]


def _group_priced(pricer: Pricer, candidate: space.Candidate, kind: str, share: int, group: int):
    """(GroupTime, memory, traffic, view) of one group doing ``share`` of the work (cached)."""
    key = (candidate, kind, share, group)
    cache = pricer.__dict__.setdefault("_group_cache", {})
    if key in cache:
        return cache[key]
    p = pricer.problem
    strategy, step = pricer.step(candidate)
    groups = len(p.topology.device_groups)
    view = group_views(p.topology)[group]
    layer_scale = share * groups / p.cfg.layers if kind == "layers" else 1.0  # this group's layers against an even split's
    rows = p.batch if kind == "layers" else share * groups  # priced as if every group took this share
    cfg = p.cfg if kind == "batch" else dataclasses.replace(p.cfg, layers=share * groups)
    traffic = {k: v * (layer_scale if k[1] in step.layout.batch_axes else 1.0)
               for k, v in cost.summed_traffic(step, strategy, rows, p.seq_len, p.cfg).items()}
    memory = {part: b * (layer_scale if part != "logits" else 1.0)
              for part, b in cost.memory(step, p.cfg, rows // step.layout.batch_shards, p.seq_len, p.compute_dtype).items()}
    t = cost.group_time(cfg, rows, p.seq_len, traffic, view, p.topology.num_chips, layout=step.layout,
                        state=memory_lib.zero_table(step), remat=candidate.remat,
                        microbatches=candidate.microbatches, attention=p.attention, compute_dtype=p.compute_dtype,
                        schedule=step.plan.schedule)
    cache[key] = (t, memory, traffic, view)
    return cache[key]


def price_split(pricer: Pricer, candidate: space.Candidate, split: Split) -> Priced:
    """``candidate`` with each group doing its share of ``split``: the plan's step is its slowest
    group's, its memory the fullest group's (against that group's HBM)."""
    per_group = [_group_priced(pricer, candidate, split.kind, share, g) for g, share in enumerate(split.shares)]
    slowest = max(per_group, key=lambda g: g[0].step_s)[0]
    _, memory, traffic, view = max(per_group, key=lambda g: sum(g[1].values()) / g[3].hbm_bytes)
    flops = sum(g[0].model_flops for g in per_group) / len(per_group)
    peak = sum(g[0].peak_flops for g in per_group) / len(per_group)
    groups = tuple((v.name.rsplit("/", 1)[-1], t.step_s, sum(m.values())) for t, m, _, v in per_group)
    return Priced(candidate, slowest.step_s, slowest.compute_s, slowest.exposed_comm_s, slowest.overlapped_comm_s,
                  slowest.bubble_s, memory, view.hbm_bytes, traffic, flops / (peak * slowest.step_s), split, groups)


def _names(pricer: Pricer) -> tuple[str, ...]:
    return tuple(g.name for g in pricer.problem.topology.device_groups)


def _units(pricer: Pricer, candidate: space.Candidate, kind: str) -> tuple[int, int] | None:
    """(unit, units in all) of a split of this kind, None where each group cannot get one."""
    groups = len(pricer.problem.topology.device_groups)
    unit = split_unit(candidate, kind, groups)
    total = pricer.problem.batch if kind == "batch" else pricer.problem.cfg.layers
    return None if total % unit or total // unit < groups else (unit, total // unit)


def even(pricer: Pricer, candidate: space.Candidate, kind: str) -> Priced:
    """The equal split: what a planner that sees one kind of chip runs."""
    groups = len(pricer.problem.topology.device_groups)
    total = pricer.problem.batch if kind == "batch" else pricer.problem.cfg.layers
    return price_split(pricer, candidate, Split(kind, (total // groups,) * groups, _names(pricer)))


def best_split(pricer: Pricer, candidate: space.Candidate, kind: str) -> Priced | None:
    """The split minimising the slowest group's step: shares first in proportion to each group's
    speed (its step at an even share), then one unit at a time moved off the slowest group while
    that shortens the plan's step (optimal for steps that grow with their share)."""
    found = _units(pricer, candidate, kind)
    if found is None:
        return None
    unit, units = found
    groups = len(pricer.problem.topology.device_groups)
    step = lambda g, n: _group_priced(pricer, candidate, kind, n * unit, g)[0].step_s  # noqa: E731
    speed = [1 / step(g, units // groups) for g in range(groups)]
    shares = [max(1, round(units * s / sum(speed))) for s in speed]
    shares[speed.index(max(speed))] += units - sum(shares)
    while True:
        slowest = max(range(groups), key=lambda g: step(g, shares[g]))
        moves = [(max(step(g, shares[g] + (g == h) - (g == slowest)) for g in range(groups)), h)
                 for h in range(groups) if h != slowest and shares[slowest] > 1]
        if not moves or min(moves)[0] >= step(slowest, shares[slowest]):
            break
        h = min(moves)[1]
        shares[slowest] -= 1
        shares[h] += 1
    return price_split(pricer, candidate, Split(kind, tuple(n * unit for n in shares), _names(pricer)))


def exhaustive_split(pricer: Pricer, candidate: space.Candidate, kind: str) -> Priced | None:
    """Every split of whole units (at least one per group), the best by the plans' rank."""
    found = _units(pricer, candidate, kind)
    if found is None:
        return None
    unit, units = found
    groups = len(pricer.problem.topology.device_groups)
    splits = [s for s in itertools.product(range(1, units), repeat=groups) if sum(s) == units]
    priced = [price_split(pricer, candidate, Split(kind, tuple(u * unit for u in s), _names(pricer))) for s in splits]
    return min(priced, key=lambda r: r.rank_key) if priced else None


def price_heterogeneous(pricer: Pricer, candidate: space.Candidate, exhaustive: bool = False) -> Priced | None:
    """``candidate``'s best split over the kinds it can split; a candidate whose outer axes span no
    groups (FSDP over every chip, say) gives every chip an equal share: the even split of its batch."""
    groups = len(pricer.problem.topology.device_groups)
    splitter = exhaustive_split if exhaustive else best_split
    kinds = kinds_for(candidate, groups)
    if not kinds:
        return even(pricer, candidate, "batch") if pricer.problem.batch % groups == 0 else None
    plans = [r for kind in kinds if (r := splitter(pricer, candidate, kind)) is not None]
    return min(plans, key=lambda r: r.rank_key) if plans else None


