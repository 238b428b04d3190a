"""Decoding a Llama with a KV cache (serve/llama.py): the cache against recomputing the whole
prefix, a batch of prompts of different lengths against each alone, tensor-parallel layouts
against one device, rows padded per data shard, and bad input refused in words. (From a checkpoint
of `jaxpar train`, and `jaxpar generate`: test_generate_cli.py.)"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar import attention
from jaxpar.errors import JaxparError
from jaxpar.models import bd3lm, llama
from jaxpar.parallel import build_layout, parse_strategy
from jaxpar.serve.llama import Decoder

NEW = 6
PROMPTS = [np.array([5, 17, 200, 3, 99, 42, 7], np.int32), np.array([250, 1, 64], np.int32)]


@functools.cache
def model():
    return llama.Llama(llama.CONFIGS["tiny"], rngs=nnx.Rngs(0))


@functools.cache
def one_device():
    return Decoder(model()).generate(PROMPTS, NEW).tokens


def assert_recomputed(prompt, decoded):
    """``decoded`` (the prompt, then its new tokens) is what greedy decoding by recomputing the whole
    prefix gives: the model's own forward on the whole sequence, causal, puts its argmax at every
    new token's position on that token (logits at a position read only the tokens up to it)."""
    with attention.use_implementation("naive"):  # any length (the blockwise kernel tiles by 512)
        logits = model()(jnp.asarray(decoded[None, :-1]))
    np.testing.assert_array_equal(np.asarray(jnp.argmax(logits[0, len(prompt) - 1:], -1)), decoded[len(prompt):])
    np.testing.assert_array_equal(decoded[: len(prompt)], prompt)


def test_the_cache_equals_recomputing_the_whole_prefix():
    for prompt, decoded in zip(PROMPTS, one_device()):
        assert_recomputed(prompt, decoded)


def test_a_prompt_longer_than_the_attention_tile_is_padded_to_whole_tiles():
    # 520 tokens: the prefill's keys are padded to 1024 (two tiles of 512), with the other prompt
    prompts = [np.random.default_rng(0).integers(0, 256, 520).astype(np.int32), PROMPTS[1]]
    decoded = Decoder(model()).generate(prompts, 2).tokens
    for prompt, ours in zip(prompts, decoded):
        assert_recomputed(prompt, ours)


def test_a_batch_of_prompts_of_different_lengths_equals_each_alone():
    for prompt, together in zip(PROMPTS, one_device()):
        (alone,) = Decoder(model()).generate([prompt], NEW).tokens
        np.testing.assert_array_equal(together, alone)


@pytest.mark.parametrize("strategy, devices", [("tensor=2", 2), ("tensor=4", 4), ("data=2,tensor=4", 8)])
def test_tensor_parallel_greedy_decoding_equals_one_device(strategy, devices):
    layout = build_layout(parse_strategy(strategy, devices), jax.devices()[:devices])
    decoder = Decoder(model(), layout=layout)
    # the weights are split as the layout computes with them (the MLP's columns over tensor)
    assert decoder.params["layers"]["w_up"].sharding.shard_shape((4, 128, 384))[-1] == 384 // layout.mesh.shape["tensor"]
    decoded = decoder.generate(PROMPTS, NEW)
    for ours, reference in zip(decoded.tokens, one_device()):
        np.testing.assert_array_equal(ours, reference)
    assert len(decoded.step_seconds) == NEW  # the prefill, then a step for each later token


def test_rows_are_padded_to_whole_rows_per_data_shard_and_the_padding_dropped():
    """3 prompts under data=2 (the GSPMD path) and data=2 with delay=1 (the manual one): 4 rows
    each, the fourth a copy of the first, dropped; each prompt gets one device's tokens (delayed
    TP: what it gets alone)."""
    prompts = [*PROMPTS, np.array([9, 8, 7, 6], np.int32)]
    alone = Decoder(model()).generate(prompts, NEW).tokens
    for strategy in ("data=2,tensor=2", "data=2,tensor=2,delay=1"):
        decoder = Decoder(model(), layout=build_layout(parse_strategy(strategy, 4), jax.devices()[:4]))
        decoded = decoder.generate(prompts, NEW).tokens
        assert len(decoded) == 3
        if "delay" not in strategy:
            for ours, reference in zip(decoded, alone):
                np.testing.assert_array_equal(ours, reference)
        else:  # another function than one device's: the first prompt against itself alone, padded to 2 rows
            np.testing.assert_array_equal(decoded[0], decoder.generate(prompts[:1], NEW).tokens[0])


def test_a_layout_axis_that_would_only_copy_work_is_refused():
    for strategy, devices, words in [("context=2", 2, "context=2 cannot serve: a Llama decodes one token a step"),
                                     ("stage=2,tensor=2", 4, "stage=2 cannot serve: it splits no weight of the model and not the rows")]:
        layout = build_layout(parse_strategy(strategy, devices), jax.devices()[:devices])
        with pytest.raises(JaxparError, match=words):
            Decoder(model(), layout=layout)


def test_sampling_repeats_for_a_seed_and_keeps_to_the_nucleus():
    decoder = Decoder(model())
    first, again = (decoder.generate(PROMPTS, NEW, temperature=1.0, top_p=0.9, seed=3).tokens for _ in range(2))
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    # a nucleus this small holds only the most probable id: greedy
    for sampled, greedy in zip(decoder.generate(PROMPTS, NEW, temperature=1.0, top_p=1e-6, seed=3).tokens, one_device()):
        np.testing.assert_array_equal(sampled, greedy)


def test_bad_input_is_refused_in_words():
    decoder = Decoder(model())
    with pytest.raises(JaxparError, match=r"max_length=8.*shorten the prompt"):
        decoder.generate(PROMPTS, NEW, max_length=8)
    with pytest.raises(JaxparError, match=r"ids in \[0, 300\].*\[0, 256\)"):
        decoder.generate([np.array([0, 300])], 2)
    with pytest.raises(JaxparError, match="max_new_tokens=0"):
        decoder.generate(PROMPTS, 0)
    with pytest.raises(JaxparError, match="top_p=0"):
        decoder.generate(PROMPTS, 2, temperature=1.0, top_p=0)
    with pytest.raises(JaxparError, match=r"top_p=0.9 does nothing at temperature=0 \(greedy"):
        decoder.generate(PROMPTS, 2, top_p=0.9)
    with pytest.raises(JaxparError, match="block diffusion"):
        Decoder(bd3lm.BD3LM(bd3lm.CONFIGS["bd3lm-tiny"], rngs=nnx.Rngs(0)))
