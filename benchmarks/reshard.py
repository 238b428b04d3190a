"""Cross-mesh resharding: bytes and wall time of broadcast delivery against naive per-receiver sends.

    python benchmarks/reshard.py [--size 4096] [--runs 5]

8 simulated CPU devices: mesh A = devices 0-3 (2x2), mesh B = devices 4-7 (2x2). For each layout
pair, a float32 size x size array moves from A to B with ``jaxpar.collectives.reshard`` in both
modes. Bytes are read from the compiled HLO (collective-permutes): "cross" = sent from a device of
A to a device of B, "total" = every link (adds the all-gather inside B). Time: median of ``runs``
calls after the compile, and ``jax.device_put`` to the same sharding for reference. Simulated
devices share the host's memory and cores, so times show the work done, not a network's speed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from jaxpar.analysis import hlo  # noqa: E402
from jaxpar.collectives.reshard import compile_reshard  # noqa: E402

# (name, spec on A's axes (x, y), spec on B's axes (u, v))
PAIRS = [
    ("rows -> replicated", P(("x", "y")), P()),
    ("rows -> 2-D", P(("x", "y")), P("u", "v")),
    ("2-D -> cols", P("x", "y"), P(None, ("u", "v"))),
    ("replicated -> replicated", P(), P()),
    ("rows (2 replicas) -> rows", P("x"), P(("u", "v"))),
]


def _median_seconds(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(size: int, runs: int) -> None:
    devices = jax.devices()
    mesh_a = Mesh(np.array(devices[:4]).reshape(2, 2), ("x", "y"))
    mesh_b = Mesh(np.array(devices[4:8]).reshape(2, 2), ("u", "v"))
    in_a = {d.id for d in mesh_a.devices.flat}
    host = np.arange(size * size, dtype=np.float32).reshape(size, size)
    print(f"float32[{size},{size}] = {host.nbytes / 2**20:.0f} MiB, mesh A devices 0-3 -> mesh B devices 4-7, "
          f"median of {runs} runs")
    print(f"{'layouts':28} {'mode':10} {'cross MiB':>9} {'total MiB':>9} {'rounds':>6} {'compile s':>9} {'run s':>7}")
    for name, src_spec, dst_spec in PAIRS:
        src, dst = NamedSharding(mesh_a, src_spec), NamedSharding(mesh_b, dst_spec)
        x = jax.device_put(host, src)
        for broadcast in (True, False):
            start = time.perf_counter()
            program = compile_reshard(x.shape, x.dtype, src, dst, broadcast=broadcast)
            compile_s = time.perf_counter() - start
            links = hlo.link_bytes(program.compiled.as_text(), program.mesh)
            assert links == program.plan.link_bytes()
            cross = sum(b for (s, r), b in links.items() if s in in_a and r not in in_a)
            y = program(x)
            assert np.array_equal(np.asarray(y), host) and y.sharding == dst
            seconds = _median_seconds(lambda: program(x), runs)
            rounds = sum(r.phase != "local" for r in program.plan.rounds)
            print(f"{name:28} {'broadcast' if broadcast else 'naive':10} {cross / 2**20:9.0f} "
                  f"{sum(links.values()) / 2**20:9.0f} {rounds:6d} {compile_s:9.2f} {seconds:7.3f}")
        seconds = _median_seconds(lambda: jax.device_put(x, dst), runs)
        print(f"{name:28} {'device_put':10} {'':>9} {'':>9} {'':>6} {'':>9} {seconds:7.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    main(args.size, args.runs)
