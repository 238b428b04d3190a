"""Decoding a Llama with a KV cache (``serve/llama.py``) on one device and under tensor parallelism.

    python benchmarks/decode.py [--new-tokens 64] [--rows 4] [--model tiny]

8 simulated CPU devices: greedy decoding of ``--rows`` prompts of the corpus, ``--new-tokens`` each,
on one device and under ``tensor=2|4|8``: the median time of a decoding step after the compiles,
tokens per second over every row, and the collectives one decoding step waits on, from its
compiled program (count and bytes per device). The simulated devices share two cores, so a
step's time is every device's work added up, not the busiest device's on real hardware.
Every layout's tokens are checked against one device's.
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxpar.analysis import hlo  # noqa: E402
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
    print(f"{'layout':12s} {'step ms':>8s} {'tokens/s':>9s} {'collectives per step':>22s} {'bytes per device':>17s}")
    for strategy, devices in (("one device", 1), ("tensor=2", 2), ("tensor=4", 4), ("tensor=8", 8)):
        layout = None if devices == 1 else build_layout(parse_strategy(strategy, devices), jax.devices()[:devices])
        decoder = Decoder(model, layout=layout, vocab=256)
        out = decoder.generate(prompts, args.new_tokens)
        if reference is None:
            reference = out.tokens
        assert all(np.array_equal(a, b) for a, b in zip(out.tokens, reference)), f"{strategy} decodes other tokens than one device"
        steady = out.step_seconds[2:]
        cols = hlo.collectives(decoder.compiled_step(args.rows, 127).as_text(), layout.mesh) if layout else []
        sent = sum(c.bytes_per_step for c in cols)
        print(f"{strategy:12s} {1000 * statistics.median(steady):8.2f} {out.tokens_per_second:9.0f} "
              f"{sum(c.executions for c in cols):>22d} {sent:>17,.0f}")


if __name__ == "__main__":
    main()
