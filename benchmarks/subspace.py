"""Subspace pipeline boundaries on the main job: held-out loss against steps, and against the
wall time of a pipeline whose stage links are slow, for the dense boundary and subspace=k.

    python benchmarks/subspace.py [--steps 120] [--batch-size 16] [--seq-len 128] [--ks 16,32,64]
                                  [--links cpu-8-slow-stages] [--real-steps 8]

Every run trains the main job's tiny Llama (width d = 128) on the built-in corpus from the same
seed and batches, as ``stage=4,data=2`` with 1F1B over 4 micro-batches, dense and with
``subspace=k``; the held-out loss is taken every steps/6 steps.

The links are not slowed for real here: a step's wall time on the stage links of the topology
``--links`` (``stage_link_mbps``, ``stage_link_latency_ms``: 200 Mb/s and 50 ms in
meshes/cpu-8-slow-stages.toml) is the
1F1B schedule run with real durations (``analysis.overlap.schedule_seconds``): a forward's and a
backward's seconds (twice a forward's) from the measured median step on the 8 simulated devices,
and each send between stages the latency plus a micro-batch's boundary bytes (the compiled
step's collective-permutes over ``stage``) over the bandwidth. At this model's size a send is
mostly latency; "no latency" gives the same step with the latency at zero. Then, for the dense
boundary and the smallest k, a few steps with the links slowed for real (``--stage-link-mbps``,
``--stage-link-latency-ms``: each tick that sends waits), against the schedule's figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxpar.analysis import overlap  # noqa: E402
from jaxpar.parallel.stage import schedules  # noqa: E402
from jaxpar.report import step_report  # noqa: E402
from jaxpar.run import RunConfig, run_training  # noqa: E402
from jaxpar.topology import load_topology  # noqa: E402
from jaxpar.train.config import TrainConfig  # noqa: E402

STAGES, MICROBATCHES, WIDTH = 4, 4, 128


def step_seconds(run: dict, bandwidth: float, latency_s: float, lockstep: bool = False) -> float:
    """A step's seconds with slow stage links (module doc): the 1F1B schedule run with real
    durations (``analysis.overlap.schedule_seconds``; ``lockstep``: as jaxpar's SPMD executor runs
    it, every tick waiting for its sends), each send ``latency_s`` plus a micro-batch's boundary
    bytes over the bandwidth. ``run["sent"]``, a device's collective-permute bytes over stage a
    step, is the mean over the stages of the 2 m (S - 1) sends the schedule makes."""
    schedule = schedules.make("1f1b", STAGES, MICROBATCHES)
    # a forward's seconds, a backward taking twice it, from the measured step (the lockstep executor)
    forward_s = run["compute_s"] / overlap.schedule_seconds(schedule, 1.0, 2.0, 0.0, lockstep=True)
    per_send = run["sent"] * STAGES / (2 * MICROBATCHES * (STAGES - 1))
    return overlap.schedule_seconds(schedule, forward_s, 2 * forward_s, latency_s + per_send / bandwidth, lockstep)


def train(base: RunConfig, k: int, link=None) -> dict:
    """One run; ``link`` (bytes/s, seconds): its stage links slowed to that for real."""
    strategy = f"stage={STAGES},data=2" + (f",subspace={k}" if k else "")
    run = dataclasses.replace(base, strategy=strategy)
    if link:
        run = dataclasses.replace(run, train=dataclasses.replace(run.train, stage_link_mbps=link[0] * 8 / 1e6,
                                                                 stage_link_latency_ms=link[1] * 1e3))
    report = run_training(run, load_topology("cpu-8"), progress=None, analyze=step_report)
    stage_sends = report["communication"]["by_axes"].get("collective-permute over stage", {"bytes_per_device": 0})
    return {"k": k, "held_out": report["held_out_losses"], "final": report["held_out_loss"],
            "compute_s": statistics.median(report["step_times_s"][1:]), "sent": stage_sends["bytes_per_device"]}


def steps_to(held_out: list, target: float) -> float | None:
    """The step at which a run's held-out loss first reaches ``target``, between two evaluations
    linearly; None if it never does."""
    previous = (0, float("inf"))
    for step, loss in held_out:
        if loss <= target:
            if previous[1] == float("inf"):
                return float(step)
            return previous[0] + (step - previous[0]) * (previous[1] - target) / (previous[1] - loss)
        previous = (step, loss)
    return None


def loss_table(runs: list, bandwidth: float, latency: float):
    dense = runs[0]
    dense_step = step_seconds(dense, bandwidth, latency)
    print(f"{'boundary':>10} {'k/d':>6} {'sent B/step':>12} {'compute s':>9} {'slow-link step s':>16} {'no latency':>10} "
          f"{'x dense':>7}  held-out loss at steps " + " ".join(f"{s:>6d}" for s, _ in dense["held_out"]))
    for run in runs:
        step = step_seconds(run, bandwidth, latency)
        name = f"k={run['k']}" if run["k"] else f"dense {WIDTH}"
        print(f"{name:>10} {(run['k'] or WIDTH) / WIDTH:6.1%} {run['sent']:12,.0f} {run['compute_s']:9.3f} {step:16.3f} "
              f"{step_seconds(run, bandwidth, 0.0):10.3f} {dense_step / step:7.2f}  {'':23}"
              + " ".join(f"{loss:6.3f}" for _, loss in run["held_out"]))
    print("\nthe step penalty: steps to reach the dense run's held-out loss at its step s, as a multiple of s "
          "(and the time to it on the slow links, as a multiple of dense's)")
    for s, target in dense["held_out"][1:-1]:
        cells = []
        for run in runs[1:]:
            reached = steps_to(run["held_out"], target)
            time_x = reached * step_seconds(run, bandwidth, latency) / (s * dense_step) if reached else None
            cells.append(f"k={run['k']}: " + (f"{reached / s:4.2f}x steps, {time_x:4.2f}x time" if reached else "not reached"))
        print(f"  dense at step {s:4d} ({target:.3f}): " + "; ".join(cells))


def real_links_table(base: RunConfig, k: int, steps: int, bandwidth: float, latency: float):
    """Dense and subspace=k with the links slowed for real: the measured step against the
    schedule's figure, lockstep (as the SPMD executor runs) and not."""
    print(f"\nthe links slowed for real (--stage-link-mbps {bandwidth * 8 / 1e6:g} --stage-link-latency-ms "
          f"{latency * 1e3:g}), {steps} steps: the median step against the schedule's figure")
    print(f"{'boundary':>10} {'measured s':>10} {'lockstep s':>10} {'async s':>8}")
    short = dataclasses.replace(base, steps=steps, eval_every=0)
    for kk in (0, k):
        fast, slow = train(short, kk), train(short, kk, (bandwidth, latency))
        measured = slow["compute_s"]
        print(f"{('k=' + str(kk)) if kk else 'dense':>10} {measured:10.3f} {step_seconds(fast, bandwidth, latency, True):10.3f} "
              f"{step_seconds(fast, bandwidth, latency):8.3f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--ks", default="16,32,64", help="subspace dimensions (the model's width is 128)")
    parser.add_argument("--links", default="cpu-8-slow-stages", help="a topology whose stage_link_ keys give the links")
    parser.add_argument("--real-steps", type=int, default=8, help="steps of each run with the links slowed for real")
    args = parser.parse_args()
    links = load_topology(args.links)
    if not links.stage_link_bandwidth:
        parser.error(f"topology {args.links} gives no stage links (stage_link_mbps, stage_link_latency_ms); "
                     "give one that does, e.g. cpu-8-slow-stages")
    bandwidth, latency = links.stage_link_bandwidth, links.stage_link_latency
    base = RunConfig(model="tiny", steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, seed=0,
                     eval_every=max(args.steps // 6, 1),
                     train=TrainConfig(microbatches=MICROBATCHES, schedule="1f1b", warmup_steps=10, total_steps=args.steps))
    print(f"tiny Llama (d = {WIDTH}), stage={STAGES},data=2, 1F1B over {MICROBATCHES} micro-batches, {args.steps} steps of "
          f"{args.batch_size} x {args.seq_len}; stage links {bandwidth * 8 / 1e6:g} Mb/s, {latency * 1e3:g} ms\n")
    ks = [int(k) for k in args.ks.split(",")]
    loss_table([train(base, k) for k in [0] + ks], bandwidth, latency)
    if args.real_steps:
        real_links_table(base, ks[0], args.real_steps, bandwidth, latency)


if __name__ == "__main__":
    main()
