"""``jaxpar plan`` on pod-sized problems: the best plans, the search's time, and on the
heterogeneous H100 + A100 cluster the predicted gain of the heterogeneity-aware plan over the best
plan of a planner that sees one kind of chip (that plan run with every group doing an equal share).

    python benchmarks/planner.py [--top 3]

Nothing is compiled: every figure is the planner's cost model (jaxpar/planner/cost.py).
"""

from __future__ import annotations

import argparse

from jaxpar import planner
from jaxpar.topology import load_topology

# (model, topology, sequences per step, tokens per sequence)
PROBLEMS = [
    ("llama2-7b", "v5p-256", 512, 4096),  # 128 chips, 4 sequences per chip
    ("mixtral-8x7b", "v5p-512", 1024, 4096),  # 256 chips, as MaxText's published Mixtral run (seq 4096)
    ("mixtral-8x7b", "gpu-h100-64", 256, 4096),
    ("llama2-7b", "gpu-h100-a100-16", 64, 4096),
    ("llama-1b", "gpu-h100-a100-16", 128, 2048),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=3)
    args = parser.parse_args()
    for model, topology, batch, seq_len in PROBLEMS:
        plans = planner.plan(model, load_topology(topology), batch, seq_len, top=args.top)
        print(planner.format_plans(plans))
        print()


if __name__ == "__main__":
    main()
