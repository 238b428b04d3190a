"""Decoding a Llama with a KV cache (serve/llama.py): the cache against recomputing the whole
prefix, a batch of prompts of different lengths against each alone, tensor-parallel layouts
against one device, and bad input refused in words."""
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar import attention
from jaxpar.errors import JaxparError
from jaxpar.models import bd3lm, llama
from jaxpar.parallel import build_layout, parse_strategy
from jaxpar.serve import common
from jaxpar.serve import llama as serving
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


# --- from a checkpoint of the main job -------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A checkpoint of `jaxpar train --model tiny --seq-len 32` after 10 steps on one device."""
    from jaxpar.topology import load_topology
    from jaxpar.train.checkpoint import CheckpointConfig
    from jaxpar.train.loop import RunConfig, run_training

    directory = tmp_path_factory.mktemp("llama") / "run"
    run = RunConfig(model="tiny", strategy="data=1", steps=10, batch_size=8, seq_len=32)
    run_training(run, load_topology("cpu-1"), progress=None, checkpoint=CheckpointConfig(str(directory), every=10))
    return str(directory)


def test_generation_from_a_checkpoint_of_the_main_job(trained):
    outs, decoded = serving.generate_from_checkpoint(trained, ["The ", "A b"], 8)
    model, meta = common.restore_model(trained, "llama")
    alone = Decoder(model, vocab=256).generate([common.encode_text("The ")], 8).tokens[0]
    assert [(o.model, o.step, o.prompt_tokens) for o in outs] == [("tiny", 10, 4), ("tiny", 10, 3)]
    np.testing.assert_array_equal(outs[0].tokens, alone)
    assert outs[0].text.startswith("The ") and outs[0].continuation == common.decode_tokens(outs[0].tokens[4:])
    assert all(o.tokens.max() < 256 for o in outs) and len(decoded.step_seconds) == 8
    with pytest.raises(JaxparError, match=r"make 33 tokens, more than 32 \(the run's --seq-len\)"):
        serving.generate_from_checkpoint(trained, ["The "], 29)
    with pytest.raises(JaxparError, match=r"holds 'tiny', a Llama; this generates from block diffusion models"):
        common.restore_model(trained, "bd3lm")


def test_jaxpar_generate_continues_each_prompt_of_a_file(trained, tmp_path, capsys):
    from jaxpar import cli

    (tmp_path / "prompts.txt").write_text("The \nA b\n")
    argv = ["generate", "--checkpoint-dir", trained, "--prompts-file", str(tmp_path / "prompts.txt"), "--max-new-tokens", "8",
            "--strategy", "data=2,tensor=2", "--topology", "cpu-4", "--json", str(tmp_path / "out.json")]
    assert cli.main(argv) == cli.EXIT_OK, capsys.readouterr().err
    printed = capsys.readouterr()
    expected, _ = serving.generate_from_checkpoint(trained, ["The ", "A b"], 8)  # one device
    assert printed.out.startswith(expected[0].text) and "2 x 8 new tokens" in printed.err
    written = json.loads((tmp_path / "out.json").read_text())
    assert [p["tokens"] for p in written["prompts"]] == [[int(t) for t in o.tokens] for o in expected]
    assert len(written["step_seconds"]) == 8 and written["tokens_per_second"] > 0
    assert cli.main([*argv[:3], "--prompt", "The ", "--new-blocks", "2"]) == cli.EXIT_BAD_INPUT
    assert "--new-blocks is for block diffusion models" in capsys.readouterr().err


def test_jaxpar_affinity_writes_a_permutation_that_generate_applies_under_delay(trained, tmp_path, capsys):
    from jaxpar import affinity, cli

    perm = str(tmp_path / "perm.json")
    assert cli.main(["affinity", "--checkpoint-dir", trained, "--tensor", "2", "--out", perm]) == cli.EXIT_OK
    printed = capsys.readouterr().out
    assert "affinity" in printed and "random" in printed and "identity" in printed
    argv = ["generate", "--checkpoint-dir", trained, "--prompt", "The ", "--max-new-tokens", "6", "--strategy",
            "data=2,tensor=2,delay=1", "--topology", "cpu-4", "--permutation", perm, "--json", str(tmp_path / "out.json")]
    with pytest.warns(UserWarning, match="served with delay=1"):  # trained as TP
        assert cli.main(argv) == cli.EXIT_OK, capsys.readouterr().err
    # the same as the decoder on the weights permuted by hand, under the same layout
    model, meta = common.restore_model(trained, "llama")
    affinity.permute_model(model, affinity.load(perm, meta["model"], model.cfg))
    layout = build_layout(parse_strategy("data=2,tensor=2,delay=1", 4), jax.devices()[:4])
    expected = Decoder(model, layout=layout, vocab=256).generate([common.encode_text("The ")], 6).tokens[0]
    assert json.loads((tmp_path / "out.json").read_text())["prompts"][0]["tokens"] == [int(t) for t in expected]
    capsys.readouterr()
    # a permutation made for another model is refused before any weight is read
    other = llama.CONFIGS["llama-1b"]
    made = affinity.Permutation(2, np.tile(np.arange(other.kv_heads), (other.layers, 1)), np.tile(np.arange(other.mlp), (other.layers, 1)))
    affinity.save(made, str(tmp_path / "other.json"), "llama-1b", other)
    assert cli.main([*argv[:-2], "--permutation", str(tmp_path / "other.json")]) == cli.EXIT_BAD_INPUT
    assert "was made for model 'llama-1b', whose shape differs from that of 'tiny'" in capsys.readouterr().err
