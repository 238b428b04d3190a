"""Delayed tensor parallelism (``delay=1``) trains and decodes like its single-device simulation.

The oracle is written here with plain JAX on one device: the Llama's weights split into D virtual
shards (each holds H/D query heads, K/D key/value heads, M/D MLP columns, V/D vocabulary rows),
each shard with a residual stream of its own, adding after every sublayer its own partial output
at once and the other shards' partial outputs of the sublayer before (the same algorithm as
``parallel/delayed.py``, none of its code). Attention is ``jax.nn.dot_product_attention``.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxpar import affinity
from jaxpar.analysis import hlo
from jaxpar.errors import JaxparError, LayoutError, SpecError
from jaxpar.models import llama
from jaxpar.parallel import build_layout, parse_strategy
from jaxpar.parallel import tensor
from jaxpar.report import Measured
from jaxpar.serve.llama import Decoder
from jaxpar.train import data
from jaxpar.train.step import Trainer
from tests.test_equivalence import (BATCH, CFG, OPTIMIZER, SEQ, assert_same, batches, initial_weights, llama_model, oracle, sharded,
                                    tokens)  # noqa: F401 (tokens: a fixture)

TINY = llama.CONFIGS["tiny"]


def _rms(x, scale, eps=TINY.norm_eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _rotary(x, positions, theta=TINY.rope_theta):  # (b, n, heads, d), the half-split convention
    half = x.shape[-1] // 2
    angles = positions[:, :, None, None] * theta ** (-jnp.arange(half) / half)
    first, second = x[..., :half], x[..., half:]
    return jnp.concatenate([first * jnp.cos(angles) - second * jnp.sin(angles),
                            second * jnp.cos(angles) + first * jnp.sin(angles)], axis=-1)


def simulated_logits(weights, tokens, shards: int):
    """Logits (b, n, V) of delayed TP over ``shards`` virtual devices; ``weights``: the Llama's pure
    dict. The shards are a leading dim of every per-shard array (``jax.vmap`` runs each shard's
    sublayer on its own stream), the layers a ``lax.scan``."""
    cfg, d = TINY, shards
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape).astype(jnp.float32)

    def split(w, axis):  # (..., n, ...) -> (d, ..., n / d, ...): shard s holds the s-th contiguous block
        return jnp.moveaxis(w.reshape(w.shape[:axis] + (d, w.shape[axis] // d) + w.shape[axis + 1:]), axis, 0)

    def attention(stream, w):  # one shard's partial output of attention
        h = _rms(stream, w["attn_norm"])
        q = _rotary(jnp.einsum("ble,ehd->blhd", h, w["wq"]), positions)
        k = _rotary(jnp.einsum("ble,ekd->blkd", h, w["wk"]), positions)
        v = jnp.einsum("ble,ekd->blkd", h, w["wv"])
        return jnp.einsum("blhd,hde->ble", jax.nn.dot_product_attention(q, k, v, is_causal=True), w["wo"])

    def mlp(stream, w):
        h = _rms(stream, w["mlp_norm"])
        return (jax.nn.silu(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"]

    def add(streams, pending, partials):  # each shard: its own partial now, the others' previous ones late
        return streams + partials + (pending.sum(0) - pending), partials

    def layer(carry, w):
        streams, pending = carry
        shared = {"attn_norm": w["attn_norm"], "mlp_norm": w["mlp_norm"]}
        own = {"wq": split(w["wq"], 1), "wk": split(w["wk"], 1), "wv": split(w["wv"], 1), "wo": split(w["wo"], 0),
               "w_gate": split(w["w_gate"], 1), "w_up": split(w["w_up"], 1), "w_down": split(w["w_down"], 0)}
        streams, pending = add(streams, pending, jax.vmap(lambda s, o: attention(s, {**shared, **o}))(streams, own))
        streams, pending = add(streams, pending, jax.vmap(lambda s, o: mlp(s, {**shared, **o}))(streams, own))
        return (streams, pending), None

    first = jnp.broadcast_to(weights["embedding"][tokens], (d, *tokens.shape, cfg.embed))
    (streams, pending), _ = jax.lax.scan(layer, (first, jnp.zeros_like(first)), weights["layers"])
    streams = streams + (pending.sum(0) - pending)
    # each shard's vocabulary rows from its own copy of the stream (the copies agree to rounding)
    logits = jax.vmap(lambda s, u: _rms(s, weights["final_norm"]) @ u)(streams, split(weights["unembedding"], 1))
    return jnp.moveaxis(logits, 0, -2).reshape(*tokens.shape, cfg.vocab_size)


def simulated_loss(shards):
    def loss(model, batch):
        logits = simulated_logits(nnx.to_pure_dict(nnx.state(model)), batch[:, :-1], shards)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]))
    return loss


@functools.cache
def trained(strategy, steps=3):
    """(the layout's Trainer, its losses, first gradients, final weights), shared by the tests that
    read the program that ran."""
    trainer = Trainer(build_layout(parse_strategy(strategy, 8)), llama_model, llama.loss_fn, CFG, optimizer=OPTIMIZER)
    return trainer, sharded(trainer, llama_model, llama.loss_fn, batches(data.corpus_tokens(50_000))[:steps])


def tensor_section(trainer):
    example = trainer.abstract_batch(BATCH, SEQ)
    text = trainer._step.lower(trainer.abstract_state(), example).compile().as_text()
    return tensor.report(trainer.layout, Measured(text, trainer.layout.mesh, {}, SEQ), TINY)


@pytest.mark.parametrize("strategy,shards", [("data=2,tensor=4,delay=1", 4)])
def test_delayed_training_equals_its_simulation(strategy, shards, tokens):
    trainer, ours = trained(strategy)
    assert_same(ours, oracle(llama_model, simulated_loss(shards), batches(tokens)))
    # and it is a different function from TP (so the test above can tell them apart): the first loss
    first = batches(tokens)[0]
    logits = jax.jit(simulated_logits, static_argnums=2)(initial_weights(llama_model), jnp.asarray(first[:, :-1]), 1)
    tp = float(jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(first[:, 1:]))))
    assert abs(ours[0][0] - tp) > 1e-4
    # in its compiled step no forward sublayer waits on its own all-reduce (TP's both do: test_main_job)
    assert tensor_section(trainer) == {"delayed": True, "axes": ["tensor"], "all_reduces_per_layer": 2, "blocking_per_layer": 0}


def test_delay_0_is_tensor_parallelism_bit_for_bit():
    # the same program, so the same bits (TP's 2 blocking all-reduces per layer: test_main_job)
    def program(strategy):
        trainer = Trainer(build_layout(parse_strategy(strategy, 8)), llama_model, llama.loss_fn, CFG, optimizer=OPTIMIZER)
        example = trainer.abstract_batch(BATCH, SEQ)
        return trainer.jit_step(example).lower(trainer.abstract_state(), example).as_text()

    assert program("data=4,tensor=2,delay=0") == program("data=4,tensor=2")
    assert program("data=4,tensor=2,delay=1") != program("data=4,tensor=2")


@pytest.fixture(scope="module")
def loud_weights():
    """The tiny Llama's weights with its sublayers' outputs made 8 times louder: what a device sees
    late then changes which id wins, so DTP's tokens differ from TP's (checked below)."""
    weights = jax.tree.map(np.array, initial_weights(llama_model))
    for name in ("wo", "w_down"):
        weights["layers"][name] *= 8
    return weights


def _with_weights(weights):
    with nnx.use_eager_sharding(False):
        model = llama_model(nnx.Rngs(jax.random.key(0)))
    state = nnx.state(model)
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, weights))
    nnx.update(model, state)
    return model


def _greedy_of(weights, tokens, prompt_length: int, shards: int) -> np.ndarray:
    """``tokens`` (a prompt then new ids) with each new id replaced by the simulation's argmax after
    the ids before it: equal to ``tokens`` exactly when they are the simulation's greedy decoding."""
    logits = jax.jit(simulated_logits, static_argnums=2)(weights, jnp.asarray(tokens[None, :-1]), shards)
    return np.concatenate([tokens[:prompt_length], np.asarray(jnp.argmax(logits[0, prompt_length - 1:], -1))])


def test_delayed_decoding_equals_its_simulation(loud_weights):
    # two prompts of different lengths, padded to a whole row per data shard (a third row, dropped)
    prompts = [np.arange(7, dtype=np.int32) * 11 % 256, np.arange(3, dtype=np.int32) * 29 % 256, np.array([5, 9], np.int32)]
    layout = build_layout(parse_strategy("data=2,tensor=4,delay=1", 8))
    decoded = Decoder(_with_weights(loud_weights), layout=layout).generate(prompts, 8)
    assert len(decoded.tokens) == 3
    for prompt, tokens in zip(prompts, decoded.tokens):
        np.testing.assert_array_equal(_greedy_of(loud_weights, tokens, len(prompt), 4), tokens)
    tp = _greedy_of(loud_weights, decoded.tokens[0], len(prompts[0]), 1)
    assert not np.array_equal(tp, decoded.tokens[0]), "TP would decode the same tokens: the check above could not tell DTP from TP"


@pytest.mark.parametrize("strategy,blocking", [("data=2,tensor=4", 2), ("data=2,tensor=4,delay=1", 0)])
def test_a_decoding_step_waits_on_no_all_reduce_of_its_own_under_delay(strategy, blocking, loud_weights):
    decoder = Decoder(_with_weights(loud_weights), layout=build_layout(parse_strategy(strategy, 8)))
    loops = hlo.blocking_collectives(decoder.compiled_step(4, 32).as_text())
    assert [(loop["trips"], loop["collectives"], loop["blocking"]) for loop in loops] == [(TINY.layers, 2, blocking)]


class PlainMlp(nnx.Module):
    """A plain Flax model: no jaxpar call, so XLA's partitioner would place its collectives."""

    def __init__(self, rngs):
        named = lambda names: nnx.with_partitioning(nnx.initializers.lecun_normal(), names)  # noqa: E731
        self.up = nnx.Linear(16, 64, kernel_init=named(("embed", "mlp")), use_bias=False, rngs=rngs)
        self.down = nnx.Linear(64, 16, kernel_init=named(("mlp", "embed")), use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


def test_bad_input_is_refused_in_words(loud_weights):
    refusals = {
        "data=8,delay=1": "tensor=1; add tensor=N",
        "data=4,tensor=2,delay=1,sp=on": "drop one of the two",
        "stage=2,tensor=4,delay=1": "stage=2",
        "data=4,tensor=2,delay=2": "delay=1",
    }
    for strategy, words in refusals.items():
        with pytest.raises(SpecError, match=words):
            parse_strategy(strategy, 8)
    layout = build_layout(parse_strategy("data=4,tensor=2,delay=1", 8))
    mse = lambda model, batch: jnp.mean((model(batch[:, :16]) - batch[:, 16:]) ** 2)  # noqa: E731
    trainer = Trainer(layout, PlainMlp, mse, CFG, optimizer=OPTIMIZER)
    with pytest.raises(LayoutError, match="never adds a sublayer to its residual stream"):
        trainer.step(trainer.init(seed=0), trainer.put_batch(np.zeros((16, 32), np.float32)))
    with pytest.raises(JaxparError, match="kv_heads must split evenly"):  # 4 key/value heads over 8 tensor shards
        Decoder(_with_weights(loud_weights), layout=build_layout(parse_strategy("tensor=8,delay=1", 8)))


def test_a_permuted_model_is_the_same_function_under_tp_and_a_different_one_under_dtp(loud_weights):
    cfg = TINY
    for shards in (2, 4):
        chosen = affinity.assign(loud_weights, cfg, shards)
        for order in (*chosen.groups, *chosen.columns):  # every unit once, each device an equal share
            assert sorted(order) == list(range(len(order)))
        permuted = affinity.permute(loud_weights, cfg, chosen)
        back = affinity.permute(permuted, cfg, chosen, inverse=True)
        jax.tree.map(np.testing.assert_array_equal, back, loud_weights)
        ids = jnp.asarray(np.arange(24, dtype=np.int32)[None] * 7 % 256)
        with jax.default_device(jax.devices()[0]):
            tp = [_with_weights(w)(ids) for w in (loud_weights, permuted)]
            np.testing.assert_allclose(tp[1], tp[0], rtol=1e-4, atol=1e-4)  # heads and columns only change places
            dtp = [jax.jit(simulated_logits, static_argnums=2)(w, ids, shards) for w in (loud_weights, permuted)]
            assert np.abs(np.asarray(dtp[1]) - np.asarray(dtp[0])).max() > 1e-2  # who sits with whom matters under DTP
        kept = {m: affinity.kept_coupling(loud_weights, cfg, affinity.assign(loud_weights, cfg, shards, m)) for m in affinity.METHODS}
        assert kept["affinity"] > max(kept["random"], kept["identity"])


def test_a_permutation_file_is_checked_against_the_model(tmp_path, loud_weights):
    chosen = affinity.assign(loud_weights, TINY, 2)
    path = str(tmp_path / "p.json")
    affinity.save(chosen, path, "tiny", TINY)
    loaded = affinity.load(path, "tiny", TINY)
    np.testing.assert_array_equal(loaded.columns, chosen.columns)
    wider = llama.LlamaConfig(**{**TINY.__dict__, "mlp": 512})
    with pytest.raises(JaxparError, match="mlp 384 there, 512 here"):
        affinity.load(path, "mine", wider)
    with open(path, "w") as f:
        f.write('{"model": "tiny"')
    with pytest.raises(JaxparError, match="cannot read the permutation file"):
        affinity.load(path, "tiny", TINY)
    with pytest.raises(JaxparError, match="do not split evenly over 8 tensor shards"):
        affinity.assign(loud_weights, TINY, 8)
