"""``jaxpar bench``: every strategy on the same model and devices, side by side.

For each strategy: median step time, tokens/s, collective bytes per device against the analytic
optimum, and per-device memory against the ZeRO table, as a table and as JSON. Figures from one
run are comparable with each other (same machine, same moment); across machines compare ratios.
"""

from __future__ import annotations

import dataclasses
import sys
import time

from jaxpar.errors import JaxparError
from jaxpar.report import step_report
from jaxpar.topology import Topology
from jaxpar.run import RunConfig, build_trainer, check_at_least, check_run, run_training

STRATEGIES = (
    "data=8",
    "fsdp=8",
    "fsdp=8,regather=on",
    "fsdp=8,zero=1",
    "fsdp=8,zero=2",
    "data=2,fsdp=4",
    "data=2,tensor=4",
    "data=2,tensor=4,sp=on",
    "fsdp=4,tensor=2",
    "data=2,fsdp=2,tensor=2",
)


def parse_strategies(text: str) -> list[str]:
    """``"data=8;fsdp=8"`` -> ``["data=8", "fsdp=8"]``; an empty entry is refused."""
    entries = [entry.strip() for entry in text.split(";")]
    empty = [i for i, entry in enumerate(entries, 1) if not entry]
    if empty:
        raise JaxparError(
            f"--strategies {text!r}: entry {empty[0]} of {len(entries)} is empty; give strategies separated by ';', "
            f"e.g. --strategies 'data=8;fsdp=8'"
        )
    return entries


def bench(run: RunConfig, topology: Topology, strategies=STRATEGIES, progress=sys.stderr) -> list[dict]:
    """Run ``run`` under each strategy. Every strategy is checked before the first one runs, so
    that a typo in the last entry is not found after the others have taken their time."""
    check_at_least("--steps", run.steps, 2, " per strategy, since the first step (which compiles) is not timed")
    check_run(run)
    for text in strategies:
        build_trainer(dataclasses.replace(run, strategy=text), topology)  # allocates nothing
    rows = []
    for index, text in enumerate(strategies, 1):
        start = time.perf_counter()
        # catch_signals=False: Ctrl-C stops the whole benchmark, not just this strategy's run
        report = run_training(dataclasses.replace(run, strategy=text), topology, progress=None, catch_signals=False,
                              analyze=step_report)
        if progress:
            progress.write(f"[{index}/{len(strategies)}] {text}: {time.perf_counter() - start:.0f} s (compile, {run.steps} steps, analysis)\n")
            progress.flush()
        comm = {k: v for k, v in report["communication"].items() if k not in ("by_axes", "scalar all-reduce", "note")}
        measured = report["memory"]["measured_bytes_per_device"]
        table = report["memory"]["zero_table_bytes_per_device"]
        rows.append({
            "strategy": report["strategy"],
            "step_time_s": sorted(report["step_times_s"][1:] or report["step_times_s"])[len(report["step_times_s"][1:]) // 2],
            "tokens_per_s": report["tokens_per_s"],
            "collective_bytes": sum(v["measured_bytes"] for v in comm.values()),
            "optimal_bytes": sum(v["optimal_bytes"] for v in comm.values()),
            "memory_bytes": sum(measured[k] for k in table),
            "zero_table_bytes": sum(table.values()),
            "temporaries_bytes": measured["temporaries"],
        })
    return rows


def format_table(rows: list[dict]) -> str:
    head = f"{'strategy':28s} {'step ms':>8s} {'tok/s':>8s} {'comm MiB':>9s} {'/optimum':>8s} {'state MiB':>9s} {'/ZeRO':>6s} {'temp MiB':>8s}"
    lines = [head]
    for r in rows:
        ratio = r["collective_bytes"] / r["optimal_bytes"] if r["optimal_bytes"] else float("nan")
        lines.append(
            f"{r['strategy']:28s} {1e3 * r['step_time_s']:8.1f} {r['tokens_per_s']:8.0f} {r['collective_bytes'] / 2**20:9.2f} "
            f"{ratio:8.3f} {r['memory_bytes'] / 2**20:9.2f} {r['memory_bytes'] / r['zero_table_bytes']:6.3f} {r['temporaries_bytes'] / 2**20:8.2f}"
        )
    return "\n".join(lines)
