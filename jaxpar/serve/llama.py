"""Generation from a Llama (``models/llama.py``): a prefill of the prompts, then one token a step
with a KV cache.

Prompts of different lengths decode together. Each is placed so that all end at the same cache
slot (left-padded): slot s holds row i's token at position s - pad_i, where pad_i is how much
shorter row i's prompt is than the longest (and, past 512 tokens, all rows are padded to a
multiple of 512, which the attention op tiles by). The prefill runs the prompts in one step
(``Llama.network_prefill``: causal, the padding a segment of its own so that no real token reads
it), writes their keys and values into slots 0.., and picks the first new token from the last
slot's logits. Every later step runs one compiled program on one token per row at slot s
(``Llama.network_cached``): it writes the token's keys and values into slot s and reads, for row i,
the slots pad_i <= slot < s.

What a new token is: the argmax over the vocabulary (``temperature`` 0, greedy: a pure function of
the weights and the prompt) or a sample at ``temperature`` from the top-p nucleus
(``common.pick``), drawn from ``jax.random.key(seed)`` folded with the new token's index.

Under a layout (``Decoder(layout=...)``) the weights are placed as the layout computes them and the
programs are partitioned by XLA (under ``rules.use_layout`` the model's ``jaxpar.nn`` calls become
sharding constraints); greedy decoding equals one device's. Under delayed TP (``delay=1``) each
device keeps a residual stream of its own, which only jaxpar's collectives can run: the programs
then run inside one ``shard_map`` (``ServePlan.manual``), each device's cache holding its own
key/value heads, and the logits' vocabulary shards summed into whole rows before an id is picked.
On either path the rows are padded to a whole number per data shard (copies of the first prompt,
their outputs dropped), and a layout axis that would only copy work (``context``: one token a
step cannot be split) is refused (``common.check_layout``).

From a checkpoint of ``jaxpar train`` (``generate_from_checkpoint``): only the parameters are read,
into the layout's shardings, and checked against their saved checksums (``common.restore_model``);
text is UTF-8 bytes, the main job's tokens.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import affinity, corpus
from jaxpar.attention import DEFAULT_BLOCK
from jaxpar.errors import JaxparError
from jaxpar.models import family_of
from jaxpar.models.llama import LOGITS, Llama
from jaxpar.nn import shard_offset
from jaxpar.parallel import serves_manually
from jaxpar.parallel.tensor import DELAYED
from jaxpar.rules import Layout, use_layout
from jaxpar.serve.common import NEXT_TOKEN, Generated, Served, check_pick, is_int, pad_rows, pick, restore_model


@dataclasses.dataclass(frozen=True)
class Decoded:
    tokens: list  # per prompt: int32 (its length + new,), the prompt then its new tokens
    step_seconds: list  # wall time of the prefill, then of each decoding step (the first two compile)
    new_tokens: int  # per prompt

    @property
    def tokens_per_second(self) -> float:
        """New tokens of every row per second of decoding, the two compiling steps left out."""
        decoding = self.step_seconds[2:]
        return len(self.tokens) * len(decoding) / sum(decoding) if decoding else float("nan")


class Decoder(Served):
    """Greedy or sampled generation from a Llama's weights (the module doc says how).

    ``model``: a ``models.llama.Llama``. ``layout``: place the weights and compile under it
    (default: one device). ``vocab``: produce only ids below it (default the whole vocabulary; the
    byte tokenizer passes 256)."""

    DONATES = {"prefill": (1,), "step": (1,)}  # the cache, returned written
    family = "llama"

    def __init__(self, model, *, layout: Layout | None = None, vocab: int | None = None):
        cfg = model.cfg
        if not isinstance(model, Llama) or family_of(cfg).name not in NEXT_TOKEN:
            raise JaxparError(f"the decoder generates from a Llama or a mixture of experts on its layers (models.llama.Llama, "
                              f"models.moe.MoE); got a {type(model).__name__} with a {type(cfg).__name__} (block diffusion "
                              f"models have their own sampler: jaxpar.serve.bd3lm)")
        self.cfg, self.family = cfg, family_of(cfg).name
        if serves_manually(layout):  # (the plan's manual programs: each device's own heads in its cache)
            for name, count in (("kv_heads", cfg.kv_heads), ("heads", cfg.heads)):
                ways = math.prod(layout.mesh.shape[a] for a in layout.axes_of(name))
                if count % ways:
                    raise JaxparError(f"delay=1 decoding keeps each device's own {name} in its cache: the model's {count} "
                                      f"{name} must split evenly over the layout's {ways} tensor shards; use tensor={math.gcd(count, ways)}")
        super().__init__(model, layout, vocab, cfg.vocab_size, "vocab_size")

    def _specs(self, name: str):
        b = _entry(self.layout.axes_of("batch"))
        cache = (P(None, b, None, _entry(self.layout.axes_of("kv_heads")), None),) * 2
        rows = P(b)
        if name == "prefill":  # params, cache, tokens, pads, key
            return (self.param_specs, cache, rows, rows, P()), (cache, rows)
        return (self.param_specs, cache, P(), rows, rows, P()), (cache, rows)  # + the slot

    def _whole_vocab(self, logits):
        """The logits of every id: under the manual programs each device holds its vocabulary shard,
        summed here into whole rows (the same on every device, so each picks the same id)."""
        axes = self.layout.axes_of("vocab") if self.plan.manual else ()
        if not axes:
            return logits
        whole = jnp.zeros(logits.shape[:-1] + (self.cfg.vocab_size,), logits.dtype)
        offset = shard_offset(LOGITS, 2, logits.shape[-1])
        return jax.lax.psum(jax.lax.dynamic_update_slice_in_dim(whole, logits, offset, axis=2), axes)

    def _prefill(self, temperature, top_p, params, cache, tokens, pads, key):
        """(the cache with the prompts' slots written, each row's first new id) for the left-padded
        prompts ``tokens`` (rows, n)."""
        slots = jnp.arange(tokens.shape[1])
        positions = jnp.maximum(slots[None, :] - pads[:, None], 0)  # a pad's position is never read
        segments = (slots[None, :] >= pads[:, None]).astype(jnp.int32)
        logits, kv = self._model(params).network_prefill(tokens, positions, segments)
        cache = tuple(jax.lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype), 0, axis=2) for c, new in zip(cache, kv))
        logits = self._whole_vocab(logits[:, -1:])[:, 0]
        return cache, pick(logits[:, : self.vocab].astype(jnp.float32), temperature, top_p, key)

    def _step(self, temperature, top_p, params, cache, slot, tokens, pads, key):
        """(the cache with slot ``slot`` written, each row's next id) for ``tokens`` (rows,) at ``slot``."""
        positions = (slot - pads)[:, None]
        slots = jnp.arange(cache[0].shape[2])
        valid = (slots[None, :] < slot) & (slots[None, :] >= pads[:, None])
        logits, kv = self._model(params).network_cached(tokens[:, None], positions, cache, valid)
        cache = tuple(jax.lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype), slot, axis=2) for c, new in zip(cache, kv))
        logits = self._whole_vocab(logits)[:, -1]
        return cache, pick(logits[:, : self.vocab].astype(jnp.float32), temperature, top_p, key)

    def compiled_step(self, rows: int, cache_slots: int, temperature: float = 0.0, top_p: float = 1.0):
        """The compiled decoding step for ``rows`` prompts and a cache of ``cache_slots`` slots (its
        text shows the collectives each new token waits on)."""
        shape = (self.cfg.layers, rows, cache_slots, self.cfg.kv_heads, self.cfg.head_dim)
        cache = (jax.ShapeDtypeStruct(shape, self.params["embedding"].dtype),) * 2
        ids = jax.ShapeDtypeStruct((rows,), jnp.int32)
        with use_layout(self.layout):
            return self._program("step", float(temperature), float(top_p)).lower(
                self.params, cache, jax.ShapeDtypeStruct((), jnp.int32), ids, ids, jax.random.key(0)).compile()

    def _check_prompts(self, prompts) -> list[np.ndarray]:
        if isinstance(prompts, np.ndarray) and prompts.ndim == 1:
            prompts = [prompts]
        checked = []
        for i, prompt in enumerate(prompts):
            prompt = np.asarray(prompt)
            if prompt.ndim != 1 or prompt.size == 0 or not np.issubdtype(prompt.dtype, np.integer):
                raise JaxparError(f"prompt {i} must be a non-empty 1-D array of int ids; got {prompt.dtype} of shape {prompt.shape}")
            if prompt.min() < 0 or prompt.max() >= self.vocab:
                raise JaxparError(f"prompt {i} has ids in [{prompt.min()}, {prompt.max()}]; they must lie in [0, {self.vocab})")
            checked.append(prompt.astype(np.int32))
        if not checked:
            raise JaxparError("no prompt given: pass at least one")
        return checked

    def generate(self, prompts, max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                 max_length: int | None = None, progress=None) -> Decoded:
        """Each prompt (a 1-D int array, or a list of them) continued by ``max_new_tokens`` ids.
        ``max_length``: refuse a prompt that would grow longer than this many tokens (default: no bound);
        ``progress(new tokens so far)`` after each decoding step."""
        check_pick(temperature, top_p)
        if not is_int(max_new_tokens) or max_new_tokens < 1:
            raise JaxparError(f"max_new_tokens={max_new_tokens!r} must be a positive int")
        prompts = self._check_prompts(prompts)
        longest = max(len(p) for p in prompts)
        if max_length is not None and longest + max_new_tokens > max_length:
            raise JaxparError(f"a prompt of {longest} tokens and {max_new_tokens} new ones make {longest + max_new_tokens} tokens, "
                              f"more than max_length={max_length}: shorten the prompt, ask for fewer tokens or raise max_length")
        width = longest if longest <= DEFAULT_BLOCK else -(-longest // DEFAULT_BLOCK) * DEFAULT_BLOCK  # the prefill's tiling
        asked = len(prompts)
        prompts = prompts + prompts[:1] * pad_rows(asked, self.layout)  # whole rows per data shard; outputs dropped
        rows, total = len(prompts), width + max_new_tokens
        pads = np.array([width - len(p) for p in prompts], np.int32)
        out = np.zeros((rows, total), np.int32)
        for i, p in enumerate(prompts):
            out[i, pads[i]:width] = p
        slots = total - 1  # the last new token is never read
        if slots + 1 > DEFAULT_BLOCK:  # a step's keys, the cache and its own: tiled by DEFAULT_BLOCK
            slots = -(-(slots + 1) // DEFAULT_BLOCK) * DEFAULT_BLOCK - 1
        dtype = self.params["embedding"].dtype
        shape = (self.cfg.layers, rows, slots, self.cfg.kv_heads, self.cfg.head_dim)
        cache = (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
        if self.plan.manual:
            cache = jax.device_put(cache, NamedSharding(self.layout.mesh, self._specs("step")[0][1][0]))
        key, statics, seconds = jax.random.key(seed), (float(temperature), float(top_p)), []
        with use_layout(self.layout):
            begun = time.perf_counter()
            cache, picked = self._program("prefill", *statics)(self.params, cache, out[:, :width], pads, jax.random.fold_in(key, 0))
            out[:, width] = np.asarray(picked)
            seconds.append(time.perf_counter() - begun)
            if progress:
                progress(1)
            for slot in range(width, total - 1):
                begun = time.perf_counter()
                cache, picked = self._program("step", *statics)(self.params, cache, jnp.int32(slot), out[:, slot], pads,
                                                                jax.random.fold_in(key, slot + 1 - width))
                out[:, slot + 1] = np.asarray(picked)
                seconds.append(time.perf_counter() - begun)
                if progress:
                    progress(slot + 2 - width)
        return Decoded([out[i, pads[i]:] for i in range(asked)], seconds, max_new_tokens)


def _entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def generate_from_checkpoint(checkpoint_dir: str, prompts: list[str], max_new_tokens: int, *, temperature: float = 0.0,
                             top_p: float = 1.0, seed: int = 0, max_length: int | None = None, layout: Layout | None = None,
                             step: int | None = None, permutation: str | None = None, family: str = "llama",
                             progress=None) -> tuple[list[Generated], Decoded]:
    """Continue each of ``prompts`` (text) by ``max_new_tokens`` tokens from the weights of a
    ``jaxpar train`` checkpoint of a model of ``family`` (a Llama, or ``moe``), as ``Decoder.generate`` does on their ids by the
    tokenizer the run trained with (UTF-8 bytes, or the file its checkpoint directory keeps: ``corpus.kept``):
    (one ``Generated`` per prompt, the decoding's ``Decoded``). ``max_length``: default the run's
    ``--seq-len`` (positions beyond it were never trained on; pass a larger one to go further).
    ``permutation``: a file of ``jaxpar affinity`` whose order of heads and MLP columns the weights
    take when loaded (the checkpoint keeps its own). ``progress``: as for ``Decoder.generate``."""
    check_pick(temperature, top_p)
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise JaxparError(f"max_new_tokens={max_new_tokens!r} must be a positive int")
    empty = [i for i, p in enumerate(prompts) if not p]
    if not prompts or empty:
        raise JaxparError(f"prompt {empty[0]} is empty: give each prompt some text" if empty else "no prompt given: pass at least one")
    encoded, tokenizer = [], []  # the prompts' ids, by the tokenizer the run trained with (its meta names it)
    placed = []  # the permutation, once read and checked against the model and the layout

    def check(meta, cfg):  # before any array is read
        tokenizer[:] = [corpus.kept(checkpoint_dir, meta.get("tokenizer", {"identity": corpus.BYTES})["identity"])]
        encoded[:] = [np.asarray(tokenizer[0].encode(p), np.int32) for p in prompts]
        bound, what = (meta["data"]["seq_len"], "the run's --seq-len") if max_length is None else (max_length, "max_length")
        longest = max(len(e) for e in encoded)
        if longest + max_new_tokens > bound:
            raise JaxparError(f"a prompt of {longest} tokens and {max_new_tokens} new ones make {longest + max_new_tokens} tokens, "
                              f"more than {bound} ({what}): shorten the prompt or ask for fewer tokens")
        if permutation is not None:
            placed[:] = [affinity.load(permutation, meta["model"], cfg, serving=True, layout=layout)]

    model, meta = restore_model(checkpoint_dir, family, layout=layout, step=step, check_meta=check)
    _warn_of_delay(meta, layout, permutation)
    if placed:
        affinity.permute_model(model, placed[0])
    words = tokenizer[0]
    decoded = Decoder(model, layout=layout, vocab=words.vocab_size).generate(encoded, max_new_tokens, temperature=temperature,
                                                                             top_p=top_p, seed=seed, progress=progress)
    return [Generated(words.decode(t), words.decode(t[len(e):]), t, len(e), meta["model"], meta["step"])
            for t, e in zip(decoded.tokens, encoded)], decoded


def _warn_of_delay(meta: dict, layout: Layout | None, permutation: str | None) -> None:
    """Say so when the model served is not the function trained: delayed TP (``delay=1``) on one
    side only, or a DTP model's units moved by a permutation."""
    trained, served = "delay=1" in meta["strategy"].split(","), bool(layout is not None and layout.role(DELAYED))
    if trained and permutation is not None:
        warnings.warn(f"checkpoint of {meta['model']} was trained under {meta['strategy']!r} with its heads and MLP "
                      f"columns where they are: the permutation changes what each device sees late, so the model served "
                      f"is not the one trained (choose a permutation for a model trained as TP)", stacklevel=3)
    if trained != served:
        warnings.warn(f"checkpoint of {meta['model']} trained under {meta['strategy']!r} is served "
                      f"{'with' if served else 'without'} delay=1: delayed TP computes a different function from TP, "
                      f"so the text may be worse than the model's held-out loss says", stacklevel=3)
