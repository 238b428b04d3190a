"""Train a Flax NNX model written here (not from jaxpar.models) under several layouts on 8
simulated CPU devices, and check each against the first: the layout changes where the work
happens, never the numbers.

    python examples/train_own_model.py [--steps 20] [--batch-size 32] [--layouts data=8 fsdp=4,tensor=2 ...]

Exits with an error if any layout's final loss differs from the first's by more than TOLERANCE (relative).
"""
import argparse
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxpar.parallel import build_layout, parse_strategy  # noqa: E402
from jaxpar.nn import reduce_partial  # noqa: E402
from jaxpar.train.step import TrainConfig, Trainer  # noqa: E402

LAYOUTS = ("data=8", "fsdp=8", "data=2,fsdp=4", "fsdp=4,tensor=2")
# fp32: the layouts differ only in the order of their sums (measured ~3e-8 after 20 steps)
TOLERANCE = 1e-5


class MLP(nnx.Module):
    def __init__(self, rngs):
        named = lambda names: nnx.with_partitioning(nnx.initializers.lecun_normal(), names)  # noqa: E731
        # the bias needs names too: under tensor parallelism it is split over "mlp" like its kernel's columns
        bias = nnx.with_partitioning(nnx.initializers.zeros_init(), ("mlp",))
        self.up = nnx.Linear(16, 64, kernel_init=named(("embed", "mlp")), bias_init=bias, rngs=rngs)
        self.down = nnx.Linear(64, 16, kernel_init=named(("mlp", "embed")), use_bias=False, rngs=rngs)

    def __call__(self, x):
        # under tensor parallelism the down projection's sum over "mlp" spans devices
        return reduce_partial(self.down(jax.nn.gelu(self.up(x))), ("mlp",), ("batch", "embed"))


def loss_fn(model, batch):
    return jnp.mean((model(batch[:, :16]) - jnp.sin(batch[:, 16:])) ** 2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="a multiple of 8: data=8 splits it over 8 devices")
    parser.add_argument("--layouts", nargs="+", default=LAYOUTS, help="strategies to compare; the first is the reference")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    batches = [rng.standard_normal((args.batch_size, 32)).astype(np.float32) for _ in range(args.steps)]
    results = {}
    for text in args.layouts:
        layout = build_layout(parse_strategy(text, jax.device_count()))
        trainer = Trainer(layout, MLP, loss_fn, TrainConfig(learning_rate=1e-2, total_steps=args.steps))
        state = trainer.init(seed=0)
        for batch in batches:
            state, metrics = trainer.step(state, trainer.put_batch(batch))
        results[text] = float(metrics["loss"])
        print(f"{text:18s} final loss {results[text]:.6f}")
    first = results[args.layouts[0]]
    worst = max(abs(v - first) for v in results.values()) / abs(first)
    print(f"largest relative difference from {args.layouts[0]}: {worst:.1e} (tolerance {TOLERANCE:.0e})")
    if worst > TOLERANCE:
        sys.exit(f"the layouts disagree: relative difference {worst:.1e} > {TOLERANCE:.0e}")


if __name__ == "__main__":
    main()
