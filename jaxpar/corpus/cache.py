"""The token cache: a corpus tokenized once into a memory-mapped file beside the data.

A cache is a directory ``<the first source's directory>/.jaxpar-cache/<key>/`` holding
``tokens.bin`` (the token stream: every document's ids, uint32, with the tokenizer's
``between_documents`` ids between two documents), ``bounds.npy`` ((documents, 2) int64: where each
document starts and stops in the stream) and ``record.json`` (what it was made from). ``key`` is a hash of the
tokenizer's identity, the sources' paths, sizes and SHA-256 and the reading options: a changed
source file or another tokenizer gives another key, so a stale cache is never read. A cache is
written into a temporary directory and renamed into place whole: a job killed while tokenizing
leaves no half cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time

import numpy as np

from jaxpar.corpus import sources
from jaxpar.corpus.tokenizer import Tokenizer
from jaxpar.errors import JaxparError

FORMAT = 1


def key_of(fingerprint: list[dict], tokenizer: Tokenizer, field: str, separator: str | None) -> dict:
    """What a cache is made from (the record's ``source``)."""
    return {"format": FORMAT, "tokenizer": tokenizer.identity, "sources": fingerprint, "field": field, "separator": separator}


def build_or_open(paths: list[str], tokenizer: Tokenizer, field: str = "text", separator: str | None = None,
                  cache_root: str | None = None, log=lambda message: None) -> tuple[np.ndarray, np.ndarray, dict]:
    """(token stream (memory-mapped uint32), document bounds (documents, 2), record) of the
    corpus, from its cache, tokenized first if there is none for these sources and this tokenizer."""
    source = key_of(sources.fingerprint(paths), tokenizer, field, separator)
    digest = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:20]
    root = cache_root or os.path.join(os.path.dirname(os.path.abspath(paths[0])), ".jaxpar-cache")
    where = os.path.join(root, digest)
    if not os.path.isdir(where):
        _build(paths, tokenizer, field, separator, root, where, source, log)
    with open(os.path.join(where, "record.json")) as f:
        record = json.load(f)
    bounds = np.load(os.path.join(where, "bounds.npy"))
    tokens = np.memmap(os.path.join(where, "tokens.bin"), dtype=np.uint32, mode="r", shape=(record["tokens"],))
    record["directory"] = where
    return tokens, bounds, record


def _build(paths, tokenizer: Tokenizer, field: str, separator: str | None, root: str, where: str, source: dict, log):
    try:
        os.makedirs(root, exist_ok=True)
        work = tempfile.mkdtemp(dir=root, prefix=".building-")
    except OSError as err:
        raise JaxparError(f"the token cache cannot be written in {root} ({err.strerror}); give a writable --data-cache "
                          f"directory") from None
    started, bounds, total = time.perf_counter(), [], 0
    between = np.asarray(tokenizer.between_documents(), np.uint32)
    try:
        with open(os.path.join(work, "tokens.bin"), "wb") as out:
            for number, text in enumerate(sources.documents(paths, field, separator), start=1):
                ids = np.asarray(tokenizer.encode(text), np.uint32)
                if len(ids) < 2:
                    continue  # a document of one token predicts nothing
                if bounds:
                    out.write(between.tobytes())
                    total += len(between)
                out.write(ids.tobytes())
                bounds.append((total, total + len(ids)))
                total += len(ids)
                if number % 10_000 == 0:
                    log(f"tokenizing: {number:,} documents, {total:,} tokens ({time.perf_counter() - started:.0f} s)")
        if not bounds:
            raise JaxparError(f"--data: the corpus ({', '.join(paths[:3])}{'...' if len(paths) > 3 else ''}) holds no "
                              f"document of two tokens or more; give text")
        np.save(os.path.join(work, "bounds.npy"), np.asarray(bounds, np.int64))
        record = {"source": source, "documents": len(bounds), "tokens": total, "seconds": time.perf_counter() - started}
        with open(os.path.join(work, "record.json"), "w") as f:
            json.dump(record, f, indent=1)
        if os.path.isdir(where):  # another process made it meanwhile
            shutil.rmtree(work)
        else:
            os.replace(work, where)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    log(f"tokenized {len(bounds):,} documents, {total:,} tokens in {time.perf_counter() - started:.1f} s into {where}")
