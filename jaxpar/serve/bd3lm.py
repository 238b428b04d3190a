"""Sampling from a BD3-LM (``models/bd3lm.py``): autoregressive over blocks, a masked diffusion
inside each block, with a KV cache of the clean blocks.

Block by block. The clean blocks read so far (the prompt's, then each generated one) live in a KV
cache: per layer, the keys (after RoPE) and values of every clean position, computed once and as
the training forward's clean stream computes them (block-causal: a clean block sees the clean
blocks before it and itself). A new block b of ``B`` tokens starts fully masked (every token the
MASK id) at positions bB .. bB + B - 1 and is denoised in ``denoise_steps`` = S steps: each step runs
the network on the block's B tokens, which attend to each other and to every cached position (a
noisy block's view in the three-part mask), and reveals some of its masked tokens. When all are
revealed the block is committed: run once more, now as clean tokens, and its keys and values join
the cache.

The denoising rule. A linear schedule from t = 1 (all masked) to t = 0 in S equal steps: after
step s (1..S), t_s = 1 - s / S and ceil(m t_s) of the block's m masked tokens are still masked, so
step s reveals floor(m s / S) - floor(m (s - 1) / S) of them (spread evenly; S = m reveals one a
step; all are revealed by step S). Which ones: the most confident masked positions, by the model's
largest probability over the data ids there (its softmax, at temperature 1), ties broken by
position (the earlier first). What they become: the argmax over the data ids (``temperature`` 0,
greedy: a pure function of the weights and the prompt), or a sample from the distribution at
``temperature`` cut to its top-p nucleus (the fewest most probable ids whose probabilities sum to
``top_p`` or more, and any id exactly as probable as the least of them), drawn from
``jax.random.key(seed)`` folded with the block index and then the step. A revealed token is never masked again (the
absorbing process run backwards). Only data ids are produced: MASK and the padding ids are never
candidates (the model gives them no probability either).

The prompt. Its whole blocks are read into the cache, one block at a time as above. A last partial
block of r tokens is not padded: it opens the first generated block, whose first r tokens are
given (never masked) and whose other B - r are denoised (m = B - r above). The output is whole
blocks: the prompt, then its continuation to the end of the last generated block.

The cache has a fixed number of slots (every position generation will read, rounded up so that the
attention op can tile the keys) and masks out the slots not yet written (segment ids), so every
block runs the same two compiled programs (denoise a block, commit a block) whatever its index.

``path="recompute"`` runs the training forward instead, without a cache: the network on [x_t of
block b ; x_0 of blocks 0..b-1] under the three-part mask of the training input restricted to
those blocks (``_ShiftedBlocks``). It is the reference the cached path is tested against.

Under a layout (``Sampler(layout=...)``) the weights are placed as the layout computes them and the
programs are partitioned by XLA (jaxpar's GSPMD path: under ``rules.use_layout`` the model's
``jaxpar.nn`` calls become sharding constraints); greedy decoding equals one device's. The rows are
padded to a whole number per data shard (copies of the first, dropped from the output).

From a checkpoint of ``jaxpar train --model bd3lm-...`` (``generate_from_checkpoint``): only the
parameters of the saved TrainState are read, into the layout's shardings, and checked against their
saved checksums. Text is UTF-8 bytes (the main job's tokens, ``train/data.py``) and the output is
decoded with errors replaced.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.attention import DEFAULT_BLOCK, BlockMask, Mask
from jaxpar.errors import JaxparError
from jaxpar.models import bd3lm
from jaxpar.rules import Layout, use_layout
from jaxpar.serve.common import (BYTE_VOCAB, Generated, Served, check_pick, decode_tokens, encode_text, is_int, pad_rows, pick,
                                 restore_model)

PATHS = ("cache", "recompute")


# --- checks ----------------------------------------------------------------------------------------


def check_sampling(block_size: int, denoise_steps, temperature, top_p) -> None:
    """Refuse sampling settings that cannot work, each with its value and the range it must lie in."""
    if not is_int(denoise_steps) or not 1 <= denoise_steps <= block_size:
        raise JaxparError(f"denoise_steps={denoise_steps!r} must be an int from 1 to block_size={block_size}: the steps that "
                          f"unmask a block ({block_size} reveals one token a step, 1 the whole block at once)")
    check_pick(temperature, top_p)


# --- the denoising rule (one block) ----------------------------------------------------------------


def denoise(logits_of: Callable, block, steps: int, temperature: float, top_p: float, key, mask_id: int):
    """``block`` (rows, B) int32, MASK where unknown, after ``steps`` denoising steps (the module
    doc's rule); ``logits_of(tokens)``: float32 (rows, B, ids) logits over the ids that may be
    produced, for the block's current tokens."""
    masked_at_start = jnp.sum(block == mask_id, axis=1)  # m, per row

    def step(s, tokens):
        logits = logits_of(tokens)
        masked = tokens == mask_id
        confidence = jnp.where(masked, jax.nn.softmax(logits, -1).max(-1), -1.0)  # known tokens rank last
        order = jnp.argsort(-confidence, axis=1, stable=True)  # most confident first; a tie keeps position order
        rank = jnp.argsort(order, axis=1)  # each position's place in that order
        count = masked_at_start * (s + 1) // steps - masked_at_start * s // steps  # revealed at this step, per row
        reveal = masked & (rank < count[:, None])
        return jnp.where(reveal, pick(logits, temperature, top_p, jax.random.fold_in(key, s)), tokens)

    return jax.lax.fori_loop(0, steps, step, jnp.asarray(block, jnp.int32))


# --- the recompute path's mask -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _ShiftedBlocks:
    """``allowed`` of a block mask read from block ``offset`` on. The training input of b + 1
    blocks is [b + 1 noisy | b + 1 clean]; its blocks b .. 2b are [noisy block b ; clean blocks
    0..b-1], the recompute path's input, so that input's mask is the training mask shifted by b.
    (A dataclass, so that two equal masks compare equal and share a compiled program.)"""

    allowed: Callable[[int, int], bool]
    offset: int

    def __call__(self, qb: int, kb: int) -> bool:
        return self.allowed(qb + self.offset, kb + self.offset)


def recompute_inputs(prefix_blocks: int, block_size: int, rows: int):
    """(positions (rows, (b + 1) B), mask) of the input [x_t block b ; x_0 blocks 0..b-1] for
    b = ``prefix_blocks``: the training input's (``bd3lm.positions_for``, ``block_diffusion_mask``)
    over its tokens from bB to (2b + 1)B."""
    b, n = prefix_blocks, block_size
    whole = bd3lm.positions_for((b + 1) * n, rows)
    training = bd3lm.block_diffusion_mask((b + 1) * n, n).blocks.allowed
    return whole[:, b * n:(2 * b + 1) * n], Mask(blocks=BlockMask(_ShiftedBlocks(training, b), n))


# --- the sampler -----------------------------------------------------------------------------------


class Sampler(Served):
    """Generation from a BD3-LM's weights (the module doc says how).

    ``model``: a ``models.bd3lm.BD3LM``. ``block_size``: the blocks it was trained on (default its
    config's; a checkpoint does not record ``--block-size``). ``layout``: place the weights and
    compile under it (default: one device). ``vocab``: produce only ids below it (default every
    data id; the byte tokenizer passes 256)."""

    family = "bd3lm"

    def __init__(self, model, *, block_size: int | None = None, layout: Layout | None = None, vocab: int | None = None):
        cfg = model.cfg
        if not isinstance(cfg, bd3lm.BD3LMConfig):
            raise JaxparError(f"the sampler generates from block diffusion models (models.bd3lm.BD3LM); got a {type(model).__name__} "
                              f"with a {type(cfg).__name__}")
        check_unwindowed(cfg.window)
        self.cfg = cfg
        self.block_size = cfg.block_size if block_size is None else block_size
        bd3lm.check_block_size(self.block_size)
        super().__init__(model, layout, vocab, cfg.data_vocab, "data_vocab")

    # --- programs (traced under the layout, compiled once per shape) ---

    def _cached_logits(self, params, cache, start, tokens):
        """(float32 logits (rows, n, vocab), the tokens' (keys, values)) of ``tokens`` (rows, n) at
        positions start.., reading the cache's slots below ``start``."""
        slots = cache[0].shape[2]
        positions = start + jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        valid = jnp.broadcast_to(jnp.arange(slots) < start, (tokens.shape[0], slots))
        logits, kv = self._model(params).network_cached(tokens, positions, cache, valid)
        return logits[..., : self.vocab].astype(jnp.float32), kv

    def _commit(self, params, cache, start, tokens):
        """The cache with the clean block ``tokens``' keys and values written at ``start``."""
        _, kv = self._cached_logits(params, cache, start, tokens)
        return tuple(jax.lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype), start, axis=2) for c, new in zip(cache, kv))

    def _denoise_cached(self, steps, temperature, top_p, params, cache, start, block, key):
        logits_of = lambda tokens: self._cached_logits(params, cache, start, tokens)[0]  # noqa: E731
        return denoise(logits_of, block, steps, temperature, top_p, key, self.cfg.mask_id)

    def _recompute_logits(self, params, prefix, block):
        """float32 logits (rows, B, vocab) of the noisy ``block`` after the clean ``prefix`` (whole
        blocks), from the training forward on [block ; prefix]."""
        rows, n = block.shape
        positions, mask = recompute_inputs(prefix.shape[1] // n, n, rows)
        logits = self._model(params).network(jnp.concatenate([block, prefix], axis=1), jnp.asarray(positions), mask)
        return logits[:, :n, : self.vocab].astype(jnp.float32)

    def _denoise_recompute(self, steps, temperature, top_p, params, prefix, block, key):
        logits_of = lambda tokens: self._recompute_logits(params, prefix, tokens)  # noqa: E731
        return denoise(logits_of, block, steps, temperature, top_p, key, self.cfg.mask_id)

    # --- the cache ---

    def _prefilled(self, prefix: np.ndarray, slots: int):
        """A cache of at least ``slots`` positions holding the clean ``prefix``'s keys and values."""
        b = self.block_size
        length = slots + b  # the keys one step attends to: the cache and the block's own
        if length > DEFAULT_BLOCK:  # the attention op tiles longer key sequences by DEFAULT_BLOCK
            length = -(-length // DEFAULT_BLOCK) * DEFAULT_BLOCK
        shape = (self.cfg.layers, prefix.shape[0], length - b, self.cfg.kv_heads, self.cfg.head_dim)
        dtype = self.params["embedding"].dtype
        cache = (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
        for start in range(0, prefix.shape[1], b):
            cache = self._program("commit")(self.params, cache, jnp.int32(start), prefix[:, start:start + b])
        return cache

    # --- public ---

    def _check_tokens(self, tokens, what: str, whole_blocks: bool = False) -> np.ndarray:
        tokens = np.asarray(tokens)
        if tokens.ndim != 2 or tokens.shape[0] < 1 or not (np.issubdtype(tokens.dtype, np.integer) or tokens.size == 0):
            raise JaxparError(f"{what} must be int (rows, length) with at least one row; got {tokens.dtype} of shape {tokens.shape}")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab):
            raise JaxparError(f"{what} ids must lie in [0, {self.vocab}) (data ids; MASK is {self.cfg.mask_id}); "
                              f"got ids in [{tokens.min()}, {tokens.max()}]")
        if whole_blocks and tokens.shape[1] % self.block_size:
            raise JaxparError(f"{what} must be whole blocks of {self.block_size} tokens; got {tokens.shape[1]}")
        return tokens.astype(np.int32)

    def generate(self, prompt, new_blocks: int, *, denoise_steps: int | None = None, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, max_length: int | None = None, path: str = "cache", progress=None) -> np.ndarray:
        """int32 tokens (rows, (P // B + new_blocks) B): the ``prompt`` (rows, P) of data ids, then
        ``new_blocks`` denoised blocks, the first opened by the prompt's last partial block (see
        the module doc). ``denoise_steps``: S, from 1 to B (default B: one token a step).
        ``max_length``: refuse an output longer than this many tokens (default: no bound).
        ``path``: ``cache`` (the KV cache) or ``recompute`` (the training forward, no cache).
        ``progress(new blocks so far)`` after each block."""
        b = self.block_size
        steps = b if denoise_steps is None else denoise_steps
        check_sampling(b, steps, temperature, top_p)
        if path not in PATHS:
            raise JaxparError(f"path={path!r} is unknown: use {' or '.join(PATHS)}")
        if not is_int(new_blocks) or new_blocks < 1:
            raise JaxparError(f"new_blocks={new_blocks!r} must be a positive int (blocks of {b} tokens to generate)")
        prompt = self._check_tokens(prompt, "the prompt")
        rows, length = prompt.shape
        prompt = np.concatenate([prompt, np.repeat(prompt[:1], pad_rows(rows, self.layout), 0)])  # whole rows per data shard
        whole, tail = divmod(length, b)
        blocks = whole + new_blocks
        if max_length is not None and blocks * b > max_length:
            opens = f": the prompt's last {tail} open the first new block" if tail else ""
            raise JaxparError(f"a prompt of {length} tokens and {new_blocks} new blocks make {blocks * b} tokens (whole blocks of "
                              f"{b}{opens}), more than max_length={max_length}: shorten the prompt, generate fewer blocks or "
                              f"raise max_length")
        out = np.zeros((len(prompt), blocks * b), np.int32)
        out[:, :length] = prompt
        key = jax.random.key(seed)
        statics = (steps, float(temperature), float(top_p))
        with use_layout(self.layout):
            if path == "cache":
                cache = self._prefilled(out[:, : whole * b], (blocks - 1) * b)  # the last block is read by no later one
            for index in range(whole, blocks):
                start = index * b
                block = np.full((len(prompt), b), self.cfg.mask_id, np.int32)
                if index == whole:
                    block[:, :tail] = prompt[:, start:]
                block_key = jax.random.fold_in(key, index)
                if path == "cache":
                    done = self._program("denoise_cached", *statics)(self.params, cache, jnp.int32(start), block, block_key)
                else:
                    done = self._program("denoise_recompute", *statics)(self.params, out[:, :start], block, block_key)
                out[:, start:start + b] = np.asarray(done)
                if progress:
                    progress(index + 1 - whole)
                if path == "cache" and index < blocks - 1:
                    cache = self._program("commit")(self.params, cache, jnp.int32(start), out[:, start:start + b])
        return out[:rows]  # the padding rows dropped

    def block_logits(self, prefix, block, path: str = "cache") -> np.ndarray:
        """float32 logits (rows, B, vocab) of ``block`` (rows, B; MASK where unknown) read after the
        clean ``prefix`` (rows, whole blocks), by ``path``: what one denoising step sees."""
        prefix = self._check_tokens(prefix, "the prefix", whole_blocks=True)
        block = np.asarray(block, np.int32)
        if block.shape != (prefix.shape[0], self.block_size):
            raise JaxparError(f"block must be ({prefix.shape[0]}, {self.block_size}); got {block.shape}")
        if path not in PATHS:
            raise JaxparError(f"path={path!r} is unknown: use {' or '.join(PATHS)}")
        with use_layout(self.layout):
            if path == "recompute":
                return np.asarray(self._program("recompute_logits")(self.params, prefix, block))
            cache = self._prefilled(prefix, prefix.shape[1])
            return np.asarray(self._program("cached_logits")(self.params, cache, jnp.int32(prefix.shape[1]), block)[0])


# --- from a checkpoint of the main job -------------------------------------------------------------


def check_unwindowed(window) -> None:
    """Refuse a model trained with a sliding window: the cache here holds, and every block reads,
    the whole clean prefix."""
    if window is not None:
        raise JaxparError(f"the model was trained with a sliding window of {window} tokens; the sampler reads the whole "
                          f"clean prefix, which that model never saw: generation for windowed models is not built yet")


def generate_from_checkpoint(checkpoint_dir: str, prompt_text: str, new_blocks: int, *, denoise_steps: int | None = None,
                             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, block_size: int | None = None,
                             max_length: int | None = None, layout: Layout | None = None, step: int | None = None,
                             progress=None) -> Generated:
    """Continue ``prompt_text`` by ``new_blocks`` blocks from the weights of a ``jaxpar train``
    checkpoint (``restore_model``), as ``Sampler.generate`` does on its UTF-8 bytes.
    ``block_size``: default the run's ``--block-size``, as its checkpoint records it. ``max_length``: default the run's ``--seq-len`` (positions beyond it were never
    trained on; pass a larger one to go further). ``progress``: as for ``Sampler.generate``."""
    def run_block_size(meta, cfg):  # the run's --block-size (runs before it was recorded: the config's)
        return block_size or meta.get("block_size") or cfg.block_size

    def check(meta, cfg):  # the settings against the checkpoint's blocks, before its arrays are read
        check_unwindowed(meta.get("window"))
        check_sampling(run_block_size(meta, cfg), run_block_size(meta, cfg) if denoise_steps is None else denoise_steps,
                       temperature, top_p)

    model, meta = restore_model(checkpoint_dir, "bd3lm", layout=layout, step=step, check_meta=check)
    block_size = run_block_size(meta, model.cfg)
    if max_length is None:
        max_length = meta["data"]["seq_len"]
    sampler = Sampler(model, block_size=block_size, layout=layout, vocab=BYTE_VOCAB)
    prompt = encode_text(prompt_text)
    tokens = sampler.generate(prompt[None], new_blocks, denoise_steps=denoise_steps, temperature=temperature, top_p=top_p,
                              seed=seed, max_length=max_length, progress=progress)[0]
    return Generated(decode_tokens(tokens), decode_tokens(tokens[len(prompt):]), tokens, len(prompt), meta["model"], meta["step"])
