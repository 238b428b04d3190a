"""Batches of a user's corpus, read through Grain: a step's rows are a pure function of the seed
and the step, so a resumed job, or one resumed under another layout or process count, reads
exactly the batches the uninterrupted one would have read, and the data position a checkpoint
keeps is the next step.

Records are fixed before training: windows of ``seq_len + 1`` tokens cut from the token stream
every ``seq_len`` tokens (``Windows``: a window's last token is the next one's first, so each
token is predicted by one window), or rows of whole documents packed best-fit (``PackedRows``; a
document longer than a row is cut into pieces of a row each, overlapping by one token likewise).
A Grain ``MapDataset`` shuffles the records by the seed, a new order each epoch, and repeats; the
global batch at step s is records ``s x batch_size`` to ``(s + 1) x batch_size - 1`` of that
sequence, and a process reads only its own rows of it. So every record is read, and every
prediction made, exactly once per epoch across all processes. Windows drop the stream's last
partial window (fewer than ``seq_len`` predictions); packed rows lose nothing.
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from jaxpar.corpus.tokenizer import Tokenizer
from jaxpar.errors import JaxparError


def check_fraction(fraction: float):
    """Refuse a held-out fraction of the documents that leaves none out, or none to train on."""
    if not 0.0 < fraction < 1.0:
        raise JaxparError(f"--eval-fraction {fraction} must be strictly between 0 and 1, e.g. 0.05")


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A tokenized corpus: the token stream, each document's (start, stop) in it, its tokenizer and
    the cache's record."""

    tokens: np.ndarray
    bounds: np.ndarray
    tokenizer: Tokenizer
    record: dict

    def split(self, fraction: float) -> tuple["Corpus", "Corpus"]:
        """(training, held-out): the held-out part is the last ``fraction`` of the documents."""
        check_fraction(fraction)
        held = max(1, round(len(self.bounds) * fraction))
        if held >= len(self.bounds):
            raise JaxparError(f"the corpus has {len(self.bounds)} documents: too few to hold out {fraction:.0%} and train on the "
                              f"rest; give more documents, or the held-out text with --eval-data")
        first = int(self.bounds[-held, 0])
        train = dataclasses.replace(self, tokens=self.tokens[:int(self.bounds[-held - 1, 1])], bounds=self.bounds[:-held])
        return train, dataclasses.replace(self, tokens=self.tokens[first:], bounds=self.bounds[-held:] - first)

    def documents(self) -> list[np.ndarray]:
        return [np.asarray(self.tokens[a:b], np.int32) for a, b in self.bounds]


def _order(records: int, seed: int):
    """Record indices in a seeded order, a new one each epoch, repeated without end (a Grain
    ``MapDataset``, read by index)."""
    import grain  # the `data` extra: only a run with --data reads through it

    return grain.MapDataset.range(records).seed(seed).shuffle().repeat()


class Windows:
    """Windows of ``seq_len + 1`` tokens of the stream: rows (rows, seq_len + 1) int32."""

    def __init__(self, corpus: Corpus, seq_len: int, batch_size: int, seed: int, what: str = "the corpus"):
        self.corpus, self.seq_len, self.batch_size = corpus, seq_len, batch_size
        self.records = (len(corpus.tokens) - 1) // seq_len
        if self.records < 1:
            raise JaxparError(f"{what} has {len(corpus.tokens)} tokens, fewer than one window of --seq-len {seq_len} + 1; "
                              f"give more text or a shorter --seq-len")
        self.order = _order(self.records, seed)

    def rows(self, step: int, first: int, stop: int) -> np.ndarray:
        picked = [self.order[step * self.batch_size + r] for r in range(first, stop)]
        return np.stack([np.asarray(self.corpus.tokens[w * self.seq_len:w * self.seq_len + self.seq_len + 1], np.int32) for w in picked])


class PackedRows:
    """Whole documents packed best-fit into rows of ``seq_len`` predictions: rows as
    ``data.packed_batch_at`` makes them (inputs, targets, positions, segments, weights). ``what``:
    the corpus in a refusal's words."""

    def __init__(self, corpus: Corpus, seq_len: int, batch_size: int, seed: int, what: str = "the corpus"):
        self.corpus, self.seq_len, self.batch_size = corpus, seq_len, batch_size
        pieces = [(a, min(a + seq_len + 1, b)) for a, b in corpus.bounds for a in range(int(a), int(b) - 1, seq_len)]
        self.rows_of = _best_fit([b - a for a, b in pieces], seq_len)
        self.pieces = pieces
        self.real = np.asarray([sum(pieces[p][1] - pieces[p][0] - 1 for p in row) for row in self.rows_of])
        if len(self.rows_of) < batch_size:
            raise JaxparError(f"{what}: its documents fill {len(self.rows_of)} rows of {seq_len} tokens, fewer than the batch "
                              f"of {batch_size}; use a smaller --batch-size or --seq-len, or give more text")
        self.order = _order(len(self.rows_of), seed)

    def rows(self, step: int, first: int, stop: int) -> dict:
        batch = [self.order[step * self.batch_size + r] for r in range(self.batch_size)]
        real = int(self.real[batch].sum())  # the global batch's real targets: every process computes it
        out = {key: np.zeros((stop - first, self.seq_len), np.int32) for key in ("inputs", "targets", "positions", "segments")}
        out["weights"] = np.zeros((stop - first, self.seq_len), np.float32)
        for i, row in enumerate(batch[first:stop]):
            at = 0
            for segment, p in enumerate(self.rows_of[row], start=1):
                a, b = self.pieces[p]
                piece, n = np.asarray(self.corpus.tokens[a:b], np.int32), b - a - 1
                out["inputs"][i, at:at + n], out["targets"][i, at:at + n] = piece[:-1], piece[1:]
                out["positions"][i, at:at + n] = np.arange(n)
                out["segments"][i, at:at + n] = segment
                out["weights"][i, at:at + n] = self.batch_size * self.seq_len / real
                at += n
        return out


def _best_fit(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Pieces (of n tokens, n - 1 predictions) into rows of ``seq_len`` predictions: longest
    first, each into the fullest row with room (best fit; a sorted list of rooms, so a corpus of
    millions of documents packs in n log n)."""
    rows: list[list[int]] = []
    rooms: list[tuple[int, int]] = []  # (predictions free, row), sorted
    for p in sorted(range(len(lengths)), key=lambda p: -lengths[p]):
        need = lengths[p] - 1
        k = bisect.bisect_left(rooms, (need, -1))
        if k == len(rooms):
            rows.append([])
            room, row = seq_len, len(rows) - 1
        else:
            room, row = rooms.pop(k)
        rows[row].append(p)
        if room - need > 0:
            bisect.insort(rooms, (room - need, row))
    return rows
