"""Collective matmul (``tp_overlap=on``): sequence parallelism's all-gathers and reduce-scatters run
as rings of collective-permutes under the block's matmuls, with the same results and bytes."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar.analysis import hlo
from jaxpar.parallel.overlap import collective_matmul
from jaxpar.errors import SpecError
from jaxpar.models import llama
from jaxpar.nn import enter_block, reduce_partial
from jaxpar.parallel import build_layout, parse_strategy
from jaxpar.train.step import Trainer
from tests.test_equivalence import (BATCH, CFG, OPTIMIZER, SEQ, assert_same, batches, llama_model, llama_oracle, oracle,  # noqa: F401
                                    sharded, tokens)  # (llama_oracle, tokens: fixtures)

PLAIN, OVERLAP = "data=2,tensor=4,sp=on", "data=2,tensor=4,sp=on,tp_overlap=on"


@pytest.mark.parametrize("devices,length", [(2, 3), (4, 6), (8, 5)])
def test_the_rings_equal_all_gather_and_reduce_scatter(devices, length):
    # a chunk of odd length goes round one way whole, an even one half each way
    mesh = jax.make_mesh((devices,), ("t",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:devices])
    rng = np.random.default_rng(devices)
    x = rng.standard_normal((devices, 2, devices * length, 3)).astype(np.float32)  # each device's own rows
    w = rng.standard_normal((3, 5)).astype(np.float32)
    project = lambda h: jnp.tanh(h @ w)  # noqa: E731 - acts on each position alone

    def run(f):  # f(this device's x) on every device, stacked
        return np.asarray(jax.jit(jax.shard_map(lambda c: f(c[0])[None], mesh=mesh, in_specs=P("t"), out_specs=P("t")))(x))

    chunk = lambda c: jax.lax.dynamic_slice_in_dim(c, jax.lax.axis_index("t") * length, length, axis=1)  # noqa: E731
    # every device's chunk of x[0]'s rows: each device gets the whole sequence, in order
    gathered = run(lambda c: collective_matmul.gather_then(chunk(jnp.asarray(x[0])), project, "t", 1))
    np.testing.assert_allclose(gathered, np.broadcast_to(np.tanh(x[0] @ w), gathered.shape), rtol=1e-5, atol=1e-6)
    ref = run(lambda c: jax.lax.psum_scatter(project(c), "t", scatter_dimension=1, tiled=True))
    np.testing.assert_allclose(run(lambda c: collective_matmul.project_then_scatter(c, project, "t", 1)), ref, rtol=1e-5, atol=1e-6)


@functools.cache
def trained(strategy):
    trainer = Trainer(build_layout(parse_strategy(strategy, 8)), llama_model, llama.loss_fn, CFG, optimizer=OPTIMIZER)
    from jaxpar.train import data
    return trainer, sharded(trainer, llama_model, llama.loss_fn, batches(data.corpus_tokens(50_000)))


def step_collectives(trainer):
    example = trainer.abstract_batch(BATCH, SEQ)
    return hlo.by_axes(hlo.collectives(trainer._step.lower(trainer.abstract_state(), example).compile().as_text(), trainer.layout.mesh))


def test_collective_matmul_equals_the_plain_step_and_moves_the_same_bytes_as_permutes(llama_oracle):
    (plain, plain_out), (ours, ours_out) = trained(PLAIN), trained(OVERLAP)
    assert_same(plain_out, llama_oracle)  # TP with SP trains like one device (test_equivalence's other layouts)
    assert_same(ours_out, plain_out)
    before, after = step_collectives(plain), step_collectives(ours)
    t, layers = 4, llama.CONFIGS["tiny"].layers
    # every block's gather and reduction is a ring both ways: per layer 2 gathers + 2 reductions, T-1
    # hops each way, forward and backward; the output layer's gather too. What stays whole is the
    # embedding's reduce-scatter (a lookup, no matmul) and its backward all-gather.
    rings = (4 * layers + 1) * 2
    assert after[("collective-permute", ("tensor",))]["count"] == rings * 2 * (t - 1)
    assert after[("all-gather", ("tensor",))]["count"] == after[("reduce-scatter", ("tensor",))]["count"] == 1
    replaced = sum(before[(kind, ("tensor",))]["bytes_per_device"] - after[(kind, ("tensor",))]["bytes_per_device"]
                   for kind in ("all-gather", "reduce-scatter"))
    assert after[("collective-permute", ("tensor",))]["bytes_per_device"] == replaced
    assert after[("all-reduce", ("tensor",))] == before[("all-reduce", ("tensor",))]  # the norms' gradients, the loss


class TwoBlockMlp(nnx.Module):
    """A user's two MLP blocks on a sequence, written with nnx.Linear, whose first block leaves the
    sequence split over the tensor axis (sequence parallelism) and whose second gathers it back."""

    def __init__(self, rngs):
        named = lambda names: nnx.with_partitioning(nnx.initializers.lecun_normal(), names)  # noqa: E731
        linear = lambda a, b, names: nnx.Linear(a, b, kernel_init=named(names), use_bias=False, rngs=rngs)  # noqa: E731
        self.up1, self.down1 = linear(16, 64, ("embed", "mlp")), linear(64, 16, ("mlp", "embed"))
        self.up2, self.down2 = linear(16, 64, ("embed", "mlp")), linear(64, 16, ("mlp", "embed"))

    def __call__(self, x):
        stream, block = ("batch", "residual_length", "embed"), ("batch", "length", "embed")
        hidden = jax.nn.gelu(self.up1(x))
        split = reduce_partial(hidden, ("mlp",), stream, project=self.down1)  # a ring reduce-scatter under the matmul
        hidden = enter_block(split, stream, block, then=lambda h: jax.nn.gelu(self.up2(h)))  # a ring all-gather
        return reduce_partial(hidden, ("mlp",), block, project=self.down2)  # whole sequences: an all-reduce


def regression_loss(model, batch):
    return jnp.mean((model(batch[..., :16]) - batch[..., 16:]) ** 2)


def test_a_users_model_under_collective_matmul_equals_one_device():
    rng = np.random.default_rng(0)
    host = [rng.standard_normal((8, 16, 32)).astype(np.float32) for _ in range(3)]
    assert_same(sharded("data=2,tensor=4,sp=on,tp_overlap=on", TwoBlockMlp, regression_loss, host),
                oracle(TwoBlockMlp, regression_loss, host))


def test_bad_input_is_refused_in_words():
    for strategy, words in {"data=8,tp_overlap=on": "tensor=1; add tensor=N,sp=on",
                            "data=2,tensor=4,tp_overlap=on": "sp=off; add sp=on",
                            "data=2,tensor=4,sp=on,tp_overlap=maybe": "use on or off"}.items():
        with pytest.raises(SpecError, match=words):
            parse_strategy(strategy, 8)
