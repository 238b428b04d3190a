"""``jaxpar.verify``'s file formats: an ONNX file of a Flax NNX network (an MLP with its input
normalisation, a small CNN), written here with ``onnx.helper`` from the module's own weights the way
an exporter lays them out (PyTorch's (out, in) Gemm weights, NCHW and OIHW for the convolution, the
dense weights permuted to the NCHW flattening), loads into a network whose outputs equal the
module's (1e-5) with the layers in order; graphs the bounds cannot follow are refused by name.
VNN-LIB properties written here parse to their input box and unsafe disjuncts, the verdict reads
hand-made bounds, and each malformed property is refused with its culprit named."""
import json

import numpy as np
import onnx
import pytest
from flax import nnx
from onnx import TensorProto, helper, numpy_helper

from jaxpar import cli
from jaxpar.verify import bound, from_nnx
from jaxpar.verify.network import Affine, NetworkError, ReLU, Reshape
from jaxpar.verify.onnx_file import load_onnx
from jaxpar.verify.vnnlib import PropertyError, load_vnnlib, parse_vnnlib

MEAN, STD = np.float32([0.5, -1.0, 2.0, 0.0]), np.float32([2.0, 0.5, 1.0, 4.0])  # the MLP's input normalisation
NORMAL = nnx.initializers.normal(0.5)  # non-zero biases, as a trained network has


class Classifier(nnx.Module):
    """An MLP on normalised inputs: 4 features, 16 hidden units, 3 scores."""

    def __init__(self, rngs):
        self.hidden = nnx.Linear(4, 16, bias_init=NORMAL, rngs=rngs)
        self.out = nnx.Linear(16, 3, bias_init=NORMAL, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden((x - MEAN) / STD)))


class SmallCNN(nnx.Module):
    """A convolution (strided, dilated, padded unevenly) then a dense head on NHWC images of 7x6x3."""

    def __init__(self, rngs):
        self.conv = nnx.Conv(3, 4, kernel_size=(3, 3), strides=(2, 2), padding=((1, 0), (2, 1)), kernel_dilation=(1, 2),
                             bias_init=NORMAL, rngs=rngs)
        self.head = nnx.Linear(4 * 3 * 3, 5, bias_init=NORMAL, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.conv(x))
        return self.head(h.reshape(h.shape[0], -1))


def save_model(path, nodes, initializers, inputs=(("x", ["N", 4]),), outputs=("y",)):
    """An ONNX model of ``nodes`` (checked by ONNX's own checker), saved at ``path``."""
    tensors = [numpy_helper.from_array(value if value.dtype == np.int64 else value.astype(np.float32), name)
               for name, value in ((name, np.asarray(value)) for name, value in initializers.items())]
    graph = helper.make_graph(nodes, "network", [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in inputs],
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["N", "K"]) for name in outputs], tensors)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def layer_kinds(network):
    return [(layer.name, layer.kind if isinstance(layer, Affine) else type(layer).__name__) for layer in network.layers]


def write_classifier(path, module):
    """``module`` as an exporter writes it: a Constant, Sub and Div normalisation, Gemm with PyTorch's
    (out, in) weights, an unnamed Relu, MatMul then Add, Identity."""
    hidden, out = module.hidden, module.out
    nodes = [helper.make_node("Constant", [], ["mean"], name="mean", value=numpy_helper.from_array(MEAN)),
             helper.make_node("Sub", ["x", "mean"], ["centred"], name="normalise/sub"),
             helper.make_node("Div", ["centred", "std"], ["normalised"], name="normalise/div"),
             helper.make_node("Gemm", ["normalised", "w1", "b1"], ["h"], name="hidden", transB=1),  # PyTorch's (out, in)
             helper.make_node("Relu", ["h"], ["r"]),  # unnamed: named after its op and index
             helper.make_node("MatMul", ["r", "w2"], ["scores"], name="out/matmul"),
             helper.make_node("Add", ["scores", "b2"], ["biased"], name="out/add"),
             helper.make_node("Identity", ["biased"], ["y"], name="output")]
    return save_model(path, nodes, {"std": STD, "w1": np.asarray(hidden.kernel[...]).T, "b1": hidden.bias[...],
                                    "w2": out.kernel[...], "b2": out.bias[...]})


def test_mlp_onnx_equals_the_flax_module(tmp_path):
    module = Classifier(nnx.Rngs(0))
    path = write_classifier(tmp_path / "mlp.onnx", module)
    network = load_onnx(path)
    x = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32) * 3
    np.testing.assert_allclose(network(x), module(x), atol=1e-5, rtol=0)
    assert (network.in_shape, network.out_shape) == ((4,), (3,))
    assert layer_kinds(network) == [("normalise/sub", "bias"), ("normalise/div", "scale"), ("hidden", "dense"),
                                    ("Relu[4]", "ReLU"), ("out/matmul", "dense")]  # out/add folded into out/matmul's bias


@pytest.mark.parametrize("flatten", ["Flatten", "Reshape"])
def test_cnn_onnx_equals_the_flax_module_on_nchw_inputs(tmp_path, flatten):
    module = SmallCNN(nnx.Rngs(1))
    kernel, head = np.asarray(module.conv.kernel[...]), np.asarray(module.head.kernel[...])
    # Flax flattens (h, w, channel); ONNX's Flatten of NCHW flattens (channel, h, w)
    head_chw = head.reshape(3, 3, 4, 5).transpose(2, 0, 1, 3).reshape(36, 5)
    flattening = (helper.make_node("Flatten", ["r"], ["flat"], name="flatten", axis=1) if flatten == "Flatten" else
                  helper.make_node("Reshape", ["r", "flat_shape"], ["flat"], name="flatten"))
    nodes = [helper.make_node("Conv", ["x", "k", "kb"], ["c"], name="conv", strides=[2, 2], pads=[1, 2, 0, 1], dilations=[1, 2]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"), flattening,
             helper.make_node("Gemm", ["flat", "w", "b"], ["y"], name="head", alpha=2.0, beta=0.5)]
    path = save_model(tmp_path / "cnn.onnx", nodes, {"k": kernel.transpose(3, 2, 0, 1), "kb": module.conv.bias[...],  # HWIO -> OIHW
                                                     "w": head_chw / 2, "b": 2 * np.asarray(module.head.bias[...]),
                                                     "flat_shape": np.int64([0, -1])},
                      inputs=(("x", ["N", 3, 7, 6]),))
    network = load_onnx(path)
    x = np.random.default_rng(1).normal(size=(5, 3, 7, 6)).astype(np.float32)
    np.testing.assert_allclose(network(x), module(x.transpose(0, 2, 3, 1)), atol=1e-5, rtol=0)
    assert (network.in_shape, network.out_shape) == ((3, 7, 6), (5,))
    assert layer_kinds(network) == [("conv", "conv"), ("relu", "ReLU"), ("flatten", "Reshape"), ("head", "dense")]
    assert network.layers[2] == Reshape("flatten", (4, 3, 3), (36,)) and network.layers[1] == ReLU("relu", (4, 3, 3))


DENSE = {"w": np.eye(4), "b": np.ones(4)}
REFUSED_GRAPHS = {
    "an unsupported op": ([helper.make_node("Gemm", ["x", "w", "b"], ["h"], name="hidden"),
                           helper.make_node("Sigmoid", ["h"], ["y"], name="squash")], {},
                          ["'squash' is a Sigmoid", "Gemm, MatMul", "Relu"]),
    "a residual connection": ([helper.make_node("Gemm", ["x", "w", "b"], ["h"], name="hidden"),
                               helper.make_node("Relu", ["h"], ["r"], name="act"),
                               helper.make_node("Add", ["h", "r"], ["y"], name="skip")], {},
                              ["'skip'", "two activations", "not a feed-forward chain"]),
    "a branch": ([helper.make_node("Gemm", ["x", "w", "b"], ["h"], name="hidden"),
                  helper.make_node("Relu", ["h"], ["y"], name="left"),
                  helper.make_node("Relu", ["h"], ["z"], name="right")], {},
                 ["'right' reads 'h'", "'left' reads", "not a feed-forward chain"]),
    "two inputs": ([helper.make_node("Add", ["x", "x2"], ["y"], name="sum")], {"inputs": (("x", ["N", 4]), ("x2", ["N", 4]))},
                   ["2 inputs (x, x2)", "one input"]),
    "a dynamic example shape": ([helper.make_node("Relu", ["x"], ["y"], name="act")], {"inputs": (("x", ["N", "F"]),)},
                                ["('N', 'F')", "only the batch dim"]),
    "a transposed activation": ([helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="hidden", transA=1)], {},
                                ["'hidden'", "transA=1"]),
}


@pytest.mark.parametrize("case", REFUSED_GRAPHS)
def test_onnx_graph_refused_by_name(tmp_path, case):
    nodes, graph_io, words = REFUSED_GRAPHS[case]
    path = save_model(tmp_path / "refused.onnx", nodes, DENSE, **graph_io)
    with pytest.raises(NetworkError) as refusal:
        load_onnx(path)
    for word in words:
        assert word in str(refusal.value)


DECLARATIONS = "".join(f"(declare-const {name} Real)\n" for name in ("X_0", "X_1", "Y_0", "Y_1", "Y_2"))
BOUNDS = "(assert (<= X_0 0.5))\n(assert (>= X_0 -0.5))\n(assert (and (>= X_1 (- 0.7)) (<= X_1 7e-1)))\n"
BOX = DECLARATIONS + BOUNDS


def test_vnnlib_box_and_output_constraint(tmp_path):
    text = "; class 1 scores at least class 0 somewhere in the box\n" + BOX + "(assert (<= Y_0 Y_1)) ; the unsafe set\n"
    (tmp_path / "prop.vnnlib").write_text(text)
    prop = load_vnnlib(tmp_path / "prop.vnnlib", n_inputs=2, n_outputs=3)
    assert prop.lower.dtype == prop.upper.dtype == np.float32
    np.testing.assert_allclose(prop.lower, [-0.5, -0.7], rtol=1e-7)
    np.testing.assert_allclose(prop.upper, [0.5, 0.7], rtol=1e-7)
    # 0.7 has no float32: the box is rounded outward, so it holds every input the file names
    assert prop.lower[1] <= -0.7 and prop.upper[1] >= 0.7
    (c, d), = prop.unsafe
    np.testing.assert_array_equal(c, [[1, -1, 0]])
    np.testing.assert_array_equal(d, [0])


def test_vnnlib_disjunction_of_conjunctions():
    prop = parse_vnnlib(BOX + """(assert (<= Y_2 10))  ; holds in every disjunct
        (assert (or (and (>= Y_0 3.2) (<= Y_2 -1))
                    (and (<= (+ (* 2.0 Y_0) Y_1) 0.5))
                    (< Y_1 Y_2)))  ; strict: read as <=
        """, n_inputs=2, n_outputs=3)
    assert len(prop.unsafe) == 3
    c_all, d_all, groups = prop.spec()
    np.testing.assert_array_equal(c_all, [[0, 0, 1], [-1, 0, 0], [0, 0, 1], [0, 0, 1], [2, 1, 0], [0, 0, 1], [0, 1, -1]])
    np.testing.assert_allclose(d_all, [10, -3.2, -1, 10, 0.5, 10, 0], rtol=1e-6)
    assert d_all[1] >= -3.2  # rounded up: the float32 unsafe set holds the written one
    np.testing.assert_array_equal(groups, [0, 0, 0, 1, 1, 2, 2])


def test_verdict_needs_every_disjunct_ruled_out():
    prop = parse_vnnlib(BOX + "(assert (or (and (>= Y_0 1) (<= Y_1 0)) (<= Y_2 Y_0)))", n_inputs=2, n_outputs=3)
    assert prop.verdict([0.1, -1.0, 0.2])  # disjunct 0 by its first row, disjunct 1 by its only row
    assert prop.verdict([-1.0, 0.3, 0.2])  # any one row of a disjunct suffices
    assert not prop.verdict([-0.1, -1.0, 0.2])  # disjunct 0 may hold
    assert not prop.verdict([0.1, -1.0, 0.0])  # a bound of 0 leaves the boundary reachable
    assert not prop.verdict([np.nan, np.nan, 0.2])
    with pytest.raises(PropertyError, match=r"shape \(2,\).*shape \(3,\)"):
        prop.verdict([1.0, 1.0])


REFUSED_PROPERTIES = {
    "an empty box": (DECLARATIONS + "(assert (>= X_0 0.5)) (assert (<= X_0 -0.5)) (assert (<= X_1 1)) (assert (>= X_1 0))",
                     ["X_0", "below by 0.5", "above by -0.5", "swap"]),
    "an input without a lower bound": (DECLARATIONS + "(assert (<= X_0 1)) (assert (>= X_0 0)) (assert (<= X_1 1))",
                                       ["X_1 no lower bound", "(assert (>= X_1"]),
    "an input beyond the network's": (BOX + "(declare-const X_2 Real)", ["X_2", "2 inputs (X_0 to X_1)"]),
    "an output beyond the network's": (BOX + "(declare-const Y_3 Real) (assert (<= Y_3 0))", ["Y_3", "3 outputs (Y_0 to Y_2)"]),
    "a disjunction over input boxes": (BOX + "(assert (or (and (>= X_0 0) (<= Y_0 1)) (and (<= X_0 0) (<= Y_1 1))))",
                                       ["disjunction over input boxes", "(and (>= X_0 0) (<= Y_0 1))"]),
    "an unclosed form": (BOX + "(assert (<= Y_0 0.5)", ["never closed", "'(assert (<= Y_0 0.5)'"]),
    "an unknown operator": (BOX + "(assert (=> Y_0 1))", ["(=> Y_0 1)", "not a comparison"]),
    "a product of outputs": (BOX + "(assert (<= (* Y_0 Y_1) 0))", ["(* Y_0 Y_1)", "multiplies variables"]),
    "an undeclared output": ("(declare-const X_0 Real) (declare-const X_1 Real)" + BOUNDS + "(assert (<= Y_0 0))",
                             ["uses Y_0 before declaring it", "(declare-const Y_0 Real)"]),
}


@pytest.mark.parametrize("case", REFUSED_PROPERTIES)
def test_vnnlib_refused_with_the_culprit(case):
    text, words = REFUSED_PROPERTIES[case]
    with pytest.raises(PropertyError) as refusal:
        parse_vnnlib(text, n_inputs=2, n_outputs=3)
    for word in words:
        assert word in str(refusal.value)


def test_jaxpar_verify_gives_each_property_its_verdict_with_the_flax_networks_bounds(tmp_path, capsys):
    """The ONNX file's bounds are the Flax module's (1e-5). Three properties on score 0 over one
    box: unsafe above 1,000 (verified), above a value an input reaches (falsified: the counterexample
    is checked on the module), and above a value between alpha-CROWN's and CROWN's upper bounds
    (unknown to CROWN: unreachable, as alpha-CROWN proves, but CROWN's bound misses it)."""
    module = Classifier(nnx.Rngs(0))
    path = write_classifier(tmp_path / "mlp.onnx", module)
    centre = np.float32([0.5, -1.0, 2.0, 1.0])
    lower, upper = (centre - 1)[None], (centre + 1)[None]
    bounds = {}
    for method in ("crown", "alpha-crown"):
        onnx_bounds, flax_bounds = (bound(net, lower, upper, method) for net in (load_onnx(path), from_nnx(module, (4,))))
        np.testing.assert_allclose(onnx_bounds.upper, flax_bounds.upper, atol=1e-5)
        np.testing.assert_allclose(onnx_bounds.lower, flax_bounds.lower, atol=1e-5)
        bounds[method] = float(onnx_bounds.upper[0, 0])
    assert bounds["alpha-crown"] < bounds["crown"] - 1e-3
    box = "".join(f"(declare-const X_{i} Real)\n(assert (>= X_{i} {lo}))\n(assert (<= X_{i} {hi}))\n"
                  for i, (lo, hi) in enumerate(zip(lower[0], upper[0])))
    outputs = "".join(f"(declare-const Y_{j} Real)\n" for j in range(3))
    reached = float(module(centre[None])[0, 0])
    thresholds = {"verified": 1000.0, "falsified": reached, "unknown": (bounds["alpha-crown"] + bounds["crown"]) / 2}
    files = []
    for name, threshold in thresholds.items():
        files.append(tmp_path / f"{name}.vnnlib")
        files[-1].write_text(box + outputs + f"(assert (>= Y_0 {threshold!r}))\n")
    argv = ["verify", "--model", str(path), "--strategy", "fsdp=8", "--share-specs", "--json", str(tmp_path / "v.json")]
    assert cli.main(argv + [arg for f in files for arg in ("--property", str(f))]) == cli.EXIT_FAILED  # not all verified
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "v.json").read_text())["properties"]
    assert [report[str(f)]["verdict"] for f in files] == ["verified", "falsified", "unknown"], out
    for name in thresholds:
        assert f"{name}.vnnlib: {name}" in out
    found = np.float32(report[str(files[1])]["counterexample"]["input"])
    assert (lower[0] <= found).all() and (found <= upper[0]).all() and float(module(found[None])[0, 0]) >= reached - 1e-6
    assert report[str(files[0])]["one_device"]["weight_bytes"] > report[str(files[0])]["weight_bytes_per_device"]


def test_jaxpar_verify_refuses_a_missing_file_in_words(tmp_path, capsys):
    path = write_classifier(tmp_path / "mlp.onnx", Classifier(nnx.Rngs(0)))
    for model, prop, named in ((tmp_path / "none.onnx", tmp_path / "p.vnnlib", "none.onnx: no such file; give the path of an ONNX file"),
                               (path, tmp_path / "none.vnnlib", "none.vnnlib: no such file; give the path of a VNN-LIB property")):
        assert cli.main(["verify", "--model", str(model), "--property", str(prop)]) == cli.EXIT_BAD_INPUT
        assert named in capsys.readouterr().err
