"""Weights in and out: a trained jaxpar Llama written in the Hugging Face layout, read back, then
fine-tuned and served.

    python examples/hf_weights.py [--dir runs/hf-weights] [--steps 20]

1. ``jaxpar train`` trains the main job's tiny Llama (your own run, or any Llama checkpoint).
2. ``jaxpar convert --from CKPT --to-hf DIR`` writes it as Hugging Face does: config.json and
   safetensors files of at most ``--max-shard-size`` with their index (small here, so that there
   are several), tensor by tensor; any tool that reads a Hugging Face Llama reads them.
3. ``jaxpar convert --from-hf DIR --to CKPT`` reads such a directory (a published Llama's, once
   downloaded) back into a verified jaxpar checkpoint, tensor by tensor.
4. ``jaxpar train --init-from CKPT`` fine-tunes from it, and ``jaxpar generate`` serves the result.

Exits with an error if the weights read back differ from the trained ones by a single bit, or the
fine-tune does not start where the trained model left off.
"""
import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
from safetensors import safe_open  # noqa: E402

from jaxpar import cli  # noqa: E402
from jaxpar.train.checkpoint import load_arrays  # noqa: E402

SHAPES = ["--batch-size", "8", "--seq-len", "64"]


def jaxpar(*argv: str):
    if cli.main(list(argv)):
        sys.exit(f"jaxpar {argv[0]} failed")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="runs/hf-weights", help="where the checkpoints and files go (made empty)")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    if os.listdir(args.dir):
        sys.exit(f"{args.dir} is not empty: give a new --dir")
    run, hf, back, tuned = (os.path.join(args.dir, name) for name in ("run", "hf", "converted", "tuned"))
    jaxpar("train", "--model", "tiny", "--steps", str(args.steps), *SHAPES, "--checkpoint-dir", run,
           "--metrics-json", os.path.join(args.dir, "run.json"))
    jaxpar("convert", "--from", run, "--to-hf", hf, "--max-shard-size", "400KB")
    with open(os.path.join(hf, "model.safetensors.index.json")) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    with safe_open(os.path.join(hf, files[0]), "np") as f:
        first = {name: f.get_slice(name).get_shape() for name in list(f.keys())[:3]}
    print(f"Hugging Face layout: {len(files)} files ({', '.join(files)}); in the first, e.g. {first}")
    jaxpar("convert", "--from-hf", hf, "--to", back)
    trained, _ = load_arrays(run)
    converted, _ = load_arrays(back)
    params = [path for path in trained if path.startswith("params/")]
    differ = [path for path in params if not np.array_equal(trained[path], converted[path])]
    print(f"read back: {len(params) - len(differ)} of {len(params)} weights bitwise equal to the trained ones")
    if differ or set(params) != set(converted):
        sys.exit(f"the weights read back differ: {differ or sorted(set(params) ^ set(converted))}")
    jaxpar("train", "--init-from", back, "--steps", str(max(args.steps // 4, 2)), *SHAPES, "--seed", "1", "--checkpoint-dir", tuned,
           "--metrics-json", os.path.join(args.dir, "tuned.json"))
    losses = [json.load(open(os.path.join(args.dir, name)))["losses"] for name in ("run.json", "tuned.json")]
    print(f"trained: loss {losses[0][0]:.3f} -> {losses[0][-1]:.3f}; the fine-tune starts at {losses[1][0]:.3f}")
    if not losses[1][0] < losses[0][0] - 0.5:
        sys.exit("the fine-tune did not start from the trained weights")
    jaxpar("generate", "--checkpoint-dir", tuned, "--prompt", "def ", "--max-new-tokens", "24")


if __name__ == "__main__":
    main()
