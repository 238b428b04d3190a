"""Train a small vision encoder and a language model as a 2-stage pipeline of different modules,
each under its own layout: the encoder under data=4 on devices 0-3, the LM under data=2,tensor=2
on devices 4-7, 1F1B over 4 micro-batches, AdamW.

    python examples/multimodal_pipeline.py [--steps 30] [--microbatches 4] [--rows 8]

The task: each image is a row of patches, each patch a noisy picture of one token; the caption
names the image's tokens in order. Without the image the caption is a guess (log of the vocabulary);
the LM reads the image through the encoder's output, which crosses between the stages' layouts
(resharded by the cross-mesh planner, forward and backward). Checks the first step's loss and
gradients against the same two modules on one device, prints the loss per step and the bytes that
crossed, and exits with an error if the loss does not fall below the guess.
"""
import argparse
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxpar.nn import residual_add  # noqa: E402
from jaxpar.parallel.stage import mpmd, schedules  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--microbatches", type=int, default=4)
parser.add_argument("--rows", type=int, default=8, help="images per micro-batch (both stages split them over data)")
args = parser.parse_args()

VOCAB, PATCHES, PIXELS, VISION, WIDTH, HEADS = 16, 6, 20, 32, 48, 4
FEATURES = ("batch", None, "embed")  # the encoder's output, as it crosses to the LM
names = nnx.with_partitioning
normal = nnx.initializers.normal(0.1)


class PatchEncoder(nnx.Module):
    """Patches -> features: a projection and a self-attention over the patches (plain Flax; under
    data parallelism nothing in it is split but the batch)."""

    def __init__(self, rngs):
        self.project = nnx.Linear(PIXELS, VISION, kernel_init=names(normal, (None, "embed")), rngs=rngs)
        self.attend = nnx.MultiHeadAttention(HEADS, VISION, decode=False, rngs=rngs)
        self.norm = nnx.LayerNorm(VISION, rngs=rngs)

    def __call__(self, patches):
        x = self.project(patches)
        return self.norm(x + self.attend(x))


class Captioner(nnx.Module):
    """Image features and caption tokens -> next-token logits of the caption. Heads and hidden units
    are split over tensor; its two writes to the stream are summed there by residual_add."""

    def __init__(self, rngs):
        self.bridge = nnx.Linear(VISION, WIDTH, kernel_init=names(normal, (None, "embed")), rngs=rngs)
        self.tokens = nnx.Embed(VOCAB, WIDTH, embedding_init=names(normal, (None, "embed")), rngs=rngs)
        self.query, self.key, self.value = (
            nnx.Linear(WIDTH, WIDTH, kernel_init=names(normal, ("embed", "heads")), use_bias=False, rngs=rngs) for _ in range(3))
        self.mix = nnx.Linear(WIDTH, WIDTH, kernel_init=names(normal, ("heads", "embed")), use_bias=False, rngs=rngs)
        self.hidden = nnx.Linear(WIDTH, 4 * WIDTH, kernel_init=names(normal, ("embed", "mlp")),
                                 bias_init=names(nnx.initializers.zeros, ("mlp",)), rngs=rngs)
        self.back = nnx.Linear(4 * WIDTH, WIDTH, kernel_init=names(normal, ("mlp", "embed")), use_bias=False, rngs=rngs)
        self.norm = nnx.RMSNorm(WIDTH, rngs=rngs)
        self.logits = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

    def __call__(self, features, caption):
        x = jnp.concatenate([self.bridge(features), self.tokens(caption)], axis=1)
        rows, length, _ = x.shape
        q, k, v = (f(x).reshape(rows, length, -1, WIDTH // HEADS) for f in (self.query, self.key, self.value))
        attended = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(rows, length, -1)
        x = residual_add(x, self.mix(attended), ("heads",), FEATURES)[0]
        x = residual_add(x, self.back(jax.nn.relu(self.hidden(x))), ("mlp",), FEATURES)[0]
        return self.logits(self.norm(x))[:, PATCHES:]


def encode(encoder, _, batch):
    return encoder(batch["patches"])


def caption_loss(captioner, features, batch):
    logits = captioner(features, batch["caption"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["caption"][:, 1:]).mean()


glyphs = np.random.default_rng(0).standard_normal((VOCAB, PIXELS)).astype(np.float32)  # each token's picture


def batches(rng, m, rows):
    """m micro-batches of `rows` images: patch i pictures token t_i (with noise); the caption is
    a start token then t_0 ... t_{P-1}."""
    tokens = rng.integers(1, VOCAB, size=(m, rows, PATCHES))
    patches = glyphs[tokens] + 0.5 * rng.standard_normal((m, rows, PATCHES, PIXELS)).astype(np.float32)
    caption = np.concatenate([np.zeros((m, rows, 1), np.int64), tokens], axis=-1)
    return {"patches": patches, "caption": caption}


with nnx.use_eager_sharding(False):  # (the names are for the stages' layouts)
    encoder, captioner = PatchEncoder(nnx.Rngs(0)), Captioner(nnx.Rngs(1))
layouts = mpmd.stage_layouts(["data=4", "data=2,tensor=2"])
pipe = mpmd.ModulePipeline([mpmd.ModuleStage(encoder, encode, sends=FEATURES), mpmd.ModuleStage(captioner, caption_loss)],
                           layouts, schedules.one_f_one_b(2, args.microbatches))
print(pipe.schedule.chart())
params = [nnx.to_pure_dict(nnx.state(encoder)), nnx.to_pure_dict(nnx.state(captioner))]


def one_device_loss(params, batch):
    """The two modules composed on one device, the mean over the micro-batches."""
    modules = []
    for module, weights in zip((encoder, captioner), params):
        graphdef, state = nnx.split(module)
        state = jax.tree.map(lambda v: v, state)  # (a copy to fill)
        nnx.replace_by_pure_dict(state, weights)
        modules.append(nnx.merge(graphdef, state))
    m = batch["caption"].shape[0]
    return sum(caption_loss(modules[1], encode(modules[0], (), mb), mb)
               for mb in (jax.tree.map(lambda x, i=i: x[i], batch) for i in range(m))) / m


optimizer = optax.adamw(1e-2, weight_decay=0.01)
weights = pipe.place(params)
states = pipe.init_optimizer(optimizer, weights)
rng = np.random.default_rng(1)
losses = []
for step in range(1, args.steps + 1):
    batch = batches(rng, args.microbatches, args.rows)
    loss, grads = pipe.value_and_grad(weights, batch)
    if step == 1:  # the pipeline against one device, on the same weights and batch
        want, want_grads = jax.value_and_grad(one_device_loss)(params, batch)
        # (against the largest gradient entry of all: the keys' bias has a gradient of zero but for rounding)
        largest = max(float(np.max(np.abs(b))) for b in jax.tree.leaves(want_grads))
        worst = max(float(np.max(np.abs(a - b))) for a, b in
                    zip(jax.tree.leaves(pipe.stage_weights(grads)), jax.tree.leaves(want_grads))) / largest
        if abs(float(loss) - float(want)) > 1e-5 * abs(float(want)) or worst > 1e-4:
            sys.exit(f"step 1 differs from one device: loss {float(loss):.6f} against {float(want):.6f}, "
                     f"gradients {worst:.2e} of the largest entry apart")
        print(f"step 1 equals one device: loss {float(loss):.6f}, gradients within {worst:.1e} of the largest entry")
    weights, states = pipe.apply_gradients(optimizer, weights, grads, states)
    losses.append(float(loss))
    print(f"step {step:3d}  loss {losses[-1]:.4f}")

t = pipe.traffic
print(f"\nbetween the stages per step: {t.transfers} transfers, {(t.forward_bytes + t.backward_bytes) / 2**10:.0f} KiB "
      f"(the image features forward, their gradient back)")
guess = np.log(VOCAB - 1)  # a caption token drawn without the image
if not losses[-1] < guess:
    sys.exit(f"the loss did not fall below a guess without the image ({guess:.3f}): {losses[-1]:.4f} at step {len(losses)}")
print(f"the loss fell from {losses[0]:.4f} to {losses[-1]:.4f}, below a guess without the image ({guess:.3f})")
