"""Train the tiny Llama with exact, dynamiq and int8 gradient sync; print the losses and the bytes
each device sends per step to reduce the gradients, read from the compiled step.

    python examples/compressed_grad_sync.py [--steps 40] [--strategy data=8] [--batch-size 16] [--seq-len 64]
                                            [--warmup-steps 20] [--syncs exact dynamiq int8]

Runs on 8 simulated CPU devices (set here before JAX starts). The three runs see the same batches
from the same initial weights, so their losses differ only by what compression changes. Exits with
an error if any of them did not bring the loss down, or if dynamiq's final loss (the mean of the
last 10 steps) is more than 1% away from exact sync's.
"""
import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

from jaxpar.report import step_report  # noqa: E402
from jaxpar.topology import load_topology  # noqa: E402
from jaxpar.run import RunConfig, run_training  # noqa: E402
from jaxpar.train.step import TrainConfig  # noqa: E402

# kinds of collective that carry gradient reductions; the scalar all-reduces (loss, norm) are apart
REDUCTIONS = ("all-reduce", "reduce-scatter", "collective-permute")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--strategy", default="data=8")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--warmup-steps", type=int, default=20, help="of the learning rate; a short run needs fewer")
    parser.add_argument("--syncs", nargs="+", default=["exact", "dynamiq", "int8"], choices=["exact", "dynamiq", "int8"],
                        help="the syncs to train with (exact and dynamiq are always compared)")
    args = parser.parse_args()
    rows = []
    for sync in dict.fromkeys(["exact", "dynamiq", *args.syncs]):
        train = TrainConfig(grad_sync=sync, warmup_steps=args.warmup_steps)
        run = RunConfig(model="tiny", strategy=args.strategy, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, train=train)
        report = run_training(run, load_topology("cpu-8"), progress=None, analyze=step_report)
        comm = report["communication"]
        sent = sum(comm[kind]["measured_bytes"] for kind in REDUCTIONS if kind in comm)
        losses = report["losses"]
        rows.append((sync, losses, sent, report["held_out_loss"]))
        print(f"{sync:8s} loss step 1 {losses[0]:.4f}  step {len(losses)} {losses[-1]:.4f}  held-out {report['held_out_loss']:.4f}  "
              f"reductions {sent:12,.0f} bytes/device/step", flush=True)
    exact_bytes = rows[0][2]
    print(f"\nstrategy {args.strategy}, {args.steps} steps; loss every {max(args.steps // 8, 1)} steps:")
    for sync, losses, sent, _ in rows:
        curve = " ".join(f"{x:.3f}" for x in losses[:: max(args.steps // 8, 1)])
        print(f"  {sync:8s} {curve}   wire bytes {sent / exact_bytes:.3f} x exact")
    stuck = [sync for sync, losses, _, _ in rows if not losses[-1] < losses[0]]
    if stuck:
        sys.exit(f"the loss did not fall with {', '.join(stuck)}")
    print("the loss fell with every sync")
    final = {sync: sum(losses[-10:]) / len(losses[-10:]) for sync, losses, _, _ in rows}  # same batches: comparable
    gap = abs(final["dynamiq"] - final["exact"]) / final["exact"]
    if gap > 0.01:
        sys.exit(f"dynamiq's final loss {final['dynamiq']:.4f} is {gap:.1%} away from exact sync's {final['exact']:.4f} (at most 1%)")
    print(f"dynamiq trains like exact sync: final loss {final['dynamiq']:.4f} against {final['exact']:.4f} ({gap:.2%} apart)")


if __name__ == "__main__":
    main()
