"""Your own mixture-of-experts model under expert parallelism, two ways, on 8 simulated CPU devices:

- ``PlainMoE``, plain Flax with no jaxpar call: its experts named ``experts`` are split over the
  ``expert`` axis by XLA's partitioner (the GSPMD path; XLA may warn that it replicates a tensor to
  re-split it: the partitioner's price for a layer that runs every expert on every token);
- ``RoutedMoE``, the same layer through ``jaxpar.nn.mixture_of_experts``: top-2 routing, grouped
  matmuls, the tokens sent to the devices that hold their experts and back (the manual path), the
  load-balancing loss, and a routing bias that no optimizer trains (``nn.RuleUpdated``: each step
  moves it by ``BIAS_RATE`` toward the experts that got fewer tokens, DeepSeek-V3's
  auxiliary-loss-free balancing, through ``experts.bias_steering``).

Each is trained under ``expert=4,fsdp=2`` and on one device, from the same weights and batches.

    python examples/own_moe.py [--steps 10] [--batch-size 16]

Exits with an error if a layout's final loss differs from one device's by more than TOLERANCE.
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

from jaxpar.experts import Routing, balance_loss, bias_steering  # noqa: E402
from jaxpar.nn import RuleUpdated, mixture_of_experts, reduce_partial  # noqa: E402
from jaxpar.parallel import build_layout, parse_strategy  # noqa: E402
from jaxpar.train.step import TrainConfig, Trainer  # noqa: E402

WIDTH, HIDDEN, EXPERTS, TOP_K = 16, 32, 8, 2
BIAS_RATE = 0.01
TOLERANCE = 1e-5  # fp32: the layouts differ only in the order of their sums


def named(names):
    return nnx.with_partitioning(nnx.initializers.normal(0.3), names)


class PlainMoE(nnx.Module):
    """Every expert runs on every token, weighed by its routing weight (zero where not chosen)."""

    def __init__(self, rngs):
        self.router = nnx.Param(named(("embed", None))(rngs.params(), (WIDTH, EXPERTS)))
        self.w_in = nnx.Param(named(("experts", "embed", "mlp"))(rngs.params(), (EXPERTS, WIDTH, HIDDEN)))
        self.w_out = nnx.Param(named(("experts", "mlp", "embed"))(rngs.params(), (EXPERTS, HIDDEN, WIDTH)))

    def __call__(self, x):
        probs = jax.nn.softmax(x @ self.router[...], axis=-1)
        top, chosen = jax.lax.top_k(probs, TOP_K)
        weights = jnp.sum(jax.nn.one_hot(chosen, EXPERTS) * (top / top.sum(-1, keepdims=True))[..., None], axis=-2)
        hidden = jax.nn.gelu(jnp.einsum("btd,xdh->btxh", x, self.w_in[...]))
        return jnp.einsum("btxd,btx->btd", jnp.einsum("btxh,xhd->btxd", hidden, self.w_out[...]), weights)


class RoutedMoE(nnx.Module):
    """The same kind of layer, SwiGLU experts, through jaxpar's op: it returns the output (partial
    sums over the experts' hidden width where tensor parallelism splits it) and the terms of the
    loss that balance the load: the balance loss, and the bias's steering term (0, its gradient the
    bias's step: added to the loss unweighted)."""

    def __init__(self, rngs):
        self.router = nnx.Param(named(("embed", None))(rngs.params(), (WIDTH, EXPERTS)))
        self.gate = nnx.Param(named(("experts", "embed", "mlp"))(rngs.params(), (EXPERTS, WIDTH, HIDDEN)))
        self.up = nnx.Param(named(("experts", "embed", "mlp"))(rngs.params(), (EXPERTS, WIDTH, HIDDEN)))
        self.down = nnx.Param(named(("experts", "mlp", "embed"))(rngs.params(), (EXPERTS, HIDDEN, WIDTH)))
        self.bias = RuleUpdated(jnp.zeros(EXPERTS), out_sharding=(None,))  # whole on every device: each routes

    def __call__(self, x):
        names = ("batch", "length", "embed")
        out, sums = mixture_of_experts(x, names, self.router[...], self.gate[...], self.up[...], self.down[...],
                                       Routing(EXPERTS, TOP_K), self.bias[...])
        return reduce_partial(out, ("mlp",), names), balance_loss(sums, TOP_K), bias_steering(self.bias[...], sums.copies, BIAS_RATE)


def plain_loss(model, batch):
    return jnp.mean((model(batch[..., :WIDTH]) - jnp.sin(batch[..., WIDTH:])) ** 2)


def routed_loss(model, batch):
    out, balance, steering = model(batch[..., :WIDTH])
    return jnp.mean((out - jnp.sin(batch[..., WIDTH:])) ** 2) + 0.01 * balance + steering


def final_loss(strategy: str, model, loss_fn, batches) -> float:
    devices = jax.devices()[:1] if strategy == "one device" else jax.devices()
    layout = build_layout(parse_strategy("data=1" if strategy == "one device" else strategy, len(devices)), devices)
    trainer = Trainer(layout, model, loss_fn, TrainConfig(learning_rate=1e-2, total_steps=len(batches)))
    state = trainer.init(seed=0)
    for batch in batches:
        state, metrics = trainer.step(state, trainer.put_batch(batch))
    return float(metrics["loss"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=16, help="a multiple of 8: the batch is split over every device")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    batches = [rng.standard_normal((args.batch_size, 8, 2 * WIDTH)).astype(np.float32) for _ in range(args.steps)]
    worst = 0.0
    for name, model, loss_fn in (("plain Flax (GSPMD)", PlainMoE, plain_loss), ("jaxpar's op (manual)", RoutedMoE, routed_loss)):
        one, split = (final_loss(s, model, loss_fn, batches) for s in ("one device", "expert=4,fsdp=2"))
        worst = max(worst, abs(split - one) / abs(one))
        print(f"{name:22s} final loss {split:.6f} under expert=4,fsdp=2, {one:.6f} on one device")
    print(f"largest relative difference from one device: {worst:.1e} (tolerance {TOLERANCE:.0e})")
    if worst > TOLERANCE:
        sys.exit(f"a layout disagrees with one device: relative difference {worst:.1e} > {TOLERANCE:.0e}")


if __name__ == "__main__":
    main()
