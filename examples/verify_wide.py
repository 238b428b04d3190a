"""Verify a network too wide for one device's memory: a plain Flax MLP whose CROWN program does not
fit one simulated device's budget fits under fsdp=8 and under tensor=4, and its bounds there hold.

    python examples/verify_wide.py [--width 512] [--layers 6] [--budget-mib 8] [--method crown]

1. The MLP (``nnx.Linear`` and ``jax.nn.relu``, random weights) and a box around one input.
2. Each layout's program is compiled, not run, first: what each device would hold (its shards of the
   weights, and the compiled temporaries: the bound matrices, a gathered layer, the relaxations),
   against the budget. One device does not fit; fsdp=8 (with the bound matrices whole on every
   device, and with each device bounding 1/8 of the specifications: ``share_specs``) and tensor=4
   do, and run.
3. Each bound that ran is checked on 1,000 inputs sampled in the box (every output inside its
   bounds), and the layouts' bounds against each other (fsdp=8 and tensor=4 to float32 rounding).

Exits with an error if one device fits the budget (nothing shown), a sharded layout does not fit,
or a bound fails its check.
"""
import argparse
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxpar.verify import compile_bound, from_nnx  # noqa: E402

MIB = 1 << 20
SHARED = "fsdp=8, specifications shared"
LAYOUTS = (("one device", "", False), ("fsdp=8", "fsdp=8", False), (SHARED, "fsdp=8", True), ("tensor=4", "tensor=4", False))


class WideMLP(nnx.Module):
    """What a plain Flax user writes: dense layers and ReLUs."""

    def __init__(self, inputs: int, width: int, layers: int, outputs: int, rngs):
        sizes = [inputs] + [width] * (layers - 1) + [outputs]
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes, sizes[1:])])

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


def held(program) -> int:
    """Bytes a device holds while the program runs: its arguments (the weight shards, the box) and
    the compiled temporaries."""
    return program.memory["argument_size"] + program.memory["temp_size"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--inputs", type=int, default=64)
    parser.add_argument("--budget-mib", type=float, default=8.0, help="each simulated device's memory")
    parser.add_argument("--method", default="crown")
    args = parser.parse_args()
    model = WideMLP(args.inputs, args.width, args.layers, 10, nnx.Rngs(0))
    net = from_nnx(model, (args.inputs,))
    centre = np.asarray(jax.random.normal(jax.random.key(1), (1, args.inputs)))
    lower, upper = centre - 0.01, centre + 0.01
    budget = args.budget_mib * MIB
    print(f"MLP {args.inputs}-{'-'.join([str(args.width)] * (args.layers - 1))}-10, {args.method}, budget "
          f"{args.budget_mib:g} MiB a device")
    fits, results = {}, {}
    for name, layout, share in LAYOUTS:
        program = compile_bound(net, 1, 10, args.method, layout, share_specs=share)
        fits[name] = held(program) <= budget
        print(f"  {name:30s} weights {program.weight_bytes / MIB:6.2f} MiB, temporaries "
              f"{program.memory['temp_size'] / MIB:6.2f} MiB, held {held(program) / MIB:6.2f} MiB: "
              + ("fits" if fits[name] else "does not fit"))
        if fits[name]:  # the program compiled above, run
            results[name] = program.run(net, lower, upper)
    points = lower + (upper - lower) * np.asarray(jax.random.uniform(jax.random.key(2), (1000, args.inputs)))
    outputs = np.asarray(model(points))
    failures = [layout for layout, r in results.items()
                if not ((outputs >= r.lower - 1e-5).all() and (outputs <= r.upper + 1e-5).all())]
    for layout, r in results.items():
        print(f"  {layout}: bounds of output 0 [{r.lower[0, 0]:.5f}, {r.upper[0, 0]:.5f}], mean width "
              f"{(r.upper - r.lower).mean():.5f}; all 1,000 sampled outputs inside: {layout not in failures}")
    if fits["one device"] or not (fits["fsdp=8"] and fits[SHARED] and fits["tensor=4"]) or failures:
        print("example failed: one device fits, a sharded layout does not, or a bound does not hold", file=sys.stderr)
        return 1
    difference = max(np.abs(results[name].lower - results["tensor=4"].lower).max()
                     + np.abs(results[name].upper - results["tensor=4"].upper).max() for name in ("fsdp=8", SHARED))
    print(f"fsdp=8 and tensor=4 bound the network one device cannot hold; their bounds differ by {difference:.2g}")
    return 0 if difference < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
