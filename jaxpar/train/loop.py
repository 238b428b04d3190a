"""The main job: train a Llama under a layout on the shipped corpus, and report what it cost.

``run_training`` is what ``jaxpar train`` calls; Python users can call it directly.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import tempfile
import time

import jax
import numpy as np

from jaxpar.analysis import memory, traffic
from jaxpar.errors import JaxparError
from jaxpar.launch import report_progress
from jaxpar.models import llama
from jaxpar.parallel import build_layout, parse_strategy, pipeline
from jaxpar.topology import Topology
from jaxpar.train import data
from jaxpar.train.checkpoint import CheckpointConfig, Checkpointer
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
    """The devices to train on, checked against the topology: the first ``num_chips`` devices of
    one process, or all devices of a multi-process job (which must number exactly ``num_chips``)."""
    devices = jax.devices("cpu") if topology.platform == "cpu" else jax.devices()
    if topology.platform != devices[0].platform:
        raise JaxparError(
            f"topology {topology.name!r} is a {topology.platform} topology but JAX sees {devices[0].platform} devices; "
            f"train on the devices you have (e.g. --topology cpu-8) or plan for {topology.name} ahead of time"
        )
    if len(devices) < topology.num_chips or (jax.process_count() > 1 and len(devices) != topology.num_chips):
        per = f" ({jax.process_count()} processes x {jax.local_device_count()})" if jax.process_count() > 1 else ""
        raise JaxparError(
            f"topology {topology.name!r} has {topology.num_chips} chips but JAX sees {len(devices)} devices{per}; "
            f"pick a topology with {len(devices)} chips" + (" (a multi-process job uses every device)" if per else " or fewer")
        )
    return devices[: topology.num_chips]


def build_trainer(run: RunConfig, topology: Topology):
    """(Trainer, parsed strategy, model config) of a run: its Llama under its strategy on the
    topology's devices. Nothing is allocated."""
    cfg = model_config(run.model, run.remat)
    devices = devices_for(topology)
    strategy = parse_strategy(run.strategy, len(devices))
    layout = build_layout(strategy, devices, num_slices=topology.num_slices)
    train_cfg = dataclasses.replace(run.train, total_steps=run.steps)
    trainer = Trainer(layout, lambda rngs: llama.Llama(cfg, rngs=rngs), llama.loss_fn, train_cfg,
                      pipeline=functools.partial(pipeline.llama_pieces, cfg))
    return trainer, strategy, cfg


def _scalar(x) -> float:
    """A replicated scalar as a Python float; works when the array spans several processes."""
    return float(np.asarray(x.addressable_data(0)))


def _start_state(trainer: Trainer, run: RunConfig, ckpt: Checkpointer | None, resume: str, log):
    """(state, first step) of a fresh run or of the checkpoint it resumes."""
    latest = ckpt.latest_step() if ckpt else None
    if latest is None or resume == "never":
        if latest is not None:
            raise JaxparError(
                f"checkpoint directory {ckpt.directory} already holds checkpoints {ckpt.steps()}; pass --resume to "
                "continue from the latest, or choose another --checkpoint-dir (nothing there is overwritten)"
            )
        return trainer.init(run.seed), 0
    state, meta = ckpt.restore(trainer.abstract_state())
    saved = meta["data"]
    changed = [f"{k} {saved[k]} -> {v}" for k, v in _data_position(run, 0).items() if k != "next_step" and saved[k] != v]
    if changed:
        log(f"note: resuming with other data settings ({', '.join(changed)}): later batches differ from the original run's")
    log(f"resuming from checkpoint {meta['step']} in {ckpt.directory} (saved under {meta['strategy']} on {meta['devices']} devices)")
    return state, meta["step"]


def _data_position(run: RunConfig, next_step: int) -> dict:
    return {"seed": run.seed, "batch_size": run.batch_size, "seq_len": run.seq_len, "next_step": next_step}


def run_training(
    run: RunConfig, topology: Topology, progress=sys.stderr,
    checkpoint: CheckpointConfig | None = None, resume: str = "never",
) -> dict:
    """Train and return the report (per-step losses and times, memory, communication).

    With ``checkpoint``, the state is saved every ``checkpoint.every`` steps and after the last;
    ``resume`` is ``never`` (the directory must hold no checkpoint), ``auto`` (continue from the
    latest complete checkpoint if there is one) or ``required`` (there must be one). In a
    multi-process job every process calls this; only process 0 prints."""
    if resume not in ("never", "auto", "required"):
        raise JaxparError(f"resume={resume!r} is not one of never, auto, required")
    if resume != "never" and checkpoint is None:
        raise JaxparError("resuming needs a checkpoint directory: pass --checkpoint-dir")
    lead = jax.process_index() == 0
    log = (lambda msg: print(msg, file=progress, flush=True)) if (progress and lead) else (lambda msg: None)
    trainer, strategy, cfg = build_trainer(run, topology)
    layout = trainer.layout
    tokens, held_out = data.split_corpus(data.corpus_tokens())
    if run.seq_len >= len(held_out):
        raise JaxparError(f"--seq-len {run.seq_len} is longer than the held-out text ({len(held_out)} tokens); use a shorter one")
    trainer.check_batch(np.zeros((run.batch_size, 1)))
    if resume == "required":
        ckpt = Checkpointer.existing(checkpoint)
    else:
        ckpt = Checkpointer(checkpoint) if checkpoint else None

    state, start = _start_state(trainer, run, ckpt, resume, log)
    example = trainer.abstract_batch(run.batch_size, run.seq_len)
    compiled = trainer.jit_step(example).lower(state, example).compile()
    meta = {"model": run.model, "strategy": str(strategy), "topology": topology.name, "devices": layout.mesh.size, "processes": jax.process_count()}
    batch_of = lambda corpus, step: trainer.put_process_batch(  # noqa: E731
        run.batch_size, lambda a, b: data.local_batch_at(corpus, step, run.batch_size, run.seq_len, run.seed, a, b)
    )
    losses, grad_norms, times, save_pauses = [], [], [], []
    nonfinite = None  # the first step whose loss or gradient norm is NaN or infinite
    bar = _Progress(start, run.steps, progress) if (progress and lead and start < run.steps) else None
    for step in range(start, run.steps):
        batch = batch_of(tokens, step)
        report_progress("start", step + 1)  # from here on, this process waits for the others in collectives
        began = time.perf_counter()
        try:
            state, metrics = compiled(state, batch)
            loss = _scalar(metrics["loss"])  # waits for the step: the time below is the step's own
            grad_norm = _scalar(metrics["grad_norm"])
        except jax.errors.JaxRuntimeError as err:
            if jax.process_count() == 1:
                raise
            raise JaxparError(
                f"step {step + 1} failed in a collective: another process of the job has probably died or hung "
                f"({str(err).splitlines()[0]}); restart the job from the last checkpoint with --resume"
            ) from err
        times.append(time.perf_counter() - began)
        losses.append(loss)
        grad_norms.append(grad_norm)
        if nonfinite is None and not (np.isfinite(loss) and np.isfinite(grad_norm)):
            nonfinite = {"step": step + 1, "loss": loss, "grad_norm": grad_norm}
            log(nonfinite_message(nonfinite))  # at once: the summary comes only at the end
        report_progress("done", step + 1)
        if bar:
            bar.update(step + 1, loss, run.batch_size * run.seq_len / times[-1])
        if ckpt and ckpt.should_save(step + 1, run.steps):
            began = time.perf_counter()
            ckpt.save(step + 1, state, dict(meta, data=_data_position(run, step + 1)))
            save_pauses.append(time.perf_counter() - began)  # training waits this long; the writing goes on behind
    if bar:
        bar.close()
    report_progress("evaluating", run.steps)
    if ckpt:
        ckpt.wait()
        ckpt.close()

    eval_fn = jax.jit(trainer.grad_fn())
    held_out_loss = _scalar(eval_fn(state.params, batch_of(held_out, 0))[0])
    steady = times[1:] or times or [float("nan")]
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
        "processes": jax.process_count(),
        "steps": run.steps,
        "start_step": start,
        "batch_size": run.batch_size,
        "seq_len": run.seq_len,
        "seed": run.seed,
        "losses": losses,
        "grad_norms": grad_norms,
        "nonfinite": nonfinite,
        "grad_sync": _grad_sync_report(trainer),
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
        "checkpoints": {"directory": ckpt.directory, "steps": ckpt.steps(), "save_pause_s": save_pauses} if ckpt else None,
    }


def nonfinite_message(nonfinite: dict) -> str:
    """The words for the first step whose loss or gradient is not finite (the same for every
    gradient sync: a compressed one turns the blocks around a NaN or inf into NaN, an exact one
    keeps NaN and inf per element; either way the gradient norm is not finite)."""
    what = "gradient" if not np.isfinite(nonfinite["grad_norm"]) else "loss"
    return f"non-finite {what} at step {nonfinite['step']} (loss {nonfinite['loss']:.4g}, gradient norm {nonfinite['grad_norm']:.4g})"


def _grad_sync_report(trainer: Trainer) -> dict:
    sync = trainer.grad_sync
    if sync is None:
        return {"name": "exact", "axes": [], "bits": None}
    return {"name": sync.name, "axes": list(sync.axes), "bits": sync.bits}


class _Progress:
    """A one-line progress bar: step, loss, tokens/s, time left."""

    def __init__(self, first: int, total: int, stream):
        self.first, self.total, self.stream, self.start = first, total, stream, time.perf_counter()
        self.live = hasattr(stream, "isatty") and stream.isatty()

    def update(self, done: int, loss: float, tokens_per_s: float):
        if not self.live and done % max(self.total // 10, 1) and done != self.total:
            return  # in logs, print a line every 10% instead of redrawing
        width = 30
        filled = width * done // self.total
        elapsed = time.perf_counter() - self.start
        left = elapsed / (done - self.first) * (self.total - done)
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
    losses, first = report["losses"], report["start_step"]
    processes = f"  processes {report['processes']}" if report["processes"] > 1 else ""
    lines = [
        f"model {report['model']} ({report['num_params']:,} params)  topology {report['topology']}  strategy {report['strategy']}{processes}",
        "",
        f"loss curve (step: loss){f', resumed after step {first}' if first else ''}",
    ]
    if losses:
        finite = [x for x in losses if np.isfinite(x)] or [0.0]
        lo, hi = min(finite), max(finite)
        for i in sorted(set([0] + [round(i * (len(losses) - 1) / 9) for i in range(10)])):
            bar = "#" * int(1 + 40 * (losses[i] - lo) / max(hi - lo, 1e-9)) if np.isfinite(losses[i]) else ""
            lines.append(f"  {first + i + 1:5d}: {losses[i]:7.4f} {bar}")
    else:
        lines.append(f"  (none: the checkpoint is already at step {first} of {report['steps']})")
    if report.get("nonfinite"):
        lines.append(nonfinite_message(report["nonfinite"]))
    sync = report.get("grad_sync") or {"name": "exact"}
    if sync["name"] != "exact":
        bits = f", {sync['bits']} bits" if sync["bits"] is not None else ""
        lines.append(f"gradient sync {sync['name']} over {'+'.join(sync['axes'])}{bits} (the traffic optimum below is for exact sync)")
    if report["checkpoints"]:
        pauses = report["checkpoints"]["save_pause_s"]
        pause = f"; training paused {1000 * float(np.median(pauses)):.0f} ms per save (median)" if pauses else ""
        lines.append(f"checkpoints {report['checkpoints']['steps']} in {report['checkpoints']['directory']}{pause}")
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
        if kind in ("by_axes", "scalar all-reduce", "note"):
            continue
        lines.append(f"  {kind:22s} {row['count']:7d} {row['measured_bytes']:14,.0f} {row['optimal_bytes']:14,.0f} {row['ratio']:7.3f}")
    scalars = comm["scalar all-reduce"]
    lines.append(f"  {'scalar all-reduce':22s} {scalars['count']:7d} {scalars['measured_bytes']:14,.0f}   (loss, gradient norm)")
    for name, row in comm["by_axes"].items():
        lines.append(f"    {name:32s} x{row['count']:<5d} {row['bytes_per_device']:14,.0f}")
    if "note" in comm:
        lines.append(f"  ({comm['note']})")
    return "\n".join(lines)
