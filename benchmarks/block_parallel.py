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
2. Estimated (``analysis/block_diffusion.py``, no compile): a 14B model of the shape of the paper's
   Nemotron-14B row (``nemotron_like``) at 64K-512K tokens, one sequence per data rank, on 16 H200
   (two nodes, the CP rings inside a node) and 16 v5p chips, ``data=2`` times CP8, matched CSBP
   and pure BP, then a sliding-window variant with ``clean_kv=fetch``: per step, the tokens a
   device holds, the K/V GiB it sends (bf16 gradients, as the paper counts them), the step with
   ideal kernels and its exposed communication, the step with jaxpar's kernels, each against
   CP's, and a device's memory; next to the paper's K/V bytes, step ratio and exposed seconds.
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

from jaxpar.analysis import block_diffusion, hlo  # noqa: E402
from jaxpar.parallel.block import blocks as block_parallel  # noqa: E402
from jaxpar.parallel.context.split_attention import FETCH, RING  # noqa: E402
from jaxpar.models import bd3lm  # noqa: E402
from jaxpar.models.llama import LlamaConfig  # noqa: E402
from jaxpar.parallel import build_layout, parse_strategy  # noqa: E402
from jaxpar.topology import load_topology  # noqa: E402
from jaxpar.train import data  # noqa: E402
from jaxpar.train.step import TrainConfig, Trainer  # noqa: E402

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
        work = block_diffusion.device_pairs(seq_len, block_size, cfg.window, ranks, ring, bool(layout.role(FETCH)))
        yield strategy, cfg.window, statistics.median(times), sent, work.max() / work.mean()


def nemotron_like(window: int | None = None) -> bd3lm.BD3LMConfig:
    """A 14B block diffusion model of the shape the paper's Nemotron-Labs-Diffusion-14B row implies:
    40 layers with 8 K/V heads of 128 (its 210 GiB of K/V per GPU at 256K tokens under CP8 is
    exactly 3 x 7/8 of 40 such layers' [x_t ; x_0] K/V), width 5120, 40 heads, MLP 17408, a 131072
    vocabulary (the published dense 14B models of that depth). The K/V bytes and the attention
    FLOPs depend only on the layers, K/V heads and head widths."""
    base = LlamaConfig(vocab_size=131_072, embed=5120, layers=40, heads=40, kv_heads=8, head_dim=128, mlp=17_408)
    return bd3lm.diffusion_config(base, 131_071, window=window)


def paper_kv_gib(cfg, length: int, ring: int, clean_only: bool) -> float:
    """The paper's K/V accounting per GPU and step: 3 x (C-1)/C of the travelling tokens' bf16 K/V
    per layer (forward K/V, backward K/V, backward gradients), no hop home."""
    moving = length if clean_only else 2 * length
    return 3 * (ring - 1) / ring * moving * 2 * cfg.kv_heads * cfg.head_dim * 2 * cfg.layers / 2**30


def estimate_rows(cfg, topology, layouts, lengths):
    """Per length, each layout's estimate with ideal and with jaxpar's kernels (bf16 K/V gradients,
    as the paper sends them)."""
    for length in lengths:
        cp = {k: block_diffusion.estimate(cfg, length, topology, layouts[0], k, grad_bytes=2) for k in block_diffusion.KERNELS}
        for strategy in layouts:
            ideal, ours = (block_diffusion.estimate(cfg, length, topology, strategy, k, grad_bytes=2) for k in block_diffusion.KERNELS)
            fits = "" if ideal.memory_bytes <= topology.hbm_bytes else " (over)"
            print(f"{length // 1024:5d}K {strategy:38s} {ideal.tokens_held:8d} {ideal.kv_bytes_per_step / 2**30:8.1f} "
                  f"{ideal.step_s:8.2f} {sum(ideal.exposed_s.values()):8.3f} {cp['ideal'].step_s / ideal.step_s:6.2f}x "
                  f"{ours.step_s:8.2f} {cp['jaxpar'].step_s / ours.step_s:6.2f}x {ideal.memory_bytes / 1e9:7.1f}{fits}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--window", type=int, default=32, help="the sliding-window model's, in tokens")
    parser.add_argument("--estimate-window", type=int, default=8192, help="the estimated sliding-window model's, in tokens")
    parser.add_argument("--skip-cpu", action="store_true", help="only the estimates")
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
    header = (f"{'tokens':>6s} {'strategy':38s} {'held':>8s} {'K/V GiB':>8s} {'step s':>8s} {'exposed':>8s} {'vs CP':>7s} "
              f"{'jaxpar s':>8s} {'vs CP':>7s} {'mem GB':>7s}")
    cfg = nemotron_like()
    for topology in (load_topology("gpu-h200-16"), load_topology("v5p-32")):
        print(f"\n14B (Nemotron-like), one sequence per data rank, {topology.num_chips} x {topology.chip}, "
              f"{topology.num_slices} node(s) or slice(s); per step, estimated with exposed communication "
              f"(analysis/block_diffusion.py); 'step s' with ideal kernels, 'jaxpar s' with jaxpar's")
        print(header)
        estimate_rows(cfg, topology, ["data=2,context=8", "data=2,block=8,context=8", "data=2,block=8"],
                      (65_536, 131_072, 262_144, 524_288))
    print(f"\nthe paper's K/V per GPU at 256K: CP8 {paper_kv_gib(cfg, 262_144, 8, False):.0f} GiB, CSBP "
          f"{paper_kv_gib(cfg, 262_144, 8, True):.0f} GiB (it measures 210 -> 105; step 1.18x, exposed 3.03 -> 2.41 s of 66.5 s)")
    windowed = nemotron_like(window=args.estimate_window)
    print(f"\nthe same with a {args.estimate_window}-token window, 16 x H200 (the paper: 1.45x at 256K, 1.61x at 512K)")
    print(header)
    estimate_rows(windowed, load_topology("gpu-h200-16"), ["data=2,context=8", "data=2,block=8,context=8,clean_kv=fetch"],
                  (262_144, 524_288))

if __name__ == "__main__":
    main()
