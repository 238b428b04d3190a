"""BD3-LM: a block diffusion language model, autoregressive over blocks and a masked (absorbing
state) discrete diffusion inside each block.

A sequence of ``L`` tokens is cut into ``N = L / block_size`` blocks. The model learns
p(block b | blocks < b) by denoising: block b is corrupted at a noise level t_b in (0, 1] (each
token replaced by the MASK id with probability t_b: the linear schedule alpha(t) = 1 - t keeps
a token with probability alpha), and the model predicts the clean tokens at the masked places
from the rest of the block and from the clean blocks before it.

Training runs every block at once. The model reads ``2L`` tokens: the corrupted sequence x_t
(each block at its own t_b) followed by the clean sequence x_0. Noisy token i and clean token i
share RoPE position i. The attention mask over the ``2N`` blocks of that input (noisy blocks
0..N-1, then clean blocks N..2N-1) has three parts:

- a noisy block sees itself, in both directions (the diffusion inside the block);
- a noisy block sees the clean blocks strictly before its own (what it is conditioned on);
- a clean block sees the clean blocks up to and including its own (block-causal: it computes
  the keys and values the later noisy blocks read, as a KV cache would at sampling time).

Clean blocks never see noisy ones, so the clean half is exactly the model's view of the prefix.
With a sliding window of W tokens (``window``, whole blocks) a block reads only the W / B clean
blocks before it (a clean block: those and itself), whatever the sequence's length.

The objective is the diffusion bound's cross-entropy on the masked noisy tokens, each weighted
by -alpha'(t_b) / (1 - alpha(t_b)) = 1 / t_b, averaged over the batch's ``L`` noisy positions
per row (unmasked and clean positions weigh 0; the targets are x_0). It is written as jaxpar's
``cross_entropy`` over all ``2L`` positions with weights ``2 [masked] / t_b`` on the noisy half,
so it stays exact under a vocab-parallel layout.

The noise levels are drawn uniformly from a clipped range ``t_range`` (default ``T_RANGE``, see
there). The corruption is a numpy function of the clean tokens and a seed or Generator
(``corrupt``): a batch is made on the host, deterministically, and the same batch feeds one device
and every layout. Positions, targets and weights travel in the batch as (batch, 2L) arrays like
the other dict batches of jaxpar (``train.data.packed_batch_at``).

The network is the Llama of ``llama.py`` (the same weights and logical names, its scanned layers
with this mask instead of the causal one), over a vocabulary of the data's tokens plus MASK,
padded to a multiple of ``VOCAB_MULTIPLE``. The logits of MASK and of the padding ids are pushed
to the dtype's lowest value: a clean token is never MASK, so the model gives it no probability.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxpar.attention import BlockMask, Mask
from jaxpar.errors import JaxparError
from jaxpar.models import llama
from jaxpar.models.family import Family
from jaxpar.models.llama import LOGITS, LlamaConfig
from jaxpar.nn import block_share, cross_entropy, shard_count, shard_offset

# The noise range. The lower end bounds the loss weight 1/t (at most 10) and with it the loss's
# variance: if every masked token cost the same c, a block of B tokens at t ~ U[a, b] would have
# the variance c^2 / B * (ln(b / a) / (b - a) - 1) from the masking alone: 1.6 c^2 / B for
# [0.1, 1] against 5.9 c^2 / B for [0.001, 1]. The upper end stays 1: a fully masked block is
# where sampling starts, so it is trained on. Tighter ranges tuned per block size can be passed.
T_RANGE = (0.1, 1.0)
BLOCK_SIZE = 16  # the configs' default; the mask and the corruption take it as an argument
# The embedding and unembedding are padded to a multiple of this many ids: data + MASK alone
# (257 for bytes) divides by no tensor degree, and jaxpar refuses a vocab dim that does not split.
VOCAB_MULTIPLE = 128


# --- checks ----------------------------------------------------------------------------------------


def check_block_size(block_size) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size <= 0:
        raise JaxparError(f"block_size={block_size!r} must be a positive int (tokens per diffusion block), e.g. {BLOCK_SIZE}")


def check_blocks(length: int, block_size: int) -> int:
    """The number of blocks of a ``length``-token sequence; refuses a block size that does not divide it."""
    check_block_size(block_size)
    if length <= 0 or length % block_size:
        divisors = [d for d in range(1, length + 1) if length % d == 0] if length > 0 else []
        raise JaxparError(f"block_size={block_size} does not divide the sequence length {length}: choose a block size "
                          f"among {', '.join(map(str, divisors)) or 'none (the length must be positive)'}, or a length "
                          f"that is a multiple of {block_size}")
    return length // block_size


def check_window(window, block_size: int) -> None:
    """Refuse a sliding window that is not a whole number of blocks."""
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window <= 0 or window % block_size:
        raise JaxparError(f"window={window!r} must be a positive multiple of the block size {block_size} (the clean tokens "
                          f"before a block that it reads, in whole blocks): e.g. {', '.join(str(block_size * k) for k in (1, 2, 4, 8))}")


def check_t_range(t_range) -> None:
    lo, hi = t_range
    if not 0 < lo <= hi <= 1:
        raise JaxparError(f"t_range={tuple(t_range)} must satisfy 0 < t_min <= t_max <= 1 (t_min > 0 keeps the loss "
                          f"weight 1/t bounded), e.g. {T_RANGE}")


# --- configs ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BD3LMConfig(LlamaConfig):
    """A Llama's shapes with the diffusion's own: ids ``[0, data_vocab)`` are data, ``data_vocab``
    is MASK, ``[data_vocab + 1, vocab_size)`` padding; ``block_size`` and ``t_range`` are the
    defaults of ``loss_fn`` and of batches made for this model."""

    data_vocab: int = dataclasses.field(kw_only=True)
    block_size: int = dataclasses.field(default=BLOCK_SIZE, kw_only=True)
    t_range: tuple[float, float] = dataclasses.field(default=T_RANGE, kw_only=True)
    window: int | None = dataclasses.field(default=None, kw_only=True)  # sliding window in tokens (None: the whole prefix)

    def __post_init__(self):
        if not 0 < self.data_vocab < self.vocab_size:
            raise JaxparError(f"data_vocab={self.data_vocab} must be positive and below vocab_size={self.vocab_size}: "
                              f"the id data_vocab is the MASK token")
        check_block_size(self.block_size)
        check_t_range(self.t_range)
        check_window(self.window, self.block_size)

    @property
    def mask_id(self) -> int:
        return self.data_vocab


def diffusion_config(base: LlamaConfig, data_vocab: int, **options) -> BD3LMConfig:
    """``base``'s shapes over ``data_vocab`` data ids plus MASK, padded to ``VOCAB_MULTIPLE``."""
    shapes = {f.name: getattr(base, f.name) for f in dataclasses.fields(LlamaConfig)}
    shapes["vocab_size"] = -(-(data_vocab + 1) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    return BD3LMConfig(**shapes, data_vocab=data_vocab, **options)


CONFIGS = {
    "bd3lm-tiny": diffusion_config(llama.CONFIGS["tiny"], 256),  # the main job's tokens are bytes
    "bd3lm-8b": diffusion_config(llama.CONFIGS["llama3-8b"], 128_256),
}


# --- the mask --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _ThreePart:
    """``allowed(query block, key block)`` over [N noisy blocks | N clean blocks]. A dataclass
    rather than a closure, so that two masks of one shape compare equal."""

    blocks: int  # N: blocks per half
    window: int | None = None  # clean blocks before a block that it reads (None: all)

    def __call__(self, qb: int, kb: int) -> bool:
        n = self.blocks
        if qb < n and kb < n:  # noisy query, noisy key: its own block only
            return kb == qb
        return kb >= n and kb in self.clean_reads(qb)

    def clean_reads(self, qb: int) -> range:
        """The clean blocks (indices N..2N-1) query block ``qb`` reads: a noisy block g the clean
        blocks before g, a clean block those before it and itself, within the window."""
        n = self.blocks
        end = n + qb if qb < n else qb + 1
        first = n + (qb if qb < n else qb - n) - (self.window if self.window is not None else n)
        return range(max(n, first), end)


def block_diffusion_mask(length: int, block_size: int, window: int | None = None) -> Mask:
    """The three-part mask over the ``2 * length`` tokens [x_t ; x_0] (see the module doc), with a
    sliding ``window`` of clean tokens (whole blocks) or without, as a block mask the attention op
    evaluates blockwise, on chunks and on a ring (traced offsets)."""
    n = check_blocks(length, block_size)
    check_window(window, block_size)
    return Mask(blocks=BlockMask(_ThreePart(n, None if window is None else window // block_size), block_size, num_blocks=(2 * n, 2 * n)))


def positions_for(length: int, rows: int = 1) -> np.ndarray:
    """(rows, 2 * length) RoPE positions: noisy token i and clean token i both at i."""
    return np.tile(np.arange(length, dtype=np.int32), (rows, 2))


# --- the corruption (host side, numpy) ------------------------------------------------------------


def _token_rows(tokens) -> np.ndarray:
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise JaxparError(f"tokens must be int (rows, length); got {tokens.dtype} of shape {tokens.shape}")
    return tokens


def noise_levels(rng, rows: int, blocks: int, t_range=T_RANGE) -> np.ndarray:
    """(rows, blocks) float32 noise levels t, uniform in ``t_range``; ``rng``: a numpy Generator,
    or a seed for one (an int, or a tuple such as (seed, step))."""
    check_t_range(t_range)
    return np.random.default_rng(rng).uniform(t_range[0], t_range[1], size=(rows, blocks)).astype(np.float32)


def mask_tokens(tokens, block_size: int, t, rng, *, mask_id: int) -> dict:
    """The training batch for clean ``tokens`` (rows, L) with block b of each row corrupted at noise
    level ``t[row, b]``: each of its tokens becomes ``mask_id`` with probability t. A dict of
    (rows, 2L) arrays: ``inputs`` [x_t ; x_0] and ``targets`` [x_0 ; x_0] (int32), ``positions``
    (int32, ``positions_for``), ``weights`` (float32: 2 / t_b on masked noisy tokens, else 0)."""
    tokens = _token_rows(tokens)
    rows, length = tokens.shape
    n = check_blocks(length, block_size)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= mask_id):
        raise JaxparError(f"token ids must lie in [0, mask_id={mask_id}) (the MASK id is the first one after the data's); "
                          f"got ids in [{tokens.min()}, {tokens.max()}]")
    t = np.asarray(t, np.float32)
    if t.shape != (rows, n):
        raise JaxparError(f"t must hold one noise level per block, shape {(rows, n)}; got {t.shape}")
    t_token = np.repeat(t, block_size, axis=1)  # each token's block's level
    masked = np.random.default_rng(rng).random((rows, length)) < t_token
    noisy = np.where(masked, mask_id, tokens)
    # 2 / t: the cross-entropy means over 2L positions, the objective over the L noisy ones
    weights = np.where(masked, 2.0 / t_token, 0.0).astype(np.float32)
    return {
        "inputs": np.concatenate([noisy, tokens], axis=1).astype(np.int32),
        "targets": np.concatenate([tokens, tokens], axis=1).astype(np.int32),
        "positions": positions_for(length, rows),
        "weights": np.concatenate([weights, np.zeros_like(weights)], axis=1),
    }


def corrupt(tokens, block_size: int, rng, *, mask_id: int, t_range=T_RANGE) -> dict:
    """``mask_tokens`` at noise levels drawn from ``t_range``, one per block of each row. A pure
    function of the tokens, the block size and ``rng`` (a numpy Generator, or a seed such as
    (seed, step)): the same arguments give the same batch on every host."""
    tokens = _token_rows(tokens)
    rng = np.random.default_rng(rng)
    n = check_blocks(tokens.shape[1], block_size)
    t = noise_levels(rng, tokens.shape[0], n, t_range)
    return mask_tokens(tokens, block_size, t, rng, mask_id=mask_id)


# --- the model -------------------------------------------------------------------------------------


class BD3LM(llama.Llama):
    """The Llama network (the same weights and logical names) run on [x_t ; x_0] under the
    three-part mask; logits over ``vocab_size`` ids, of which only the data's can be predicted."""

    def __call__(self, tokens, positions=None, block_size: int | None = None, share=None):
        """Logits (batch, 2L, vocab) for int tokens (batch, 2L) = [x_t ; x_0]; ``positions``
        default ``positions_for(L)``; ``block_size`` default the config's. Under block parallelism
        ``share`` says which tokens of [x_t ; x_0] this device holds (``jaxpar.nn.block_share``):
        ``tokens`` and ``positions`` are those, and so are the logits."""
        block_size = self.cfg.block_size if block_size is None else block_size
        if share is not None:
            mask = share.mask(block_diffusion_mask(share.length, block_size, self.cfg.window))
        else:
            # under context parallelism a device holds 1/C of each row's positions (the ring evaluates
            # the mask at their places in the whole row)
            width = tokens.shape[1] * shard_count(llama.BLOCK, 1)
            if width % 2:
                raise JaxparError(f"a BD3-LM reads [x_t ; x_0], an even number of tokens per row; got {width}")
            mask = block_diffusion_mask(width // 2, block_size, self.cfg.window)
        if positions is None and share is not None:
            positions = jnp.broadcast_to(share.places % share.length, tokens.shape)  # noisy i and clean i share i
        elif positions is None:
            if tokens.shape[1] != width:
                raise JaxparError("a BD3-LM under context parallelism needs the batch's positions (the step cuts them)")
            positions = jnp.asarray(positions_for(width // 2, tokens.shape[0]))
        return _data_only(self.network(tokens, positions, mask), self.cfg.data_vocab)


def _data_only(logits, data_vocab: int):
    """Logits with MASK and the padding ids at the dtype's lowest value (finite: a -inf logit times
    a zero one-hot would be NaN in the cross-entropy). With the vocabulary split over devices each
    device holds the ids from its shard's offset."""
    local = logits.shape[-1]
    ids = shard_offset(LOGITS, 2, local) + jnp.arange(local)
    return jnp.where(ids < data_vocab, logits, jnp.finfo(logits.dtype).min)


def loss_fn(model: BD3LM, batch: dict, block_size: int | None = None):
    """The BD3-LM objective on a batch from ``corrupt`` / ``mask_tokens`` (keys ``inputs``,
    ``targets``, ``positions``, ``weights``, each (batch, 2L)): the 1/t-weighted cross-entropy of
    the masked noisy tokens, mean over the batch's noisy positions. ``block_size`` must be the
    batch's (default: the model config's). Under block parallelism each device computes the
    objective's part on its share of the rows (``parallel/block/blocks.py``)."""
    block_size = model.cfg.block_size if block_size is None else block_size
    batch, share = block_share(batch, block_size)
    logits = model(batch["inputs"], batch["positions"], block_size, share)
    loss = cross_entropy(logits, batch["targets"], LOGITS, batch["weights"])
    return loss if share is None else loss * share.loss_scale


# --- the family ------------------------------------------------------------------------------------


def corrupted_rows(cfg: BD3LMConfig, windows, seed: int, step: int, first_row: int) -> dict:
    """The batch rows of token ``windows`` (rows, L), row ``first_row + i`` corrupted by ``corrupt``
    at ``cfg``'s block size and noise range from a generator of its own (seed, step, row): a row
    is the same whichever process makes it."""
    rows = [corrupt(window[None], cfg.block_size, (seed, step, row), mask_id=cfg.mask_id, t_range=cfg.t_range)
            for row, window in enumerate(windows, first_row)]
    return {key: np.concatenate([r[key] for r in rows]) for key in rows[0]}


def _batch_fields(seq_len: int) -> dict:
    """[x_t ; x_0] rows: 2 x seq_len tokens each."""
    return {"inputs": (2 * seq_len, np.int32), "targets": (2 * seq_len, np.int32),
            "positions": (2 * seq_len, np.int32), "weights": (2 * seq_len, np.float32)}


def configure(cfg: BD3LMConfig, seq_len: int, block_size: int | None = None, window: int | None = None) -> BD3LMConfig:
    """``cfg`` with a run's ``--block-size`` and ``--window``; refuses a block size that does not
    divide ``seq_len`` and a window that is not whole blocks."""
    if block_size is not None:
        check_block_size(block_size)
        cfg = dataclasses.replace(cfg, block_size=block_size)
    if window is not None:
        check_window(window, cfg.block_size)
        cfg = dataclasses.replace(cfg, window=window)
    check_blocks(seq_len, cfg.block_size)
    return cfg


def changed(cfg: BD3LMConfig, saved: dict, given: dict) -> str | None:
    """Why a checkpoint's blocks or window (``saved``: its meta) make another function than ``cfg``'s."""
    block_size = saved.get("block_size") or CONFIGS[saved["model"]].block_size  # runs before it was recorded: the config's
    if block_size != cfg.block_size:
        now = f"--block-size {cfg.block_size}" + (" (the default)" if given.get("block_size") is None else "")
        return (f"was trained with --block-size {block_size}, and this run has {now}: other blocks make another function "
                f"of the same weights; pass --block-size {block_size} to resume it")
    if saved.get("window") != cfg.window:
        said = lambda w: f"--window {w}" if w else "no --window (the whole prefix)"  # noqa: E731
        fix = f"pass --window {saved['window']}" if saved.get("window") else "drop --window"
        return (f"was trained with {said(saved.get('window'))}, and this run has {said(cfg.window)}: another window makes "
                f"another function of the same weights; {fix} to resume it")
    return None


FAMILY = Family(
    name="bd3lm", words="block diffusion model", config_type=BD3LMConfig, configs=CONFIGS,
    model=lambda cfg, rngs: BD3LM(cfg, rngs=rngs), loss=loss_fn, rows=corrupted_rows, batch_fields=_batch_fields,
    reads=lambda seq_len: 2 * seq_len,  # [x_t ; x_0]
    options=("block_size", "window"), configure=configure, packing=False, axes=frozenset({"block"}),
    meta=lambda cfg: {"block_size": cfg.block_size, "window": cfg.window}, changed=changed,
)
