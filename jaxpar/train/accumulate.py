"""Gradient accumulation over micro-batches, per device inside the manual step's ``shard_map``.

A ``lax.scan`` over the micro-batches carries one float32 buffer per weight, already shaped like
the shard the per-micro-batch reductions leave (sharded over ``fsdp`` under ZeRO-2/3, whole under
ZeRO-1 and DP): the gradient of each micro-batch is reduced first and then added, so the buffer
never holds more than the layout's gradient mapping asks for.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict as flatten
from flax.traverse_util import unflatten_dict as nest

from jaxpar.rules import Layout, vary_over, varying_axes


def local_microbatches(batch, k: int):
    """This device's rows as ``k`` micro-batches of consecutive rows, stacked on a new dim 0
    (``gspmd.microbatches`` gives the same rows on the global batch)."""
    return jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)


def acc_zeros(x, scatters, layout: Layout):
    """The accumulator of weight ``x``'s gradient: float32 zeros of the shard that the
    per-micro-batch reduce-scatters ``scatters`` ([(dim, mesh axes)]) leave, typed as varying
    over the axes the gradients added to it vary over (``x``'s and those the tokens are split over)."""
    shape = list(x.shape)
    for dim, axes in scatters:
        shape[dim] //= math.prod(layout.mesh.shape[a] for a in axes)
    zeros = jnp.zeros(shape, jnp.float32)
    return vary_over(zeros, varying_axes(x) | set(layout.loss_axes))


def accumulate(value_and_grad, params, micro, reduce, plans: dict, layout: Layout):
    """(losses, summed gradients) over the micro-batches ``micro``
    (stacked on dim 0): ``value_and_grad(params, micro_batch)`` gives one micro-batch's loss and
    gradient, ``reduce(gradient)`` its per-micro-batch reductions (``plans[path].per_micro``, by
    which the buffer is shaped)."""

    def micro_step(acc, mb):
        loss, grads = value_and_grad(params, mb)
        return jax.tree.map(jnp.add, acc, reduce(grads)), loss

    acc = nest({p: acc_zeros(v, plans[p].per_micro, layout) for p, v in flatten(params).items()})
    acc, losses = jax.lax.scan(micro_step, acc, micro)
    return losses, acc
