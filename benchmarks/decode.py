"""Decoding a Llama with a KV cache (``serve/llama.py``) on one device, under tensor parallelism
and under delayed tensor parallelism (DTP, ``delay=1``), measured here and priced by a roofline.

    python benchmarks/decode.py [--new-tokens 64] [--rows 4] [--model tiny]

Measured, 8 simulated CPU devices: greedy decoding of ``--rows`` prompts of the corpus,
``--new-tokens`` each, on one device and under ``tensor=2|4|8`` and ``tensor=2|4,delay=1``: the
median time of a decoding step after the compiles, tokens per second over every row, the
collectives of one decoding step from its compiled program (count and bytes per device), and how
many all-reduces per layer are blocking (no matmul can run while one is in flight:
``hlo.blocking_collectives``). The simulated devices share two cores, so a step's time is every
device's work added up, not the busiest device's on real hardware. TP's tokens are checked against
one device's; DTP computes another function (tests/test_delayed_tp.py checks it against its own
simulation).

Priced: the batch-1 decode latency per token of ``llama-1b`` and ``llama3-8b`` under TP and DTP on
``gpu-h100-8`` and a v5e slice (``roofline.decode_latency``), for a range of all-reduce latencies
(the fixed cost of one small all-reduce, which this machine cannot measure: the table sweeps it).
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxpar.analysis import hlo, roofline  # noqa: E402
from jaxpar.models import llama  # noqa: E402
from jaxpar.parallel import build_layout, parse_strategy  # noqa: E402
from jaxpar.serve.llama import Decoder  # noqa: E402
from jaxpar.train import data  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--model", default="tiny")
    args = parser.parse_args()
    model = llama.Llama(llama.CONFIGS[args.model], rngs=nnx.Rngs(0))
    corpus = data.corpus_tokens(10_000)
    prompts = [corpus[100 * i: 100 * i + 16 + 8 * i] for i in range(args.rows)]
    reference = None
    print(f"{args.model}, {args.rows} prompts of 16-{16 + 8 * (args.rows - 1)} tokens, {args.new_tokens} new tokens each, greedy")
    print(f"{'layout':18s} {'step ms':>8s} {'tokens/s':>9s} {'collectives per step':>22s} {'bytes per device':>17s} "
          f"{'blocking per layer':>19s}")
    layouts = (("one device", 1), ("tensor=2", 2), ("tensor=4", 4), ("tensor=8", 8), ("tensor=2,delay=1", 2), ("tensor=4,delay=1", 4))
    for strategy, devices in layouts:
        layout = None if devices == 1 else build_layout(parse_strategy(strategy, devices), jax.devices()[:devices])
        decoder = Decoder(model, layout=layout, vocab=256)
        out = decoder.generate(prompts, args.new_tokens)
        if reference is None:
            reference = out.tokens
        if "delay" not in strategy:
            assert all(np.array_equal(a, b) for a, b in zip(out.tokens, reference)), f"{strategy} decodes other tokens than one device"
        steady = out.step_seconds[2:]
        text = decoder.compiled_step(args.rows, 127).as_text() if layout else ""
        cols = hlo.collectives(text, layout.mesh) if layout else []
        blocking = max((loop["blocking"] for loop in hlo.blocking_collectives(text)), default=0) if layout else 0
        sent = sum(c.bytes_per_step for c in cols)
        print(f"{strategy:18s} {1000 * statistics.median(steady):8.2f} {out.tokens_per_second:9.0f} "
              f"{sum(c.executions for c in cols):>22d} {sent:>17,.0f} {blocking:>19d}")
    print_roofline()


def print_roofline():
    from jaxpar.topology import load_topology

    latencies = (2e-6, 5e-6, 10e-6, 20e-6)
    print("\nroofline, batch 1, bf16 weights, 1024 tokens in the cache: decode latency per token (ms), TP / DTP")
    print(f"{'model':10s} {'topology':12s} {'tensor':>6s} " + " ".join(f"{'AR ' + str(round(a * 1e6)) + ' us':>15s}" for a in latencies))
    for name in ("llama-1b", "llama3-8b"):
        for topo, tensor in (("gpu-h100-8", 8), ("tpu-v5e-256", 4), ("tpu-v5e-256", 8)):
            topology = load_topology(topo)
            cells = []
            for latency in latencies:
                tp, dtp = (roofline.decode_latency(llama.CONFIGS[name], topology, tensor, 1024, delayed, latency) for delayed in (False, True))
                cells.append(f"{1000 * tp:6.3f} / {1000 * dtp:6.3f}")
            print(f"{name:10s} {topo:12s} {tensor:6d} " + " ".join(f"{c:>15s}" for c in cells))


if __name__ == "__main__":
    main()
