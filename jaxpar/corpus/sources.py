"""A user's corpus on disk: which files, and the documents in them.

``--data`` names files or globs (comma-separated). Each file is read by its suffix:

- ``.txt`` / ``.md`` / any other suffix: plain UTF-8 text, one document per file, or split where
  ``separator`` occurs (e.g. a blank line, ``"\\n\\n"``);
- ``.jsonl`` / ``.json`` (JSON Lines): one JSON object per line, the document in ``field``;
- ``.parquet``: the string column ``field`` (read with pyarrow, one row group at a time).

Bad input is refused in words before any tokenizing: a path that matches nothing or is empty, a
line that is not JSON (file and line), a record or a table without the field (naming the fields it
has).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Iterator

from jaxpar.errors import JaxparError

PARQUET = (".parquet",)
JSON_LINES = (".jsonl", ".json")


def files(spec: str) -> list[str]:
    """The files ``spec`` names (paths or globs, comma-separated; a directory means every file in
    it), sorted within each item, in the order given; refused if an item matches no file or a file
    is empty."""
    out: list[str] = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        if os.path.isdir(item):
            found = sorted(p for p in glob.glob(os.path.join(item, "**", "*"), recursive=True) if os.path.isfile(p))
        else:
            found = sorted(p for p in glob.glob(item, recursive=True) if os.path.isfile(p))
        if not found:
            raise JaxparError(f"--data {item}: no such file (nor any file matching it); give a file, a directory or a glob "
                              f"such as 'corpus/*.jsonl'")
        out += [p for p in found if p not in out]
    if not out:
        raise JaxparError(f"--data {spec!r} names no file; give a file, a directory or a glob such as 'corpus/*.txt'")
    for path in out:
        if os.path.getsize(path) == 0:
            raise JaxparError(f"--data: {path} is empty; remove it from the corpus or give it text")
    return out


def fingerprint(paths: list[str]) -> list[dict]:
    """Each source's path, size and SHA-256: a changed file changes this (the token cache's key)."""
    out = []
    for path in paths:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
        out.append({"path": os.path.abspath(path), "bytes": os.path.getsize(path), "sha256": digest.hexdigest()})
    return out


def documents(paths: list[str], field: str = "text", separator: str | None = None) -> Iterator[str]:
    """Every document of the files, in order (empty documents skipped)."""
    for path in paths:
        suffix = os.path.splitext(path)[1].lower()
        if suffix in PARQUET:
            yield from _parquet(path, field)
        elif suffix in JSON_LINES:
            yield from _json_lines(path, field)
        else:
            yield from _text(path, separator)


def _text(path: str, separator: str | None) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as err:
        raise JaxparError(f"--data: {path} is not UTF-8 text (byte {err.start}); convert it, or give JSON Lines or Parquet") from None
    for doc in (text.split(separator) if separator else [text]):
        if doc.strip():
            yield doc


def _json_lines(path: str, field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise JaxparError(f"--data: {path} line {number} is not JSON ({err.msg} at column {err.colno}); "
                                  f"each line of a .jsonl file must be one JSON object") from None
            if not isinstance(record, dict) or field not in record:
                has = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise JaxparError(f"--data: {path} line {number} has no field {field!r} (it has {has}); "
                                  f"name the text's field with --data-field")
            if not isinstance(record[field], str):
                raise JaxparError(f"--data: {path} line {number}: field {field!r} holds {type(record[field]).__name__}, "
                                  f"not text; name the text's field with --data-field")
            if record[field].strip():
                yield record[field]


def _parquet(path: str, field: str) -> Iterator[str]:
    import pyarrow.parquet as pq  # only for Parquet sources (the `data` extra)

    table = pq.ParquetFile(path)
    if field not in table.schema_arrow.names:
        raise JaxparError(f"--data: {path} has no column {field!r} (it has {table.schema_arrow.names}); "
                          f"name the text's column with --data-field")
    for group in range(table.num_row_groups):
        for text in table.read_row_group(group, columns=[field]).column(0).to_pylist():
            if text is not None and text.strip():
                yield text
