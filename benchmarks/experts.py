"""Expert parallelism on 8 simulated CPU devices: `moe-tiny` trained under each expert-parallel
layout, dropless and with a capacity factor of 1.25, and a layout without expert parallelism
(fsdp=8, every device holding every expert) for comparison.

    python benchmarks/experts.py [--steps 20] [--batch-size 16] [--seq-len 128] [--layouts "expert=8;fsdp=8"]
    python benchmarks/experts.py --balancing [--steps 200] [--seq-len 64]


Prints, per layout and routing: the median step time (compile excluded), the exchange's all-to-all
bytes per MoE layer and device measured on the compiled step against the formula, all collective
bytes per device per step, and the held-out batch's routing (the most loaded device against the
mean, the copies dropped). Simulated devices share this machine's cores: a step's time is every
device's work added up, so compare layouts by their bytes and by ratios within one run.

``--balancing`` trains under expert=4,fsdp=2 with nothing balancing the load, the balance loss,
and DeepSeek-V3's routing bias at two rates (``--bias-rate``), and prints the held-out batch's
routing: the most loaded expert and device against the mean (worst layer), and the held-out loss.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from jaxpar.report import step_report  # noqa: E402
from jaxpar.run import RunConfig, run_training  # noqa: E402
from jaxpar.topology import load_topology  # noqa: E402

LAYOUTS = "expert=8;expert=4,fsdp=2;expert=2,tensor=2,fsdp=2;expert=2,context=2,fsdp=2;fsdp=8"


def measure(run: RunConfig) -> dict:
    report = run_training(run, load_topology("cpu-8"), progress=None, catch_signals=False, analyze=step_report)
    times = sorted(report["step_times_s"][1:])
    comm = {k: v for k, v in report["communication"].items() if k not in ("by_axes", "scalar all-reduce", "note")}
    expert = report.get("expert") or {}
    routing = report.get("batch_report") or {}
    return {"layout": run.strategy, "capacity": run.capacity_factor or "dropless", "step_ms": 1e3 * times[len(times) // 2],
            "exchange_per_layer": expert.get("measured_bytes_per_layer", 0.0), "formula_per_layer": expert.get("formula_bytes_per_layer", 0.0),
            "collective_bytes": sum(v["measured_bytes"] for v in comm.values()),
            "device_max_over_mean": max(routing.get("device_max_over_mean", [1.0])), "dropped": routing.get("dropped_fraction", 0.0),
            "held_out_loss": report["held_out_loss"], "expert_max_over_mean": max(routing.get("expert_max_over_mean", [1.0]))}


BALANCINGS = ((0.0, 0.0), (0.01, 0.0), (0.0, 0.001), (0.0, 0.01))  # (balance weight, bias rate)


def balancing(base: RunConfig):
    print(f"{'balance weight':>14s} {'bias rate':>9s} {'expert max/mean':>15s} {'device max/mean':>15s} {'held-out':>8s}")
    for weight, rate in BALANCINGS:
        row = measure(dataclasses.replace(base, strategy="expert=4,fsdp=2", balance_weight=weight, bias_rate=rate))
        print(f"{weight:14g} {rate:9g} {row['expert_max_over_mean']:15.3f} {row['device_max_over_mean']:15.3f} "
              f"{row['held_out_loss']:8.4f}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--layouts", default=LAYOUTS)
    parser.add_argument("--balancing", action="store_true", help="compare the balance loss and the routing bias instead")
    args = parser.parse_args()
    base = RunConfig(model="moe-tiny", steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len)
    if args.balancing:
        return balancing(base)
    print(f"{'layout':28s} {'routing':>8s} {'step ms':>8s} {'a2a/layer B':>12s} {'formula':>10s} {'all coll. B':>12s} "
          f"{'dev max/mean':>12s} {'dropped':>8s} {'held-out':>8s}")
    for layout in args.layouts.split(";"):
        for capacity in (0.0, 1.25):
            row = measure(dataclasses.replace(base, strategy=layout, capacity_factor=capacity))
            print(f"{row['layout']:28s} {str(row['capacity']):>8s} {row['step_ms']:8.1f} {row['exchange_per_layer']:12,.0f} "
                  f"{row['formula_per_layer']:10,.0f} {row['collective_bytes']:12,.0f} {row['device_max_over_mean']:12.3f} "
                  f"{100 * row['dropped']:7.2f}% {row['held_out_loss']:8.4f}", flush=True)


if __name__ == "__main__":
    main()
