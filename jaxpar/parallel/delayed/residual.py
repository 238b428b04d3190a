"""Delayed TP's runtime: the residual stream's adds when each sublayer's finished sum is read one
sublayer late (the model calls ``jaxpar.nn.start_delayed``, ``residual_add`` and
``finish_delayed``, which come here where the layout delays sums).

Each device keeps its own copy of the stream: after sublayer k it adds its own partial output of
k at once and the other devices' share of the partial output of k - 1, whose all-reduce was issued
when k - 1 made it, so that all-reduce runs while sublayer k computes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.errors import LayoutError
from jaxpar.parallel.tensor import DELAYED
from jaxpar.rules import _ACTIVE, _CALLS, manual_layout, vary_everywhere


def delayed_axes(call: str) -> tuple[str, ...]:
    """The mesh axes the active layout delays the sums over (() outside jaxpar's manual step);
    records the model's ``call``. A delaying layout outside the manual step is refused: only a
    shard_map keeps a stream per device."""
    layout = manual_layout(call)
    active = _ACTIVE.get()
    probing = _CALLS.get() is not None  # the plan's trace that only records which calls a model makes
    if layout is None and active is not None and active.layout.role(DELAYED) and not probing:
        raise LayoutError("the layout delays tensor parallelism's sums (delay=1), which only jaxpar's manual step "
                          "(shard_map) can run: each device keeps a residual stream of its own. Run the model through "
                          "jaxpar's Trainer or serving Decoder, or drop delay=1")
    return () if layout is None else layout.role(DELAYED)


def start(x):
    """(this device's own copy of the stream ``x``, zeros pending). A sublayer's output varies over
    every mesh axis (``enter_block`` makes its input so); the stream it is added to, carried
    through a layer scan, must have the same type from the start."""
    layout = _ACTIVE.get().layout
    x = vary_everywhere(x, layout)
    return x, vary_everywhere(jnp.zeros_like(x), layout)


def add_late(x, partial, pending, contracted, axes: tuple[str, ...]):
    """(``x`` + this device's ``partial`` + the others' share of ``pending``, the new pending
    ``partial``) for a sublayer whose sum runs over logical axes ``contracted``."""
    summed = sorted({a for name in contracted for a in _ACTIVE.get().layout.axes_of(name)})
    if summed != sorted(axes):
        raise LayoutError(f"residual_add: the partial sums over logical axes {tuple(contracted)} are split over mesh axes "
                          f"{summed}, but the layout delays the sums over {list(axes)}: only a sublayer whose sum runs over "
                          f"exactly those axes can be delayed")
    return x + partial + (jax.lax.psum(pending, axes) - pending), partial


def finish(x, pending, axes: tuple[str, ...]):
    """The stream after the last sublayer: the pending sum added (every copy the same again)."""
    return x + (jax.lax.psum(pending, axes) - pending)
