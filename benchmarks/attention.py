"""Attention on the CPU: the blockwise kernel against the naive one, forward and backward.

    python benchmarks/attention.py [--lengths 512,1024,2048,4096,8192] [--runs 3]

One sequence (batch 1), 4 query heads over 2 key/value heads of width 64, causal, float32. Time:
median of ``runs`` calls of the jitted value-and-gradient after its compile. Memory: the compiled
program's temporaries (``memory_analysis().temp_size_in_bytes``), the peak working set beyond the
inputs and outputs. Ratios are within one run (this machine is noisy).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from jaxpar import attention as A  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64


def measure(impl: str, length: int, runs: int) -> tuple[float, int]:
    """(median seconds of one forward + backward, temporary bytes)."""
    key = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(key[0], (1, length, HEADS, HEAD_DIM))
    k, v = (jax.random.normal(kk, (1, length, KV_HEADS, HEAD_DIM)) for kk in key[1:])

    def loss(q, k, v):
        return A.attention(q, k, v, A.CAUSAL, implementation=impl).sum()

    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    jax.block_until_ready(compiled(q, k, v))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v))
        times.append(time.perf_counter() - start)
    return statistics.median(times), temp


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,1024,2048,4096,8192")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    print(f"{'length':>7} {'naive s':>9} {'blockwise s':>12} {'speed-up':>9} {'naive MiB':>10} {'blockwise MiB':>14} {'memory ratio':>13}")
    for length in (int(n) for n in args.lengths.split(",")):
        (tn, mn), (tb, mb) = measure("naive", length, args.runs), measure("blockwise", length, args.runs)
        print(f"{length:>7} {tn:>9.3f} {tb:>12.3f} {tn / tb:>8.2f}x {mn / 2**20:>10.1f} {mb / 2**20:>14.1f} {mn / mb:>12.1f}x", flush=True)


if __name__ == "__main__":
    main()
