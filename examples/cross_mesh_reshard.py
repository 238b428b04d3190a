"""Move an array from one mesh to another: a pipeline stage on devices 0-3 hands a row-sharded
activation to the next stage on devices 4-7, which wants it replicated.

    python examples/cross_mesh_reshard.py [--rows 16] [--cols 8]

Prints the plan (each tile: who holds it, who needs it, who sends which piece) and checks the
move: same values, destination sharding, and the bytes the compiled program sends between the
meshes equal to what the plan says (one crossing per element; the naive way would send four).
Exits with an error if any of these fails.
"""
import argparse
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from jaxpar.analysis import hlo  # noqa: E402
from jaxpar.collectives.reshard import compile_reshard, reshard  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--rows", type=int, default=16, help="even: stage 0 splits them over data=2")
parser.add_argument("--cols", type=int, default=8)
args = parser.parse_args()

devices = jax.devices()
stage_0 = Mesh(np.array(devices[:4]).reshape(2, 2), ("data", "tensor"))
stage_1 = Mesh(np.array(devices[4:8]).reshape(2, 2), ("data", "tensor"))

activation = jax.device_put(np.arange(args.rows * args.cols, dtype=np.float32).reshape(args.rows, args.cols),
                            NamedSharding(stage_0, P("data")))  # rows over data, replicated over tensor
target = NamedSharding(stage_1, P())

program = compile_reshard(activation.shape, activation.dtype, activation.sharding, target)
print(program.plan)

moved = reshard(activation, target)
if not np.array_equal(np.asarray(moved), np.asarray(activation)):
    sys.exit("the moved array differs from the source")
if moved.sharding != target:
    sys.exit(f"the moved array has sharding {moved.sharding}, not {target}")
links = hlo.link_bytes(program.compiled.as_text(), program.mesh)  # what the compiled program sends
crossed = sum(b for (s, r), b in links.items() if s < 4 <= r)
if not crossed == program.plan.cross_mesh_bytes == activation.nbytes:
    sys.exit(f"{crossed} B crossed between the meshes, the plan says {program.plan.cross_mesh_bytes} B, "
             f"the array has {activation.nbytes} B")
print(f"\nmoved: values equal, sharding {moved.sharding.spec} on devices 4-7, "
      f"{crossed} B crossed between the meshes (naive: {program.plan.naive_bytes} B)")
