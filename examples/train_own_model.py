"""Train a Flax NNX model written here (not from jaxpar.models) under several layouts on 8
simulated CPU devices, and check each against the first: the layout changes where the work
happens, never the numbers.

    python examples/train_own_model.py
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxpar.parallel import build_layout, parse_strategy  # noqa: E402
from jaxpar.rules import reduce_partial  # noqa: E402
from jaxpar.train.step import TrainConfig, Trainer  # noqa: E402


class MLP(nnx.Module):
    def __init__(self, rngs):
        named = lambda names: nnx.with_partitioning(nnx.initializers.lecun_normal(), names)  # noqa: E731
        self.up = nnx.Linear(16, 64, kernel_init=named(("embed", "mlp")), use_bias=False, rngs=rngs)
        self.down = nnx.Linear(64, 16, kernel_init=named(("mlp", "embed")), use_bias=False, rngs=rngs)

    def __call__(self, x):
        # under tensor parallelism the down projection's sum over "mlp" spans devices
        return reduce_partial(self.down(jax.nn.gelu(self.up(x))), ("mlp",), ("batch", "embed"))


def loss_fn(model, batch):
    return jnp.mean((model(batch[:, :16]) - jnp.sin(batch[:, 16:])) ** 2)


def main():
    rng = np.random.default_rng(0)
    batches = [rng.standard_normal((32, 32)).astype(np.float32) for _ in range(20)]
    results = {}
    for text in ("data=8", "fsdp=8", "data=2,fsdp=4", "fsdp=4,tensor=2"):
        trainer = Trainer(build_layout(parse_strategy(text, jax.device_count())), MLP, loss_fn, TrainConfig(learning_rate=1e-2, total_steps=20))
        state = trainer.init(seed=0)
        for batch in batches:
            state, metrics = trainer.step(state, trainer.put_batch(batch))
        results[text] = float(metrics["loss"])
        print(f"{text:18s} final loss {results[text]:.6f}")
    first = next(iter(results.values()))
    print("largest difference from data=8:", max(abs(v - first) for v in results.values()))


if __name__ == "__main__":
    main()
