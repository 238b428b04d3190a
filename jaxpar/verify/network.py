"""The networks ``jaxpar.verify`` bounds: a feed-forward chain of affine layers (dense, convolution,
elementwise scale, bias), ReLUs and reshapes, read from a Flax NNX module by tracing it
(``from_nnx``) or from an ONNX file (``verify.onnx``).

A network is written once, as a plain Flax user writes it; the chain is what its jaxpr does to
one input. Tracing rather than walking the module's attributes means any composition works
(``nnx.Sequential``, a custom ``__call__``, ``jax.nn.relu`` or ``nnx.relu``), and an operation the
bounds cannot follow is refused by name before any bound is computed.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from jaxpar.errors import JaxparError

class NetworkError(JaxparError):
    """A network the bounds cannot follow (an operation, a shape), said before any work."""


@dataclasses.dataclass(frozen=True)
class Affine:
    """``y = linear(x) + b`` on one example (no batch dim): ``dense`` (``x @ w``, w of shape
    (in, out)), ``conv`` (``lax.conv_general_dilated`` with ``conv``'s arguments, w its kernel),
    ``scale`` (``x * w``, w broadcast to the example) or ``bias`` (no w). ``b``: None or broadcast
    to the output."""

    name: str
    kind: str
    w: jax.Array | None
    b: jax.Array | None
    in_shape: tuple
    out_shape: tuple
    conv: dict | None = None

    def linear(self, x, w=None):
        """The linear part on ``x`` of shape (..., *in_shape), with weights ``w`` (default this
        layer's; ``|w|`` gives the interval radius's map)."""
        w = self.w if w is None else w
        if self.kind == "dense":
            return x @ w
        if self.kind == "scale":
            return x * w
        if self.kind == "bias":
            return x
        lead = x.shape[:x.ndim - len(self.in_shape)]
        flat = x.reshape((-1, *self.in_shape))
        y = jax.lax.conv_general_dilated(flat, w, **self.conv)
        return y.reshape((*lead, *self.out_shape))

    def transpose(self, a, w=None):
        """The linear part's transpose on ``a`` of shape (..., *out_shape): the backward bound's map."""
        w = self.w if w is None else w
        if self.kind == "dense":
            return a @ w.T
        if self.kind in ("scale", "bias"):
            return a * w if self.kind == "scale" else a
        lead = a.shape[:a.ndim - len(self.out_shape)]
        flat = a.reshape((-1, *self.out_shape))
        # the transpose at a point of a's own type (under shard_map, varying where a is)
        point = jnp.broadcast_to(flat.ravel()[0] * 0, (flat.shape[0], *self.in_shape))
        _, back = jax.vjp(lambda x: self.linear(x, w), point)
        return back(flat)[0].reshape((*lead, *self.in_shape))

    def describe(self) -> str:
        return f"{self.name} ({self.kind}, {math.prod(self.in_shape)} -> {math.prod(self.out_shape)})"


@dataclasses.dataclass(frozen=True)
class ReLU:
    name: str
    shape: tuple


@dataclasses.dataclass(frozen=True)
class Reshape:
    name: str
    in_shape: tuple
    out_shape: tuple


@dataclasses.dataclass(frozen=True)
class Network:
    """The chain, first layer first, on examples of ``in_shape`` giving ``out_shape``."""

    layers: tuple
    in_shape: tuple
    out_shape: tuple

    def __call__(self, x):
        """The network on a batch ``x`` of shape (batch, *in_shape) (what the bounds bound)."""
        for layer in self.layers:
            if isinstance(layer, Affine):
                x = layer.linear(x) + (0 if layer.b is None else layer.b)
            elif isinstance(layer, ReLU):
                x = jnp.maximum(x, 0)
            else:
                x = x.reshape((x.shape[0], *layer.out_shape))
        return x


def from_nnx(module, in_shape: tuple) -> Network:
    """The chain a Flax NNX ``module`` applies to one example of ``in_shape`` (traced on a batch of
    one; weights are the module's, by reference). Layers are named by their weights' paths in the
    module's state."""
    from flax import nnx  # (here only: an ONNX network and the bounds need none of flax)

    graphdef, state = nnx.split(module)
    names = {id(variable.get_value()): "/".join(str(part) for part in path[:-1]) or "/".join(map(str, path))
             for path, variable in nnx.to_flat_state(state)}
    closed = jax.make_jaxpr(lambda x: nnx.merge(graphdef, state)(x))(jnp.zeros((1, *in_shape), jnp.float32))
    consts = dict(zip(closed.jaxpr.constvars, closed.consts))
    tracer = _Tracer(names, Chain(in_shape))
    env = dict(consts)
    env[closed.jaxpr.invars[0]] = _ACT
    if tracer.walk(closed.jaxpr, env) is not _ACT:
        raise NetworkError("the network's output does not depend on its input")
    return tracer.chain.network()


class Chain:
    """A network being built, layer by layer (by ``from_nnx``'s tracer or the ONNX reader): its
    layers so far and the shape of one example after them."""

    def __init__(self, in_shape: tuple):
        self.in_shape, self.layers, self.shape = tuple(in_shape), [], tuple(in_shape)

    def emit(self, layer):
        self.layers.append(layer)
        self.shape = getattr(layer, "out_shape", getattr(layer, "shape", self.shape))

    def add_bias(self, b, name: str | None = None):
        """A constant added to the activation: folded into the last layer's bias when that layer is
        affine, else a bias layer of its own."""
        last = self.layers[-1] if self.layers else None
        if isinstance(last, Affine):
            self.layers[-1] = dataclasses.replace(last, b=b if last.b is None else last.b + b)
        else:
            self.emit(Affine(name or f"bias[{len(self.layers)}]", "bias", None, b, self.shape, self.shape))

    def network(self) -> Network:
        return Network(tuple(self.layers), self.in_shape, self.shape)


_ACT = object()  # the activation's place in a traced jaxpr (every other value is a constant)
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
          "custom_vjp_call_jaxpr": "fun_jaxpr", "closed_call": "call_jaxpr"}


class _Tracer:
    """Walks a jaxpr with one activation flowing through it, folding constants and emitting layers."""

    def __init__(self, names: dict, chain: Chain):
        self.names, self.chain = names, chain

    def name(self, w) -> str:
        return self.names.get(id(w), f"layers[{len(self.chain.layers)}]")

    def walk(self, jaxpr, env: dict):
        read = lambda v: v.val if isinstance(v, jex_core.Literal) else env[v]
        for eqn in jaxpr.eqns:
            args = [read(v) for v in eqn.invars]
            active = any(a is _ACT for a in args)  # (identity: `in` would compare arrays)
            if eqn.primitive.name in _CALLS and active:
                inner = eqn.params[_CALLS[eqn.primitive.name]]
                inner = getattr(inner, "jaxpr", inner)
                sub = dict(zip(inner.constvars, getattr(eqn.params[_CALLS[eqn.primitive.name]], "consts", [])))
                sub.update(zip(inner.invars, args))
                outs = [self.walk(inner, sub)]
            elif not active:
                outs = eqn.primitive.bind(*args, **eqn.params)
                outs = outs if eqn.primitive.multiple_results else [outs]
            else:
                outs = [self.layer(eqn, args)]
            for var, value in zip(eqn.outvars, outs):
                env[var] = value
        return read(jaxpr.outvars[0])

    def layer(self, eqn, args):
        """The layer one equation on the activation makes (or folds into the last one)."""
        prim, chain = eqn.primitive.name, self.chain
        shape = chain.shape
        const = next((a for a in args if a is not _ACT), None)
        out_shape = tuple(eqn.outvars[0].aval.shape[1:])
        if prim == "dot_general" and args[0] is _ACT and len(shape) == 1:
            (lhs, rhs), batch = eqn.params["dimension_numbers"]
            if batch != ((), ()) or tuple(lhs) != (1,) or const.ndim != 2:
                raise NetworkError(f"{self.name(const)}: a dense layer must be x @ w on the features; got dimension numbers "
                                   f"{eqn.params['dimension_numbers']}")
            w = const if tuple(rhs) == (0,) else const.T
            chain.emit(Affine(self.name(const), "dense", w, None, shape, out_shape))
        elif prim == "conv_general_dilated" and args[0] is _ACT:
            params = {k: eqn.params[k] for k in ("window_strides", "padding", "lhs_dilation", "rhs_dilation",
                                                 "dimension_numbers", "feature_group_count", "batch_group_count")}
            chain.emit(Affine(self.name(const), "conv", const, None, shape, out_shape, params))
        elif prim in ("add", "sub") and const is not None:
            b = jnp.broadcast_to(jnp.asarray(const, jnp.float32), (1, *out_shape))[0]
            if prim == "sub" and args[1] is _ACT:  # c - x: a scale by -1, then c
                chain.emit(Affine(f"negate[{len(chain.layers)}]", "scale", -jnp.ones(out_shape), None, shape, out_shape))
            chain.add_bias(-b if prim == "sub" and args[0] is _ACT else b)
        elif (prim == "mul" and const is not None) or (prim == "div" and args[0] is _ACT):
            w = jnp.broadcast_to(jnp.asarray(const, jnp.float32), (1, *out_shape))[0]
            chain.emit(Affine(self.name(const), "scale", 1 / w if prim == "div" else w, None, shape, out_shape))
        elif prim == "max" and const is not None and np.all(np.asarray(const) == 0):
            chain.emit(ReLU(f"relu[{len(chain.layers)}]", shape))
        elif prim == "reshape":
            if out_shape != shape:
                chain.emit(Reshape(f"reshape[{len(chain.layers)}]", shape, out_shape))
        elif prim == "convert_element_type" and eqn.outvars[0].aval.dtype == jnp.float32:
            pass
        elif prim == "add":
            raise NetworkError("the network adds two activations (a residual connection); jaxpar.verify bounds chains "
                               "of dense, convolution, scale, bias, ReLU and reshape layers")
        else:
            raise NetworkError(f"the network applies {prim}, which jaxpar.verify cannot bound; it bounds chains of "
                               "dense, convolution, scale, bias, ReLU and reshape layers")
        return _ACT
