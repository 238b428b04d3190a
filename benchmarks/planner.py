"""``jaxpar plan`` on pod-sized problems: the best plans, the search's time, and on the
heterogeneous H100 + A100 cluster the predicted gain of the heterogeneity-aware plan over the best
plan of a planner that sees one kind of chip (that plan run with every group doing an equal share);
for Mixtral-8x7B there, the HeterMoE placement (attention on one group, experts on the other)
against the best plan and the best uneven split (or, where none fits, the lightest).

    python benchmarks/planner.py [--top 3]

Nothing is compiled: every figure is the planner's cost model (jaxpar/planner/cost.py).
"""

from __future__ import annotations

import argparse

from jaxpar import planner
from jaxpar.errors import LayoutError, SpecError
from jaxpar.planner import hetero
from jaxpar.planner.pricing import Pricer, candidates
from jaxpar.topology import load_topology

# (model, topology, sequences per step, tokens per sequence)
PROBLEMS = [
    ("llama2-7b", "v5p-256", 512, 4096),  # 128 chips, 4 sequences per chip
    ("mixtral-8x7b", "v5p-512", 1024, 4096),  # 256 chips, as MaxText's published Mixtral run (seq 4096)
    ("mixtral-8x7b", "gpu-h100-64", 256, 4096),
    ("llama2-7b", "gpu-h100-a100-16", 64, 4096),
    ("llama-1b", "gpu-h100-a100-16", 128, 2048),
    ("mixtral-8x7b", "gpu-h100-a100-16", 64, 4096),  # 4 sequences per chip
]


def uneven_split_line(plans) -> str:
    """The best fitting plan whose shares differ across the groups, or the lightest layout that
    could split them (its outermost axis spans the groups) and by how much it does not fit."""
    uneven = [r for r in plans.ranked if r.split and r.split.kind in hetero.SPLIT_KINDS and len(set(r.split.shares)) > 1]
    if uneven:
        r = uneven[0]
        return f"best uneven split: {r.candidate.describe()} [{r.split.describe()}]: {r.step_s:.4f} s"
    problem, pricer, lightest = plans.problem, Pricer(plans.problem), None
    for c in candidates(problem):
        if hetero.kinds_for(c, len(problem.topology.device_groups)):
            try:
                used = sum(pricer.memory(c).values())
            except (LayoutError, SpecError):
                continue  # a layout the model refuses (a pipeline of a model with a balance loss)
            lightest = min(lightest or (used, c), (used, c))
    if lightest is None:
        return "no uneven split: no layout spans the groups on its outermost axis"
    return (f"no uneven split fits: the lightest layout that spans the groups, {lightest[1].describe()}, needs "
            f"{lightest[0] / 2**30:.2f} GiB per device of {problem.topology.hbm_bytes / 2**30:.2f} GiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=3)
    args = parser.parse_args()
    for model, topology, batch, seq_len in PROBLEMS:
        plans = planner.plan(model, load_topology(topology), batch, seq_len, top=args.top)
        print(planner.format_plans(plans))
        if plans.placements:
            print(uneven_split_line(plans))
        print()


if __name__ == "__main__":
    main()
