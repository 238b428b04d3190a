"""Long sequences on a TPU pod, planned from this machine: `jaxpar compile` of llama2-7b on 32 v5p
chips (v5p-64, 2x4x4) at several sequence lengths, with and without context parallelism.

    python benchmarks/long_context.py [--seq-lens 2048,8192,32768,131072] [--layouts "fsdp=32;fsdp=8,context=4"]
                                      # about a minute and several GB of RAM per compile

One sequence per data group (global batch 32 without context parallelism, as in MaxText's
published AOT figures; 32 / context with it, so context parallelism holds 1/context of each
sequence per chip where the other layout holds a whole one). Prints, per compile:
fit, peak and temporary HBM per chip, ring / all-to-all bytes per chip per step and the roofline
step time. MaxText's figures for the same model and pod (its AOT compile, llama2-7b, global batch
32): seq 2048 peak 5.129 GB and temporaries 3.888 GB per chip; seq 4096 peak 6.207 GB,
temporaries 5.768 GB. Nothing here ran on a TPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from jaxpar import aot
from jaxpar.errors import JaxparError
from jaxpar.topology import load_topology

MAXTEXT = {2048: (5.129, 3.888), 4096: (6.207, 5.768)}  # seq -> (peak, temporaries) GB per chip


def v5p_64():
    base = load_topology("tpu-v5p-256")
    return dataclasses.replace(base, name="tpu-v5p-64", tpu_topology="v5p:2x4x4", ici_shape=(2, 4, 4), dcn_shape=(1,), num_chips=32)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", default="2048,8192,32768,131072")
    parser.add_argument("--layouts", default="fsdp=32,regather=on;fsdp=8,context=4,regather=on")
    args = parser.parse_args()
    topology = v5p_64()
    print(f"{'seq':>7} {'layout':32} {'batch':>6} {'fits':>5} {'peak GB':>8} {'temp GB':>8} {'ring GB':>8} {'a2a GB':>7} "
          f"{'step s':>7} {'MaxText peak/temp GB':>21} {'compile s':>9}")
    for seq in (int(n) for n in args.seq_lens.split(",")):
        for layout in args.layouts.split(";"):
            batch = 32 // _context(layout)
            start = time.perf_counter()
            try:
                report = aot.compile_report("llama2-7b", topology, layout, batch, seq, alternatives=0)
            except JaxparError as err:
                print(f"{seq:>7} {layout:32} {batch:>6}  refused: {str(err)[:160]}", flush=True)
                continue
            mem, comm = report["memory_per_chip"], report["collectives"]
            moved = lambda kind: sum(row["bytes_per_chip"] for name, row in comm.items() if name.startswith(kind)) / 1e9  # noqa: E731
            maxtext = "{:.3f} / {:.3f}".format(*MAXTEXT[seq]) if seq in MAXTEXT and batch == 32 else "-"
            print(f"{seq:>7} {layout:32} {batch:>6} {'yes' if mem['fits'] else 'NO':>5} {mem['peak'] / 1e9:>8.3f} "
                  f"{mem['temporaries'] / 1e9:>8.3f} {moved('collective-permute'):>8.3f} {moved('all-to-all'):>7.3f} "
                  f"{report['roofline']['step_s']:>7.3f} {maxtext:>21} {time.perf_counter() - start:>9.0f}", flush=True)


def _context(layout: str) -> int:
    for part in layout.split(","):
        if part.startswith("context="):
            return int(part.split("=")[1])
    return 1


if __name__ == "__main__":
    main()
