"""The main job: train a Llama under a layout on the shipped corpus, and report what it cost.

``run_training`` is what ``jaxpar train`` calls; Python users can call it directly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time

import jax
import numpy as np

from jaxpar.analysis import memory, traffic
from jaxpar.errors import JaxparError
from jaxpar.models import llama
from jaxpar.parallel import build_layout, parse_strategy
from jaxpar.topology import Topology
from jaxpar.train import data
from jaxpar.train.step import TrainConfig, Trainer


@dataclasses.dataclass(frozen=True)
class RunConfig:
    model: str = "tiny"
    strategy: str = "fsdp=4,tensor=2"
    steps: int = 300
    batch_size: int = 16
    seq_len: int = 128
    seed: int = 0
    remat: str = "none"
    train: TrainConfig = TrainConfig()


def model_config(name: str, remat: str = "none") -> llama.LlamaConfig:
    if name not in llama.CONFIGS:
        raise JaxparError(f"unknown model {name!r}; choose one of {', '.join(llama.CONFIGS)}")
    return dataclasses.replace(llama.CONFIGS[name], remat=remat)


def devices_for(topology: Topology):
    """The first ``num_chips`` devices JAX sees, checked against the topology."""
    devices = jax.devices("cpu") if topology.platform == "cpu" else jax.devices()
    if topology.platform != devices[0].platform:
        raise JaxparError(
            f"topology {topology.name!r} is a {topology.platform} topology but JAX sees {devices[0].platform} devices; "
            f"train on the devices you have (e.g. --topology cpu-8) or plan for {topology.name} ahead of time"
        )
    if len(devices) < topology.num_chips:
        raise JaxparError(
            f"topology {topology.name!r} has {topology.num_chips} chips but JAX sees {len(devices)} devices; "
            f"pick a topology with at most {len(devices)} chips"
        )
    return devices[: topology.num_chips]


def run_training(run: RunConfig, topology: Topology, progress=sys.stderr) -> dict:
    """Train and return the report (per-step losses and times, memory, communication)."""
    cfg = model_config(run.model, run.remat)
    devices = devices_for(topology)
    strategy = parse_strategy(run.strategy, len(devices))
    layout = build_layout(strategy, devices, num_slices=topology.num_slices)
    train_cfg = dataclasses.replace(run.train, total_steps=run.steps)
    trainer = Trainer(layout, lambda rngs: llama.Llama(cfg, rngs=rngs), llama.loss_fn, train_cfg)
    tokens, held_out = data.split_corpus(data.corpus_tokens())
    if run.seq_len >= len(held_out):
        raise JaxparError(f"--seq-len {run.seq_len} is longer than the held-out text ({len(held_out)} tokens); use a shorter one")
    trainer.check_batch(np.zeros((run.batch_size, 1)))

    state = trainer.init(run.seed)
    example = trainer.put_batch(data.batch_at(tokens, 0, run.batch_size, run.seq_len, run.seed))
    compiled = trainer.jit_step(example).lower(state, example).compile()
    losses, times = [], []
    bar = _Progress(run.steps, progress) if progress else None
    for step in range(run.steps):
        batch = trainer.put_batch(data.batch_at(tokens, step, run.batch_size, run.seq_len, run.seed))
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        loss = float(metrics["loss"])  # waits for the step: the time below is the step's own
        times.append(time.perf_counter() - start)
        losses.append(loss)
        if bar:
            bar.update(step + 1, loss, run.batch_size * run.seq_len / times[-1])
    if bar:
        bar.close()

    eval_fn = jax.jit(trainer.grad_fn())
    eval_batch = trainer.put_batch(data.batch_at(held_out, 0, run.batch_size, run.seq_len, run.seed))
    held_out_loss = float(eval_fn(state.params, eval_batch)[0])
    steady = times[1:] or times
    tokens_per_s = run.batch_size * run.seq_len / float(np.median(steady))
    measured = memory.measured_memory(trainer, compiled)
    table = memory.zero_table(trainer, strategy.zero_stage)
    comm = traffic.compare(compiled.as_text(), trainer, strategy, (run.batch_size, run.seq_len), cfg)
    flops = cfg.flops_per_token(run.seq_len) * run.batch_size * run.seq_len
    return {
        "model": run.model,
        "num_params": cfg.num_params(),
        "topology": topology.name,
        "strategy": str(strategy),
        "mesh": {k: v for k, v in layout.mesh.shape.items()},
        "steps": run.steps,
        "batch_size": run.batch_size,
        "seq_len": run.seq_len,
        "seed": run.seed,
        "losses": losses,
        "step_times_s": times,
        "held_out_loss": held_out_loss,
        "tokens_per_s": tokens_per_s,
        "model_flops_per_s": flops / float(np.median(steady)),
        "memory": {
            "measured_bytes_per_device": measured,
            "zero_table_bytes_per_device": table,
            "zero_table_bytes_per_param": memory.BYTES_PER_PARAM,
        },
        "communication": comm,
    }


class _Progress:
    """A one-line progress bar: step, loss, tokens/s, time left."""

    def __init__(self, total: int, stream):
        self.total, self.stream, self.start = total, stream, time.perf_counter()
        self.live = hasattr(stream, "isatty") and stream.isatty()

    def update(self, done: int, loss: float, tokens_per_s: float):
        if not self.live and done % max(self.total // 10, 1) and done != self.total:
            return  # in logs, print a line every 10% instead of redrawing
        width = 30
        filled = width * done // self.total
        elapsed = time.perf_counter() - self.start
        left = elapsed / done * (self.total - done)
        line = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} loss {loss:.3f} {tokens_per_s:,.0f} tok/s {left:4.0f}s left"
        self.stream.write(("\r" + line) if self.live else line + "\n")
        self.stream.flush()

    def close(self):
        if self.live:
            self.stream.write("\n")


def write_json_atomically(path: str, payload: dict):
    """Write to a temporary file next to ``path`` and rename it: never a half-written file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".metrics-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=1, default=float)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def format_summary(report: dict) -> str:
    """The human summary printed at the end of ``jaxpar train``."""
    gib = lambda b: f"{b / 2**20:9.3f} MiB"  # noqa: E731
    losses = report["losses"]
    marks = sorted(set([0] + [round(i * (len(losses) - 1) / 9) for i in range(10)]))
    lines = [
        f"model {report['model']} ({report['num_params']:,} params)  topology {report['topology']}  strategy {report['strategy']}",
        "",
        "loss curve (step: loss)",
    ]
    lo, hi = min(losses), max(losses)
    for i in marks:
        bar = "#" * int(1 + 40 * (losses[i] - lo) / max(hi - lo, 1e-9))
        lines.append(f"  {i + 1:5d}: {losses[i]:7.4f} {bar}")
    lines += [
        f"held-out loss {report['held_out_loss']:.4f}",
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
        if kind in ("by_axes", "scalar all-reduce"):
            continue
        lines.append(f"  {kind:22s} {row['count']:7d} {row['measured_bytes']:14,.0f} {row['optimal_bytes']:14,.0f} {row['ratio']:7.3f}")
    scalars = comm["scalar all-reduce"]
    lines.append(f"  {'scalar all-reduce':22s} {scalars['count']:7d} {scalars['measured_bytes']:14,.0f}   (loss, gradient norm)")
    for name, row in comm["by_axes"].items():
        lines.append(f"    {name:32s} x{row['count']:<5d} {row['bytes_per_device']:14,.0f}")
    return "\n".join(lines)
