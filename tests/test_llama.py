"""The reference model: published sizes, logical names on every weight, and no memory for big configs."""
import jax
import pytest
from flax import nnx

from jaxpar.models import llama
from jaxpar.rules import LOGICAL_AXES
from jaxpar.train.state import abstract_model


@pytest.mark.parametrize(
    "name, published",
    [("llama2-7b", 6.74e9), ("llama3-8b", 8.03e9), ("llama2-70b", 68.98e9)],
)
def test_big_configs_have_their_published_size_without_memory(name, published):
    before = len(jax.live_arrays())
    _, state = abstract_model(lambda r: llama.Llama(llama.CONFIGS[name], rngs=r))
    assert len(jax.live_arrays()) == before  # shapes only
    count = sum(v.get_value().size for _, v in nnx.to_flat_state(state))
    assert count == llama.CONFIGS[name].num_params()
    assert count == pytest.approx(published, rel=0.01)


def test_every_weight_has_a_known_logical_name_per_dim():
    _, state = abstract_model(lambda r: llama.Llama(llama.CONFIGS["tiny"], rngs=r))
    for path, var in nnx.to_flat_state(state):
        names = var.get_metadata()["out_sharding"]
        assert len(names) == var.get_value().ndim, path
        assert set(names) <= set(LOGICAL_AXES), path


def test_causal_attention_ignores_the_future():
    model = llama.Llama(llama.CONFIGS["tiny"], rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
    changed = tokens.at[:, 10:].set((tokens[:, 10:] + 1) % 256)
    a, b = model(tokens), model(changed)
    assert jax.numpy.allclose(a[:, :10], b[:, :10], atol=1e-5)
    assert not jax.numpy.allclose(a[:, 10:], b[:, 10:], atol=1e-3)


def test_each_packed_document_loses_as_if_alone():
    # a packed row against each of its documents alone at the start of a row of its own (what
    # follows it there cannot reach it under the causal mask); float32 on one device
    import numpy as np
    import optax

    from jaxpar.train import data

    seq = 256
    docs = data.documents(data.corpus_tokens(50_000))
    packed = data.packed_batch_at(docs, step=0, batch_size=2, seq_len=seq, seed=0)
    plan = data.packing_plan([len(d) for d in docs], 0, 2, seq, 0)
    pieces = [(row, segment, docs[doc][:take]) for row, held in enumerate(plan) for segment, (doc, take) in enumerate(held, start=1)]
    assert len(pieces) >= 4
    alone = np.zeros((len(pieces), seq + 1), np.int32)
    for i, (_, _, piece) in enumerate(pieces):
        alone[i, :len(piece)] = piece
    model = llama.Llama(llama.CONFIGS["tiny"], rngs=nnx.Rngs(0))
    per_token = lambda logits, targets: optax.softmax_cross_entropy_with_integer_labels(logits, targets)  # noqa: E731
    run = nnx.jit(lambda m, x, p, s: m(x, p, s))
    packed_losses = per_token(run(model, packed["inputs"], packed["positions"], packed["segments"]), packed["targets"])
    alone_losses = per_token(nnx.jit(lambda m, x: m(x))(model, alone[:, :-1]), alone[:, 1:])
    for i, (row, segment, piece) in enumerate(pieces):
        got = packed_losses[row][packed["segments"][row] == segment]
        np.testing.assert_allclose(got, alone_losses[i, :len(piece) - 1], rtol=1e-5, atol=1e-5)
    # the model's loss is the mean over the real tokens only
    real = packed["segments"] > 0
    assert float(llama.loss_fn(model, packed)) == pytest.approx(float(packed_losses[real].mean()), rel=1e-5)
