"""The model's own layer loop, found in its traced loss: the scan over its stacked weights.

A model that stacks its layers (logical axis ``layers``) runs them with ``jax.lax.scan`` or
``nnx.scan``; traced, that is a ``scan`` whose scanned-over operands include the stacked weights.
The framework works on that scan without any call of the model's: remat checkpoints its body
(``train/remat.py``), and a pipeline cuts the loss there into what comes before the loop, chunks
of the loop, and what comes after (``parallel/pipeline.split_at_layer_scan``).

The trace is evaluated again the way ``jax.core.eval_jaxpr`` does, one equation at a time on the
caller's values, so it runs under whatever the caller is tracing (``shard_map``, ``grad``, ``jit``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.extend import core as jcore
from jax.extend import source_info_util

from jaxpar.errors import LayoutError

# ops a stacked weight passes through on its way into the layer loop unchanged in what it is
_PASS_THROUGH = {"convert_element_type", "copy", "copy_p", "pcast", "sharding_constraint", "mesh_cast", "reshard",
                 "device_put", "optimization_barrier"}
_NESTED_CALLS = {"pjit", "closed_call", "core_call"}


@dataclasses.dataclass
class Traced:
    """A function traced once: its jaxpr, the flat inputs it was traced at and which are stacked weights."""

    jaxpr: Any
    consts: list
    args: list
    marks: list  # per flat input: a stacked weight?
    out_tree: Any


def trace(fn, args: tuple, stacked: tuple) -> Traced:
    """``fn(*args)`` traced. ``stacked``: per argument, True / False for all of its leaves, or a tree
    like it of bools (True at the stacked weights). A leaf may be a ``jax.ShapeDtypeStruct``: a
    placeholder that must not be evaluated."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    marks = []
    for arg, mark in zip(args, stacked):
        count = len(jax.tree.leaves(arg))
        marks += [mark] * count if isinstance(mark, bool) else list(jax.tree.leaves(mark))
    return Traced(closed.jaxpr, list(closed.consts), jax.tree.leaves(args), marks, jax.tree.structure(out_shape))


def _is_var(v) -> bool:
    return not isinstance(v, jcore.Literal)


def _is_layer_scan(eqn, in_marks) -> bool:
    p = eqn.params
    return eqn.primitive.name == "scan" and any(in_marks[p["num_consts"] + p["num_carry"]:])


def bind(eqn, ins, params=None) -> list:
    """One equation on ``ins`` (a list of outputs), with its source line and context."""
    params = eqn.params if params is None else params
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=eqn.source_info.name_stack), eqn.ctx.manager:
        outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(params))
    return list(outs) if eqn.primitive.multiple_results else [outs]


def evaluate(traced: Traced, on_layer_scan):
    """The traced function's output, every layer scan (also one inside a nested jit that receives
    stacked weights, which is inlined) run by ``on_layer_scan(eqn, ins) -> outputs``."""
    outs, _ = _evaluate(traced.jaxpr, traced.consts, traced.args, traced.marks, on_layer_scan)
    return jax.tree.unflatten(traced.out_tree, outs)


def _evaluate(jaxpr, consts, args, marks, on_layer_scan):
    env, from_stack = {}, set()
    read = lambda v: env[v] if _is_var(v) else v.val  # noqa: E731
    env.update(zip(jaxpr.constvars, consts))
    for var, arg, mark in zip(jaxpr.invars, args, marks):
        env[var] = arg
        if mark:
            from_stack.add(var)
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        in_marks = [_is_var(v) and v in from_stack for v in eqn.invars]
        name = eqn.primitive.name
        if name in _NESTED_CALLS and any(in_marks):
            inner = eqn.params.get("jaxpr") or eqn.params["call_jaxpr"]
            inner = inner if isinstance(inner, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(inner, ())
            outs, out_marks = _evaluate(inner.jaxpr, inner.consts, ins, in_marks, on_layer_scan)
        else:
            outs = on_layer_scan(eqn, ins) if _is_layer_scan(eqn, in_marks) else bind(eqn, ins)
            out_marks = [name in _PASS_THROUGH and any(in_marks)] * len(outs)
        for var, out, mark in zip(eqn.outvars, outs, out_marks):
            env[var] = out
            if mark:
                from_stack.add(var)
    return [read(v) for v in jaxpr.outvars], [_is_var(v) and v in from_stack for v in jaxpr.outvars]


def with_body(eqn, ins, wrap=None):
    """The scan ``eqn`` bound on ``ins`` with its body traced again for their types (a carry may
    come from elsewhere than the trace's), under ``wrap`` (e.g. ``jax.checkpoint``) if given."""
    body = eqn.params["jaxpr"]
    fn = jcore.jaxpr_as_fun(body)
    fn = wrap(fn) if wrap else fn
    p = eqn.params
    lead = p["num_consts"] + p["num_carry"]
    avals = [jax.typeof(x) for x in ins[:lead]] + list(body.in_avals[lead:])
    return bind(eqn, ins, dict(p, jaxpr=jax.make_jaxpr(fn)(*avals)))


# --- the cut at the layer scan (pipelines) --------------------------------------------------


@dataclasses.dataclass
class Cut:
    """A traced loss and its one top-level layer scan: ``index`` in the equations, the scan's
    carry going in and coming out."""

    traced: Traced
    index: int

    @property
    def eqn(self):
        return self.traced.jaxpr.eqns[self.index]

    @property
    def carry_in(self):
        return self.eqn.invars[self.eqn.params["num_consts"]]

    @property
    def carry_out(self):
        return self.eqn.outvars[0]


def cut(traced: Traced, what: str) -> Cut:
    """The one layer scan at the top of ``traced``, refused in words (naming ``what`` was traced)
    unless it carries one array and outputs nothing per layer, and unless the stacked weights go
    nowhere else (a stage holds only its chunk of them: a sum over all layers' weights outside the
    loop, e.g. a regulariser, would silently cover that chunk alone)."""
    jaxpr, from_stack, found, other = traced.jaxpr, set(), [], []
    from_stack.update(v for v, m in zip(jaxpr.invars, traced.marks) if m)
    for i, eqn in enumerate(jaxpr.eqns):
        in_marks = [_is_var(v) and v in from_stack for v in eqn.invars]
        if _is_layer_scan(eqn, in_marks):
            found.append(i)
        elif any(in_marks) and eqn.primitive.name in _PASS_THROUGH:
            from_stack.update(eqn.outvars)
        elif any(in_marks):
            other.append(eqn.primitive.name)
    if len(found) != 1:
        where = f"; the stacked weights go into {', '.join(sorted(set(other)))} instead" if other else ""
        raise LayoutError(
            f"a pipeline cuts {what} at the scan that runs over the stacked layer weights (jax.lax.scan or nnx.scan "
            f"over the weights named 'layers'), but its trace has {len(found)} such scans at its top level{where}. "
            f"Run the layers in one scan, outside any jax.jit of the model's own")
    if other:
        raise LayoutError(
            f"a pipeline stage holds only its chunk of the stacked layer weights, but {what} also uses them outside "
            f"its layer scan (in {', '.join(sorted(set(other)))}). Use them only inside the scan over the layers")
    result = Cut(traced, found[0])
    p = result.eqn.params
    if p["num_carry"] != 1 or len(result.eqn.outvars) != 1:
        raise LayoutError(
            f"a pipeline passes one array between stages, but the layer scan of {what} carries {p['num_carry']} values "
            f"and outputs {len(result.eqn.outvars) - p['num_carry']} per layer; carry only the residual stream")
    return result


def evaluate_for(traced: Traced, targets, given: dict, what: str, bind_at: dict | None = None) -> list:
    """The values of ``targets`` (vars of the trace), evaluating only the equations they need, with
    ``given`` vars taking the values given and equation i bound by ``bind_at[i](eqn, ins)`` if
    there. Refuses when a needed input is a placeholder (a ``jax.ShapeDtypeStruct``)."""
    jaxpr, bind_at = traced.jaxpr, bind_at or {}
    needed, run = set(targets) - set(given), set()
    for i in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[i]
        if any(v in needed for v in eqn.outvars):
            run.add(i)
            needed.update(v for v in eqn.invars if _is_var(v) and v not in given)
    env = dict(zip(jaxpr.constvars, traced.consts))
    for var, arg in zip(jaxpr.invars, traced.args):
        if var in needed and isinstance(arg, jax.ShapeDtypeStruct):
            raise LayoutError(f"{what} needs a weight this pipeline stage does not hold ({arg.shape}); the layer scan "
                              f"may use only the stacked weights and what flows in from the previous stage")
        env[var] = arg
    env.update(given)
    read = lambda v: env[v] if _is_var(v) else v.val  # noqa: E731
    for i in sorted(run):
        eqn = jaxpr.eqns[i]
        env.update(zip(eqn.outvars, bind_at.get(i, bind)(eqn, [read(v) for v in eqn.invars])))
    return [read(v) for v in targets]
