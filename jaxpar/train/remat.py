"""The framework's remat: a checkpoint policy on each iteration of the model's own layer loop.

A model that stacks its layers runs them with a scan (``jax.lax.scan``, ``nnx.scan``). jaxpar
traces the loss once, finds the scans that run over the stacked weights (logical axis ``layers``)
and evaluates the trace again with each such scan's body under ``jax.checkpoint(policy)``, so the
backward pass keeps or recomputes per layer as the policy says and the model needs no call of
jaxpar's. (One checkpoint around the whole loss would not do: its backward pass recomputes the
whole forward pass at once and keeps every layer's activations again.)

The policy combines the run's choice (``TrainConfig.remat``) with the layout's FSDP choice: the
weights gathered for compute (checkpoint name ``rules.GATHERED``) are kept for the backward pass
unless the layout says ``regather``, then they are gathered again (3 instead of 2 passes of
weight traffic). Only weights gathered inside the loop body can be gathered again: outside a loop
XLA merges a recomputed gather with the forward one.
"""

from __future__ import annotations

import jax
from jax.extend import core as jcore
from jax.extend import source_info_util

from jaxpar.errors import JaxparError
from jaxpar.rules import GATHERED

REMAT = ("none", "full", "dots")

# ops a stacked weight passes through on its way into the layer loop unchanged in what it is
_PASS_THROUGH = {"convert_element_type", "copy", "copy_p", "pcast", "sharding_constraint", "mesh_cast", "reshard",
                 "device_put", "optimization_barrier"}
_NESTED_CALLS = {"pjit", "closed_call", "core_call"}


def policy(remat: str, regather: bool):
    """The ``jax.checkpoint`` policy of a layer body, or None when the body needs no checkpoint."""
    cp = jax.checkpoint_policies
    if remat not in REMAT:
        raise JaxparError(f"remat={remat!r} is unknown; use none (keep activations), full (recompute each layer) "
                          f"or dots (keep only matmul outputs)")
    if remat == "none":
        # regather: keep matmul outputs, recompute the elementwise ops and the gathers (naming the
        # gathered weights "not saveable" is not enough: autodiff may save the same value unnamed)
        return cp.dots_saveable if regather else None
    if remat == "full":
        return cp.nothing_saveable if regather else cp.save_only_these_names(GATHERED)
    dots = cp.dots_with_no_batch_dims_saveable
    return dots if regather else cp.save_from_both_policies(dots, cp.save_only_these_names(GATHERED))


def checkpoint_layer_loops(fn, policy, stacked):
    """``fn(params, *rest)`` with the body of every scan over a stacked weight checkpointed by
    ``policy``. ``stacked``: a tree shaped like ``params``, True at the stacked weights (or True:
    all of ``params`` is a layer stack, as a pipeline stage's chunk is)."""
    if policy is None:
        return fn

    def run(params, *rest):
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(params, *rest)
        args = jax.tree.leaves((params, *rest))
        marks = [True] * len(jax.tree.leaves(params)) if stacked is True else list(jax.tree.leaves(stacked))
        marks += [False] * (len(args) - len(marks))
        outs, _ = _evaluate(closed.jaxpr, closed.consts, args, marks, policy)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return run


def _evaluate(jaxpr, consts, args, marks, policy):
    """Evaluate ``jaxpr`` as ``jax.core.eval_jaxpr`` does, checkpointing the layer loops.
    ``marks``: per input, whether it is a stacked weight. Returns (outputs, their marks)."""
    env, from_stack = {}, set()
    read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]  # noqa: E731
    env.update(zip(jaxpr.constvars, consts))
    for var, arg, mark in zip(jaxpr.invars, args, marks):
        env[var] = arg
        if mark:
            from_stack.add(var)
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        in_marks = [not isinstance(v, jcore.Literal) and v in from_stack for v in eqn.invars]
        name, params = eqn.primitive.name, eqn.params
        if name in _NESTED_CALLS and any(in_marks):  # a jit inside the loss: look inside it, inline
            inner = params.get("jaxpr") or params["call_jaxpr"]
            inner = inner if isinstance(inner, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(inner, ())
            outs, out_marks = _evaluate(inner.jaxpr, inner.consts, ins, in_marks, policy)
        else:
            if name == "scan" and any(in_marks[params["num_consts"] + params["num_carry"]:]):
                params = dict(params, jaxpr=_checkpointed(params["jaxpr"], policy))
            with source_info_util.user_context(eqn.source_info.traceback, name_stack=eqn.source_info.name_stack), \
                    eqn.ctx.manager:
                outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(params))
            outs = outs if eqn.primitive.multiple_results else [outs]
            out_marks = [name in _PASS_THROUGH and any(in_marks)] * len(outs)
        for var, out, mark in zip(eqn.outvars, outs, out_marks):
            env[var] = out
            if mark:
                from_stack.add(var)
    return [read(v) for v in jaxpr.outvars], [not isinstance(v, jcore.Literal) and v in from_stack for v in jaxpr.outvars]


def _checkpointed(body, policy):
    """A scan body (ClosedJaxpr) under ``jax.checkpoint(policy)``, with the same inputs and outputs.
    (prevent_cse=False: inside a scan the recomputation cannot be merged away.)"""
    fn = jax.checkpoint(jcore.jaxpr_as_fun(body), policy=policy, prevent_cse=False)
    return jax.make_jaxpr(fn)(*body.in_avals)
