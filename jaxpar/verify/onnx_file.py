"""ONNX files as ``jaxpar.verify`` networks: ``load_onnx`` reads a feed-forward chain (the form
VNN-COMP's benchmarks ship) into the same ``Network`` that ``from_nnx`` builds.

ONNX is NCHW: a convolutional network's per-example ``in_shape`` is (C, H, W), its kernels OIHW, and
the convolution keeps ONNX's layout (its dimension numbers say so) rather than transposing weights.
The whole graph is checked first (every op supported, one activation flowing through a single
chain, one input of static per-example shape), so a file the bounds cannot follow is refused by
name before any layer is built. Shapes are computed by evaluating each layer, never read from the
file's value_info, which exporters fill in unevenly.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.verify.network import Affine, Chain, Network, NetworkError, ReLU, Reshape

SUPPORTED = ("Gemm", "MatMul", "Add", "Sub", "Mul", "Div", "Conv", "Relu", "Flatten", "Reshape", "Identity", "Constant")
# which input of each op may carry the activation (every other input must be a constant); the rest take it first
_ACTIVATION_SLOTS = {"Add": (0, 1), "Sub": (0, 1), "Mul": (0, 1)}
_ACT = object()  # the activation's place among a node's arguments (every other argument is a constant)


@dataclasses.dataclass(frozen=True)
class _Step:
    """One node of the chain: its layer name, the node, and its arguments (``_ACT`` for the
    activation, a NumPy array for each constant, None for an optional input left out)."""

    name: str
    node: object
    args: list


def load_onnx(path) -> Network:
    """The chain an ONNX file at ``path`` computes on one example (batch dim first in the file,
    dynamic or not). Layers are named after the ONNX nodes (their op type and index when unnamed)."""
    import onnx  # (the verify extra; nothing else in jaxpar needs it)

    if not pathlib.Path(path).is_file():
        raise NetworkError(f"{path}: no such file; give the path of an ONNX file")
    graph = onnx.load(str(pathlib.Path(path))).graph
    consts = {init.name: onnx.numpy_helper.to_array(init) for init in graph.initializer}
    input_name, in_shape = _graph_input(graph, consts)
    steps = _chain(graph, input_name, consts)
    builder = Chain(in_shape)
    for step in steps:
        _OPS[step.node.op_type](builder, step)
    return builder.network()


def _graph_input(graph, consts: dict):
    """The graph's one input (old exporters list the initializers among the inputs too) and its
    static per-example shape; its one output is checked here as well."""
    inputs = [value for value in graph.input if value.name not in consts]
    if len(inputs) != 1:
        raise NetworkError(f"the ONNX graph has {len(inputs)} inputs ({', '.join(v.name for v in inputs) or 'none'}); "
                           "jaxpar.verify reads networks of one input: export the network alone, with its weights as initializers")
    if len(graph.output) != 1:
        raise NetworkError(f"the ONNX graph has {len(graph.output)} outputs ({', '.join(v.name for v in graph.output)}); "
                           "jaxpar.verify reads networks of one output: export the network with the one output to bound")
    value = inputs[0]
    if not value.type.tensor_type.HasField("shape"):
        raise NetworkError(f"the ONNX input {value.name!r} declares no shape; export it with its shape (batch dim first)")
    dims = value.type.tensor_type.shape.dim
    shown = tuple(d.dim_value if d.WhichOneof("value") == "dim_value" else (d.dim_param or "?") for d in dims)
    if len(dims) < 2:
        raise NetworkError(f"the ONNX input {value.name!r} has shape {shown}: jaxpar.verify needs a batch dim first, "
                           "then the example's shape; export it with a batch dim")
    if any(d.WhichOneof("value") != "dim_value" or d.dim_value <= 0 for d in dims[1:]):
        raise NetworkError(f"the ONNX input {value.name!r} has shape {shown}: only the batch dim (the first) may be "
                           "dynamic; export the network with a fixed size for every other dim")
    return value.name, tuple(d.dim_value for d in dims[1:])


def _node_name(node, index: int) -> str:
    return node.name or f"{node.op_type}[{index}]"


def _chain(graph, input_name: str, consts: dict) -> list:
    """The graph's nodes as one chain from its input to its output, checked before any layer is
    built: every op supported, each node reading the activation once (and nothing else that varies),
    each activation read by one node. ``consts`` gains the Constant nodes' values."""
    activations, reader, steps = {input_name}, {}, []
    for index, node in enumerate(graph.node):
        name = _node_name(node, index)
        if node.op_type not in SUPPORTED or node.domain not in ("", "ai.onnx"):
            raise NetworkError(f"ONNX node {name!r} is a {node.op_type}, which jaxpar.verify cannot bound; it reads "
                               f"chains of {', '.join(SUPPORTED)}")
        if node.op_type == "Constant":
            consts[node.output[0]] = _constant(node, name)
            continue
        unknown = [i for i in node.input if i and i not in activations and i not in consts]
        if unknown:
            raise NetworkError(f"ONNX node {name!r} reads {unknown[0]!r}, which no node before it makes; "
                               "save the graph in topological order (onnx.checker.check_model says where)")
        read = [i for i in node.input if i in activations]
        if len(read) > 1:
            raise NetworkError(f"ONNX node {name!r} ({node.op_type}) takes two activations ({', '.join(read)}), as a "
                               "residual connection does: not a feed-forward chain, which is what jaxpar.verify bounds")
        if not read:
            raise NetworkError(f"ONNX node {name!r} ({node.op_type}) computes on constants only; fold it into a constant "
                               "first (onnxsim does)")
        if read[0] in reader:
            raise NetworkError(f"ONNX node {name!r} reads {read[0]!r}, which node {reader[read[0]]!r} reads too: a "
                               "branch, not a feed-forward chain, which is what jaxpar.verify bounds")
        slot = list(node.input).index(read[0])
        if slot not in _ACTIVATION_SLOTS.get(node.op_type, (0,)):
            raise NetworkError(f"ONNX node {name!r} ({node.op_type}) takes the activation as input {slot}; jaxpar.verify "
                               f"reads {node.op_type} with the activation as input 0 and constants for the rest")
        reader[read[0]] = name
        activations.add(node.output[0])
        steps.append(_Step(name, node, [_ACT if i == read[0] else (consts[i] if i else None) for i in node.input]))
    last = steps[-1].node.output[0] if steps else input_name
    if graph.output[0].name != last:
        raise NetworkError(f"the ONNX graph's output {graph.output[0].name!r} is not the end of the chain from its input "
                           f"({last!r}); export the network with its last layer's output as the graph's output")
    return steps


def _constant(node, name: str) -> np.ndarray:
    """A Constant node's value."""
    from onnx import helper, numpy_helper

    attribute = node.attribute[0] if len(node.attribute) == 1 else None
    if attribute is None or attribute.name not in ("value", "value_float", "value_floats", "value_int", "value_ints"):
        raise NetworkError(f"ONNX Constant {name!r} holds {[a.name for a in node.attribute]}; jaxpar.verify reads a "
                           "Constant of a dense tensor or numbers (value, value_float(s), value_int(s))")
    value = helper.get_attribute_value(attribute)
    return numpy_helper.to_array(value) if attribute.name == "value" else np.asarray(value)


def _attributes(node) -> dict:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _out_shape(name: str, fn, in_shape: tuple) -> tuple:
    """The per-example shape ``fn`` gives on examples of ``in_shape`` (evaluated on a batch of one)."""
    try:
        return tuple(jax.eval_shape(fn, jax.ShapeDtypeStruct((1, *in_shape), jnp.float32)).shape[1:])
    except (TypeError, ValueError) as error:
        raise NetworkError(f"ONNX node {name!r} does not apply to an activation of per-example shape {in_shape}: "
                           f"{error}") from None


def _per_example(name: str, const, shape: tuple):
    """A constant operand of an elementwise op as one example's (it must not vary along the batch)."""
    try:
        return jnp.broadcast_to(jnp.asarray(const, jnp.float32), (1, *shape))[0]
    except ValueError:
        raise NetworkError(f"ONNX node {name!r} has a constant of shape {np.shape(const)}, which does not broadcast to "
                           f"the activation's (batch, {', '.join(map(str, shape))}) without changing it") from None


def _dense(builder, step: _Step, w):
    """``x @ w`` on a flat activation."""
    shape = builder.shape
    if len(shape) != 1 or np.ndim(w) != 2:
        raise NetworkError(f"ONNX node {step.name!r} ({step.node.op_type}) multiplies an activation of per-example shape "
                           f"{shape} by a weight of shape {np.shape(w)}; jaxpar.verify reads dense layers on flat "
                           "activations with 2-D weights: put a Flatten before it")
    w = jnp.asarray(w, jnp.float32)
    builder.emit(Affine(step.name, "dense", w, None, shape, _out_shape(step.name, lambda x: x @ w, shape)))


def _gemm(builder, step: _Step):
    """Gemm: ``alpha * x @ B' + beta * C`` with ``B' = B`` or ``B.T`` (transB)."""
    attributes = _attributes(step.node)
    if attributes.get("transA", 0):
        raise NetworkError(f"ONNX node {step.name!r} is a Gemm with transA=1 (it transposes the activation); "
                           "jaxpar.verify reads Gemm on (batch, features) activations: export it with transA=0")
    w = np.asarray(step.args[1], np.float32)
    w = w.T if attributes.get("transB", 0) else w
    _dense(builder, step, attributes.get("alpha", 1.0) * w)
    if len(step.args) > 2 and step.args[2] is not None:
        builder.add_bias(attributes.get("beta", 1.0) * _per_example(step.name, step.args[2], builder.shape), step.name)


def _matmul(builder, step: _Step):
    _dense(builder, step, np.asarray(step.args[1], np.float32))


def _conv(builder, step: _Step):
    """A 2-D NCHW convolution with an OIHW kernel and an optional bias, one group."""
    attributes, kernel, shape = _attributes(step.node), np.asarray(step.args[1], np.float32), builder.shape
    auto_pad = attributes.get("auto_pad", b"NOTSET").decode()
    if attributes.get("group", 1) != 1:
        raise NetworkError(f"ONNX Conv {step.name!r} has group={attributes['group']}; jaxpar.verify reads convolutions "
                           "of one group: export grouped or depthwise convolutions as ordinary ones")
    if kernel.ndim != 4 or len(shape) != 3:
        raise NetworkError(f"ONNX Conv {step.name!r} has a kernel of shape {kernel.shape} on activations of per-example "
                           f"shape {shape}; jaxpar.verify reads 2-D convolutions: (C, H, W) activations, OIHW kernels")
    if auto_pad not in ("NOTSET", "VALID"):
        raise NetworkError(f"ONNX Conv {step.name!r} has auto_pad={auto_pad}; jaxpar.verify reads explicit pads: "
                           "export it with pads (auto_pad=NOTSET)")
    pads = [0, 0, 0, 0] if auto_pad == "VALID" else list(attributes.get("pads", [0, 0, 0, 0]))
    kwargs = dict(window_strides=tuple(attributes.get("strides", (1, 1))),
                  padding=((pads[0], pads[2]), (pads[1], pads[3])),  # ONNX: [top, left, bottom, right]
                  lhs_dilation=(1, 1), rhs_dilation=tuple(attributes.get("dilations", (1, 1))),
                  dimension_numbers=jax.lax.conv_dimension_numbers((1, *shape), kernel.shape, ("NCHW", "OIHW", "NCHW")),
                  feature_group_count=1, batch_group_count=1)
    w = jnp.asarray(kernel)
    out_shape = _out_shape(step.name, lambda x: jax.lax.conv_general_dilated(x, w, **kwargs), shape)
    builder.emit(Affine(step.name, "conv", w, None, shape, out_shape, kwargs))
    if len(step.args) > 2 and step.args[2] is not None:
        builder.add_bias(jnp.broadcast_to(jnp.asarray(step.args[2], jnp.float32)[:, None, None], out_shape), step.name)


def _elementwise(builder, step: _Step):
    """Add, Sub, Mul or Div of the activation and a constant: a bias or a scale."""
    slot = next(i for i, arg in enumerate(step.args) if arg is _ACT)
    const, shape, op = _per_example(step.name, step.args[1 - slot], builder.shape), builder.shape, step.node.op_type
    if op == "Add":
        builder.add_bias(const, step.name)
    elif op == "Sub" and slot == 0:
        builder.add_bias(-const, step.name)
    elif op == "Sub":  # c - x = (-1) * x + c
        builder.emit(Affine(step.name, "scale", -jnp.ones(shape, jnp.float32), None, shape, shape))
        builder.add_bias(const, step.name)
    elif op == "Mul":
        builder.emit(Affine(step.name, "scale", const, None, shape, shape))
    elif not np.all(np.asarray(const)):
        raise NetworkError(f"ONNX Div {step.name!r} divides by a constant with a zero in it; remove the division by zero")
    else:
        builder.emit(Affine(step.name, "scale", 1 / const, None, shape, shape))


def _reshape_to(builder, name: str, out_shape: tuple):
    if out_shape != builder.shape:
        builder.emit(Reshape(name, builder.shape, out_shape))


def _flatten(builder, step: _Step):
    axis = _attributes(step.node).get("axis", 1)
    if axis % (len(builder.shape) + 1) != 1:
        raise NetworkError(f"ONNX Flatten {step.name!r} has axis={axis}; jaxpar.verify reads Flatten with axis=1 "
                           "(keep the batch dim, flatten each example)")
    _reshape_to(builder, step.name, (math.prod(builder.shape),))


def _reshape(builder, step: _Step):
    """Reshape to a constant shape whose first entry is the batch: 0 (copy it), -1, or its size
    (then the example's size must match: a reshape that moves data across examples is refused)."""
    target = [int(v) for v in np.asarray(step.args[1]).ravel()]
    rest = [builder.shape[i] if v == 0 and not _attributes(step.node).get("allowzero", 0) and i < len(builder.shape) else v
            for i, v in enumerate(target[1:])]
    if not target or target[0] < -1 or (target[0] != 0 and -1 in rest):
        raise NetworkError(f"ONNX Reshape {step.name!r} reshapes to {target}; jaxpar.verify reads reshapes that keep the "
                           "batch dim first (0, -1 or the batch size) with the rest of the shape fixed")
    _reshape_to(builder, step.name, _out_shape(step.name, lambda x: x.reshape((x.shape[0], *rest)), builder.shape))


def _relu(builder, step: _Step):
    builder.emit(ReLU(step.name, builder.shape))


_OPS = {"Gemm": _gemm, "MatMul": _matmul, "Conv": _conv, "Add": _elementwise, "Sub": _elementwise,
        "Mul": _elementwise, "Div": _elementwise, "Relu": _relu, "Flatten": _flatten, "Reshape": _reshape,
        "Identity": lambda builder, step: None}
