"""Compressed all-reduce: accuracy (vNMSE) against wire bytes, per scheme, at 8 and 64 simulated ranks.

    python benchmarks/compressed_allreduce.py [--ranks 8 64] [--values 65536] [--llama]

Schemes: dynamiq (``compressed.all_reduce``, several average widths, butterfly and ring), the
naive per-hop uniform quantizer at int4 / int8, and the two-hop all-to-all (ZeRO++ qgZ style) at
int4 / int8. Wire bits per value are read from the compiled HLO (bytes one device sends for its
collectives, x 8 / values per rank) next to a float32 ring all-reduce's 2 (R - 1) / R x 32.
vNMSE = |estimate - exact sum|^2 / |exact sum|^2 for one seed. Each rank count runs in its own
process, since the simulated device count is fixed when JAX starts.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def _data(ranks: int, n: int, llama: bool):
    import numpy as np

    rng = np.random.default_rng(0)
    scale = np.repeat(np.exp(1.5 * rng.standard_normal(n // 512)), 512)
    sets = {
        "gradient-like": scale * (rng.standard_t(3, n) + 2 * rng.standard_t(3, (ranks, n))),
        "Student-t(3) iid": rng.standard_t(3, (ranks, n)),
    }
    if llama:
        sets["tiny-Llama grads"] = _llama_gradients(ranks)
    return sets


def _llama_gradients(ranks: int):
    import jax
    import numpy as np
    from flax import nnx

    from jaxpar.models import llama
    from jaxpar.train import data

    graphdef, state = nnx.split(llama.Llama(llama.CONFIGS["tiny"], rngs=nnx.Rngs(0)))
    grad = jax.jit(jax.grad(lambda st, b: llama.loss_fn(nnx.merge(graphdef, st), b)))
    tokens = data.corpus_tokens()
    flat = lambda g: np.concatenate([np.asarray(v).ravel() for v in jax.tree.leaves(g)])  # noqa: E731
    return np.stack([flat(grad(state, data.batch_at(tokens, r, 4, 64, 0))) for r in range(ranks)])


def _schemes(ranks: int):
    from jaxpar.collectives import compressed

    rows = []
    for algorithm in ("butterfly", "ring"):
        for bits in (3, 4, 5.125, 6, 8):
            if algorithm == "ring" and ranks > 8 and bits not in (5.125, 8):
                continue  # the 64-rank ring compiles 63 hops per width: two widths tell the story
            rows.append((f"dynamiq {bits} {algorithm}", lambda v, a=algorithm, b=bits: compressed.all_reduce(v, "r", bits=b, algorithm=a, min_size=16)))
        for bits in (4, 8):
            rows.append((f"per-hop int{bits} {algorithm}", lambda v, a=algorithm, b=bits: compressed.all_reduce(v, "r", scheme="uniform", bits=b, algorithm=a, min_size=16)))
    for bits in (4, 8):
        rows.append((f"two-hop int{bits} all-to-all", lambda v, b=bits: compressed.two_hop_all_reduce(v, "r", bits=b)))
    return rows


def worker(ranks: int, n: int, llama: bool):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    from jaxpar.analysis import hlo

    mesh = Mesh(np.array(jax.devices()[:ranks]), ("r",))
    moved = 2 * (ranks - 1) / ranks  # values per rank's value a ring all-reduce sends
    print(f"\n## {ranks} ranks, {n:,} values per rank")
    sets = _data(ranks, n, llama)
    names = list(sets)
    print("| scheme | wire bits per value | vs float32 ring | " + " | ".join(f"vNMSE {s}" for s in names) + " | compile s |")
    print("|---|---|---|" + "---|" * len(names) + "---|")
    for label, fn in _schemes(ranks):
        started = time.perf_counter()
        body = jax.shard_map(lambda v: fn(v[0])[None], mesh=mesh, in_specs=P("r"), out_specs=P("r"), check_vma=False)
        shape = jax.ShapeDtypeStruct((ranks, sets[names[0]].shape[1]), jnp.float32)
        compiled = jax.jit(body).lower(shape).compile()
        compile_s = time.perf_counter() - started
        sent = sum(v["bytes_per_device"] for v in hlo.summarize(hlo.collectives(compiled.as_text(), mesh)).values())
        errors = []
        for name in names:
            x = sets[name]
            if x.shape[1] != shape.shape[1]:
                compiled_x = jax.jit(body)
            else:
                compiled_x = compiled
            out = np.asarray(compiled_x(jnp.asarray(x, jnp.float32)), np.float64)[0]
            exact = np.asarray(x, np.float64).sum(0)
            errors.append(np.sum((out - exact) ** 2) / np.sum(exact**2))
        wire = sent * 8 / (shape.shape[1] * moved)
        print(f"| {label} | {wire:.2f} | {wire / 32:.3f} | " + " | ".join(f"{e:.2e}" for e in errors) + f" | {compile_s:.1f} |", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    p.add_argument("--values", type=int, default=65536, help="values per rank (default 65536)")
    p.add_argument("--llama", action="store_true", help="also the tiny Llama's gradients, one batch per rank (8 ranks: ~850k values)")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.values, args.llama)
    for ranks in args.ranks:
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={ranks}", JAX_PLATFORMS="cpu")
        cmd = [sys.executable, __file__, "--worker", str(ranks), "--values", str(args.values)] + (["--llama"] if args.llama else [])
        subprocess.run(cmd, env=env, check=True)


if __name__ == "__main__":
    main()
