"""Block parallelism (BP, CSBP) against context parallelism (CP) for a block diffusion model.

    python benchmarks/block_parallel.py [--steps 6] [--seq-len 256] [--skip-cpu]

1. Measured, 8 simulated CPU devices: ``bd3lm-tiny`` on the same batches of the corpus under CP
   (``context=8``), BP (``block=8``), matched CSBP (``block=8,context=8``) and CSBP with more devices
   than ring ranks (``block=8,context=4|2``), and a sliding-window model
   (``--window``) under CP and CSBP with ``clean_kv=fetch``: the median step time after the
   compile, the bytes each device sends per step by kind (from the compiled program) and the
   attention work imbalance (max / mean query-key pairs per device). The simulated devices share
   two cores, so a step's time is every device's work added up (BP repeats the clean half on each),
   not the busiest device's time on real hardware.
2. Analytic, the ``bd3lm-8b`` shape (llama3-8b) at 32K-128K tokens, one sequence, on 16 v5p chips
   and on 8 H100s (the topology files' FLOP/s, efficiency and link bandwidth): per device and
   layer, the tokens held, the attention pairs of the busiest device, the K/V bytes sent, an
   estimate of a device's memory (``layer_estimate`` says what it counts), and a
   step-time estimate max(compute, ring traffic) with compute = matmul and attention FLOPs at the
   chip's matmul efficiency and the ring overlapped with it, at the roofline's link bandwidth (the model of ``analysis/roofline.py``
   for one layer, written out here for layouts it does not know). The ratio to CP stands next to
   the paper's measured 1.61x (16 H200) and 7.59x (8 H100).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxpar.analysis import hlo, roofline  # noqa: E402
from jaxpar.parallel.block import blocks as block_parallel  # noqa: E402
from jaxpar.parallel.context.split_attention import FETCH, RING, sequence_order  # noqa: E402
from jaxpar.models import bd3lm  # noqa: E402
from jaxpar.parallel import build_layout, parse_strategy  # noqa: E402
from jaxpar.topology import load_topology  # noqa: E402
from jaxpar.train import data  # noqa: E402
from jaxpar.train.step import TrainConfig, Trainer  # noqa: E402

PAPER = {"tpu": "1.61x on 16 H200", "gpu": "7.59x on 8 H100"}  # BP/CSBP over CP, measured in the paper


def cpu_rows(steps: int, seq_len: int, block_size: int, window: int):
    tiny = dataclasses.replace(bd3lm.CONFIGS["bd3lm-tiny"], block_size=block_size)
    cases = [("context=8", tiny), ("block=8", tiny), ("block=8,context=8", tiny), ("block=8,context=4", tiny), ("block=8,context=2", tiny),
             ("context=8", dataclasses.replace(tiny, window=window)),
             ("block=8,context=4,clean_kv=fetch", dataclasses.replace(tiny, window=window))]
    tokens = data.corpus_tokens(200_000)
    batches = [bd3lm.corrupt(data.batch_at(tokens, s, 8, seq_len, seed=0)[:, :seq_len], block_size, (0, s), mask_id=tiny.mask_id)
               for s in range(steps)]
    for strategy, cfg in cases:
        trainer = Trainer(build_layout(parse_strategy(strategy, 8)), lambda rngs, cfg=cfg: bd3lm.BD3LM(cfg, rngs=rngs),
                          bd3lm.loss_fn, TrainConfig())
        state, times = trainer.init(seed=0), []
        for i, batch in enumerate(batches):
            start = time.perf_counter()
            state, metrics = trainer.step(state, trainer.put_batch(batch))
            jax.block_until_ready(metrics["loss"])
            if i:  # the first step compiles
                times.append(time.perf_counter() - start)
        example = trainer.abstract_batch(8, seq_len, fields=bd3lm.FAMILY.batch_fields(seq_len))
        cols = hlo.collectives(trainer._step.lower(trainer.abstract_state(), example).compile().as_text(), trainer.layout.mesh)
        sent = hlo.summarize([c for c in cols if c.operand_bytes > 8])
        layout = trainer.layout
        ranks = max(1, int(np.prod([layout.mesh.shape[a] for a in layout.role(block_parallel.BLOCKS)])))
        ring = int(np.prod([layout.mesh.shape[a] for a in layout.role(RING)]))
        work = device_pairs(seq_len, block_size, cfg.window, ranks, ring, bool(layout.role(FETCH)))
        yield strategy, cfg.window, statistics.median(times), sent, work.max() / work.mean()


def device_pairs(length: int, block_size: int, window, ranks: int, ring: int, fetch: bool = False) -> np.ndarray:
    """Query-key pairs per device: BP / CSBP from their shares; CP (ranks 1) from the zigzag order
    of the whole [x_t ; x_0] over the ring."""
    if ranks > 1:
        return block_parallel.attention_work(length, block_size, ranks, ring, window, fetch)
    places = sequence_order(2 * length, ring).reshape(ring, -1)
    return block_parallel.keys_read(places, length, block_size, window).sum(axis=1)


def layer_estimate(cfg, length: int, topology, devices: int, strategy: str):
    """Per device and layer for one sequence: (tokens held, busiest device's attention pairs, K/V
    bytes sent, seconds, memory bytes) under ``strategy`` on ``devices`` chips (bf16, forward and
    backward). Memory: the weights' state split over every device (16 bytes a weight: float32
    weights, gradients and two Adam moments), each layer's bf16 input kept for the backward pass
    (remat full) and one layer's working set (its input, q/k/v/out and the MLP's three activations,
    bf16; the attention itself flash-like, linear in the tokens)."""
    parsed = parse_strategy(strategy, devices)
    ranks, ring = parsed.written_degrees["block"], parsed.degrees["context"]
    if ranks > 1:
        # BP: the noisy blocks and the clean prefix; CSBP: 2L / P tokens, the clean half travelling
        held = length // ranks + (block_parallel.clean_prefix(length, cfg.block_size) if ring == 1 else length // ranks)
        pairs = block_parallel.attention_work(length, cfg.block_size, ranks, ring, cfg.window).max()
        moving = length if ring > 1 else 0
    else:
        held = 2 * length // ring
        pairs = device_pairs(length, cfg.block_size, cfg.window, 1, ring).max()
        moving = 2 * length  # the whole [x_t ; x_0]
    kv = moving * cfg.kv_heads * cfg.head_dim * 2 * 2  # K and V, bf16
    sent = 2 * (ring - 1) / ring * kv + 2 * kv if ring > 1 else 0.0  # forward, backward, float32 K/V gradients home
    group = ranks // ring if ranks > 1 else 1  # CSBP with P > C: a rank's pieces all-gathered (twice: remat) and reduce-scattered
    sent += 3 * (group - 1) / group * kv / ring
    weights = 2 * cfg.embed * cfg.heads * cfg.head_dim + 2 * cfg.embed * cfg.kv_heads * cfg.head_dim + 3 * cfg.embed * cfg.mlp
    flops = 3 * (2 * held * weights + 4 * pairs * cfg.heads * cfg.head_dim)  # forward, backward twice
    compute = flops / (topology.peak_bf16_flops * roofline.matmul_efficiency(topology.chip))
    seconds = max(compute, roofline.collective_seconds("collective-permute", sent, False, topology))
    saved = cfg.layers * held * cfg.embed * 2
    working = held * (2 * cfg.embed + (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim + 3 * cfg.mlp) * 2
    return held, pairs, sent, seconds, 16 * cfg.num_params() / devices + saved + working


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--window", type=int, default=32, help="the sliding-window model's, in tokens")
    parser.add_argument("--skip-cpu", action="store_true", help="only the analytic 8B table")
    args = parser.parse_args()
    if not args.skip_cpu:
        print(f"bd3lm-tiny, 8 simulated CPU devices, batch 8 x {args.seq_len} ([x_t ; x_0]: {2 * args.seq_len} positions), "
              f"block {args.block_size}; median of {args.steps - 1} steps")
        print(f"{'strategy':34s} {'window':>6s} {'step s':>7s} {'vs CP':>6s} {'imbalance':>9s}  bytes sent per device per step")
        base = {}
        for strategy, window, seconds, sent, imbalance in cpu_rows(args.steps, args.seq_len, args.block_size, args.window):
            base.setdefault(window, seconds)
            kinds = ", ".join(f"{kind} {row['bytes_per_device']:,.0f}" for kind, row in sent.items())
            print(f"{strategy:34s} {window or '-':>6} {seconds:7.3f} {base[window] / seconds:5.2f}x {imbalance:9.3f}  {kinds}")
    cfg = bd3lm.CONFIGS["bd3lm-8b"]
    for topology, devices in ((load_topology("v5p-32"), 16), (load_topology("gpu-h100-8"), 8)):
        ring = 4 if devices > 8 else 2
        print(f"\nbd3lm-8b, one sequence, {devices} x {topology.chip}; per device and layer, estimated "
              f"(the paper: {PAPER[topology.platform]})")
        print(f"{'tokens':>7s} {'strategy':22s} {'held':>8s} {'pairs (max)':>14s} {'K/V sent':>12s} {'ms':>8s} {'vs CP':>6s} {'memory':>9s}")
        for length in (32_768, 65_536, 131_072):
            layouts = [f"context={devices}", f"block={devices}", f"block={devices},context={devices}", f"block={devices},context={ring}"]
            rows = [(s, layer_estimate(cfg, length, topology, devices, s)) for s in layouts]
            cp = rows[0][1][3]
            for s, (held, pairs, sent, seconds, memory) in rows:
                fits = "" if memory <= topology.hbm_bytes else " (over)"
                print(f"{length:7d} {s:22s} {held:8d} {pairs:14,d} {sent / 2**20:9.1f} MiB {1e3 * seconds:8.2f} {cp / seconds:5.2f}x "
                      f"{memory / 1e9:6.1f} GB{fits}")


if __name__ == "__main__":
    main()
