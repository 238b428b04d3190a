"""``jaxpar train --strategy "federation=G,..."``: the main job's model and data trained as G groups'
copies, merged every ``local_steps`` steps (``train/federated.py``), and a report of the merges.

Each group reads its rows of every global batch (``--batch-size`` rows, G equal shares), so the
global batch is the same as under HSDP with ``data=G``; the copies merge every H = ``local_steps``
steps, and once more at the end if the last step is not a merge, so the run ends with one model,
whose held-out loss is reported. The figures the federated papers compare: the global batch per
merge (H global batches), the bytes each device sends across the groups per step (one merge's
2 (Psi / n) (G - 1) / G every H steps, against HSDP's all-reduce of the same gradient shard every
step) and each group's drift at each merge. Checkpoints hold every group's state (its copy, its
inner optimizer state, the anchor and the outer optimizer's), so a resumed run continues exactly.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import numpy as np

from jaxpar import decoupled, scalars
from jaxpar.collectives import compressed
from jaxpar.collectives.quantize import wire_bits_per_value
from jaxpar.errors import JaxparError
from jaxpar.models import config_record, model_and_loss
from jaxpar.parallel import build_layout, federation, parse_strategy
from jaxpar.run import (
    RunConfig, batch_source, devices_for, initial_state, model_name, open_data, plan_run, run_model_config,
)
from jaxpar.topology import Topology
from jaxpar.train import data
from jaxpar.train.checkpoint import CheckpointConfig, Checkpointer
from jaxpar.train.federated import FederatedTrainer, inner_strategy

def check(run: RunConfig, groups: int) -> None:
    """Refuse, before any work, what a federated run cannot split."""
    if run.batch_size % groups:
        raise JaxparError(f"--batch-size {run.batch_size} does not split over federation={groups} groups; "
                          f"give a multiple of {groups}")


def train(run: RunConfig, topology: Topology, progress=sys.stderr, checkpoint: CheckpointConfig | None = None,
          resume: str = "never") -> dict | None:
    """Train ``run`` (whose strategy has ``federation=G``) and return its report. With
    ``checkpoint``, every group's state is saved every ``checkpoint.every`` steps and at the end
    (one verified checkpoint of the groups' arrays stacked over ``federation``); ``resume="auto"``
    continues from the newest that verifies."""
    if decoupled.role():  # one process of jaxpar launch --learners: a learner (which reports nothing) or the syncer
        job = decoupled.job_of(run, topology, checkpoint, resume)
        return decoupled.learn(job, topology, progress) if decoupled.role() == "learner" else decoupled.sync(job, topology, progress)
    log = (lambda message: print(message, file=progress, flush=True)) if progress else (lambda message: None)
    strategy, plan, cfg, trainer = _planned(run, topology)
    own = open_data(run, log)
    tokens, held_out = data.split_corpus(data.corpus_tokens()) if own is None else (None, None)
    train_rows, held, batch_of = batch_source(run, trainer, cfg, tokens, held_out, own)
    ckpt = Checkpointer(checkpoint) if checkpoint else None
    board = scalars.TensorBoard(run.tensorboard) if run.tensorboard else None
    try:
        states, start, history = _start(run, strategy, trainer, ckpt, resume, log)
        meta = {"model": model_name(run), "strategy": str(strategy), "devices": trainer.layout.mesh.size, "processes": 1,
                **config_record(cfg)}
        watch = _Watch(run, trainer, batch_of(held, 0), board, progress, start)
        states = _loop(run, trainer, states, start, history, lambda step: batch_of(train_rows, step), ckpt, meta, watch)
    finally:
        if ckpt:
            ckpt.close()
        if board:
            board.close()
    # each group's compiled step reports the loss at the weights it is given, before its update:
    # one more call of it on its share of a held-out batch (the updated state dropped) costs no compile
    held_losses = [float(group.step(state.train, batch)[1]["loss"])
                   for group, state, batch in zip(trainer.groups, states, batch_of(held, 0))]
    return _report(run, strategy, trainer, plan, history, start, float(np.mean(held_losses)))


def _planned(run: RunConfig, topology: Topology):
    """(strategy, a group's RunPlan, model config, FederatedTrainer): every check before any work."""
    devices = devices_for(topology)
    strategy = parse_strategy(run.strategy, len(devices))
    groups = strategy.degrees["federation"]
    federation.check_slices(strategy, topology.num_slices)
    check(run, groups)
    inner = dataclasses.replace(run, strategy=inner_strategy(strategy), batch_size=run.batch_size // groups)
    plan = plan_run(inner, topology, devices[: len(devices) // groups])
    cfg = run_model_config(run)
    train_cfg = dataclasses.replace(run.train, total_steps=run.steps, memory_bytes=run.train.memory_bytes or topology.hbm_bytes)
    layout = build_layout(strategy, devices, num_slices=topology.num_slices)
    return strategy, plan, cfg, FederatedTrainer(layout, strategy, *model_and_loss(cfg), train_cfg)


def _start(run: RunConfig, strategy, trainer: FederatedTrainer, ckpt, resume: str, log):
    """(the groups' states, first step, history so far): fresh, or the newest verified checkpoint's."""
    fresh = {"losses": [], "step_times_s": [], "merges": []}
    if ckpt is None or ckpt.latest_step() is None or resume == "never":
        if ckpt is not None and ckpt.latest_step() is not None:
            raise JaxparError(f"checkpoint directory {ckpt.directory} already holds checkpoints {ckpt.steps()}; pass --resume "
                              "to continue from the latest, or choose another --checkpoint-dir")
        trains = [initial_state(group, run, log if g == 0 else lambda message: None) for g, group in enumerate(trainer.groups)]
        return trainer.start_from(trains), 0, fresh

    def same_run(meta):
        if meta["strategy"] != str(strategy) or meta["model"] != model_name(run):
            raise JaxparError(f"checkpoint in {ckpt.directory} is of {meta['model']} under {meta['strategy']}, not "
                              f"{model_name(run)} under {strategy}: resume with those, or start another --checkpoint-dir")

    stacked, meta = ckpt.restore_newest_verified(trainer.abstract_stacked(), log, same_run)
    log(f"resuming from checkpoint {meta['step']} in {ckpt.directory}")
    return trainer.unstacked(stacked), meta["step"], meta["history"]


class _Watch:
    """What a run shows as it goes: the progress bar, the held-out loss every ``--eval-every``
    steps (each group's copy on its share of the held-out batch, by its loss program, compiled
    once; their mean), and ``--tensorboard``'s scalars."""

    def __init__(self, run: RunConfig, trainer: FederatedTrainer, held_batches: list, board, progress, start: int):
        self.run, self.trainer, self.held, self.board = run, trainer, held_batches, board
        self.bar = scalars.Progress(start, run.steps, progress) if progress and start < run.steps else None
        self.losses = [group.jit_loss(batch) for group, batch in zip(trainer.groups, held_batches)] if run.eval_every else None

    def step(self, done: int, states, metrics: dict, history: dict):
        held = None
        if self.losses and (done % self.run.eval_every == 0 or done == self.run.steps):
            held = float(np.mean([float(loss(state.train.params, batch))
                                  for loss, state, batch in zip(self.losses, states, self.held)]))
            history.setdefault("held_out_losses", []).append([done, held])
        if self.bar:
            status = f"loss {metrics['loss']:.3f}" + (" merged" if metrics["drift"] is not None else "")
            self.bar.update(done, status + (f", held-out {held:.3f}" if held is not None else ""), always=held is not None)
        if self.board:
            drifts = {f"federation/drift_group{g}": d for g, d in enumerate(metrics["drift"] or [])}
            self.board.add(done, {"train/loss": metrics["loss"], "eval/held_out_loss": held, **drifts})

    def close(self):
        if self.bar:
            self.bar.close()


def _loop(run: RunConfig, trainer: FederatedTrainer, states, start: int, history: dict, batch_at, ckpt, meta: dict,
          watch: _Watch):
    """The steps from ``start``: a merge every ``local_steps`` and at the last step, saving as
    ``ckpt`` says; ``history`` gets each step's loss and time, each merge's drifts and the
    held-out losses; ``watch`` shows them."""
    for step in range(start, run.steps):
        began = time.perf_counter()
        states, metrics = trainer.step(states, batch_at(step))
        done = step + 1
        if done == run.steps and (metrics["drift"] is None or trainer.fragments > 1 or trainer.delay):  # one model at the end
            states, metrics["drift"] = trainer.merge_all(states, but=metrics["fragment"])
            metrics["fragment"] = None
        history["step_times_s"].append(time.perf_counter() - began)
        history["losses"].append(metrics["loss"])
        if metrics["drift"] is not None:
            fragment = metrics["fragment"] if trainer.fragments > 1 else None  # (None: the whole model)
            history["merges"].append({"step": done, "drift": metrics["drift"], "fragment": fragment})
        watch.step(done, states, metrics, history)
        if ckpt and ckpt.should_save(done, run.steps):
            ckpt.save(done, trainer.stacked(states), dict(meta, data={"seed": run.seed, "next_step": done},
                                                          history=json.loads(json.dumps(history))))
    watch.close()
    if ckpt:
        ckpt.wait()
    return states


def _report(run: RunConfig, strategy, trainer: FederatedTrainer, plan, history: dict, start: int, held_out_loss) -> dict:
    groups, local = trainer.size, trainer.local_steps
    losses, times = history["losses"], history["step_times_s"]
    group_devices = trainer.groups[0].layout.mesh.size
    merge_bytes = trainer.merge_bytes()
    sync, wire = trainer.merge_sync, 1.0
    if sync is not None:  # the compressed all-reduce's bits per value, scales included, against float32's
        wire = wire_bits_per_value(compressed.DEFAULT_BITS[sync.scheme] if sync.bits is None else sync.bits, sync.scheme) / 32
    steady = times[1:] or times
    return {
        "model": model_name(run), "strategy": str(strategy), "groups": groups, "devices_per_group": group_devices,
        "local_steps": local, "outer": trainer.options["outer"], "steps": run.steps, "batch_size": run.batch_size,
        "seq_len": run.seq_len, "start_step": start, "losses": losses, "step_times_s": times, "merges": history["merges"],
        "held_out_loss": held_out_loss, "held_out_losses": history.get("held_out_losses", []),
        "tokens_per_s": run.batch_size * run.seq_len / float(np.median(steady)),
        "global_batch_per_merge": {"rows": run.batch_size * local, "tokens": run.batch_size * local * run.seq_len},
        # bytes a device sends across the groups per step: a merge every H steps, or HSDP's all-reduce every step
        "inter_group_bytes_per_step": {"federated": merge_bytes * wire / local, "hsdp": merge_bytes},
        "merge_sync": {"name": sync.name, "bits": sync.bits} if sync else {"name": "exact", "bits": None},
        "group_plan": {"strategy": str(plan.strategy), "path": trainer.groups[0].plan.path},
    }


def summary(report: dict) -> list[str]:
    """The report's lines for a terminal."""
    if report.get("role") == "syncer":
        return decoupled.summary(report)
    cross = report["inter_group_bytes_per_step"]
    lines = [f"{report['model']} under {report['strategy']}: {report['groups']} groups of {report['devices_per_group']} devices "
             f"({report['group_plan']['strategy']} each), merging every {report['local_steps']} steps ({report['outer']})",
             f"loss {report['losses'][0]:.4f} -> {report['losses'][-1]:.4f}; held-out loss {report['held_out_loss']:.4f} "
             f"(the merged model)",
             f"global batch per merge: {report['global_batch_per_merge']['rows']} rows, "
             f"{report['global_batch_per_merge']['tokens']:,} tokens",
             f"bytes each device sends across the groups per step: {cross['federated']:,.0f} "
             f"(HSDP: {cross['hsdp']:,.0f}, {cross['hsdp'] / cross['federated']:.0f}x more)"
             + ("" if report["merge_sync"]["name"] == "exact" else f"; merges compressed ({report['merge_sync']['name']})")
             if cross["federated"] else
             "one group: nothing crosses the groups"]
    if report["held_out_losses"]:
        lines.append("held-out loss by step: " + ", ".join(f"{step} {loss:.4f}" for step, loss in report["held_out_losses"][-8:]))
    for merge in report["merges"][-6:]:
        part = "" if merge.get("fragment") is None else f" (fragment {merge['fragment']})"
        lines.append(f"  merge at step {merge['step']}{part}: drift " + ", ".join(f"{d:.4f}" for d in merge["drift"]))
    lines.append(f"throughput {report['tokens_per_s']:,.0f} tokens/s (median step)")
    return lines
