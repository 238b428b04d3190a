"""Data-centric parallel against static context parallelism and plain packing, on 8 simulated
CPU devices: the same batches of the corpus's documents (natural lengths, long-tailed), the tiny
Llama.

    python benchmarks/dcp.py [--steps 4] [--batch 48] [--capacity 32]

Per layout: the median step time (after the compile) and the work imbalance per device (max /
mean useful FLOPs, ``train.dcp.imbalance``). Simulated devices share this machine's 2 cores, so a
step's time is the work of all devices together (padding and ring traffic included), not the
time of the busiest device on real hardware; the imbalance is what real devices would wait on.

Then (``--estimate-only`` for it alone; ``analysis/data_centric.py``, no compile): llama3-8b on 32
H200 (four nodes), batches of 64 sequences drawn from a long-tailed (lognormal) length
distribution up to 256K tokens, 32K positions a device: DCP against static context parallelism
over the longest sequence's degree and packing, the busiest device's step and its exposed ring,
next to the paper's 2.88x.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxpar.models import llama  # noqa: E402
from jaxpar.parallel import build_layout, parse_strategy  # noqa: E402
from jaxpar.train import data, dcp  # noqa: E402
from jaxpar.train.step import TrainConfig, Trainer  # noqa: E402

TINY = llama.CONFIGS["tiny"]


def model_fn(rngs):
    return llama.Llama(TINY, rngs=rngs)


def static_times(strategy: str, batches, row_length: int) -> float:
    """Median step time of a static layout (after its compile): each batch first-fit packed into
    rows of the longest length, padded to one row count for all batches (a static shape)."""
    trainer = Trainer(build_layout(parse_strategy(strategy, 8)), model_fn, llama.loss_fn, TrainConfig())
    groups = trainer.layout.batch_shards
    packed = [[tuple(r) for r in dcp.first_fit([len(s) for s in sequences], row_length)] for sequences in batches]
    count = max(len(rows) for rows in packed)
    count += -count % groups
    state, times = trainer.init(seed=0), []
    for i, (sequences, rows) in enumerate(zip(batches, packed)):
        batch = dcp.rows_batch(sequences, rows + [()] * (count - len(rows)), row_length, sum(len(s) - 1 for s in sequences))
        start = time.perf_counter()
        state, metrics = trainer.step(state, trainer.put_batch(batch))
        jax.block_until_ready(metrics["loss"])
        if i:  # the first step compiles
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def estimate_table(batches: int = 4, size: int = 64, capacity: int = 32_768):
    from jaxpar.analysis import data_centric
    from jaxpar.topology import load_topology

    node = load_topology("gpu-h200-16")
    topology = dataclasses.replace(node, name="gpu-h200-32", num_chips=32, dcn_shape=(4,))
    cfg, longest = llama.CONFIGS["llama3-8b"], 262_144
    rng = np.random.default_rng(0)
    print(f"estimated: llama3-8b on 32 x H200 (4 nodes), {batches} batches of {size} sequences, lengths lognormal "
          f"(median 4096, sigma 1.5) up to {longest}, {capacity} positions a device (the paper: DCP 2.88x on 32 H200)")
    print(f"{'batch':>5} {'tokens':>9} {'longest':>8} {'layout':24} {'step s':>8} {'mean s':>8} {'exposed s':>9} {'vs DCP':>7}")
    for b in range(batches):
        lengths = np.minimum(rng.lognormal(np.log(4096), 1.5, size).astype(int) + 2, longest + 1)
        static = 2 ** math.ceil(math.log2(max(1, (lengths.max() - 1) / capacity)))
        rows = data_centric.compare(lengths, cfg, topology, capacity, static, memory_budget=60e9)
        for row in rows:
            fits = "" if row.fits else " (over memory)"
            print(f"{b:>5} {int(lengths.sum()):>9} {int(lengths.max()):>8} {row.name:24} {row.step_s:>8.2f} {row.mean_s:>8.2f} "
                  f"{row.exposed_s:>9.3f} {row.step_s / rows[0].step_s:>6.2f}x{fits}")
    print()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--estimate-only", action="store_true", help="only the estimated 32 x H200 table")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=48, help="documents per step")
    parser.add_argument("--capacity", type=int, default=32, help="token positions per device and row")
    args = parser.parse_args()
    estimate_table()
    if args.estimate_only:
        return
    docs = data.documents(data.split_corpus(data.corpus_tokens())[0])
    longest = args.capacity * 8
    batches = [data.documents_at(docs, step, args.batch, 0, longest + 1) for step in range(args.steps)]
    budget = 1e9
    trainer = dcp.DataCentricTrainer(model_fn, llama.loss_fn, TINY, TrainConfig(), capacity=args.capacity, memory_budget=budget)
    state, times = trainer.init(seed=0), []
    start = time.perf_counter()
    shapes = trainer.compile_ahead(state.params, args.batch)
    ahead = time.perf_counter() - start
    for i, sequences in enumerate(batches):
        start = time.perf_counter()
        state, metrics = trainer.step(state, sequences)
        jax.block_until_ready(metrics["loss"])
        if i:  # the first step compiles the update
            times.append(time.perf_counter() - start)
    print(f"dcp: {shapes} call shapes compiled ahead in {ahead:.1f} s; programs compiled in all {trainer.compiles}")
    ratios = [dcp.imbalance([len(s) for s in b], 8, args.capacity, TINY, budget, static_context=8) for b in batches]
    mean = lambda key: statistics.mean(r[key] for r in ratios)  # noqa: E731
    print(f"{args.steps} steps of {args.batch} documents (up to {longest + 1} tokens), capacity {args.capacity} positions per device")
    print(f"{'layout':28} {'step s (median)':>16} {'imbalance':>10}")
    print(f"{'dcp':28} {statistics.median(times):>16.3f} {mean('dcp'):>10.2f}")
    print(f"{'static context=8':28} {static_times('context=8', batches, longest):>16.3f} {mean('static context=8'):>10.2f}")
    print(f"{'packing (data=8)':28} {static_times('data=8', batches, longest):>16.3f} {mean('packing'):>10.2f}")


if __name__ == "__main__":
    main()
