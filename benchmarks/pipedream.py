"""PipeDream against 1F1B and LocalSGD in simulated time, with the delay against the theory's.

    python benchmarks/pipedream.py [--stages 2 4 8] [--seconds 900] [--llama-seconds 240]

Every method runs on one device as the optimizer it is (``jaxpar.analysis.stale_sgd``), plain
SGD, its clock the schedule's (a forward 1 unit, a backward 2):

- PipeDream: the asynchronous schedule exactly (weight stashing, an update per micro-batch and
  stage, no flush); Randomized PipeDream: the theory paper's stale block-SGD model of it, at the
  delays measured on the timed schedule (``overlap.update_delays``);
- 1F1B: one update a step of 4S micro-batches (its bubble in the clock);
- LocalSGD: S workers with the whole model (a local step: S forward-and-backwards), merged every
  H steps, the merge free or costing one local step.

Each method's learning rate is the best of a grid at the time budget. Two objectives: a quadratic
whose blocks are coupled (a random rotation of eigenvalues 0.05..1, gradient noise), and the tiny
Llama on the main job's corpus (its held-out loss; S = 2 and 4 stages of its layers).
"""
import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxpar.analysis import overlap, stale_sgd  # noqa: E402
from jaxpar.parallel.stage import schedules as sc  # noqa: E402

UNIT = 3.0  # one forward (1) and backward (2) of one stage
QUADRATIC_GRID = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6)
LLAMA_GRID = (0.03, 0.1, 0.3, 1.0)


def methods(stages: int, seconds: float):
    """name -> run(grad, blocks, lr): each method over ``seconds`` of simulated time."""
    delays = overlap.update_delays(sc.pipedream(stages, 8 * stages), 1.0, 2.0)
    micro = 4 * stages
    one_f_one_b = sc.one_f_one_b(stages, micro)
    step_s = overlap.schedule_seconds(one_f_one_b, 1.0, 2.0, 0.0)
    streamed = int(seconds / UNIT) - stages + 1  # micro-batches the stream finishes in time
    runs = {
        "pipedream": lambda g, b, lr: stale_sgd.pipedream(g, b, sc.pipedream(stages, max(streamed, stages)), lr),
        "randomized pipedream": lambda g, b, lr: stale_sgd.randomized_pipedream(g, b, delays, int(seconds / UNIT * stages), lr),
        f"1f1b (m={micro})": lambda g, b, lr: stale_sgd.flushed(g, b, one_f_one_b, max(1, int(seconds / step_s)), lr),
    }
    for period, sync in ((4, 0.0), (16, 0.0), (16, stages * UNIT)):
        rounds = max(1, int(seconds / (period * stages * UNIT + sync)))
        runs[f"localsgd (H={period}, merge {sync:g})"] = (
            lambda g, b, lr, p=period, s=sync, r=rounds: stale_sgd.local_sgd(g, b, stages, p, r, lr, sync_s=s))
    return runs, delays


def best(run, grad, blocks, loss_at, seconds: float, grid):
    """(loss at ``seconds`` and at half of it, lr) of the best learning rate of the grid."""
    scored = []
    for lr in grid:
        trajectory = run(grad, blocks, lr)
        final = loss_at(stale_sgd.at_seconds(trajectory, seconds))
        scored.append((final if np.isfinite(final) else np.inf, loss_at(stale_sgd.at_seconds(trajectory, seconds / 2)), lr))
    return min(scored)


def quadratic(stages: int, width: int = 64, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = np.linalg.qr(rng.standard_normal((width, width)))[0]
    a = q @ np.diag(np.geomspace(0.05, 1.0, width)) @ q.T
    noise = rng.standard_normal((200_000, width)) * 0.05

    def grad(blocks, i):
        x = np.concatenate(blocks)
        return 0.5 * x @ a @ x, np.split(a @ x + noise[i % len(noise)], stages)

    loss = lambda blocks: float(0.5 * np.concatenate(blocks) @ a @ np.concatenate(blocks))  # noqa: E731
    return grad, np.split(np.ones(width), stages), loss


def llama(stages: int, rows: int = 8, length: int = 64):
    """The tiny Llama cut into ``stages`` blocks of its layers (the embedding with the first, the
    final norm and head with the last), a micro-batch of the main job's corpus a call."""
    from flax import nnx

    from jaxpar.models import llama as model_lib
    from jaxpar.train import data

    cfg = model_lib.CONFIGS["tiny"]
    with nnx.use_eager_sharding(False):
        model = model_lib.Llama(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    if cfg.layers % stages:
        sys.exit(f"the tiny Llama's {cfg.layers} layers do not split over {stages} stages")
    k = cfg.layers // stages
    cut = lambda tree, s: jax.tree.map(lambda x: x[s * k:(s + 1) * k], tree)  # noqa: E731
    edge = {key: value for key, value in params.items() if key != "layers"}
    blocks = [{"layers": cut(params["layers"], s)} for s in range(stages)]
    blocks[0]["edge"] = edge  # (one copy of the edge weights, updated with the first stage)

    def whole(blocks):
        layers = jax.tree.map(lambda *xs: jnp.concatenate(xs), *[b["layers"] for b in blocks])
        return {**blocks[0]["edge"], "layers": layers}

    def loss_of(blocks, tokens):
        state = jax.tree.map(lambda v: v, nnx.state(model))
        nnx.replace_by_pure_dict(state, whole(blocks))
        return model_lib.loss_fn(nnx.merge(graphdef, state), tokens)

    tokens, held_out = data.split_corpus(data.corpus_tokens())
    step = jax.jit(jax.value_and_grad(loss_of))
    held = jnp.asarray(data.batch_at(held_out, 0, 32, length, seed=1))
    held_loss = jax.jit(loss_of)

    def grad(blocks, i):
        loss, grads = step(blocks, jnp.asarray(data.batch_at(tokens, i, rows, length, seed=0)))
        return loss, grads

    return grad, blocks, lambda blocks: float(held_loss(blocks, held))


def table(title: str, stages_list, make, seconds: float, grid):
    print(f"\n{title} ({seconds:g} units of simulated time; loss at half and at the end, the best lr of {grid})")
    for stages in stages_list:
        grad, blocks, loss_at = make(stages)
        runs, delays = methods(stages, seconds)
        print(f"S={stages}: PipeDream's delay on stage 0 {delays[0]:g} updates (theory S^2 - S/2 = {stages ** 2 - stages / 2:g}), "
              f"per stage {', '.join(f'{d:g}' for d in delays)}; start loss {loss_at(blocks):.4f}")
        for name, run in runs.items():
            final, half, lr = best(run, grad, blocks, loss_at, seconds, grid)
            print(f"  {name:30s} lr {lr:<5g} loss {half:9.4f} -> {final:9.4f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--seconds", type=float, default=900.0, help="simulated time of the quadratic's runs (units)")
    parser.add_argument("--llama-seconds", type=float, default=240.0, help="of the tiny Llama's (0: skip it)")
    args = parser.parse_args()
    table("quadratic, 64 dims in S coupled blocks", args.stages, quadratic, args.seconds, QUADRATIC_GRID)
    if args.llama_seconds:
        table("tiny Llama, main job's corpus, held-out loss", [s for s in args.stages if s <= 4], llama,
              args.llama_seconds, LLAMA_GRID)


if __name__ == "__main__":
    main()
