"""Names a program carries in its ops' metadata for the analysis of its compiled text.

A collective inside one branch of a conditional runs only on the loop trips that take that branch,
which the compiled text cannot tell. Where the caller knows it (the SPMD pipeline's branches are
chosen by a static table), it wraps the collective in ``jax.named_scope(branch_runs(n, trips))``,
and ``analysis/hlo.py`` counts the collective ``n`` times per ``trips`` trips of its loop instead
of on every trip. Standard library only: the bottom layer.
"""

from __future__ import annotations

import re

_BRANCH_RUNS = re.compile(r"\bbranch_runs_(\d+)_of_(\d+)\b")


def branch_runs(runs: int, trips: int) -> str:
    """The name scope saying: taken on ``runs`` of its loop's ``trips`` trips."""
    return f"branch_runs_{runs}_of_{trips}"


def read_branch_runs(text: str) -> tuple[int, int] | None:
    """(runs, trips) from an op's metadata text, if it carries the mark."""
    found = _BRANCH_RUNS.search(text)
    return (int(found[1]), int(found[2])) if found else None
