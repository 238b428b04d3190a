"""A model family as one bundle: what the main job, ``jaxpar compile``, ``jaxpar check`` and
``jaxpar generate`` need of a model, so that none of them branches on which model it is.

Each family's file defines its ``FAMILY``; ``models/__init__.py`` registers it in one line.
Generation is serving's: ``jaxpar.serve`` keeps a decoder per family name and refuses, in words,
a family without one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any


def _next_token_fields(seq_len: int) -> None:
    return None  # (batch, seq_len + 1) tokens, or packed documents: what the Llama's loss reads


def _no_options(cfg, seq_len: int, **options):
    return cfg


def _nothing_more(cfg, saved: dict, given: dict) -> str | None:
    return None


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # what checkpoints and the code call it ("llama")
    words: str  # what messages call one of it ("Llama")
    config_type: type  # its config class, exactly (a subclass of it is another family's)
    configs: Mapping[str, Any]  # its configs by ``--model`` name
    model: Callable  # (cfg, rngs) -> the Flax NNX model
    loss: Callable  # (model, batch) -> the mean loss over the batch
    # (cfg, (rows, seq_len) token windows, seed, step, first row) -> the batch rows its loss reads;
    # None: next-token windows of seq_len + 1 tokens
    rows: Callable | None = None
    # (seq_len) -> {key: (width, dtype)} of the rows ``rows`` makes (None: next-token tokens)
    batch_fields: Callable[[int], dict | None] = _next_token_fields
    reads: Callable[[int], int] = lambda seq_len: seq_len  # tokens of a row the network reads (FLOPs)
    # RunConfig fields only this family takes (``--block-size``...), applied and checked by
    # ``configure(cfg, seq_len, **options)`` -> the config the run trains
    options: tuple[str, ...] = ()
    configure: Callable = _no_options
    packing: bool = True  # whether ``--packing`` (rows of whole documents) applies
    # mesh axes of strategies that need something of the model (``base.NEEDS_MODEL``) it has
    axes: frozenset[str] = frozenset()
    # (cfg) -> what a checkpoint records of the config beyond its name (a resume and the sampler read it)
    meta: Callable[[Any], dict] = lambda cfg: {}
    # (model, batch, devices its experts are split over) -> the run report's section of what the
    # model does with a batch (a mixture of experts' routing: loads, drops), run after training;
    # None: no such section. ``summary`` (section) -> its lines in ``jaxpar train``'s summary
    batch_report: Callable | None = None
    summary: Callable[[dict], list] = lambda section: []
    # (cfg, saved meta, options given) -> why resuming the saved run as ``cfg`` would train
    # another function of the same weights (None: it would not)
    changed: Callable = _nothing_more
    # (cfg, a checkpoint's meta) -> the config whose weights the checkpoint holds (a mixture's
    # routing bias is a weight only where its run had one)
    saved: Callable = lambda cfg, meta: cfg
