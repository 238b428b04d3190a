"""Unfinished partial sums on the manual path, found in the traced forward pass before any compile.

Inside jaxpar's ``shard_map`` a matmul or a sum over a logical axis that a model-parallel mesh axis
(``tensor``...) splits leaves each device a *partial* sum: right only once summed across devices
(``jaxpar.nn.reduce_partial``, ``sum_over``, a ``psum``). A model that forgets to finish one trains
on wrong numbers that a later sum over the same axis (a vocab-parallel loss) can hide from shard_map's
own type checks. This pass follows the forward jaxpr with, per value, which dims each tracked mesh
axis splits (seeded from the weights' stored layout) and which tracked axes it is still a partial sum
over, and refuses the first partial sum that meets a non-linear op (a norm, a softmax, a product of
two partial sums, a comparison) or leaves the loss, naming the op that made it and the op it met.

A primitive it does not know keeps what it knows of partial sums; where its operands are shaped
like its output it is taken as elementwise (each dim split as theirs), otherwise it forgets which
dims are split, and only a known non-linear op refuses: it leans to missing a fault rather than
inventing one. Axes that jaxpar's own runtime sums
(the batch and sequence axes, block parallelism, delayed TP's residual stream) are not tracked.
"""

from __future__ import annotations

import os

from jax._src import source_info_util
from jax.extend import core as jax_core

from jaxpar import parallel
from jaxpar.errors import LayoutError
from jaxpar.parallel.overlap.collective_matmul import FINISHED_SCOPE

# the logical axes whose mesh axes a forgotten sum leaves partial (the model's own dims)
_MODEL_NAMES = ("embed", "mlp", "heads", "kv_heads", "head_dim", "vocab", "experts")
# where a partial sum is wrong (its value, not only its sum, decides the result)
_NON_LINEAR = frozenset({
    "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan", "sqrt", "rsqrt", "cbrt", "pow",
    "integer_pow", "square", "abs", "sign", "max", "min", "reduce_max", "reduce_min", "argmax", "argmin", "erf",
    "erfc", "erf_inv", "lt", "le", "gt", "ge", "eq", "ne", "round", "floor", "ceil", "is_finite", "clamp", "sort",
    "top_k", "cumlogsumexp", "cummax", "cummin", "atan2", "rem",
})
_LIBRARIES = (f"{os.sep}flax{os.sep}", f"{os.sep}jaxpar{os.sep}", f"{os.sep}optax{os.sep}")
_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "argmax", "argmin", "reduce_prod"})
_FINISHING = frozenset({"psum", "pmax", "pmin", "psum_scatter", "reduce_scatter", "psum_invariant"})


def tracked_axes(layout) -> frozenset[str]:
    """Mesh axes a model's own dims are split over, less those jaxpar's runtime sums itself."""
    model = {a for name in _MODEL_NAMES for a in layout.axes_of(name)}
    runtime = set(layout.loss_axes) | set(parallel.runtime_axes(layout))
    return frozenset(model - runtime)


class _Value:
    """What the pass knows of one value: per dim, the tracked mesh axes splitting it (None: not
    known), and each tracked axis it is a partial sum over, with the op that made it so."""

    __slots__ = ("dims", "partial")

    def __init__(self, dims, partial=None):
        self.dims, self.partial = dims, dict(partial or {})


def check(jaxpr, seeds, axes: frozenset[str]):
    """Refuse an unfinished partial sum in the closed forward ``jaxpr`` of a model's loss; ``seeds``
    holds, per input, the tracked mesh axes splitting each dim (a tuple of sets per dim)."""
    if not axes:
        return
    known = [_Value(tuple(frozenset(d) & axes for d in dims)) for dims in seeds]
    outs = _run(jaxpr.jaxpr, known, axes)
    for out in outs:
        if out.partial:
            axis, origin = next(iter(out.partial.items()))
            raise LayoutError(_message(axis, origin, "the loss the model returns"))


def _message(axis: str, origin: str, met: str) -> str:
    return (f"unfinished partial sum: {origin} over mesh axis {axis!r}, so each device holds "
            f"only its share of the result, and {met} uses it as if whole. Finish the sum first: wrap it in "
            f"jaxpar.nn.reduce_partial(x, contracted_names, output_names) (a row-parallel matmul), use "
            f"jaxpar.nn.embed_lookup for a lookup in a vocabulary-split table, or jaxpar.nn.sum_over / cross_entropy for "
            f"a sum or softmax over a split dim")


# the calls (jit, custom_vjp...) whose inner jaxprs are being followed, innermost last: an op inside a
# library's jitted function (jnp.take's gather) has only the library's frames, its caller the user's
_CALLERS: list = []


def _where(eqn) -> str:
    """The op and the first line of the user's own code that made it (past Flax's and jaxpar's),
    found on the op or else on the calls it was made inside."""
    for holder in (eqn, *reversed(_CALLERS)):
        for frame in source_info_util.user_frames(holder.source_info.traceback):
            if not any(part in frame.file_name for part in _LIBRARIES):
                return f"{eqn.primitive.name} at {frame.file_name}:{frame.start_line} ({frame.function_name})"
    return f"{eqn.primitive.name} at {source_info_util.summarize(eqn.source_info)}"


def _run(jaxpr, inputs, axes) -> list[_Value]:
    env = {}
    for var, value in zip(jaxpr.invars, inputs):
        env[var] = value
    for var in jaxpr.constvars:
        env[var] = _Value((frozenset(),) * len(var.aval.shape))

    def read(atom):
        if isinstance(atom, jax_core.Literal) or atom not in env:
            return _Value((frozenset(),) * len(getattr(atom.aval, "shape", ())))
        return env[atom]

    for eqn in jaxpr.eqns:
        outs = _eqn(eqn, [read(v) for v in eqn.invars], axes)
        if FINISHED_SCOPE in str(eqn.source_info.name_stack):
            for out in outs:
                out.partial = {}
        for var, out in zip(eqn.outvars, outs):
            env[var] = out
    return [read(v) for v in jaxpr.outvars]


def _sub_jaxpr(eqn):
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if sub is not None:
            return sub
    return None


def _eqn(eqn, ins: list[_Value], axes) -> list[_Value]:
    name = eqn.primitive.name
    partial = {}
    for value in ins:
        partial.update(value.partial)
    if partial and name in _NON_LINEAR or (name in ("mul", "dot_general", "div") and _both_partial(ins, name)):
        axis, origin = next(iter(partial.items()))
        raise LayoutError(_message(axis, origin, _where(eqn)))
    if name == "scan":
        return _scan(eqn, ins, axes)
    if name == "while":
        body = eqn.params["body_jaxpr"]
        nc, bc = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        carry = ins[nc + bc:]
        for _ in range(2):  # twice: a partial sum made in one trip is carried into the next
            carry = _merge(carry, _run(body.jaxpr, ins[nc:nc + bc] + carry, axes))
        return carry
    if name == "cond":
        outs = [_run(b.jaxpr, ins[1:], axes) for b in eqn.params["branches"]]
        for other in outs[1:]:
            outs[0] = _merge(outs[0], other)
        return outs[0]
    sub = _sub_jaxpr(eqn)
    if sub is not None and len(getattr(sub, "jaxpr", sub).invars) == len(ins):
        _CALLERS.append(eqn)
        try:
            return _run(getattr(sub, "jaxpr", sub), ins, axes)
        finally:
            _CALLERS.pop()
    if name == "dot_general" or name in _REDUCTIONS:
        return [_summed(eqn, ins, partial, axes)]
    if name == "gather":
        return [_looked_up(eqn, ins, partial, axes)]
    if name in _FINISHING:
        partial = _finish(eqn, partial)
    return [_Value(_dims(eqn, ins, i, axes), partial) for i in range(len(eqn.outvars))]


def _both_partial(ins, name) -> bool:
    if name == "div":
        return bool(ins[1].partial)
    return len(ins) >= 2 and bool(ins[0].partial) and bool(ins[1].partial)


def _finish(eqn, partial: dict) -> dict:
    names = eqn.params.get("axes", eqn.params.get("axis_name", ()))
    names = set(names if isinstance(names, (tuple, list)) else (names,))
    return {a: o for a, o in partial.items() if a not in names}


def _merge(old: list[_Value], new: list[_Value]) -> list[_Value]:
    out = []
    for a, b in zip(old, new):
        dims = tuple(x if x == y else None for x, y in zip(a.dims, b.dims)) if len(a.dims) == len(b.dims) else b.dims
        out.append(_Value(dims, {**a.partial, **b.partial}))
    return out


def _scan(eqn, ins, axes) -> list[_Value]:
    body = eqn.params["jaxpr"].jaxpr
    nconsts, ncarry = eqn.params["num_consts"], eqn.params["num_carry"]
    consts, carry, xs = ins[:nconsts], ins[nconsts:nconsts + ncarry], ins[nconsts + ncarry:]
    slices = [_Value(x.dims[1:], x.partial) for x in xs]
    for _ in range(2):  # twice: what one layer leaves partial reaches the next through the carry
        outs = _run(body, consts + carry + slices, axes)
        carry = _merge(carry, outs[:ncarry])
    ys = [_Value((frozenset(),) + y.dims, y.partial) for y in outs[ncarry:]]
    return carry + ys


def _summed(eqn, ins, partial, axes) -> _Value:
    """A dot_general or a reduction: partial over every tracked axis splitting a summed dim."""
    if eqn.primitive.name == "dot_general":
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lhs, rhs = ins
        summed = {a for d in lc for a in lhs.dims[d] or ()} | {a for d in rc for a in rhs.dims[d] or ()}
        free_l = [d for d in range(len(lhs.dims)) if d not in lc and d not in lb]
        free_r = [d for d in range(len(rhs.dims)) if d not in rc and d not in rb]
        dims = tuple(_union(lhs.dims[a], rhs.dims[b]) for a, b in zip(lb, rb))
        dims += tuple(lhs.dims[d] for d in free_l) + tuple(rhs.dims[d] for d in free_r)
    else:
        (operand,) = ins[:1]
        reduced = tuple(eqn.params.get("axes", ()))
        summed = {a for d in reduced for a in operand.dims[d] or ()}
        dims = tuple(d for i, d in enumerate(operand.dims) if i not in reduced)
    made = {a: f"{_where(eqn)} reduces over a dim split" for a in sorted(summed & axes) if a not in partial}
    return _Value(dims, {**partial, **made})


def _looked_up(eqn, ins, partial, axes) -> _Value:
    """A gather: where the operand's looked-up dims are split, each device finds only the rows it
    holds (the others' ids come back clamped, or NaN), so the result is right only as
    ``jaxpar.nn.embed_lookup`` makes it: those rows kept, the others zero, and the shares summed."""
    operand = ins[0]
    split = {a for d in eqn.params["dimension_numbers"].start_index_map for a in operand.dims[d] or ()}
    made = {a: f"{_where(eqn)} looks up rows of a table split" for a in sorted(split & axes) if a not in partial}
    return _Value((None,) * len(eqn.outvars[0].aval.shape), {**partial, **made})


def _union(a, b):
    return None if a is None or b is None else a | b


def _dims(eqn, ins, index, axes) -> tuple:
    """Per dim of output ``index``, the tracked mesh axes splitting it (None where not known)."""
    name, params = eqn.primitive.name, eqn.params
    rank = len(getattr(eqn.outvars[index].aval, "shape", ()))
    if len(eqn.outvars) > 1:  # a collective over several operands: each output is its input's
        return ins[index].dims if len(ins) == len(eqn.outvars) and len(ins[index].dims) == rank else (None,) * rank
    same = [v for v in ins if len(v.dims) == rank]
    if name in ("broadcast_in_dim",):
        out = [frozenset()] * rank
        for src, dst in enumerate(params["broadcast_dimensions"]):
            out[dst] = ins[0].dims[src]
        return tuple(out)
    if name == "transpose":
        return tuple(ins[0].dims[p] for p in params["permutation"])
    if name == "squeeze":
        return tuple(d for i, d in enumerate(ins[0].dims) if i not in params["dimensions"])
    if name == "reshape":
        return _reshape(ins[0].dims, eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape)
    if name == "all_gather":
        gone = set(params["axis_name"] if isinstance(params["axis_name"], tuple) else (params["axis_name"],))
        dims = list(ins[0].dims)
        d = params["all_gather_dimension"]
        dims[d] = None if dims[d] is None else dims[d] - gone
        return tuple(dims)
    if name in ("psum_scatter", "reduce_scatter"):
        dims = list(ins[0].dims)
        d = params["scatter_dimension"]
        named = params.get("axes", params.get("axis_name"))
        named = named if isinstance(named, tuple) else (named,)
        dims[d] = None if dims[d] is None else dims[d] | (frozenset(named) & axes)
        return tuple(dims)
    if name in ("iota", "axis_index"):
        return (frozenset(),) * rank
    if name in ("gather", "scatter", "scatter-add", "scatter_add", "all_to_all") or not same:
        return (None,) * rank
    # elementwise ops, slices, pads, concatenations: each dim split as its operands' are
    return tuple(_union_all(v.dims[i] for v in same) for i in range(rank))


def _union_all(entries):
    out = frozenset()
    for e in entries:
        if e is None:
            return None
        out |= e
    return out


def _reshape(dims, old, new) -> tuple:
    """A reshape's dims: a merged dim is split where any of its parts was; a split dim's axes go to
    its first part of size above 1 (how a contiguous shard reshapes)."""
    out, i, j = [], 0, 0
    while i < len(old) or j < len(new):
        gi, gj = [i] if i < len(old) else [], [j] if j < len(new) else []
        a = old[i] if i < len(old) else 1
        b = new[j] if j < len(new) else 1
        while a != b:
            if a < b and i + len(gi) < len(old):
                a *= old[i + len(gi)]
                gi.append(i + len(gi))
            elif j + len(gj) < len(new):
                b *= new[j + len(gj)]
                gj.append(j + len(gj))
            else:
                return (None,) * len(new)
        merged = _union_all(dims[k] for k in gi)
        first = next((k for k in gj if new[k] > 1), gj[0] if gj else None)
        out.extend(merged if k == first else frozenset() for k in gj)
        i, j = i + len(gi), j + len(gj)
    return tuple(out[:len(new)])
