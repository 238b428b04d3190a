"""What jaxpar's samplers share: argument checks, the rule that picks an id from logits, and the
weights placed as a layout computes with them (nothing to gather per step when serving)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.errors import JaxparError
from jaxpar.rules import Layout, logical_names


def is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def is_real(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) and math.isfinite(x)


def check_pick(temperature, top_p) -> None:
    """Refuse a ``temperature`` or ``top_p`` that ``pick`` cannot use, with the range it must lie in."""
    if not is_real(temperature) or temperature < 0:
        raise JaxparError(f"temperature={temperature!r} must be a finite number >= 0 (0: greedy, the most probable id)")
    if not is_real(top_p) or not 0 < top_p <= 1:
        raise JaxparError(f"top_p={top_p!r} must lie in (0, 1] (1: sample from the whole distribution)")


def pick(logits, temperature: float, top_p: float, key):
    """Each position's id: the argmax, or a sample at ``temperature`` from the top-p nucleus."""
    if temperature == 0:
        return jnp.argmax(logits, -1).astype(jnp.int32)
    scaled = logits / temperature
    if top_p < 1:
        probs = jax.nn.softmax(scaled, -1)
        descending = -jnp.sort(-probs, -1)
        ahead = jnp.cumsum(descending, -1) - descending  # the probability of the ids more probable than each
        least_kept = jnp.min(jnp.where(ahead < top_p, descending, jnp.inf), -1, keepdims=True)  # the most probable always
        scaled = jnp.where(probs >= least_kept, scaled, -jnp.inf)
    return jax.random.categorical(key, scaled, -1).astype(jnp.int32)


def compute_sharding(var, layout: Layout):
    """Where a weight lives under ``layout`` when serving: as the layout computes with it (nothing
    to gather per step)."""
    value = var.get_value()
    names = layout.effective_names(logical_names(var) or (None,) * value.ndim, value.shape)
    names = tuple(None if n == "layers" else n for n in names)  # the layer stack is read one layer at a time
    return layout.sharding(names, "compute", value.shape)


def map_weights(fn, state):
    """``state`` with each weight's value replaced by ``fn(variable)``."""
    return jax.tree.map(lambda var: var.replace(value=fn(var)), state, is_leaf=lambda v: isinstance(v, nnx.Variable))
