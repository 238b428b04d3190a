"""The main job's corpus (stdlib docstrings, byte tokens) and its deterministic batches."""

import collections
import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxpar.errors import JaxparError
from jaxpar.train import data


@pytest.fixture(scope="module")
def tokens():
    return data.corpus_tokens()


def test_corpus_is_rebuilt_identically():
    first = data.corpus_bytes()
    data.corpus_bytes.cache_clear()
    assert data.corpus_bytes() == first
    # Another process with another string-hash seed builds the same bytes.
    code = (
        "import hashlib; from jaxpar.train import data; "
        "print(hashlib.sha256(data.corpus_bytes()).hexdigest())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    other = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert other == hashlib.sha256(first).hexdigest()


def test_corpus_size_near_target():
    for target in (50_000, 400_000):
        assert target - 4 <= len(data.corpus_bytes(target)) <= target


def test_corpus_is_english():
    words = data.corpus_bytes().decode("utf-8").lower().split()
    common = {w for w, _ in collections.Counter(words).most_common(20)}
    assert {"the", "of", "to", "a", "is"} <= common


def test_tokens_are_int32_bytes(tokens):
    assert tokens.dtype == np.int32 and tokens.ndim == 1
    assert tokens.min() >= 0 and tokens.max() < data.VOCAB_SIZE
    np.testing.assert_array_equal(tokens, np.frombuffer(data.corpus_bytes(), np.uint8))


def test_split_corpus_holds_out_the_tail(tokens):
    train, held = data.split_corpus(tokens, 0.05)
    assert len(held) == round(0.05 * len(tokens))
    np.testing.assert_array_equal(np.concatenate([train, held]), tokens)


def test_batch_is_a_pure_function_of_seed_and_step(tokens):
    batch = data.batch_at(tokens, step=7, batch_size=8, seq_len=64, seed=0)
    assert batch.shape == (8, 65) and batch.dtype == np.int32
    np.testing.assert_array_equal(batch, data.batch_at(tokens, 7, 8, 64, 0))
    assert not np.array_equal(batch, data.batch_at(tokens, 8, 8, 64, 0))
    assert not np.array_equal(batch, data.batch_at(tokens, 7, 8, 64, 1))


def test_batch_rows_are_windows_of_the_corpus(tokens):
    text = data.corpus_bytes()
    for row in data.batch_at(tokens, step=3, batch_size=4, seq_len=32, seed=5):
        assert row.astype(np.uint8).tobytes() in text
    # A corpus just one token longer than seq_len has exactly one window: all of it.
    tiny = np.arange(11, dtype=np.int32)
    np.testing.assert_array_equal(data.batch_at(tiny, 0, 3, 10, 0), np.tile(tiny, (3, 1)))


@pytest.mark.parametrize("rows", [(0, 16), (0, 1), (5, 6), (3, 11), (8, 16), (15, 16)])
def test_local_batch_is_the_slice_of_the_global_batch(tokens, rows):
    full = data.batch_at(tokens, step=11, batch_size=16, seq_len=40, seed=3)
    local = data.local_batch_at(tokens, 11, 16, 40, 3, *rows)
    np.testing.assert_array_equal(local, full[rows[0]:rows[1]])


def test_seq_len_longer_than_corpus_is_explained():
    with pytest.raises(JaxparError, match=r"seq_len=10 .* has 10.*shorter seq_len"):
        data.batch_at(np.arange(10, dtype=np.int32), 0, 2, 10, 0)


def test_bad_batch_size_is_explained(tokens):
    with pytest.raises(JaxparError, match=r"batch_size=0 must be positive"):
        data.batch_at(tokens, 0, 0, 16, 0)


@pytest.mark.parametrize("rows", [(-1, 2), (2, 2), (3, 9), (5, 4)])
def test_rows_outside_the_batch_are_explained(tokens, rows):
    with pytest.raises(JaxparError, match=rf"rows \[{rows[0]}, {rows[1]}\).*batch of 8 rows"):
        data.local_batch_at(tokens, 0, 8, 16, 0, *rows)


def test_target_beyond_the_stdlib_is_explained():
    with pytest.raises(JaxparError, match=r"target_bytes=100000000 .*pass target_bytes <="):
        data.corpus_bytes(100_000_000)


@pytest.mark.parametrize("strategy, ranges", [("fsdp=8", 8), ("data=2,tensor=4", 2), ("fsdp=2,tensor=4", 2), ("tensor=4", 1)])
def test_process_batch_reads_each_held_row_range_once(tokens, strategy, ranges):
    from jaxpar.topology import load_topology
    from jaxpar.run import RunConfig, build_trainer

    topology = "cpu-4" if strategy == "tensor=4" else "cpu-8"
    trainer, _, _ = build_trainer(RunConfig(strategy=strategy), load_topology(topology))
    asked = []

    def rows(start, stop):
        asked.append((start, stop))
        return data.local_batch_at(tokens, 5, 16, 32, 0, start, stop)

    batch = trainer.put_process_batch(16, rows)
    np.testing.assert_array_equal(np.asarray(batch), data.batch_at(tokens, 5, 16, 32, 0))
    assert batch.sharding == trainer.batch_sharding(batch)
    # one request per distinct row range the devices hold: replicated rows are read once
    assert asked == [(i * 16 // ranges, (i + 1) * 16 // ranges) for i in range(ranges)]


# --- packed documents ------------------------------------------------------------------------------


def test_packed_rows_hold_whole_documents_with_their_own_positions(tokens):
    docs = data.documents(tokens)
    batch = data.packed_batch_at(docs, step=3, batch_size=4, seq_len=256, seed=0)
    plan = data.packing_plan([len(d) for d in docs], 3, 4, 256, 0)
    for key in batch:
        np.testing.assert_array_equal(batch[key][1:3], data.packed_batch_at(docs, 3, 4, 256, 0, 1, 3)[key])  # a process's rows
    real = 0
    for row, held in enumerate(plan):
        for segment, (doc, take) in enumerate(held, start=1):
            at = batch["segments"][row] == segment
            piece = docs[doc][:take]
            np.testing.assert_array_equal(batch["inputs"][row][at], piece[:-1])
            np.testing.assert_array_equal(batch["targets"][row][at], piece[1:])
            np.testing.assert_array_equal(batch["positions"][row][at], np.arange(take - 1))
            real += take - 1
    assert max(len(held) for held in plan) >= 3  # rows really are packed
    # weights: zero on padding, and a mean over all slots that is the mean over real tokens
    assert np.all(batch["weights"][batch["segments"] == 0] == 0)
    assert batch["weights"].sum() == pytest.approx(4 * 256 * np.count_nonzero(batch["segments"]) / real)


def test_documents_are_the_runs_between_blank_lines():
    stream = np.frombuffer(b"one doc\n\ntwo\nlines\n\nx\n\nlast", np.uint8).astype(np.int32)
    assert [bytes(d.astype(np.uint8)) for d in data.documents(stream)] == [b"one doc", b"two\nlines", b"last"]
