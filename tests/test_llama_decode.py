"""Decoding a Llama with a KV cache (serve/llama.py): the cache against recomputing the whole
prefix, a batch of prompts of different lengths against each alone, tensor-parallel layouts
against one device, and bad input refused in words."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

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


def recomputed(prompt, new):
    """Greedy continuation by the model's own forward on the whole prefix at every step."""
    tokens = list(prompt)
    for _ in range(new):
        logits = model()(jnp.asarray([tokens], jnp.int32))
        tokens.append(int(jnp.argmax(logits[0, -1])))
    return np.array(tokens, np.int32)


def test_the_cache_equals_recomputing_the_whole_prefix():
    for prompt, decoded in zip(PROMPTS, one_device()):
        np.testing.assert_array_equal(decoded, recomputed(prompt, NEW))


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
    assert len(decoded.step_seconds) == len(PROMPTS[0]) + NEW - 1


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
    with pytest.raises(JaxparError, match="block diffusion"):
        Decoder(bd3lm.BD3LM(bd3lm.CONFIGS["bd3lm-tiny"], rngs=nnx.Rngs(0)))
