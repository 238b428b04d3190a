"""The reference model: published sizes, logical names on every weight, and no memory for big configs."""
import jax
import pytest
from flax import nnx

from jaxpar.models import llama
from jaxpar.rules import LOGICAL_AXES
from jaxpar.train.step import abstract_model


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
