"""The search over candidates: pruned, or exhaustive for checks.

``search`` walks the candidates ``space.py`` lists, pruned further: memory before time, then
dominance: for a layout without a pipeline, more micro-batches or more recomputation never make a
step faster (nor send less), so once a (remat, micro-batches) fits, the costlier ones are skipped;
``exhaustive`` prices every listed candidate and ranks them the same way. On a heterogeneous
topology each candidate is priced at its best split across the groups (``hetero.py``).
"""

from __future__ import annotations

import math

from jaxpar.errors import LayoutError, SpecError
from jaxpar.parallel.stage import schedules
from jaxpar.planner import hetero, space
from jaxpar.planner.pricing import Priced, Pricer, Problem, candidates

def _priced_or_none(pricer: Pricer, candidate, prune_memory: bool):
    try:
        mem = pricer.memory(candidate)
    except (LayoutError, SpecError, schedules.ScheduleError):
        return None
    topology = pricer.problem.topology
    if topology.is_heterogeneous:
        if prune_memory and sum(mem.values()) > max(g.hbm_bytes for g in topology.device_groups) * len(topology.device_groups):
            return "too big"  # no split takes more than a group's whole share off it
        priced = hetero.price_heterogeneous(pricer, candidate, exhaustive=not prune_memory)
        return "too big" if priced is not None and prune_memory and not priced.fits else priced
    if prune_memory and sum(mem.values()) > topology.hbm_bytes:
        return "too big"
    return pricer.price(candidate, mem)


def exhaustive(problem: Problem, pricer: Pricer | None = None) -> list[Priced]:
    """Every listed candidate priced (nothing skipped for memory or dominance), best first."""
    pricer = pricer or Pricer(problem)
    priced = [r for c in candidates(problem) if isinstance(r := _priced_or_none(pricer, c, False), Priced)]
    return sorted(priced, key=lambda r: r.rank_key)


def search(problem: Problem, pricer: Pricer | None = None) -> list[Priced]:
    """The pruned search (the module doc): the fitting candidates it prices, best first."""
    pricer = pricer or Pricer(problem)
    by_policy: dict = {}
    for c in candidates(problem):
        by_policy.setdefault((c.degrees, c.zero, c.regather), []).append(c)
    priced = []
    for group in by_policy.values():
        if group[0].degree("stage") > 1:  # a pipeline's bubble shrinks with more micro-batches: no dominance
            priced += [r for c in group if isinstance(r := _priced_or_none(pricer, c, True), Priced)]
            continue
        fewest = math.inf  # micro-batches of the first fitting plan with less recomputation
        for remat in space.REMAT_POLICIES:
            for c in sorted((c for c in group if c.remat == remat and c.microbatches < fewest), key=lambda c: c.microbatches):
                result = _priced_or_none(pricer, c, True)
                if result is None:
                    break  # does not divide: neither will more micro-batches of the same layout
                if isinstance(result, Priced):
                    priced.append(result)
                    fewest = c.microbatches
                    break
    return sorted(priced, key=lambda r: r.rank_key)
