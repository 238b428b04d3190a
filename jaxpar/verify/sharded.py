"""The bounds under a layout: where each layer's weights go (``place``), the ``shard_map`` over
``data`` x ``fsdp`` x ``tensor`` that runs ``bounds``' functions, and what each device holds.

- ``fsdp=N``: each dense or convolution weight is split over N devices along a dim N divides
  (the largest) and gathered whole at each use, one layer at a time; everything else is as on one
  device, so IBP's and CROWN's bounds equal one device's bitwise. alpha-CROWN's may differ in the
  last bit (1.2e-7 seen at width 1024; 0 on the tests' networks) where XLA fuses the gradient of
  the two programs' Adam loops differently. The bound matrices are then whole on every
  device: where they, not the weights, fill the memory (CROWN's intermediate bounds start from an
  identity as wide as each layer), ``share_specs`` gives each device 1/N of their rows too.
- ``tensor=T``: dense layers go in Megatron pairs, the first split by its outputs (column), the
  second by its inputs (row), with the ReLUs (and scale and bias layers) between them split by
  neuron. The bound matrices' columns follow the activations inside a pair; passing back from
  the outputs, they are all-reduced once at each column layer, and passing back from a layer's
  neurons (as many rows as columns) each device bounds 1/T of the neurons and the matrices' row
  blocks go round a ring at each split layer (``bounds.Placement.backward``): 1/T of every bound
  matrix on each device. Bounds equal one device's up to float32 rounding (the row layer's and the
  column layer's sums are added in another order). Convolutions and a dense layer left
  without a partner stay whole.
- ``data=D``: the regions (and their specifications) split over D devices.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from jaxpar.verify import bounds
from jaxpar.verify.network import Affine, Network, NetworkError, ReLU

AXES = ("data", "fsdp", "tensor")
METHODS = ("ibp", "crown", "alpha-crown")


def degrees(strategy: str, devices: int) -> dict:
    """{data, fsdp, tensor: degree} of ``strategy`` ("fsdp=8", "data=2,tensor=4"; "" is one
    device), refusing other axes and more devices than there are. (Not ``parallel.parse_strategy``:
    a training strategy gives its leftover devices to data, where bounds want one device unless told.)"""
    degree = dict.fromkeys(AXES, 1)
    for part in filter(None, (p.strip() for p in strategy.split(","))):
        axis, _, value = part.partition("=")
        if axis.strip() not in AXES or not value.strip().isdigit() or int(value) < 1:
            raise NetworkError(f"{part!r} in strategy {strategy!r}: bounds run under {', '.join(a + '=N' for a in AXES)}")
        degree[axis.strip()] = int(value)
    if math.prod(degree.values()) > devices:
        raise NetworkError(f"strategy {strategy!r} needs {math.prod(degree.values())} devices and there are {devices}")
    return degree


def place(net: Network, fsdp: int, tensor: int, share_specs: bool = False) -> bounds.Placement:
    """The placement of ``net``'s layers (module doc), refusing a degree that does not divide a
    layer, by name; with ``share_specs`` each fsdp device bounds its share of the specifications."""
    roles = ["full"] * len(net.layers)
    if tensor > 1:
        _pair(net, roles, tensor)
    gather = tuple(_fsdp_dim(layer, role, fsdp, tensor) for layer, role in zip(net.layers, roles))
    return bounds.Placement(tuple(roles), gather, tensor, fsdp if share_specs else 1)


def _pair(net: Network, roles: list, tensor: int):
    """Megatron pairs of dense layers with only elementwise layers between them."""
    open_column = None
    for i, layer in enumerate(net.layers):
        dense = isinstance(layer, Affine) and layer.kind == "dense"
        if open_column is not None and dense:
            column = net.layers[open_column]
            if column.out_shape[0] % tensor:  # (a dense layer left without a partner stays whole, unchecked)
                raise NetworkError(f"layer {column.describe()}: tensor={tensor} does not divide its {column.out_shape[0]} "
                                   f"outputs; choose a tensor degree that divides the width of every dense layer it splits")
            roles[open_column], roles[i] = "column", "row"
            for k in range(open_column + 1, i):
                roles[k] = "zone"
            open_column = None
        elif dense:
            open_column = i
        elif not (isinstance(layer, ReLU) or (isinstance(layer, Affine) and layer.kind in ("scale", "bias"))):
            open_column = None  # a convolution or a reshape ends a pair before it forms
    if "column" not in roles:
        raise NetworkError(f"tensor={tensor} splits pairs of dense layers with only ReLUs between them, and this network "
                           "has none; use fsdp or data")


def _fsdp_dim(layer, role: str, fsdp: int, tensor: int) -> int | None:
    """The dim of a dense or convolution weight split over fsdp: the largest it divides that tensor
    does not split, else the one tensor splits if fsdp divides its tensor shards."""
    if fsdp == 1 or not isinstance(layer, Affine) or layer.kind not in ("dense", "conv"):
        return None
    taken = {"column": 1, "row": 0}.get(role)
    shape = layer.w.shape
    dims = [d for d in np.argsort(shape)[::-1] if d != taken and shape[d] % fsdp == 0]
    if taken is not None and shape[taken] % (fsdp * tensor) == 0:
        dims.append(taken)
    if not dims:
        raise NetworkError(f"layer {layer.describe()}: fsdp={fsdp} divides no dim of its weight {tuple(shape)}"
                           + (f" (nor its tensor={tensor} shards)" if taken is not None else "")
                           + "; choose an fsdp degree that divides one dim of every dense and convolution weight")
    return int(dims[0])


def _specs(net: Network, placement: bounds.Placement):
    """Each layer's (w, b) PartitionSpecs."""
    specs = []
    for layer, role, gather in zip(net.layers, placement.roles, placement.gather):
        if not isinstance(layer, Affine):
            specs.append((None, None))
            continue
        w: list = [None] * (0 if layer.w is None else len(layer.w.shape))
        if role in ("column", "row") or (role == "zone" and layer.w is not None):
            w[{"column": 1, "row": 0}.get(role, 0)] = "tensor"
        if gather is not None:  # (on a dim tensor splits too, each tensor shard is split over fsdp)
            w[gather] = ("tensor", "fsdp") if w[gather] == "tensor" else "fsdp"
        b = P("tensor") if role in ("column", "zone") else P()
        specs.append((P(*w) if layer.w is not None else None, b if layer.b is not None else None))
    return specs


@dataclasses.dataclass(frozen=True)
class Program:
    """A bound program compiled for a layout, before it runs: ``weight_bytes`` (each device's
    shards of the weights) and the compiled ``memory`` per device (bytes: arguments, outputs,
    temporaries, peak); ``compiled`` (its HLO: ``compiled.as_text()``) and ``mesh`` its devices."""

    method: str
    strategy: str
    weight_bytes: int
    memory: dict
    compiled: Any = dataclasses.field(repr=False)
    mesh: Mesh = dataclasses.field(repr=False)

    def run(self, net: Network, lower, upper, spec=None) -> Result:
        """The bounds for these regions and specifications (as ``bound`` takes them), of the shapes
        the program was compiled for."""
        lower, upper, spec = _inputs(net, lower, upper, spec)
        lo, hi = self.compiled(_weights(net), lower, upper, spec)
        return Result(np.asarray(lo), np.asarray(hi), self)


@dataclasses.dataclass(frozen=True)
class Result:
    """Bounds of ``spec @ y`` (B, S) for each region and specification, and the program that
    computed them (what each device held)."""

    lower: np.ndarray
    upper: np.ndarray
    program: Program


def compile_bound(net: Network, regions: int, specs: int, method: str = "crown", strategy: str = "", devices=None,
                  alpha_steps: int = 20, alpha_lr: float = 0.1, compiler_options: dict | None = None,
                  share_specs: bool = False) -> Program:
    """``bound``'s program for ``regions`` boxes and ``specs`` rows of specification, compiled and
    not run (the weights may be ``jax.ShapeDtypeStruct``s: what a layout needs, known before any
    weight is made)."""
    if method not in METHODS:
        raise NetworkError(f"method {method!r}: choose one of {', '.join(METHODS)}")
    devices = list(devices or jax.devices())
    degree = degrees(strategy, len(devices))
    placement = place(net, degree["fsdp"], degree["tensor"], share_specs)
    if regions % degree["data"]:
        raise NetworkError(f"{regions} regions do not split over data={degree['data']}; give a multiple of it")
    mesh = Mesh(np.array(devices[:math.prod(degree.values())]).reshape(tuple(degree.values())), AXES)
    weight_specs = _specs(net, placement)
    program = _program(net, placement, mesh, weight_specs, method, alpha_steps, alpha_lr)
    shape = lambda x: None if x is None else jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)
    boxes = jax.ShapeDtypeStruct((regions, *net.in_shape), jnp.float32)
    rows = jax.ShapeDtypeStruct((regions, specs, *net.out_shape), jnp.float32)
    compiled = program.lower(jax.tree.map(shape, _weights(net)), boxes, boxes, rows).compile(compiler_options)
    return Program(method, strategy, _weight_bytes(net, weight_specs, degree), _memory(compiled), compiled, mesh)


def bound(net: Network, lower, upper, method: str = "crown", spec=None, strategy: str = "", devices=None,
          alpha_steps: int = 20, alpha_lr: float = 0.1, compiler_options: dict | None = None,
          share_specs: bool = False) -> Result:
    """Bounds of ``spec @ net(x)`` for x in each box [lower, upper] (B, *in_shape); ``spec``
    (B, S, *out_shape) or (S, *out_shape), default every output. ``strategy``: a layout over
    ``devices`` (default all) of data, fsdp and tensor. ``compiler_options``: XLA's, for the
    program (FSDP's bounds equal one device's bitwise when both are compiled alike).
    ``share_specs``: each fsdp device bounds 1/fsdp of the specifications (every layer's neurons
    for the intermediate bounds, and ``spec``'s rows) where they split evenly, and the bounds are
    all-gathered: the bound matrices' memory and work divided by fsdp, the bounds equal to one
    device's to float32 rounding (a matrix product of fewer rows rounds apart), no longer bitwise."""
    lower, upper, spec = _inputs(net, lower, upper, spec)
    program = compile_bound(net, lower.shape[0], spec.shape[1], method, strategy, devices, alpha_steps, alpha_lr,
                            compiler_options, share_specs)
    return program.run(net, lower, upper, spec)


def _weights(net: Network) -> list:
    return [(layer.w, layer.b) if isinstance(layer, Affine) else (None, None) for layer in net.layers]


def linf_ball(centre, radius):
    """(lower, upper) of the L-infinity balls of ``radius`` around each input of ``centre``
    ((regions, *in_shape)): the region ``bound`` takes."""
    if not np.all(np.asarray(radius) >= 0):
        raise NetworkError(f"an L-infinity ball of radius {radius}: give a radius of 0 or more")
    centre = np.asarray(centre, np.float32)
    return centre - radius, centre + radius


def _inputs(net: Network, lower, upper, spec):
    lower, upper = jnp.asarray(lower, jnp.float32), jnp.asarray(upper, jnp.float32)
    if lower.shape != upper.shape or lower.shape[1:] != net.in_shape:
        raise NetworkError(f"the region's bounds have shapes {lower.shape} and {upper.shape}; give both as "
                           f"(regions, {', '.join(map(str, net.in_shape))})")
    if not (np.isfinite(np.asarray(lower)).all() and np.isfinite(np.asarray(upper)).all()):
        raise NetworkError("the region's bounds hold an infinite or NaN value; give finite lower and upper bounds")
    bad = np.argwhere(np.asarray(lower > upper))
    if bad.size:
        where = tuple(int(i) for i in bad[0])
        raise NetworkError(f"the region's lower bound is above its upper bound at {where}: {float(lower[where])} > "
                           f"{float(upper[where])}; give lower <= upper")
    if spec is None:
        out = math.prod(net.out_shape)
        spec = jnp.eye(out, dtype=jnp.float32).reshape((out, *net.out_shape))
    spec = jnp.asarray(spec, jnp.float32)
    if spec.shape[-len(net.out_shape):] != net.out_shape:
        raise NetworkError(f"the specification's rows have shape {spec.shape[-len(net.out_shape):]}, but the network's "
                           f"output is {net.out_shape}; give rows over the network's outputs")
    if spec.ndim == len(net.out_shape) + 1:
        spec = jnp.broadcast_to(spec, (lower.shape[0], *spec.shape))
    return lower, upper, spec


def _program(net: Network, placement, mesh: Mesh, weight_specs, method: str, steps: int, lr: float):
    def local(weights, lower, upper, spec):
        if method == "ibp":
            lo, hi = bounds.ibp(net, placement, weights, lower, upper)
            return _spec_interval(spec, lo, hi, len(net.out_shape))
        if method == "crown":
            return bounds.crown(net, placement, weights, lower, upper, spec)
        return bounds.alpha_crown(net, placement, weights, lower, upper, spec, steps, lr)

    data = P("data")
    mapped = jax.shard_map(local, mesh=mesh, in_specs=(weight_specs, data, data, data), out_specs=(data, data))
    return jax.jit(mapped)


def _spec_interval(spec, lo, hi, ndim: int):
    """The interval of ``spec @ y`` for y in [lo, hi]: exact for a box."""
    c, r = (hi + lo) / 2, (hi - lo) / 2
    return bounds.contract(spec, c, ndim) - bounds.contract(jnp.abs(spec), r, ndim), \
        bounds.contract(spec, c, ndim) + bounds.contract(jnp.abs(spec), r, ndim)


def _weight_bytes(net: Network, weight_specs, degree: dict) -> int:
    """Each device's bytes of the weights and biases, from their PartitionSpecs."""
    total = 0
    for layer, specs in zip(net.layers, weight_specs):
        for x, spec in zip((getattr(layer, "w", None), getattr(layer, "b", None)), specs):
            if x is not None:
                axes = [axis for entry in spec if entry for axis in (entry if isinstance(entry, tuple) else (entry,))]
                total += math.prod(x.shape) * np.dtype(x.dtype).itemsize // math.prod(degree[axis] for axis in axes)
    return total


def _memory(compiled) -> dict:
    stats = compiled.memory_analysis()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "peak_memory_in_bytes")
    return {field.removesuffix("_in_bytes"): int(getattr(stats, field, 0) or 0) for field in fields}

