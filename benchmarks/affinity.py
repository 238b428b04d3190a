"""Affinity-aware sharding (``jaxpar/affinity.py``): the quality gap of delayed TP to TP on the main
job's corpus, with the heads and MLP columns placed by affinity, at random, or as they are.

    python benchmarks/affinity.py [--steps 600] [--tensor 2 4] [--finetune 100] [--held-out 8]

8 simulated CPU devices. The tiny Llama is trained as TP (``data=4,tensor=2``) for ``--steps`` on the
main job's corpus (its settings: batch 16, 128 tokens, AdamW). Its weights are then permuted for each
assignment of units to the ``--tensor`` shards (affinity; random, three seeds; identity) and
evaluated on ``--held-out`` held-out batches under TP and under DTP (``delay=1``): the mean loss,
and the gap of DTP's to TP's. A permuted model is the same function under TP, so TP's loss is one
number (checked to 1e-4). Then each DTP model trains ``--finetune`` more steps as DTP (the way a DTP
model is meant to be trained) and TP the same steps as TP, and the gaps are measured again: what
the comparison ends with. Printed with the coupling each assignment keeps on one device.
"""

from __future__ import annotations

import argparse
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxpar import affinity  # noqa: E402
from jaxpar.models import llama  # noqa: E402
from jaxpar.parallel import build_layout, parse_strategy  # noqa: E402
from jaxpar.train import data  # noqa: E402
from jaxpar.train.state import TrainState  # noqa: E402
from jaxpar.train.step import TrainConfig, Trainer  # noqa: E402

BATCH, SEQ = 16, 128


def model_fn(rngs):
    return llama.Llama(llama.CONFIGS["tiny"], rngs=rngs)


def state_of(trainer, params):
    shardings = trainer.state_shardings
    params = jax.device_put(params, shardings.params)
    return TrainState(params, jax.device_put(trainer.optimizer.init(params), shardings.opt_state),
                      jax.device_put(np.int32(0), shardings.step))


def train(trainer, state, tokens, steps: int, first: int = 0):
    for step in range(steps):
        state, _ = trainer.step(state, trainer.put_batch(data.batch_at(tokens, first + step, BATCH, SEQ + 1, seed=0)))
    return state


def held_out_loss(trainer, state, held, batches: int) -> float:
    # the step's loss is taken at the weights it is given (before its update), as the main job's evaluation
    return float(np.mean([float(trainer.step(state, trainer.put_batch(data.batch_at(held, i, BATCH, SEQ + 1, seed=1)))[1]["loss"])
                          for i in range(batches)]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--tensor", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--finetune", type=int, default=100)
    parser.add_argument("--held-out", type=int, default=8)
    args = parser.parse_args()
    tokens, held = data.split_corpus(data.corpus_tokens())
    cfg = llama.CONFIGS["tiny"]
    base = TrainConfig(total_steps=args.steps)
    teacher = Trainer(build_layout(parse_strategy("data=4,tensor=2", 8)), model_fn, llama.loss_fn, base)
    state = train(teacher, teacher.init(seed=0), tokens, args.steps)
    weights = jax.tree.map(np.asarray, jax.device_get(state.params))
    print(f"tiny Llama trained as TP (data=4,tensor=2) for {args.steps} steps of {BATCH} x {SEQ} tokens; held-out loss on "
          f"{args.held_out} batches; then {args.finetune} more steps each")
    tune = TrainConfig(learning_rate=1e-3, warmup_steps=0, total_steps=args.finetune, donate=False)  # a state is evaluated more than once
    for tensor in args.tensor:
        layouts = {name: build_layout(parse_strategy(f"data={8 // tensor},tensor={tensor}{extra}", 8))
                   for name, extra in (("tp", ""), ("dtp", ",delay=1"))}
        evaluate = {name: Trainer(layout, model_fn, llama.loss_fn, tune) for name, layout in layouts.items()}
        assignments = {"affinity": affinity.assign(weights, cfg, tensor, "affinity"), "identity": affinity.assign(weights, cfg, tensor, "identity"),
                       **{f"random {s}": affinity.assign(weights, cfg, tensor, "random", seed=s) for s in range(3)}}
        tp_start = tp_end = None
        print(f"\ntensor={tensor}")
        print(f"{'assignment':11s} {'coupling kept':>13s} {'TP loss':>8s} {'DTP loss':>9s} {'gap':>8s}   "
              f"{'after ' + str(args.finetune) + ' steps: TP':>22s} {'DTP':>7s} {'gap':>8s}")
        for name, chosen in assignments.items():
            permuted = affinity.permute(weights, cfg, chosen)
            tp = held_out_loss(evaluate["tp"], state_of(evaluate["tp"], permuted), held, args.held_out)
            if tp_start is None:
                tp_start = tp
                tp_end = held_out_loss(evaluate["tp"], train(evaluate["tp"], state_of(evaluate["tp"], weights), tokens, args.finetune,
                                                             first=args.steps), held, args.held_out)
            assert abs(tp - tp_start) < 1e-4, f"{name}: a permuted model must be the same function under TP ({tp} vs {tp_start})"
            start = state_of(evaluate["dtp"], permuted)
            dtp = held_out_loss(evaluate["dtp"], start, held, args.held_out)
            tuned = train(evaluate["dtp"], start, tokens, args.finetune, first=args.steps)
            dtp_end = held_out_loss(evaluate["dtp"], tuned, held, args.held_out)
            kept = affinity.kept_coupling(weights, cfg, chosen)
            print(f"{name:11s} {100 * kept:12.2f}% {tp:8.4f} {dtp:9.4f} {dtp - tp:+8.4f}   {tp_end:22.4f} {dtp_end:7.4f} "
                  f"{dtp_end - tp_end:+8.4f}")


if __name__ == "__main__":
    main()
