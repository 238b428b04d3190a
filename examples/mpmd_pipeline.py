"""Train the tiny Llama as a 2-stage MPMD pipeline: stage 0 on devices 0-3 with tensor=4, stage 1
on devices 4-7 with data=2,tensor=2, 1F1B over 8 micro-batches, AdamW.

    python examples/mpmd_pipeline.py [--steps 20] [--microbatches 8] [--rows 4] [--seq-len 64]

Each stage runs its own programs under its own layout; the residual stream and its gradient move
between the stages by cross-mesh resharding. Prints the loss per step, the bytes that crossed
between the stages per step (broadcast delivery against naive per-receiver sends), and the plan of
one activation transfer. Exits with an error if the last step's loss is not below the first's.
"""
import argparse
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from jaxpar.collectives.reshard import plan_reshard  # noqa: E402
from jaxpar.models import llama  # noqa: E402
from jaxpar.parallel.stage import mpmd, pipeline, schedules  # noqa: E402
from jaxpar.train.state import abstract_model  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--microbatches", type=int, default=8)
parser.add_argument("--rows", type=int, default=4, help="sequences per micro-batch (stage 1's data=2 splits them)")
parser.add_argument("--seq-len", type=int, default=64)
args = parser.parse_args()

cfg = llama.CONFIGS["tiny"]
graphdef, abstract = abstract_model(lambda r: llama.Llama(cfg, rngs=r))
with nnx.use_eager_sharding(False):
    params = nnx.to_pure_dict(nnx.state(llama.Llama(cfg, rngs=nnx.Rngs(0))))
# no pipeline code in the model: its loss is cut at the scan over its stacked layers
split = pipeline.split_at_layer_scan(llama.loss_fn, graphdef, abstract)

microbatches, rows, length = args.microbatches, args.rows, args.seq_len
layouts = mpmd.stage_layouts(["tensor=4", "data=2,tensor=2"])
pipe = mpmd.MPMDPipeline(split.pieces, layouts, schedules.one_f_one_b(2, microbatches), names=split.names,
                         activation_names=llama.RESIDUAL)
print(pipe.schedule.chart())

optimizer = optax.adamw(3e-3, weight_decay=0.1)
weights = pipe.place(*split.split(params))
states = pipe.init_optimizer(optimizer, weights)
# A repeating pattern the model can learn: each sequence counts up from a random start.
rng = np.random.default_rng(0)
losses = []
for step in range(1, args.steps + 1):
    starts = rng.integers(0, cfg.vocab_size, size=(microbatches, rows, 1))
    tokens = (starts + np.arange(length + 1)) % cfg.vocab_size
    loss, grads = pipe.value_and_grad(weights, tokens)
    weights, states = pipe.apply_gradients(optimizer, weights, grads, states)
    losses.append(float(loss))
    print(f"step {step:3d}  loss {losses[-1]:.4f}")

t = pipe.traffic
print(f"\nbetween the stages per step: {t.transfers} transfers, {(t.forward_bytes + t.backward_bytes) / 2**10:.0f} KiB "
      f"sent with broadcast delivery, {t.naive_bytes / 2**10:.0f} KiB with naive per-receiver sends")
shape = (rows, length, cfg.embed)
sender, receiver = (NamedSharding(layout.mesh, layout.spec(llama.RESIDUAL)) for layout in layouts)
print("\nplan of one activation transfer, stage 0 -> stage 1:")
print(plan_reshard(shape, np.float32, sender, receiver))
if not losses[-1] < losses[0]:
    sys.exit(f"the loss did not fall: {losses[0]:.4f} at step 1, {losses[-1]:.4f} at step {len(losses)}")
print(f"\nthe loss fell from {losses[0]:.4f} to {losses[-1]:.4f}")
