"""The main job's report, the parts read off the compiled step, and the summary ``jaxpar train``
prints.

``jaxpar.run.run_training`` trains and reports losses, times and checkpoints; train/ reads
no compiled program. Given ``analyze=step_report`` it adds what the analysis measures on the
compiled step: memory per device against the ZeRO table, and the step's collectives against the
analytic optimum. ``jaxpar train`` and ``jaxpar bench`` report both.
"""

from __future__ import annotations

import numpy as np

from jaxpar.analysis import hlo, memory, traffic
from jaxpar.attention import CAUSAL
from jaxpar.collectives import block_parallel, context_attention
from jaxpar.run import interruption_message
from jaxpar.train.step import nonfinite_message


def step_report(trainer, compiled, strategy, cfg, batch_shape: tuple[int, int]) -> dict:
    """The report's ``memory`` and ``communication`` fields for a run's compiled step: bytes per
    device measured and from the ZeRO table, and collectives per step against the optimum
    (``run_training``'s ``analyze``)."""
    report = {
        "memory": {
            "measured_bytes_per_device": memory.measured_memory(trainer, compiled),
            "zero_table_bytes_per_device": memory.zero_table(trainer, strategy),
            "zero_table_bytes_per_param": memory.BYTES_PER_PARAM,
        },
        "communication": traffic.compare(compiled.as_text(), trainer, strategy, batch_shape, cfg),
    }
    layout = trainer.layout
    if layout.block_axes:
        cols = hlo.collectives(compiled.as_text(), layout.mesh)
        report["block"] = block_report(layout, cols, report["communication"], batch_shape[1], cfg)
    elif layout.ring_axes or layout.a2a_axes:
        report["context"] = context_report(layout, report["communication"], batch_shape[1], cfg)
    if layout.axes_of("heads"):
        section = tensor_report(layout, compiled.as_text(), cfg)
        if section is not None:
            report["tensor"] = section
    return report


def tensor_report(layout, hlo_text: str, cfg) -> dict:
    """Tensor parallelism's part of the report: per layer of the forward pass, the all-reduces
    over the tensor axes and how many of them are blocking (no matmul can run while one is in
    flight: ``hlo.blocking_collectives``); Megatron TP has 2, delayed TP (``delay=1``) 0. None where
    the program has no loop over all the layers (a pipeline's stages each run a part)."""
    forward = [loop for loop in hlo.blocking_collectives(hlo_text)
               if "transpose" not in loop["op_name"] and loop["trips"] == cfg.layers]
    if not forward:  # no loop over the layers (a pipeline splits them): no count rather than a wrong 0
        return None
    return {"delayed": bool(layout.delay_axes), "axes": list(layout.axes_of("heads")),
            "all_reduces_per_layer": max((loop["collectives"] for loop in forward), default=0),
            "blocking_per_layer": max((loop["blocking"] for loop in forward), default=0)}


def block_report(layout, cols, communication: dict, length: int, cfg) -> dict:
    """Block parallelism's part of the report (``cols``: the step's collectives; ``length``: the
    model's 2L): the clean keys and values the context ring carries per layer against the formula,
    the bytes of every other collective over the block axes but the gradient all-reduce (noisy keys
    and values never travel: 0), and each device's attention work."""
    size = lambda axes: int(np.prod([layout.mesh.shape[a] for a in axes]))  # noqa: E731
    ranks, ring = size(layout.block_axes), size(layout.ring_axes)
    moved = "all-to-all" if layout.diffusion_fetch else "collective-permute"  # the fetch, or the ring
    clean = communication.get(moved, {"measured_bytes": 0.0, "optimal_bytes": 0.0})
    clean_ring = (moved, tuple(layout.ring_axes))
    others = sum(c.bytes_per_step for c in cols if set(c.mesh_axes) & set(layout.block_axes)
                 and c.kind != "all-reduce" and (c.kind, c.mesh_axes) != clean_ring)
    work = block_parallel.attention_work(length // 2, cfg.block_size, ranks, ring, cfg.window, layout.diffusion_fetch)
    return {"ranks": ranks, "ring": ring, "noisy_blocks_per_device": length // 2 // cfg.block_size // ranks,
            "clean_kv": "fetched in one all-to-all" if layout.diffusion_fetch else "on the ring",
            "clean_kv_per_layer": {"measured_bytes": clean["measured_bytes"] / cfg.layers,
                                   "formula_bytes": clean["optimal_bytes"] / cfg.layers},
            "other_bytes_over_block_axes": others, "attention_work_per_device": work.tolist(),
            "imbalance": float(work.max() / work.mean())}


def context_report(layout, communication: dict, length: int, cfg) -> dict:
    """Context parallelism's part of the report: ring and all-to-all bytes per layer against
    their formulas, and each device's causal attention work (query-key pairs per head and row,
    whole kernel blocks) with the zigzag, next to a contiguous split's."""
    size = lambda axes: int(np.prod([layout.mesh.shape[a] for a in axes]))  # noqa: E731
    ring, a2a = size(layout.ring_axes), size(layout.a2a_axes)
    per_layer = {kind: {"measured_bytes": communication[kind]["measured_bytes"] / cfg.layers,
                        "formula_bytes": communication[kind]["optimal_bytes"] / cfg.layers}
                 for kind in ("collective-permute", "all-to-all") if kind in communication}
    work = context_attention.rank_work(CAUSAL, length, ring, a2a)
    contiguous = context_attention.rank_work(CAUSAL, length, ring, a2a, zigzag=False)
    return {"ring": ring, "a2a": a2a, "per_layer": per_layer, "attention_work_per_device": work.tolist(),
            "imbalance": float(work.max() / work.mean()), "contiguous_imbalance": float(contiguous.max() / contiguous.mean())}


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
        lines.append(nonfinite_message(bad["step"], bad["loss"], bad["grad_norm"]))
    sync = report.get("grad_sync") or {"name": "exact"}
    if sync["name"] != "exact":
        bits = f", {sync['bits']} bits" if sync["bits"] is not None else ""
        lines.append(f"gradient sync {sync['name']} over {'+'.join(sync['axes'])}{bits} (the traffic optimum below is for exact sync)")
    if report["checkpoints"]:
        pauses = report["checkpoints"]["save_pause_s"]
        pause = f"; training paused {1000 * float(np.median(pauses)):.0f} ms per save (median)" if pauses else ""
        lines.append(f"checkpoints {report['checkpoints']['steps']} in {report['checkpoints']['directory']}{pause}")
    if report["interrupted"]:
        lines.append(interruption_message(report))
    else:
        lines.append(f"held-out loss {report['held_out_loss']:.4f}")
    lines += [
        f"throughput {report['tokens_per_s']:,.0f} tokens/s (median step; compile excluded)",
        "",
        "memory per device          measured      ZeRO table",
    ]
    measured = report["memory"]["measured_bytes_per_device"]
    table = report["memory"]["zero_table_bytes_per_device"]
    for kind in ("parameters", "gradient_accumulation", "optimizer"):
        lines.append(f"  {kind:22s} {gib(measured[kind])}  {gib(table[kind])}")
    for kind in ("temporaries", "arguments", "generated_code"):
        lines.append(f"  {kind:22s} {gib(measured[kind])}")
    lines += ["", "collectives per step       count   bytes/device        optimum   ratio"]
    comm = report["communication"]
    for kind, row in comm.items():
        if kind in ("by_axes", "scalar all-reduce", "note"):
            continue
        lines.append(f"  {kind:22s} {row['count']:7d} {row['measured_bytes']:14,.0f} {row['optimal_bytes']:14,.0f} {row['ratio']:7.3f}")
    scalars = comm["scalar all-reduce"]
    lines.append(f"  {'scalar all-reduce':22s} {scalars['count']:7d} {scalars['measured_bytes']:14,.0f}   (loss, gradient norm)")
    for name, row in comm["by_axes"].items():
        lines.append(f"    {name:32s} x{row['count']:<5d} {row['bytes_per_device']:14,.0f}")
    if "note" in comm:
        lines.append(f"  ({comm['note']})")
    if "context" in report:
        ctx = report["context"]
        parts = [f"{name} over {ctx[key]} devices" for name, key in (("ring", "ring"), ("all-to-all", "a2a")) if ctx[key] > 1]
        lines += ["", f"context parallelism: {' and '.join(parts)}; per layer and device"]
        for kind, row in ctx["per_layer"].items():
            lines.append(f"  {kind:22s} {row['measured_bytes']:14,.0f} bytes   formula {row['formula_bytes']:14,.0f}")
        lines.append(f"  causal attention work per device, max / mean: {ctx['imbalance']:.3f} with the zigzag "
                     f"({ctx['contiguous_imbalance']:.3f} for contiguous chunks)")
    if "tensor" in report:
        tp = report["tensor"]
        how = "delayed (delay=1): each sublayer's sum read one sublayer later" if tp["delayed"] else "Megatron"
        lines += ["", f"tensor parallelism over {'/'.join(tp['axes'])}, {how}",
                  f"  per layer, forward: {tp['all_reduces_per_layer']} all-reduces, {tp['blocking_per_layer']} of them blocking "
                  f"(no matmul runs while it is in flight)"]
    if "block" in report:
        bp = report["block"]
        ring = f", the clean half split over {bp['ring']} (CSBP)" if bp["ring"] > 1 else ", the clean half on every device"
        kv = bp["clean_kv_per_layer"]
        lines += ["", f"block parallelism: {bp['noisy_blocks_per_device']} noisy blocks per device of {bp['ranks']}{ring}; per layer and device",
                  f"  clean K/V {bp['clean_kv']:25s} {kv['measured_bytes']:14,.0f} bytes   formula {kv['formula_bytes']:14,.0f}",
                  f"  anything else over the block axes but the gradient all-reduce (noisy K/V stay): {bp['other_bytes_over_block_axes']:,.0f} bytes",
                  f"  attention work per device, max / mean: {bp['imbalance']:.3f}"]
    return "\n".join(lines)
