"""Your own corpus and tokenizer, with jaxpar's Llama and with a Flax model of your own.

    python examples/own_data.py [--dir runs/own-data] [--steps 60]

1. Writes a small corpus in three formats (plain text split on blank lines, JSON Lines, Parquet):
   stand-ins for your files. Give yours to ``jaxpar train --data`` the same way.
2. Trains a byte-level BPE tokenizer on it with Hugging Face ``tokenizers`` (with a tokenizer.json
   or SentencePiece .model of your own, skip this and pass it to ``--tokenizer``).
3. Writes a run file and trains jaxpar's Llama with ``jaxpar train --config run.toml``: the
   corpus is tokenized once into a cache beside it, packed into rows, the held-out loss measured
   every few steps, every step's figures written for TensorBoard.
4. Continues a prompt with ``jaxpar generate``, which reads the tokenizer kept with the checkpoint.
5. Feeds a Flax NNX model written here (nnx.Embed, nnx.Linear, an optax loss) from the same
   token cache through ``jaxpar.corpus.Windows`` under fsdp=4,tensor=2, and checks its losses
   against the same model trained on one device.

Exits with an error if the held-out loss does not fall or the layout's losses differ from one
device's by more than TOLERANCE (relative).
"""
import argparse
import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from flax import nnx  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from jaxpar import cli, corpus  # noqa: E402
from jaxpar.parallel import build_layout, parse_strategy  # noqa: E402
from jaxpar.train.step import TrainConfig, Trainer  # noqa: E402

# fp32: a layout differs from one device only in the order of its sums
TOLERANCE = 1e-5
ANIMALS = "cat dog owl fox bee ant elk yak emu cod".split()
VERBS = "sees chases follows greets ignores feeds".split()


def sentence(rng) -> str:
    return f"the {rng.choice(ANIMALS)} {rng.choice(VERBS)} the {rng.choice(ANIMALS)}."


def write_corpus(directory: str) -> list[str]:
    """Documents of a few sentences each, in the three formats; returns the texts."""
    rng = np.random.default_rng(0)
    texts = [" ".join(sentence(rng) for _ in range(rng.integers(2, 12))) for _ in range(240)]
    with open(os.path.join(directory, "notes.txt"), "w") as f:
        f.write("\n\n".join(texts[:80]))
    with open(os.path.join(directory, "records.jsonl"), "w") as f:
        f.writelines(json.dumps({"id": i, "body": text}) + "\n" for i, text in enumerate(texts[80:160]))
    pq.write_table(pa.table({"body": texts[160:]}), os.path.join(directory, "rows.parquet"))
    return texts


def train_tokenizer(path: str, texts: list[str], size: int = 400):
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=size, special_tokens=["<unk>"],
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(path)


class TinyLM(nnx.Module):
    """A next-token model as a plain Flax user writes one, its weights named by logical axes and
    no jaxpar call in it: XLA's partitioner places its collectives (jaxpar's GSPMD path)."""

    def __init__(self, vocab: int, rngs: nnx.Rngs):
        named = lambda names: nnx.with_partitioning(nnx.initializers.lecun_normal(), names)  # noqa: E731
        self.embed = nnx.Embed(vocab, 32, embedding_init=nnx.with_partitioning(nnx.initializers.normal(0.02), ("vocab", "embed")),
                               rngs=rngs)
        self.up = nnx.Linear(32, 128, kernel_init=named(("embed", "mlp")), use_bias=False, rngs=rngs)
        self.down = nnx.Linear(128, 32, kernel_init=named(("mlp", "embed")), use_bias=False, rngs=rngs)
        self.head = nnx.Linear(32, vocab, kernel_init=named(("embed", "vocab")), use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        return self.head(x + self.down(jax.nn.gelu(self.up(x))))


def lm_loss(model, rows):
    return optax.softmax_cross_entropy_with_integer_labels(model(rows[:, :-1]), rows[:, 1:]).mean()


def own_model_losses(data: str, tokenizer_path: str, strategy: str, devices, steps: int) -> list[float]:
    """``TinyLM`` trained for ``steps`` on windows of the corpus under ``strategy`` on ``devices``."""
    train = corpus.open_corpus(data, corpus.load(tokenizer_path), field="body", separator="\n\n")
    reader = corpus.Windows(train, 32, 8, seed=0)  # rows of 33 tokens, 8 a step, in a seeded order
    vocab = -(-train.tokenizer.vocab_size // 128) * 128  # padded: any tensor degree up to 128 splits it
    trainer = Trainer(build_layout(parse_strategy(strategy, len(devices)), devices), lambda rngs: TinyLM(vocab, rngs), lm_loss,
                      TrainConfig(learning_rate=3e-3, total_steps=steps))
    state, losses = trainer.init(seed=0), []
    for step in range(steps):
        # each process reads only its own rows of the global batch
        batch = trainer.put_process_batch(8, lambda first, stop, step=step: reader.rows(step, first, stop))
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="runs/own-data", help="where the corpus, tokenizer, checkpoints and logs go (made empty)")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    if os.listdir(args.dir):
        sys.exit(f"{args.dir} is not empty: give a new --dir")
    texts = write_corpus(args.dir)
    tokenizer = os.path.join(args.dir, "tokenizer.json")
    train_tokenizer(tokenizer, texts)
    data = ",".join(os.path.join(args.dir, name) for name in ("notes.txt", "records.jsonl", "rows.parquet"))
    every = max(args.steps // 4, 1)
    run_file = os.path.join(args.dir, "run.toml")
    with open(run_file, "w") as f:  # every flag of jaxpar train is a key of the same name
        f.write(f'model = "tiny"\nstrategy = "fsdp=4,tensor=2"\nsteps = {args.steps}\nbatch-size = 8\nseq-len = 64\n'
                f'data = "{data}"\ndata-field = "body"\ndata-separator = "\\n\\n"\ntokenizer = "{tokenizer}"\n'
                f'packing = "on"\neval-fraction = 0.1\neval-every = {every}\nlearning-rate = 3e-3\nwarmup-steps = 5\n'
                f'tensorboard = "{os.path.join(args.dir, "board")}"\n')
    metrics = os.path.join(args.dir, "metrics.json")
    checkpoints = os.path.join(args.dir, "ckpt")
    if cli.main(["train", "--config", run_file, "--checkpoint-dir", checkpoints, "--metrics-json", metrics]):
        sys.exit("jaxpar train failed")
    with open(metrics) as f:
        held_out = json.load(f)["held_out_losses"]
    print("held-out loss by step: " + ", ".join(f"{step}: {loss:.3f}" for step, loss in held_out))
    if not held_out[-1][1] < held_out[0][1]:
        sys.exit(f"the held-out loss did not fall: {held_out}")
    if cli.main(["generate", "--checkpoint-dir", checkpoints, "--prompt", "the owl", "--max-new-tokens", "12"]):
        sys.exit("jaxpar generate failed")
    steps = min(args.steps, 20)
    one = own_model_losses(data, tokenizer, "data=1", jax.devices()[:1], steps)
    split = own_model_losses(data, tokenizer, "fsdp=4,tensor=2", jax.devices(), steps)
    worst = max(abs(a - b) / abs(a) for a, b in zip(one, split))
    print(f"your model on your data: loss {one[0]:.3f} -> {one[-1]:.3f} in {steps} steps; fsdp=4,tensor=2 against one "
          f"device: largest relative difference {worst:.1e} (tolerance {TOLERANCE:.0e})")
    if worst > TOLERANCE or not one[-1] < one[0]:
        sys.exit("your model under fsdp=4,tensor=2 does not train like on one device")


if __name__ == "__main__":
    main()
