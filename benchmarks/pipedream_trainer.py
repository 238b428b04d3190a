"""PipeDream through the Trainer on the main job, against 1F1B: held-out loss by step and on the
schedule's clock.

    python benchmarks/pipedream_trainer.py [--steps 60] [--stages 4] [--microbatches 8]

Both run ``jaxpar train``'s own loop (``run_training``) on the tiny Llama and the main job's
corpus under ``stage=S,data=8/S``, the same batches in the same order: 1F1B makes one AdamW step
a step, PipeDream (``--schedule pipedream``) one per micro-batch and stage. Each learning rate is
the best of a grid. On this machine the eight devices share two cores, so the wall clock says
nothing of a pipeline's overlap; the clock here is the schedule's (a forward 1 unit, a backward 2,
``analysis.overlap``): 1F1B's step is its flushed schedule, PipeDream's m micro-batches of its
never-flushed stream (3 units each once full), and with ``--send-units`` a send between stages
costs that much (slow links).
"""
from __future__ import annotations

import argparse
import dataclasses
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxpar.analysis import overlap  # noqa: E402
from jaxpar.parallel.stage import schedules  # noqa: E402
from jaxpar.run import RunConfig, run_training  # noqa: E402
from jaxpar.topology import load_topology  # noqa: E402
from jaxpar.train.config import TrainConfig  # noqa: E402

GRIDS = {"1f1b": (3e-3, 1e-2, 3e-2), "pipedream": (1e-3, 3e-3, 1e-2)}


def step_units(name: str, stages: int, m: int, send: float) -> float:
    """A step's length on the schedule's clock; PipeDream's from a long stream, per m micro-batches."""
    if name == "1f1b":
        return overlap.schedule_seconds(schedules.one_f_one_b(stages, m), 1.0, 2.0, send)
    long = 16 * m
    return overlap.schedule_seconds(schedules.pipedream(stages, long), 1.0, 2.0, send) * m / long


def train(base: RunConfig, schedule: str, lr: float) -> dict:
    run = dataclasses.replace(base, train=dataclasses.replace(base.train, schedule=schedule, learning_rate=lr))
    report = run_training(run, load_topology("cpu-8"), progress=None)
    return {"schedule": schedule, "lr": lr, "held_out": report["held_out_losses"], "final": report["held_out_loss"],
            "staleness": (report.get("pipedream") or {}).get("staleness")}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--send-units", type=float, default=3.0, help="a send between stages on the slow-link clock")
    args = parser.parse_args()
    S, m = args.stages, args.microbatches
    base = RunConfig(model="tiny", strategy=f"stage={S},data={8 // S}", steps=args.steps, batch_size=args.batch_size,
                     seq_len=args.seq_len, seed=0, eval_every=max(args.steps // 6, 1),
                     train=TrainConfig(microbatches=m, warmup_steps=max(args.steps // 10, 1), total_steps=args.steps))
    print(f"tiny Llama, stage={S},data={8 // S}, {m} micro-batches a step of {args.batch_size} x {args.seq_len}, "
          f"{args.steps} steps; learning rates: the best of {GRIDS}\n")
    best = {}
    for name, grid in GRIDS.items():
        runs = [train(base, name, lr) for lr in grid]
        for run in runs:
            print(f"  {name:9s} lr {run['lr']:g}: held-out {run['final']:.4f}")
        best[name] = min(runs, key=lambda r: r["final"])
    print()
    clocks = {name: (step_units(name, S, m, 0.0), step_units(name, S, m, args.send_units)) for name in best}
    print(f"{'schedule':>9} {'lr':>7} {'units/step':>10} {'slow links':>10}  held-out loss at steps "
          + " ".join(f"{s:>6d}" for s, _ in best["1f1b"]["held_out"]))
    for name, run in best.items():
        print(f"{name:>9} {run['lr']:7.0e} {clocks[name][0]:10.1f} {clocks[name][1]:10.1f}  {'':22}"
              + " ".join(f"{loss:6.3f}" for _, loss in run["held_out"]))
    flushed, stream = best["1f1b"], best["pipedream"]
    print(f"\nPipeDream's measured staleness per stage: {stream['staleness']} (S - s - 1: {[S - s - 1 for s in range(S)]})")
    for slow, label in ((0, "fast links"), (1, f"sends of {args.send_units:g} units")):
        ratio = clocks["1f1b"][slow] / clocks["pipedream"][slow]
        target = flushed["final"]
        reached = next((s for s, loss in stream["held_out"] if loss <= target), None)
        when = (f"PipeDream reaches 1F1B's final held-out loss ({target:.3f}) at step {reached}: "
                f"{args.steps / reached * ratio:.2f}x sooner on this clock" if reached else
                f"PipeDream does not reach 1F1B's final held-out loss ({target:.3f}) in {args.steps} steps")
        print(f"  {label}: a PipeDream step is {ratio:.2f}x shorter than 1F1B's; {when}")


if __name__ == "__main__":
    main()
