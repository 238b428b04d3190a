"""The main job's corpus and its deterministic batches.

Where the text comes from: the repository holds no copied text. The corpus is gathered at run time
from the documentation strings of Python's own standard library, which every machine that runs
jaxpar already has: a fixed, sorted list of pure-Python stdlib modules is imported, and the
docstrings of each module and of its public classes, functions and methods (``inspect.getdoc``) are
taken in a fixed order, de-duplicated and whitespace-normalised, until about ``target_bytes`` of
UTF-8. The same Python version gives the same bytes; other versions may differ slightly.

Tokens are the UTF-8 bytes themselves (vocabulary 256). A batch is a pure function of
``(seed, step)``, so a restarted job reads the exact same data order, and any process can compute
its own rows of the global batch without building the others.

Two forms of batch: random windows of the token stream (``batch_at``), or whole documents (the
docstrings, split where the corpus has a blank line) packed into rows (``packed_batch_at``), each
keeping its natural length, with segment ids and per-document positions.
"""

from __future__ import annotations

import functools
import importlib
import inspect

import numpy as np

from jaxpar.corpus.tokenizer import BLANK_LINE
from jaxpar.errors import JaxparError

VOCAB_SIZE = 256

# Pure-Python modules that import cleanly on every platform, without side effects or warnings.
# Kept sorted; changing this list changes the corpus.
_MODULES = (
    "abc", "argparse", "ast", "asyncio.events", "asyncio.futures", "asyncio.locks",
    "asyncio.queues", "asyncio.streams", "asyncio.tasks", "base64", "bisect", "calendar", "cmd",
    "codecs", "collections", "colorsys", "configparser", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "difflib", "dis", "doctest", "email.headerregistry",
    "email.message", "email.parser", "email.policy", "email.utils", "enum", "filecmp", "fileinput",
    "fnmatch", "fractions", "ftplib", "functools", "getopt", "gettext", "glob", "graphlib", "gzip",
    "heapq", "hmac", "html", "html.parser", "http.client", "http.cookiejar", "http.cookies",
    "http.server", "imaplib", "inspect", "ipaddress", "json", "logging", "logging.config",
    "logging.handlers", "mailbox", "mimetypes", "netrc", "numbers", "operator", "optparse",
    "pathlib", "pickle", "pickletools", "pkgutil", "plistlib", "poplib", "pprint", "pydoc",
    "queue", "quopri", "random", "re", "reprlib", "runpy", "sched", "secrets", "shelve", "shlex",
    "smtplib", "statistics", "string", "tarfile", "tempfile", "textwrap", "threading", "timeit",
    "tokenize", "trace", "traceback", "types", "unittest", "unittest.mock", "urllib.parse",
    "urllib.request", "urllib.robotparser", "uuid", "warnings", "wave", "weakref",
    "xml.dom.minidom", "xml.etree.ElementTree", "xmlrpc.client", "zipfile", "zipimport",
)


def _normalise(doc: str) -> str:
    """Collapse whitespace inside each paragraph; one newline between paragraphs."""
    paragraphs = (" ".join(p.split()) for p in doc.split("\n\n"))
    return "\n".join(p for p in paragraphs if p)


def _docstrings():
    """Yield every docstring of the listed modules, in a fixed order (duplicates included)."""
    for name in _MODULES:
        module = importlib.import_module(name)
        yield inspect.getdoc(module)
        for member_name in sorted(vars(module)):
            member = vars(module)[member_name]
            if member_name.startswith("_") or getattr(member, "__module__", None) != name:
                continue
            if inspect.isroutine(member):
                yield inspect.getdoc(member)
            elif inspect.isclass(member):
                yield inspect.getdoc(member)
                for attr in sorted(vars(member)):
                    if not attr.startswith("_") and inspect.isroutine(vars(member)[attr]):
                        yield inspect.getdoc(getattr(member, attr))


@functools.lru_cache(maxsize=4)
def corpus_bytes(target_bytes: int = 400_000) -> bytes:
    """About ``target_bytes`` of English from the standard library's docstrings (see module doc)."""
    if target_bytes <= 0:
        raise JaxparError(f"target_bytes={target_bytes} must be positive; pass e.g. 400_000.")
    seen, pieces, size = set(), [], 0
    for doc in _docstrings():
        text = _normalise(doc or "")
        if not text or text in seen:
            continue
        seen.add(text)
        piece = text.encode("utf-8") + b"\n\n"
        pieces.append(piece)
        size += len(piece)
        if size >= target_bytes:
            break
    else:
        raise JaxparError(
            f"target_bytes={target_bytes} is more than the {size} bytes of docstrings this Python "
            f"offers; pass target_bytes <= {size}."
        )
    # Cut at exactly target_bytes, dropping a trailing partial UTF-8 character.
    return b"".join(pieces)[:target_bytes].decode("utf-8", "ignore").encode("utf-8")


def corpus_tokens(target_bytes: int = 400_000) -> np.ndarray:
    """The corpus as byte tokens: a 1-D int32 array with values in [0, 256)."""
    return np.frombuffer(corpus_bytes(target_bytes), dtype=np.uint8).astype(np.int32)


def split_corpus(tokens: np.ndarray, holdout_fraction: float = 0.05):
    """Split into (train, held-out): the held-out part is the last ``holdout_fraction``."""
    if not 0.0 < holdout_fraction < 1.0:
        raise JaxparError(
            f"holdout_fraction={holdout_fraction} must be strictly between 0 and 1, e.g. 0.05."
        )
    n_hold = max(1, round(len(tokens) * holdout_fraction))
    if n_hold >= len(tokens):
        raise JaxparError(
            f"a corpus of {len(tokens)} tokens is too short to hold out {holdout_fraction:.0%}; "
            "use a larger corpus."
        )
    return tokens[:-n_hold], tokens[-n_hold:]


def batch_at(tokens: np.ndarray, step: int, batch_size: int, seq_len: int, seed: int) -> np.ndarray:
    """The global batch for ``step``: int32 ``(batch_size, seq_len + 1)`` random windows.

    A pure function of ``(seed, step)``: inputs are ``[:, :-1]``, targets ``[:, 1:]``.
    """
    return local_batch_at(tokens, step, batch_size, seq_len, seed, 0, batch_size)


def local_batch_at(
    tokens: np.ndarray, step: int, batch_size: int, seq_len: int, seed: int,
    row_start: int, row_stop: int,
) -> np.ndarray:
    """Rows ``[row_start, row_stop)`` of ``batch_at(...)``, without building the other rows."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise JaxparError(f"tokens must be 1-D, got shape {tokens.shape}; pass corpus_tokens().")
    if batch_size <= 0:
        raise JaxparError(f"batch_size={batch_size} must be positive.")
    if seq_len <= 0:
        raise JaxparError(f"seq_len={seq_len} must be positive.")
    if seq_len >= len(tokens):
        raise JaxparError(
            f"seq_len={seq_len} needs a corpus longer than seq_len + 1 tokens, but it has "
            f"{len(tokens)}; use a shorter seq_len or a larger target_bytes."
        )
    if step < 0 or seed < 0:
        raise JaxparError(f"step={step} and seed={seed} must both be >= 0.")
    if not 0 <= row_start < row_stop <= batch_size:
        raise JaxparError(
            f"rows [{row_start}, {row_stop}) are not a non-empty range inside the batch of "
            f"{batch_size} rows; need 0 <= row_start < row_stop <= batch_size."
        )
    # One start offset per row of the whole batch (batch_size integers, cheap); only the
    # requested rows are gathered.
    rng = np.random.default_rng((seed, step))
    starts = rng.integers(0, len(tokens) - seq_len, size=batch_size)[row_start:row_stop]
    return tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)


# --- packed documents ------------------------------------------------------------------------------

SEPARATOR = BLANK_LINE  # the blank line between two documents of the corpus


def documents(tokens: np.ndarray) -> list[np.ndarray]:
    """The documents of a token stream: the runs between blank lines (of at least 2 tokens)."""
    tokens = np.asarray(tokens)
    breaks = np.nonzero((tokens[:-1] == SEPARATOR[0]) & (tokens[1:] == SEPARATOR[1]))[0]
    starts = np.concatenate([[0], breaks + 2])
    stops = np.concatenate([breaks, [len(tokens)]])
    return [tokens[a:b] for a, b in zip(starts, stops) if b - a >= 2]


def packing_plan(lengths, step: int, batch_size: int, seq_len: int, seed: int) -> list[list[tuple[int, int]]]:
    """Per row of the global batch at ``step``: the (document, tokens taken) it holds. Documents
    are drawn in a seeded order and each goes whole into the first row with room for it (first
    fit; a document longer than a row gives its first seq_len + 1 tokens); a document no row has
    room for is left for another step. A pure function of ``(seed, step)`` and the lengths."""
    order = np.random.default_rng((seed, step, 1)).permutation(len(lengths))
    rows: list[list[tuple[int, int]]] = []
    free: list[int] = []  # predictions left in each row: a document of n tokens makes n - 1
    for doc in order:
        take = min(int(lengths[doc]), seq_len + 1)
        row = next((r for r, room in enumerate(free) if room >= take - 1), None)
        if row is None:
            if len(rows) == batch_size:
                continue
            rows.append([])
            free.append(seq_len)
            row = len(rows) - 1
        rows[row].append((int(doc), take))
        free[row] -= take - 1
        if len(rows) == batch_size and max(free) < 1:
            break
    if len(rows) < batch_size:
        raise JaxparError(f"the corpus's {len(lengths)} documents fill {len(rows)} rows of {seq_len} tokens, fewer than the "
                          f"batch of {batch_size}; use a smaller --batch-size or --seq-len")
    return rows


def packed_batch_at(docs: list[np.ndarray], step: int, batch_size: int, seq_len: int, seed: int,
                    row_start: int = 0, row_stop: int | None = None) -> dict:
    """Rows ``[row_start, row_stop)`` of the packed global batch at ``step`` (``packing_plan``),
    each a dict of (rows, seq_len) arrays: ``inputs`` and ``targets`` (int32), ``positions``
    (from 0 in each document), ``segments`` (1, 2, ... per document in its row; 0 is padding)
    and ``weights`` (float32: 0 on padding, else the global batch's slots over its real targets,
    so the mean over every slot of weight x loss is the mean over the real tokens)."""
    row_stop = batch_size if row_stop is None else row_stop
    plan = packing_plan([len(d) for d in docs], step, batch_size, seq_len, seed)
    real = sum(take - 1 for row in plan for _, take in row)
    out = {key: np.zeros((row_stop - row_start, seq_len), np.int32) for key in ("inputs", "targets", "positions", "segments")}
    out["weights"] = np.zeros((row_stop - row_start, seq_len), np.float32)
    for i, row in enumerate(plan[row_start:row_stop]):
        at = 0
        for segment, (doc, take) in enumerate(row, start=1):
            piece, n = docs[doc][:take], take - 1
            out["inputs"][i, at:at + n], out["targets"][i, at:at + n] = piece[:-1], piece[1:]
            out["positions"][i, at:at + n] = np.arange(n)
            out["segments"][i, at:at + n] = segment
            out["weights"][i, at:at + n] = batch_size * seq_len / real
            at += n
    return out


def documents_at(docs: list[np.ndarray], step: int, count: int, seed: int, max_tokens: int) -> list[np.ndarray]:
    """``count`` whole documents for ``step`` (a seeded draw, a pure function of seed and step),
    each cut to at most ``max_tokens`` tokens: a batch of variable-length sequences."""
    if count > len(docs):
        raise JaxparError(f"a batch of {count} documents needs that many; the corpus has {len(docs)}: use a smaller --batch-size")
    picked = np.random.default_rng((seed, step, 2)).choice(len(docs), size=count, replace=False)
    return [docs[i][:max_tokens] for i in picked]


def family_batch_at(
    tokens: np.ndarray, step: int, batch_size: int, seq_len: int, seed: int, row_start: int, row_stop: int, family, cfg,
) -> dict:
    """Rows ``[row_start, row_stop)`` of a batch that ``family`` makes from windows of ``seq_len``
    tokens picked as ``local_batch_at`` picks them (``Family.rows``: a block diffusion model
    corrupts each, from a generator of its own per row, so a row is the same whichever process
    reads it)."""
    windows = local_batch_at(tokens, step, batch_size, seq_len, seed, row_start, row_stop)[:, :seq_len]
    return family.rows(cfg, windows, seed, step, row_start)
