"""Serve a Llama trained as TP under delayed tensor parallelism (DTP), its heads and MLP columns
placed by affinity, on 8 simulated CPU devices.

    python examples/serve_delayed_tp.py [--steps 300] [--tensor 4] [--new-tokens 48]

Trains the tiny Llama as TP (``data=2,tensor=4``) on the main job's corpus, chooses a placement of
its units by affinity (``jaxpar.affinity``), and decodes corpus prompts greedily under TP and under
DTP (``tensor=4,delay=1``) with the placement. Checks its claims and exits non-zero if one fails:
the placement leaves the model's logits unchanged under TP (the same function, on one device), and
in the compiled decoding step each of TP's two all-reduces per layer blocks the next sublayer while
none of DTP's does.
"""
import argparse
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jaxpar import affinity  # noqa: E402
from jaxpar.analysis import hlo  # noqa: E402
from jaxpar.models import llama  # noqa: E402
from jaxpar.parallel import build_layout, parse_strategy  # noqa: E402
from jaxpar.serve.common import decode_tokens, encode_text  # noqa: E402
from jaxpar.serve.llama import Decoder  # noqa: E402
from jaxpar.train import data  # noqa: E402
from jaxpar.train.step import TrainConfig, Trainer  # noqa: E402


def model_fn(rngs):
    return llama.Llama(llama.CONFIGS["tiny"], rngs=rngs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--tensor", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=48)
    args = parser.parse_args()
    tokens, _ = data.split_corpus(data.corpus_tokens())
    model = model_fn(nnx.Rngs(0))
    if args.steps:
        trainer = Trainer(build_layout(parse_strategy(f"data={8 // args.tensor},tensor={args.tensor}", 8)), model_fn,
                          llama.loss_fn, TrainConfig(total_steps=args.steps))
        state = trainer.init(seed=0)
        for step in range(args.steps):
            state, metrics = trainer.step(state, trainer.put_batch(data.batch_at(tokens, step, 16, 129, seed=0)))
        print(f"trained as TP for {args.steps} steps: loss {float(metrics['loss']):.3f}")
        model = nnx.merge(trainer.graphdef, jax.device_get(state.params))
    weights = affinity.weights_of(model)
    placed = affinity.assign(weights, model.cfg, args.tensor)
    kept = {m: affinity.kept_coupling(weights, model.cfg, affinity.assign(weights, model.cfg, args.tensor, m)) for m in affinity.METHODS}
    print("coupling between consecutive sublayers kept on one device: " + ", ".join(f"{m} {100 * k:.1f}%" for m, k in kept.items()))
    permuted = nnx.merge(*nnx.split(model))  # a copy, its units then placed
    affinity.permute_model(permuted, placed)
    ids = jnp.asarray(tokens[None, :64])
    with jax.default_device(jax.devices()[0]):
        moved = float(jnp.max(jnp.abs(permuted(ids) - model(ids))))
    print(f"placed units, one device (TP's function): logits move by at most {moved:.2e}")

    prompts = [encode_text(p) for p in ("The model ", "def ")]
    devices = jax.devices()[: args.tensor]
    blocking = {}
    for name, served, strategy in (("TP", model, f"tensor={args.tensor}"), ("DTP, placed", permuted, f"tensor={args.tensor},delay=1")):
        decoder = Decoder(served, layout=build_layout(parse_strategy(strategy, args.tensor), devices), vocab=256)
        run = decoder.generate(prompts, args.new_tokens)
        blocking[name] = [loop["blocking"] for loop in hlo.blocking_collectives(decoder.compiled_step(len(prompts), 63).as_text())]
        print(f"\n{name} ({strategy}): {run.tokens_per_second:.0f} tokens/s on the simulated devices; "
              f"blocking all-reduces per layer {blocking[name]}")
        for out in run.tokens:
            print("  " + repr(decode_tokens(out)))

    if moved > 1e-4:
        print(f"FAILED: placing the units moved TP's logits by {moved}", file=sys.stderr)
        return 1
    if blocking["TP"] != [2] or blocking["DTP, placed"] != [0]:
        print(f"FAILED: blocking all-reduces per layer {blocking}, expected TP [2] and DTP [0]", file=sys.stderr)
        return 1
    print("\nchecked: the placement leaves TP's function unchanged; TP waits on 2 all-reduces per layer, DTP on none")
    return 0


if __name__ == "__main__":
    sys.exit(main())
