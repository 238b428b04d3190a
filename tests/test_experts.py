"""The mixture-of-experts MLP on one device (jaxpar/experts.py): the grouped-matmul block equals a
per-expert loop written here, value and gradients, an expert that receives no token included; the
dispatch offsets alone; the load-balancing loss against its formula; a top-k the experts cannot give
refused in words."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.errors import JaxparError
from jaxpar import experts as moe

TOKENS, EMBED, MLP, EXPERTS, TOP_K = 12, 8, 16, 4, 2
ROUTING = moe.Routing(EXPERTS, TOP_K)


def block(x, *w):
    return moe.mixture(x[None], *w, ROUTING)[0][0]


def weights(seed=0, silent_expert=None):
    """(x, router, gate, up, down); with ``silent_expert``, a router that never picks that expert."""
    keys = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(keys[0], (TOKENS, EMBED))
    router = jax.random.normal(keys[1], (EMBED, EXPERTS))
    if silent_expert is not None:  # its logit far below every other for every token
        x = jnp.abs(x)
        router = router.at[:, silent_expert].set(-100.0)
    gate, up = (jax.random.normal(k, (EXPERTS, EMBED, MLP)) / EMBED**0.5 for k in keys[2:4])
    down = jax.random.normal(keys[4], (EXPERTS, MLP, EMBED)) / MLP**0.5
    return x, router, gate, up, down


def loop_moe(x, router, gate, up, down):
    """The oracle: token by token, its top-k experts' SwiGLU outputs summed with the renormalised
    softmax weights."""
    probs = jax.nn.softmax(x @ router, axis=-1)
    out = []
    for t in range(x.shape[0]):
        top = jnp.argsort(-probs[t])[:TOP_K]
        w = probs[t, top] / jnp.sum(probs[t, top])
        y = jnp.zeros(EMBED)
        for k, e in enumerate(top):
            y = y + w[k] * ((jax.nn.silu(x[t] @ gate[e]) * (x[t] @ up[e])) @ down[e])
        out.append(y)
    return jnp.stack(out)


@pytest.mark.parametrize("silent_expert", [None, 2])
def test_the_block_equals_a_per_expert_loop_value_and_gradients(silent_expert):
    args = weights(silent_expert=silent_expert)
    if silent_expert is not None:
        _, experts, _ = moe.route(args[0] @ args[1], ROUTING)
        assert not (experts == silent_expert).any()  # the case the test is about: an empty group
    got = block(*args)
    np.testing.assert_allclose(got, jax.jit(loop_moe)(*args), rtol=1e-5, atol=1e-5)
    probe = jax.random.normal(jax.random.key(9), (TOKENS, EMBED))  # a loss that weighs every output differently
    grads = jax.grad(lambda *a: jnp.sum(block(*a) * probe), argnums=(0, 1, 2, 3, 4))(*args)
    # (the loop compiled: run op by op, its gradient took 18 s of the suite)
    want = jax.jit(jax.grad(lambda *a: jnp.sum(loop_moe(*a) * probe), argnums=(0, 1, 2, 3, 4)))(*args)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_megablox_grouped_matmuls_equal_ragged_dot_with_rows_past_the_groups():
    # the megablox Pallas kernel (interpret mode here; expert parallelism takes it on TPU) against
    # ragged_dot: groups of 3, 0 (an empty expert), 2, 1 copies in 8 rows, rows 6 and 7 past them
    x, _, gate, up, down = weights()
    copies, sizes = x[:8], jnp.array([3, 0, 2, 1])
    probe = jax.random.normal(jax.random.key(5), (8, EMBED))

    def run(kernel, interpret=False):
        mlp = lambda c, g, u, d: moe.experts_mlp(c, sizes, g, u, d, kernel, interpret)  # noqa: E731
        return mlp(copies, gate, up, down), jax.grad(lambda *a: jnp.sum(mlp(*a) * probe), argnums=(0, 1, 2, 3))(copies, gate, up, down)

    (want, want_grads), (got, got_grads) = run("ragged_dot"), run("megablox", interpret=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert (got[6:] == 0).all()
    np.testing.assert_allclose(got_grads[0][:6], want_grads[0][:6], rtol=1e-5, atol=1e-6)  # (rows past the groups: unwritten)
    for g, w in zip(got_grads[1:], want_grads[1:]):  # the experts' weights: only their own rows, whole
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    assert moe.megablox_tiling(4096, 4096, 14336) == (512, 1024, 1024) and moe.megablox_tiling(1000, 64, 64) is None  # 1000 rows: no whole 512-row tiles


def test_dispatch_groups_each_experts_copies_and_counts_an_empty_expert():
    experts = jnp.array([[3, 0], [0, 3], [1, 3]])  # token copies 0..5; expert 2 gets none
    order, sizes = moe.dispatch(experts, 4)
    assert sizes.tolist() == [2, 1, 0, 3]
    assert order.tolist() == [1, 2, 4, 0, 3, 5]  # expert 0: copies 1, 2; expert 1: copy 4; expert 3: copies 0, 3, 5
    outputs = jnp.arange(6.0)[:, None] * jnp.ones((6, 2))  # sorted copy j carries j
    combined = moe.combine(outputs, order, jnp.array([[1.0, 10.0], [1.0, 10.0], [1.0, 10.0]]))
    # token 0: copy 0 (sorted 3) + 10 x copy 1 (sorted 0); token 1: copy 2 (sorted 1) + 10 x copy 3 (sorted 4); ...
    assert combined[:, 0].tolist() == [3.0 + 10 * 0.0, 1.0 + 10 * 4.0, 2.0 + 10 * 5.0]


def loss(probs, experts):
    return moe.balance_loss(moe.balance_sums(jnp.asarray(experts), jnp.asarray(probs), EXPERTS), experts.shape[1])


def test_load_balancing_loss_equals_its_formula():
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(EXPERTS), size=TOKENS)
    experts = np.argsort(-probs, axis=1)[:, :TOP_K]
    f = np.array([(experts == e).sum() for e in range(EXPERTS)]) / experts.size
    want = EXPERTS * np.sum(f * probs.mean(axis=0))
    np.testing.assert_allclose(loss(probs, experts), want, rtol=1e-6)
    uniform = np.full((EXPERTS, EXPERTS), 1 / EXPERTS)  # every expert equally likely and equally loaded: 1
    np.testing.assert_allclose(loss(uniform, np.arange(EXPERTS)[:, None]), 1.0)
    onehot = np.eye(EXPERTS)[np.zeros(TOKENS, int)]  # every token on expert 0 with probability 1: E
    np.testing.assert_allclose(loss(onehot, np.zeros((TOKENS, 1), int)), EXPERTS)


def test_a_top_k_above_the_experts_is_refused_in_words():
    with pytest.raises(JaxparError, match=r"top_k=5 must be between 1 and the number of experts \(4\)"):
        moe.Routing(4, 5)


def loop_sigmoid_group_limited(x, router, gate, up, down, groups, top_groups, bias):
    """DeepSeek-V3's routing, token by token in numpy: sigmoid scores; a group is worth its best two
    scores (with the bias); the top_k experts (by score + bias) come from the top_groups best groups;
    the weights are the chosen experts' scores (without the bias), normalised."""
    x, router, gate, up, down, bias = (np.asarray(a, np.float64) for a in (x, router, gate, up, down, bias))
    scores = 1 / (1 + np.exp(-(x @ router)))
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        choice = (scores[t] + bias).reshape(groups, -1)
        worth = np.sort(choice, axis=1)[:, -2:].sum(axis=1)
        kept_groups = np.argsort(-worth, kind="stable")[:top_groups]
        allowed = np.full(choice.shape, -np.inf)
        allowed[kept_groups] = choice[kept_groups]
        top = np.argsort(-allowed.reshape(-1), kind="stable")[:TOP_K]
        weights = scores[t, top] / scores[t, top].sum()
        for w, e in zip(weights, top):
            out[t] += w * ((silu(x[t] @ gate[e]) * (x[t] @ up[e])) @ down[e])
    return out


def test_sigmoid_group_limited_routing_with_a_bias_equals_its_loop():
    args = weights(seed=3)
    bias = jnp.array([0.3, -0.2, 0.0, 0.1])  # steers the choice, not the weights
    routing = moe.Routing(EXPERTS, TOP_K, score="sigmoid", groups=2, top_groups=1)
    got = moe.mixture(args[0][None], *args[1:], routing, bias)[0][0]
    np.testing.assert_allclose(got, loop_sigmoid_group_limited(*args, 2, 1, bias), rtol=1e-5, atol=1e-5)
    _, chosen, _ = moe.route(args[0] @ args[1], routing, bias)
    assert (chosen // 2 == chosen[:, :1] // 2).all()  # both of a token's experts from its one kept group


def test_the_bias_steering_term_is_zero_and_its_gradient_the_rules_step():
    copies = jnp.array([5, 1, 3, 3])  # mean 3: expert 0 above, expert 1 below, 2 and 3 even
    bias = jnp.array([0.25, -0.5, 0.0, 1.0])
    value, grad = jax.value_and_grad(moe.bias_steering)(bias, copies, 0.01)
    assert float(value) == 0.0
    np.testing.assert_array_equal(grad, np.float32([0.01, -0.01, 0.0, 0.0]))  # subtracted: the loaded expert's bias falls


def test_routings_that_cannot_work_are_refused_in_words():
    with pytest.raises(JaxparError, match=r"groups dividing the 4 experts.*got groups=3"):
        moe.Routing(4, 2, groups=3)
    with pytest.raises(JaxparError, match=r"top_groups=1 groups of 1 experts hold fewer than top_k=2.*at least 2"):
        moe.Routing(4, 2, groups=4, top_groups=1)
    with pytest.raises(JaxparError, match=r"router score 'relu' is not one of softmax, sigmoid"):
        moe.Routing(4, 2, score="relu")
    with pytest.raises(JaxparError, match=r"capacity_factor=0 must be positive"):
        moe.Routing(4, 2, capacity_factor=0)
