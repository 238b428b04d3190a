"""Asynchronous PipeDream on the tiny Llama: 4 stages x data=2, SGD after every micro-batch, weight
stashing; prints the staleness each stage trains with and the loss over the stream.

    python examples/pipedream.py [--microbatches 48] [--seq-len 32] [--learning-rate 0.5]

PipeDream runs 1F1B without a flush: stage s keeps S-s micro-batches in flight, so the gradient of
a micro-batch is computed at weights S-s-1 updates older than the ones it is applied to (0 on the
last stage). Weight stashing makes a micro-batch's forward and backward on a stage use the same
version. The same stream is also run as a single-device simulation of those stale updates
(``pipeline.simulate_pipedream``) and with no staleness at all (plain SGD, one micro-batch at a
time), for comparison. Exits with an error if the staleness is not S-s-1, if a stage trained with
other weight versions than the schedule's, or if the losses leave the simulation's.

This is the low-level API over one finite stream; to train with PipeDream, checkpoints and all,
``jaxpar train --strategy "stage=4,data=2" --schedule pipedream --microbatches 8``.
"""
import argparse
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxpar.models import llama  # noqa: E402
from jaxpar.analysis import overlap  # noqa: E402
from jaxpar.parallel.stage import pipeline, schedules  # noqa: E402
from jaxpar.train.state import abstract_model  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--microbatches", type=int, default=48, help="at least the 4 stages")
parser.add_argument("--seq-len", type=int, default=32)
parser.add_argument("--learning-rate", type=float, default=0.5)
args = parser.parse_args()

stages, m = 4, args.microbatches
# fp32; the pipeline and the simulation differ only in the order of their sums (measured 5e-7)
TOLERANCE = 1e-5
cfg = llama.CONFIGS["tiny"]
_, abstract = abstract_model(lambda r: llama.Llama(cfg, rngs=r))
with nnx.use_eager_sharding(False):
    params = nnx.to_pure_dict(nnx.state(llama.Llama(cfg, rngs=nnx.Rngs(0))))
split = pipeline.split_by_layer_stack(llama.pipeline_pieces(cfg), abstract)
stacked, edge = split.split(params)
pieces = split.pieces

schedule = schedules.pipedream(stages, m)
print(f"PipeDream, {stages} stages, a stream of {m} micro-batches; per stage:")
print(f"{'stage':>5} {'in flight':>9} {'staleness':>9} {'updates of all stages between F and B':>38}")
staleness = schedules.staleness(schedule)
for s, (flight, stale, delay) in enumerate(zip(schedule.peak_in_flight(), staleness, overlap.update_delays(schedule))):
    print(f"{s:>5} {flight:>9} {stale:>9} {delay:>38}")
if staleness != tuple(stages - s - 1 for s in range(stages)):
    sys.exit(f"staleness {staleness} per stage; PipeDream's is S-s-1 = {tuple(stages - s - 1 for s in range(stages))}")

# Sequences that count up from a random start: something SGD learns within a short stream.
starts = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(m, 4, 1))
tokens = (starts + np.arange(args.seq_len + 1)) % cfg.vocab_size
mesh = jax.make_mesh((stages, 2), ("stage", "data"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
common = dict(first_fn=pieces.first_fn, last_fn=pieces.last_fn, edge_params=edge, optimizer=optax.sgd(args.learning_rate))
run = jax.jit(lambda s, t: pipeline.pipedream_train(pieces.stage_fn, s, t, mesh, schedule, **common))
losses, _, _, versions = run(stacked, tokens)
if not np.array_equal(versions, schedules.weight_versions(schedule)):
    sys.exit("the stages trained with other weight versions than the schedule's")
simulated = pipeline.simulate_pipedream(pieces.stage_fn, stacked, tokens, stages, **common)[0]
fresh = pipeline.simulate_pipedream(pieces.stage_fn, stacked, tokens, 1, **common)[0]

print(f"\n{'micro-batches':>13} {'pipedream':>9} {'simulated':>9} {'no staleness':>12}  (mean loss)")
w = max(m // 6, 1)  # six windows over the stream
for a in range(0, m, w):
    window = slice(a, a + w)
    print(f"{a:>5}..{a + w - 1:<6} {float(np.mean(losses[window])):9.4f} {float(np.mean(simulated[window])):9.4f} "
          f"{float(np.mean(fresh[window])):12.4f}")
difference = float(np.max(np.abs(np.asarray(losses) - np.asarray(simulated))))
print(f"largest difference from the simulation: {difference:.2e} (tolerance {TOLERANCE:.0e})")
if difference > TOLERANCE:
    sys.exit("the pipeline's losses are not the simulation's")
