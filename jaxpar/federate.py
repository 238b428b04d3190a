"""``jaxpar train --strategy "federation=G,..."``: the main job's model and data trained as G groups'
copies, merged every ``local_steps`` steps (``train/federated.py``), and a report of the merges.

Each group reads its rows of every global batch (``--batch-size`` rows, G equal shares), so the
global batch is the same as under HSDP with ``data=G``; the copies merge every H = ``local_steps``
steps, and once more at the end if the last step is not a merge, so the run ends with one model,
whose held-out loss is reported. The figures the federated papers compare: the global batch per
merge (H global batches), the bytes each device sends across the groups per step (one merge's
2 (Psi / n) (G - 1) / G every H steps, against HSDP's all-reduce of the same gradient shard every
step) and each group's drift at each merge. No checkpoint is kept yet.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import jax
import numpy as np

from jaxpar import scalars
from jaxpar.errors import JaxparError
from jaxpar.models import model_and_loss
from jaxpar.parallel import build_layout, parse_strategy
from jaxpar.run import RunConfig, batch_source, devices_for, open_data, plan_run, run_model_config
from jaxpar.topology import Topology
from jaxpar.train import data
from jaxpar.train.federated import FederatedTrainer, inner_strategy

UNSUPPORTED = (("eval_every", "--eval-every"), ("init_from", "--init-from"), ("tensorboard", "--tensorboard"))


def check(run: RunConfig, groups: int) -> None:
    """Refuse, before any work, what a federated run does not do yet or cannot split."""
    for field, flag in UNSUPPORTED:
        if getattr(run, field):
            raise JaxparError(f"{flag} is not yet taken by a federated run (federation={groups}); drop it")
    if run.batch_size % groups:
        raise JaxparError(f"--batch-size {run.batch_size} does not split over federation={groups} groups; "
                          f"give a multiple of {groups}")


def train(run: RunConfig, topology: Topology, progress=sys.stderr) -> dict:
    """Train ``run`` (whose strategy has ``federation=G``) and return its report."""
    log = (lambda message: print(message, file=progress, flush=True)) if progress else (lambda message: None)
    devices = devices_for(topology)
    strategy = parse_strategy(run.strategy, len(devices))
    groups = strategy.degrees["federation"]
    check(run, groups)
    inner = dataclasses.replace(run, strategy=inner_strategy(strategy), batch_size=run.batch_size // groups)
    plan = plan_run(inner, topology, devices[: len(devices) // groups])  # a group's checks, before any work
    cfg = run_model_config(run)
    train_cfg = dataclasses.replace(run.train, total_steps=run.steps, memory_bytes=run.train.memory_bytes or topology.hbm_bytes)
    trainer = FederatedTrainer(build_layout(strategy, devices, num_slices=topology.num_slices), strategy, *model_and_loss(cfg), train_cfg)
    own = open_data(run, log)
    tokens, held_out = data.split_corpus(data.corpus_tokens()) if own is None else (None, None)
    train_rows, held, batch_of = batch_source(run, trainer, cfg, tokens, held_out, own)
    states, losses, times, merges = trainer.init(run.seed), [], [], []
    bar = scalars.Progress(0, run.steps, progress) if progress else None
    for step in range(run.steps):
        began = time.perf_counter()
        states, metrics = trainer.step(states, batch_of(train_rows, step))
        times.append(time.perf_counter() - began)
        losses.append(metrics["loss"])
        if metrics["drift"] is not None:
            merges.append({"step": step + 1, "drift": metrics["drift"]})
        if bar:
            bar.update(step + 1, f"loss {losses[-1]:.3f}" + (" merged" if metrics["drift"] is not None else ""))
    if bar:
        bar.close()
    if run.steps % trainer.local_steps:  # one model at the end
        states, drift = trainer.merge(states)
        merges.append({"step": run.steps, "drift": drift, "last": True})
    held_batches = batch_of(held, 0)
    held_losses = [float(group.jit_loss(batch)(state.train.params, batch))
                   for group, state, batch in zip(trainer.groups, states, held_batches)]
    return _report(run, strategy, trainer, plan, losses, times, merges, float(np.mean(held_losses)))


def _report(run: RunConfig, strategy, trainer: FederatedTrainer, plan, losses, times, merges, held_out_loss) -> dict:
    groups, local = trainer.size, trainer.local_steps
    group_devices = trainer.groups[0].layout.mesh.size
    # each device's shard of the weights, as a group stores them: what a merge all-reduces
    shard = sum(np.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
                for leaf in jax.tree.leaves(trainer.groups[0].abstract_state().params))
    merge_bytes = 2.0 * float(shard) * (groups - 1) / groups
    steady = times[1:] or times
    return {
        "model": run.model, "strategy": str(strategy), "groups": groups, "devices_per_group": group_devices,
        "local_steps": local, "outer": trainer.options["outer"], "steps": run.steps, "batch_size": run.batch_size,
        "seq_len": run.seq_len, "losses": losses, "step_times_s": times, "merges": merges, "held_out_loss": held_out_loss,
        "tokens_per_s": run.batch_size * run.seq_len / float(np.median(steady)),
        "global_batch_per_merge": {"rows": run.batch_size * local, "tokens": run.batch_size * local * run.seq_len},
        # bytes a device sends across the groups per step: a merge every H steps, or HSDP's all-reduce every step
        "inter_group_bytes_per_step": {"federated": merge_bytes / local, "hsdp": merge_bytes},
        "group_plan": {"strategy": str(plan.strategy), "path": trainer.groups[0].plan.path},
    }


def summary(report: dict) -> list[str]:
    """The report's lines for a terminal."""
    cross = report["inter_group_bytes_per_step"]
    lines = [f"{report['model']} under {report['strategy']}: {report['groups']} groups of {report['devices_per_group']} devices "
             f"({report['group_plan']['strategy']} each), merging every {report['local_steps']} steps ({report['outer']})",
             f"loss {report['losses'][0]:.4f} -> {report['losses'][-1]:.4f}; held-out loss {report['held_out_loss']:.4f} "
             f"(the merged model)",
             f"global batch per merge: {report['global_batch_per_merge']['rows']} rows, "
             f"{report['global_batch_per_merge']['tokens']:,} tokens",
             f"bytes each device sends across the groups per step: {cross['federated']:,.0f} "
             f"(HSDP: {cross['hsdp']:,.0f}, {cross['hsdp'] / cross['federated']:.0f}x more)" if cross["federated"] else
             "one group: nothing crosses the groups"]
    for merge in report["merges"][-6:]:
        lines.append(f"  merge at step {merge['step']}: drift " + ", ".join(f"{d:.4f}" for d in merge["drift"]))
    lines.append(f"throughput {report['tokens_per_s']:,.0f} tokens/s (median step)")
    return lines
