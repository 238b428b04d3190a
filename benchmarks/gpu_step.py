"""Single-GPU training step of a Llama in bfloat16: median step time, tokens/s and MFU.

    python benchmarks/gpu_step.py [--model llama-1b] [--batch-size 8] [--seq-len 2048] [--json PATH]

MFU = model FLOPs per token (``LlamaConfig.flops_per_token``) x tokens per step / step time / the
card's dense bf16 peak (from the topology file matching the card: gpu-h100-1 or gpu-h200-1).
Float32 master weights and AdamW state, bfloat16 compute, random tokens.
"""

from __future__ import annotations

import argparse
import json
import time


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--remat", default="none", choices=["none", "full", "dots"])
    p.add_argument("--topology", help="default: gpu-h200-1 or gpu-h100-1, after the card")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()

    import jax
    import numpy as np

    from jaxpar.topology import load_topology
    from jaxpar.run import RunConfig, build_trainer
    from jaxpar.train.step import TrainConfig

    kind = jax.devices()[0].device_kind
    topology = load_topology(args.topology or ("gpu-h200-1" if "H200" in kind else "gpu-h100-1"))
    run = RunConfig(model=args.model, strategy="data=1", steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                    train=TrainConfig(compute_dtype="bfloat16", remat=args.remat))
    trainer, _, cfg = build_trainer(run, topology)
    started = time.perf_counter()
    state = trainer.init(0)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), dtype=np.int32)
    batch = trainer.put_batch(tokens)
    state, metrics = trainer.step(state, batch)  # compiles
    jax.block_until_ready(metrics["loss"])
    compile_s = time.perf_counter() - started
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        state, metrics = trainer.step(state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - start)
    step_s = float(np.median(times))
    tokens_per_step = args.batch_size * args.seq_len
    mfu = cfg.flops_per_token(args.seq_len) * tokens_per_step / step_s / topology.peak_bf16_flops
    peak = jax.devices()[0].memory_stats() or {}
    result = {
        "device": kind, "model": args.model, "batch": args.batch_size, "seq_len": args.seq_len, "remat": args.remat,
        "params": cfg.num_params(), "step_s": step_s, "tokens_per_s": tokens_per_step / step_s, "mfu": mfu,
        "compile_and_first_step_s": compile_s, "loss": float(metrics["loss"]),
        "peak_memory_gib": peak.get("peak_bytes_in_use", 0) / 2**30,
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
