"""A user's own corpus: files (``sources``), a tokenizer (``tokenizer``), tokenized once into a
memory-mapped cache (``cache``) and read in batches through Grain (``pipeline``).

``open_corpus`` is the way in: ``jaxpar train --data ... --tokenizer ...`` calls it before
anything is compiled, so bad input is refused first.
"""

from __future__ import annotations

from jaxpar.corpus import cache, sources
from jaxpar.corpus.pipeline import Corpus, PackedRows, Windows, check_fraction
from jaxpar.corpus.tokenizer import BYTES, Tokenizer, keep, kept, load

__all__ = ["BYTES", "Corpus", "PackedRows", "Tokenizer", "Windows", "check_fraction", "keep", "kept", "load", "open_corpus"]


def open_corpus(spec: str, tokenizer: Tokenizer, field: str = "text", separator: str | None = None,
                cache_root: str | None = None, log=lambda message: None) -> Corpus:
    """The corpus the files ``spec`` names (``sources.files``), tokenized by ``tokenizer``."""
    tokens, bounds, record = cache.build_or_open(sources.files(spec), tokenizer, field, separator, cache_root, log)
    return Corpus(tokens, bounds, tokenizer, record)
