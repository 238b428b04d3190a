"""The BD3-LM sampler (jaxpar/serve/bd3lm.py): the denoising rule on a made-up model whose answers
say when each token was revealed; nucleus sampling; the KV cache against recomputing the prefix
with the training forward; a layout against one device; bad input. (From a checkpoint of `jaxpar
train`, and `jaxpar generate`: test_generate_cli.py.)

Tolerances (float32 on CPU): the cached and the recomputed logits within 1e-5 (the same sums in
other orders, over the same keys; measured differences are ~1e-6); tokens exactly equal.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.attention import use_implementation
from jaxpar.errors import JaxparError
from jaxpar.models import bd3lm, llama
from jaxpar.parallel import build_layout, parse_strategy
from jaxpar.serve import bd3lm as sampling
from jaxpar.serve import common

CFG = dataclasses.replace(bd3lm.CONFIGS["bd3lm-tiny"], layers=2)  # the tiny shapes, fewer layers: quicker compiles
MASK = CFG.mask_id
BLOCK = 8  # more blocks in few tokens


@functools.cache
def model() -> bd3lm.BD3LM:
    return bd3lm.BD3LM(CFG, rngs=nnx.Rngs(3))


@functools.cache
def sampler() -> sampling.Sampler:
    return sampling.Sampler(model(), block_size=BLOCK)


def prompt_tokens(rows: int, length: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (rows, length)).astype(np.int32)


# --- the denoising rule ----------------------------------------------------------------------------


def telling_logits(confidence, vocab: int = 16):
    """A made-up model: at each position the most probable id is the number of the block's tokens
    already known, with a probability that grows with ``confidence`` (per position): the output
    then says at which step each position was revealed."""
    confidence = jnp.asarray(confidence, jnp.float32)

    def logits_of(tokens):
        known = jnp.sum(tokens != MASK, axis=1)  # (rows,)
        hot = jax.nn.one_hot(known, vocab)[:, None, :]  # (rows, 1, vocab)
        return hot * confidence[..., None]

    return logits_of


def test_each_step_reveals_its_share_of_the_most_confident_masked_tokens():
    # 8 masked tokens in 3 steps: floor(8 s / 3) revealed after step s, i.e. 2, then 3, then 3
    confidence = [[2, 6, 4, 6, 3, 1, 5, 2]]
    done = sampling.denoise(telling_logits(confidence), jnp.full((1, 8), MASK), 3, 0.0, 1.0, jax.random.key(0), MASK)
    # most confident first, a tie in position order: 1, 3 | 6, 2, 4 | 0, 7, 5 (revealed after 0, 2, 5 were known)
    np.testing.assert_array_equal(done, [[5, 0, 2, 0, 2, 5, 2, 5]])
    # one step a token: the order itself
    done = sampling.denoise(telling_logits(confidence), jnp.full((1, 8), MASK), 8, 0.0, 1.0, jax.random.key(0), MASK)
    np.testing.assert_array_equal(done, [[5, 0, 3, 1, 4, 7, 2, 6]])


def test_given_tokens_stay_and_only_the_masked_ones_are_spread_over_the_steps():
    # the prompt's partial block: 3 tokens given, 5 masked in 2 steps: 2, then 3
    block = jnp.array([[9, 9, 9, MASK, MASK, MASK, MASK, MASK]])
    confidence = [[9, 9, 9, 1, 2, 3, 4, 5]]
    done = sampling.denoise(telling_logits(confidence), block, 2, 0.0, 1.0, jax.random.key(0), MASK)
    np.testing.assert_array_equal(done, [[9, 9, 9, 5, 5, 5, 3, 3]])  # 7, 6 first (3 known), then the rest (5 known)


def test_nucleus_sampling_draws_only_from_the_top_p_ids():
    logits = jnp.log(jnp.array([0.05, 0.5, 0.15, 0.3]))
    draws = lambda top_p, temperature=1.0: np.asarray(common.pick(  # noqa: E731
        jnp.broadcast_to(logits, (4000, 4)), temperature, top_p, jax.random.key(1)))
    assert set(np.unique(draws(0.7))) == {1, 3}  # 0.5 + 0.3 reach 0.7
    assert set(np.unique(draws(0.45))) == {1}  # the most probable alone reaches 0.45
    assert set(np.unique(draws(1e-6))) == {1}  # the most probable is always kept
    assert set(np.unique(draws(1.0))) == {0, 1, 2, 3}
    assert abs(np.mean(draws(1.0) == 1) - 0.5) < 0.03  # at temperature 1, the model's own probabilities
    assert np.mean(draws(1.0, temperature=0.25) == 1) > 0.8  # colder: sharper (0.88 at 0.25)


# --- the cache against recomputing the prefix ------------------------------------------------------


def test_the_cache_gives_the_tokens_and_logits_of_recomputing_the_prefix():
    """Greedy: 2 new blocks after a prompt of 1 block and 5 tokens, by the KV cache and by the
    training forward on [x_t block ; x_0 prefix] under the three-part mask, equal token for token."""
    s = sampler()
    prompt = prompt_tokens(2, BLOCK + 5)
    cached = s.generate(prompt, 2, denoise_steps=4)
    recomputed = s.generate(prompt, 2, denoise_steps=4, path="recompute")
    np.testing.assert_array_equal(cached, recomputed)
    assert cached.shape == (2, 3 * BLOCK)
    np.testing.assert_array_equal(cached[:, : BLOCK + 5], prompt)  # the prompt's tail opened the first new block
    assert cached.min() >= 0 and cached.max() < CFG.data_vocab  # never MASK or padding
    # what one step sees, after 2 clean blocks, with the block half revealed
    block = np.where(np.arange(BLOCK) % 2, cached[:, 2 * BLOCK:], MASK)
    by_cache = s.block_logits(cached[:, : 2 * BLOCK], block)
    by_recompute = s.block_logits(cached[:, : 2 * BLOCK], block, path="recompute")
    np.testing.assert_allclose(by_cache, by_recompute, rtol=0, atol=1e-5)
    assert np.abs(by_cache).max() > 0.1  # real logits, not an empty result


def test_the_recompute_mask_is_the_training_mask_read_from_block_b_on():
    b, n = 2, 4
    positions, mask = sampling.recompute_inputs(b, n, rows=1)
    whole = np.asarray(bd3lm.block_diffusion_mask((b + 1) * n, n).dense(2 * (b + 1) * n, 2 * (b + 1) * n))[0]
    mine = np.asarray(mask.dense((b + 1) * n, (b + 1) * n))[0]
    np.testing.assert_array_equal(mine, whole[b * n:(2 * b + 1) * n, b * n:(2 * b + 1) * n])
    np.testing.assert_array_equal(positions[0], [8, 9, 10, 11, 0, 1, 2, 3, 4, 5, 6, 7])
    assert mine[:n, :n].all() and mine[:n, n:].all() and not mine[n:, :n].any()  # noisy: itself and every clean block


def test_sampling_is_seeded():
    sample = functools.partial(sampler().generate, prompt_tokens(1, BLOCK), 2, denoise_steps=BLOCK, temperature=1.0, top_p=0.9)
    first, again, other = sample(seed=7), sample(seed=7), sample(seed=8)
    np.testing.assert_array_equal(first, again)
    assert (first != other).any()
    assert first.max() < CFG.data_vocab


def test_an_empty_prompt_and_a_long_cache_work():
    """No prompt: the first block reads an empty cache. A cache past the attention's tile (512
    keys) is rounded up to whole tiles: 8 blocks of 64 and the block's own are 576 keys, 1024 with
    the slots not yet written, which the blockwise attention reads in two tiles. The reference,
    576 tokens that no tile divides, runs the naive attention."""
    s = sampling.Sampler(model(), block_size=64)
    assert s.generate(np.zeros((1, 0), np.int32), 1, denoise_steps=2).shape == (1, 64)
    prompt = prompt_tokens(1, 8 * 64 + 10)
    cached = s.generate(prompt, 1, denoise_steps=2)
    assert cached.shape == (1, 9 * 64)
    with use_implementation("naive"):
        np.testing.assert_array_equal(cached, s.generate(prompt, 1, denoise_steps=2, path="recompute"))


# --- a layout against one device -------------------------------------------------------------------


def test_greedy_decoding_under_tensor_parallelism_equals_one_device():
    layout = build_layout(parse_strategy("tensor=2", 2), jax.devices()[:2])
    one = sampler()
    split = sampling.Sampler(model(), block_size=BLOCK, layout=layout)
    assert "tensor" in str(split.params["layers"]["wq"].sharding.spec)  # the heads are split over 2 devices
    prompt = prompt_tokens(2, BLOCK + 3, seed=1)
    np.testing.assert_array_equal(split.generate(prompt, 3, denoise_steps=4), one.generate(prompt, 3, denoise_steps=4))


def test_a_row_under_data_2_is_padded_and_the_padding_dropped():
    layout = build_layout(parse_strategy("data=2,tensor=2", 4), jax.devices()[:4])
    prompt = prompt_tokens(1, BLOCK + 3, seed=2)
    ours = sampling.Sampler(model(), block_size=BLOCK, layout=layout).generate(prompt, 2, denoise_steps=4)
    np.testing.assert_array_equal(ours, sampler().generate(prompt, 2, denoise_steps=4))  # (1, ...): the copy dropped


# --- bad input -------------------------------------------------------------------------------------


def test_bad_input_is_refused_in_words():
    s = sampler()
    prompt = prompt_tokens(1, BLOCK)
    for steps in (0, BLOCK + 1, 2.0):
        with pytest.raises(JaxparError, match=rf"denoise_steps={steps!r} must be an int from 1 to block_size={BLOCK}"):
            s.generate(prompt, 1, denoise_steps=steps)
    for temperature in (-0.5, float("nan"), float("inf")):
        with pytest.raises(JaxparError, match=r"temperature=.* must be a finite number >= 0"):
            s.generate(prompt, 1, temperature=temperature)
    for top_p in (0.0, 1.5, -1.0):
        with pytest.raises(JaxparError, match=r"top_p=.* must lie in \(0, 1\]"):
            s.generate(prompt, 1, temperature=1.0, top_p=top_p)
    with pytest.raises(JaxparError, match=r"a prompt of 13 tokens and 2 new blocks make 24 tokens \(whole blocks of 8: the "
                                          r"prompt's last 5 open the first new block\), more than max_length=16"):
        s.generate(prompt_tokens(1, 13), 2, max_length=16)
    with pytest.raises(JaxparError, match=r"new_blocks=0 must be a positive int"):
        s.generate(prompt, 0)
    with pytest.raises(JaxparError, match=r"the prompt ids must lie in \[0, 256\) \(data ids; MASK is 256\)"):
        s.generate(np.full((1, 4), MASK), 1)
    with pytest.raises(JaxparError, match=r"path='beam' is unknown"):
        s.generate(prompt, 1, path="beam")
    with pytest.raises(JaxparError, match=r"generates from block diffusion models"):
        sampling.Sampler(llama.Llama(dataclasses.replace(llama.CONFIGS["tiny"], layers=1), rngs=nnx.Rngs(0)))
    with pytest.raises(JaxparError, match=r"vocab=300 must be an int in \[1, data_vocab=256\]"):
        sampling.Sampler(model(), vocab=300)
    windowed = bd3lm.BD3LM(dataclasses.replace(model().cfg, window=32), rngs=nnx.Rngs(0))
    with pytest.raises(JaxparError, match=r"trained with a sliding window of 32 tokens.* not built yet"):
        sampling.Sampler(windowed)
