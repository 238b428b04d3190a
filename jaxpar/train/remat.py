"""The framework's remat: a checkpoint policy on each iteration of the model's own layer loop.

jaxpar traces the loss once, finds the scans that run over the stacked weights (``layer_scan``)
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

import functools

import jax

from jaxpar import layer_scan
from jaxpar.errors import JaxparError
from jaxpar.rules import GATHERED

REMAT = ("none", "full", "dots")


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


def check_layer_loops(remat: str, stacked):
    """Refuse a remat that would recompute nothing: the policy goes on the layer loops over
    stacked weights (``stacked``: True at them), and a model without any has none."""
    if remat != "none" and not any(jax.tree.leaves(stacked)):
        raise JaxparError(f"remat={remat} recomputes each iteration of the model's layer loop (a scan over weights stacked "
                          f"on the logical axis 'layers', e.g. nnx.vmap/nnx.scan with transform_metadata="
                          f"{{nnx.PARTITION_NAME: 'layers'}}), but this model has no stacked layer weights, so nothing would be "
                          f"recomputed: stack its layers, or checkpoint its blocks itself (nnx.remat) and use remat=none")


def checkpoint(policy):
    """``jax.checkpoint`` of a layer body by ``policy`` (prevent_cse=False: inside a scan the
    recomputation cannot be merged away), or None for no checkpoint."""
    return None if policy is None else functools.partial(jax.checkpoint, policy=policy, prevent_cse=False)


def checkpoint_layer_loops(fn, policy, stacked):
    """``fn(params, *rest)`` with the body of every scan over a stacked weight checkpointed by
    ``policy``. ``stacked``: a tree shaped like ``params``, True at the stacked weights."""
    if policy is None:
        return fn

    def run(params, *rest):
        traced = layer_scan.trace(fn, (params, *rest), (stacked, *[False] * len(rest)))
        return layer_scan.evaluate(traced, lambda eqn, ins: layer_scan.with_body(eqn, ins, checkpoint(policy)))

    return run
