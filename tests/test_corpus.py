"""A user's own corpus and tokenizer (jaxpar.corpus, ``jaxpar train --data --tokenizer``): files
written here in each format are read as their documents, tokenized once into a cache that a changed
file invalidates, read through Grain exactly once per epoch whichever processes read which rows,
and trained on with a tokenizer trained here (its figures in TensorBoard), then generated from;
bad input is refused in words before any work."""
import dataclasses
import io
import json
import math
import re
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentencepiece
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from jaxpar import cli, corpus, scalars
from jaxpar.aot import compile_report
from jaxpar.errors import JaxparError
from jaxpar.flags import config_from_args
from jaxpar.models import llama
from jaxpar.run import RunConfig, check_same_function, first_batch, open_data, run_model_config, run_training
from jaxpar.serve.common import restore_model
from jaxpar.serve.llama import generate_from_checkpoint
from jaxpar.train.checkpoint import CheckpointConfig
from jaxpar.train.config import TrainConfig
from jaxpar.topology import load_topology

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


def text_of(i: int) -> str:
    """Document i: a few sentences of words in a seeded order (lengths vary from 3 to 60 words)."""
    rng = np.random.default_rng(i)
    return " ".join(rng.choice(WORDS, size=int(rng.integers(3, 60)))) + "."


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """One corpus in three formats: 12 plain text documents split by a blank line, 40 JSON Lines
    records (the text in "body") and 30 Parquet rows (column "body")."""
    root = tmp_path_factory.mktemp("corpus")
    (root / "notes.txt").write_text("\n\n".join(text_of(i) for i in range(12)))
    with open(root / "records.jsonl", "w") as f:
        for i in range(12, 52):
            f.write(json.dumps({"id": i, "body": text_of(i)}) + "\n")
    pq.write_table(pa.table({"body": [text_of(i) for i in range(52, 82)]}), root / "rows.parquet", row_group_size=7)
    return root


def test_each_format_reads_as_its_documents(files):
    for spec, field, separator, first, count in ((str(files / "notes.txt"), "text", "\n\n", 0, 12),
                                                  (str(files / "*.jsonl"), "body", None, 12, 40),
                                                  (str(files / "rows.parquet"), "body", None, 52, 30)):
        docs = list(corpus.sources.documents(corpus.sources.files(spec), field, separator))
        assert docs == [text_of(i) for i in range(first, first + count)], spec


def test_the_cache_is_made_once_and_a_changed_file_makes_a_new_one(files, tmp_path):
    logs = []
    source = tmp_path / "one.jsonl"
    source.write_text("".join(json.dumps({"text": text_of(i)}) + "\n" for i in range(5)))
    first = corpus.open_corpus(str(source), corpus.load("bytes"), log=logs.append)
    again = corpus.open_corpus(str(source), corpus.load("bytes"), log=logs.append)
    assert len(logs) == 1 and again.record["directory"] == first.record["directory"]  # read, not tokenized again
    assert [bytes(d.tolist()).decode() for d in again.documents()] == [text_of(i) for i in range(5)]
    source.write_text(source.read_text().replace("alpha", "omega"))
    changed = corpus.open_corpus(str(source), corpus.load("bytes"), log=logs.append)
    assert len(logs) == 2 and changed.record["directory"] != first.record["directory"]
    assert b"omega" in bytes(np.asarray(changed.tokens).astype(np.uint8))


@pytest.mark.parametrize("kind", [corpus.Windows, corpus.PackedRows])
def test_every_token_is_read_once_per_epoch_whichever_process_reads_which_rows(files, kind):
    whole = corpus.open_corpus(f"{files}/records.jsonl,{files}/rows.parquet", corpus.load("bytes"), field="body")
    reader = kind(whole, 24, 8, seed=3)
    records = reader.records if kind is corpus.Windows else len(reader.rows_of)
    steps = -(-records // 8)
    # two processes, each its half of every global batch; then one process reading all rows
    halves = [[reader.rows(step, a, b) for step in range(steps)] for a, b in ((0, 4), (4, 8))]
    alone = [reader.rows(step, 0, 8) for step in range(steps)]
    if kind is corpus.Windows:
        got = np.concatenate([np.concatenate(h) for h in zip(*halves)])
        np.testing.assert_array_equal(got, np.concatenate(alone))
        windows = [np.asarray(whole.tokens[w * 24:w * 24 + 25], np.int32).tobytes() for w in range(records)]
        assert records == (len(whole.tokens) - 1) // 24  # every prediction but the last partial window's
        assert sorted(row.tobytes() for row in got[:records]) == sorted(windows)  # the first epoch: each window once
        return
    for key in alone[0]:
        np.testing.assert_array_equal(np.concatenate([np.concatenate([h[s][key] for h in halves]) for s in range(steps)]),
                                      np.concatenate([a[key] for a in alone]))
    assert_each_prediction_once_an_epoch(alone, reader, whole)
    # a batch's weights make the mean over every slot the mean over the global batch's real tokens
    for r in alone:
        assert r["weights"].sum() == pytest.approx(r["weights"].size, rel=1e-5)


def assert_each_prediction_once_an_epoch(batches, reader: corpus.PackedRows, whole: corpus.Corpus):
    """The first epoch's rows of packed ``batches`` hold every document once (one longer than a row
    in pieces that overlap by one token: each of its predictions is made once)."""
    read = [(r["inputs"][i][r["segments"][i] == g], r["targets"][i][r["segments"][i] == g])
            for r in batches for i in range(len(r["segments"])) for g in range(1, r["segments"][i].max() + 1)]
    read = read[:sum(len(row) for row in reader.rows_of)]
    pieces = sorted(np.append(x, y[-1]).tobytes() for x, y in read)
    assert pieces == sorted(np.asarray(whole.tokens[a:b], np.int32).tobytes() for a, b in reader.pieces)
    assert sum(b - a - 1 for a, b in reader.pieces) == sum(b - a - 1 for a, b in whole.bounds)  # every prediction once


def train_bpe(path, texts):
    tokenizer = HFTokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"],
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(path))


def test_tokenizers_trained_here_round_trip(tmp_path):
    texts = [text_of(i) for i in range(200)]
    train_bpe(tmp_path / "tokenizer.json", texts)
    (tmp_path / "train.txt").write_text("\n".join(texts))
    sentencepiece.SentencePieceTrainer.train(input=str(tmp_path / "train.txt"), model_prefix=str(tmp_path / "sp"), vocab_size=80,
                                             model_type="bpe", minloglevel=2)
    for path, size in ((tmp_path / "tokenizer.json", 300), (tmp_path / "sp.model", 80)):
        tokenizer = corpus.load(str(path))
        assert tokenizer.vocab_size == size and tokenizer.end_id is not None
        for text in (text_of(500), "sigma tau."):
            ids = tokenizer.encode(text)
            assert max(ids) < size and len(ids) < len(text) and tokenizer.decode(ids) == text
    assert corpus.load("bytes").decode(corpus.load("bytes").encode("é x")) == "é x"


@pytest.mark.parametrize("kind", ["tokenizers", "sentencepiece"])
def test_training_on_your_corpus_with_your_tokenizer_then_generating_text(files, tmp_path, kind):
    texts = [text_of(i) for i in range(200)]
    if kind == "tokenizers":
        train_bpe(tmp_path / "tokenizer.json", texts)
        path, size = tmp_path / "tokenizer.json", 300
    else:
        (tmp_path / "train.txt").write_text("\n".join(texts))
        sentencepiece.SentencePieceTrainer.train(input=str(tmp_path / "train.txt"), model_prefix=str(tmp_path / "sp"),
                                                 vocab_size=80, model_type="bpe", minloglevel=2)
        path, size = tmp_path / "sp.model", 80
    run = RunConfig(model="tiny", strategy="fsdp=4,tensor=2", steps=6, batch_size=8, seq_len=32, seed=0,
                    data=f"{files}/records.jsonl,{files}/rows.parquet", data_field="body", tokenizer=str(path),
                    eval_data=str(files / "notes.txt"), data_separator="\n\n", tensorboard=str(tmp_path / "board"), eval_every=3)
    report = run_training(run, load_topology("cpu-8"), progress=None, checkpoint=CheckpointConfig(str(tmp_path / "run"), every=3))
    # TensorBoard's own reader finds every step's scalars, and the held-out loss at the end
    board = EventAccumulator(str(tmp_path / "board"))
    board.Reload()
    scalars = {tag: [(e.step, e.value) for e in board.Scalars(tag)] for tag in board.Tags()["scalars"]}
    assert scalars["train/loss"] == [(i + 1, pytest.approx(loss, rel=1e-6)) for i, loss in enumerate(report["losses"])]
    assert [step for step, _ in scalars["train/learning_rate"]] == list(range(1, 7)) and scalars["train/learning_rate"][0][1] == 0.0
    assert len(scalars["speed/tokens_per_s"]) == len(scalars["train/grad_norm"]) == 6
    # the held-out loss every 3 steps: at step 3 it is the loss of checkpoint 3's weights on one
    # device on the held-out batch; at step 6, the end's (computed by the step itself)
    _, held = open_data(run, print)
    rows = corpus.Windows(held, run.seq_len, run.batch_size, run.seed).rows(0, 0, run.batch_size)
    model, _ = restore_model(str(tmp_path / "run"), "llama", step=3)
    at_3 = pytest.approx(float(llama.loss_fn(model, rows)), rel=1e-5)
    assert report["held_out_losses"] == [[3, at_3], [6, pytest.approx(report["held_out_loss"], rel=1e-6)]]
    assert scalars["eval/held_out_loss"] == [(3, at_3), (6, pytest.approx(report["held_out_loss"], rel=1e-6))]
    # the vocabulary follows the tokenizer, padded to a multiple of 128; the loss starts near
    # ln(vocabulary) and falls; the held-out loss is read from the other file
    padded = -(-size // 128) * 128
    assert report["num_params"] == dataclasses.replace(llama.CONFIGS["tiny"], vocab_size=padded).num_params()
    assert math.log(padded) - 1 < report["losses"][0] < math.log(padded) + 1.2, report["losses"]
    assert report["losses"][-1] < report["losses"][0] - 0.5 and np.isfinite(report["held_out_loss"]), report["losses"]
    # the checkpoint keeps the tokenizer: generation reads it there, even with the original gone
    path.unlink()
    seen = []  # jaxpar generate's progress bar is fed these
    (out,), _ = generate_from_checkpoint(str(tmp_path / "run"), ["sigma tau"], 6, progress=seen.append)
    assert seen == [1, 2, 3, 4, 5, 6]
    words = corpus.load(str(next((tmp_path / "run").glob("tokenizer.*"))))
    assert out.text.startswith("sigma tau") and out.text == words.decode(out.tokens)
    assert out.tokens[:out.prompt_tokens].tolist() == words.encode("sigma tau") and out.tokens.max() < size


def test_bad_input_is_refused_in_words(files, tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "other.jsonl").write_text('{"body": "no text field"}\n')
    (tmp_path / "tokenizer.json").write_text("{not a tokenizer")
    cases = [
        (lambda: corpus.sources.files(str(tmp_path / "missing*.txt")), "no such file"),
        (lambda: corpus.sources.files(str(tmp_path / "empty.txt")), "empty.txt is empty"),
        (lambda: list(corpus.sources.documents([str(tmp_path / "bad.jsonl")])), "bad.jsonl line 2 is not JSON"),
        (lambda: list(corpus.sources.documents([str(tmp_path / "other.jsonl")])), r"line 1 has no field 'text' \(it has \['body'\]\)"),
        (lambda: list(corpus.sources.documents([str(files / "rows.parquet")], "text")), r"no column 'text' \(it has \['body'\]\)"),
        (lambda: corpus.load(str(tmp_path / "tokenizer.json")), "cannot be read as a Hugging Face tokenizer.json"),
        (lambda: corpus.load(str(tmp_path / "none.model")), "none.model: no such file"),
        (lambda: run_training(RunConfig(model="bd3lm-tiny", tokenizer=str(files / "notes.txt")), load_topology("cpu-8"), progress=None),
         "sets the vocabulary of next-token models"),
        (lambda: run_training(RunConfig(eval_data=str(files / "notes.txt")), load_topology("cpu-8"), progress=None),
         "no --data names one"),
    ]
    for call, message in cases:
        with pytest.raises(JaxparError, match=message):
            call()
    # a checkpoint trained with another tokenizer is refused from its meta, before any array is read
    train_bpe(tmp_path / "good.json", [text_of(i) for i in range(50)])
    meta = {"step": 4, "model": "tiny", "strategy": "data=8", "devices": 8, "tokenizer": {"spec": "bytes", "identity": "bytes"}}
    run = RunConfig(model="tiny", strategy="data=8", tokenizer=str(tmp_path / "good.json"))
    with pytest.raises(JaxparError, match="was trained with --tokenizer bytes"):
        check_same_function(run, None, None, "runs/x", meta)


def test_check_compile_and_bench_take_the_runs_data_settings(files, tmp_path, capsys):
    """``jaxpar check`` runs its one-device comparison on the run's first batch of ``--data``
    (packed documents of the JSON Lines file here); ``jaxpar compile`` compiles the step for the
    tokenizer's vocabulary and the packed batch; ``jaxpar bench`` passes them to each run."""
    train_bpe(tmp_path / "tokenizer.json", [text_of(i) for i in range(200)])
    own = ["--data", str(files / "records.jsonl"), "--data-field", "body", "--tokenizer", str(tmp_path / "tokenizer.json"),
           "--packing", "on"]
    assert cli.main(["check", "--model", "tiny", "--strategy", "fsdp=4,tensor=2", "--batch-size", "4", "--seq-len", "16", *own]) == 0
    assert "12 of 12 weights match" in capsys.readouterr().out
    run = RunConfig(model="tiny", batch_size=4, seq_len=16, data=str(files / "records.jsonl"), data_field="body",
                    tokenizer=str(tmp_path / "tokenizer.json"), packing=True)
    cfg = run_model_config(run)
    batch = first_batch(run, cfg)
    assert cfg.vocab_size == 384 and batch["segments"].shape == (4, 16) and batch["inputs"].max() < 300
    report = compile_report("tiny", load_topology("cpu-8"), "fsdp=4,tensor=2", 4, 16, TrainConfig(), tokenizer=run.tokenizer, packing=True)
    assert report["num_params"] == cfg.num_params() != llama.CONFIGS["tiny"].num_params()
    parsed = cli._parser("bench").parse_args(["bench", "--batch-size", "4", "--seq-len", "16", *own])
    assert config_from_args(RunConfig, parsed, "bench") == dataclasses.replace(run, steps=6)


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_is_a_bar_on_a_terminal_and_lines_in_a_log():
    """Steps: a rich bar on a terminal, a line at every 10% (and at each held-out loss) in a log;
    a compile: a spinner on a terminal, and its time either way."""
    log, screen = io.StringIO(), Terminal()
    for stream in (log, screen):
        bar = scalars.Progress(0, 20, stream)
        for done in range(1, 21):
            bar.update(done, f"loss {done}", always=done == 3)
        bar.close()
        with scalars.working("compiling the step", stream):
            time.sleep(0.05)
    lines = log.getvalue().splitlines()
    assert [line.split()[:3] for line in lines[:-1]] == [[f"{d}/20", "loss", str(d)] for d in (2, 3, *range(4, 21, 2))]
    assert re.fullmatch(r"compiling the step: 0\.[01] s", lines[-1])
    drawn = screen.getvalue()
    assert "20/20" in drawn and "loss 20" in drawn and re.search(r"compiling the step: 0\.[01] s\n$", drawn)
