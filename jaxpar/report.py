"""The main job's report, the parts read off the compiled step, and the summary ``jaxpar train``
prints.

``jaxpar.run.run_training`` trains and reports losses, times and checkpoints; train/ reads
no compiled program. Given ``analyze=step_report`` it adds what the analysis measures on the
compiled step: memory per device against the ZeRO table, and the step's collectives against the
analytic optimum. ``jaxpar train`` and ``jaxpar bench`` report both.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jaxpar.analysis import hlo, memory, traffic
from jaxpar.models import family_of, model_config
from jaxpar.parallel import STRATEGIES
from jaxpar.run import interruption_message
from jaxpar.train.step import nonfinite_message


@dataclasses.dataclass
class Measured:
    """What a strategy's report section reads off the compiled step (``base.report``): the
    ``communication`` field, the model's sequence ``length``, the strategies' formulas by
    (collective kind, mesh axis) (``optimum``), and, read on first use, the step's ``collectives``
    and its layer loops' ``blocking`` collectives (``analysis/hlo.py``)."""

    hlo_text: str
    mesh: object
    communication: dict
    length: int
    optimum: dict = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def collectives(self) -> list:
        return hlo.collectives(self.hlo_text, self.mesh)

    @functools.cached_property
    def blocking(self) -> list:
        return hlo.blocking_collectives(self.hlo_text)


def step_report(trainer, compiled, strategy, cfg, batch_shape: tuple[int, int]) -> dict:
    """The report's ``memory`` and ``communication`` fields for a run's compiled step: bytes per
    device measured and from the ZeRO table, and collectives per step against the optimum
    (``run_training``'s ``analyze``), and each strategy's own section."""
    report = {
        "memory": {
            "measured_bytes_per_device": memory.measured_memory(trainer, compiled),
            "zero_table_bytes_per_device": memory.zero_table(trainer),
            "zero_table_bytes_per_param": memory.BYTES_PER_PARAM,
        },
        "communication": traffic.compare(compiled.as_text(), trainer, strategy, batch_shape, cfg),
    }
    measured = Measured(compiled.as_text(), trainer.layout.mesh, report["communication"], batch_shape[1],
                        traffic.optimal_traffic_by_axis(trainer, strategy, batch_shape, cfg))
    for module in STRATEGIES:
        section = module.report(trainer.layout, measured, cfg)
        if section is not None:
            report[module.name] = section
    return report


def format_summary(report: dict) -> str:
    """The human summary printed at the end of ``jaxpar train``, of a report with ``step_report``'s
    fields."""
    gib = lambda b: f"{b / 2**20:9.3f} MiB"  # noqa: E731
    losses, first = report["losses"], report["start_step"]
    processes = f"  processes {report['processes']}" if report["processes"] > 1 else ""
    lines = [
        f"model {report['model']} ({report['num_params']:,} params)  topology {report['topology']}  strategy {report['strategy']}{processes}",
        f"path {report['path']['name']}: {report['path']['reason']}",
        f"FSDP: {'regather' if report['fsdp_policy']['regather'] else 'keep'} ({report['fsdp_policy']['reason']})",
        "",
        f"loss curve (step: loss){f', resumed after step {first}' if first else ''}",
    ]
    if losses:
        finite = [x for x in losses if np.isfinite(x)] or [0.0]
        lo, hi = min(finite), max(finite)
        for i in sorted(set([0] + [round(i * (len(losses) - 1) / 9) for i in range(10)])):
            bar = "#" * int(1 + 40 * (losses[i] - lo) / max(hi - lo, 1e-9)) if np.isfinite(losses[i]) else ""
            lines.append(f"  {report['first_loss_step'] + i:5d}: {losses[i]:7.4f} {bar}")
    else:
        lines.append(f"  (none: the checkpoint is already at step {first} of {report['steps']})")
    if report.get("nonfinite"):
        bad = report["nonfinite"]
        lines.append(nonfinite_message(bad["step"], bad["loss"], bad["grad_norm"], bad.get("cause")))
    sync = report.get("grad_sync") or {"name": "exact"}
    if sync["name"] != "exact":
        bits = f", {sync['bits']} bits" if sync["bits"] is not None else ""
        lines.append(f"gradient sync {sync['name']} over {'+'.join(sync['axes'])}{bits} (the traffic optimum below is for exact sync)")
    if report.get("pipedream"):
        stream = report["pipedream"]
        lines.append(f"PipeDream: {stream['microbatches_per_step']} micro-batches a step, never flushed; each stage trained "
                     f"with weights up to {stream['staleness']} updates old (S - s - 1: {stream['staleness_formula']}), "
                     f"keeping {stream['weight_versions_kept']} weight versions")
    if report["checkpoints"]:
        pauses = report["checkpoints"]["save_pause_s"]
        pause = f"; training paused {1000 * float(np.median(pauses)):.0f} ms per save (median)" if pauses else ""
        lines.append(f"checkpoints {report['checkpoints']['steps']} in {report['checkpoints']['directory']}{pause}")
    if report["interrupted"]:
        lines.append(interruption_message(report))
    else:
        series = report.get("held_out_losses") or []
        along = f" (on the way: {', '.join(f'step {s} {loss:.4f}' for s, loss in series[-6:])})" if series else ""
        lines.append(f"held-out loss {report['held_out_loss']:.4f}{along}")
    lines += [
        f"throughput {report['tokens_per_s']:,.0f} tokens/s (median step; compile excluded)",
        "",
        "memory per device          measured      ZeRO table",
    ]
    measured = report["memory"]["measured_bytes_per_device"]
    table = report["memory"]["zero_table_bytes_per_device"]
    for kind in ("parameters", "gradient_accumulation", "optimizer"):
        lines.append(f"  {kind:22s} {gib(measured[kind])}  {gib(table[kind])}")
    for kind in ("pipedream_stream", "temporaries", "arguments", "generated_code"):
        if kind in measured:  # (PipeDream's stashes and micro-batches in flight: only under --schedule pipedream)
            lines.append(f"  {kind:22s} {gib(measured[kind])}")
    lines += ["", "collectives per step       count   bytes/device        optimum   ratio"]
    comm = report["communication"]
    for kind, row in comm.items():
        if kind in ("by_axes", "scalar all-reduce", "note"):
            continue
        optimum = f"{row['optimal_bytes']:14,.0f} {row['ratio']:7.3f}" if row["ratio"] is not None else f"{'no formula':>14s}"
        lines.append(f"  {kind:22s} {row['count']:7d} {row['measured_bytes']:14,.0f} {optimum}")
    scalars = comm["scalar all-reduce"]
    lines.append(f"  {'scalar all-reduce':22s} {scalars['count']:7d} {scalars['measured_bytes']:14,.0f}   (loss, gradient norm)")
    for name, row in comm["by_axes"].items():
        lines.append(f"    {name:32s} x{row['count']:<5d} {row['bytes_per_device']:14,.0f}")
    if "note" in comm:
        lines.append(f"  ({comm['note']})")
    for module in STRATEGIES:
        if module.name in report:
            lines += module.summary(report[module.name])
    if "batch_report" in report:  # the model family's own section (a mixture of experts' routing)
        lines += family_of(model_config(report["model"])).summary(report["batch_report"])
    return "\n".join(lines)
