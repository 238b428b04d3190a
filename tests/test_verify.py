"""Bounds on networks written as a plain Flax user writes them (``jaxpar.verify``): closed forms,
soundness on sampled points and corners for every method and layout, the sharded bounds against one
device (FSDP bitwise, tensor to float32 rounding), alpha-CROWN never looser than CROWN, the
collectives on the compiled HLO, and bad input refused in words."""
import collections
import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.analysis import hlo
from jaxpar.verify import NetworkError, bound, from_nnx, linf_ball

LAYOUTS = ("", "fsdp=8", "tensor=4", "data=2,tensor=2,fsdp=2")
METHODS = ("ibp", "crown", "alpha-crown")


class MLP(nnx.Module):
    def __init__(self, widths, rngs):
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(widths, widths[1:])])

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


class CNN(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(2, 8, (3, 3), strides=2, rngs=rngs)
        self.hidden = nnx.Linear(3 * 3 * 8, 16, rngs=rngs)
        self.out = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.conv(x)).reshape(x.shape[0], -1)
        return self.out(nnx.relu(self.hidden(x)))


def regions(shape, count, eps, seed):
    centre = jax.random.normal(jax.random.key(seed), (count, *shape))
    return centre - eps, centre + eps


def samples(lower, upper, seed):
    """1,000 points of each box and 1,000 of its corners (all of them when there are fewer)."""
    dims = math.prod(lower.shape[1:])
    if 2 ** dims <= 1000:
        signs = jnp.array(list(itertools.product([0.0, 1.0], repeat=dims))).reshape((-1, *lower.shape[1:]))
    else:
        signs = jax.random.bernoulli(jax.random.key(seed + 1), 0.5, (1000, *lower.shape[1:])).astype(jnp.float32)
    inside = jax.random.uniform(jax.random.key(seed), (1000, *lower.shape[1:]))
    t = jnp.concatenate([inside, signs])
    return lower[:, None] + (upper - lower)[:, None] * t[None]


@pytest.fixture(scope="module")
def mlp_bounds():
    """{(method, layout): Result} on an MLP 8-64-48-32-4 over 4 boxes, and its sampled outputs."""
    model = MLP((8, 64, 48, 32, 4), nnx.Rngs(0))
    lower, upper = regions((8,), 4, 0.05, 1)
    net = from_nnx(model, (8,))
    results = {(m, s): bound(net, lower, upper, m, strategy=s, alpha_steps=10) for m in METHODS for s in LAYOUTS}
    outputs = jax.vmap(model)(samples(lower, upper, 2))
    return results, outputs


def test_a_linear_layer_on_a_box_gives_its_exact_interval():
    layer = nnx.Linear(3, 2, rngs=nnx.Rngs(3))
    z = np.array([[0.5, -1.0, 2.0]], np.float32)
    w, b = np.asarray(layer.kernel[...]), np.asarray(layer.bias[...])
    exact = z @ w + b, np.abs(w).sum(axis=0)  # [z - 1, z + 1]: the centre's image, |W| times the radius 1
    for method in METHODS:
        result = bound(from_nnx(layer, (3,)), *linf_ball(z, 1.0), method)
        np.testing.assert_allclose(result.lower[0], exact[0][0] - exact[1], rtol=1e-6)
        np.testing.assert_allclose(result.upper[0], exact[0][0] + exact[1], rtol=1e-6)


def test_crown_on_a_one_input_relu_network_is_the_hand_computed_relaxation():
    """|x| = relu(x) + relu(-x) on [-1, 2]. Neuron x in [-1, 2]: upper line 2/3 x + 2/3, lower slope
    1 (u > -l); neuron -x in [-2, 1]: upper line -x/3 + 2/3, lower slope 0. CROWN: at least
    x + 0 >= -1, at most x/3 + 4/3 <= 2. IBP: [0, 2] + [0, 1]. alpha-CROWN finds equal slopes: 0."""
    model = nnx.Sequential(nnx.Linear(1, 2, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(2, 1, rngs=nnx.Rngs(0)))
    model.layers[0].kernel[...] = jnp.array([[1.0, -1.0]])
    model.layers[0].bias[...] = jnp.zeros(2)
    model.layers[2].kernel[...] = jnp.ones((2, 1))
    model.layers[2].bias[...] = jnp.zeros(1)
    net, lower, upper = from_nnx(model, (1,)), np.array([[-1.0]]), np.array([[2.0]])
    ibp, crown = bound(net, lower, upper, "ibp"), bound(net, lower, upper, "crown")
    np.testing.assert_allclose([ibp.lower[0, 0], ibp.upper[0, 0]], [0.0, 3.0], atol=1e-6)
    np.testing.assert_allclose([crown.lower[0, 0], crown.upper[0, 0]], [-1.0, 2.0], atol=1e-6)
    alpha = bound(net, lower, upper, "alpha-crown", alpha_steps=40, alpha_lr=0.2)
    assert -0.05 < alpha.lower[0, 0] <= 1e-6 and alpha.upper[0, 0] == pytest.approx(2.0, abs=1e-6)


@pytest.mark.parametrize("method", METHODS)
def test_every_layouts_bounds_hold_on_sampled_points_and_corners(mlp_bounds, method):
    results, outputs = mlp_bounds
    for layout in LAYOUTS:
        r = results[method, layout]
        assert (outputs >= r.lower[:, None] - 1e-5).all() and (outputs <= r.upper[:, None] + 1e-5).all(), layout


def test_fsdp_equals_one_device_bitwise_and_tensor_to_float32_rounding(mlp_bounds):
    """alpha-CROWN's too, here (benchmarks/verify.py shows 1.2e-7 at width 1024, where XLA fuses
    the gradients of its two programs' Adam loops differently)."""
    results, _ = mlp_bounds
    for method in METHODS:
        one, fsdp, tensor = (results[method, s] for s in ("", "fsdp=8", "tensor=4"))
        np.testing.assert_array_equal(fsdp.lower, one.lower)
        np.testing.assert_array_equal(fsdp.upper, one.upper)
        tolerance = 1e-5 if method != "alpha-crown" else 1e-4  # (its Adam steps follow the rounded bounds)
        np.testing.assert_allclose(tensor.lower, one.lower, atol=tolerance, rtol=0)
        np.testing.assert_allclose(tensor.upper, one.upper, atol=tolerance, rtol=0)


def test_alpha_crown_is_never_looser_than_crown_and_crown_than_ibp_here(mlp_bounds):
    """alpha-CROWN starts from CROWN's slopes and keeps each bound's best. Under tensor its program
    and CROWN's round their all-reduced sums apart (1.2e-7 seen), hence the slack there."""
    results, _ = mlp_bounds
    for layout in LAYOUTS:
        ibp, crown, alpha = (results[m, layout] for m in METHODS)
        slack = 1e-6 if "tensor" in layout else 0.0
        assert (alpha.lower >= crown.lower - slack).all() and (alpha.upper <= crown.upper + slack).all(), layout
        assert (alpha.upper - alpha.lower).sum() < (crown.upper - crown.lower).sum() < (ibp.upper - ibp.lower).sum()


def test_sharing_the_specifications_divides_the_bound_matrices_and_stays_sound(mlp_bounds):
    """share_specs: each fsdp device bounds 1/8 of every layer's neurons and of the output rows."""
    results, outputs = mlp_bounds
    net = from_nnx(MLP((8, 64, 48, 32, 4), nnx.Rngs(0)), (8,))
    lower, upper = regions((8,), 4, 0.05, 1)
    for method in ("crown", "alpha-crown"):
        shared = bound(net, lower, upper, method, strategy="fsdp=8", share_specs=True, alpha_steps=10)
        one, whole = results[method, ""], results[method, "fsdp=8"]
        assert (outputs >= shared.lower[:, None] - 1e-5).all() and (outputs <= shared.upper[:, None] + 1e-5).all()
        np.testing.assert_allclose(shared.lower, one.lower, atol=1e-6 if method == "crown" else 1e-4)
        assert shared.program.memory["temp_size"] < 0.6 * whole.program.memory["temp_size"], method


def test_fsdp_gathers_each_weight_once_per_layer_per_pass_and_holds_an_eighth(mlp_bounds):
    """CROWN's passes on 4 dense layers with 3 ReLUs: one back from each pre-activation (1, 2 and 3
    layers) and one from the output (4): 10 uses of a weight, each its own all-gather."""
    results, _ = mlp_bounds
    for method, uses in (("ibp", 4), ("crown", 1 + 2 + 3 + 4)):
        r = results[method, "fsdp=8"]
        gathers = [c for c in hlo.collectives(r.program.compiled.as_text(), r.program.mesh) if c.kind == "all-gather"]
        assert len(gathers) == uses and all(c.mesh_axes == ("fsdp",) for c in gathers), method
    one, fsdp = results["crown", ""], results["crown", "fsdp=8"]
    kernels = (8 * 64 + 64 * 48 + 48 * 32 + 32 * 4) * 4
    assert one.program.weight_bytes - fsdp.program.weight_bytes == kernels - kernels // 8


def test_tensor_moves_a_quarter_of_the_bound_matrices_round_its_ring_and_all_reduces_only_the_outputs(mlp_bounds):
    """Pairs (0, 1) and (2, 3) of the dense layers 8-64-48-32-4: layers 0 and 2 are column layers,
    1 and 3 row layers. The passes back from the pre-activations (64, 48 and 32 neurons) hold 1/4
    of A's rows or of its columns on each device: they cross 1 (column 0), 2 (row 1, column 0) and
    3 (column 2, row 1, column 0) layers, each crossing 3 ring steps of 1/4 of A's rows (the lower
    and upper bounds' A once they differ, after the first ReLU: 27 collective-permutes), and no
    A of theirs is all-reduced. The pass back from the 4 outputs keeps all rows and all-reduces A
    at its 2 column layers."""
    results, _ = mlp_bounds
    r = results["crown", "tensor=4"]
    text = r.program.compiled.as_text()

    def shapes(op):
        found = collections.Counter()
        for line in text.splitlines():
            if f" {op}(" in line:
                result_type = line.split("=", 1)[1].split(f"{op}(")[0]
                found.update(tuple(map(int, dims.split(","))) for dims in re.findall(r"f32\[(\d+,\d+,\d+)\]", result_type))
        return found

    assert shapes("collective-permute") == {(4, 16, 8): 3, (4, 12, 48): 3, (4, 12, 8): 6, (4, 8, 48): 3 + 6, (4, 8, 8): 6}
    matrices = {shape for shape in shapes("all-reduce") if shape[0] == 4}  # (the bias parts are (2, regions, rows))
    assert matrices == {(4, 4, 8), (4, 4, 48)}
    assert all(c.mesh_axes == ("tensor",) for c in hlo.collectives(text, r.program.mesh)
               if c.kind in ("all-reduce", "collective-permute"))


def test_tensor_4_holds_about_a_quarter_of_crowns_peak_per_device(mlp_bounds):
    """Each device's compiled peak (arguments, outputs, temporaries: weights and bound matrices)
    under tensor=4 against one device's: 0.26 measured (0.52 while the passes' bound matrices were
    all-reduced whole); benchmarks/verify.py gives tensor=2 at 0.50 on a 4096-wide MLP."""
    results, _ = mlp_bounds
    peak = lambda r: sum(r.program.memory[k] for k in ("argument_size", "output_size", "temp_size"))
    assert peak(results["crown", "tensor=4"]) <= 0.3 * peak(results["crown", ""])


def test_a_small_cnn_is_bounded_soundly_by_every_method_under_fsdp_and_tensor():
    model = CNN(nnx.Rngs(4))
    lower, upper = regions((6, 6, 2), 2, 0.02, 5)
    net = from_nnx(model, (6, 6, 2))
    assert [type(layer).__name__ for layer in net.layers] == ["Affine", "ReLU", "Reshape", "Affine", "ReLU", "Affine"]
    outputs = jax.vmap(model)(samples(lower, upper, 6))
    for method in METHODS:
        one = bound(net, lower, upper, method, alpha_steps=5)
        for layout in ("", "fsdp=8", "tensor=4"):
            r = bound(net, lower, upper, method, strategy=layout, alpha_steps=5) if layout else one
            assert (outputs >= r.lower[:, None] - 1e-5).all() and (outputs <= r.upper[:, None] + 1e-5).all(), (method, layout)
            np.testing.assert_allclose(r.lower, one.lower, atol=1e-5 if method != "alpha-crown" else 1e-4)


def test_bad_input_is_refused_in_words_before_any_bound():
    net = from_nnx(MLP((4, 6, 2), nnx.Rngs(0)), (4,))
    lower = np.zeros((1, 4), np.float32)
    with pytest.raises(NetworkError, match=r"lower bound is above its upper bound at \(0, 2\): 1.0 > 0.0"):
        bound(net, *_swapped(lower))
    with pytest.raises(NetworkError, match=r"rows have shape \(3,\), but the network's output is \(2,\)"):
        bound(net, lower, lower + 1, spec=np.ones((1, 3)))
    with pytest.raises(NetworkError, match=r"layer layers/0 \(dense, 4 -> 6\): tensor=4 does not divide its 6 outputs"):
        bound(net, lower, lower + 1, strategy="tensor=4")
    with pytest.raises(NetworkError, match="'expert=2' in strategy"):
        bound(net, lower, lower + 1, strategy="expert=2")
    with pytest.raises(NetworkError, match="method 'beta-crown': choose one of ibp, crown, alpha-crown"):
        bound(net, lower, lower + 1, method="beta-crown")


def _swapped(lower):
    upper = lower + 1
    lower = lower.copy()
    lower[0, 2] = 1.0
    upper[0, 2] = 0.0
    return lower, upper
