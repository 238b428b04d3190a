"""Federated groups against HSDP on the main job: held-out loss at equal tokens and the bytes each
device sends across the groups per step, on 8 simulated CPU devices.

    python benchmarks/federated.py [--steps 96] [--batch-size 16] [--seq-len 128]

Every run trains the main job's tiny Llama on the built-in corpus from the same seed, on the same
global batches (--batch-size rows a step), for --steps steps:

- HSDP, ``data=4,fsdp=2``: every step all-reduces the gradient's shards across the replicas;
- FL+HSDP, ``federation=2,data=2,fsdp=2``: two groups of ``data=2,fsdp=2`` merging every H steps
  (H = 1, 8, 32), by averaging and by DiLoCo's outer Nesterov step.

For each: the held-out loss at the end (the merged model), and the bytes a device sends across the
two groups per step: HSDP's share of its ``data`` all-reduce that crosses between the halves of the
devices is counted as the whole all-reduce of the gradient's shard, the figure the federated papers
compare with (2 (Psi / n) (G - 1) / G every step).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxpar import federate  # noqa: E402
from jaxpar.run import RunConfig, run_training  # noqa: E402
from jaxpar.topology import load_topology  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    topology = load_topology("cpu-8")
    base = RunConfig(model="tiny", steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, seed=0)
    tokens = args.steps * args.batch_size * args.seq_len
    print(f"tiny Llama, {args.steps} steps of {args.batch_size} x {args.seq_len} ({tokens:,} tokens), 8 simulated devices\n")
    print(f"{'layout':48s} {'held-out loss':>13s} {'bytes across groups/step':>25s} {'seconds':>8s}")
    began = time.perf_counter()
    hsdp = run_training(dataclasses.replace(base, strategy="data=4,fsdp=2"), topology, progress=None)
    rows = [("HSDP data=4,fsdp=2", hsdp["held_out_loss"], None, time.perf_counter() - began)]
    for outer in ("avg", "nesterov"):
        for local in (1, 8, 32):
            strategy = f"federation=2,data=2,fsdp=2,local_steps={local},outer={outer}"
            began = time.perf_counter()
            report = federate.train(dataclasses.replace(base, strategy=strategy), topology, progress=None)
            cross = report["inter_group_bytes_per_step"]
            rows.append((f"FL+HSDP H={local} {outer}", report["held_out_loss"], cross, time.perf_counter() - began))
            if rows[0][2] is None:  # HSDP's: one merge's bytes every step
                rows[0] = (*rows[0][:2], {"federated": cross["hsdp"]}, rows[0][3])
    for name, loss, cross, seconds in rows:
        print(f"{name:48s} {loss:13.4f} {cross['federated']:25,.0f} {seconds:8.1f}")


if __name__ == "__main__":
    main()
