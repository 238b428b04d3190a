"""A routed mixture of experts on one device's tokens: routing, dispatch, grouped matmuls, combine.

Each token's router logits pick its ``top_k`` experts (``Routing``): by softmax probability (the
chosen ones renormalised to sum to 1), or by sigmoid score (DeepSeek-V3: the chosen scores
normalised), optionally group-limited (the experts cut into ``groups``; a token chooses only among
the ``top_groups`` groups whose best two scores sum highest), optionally with a per-expert
``bias`` added to the scores for the choice only (the auxiliary-loss-free balancing of DeepSeek-V3:
the bias steers the load, the weights stay the unbiased scores).

The token copies are sorted by expert (``dispatch``), so each expert's copies are one contiguous
group, and every expert's SwiGLU runs as three grouped matmuls over the groups (``experts_mlp``:
``jax.lax.ragged_dot``, no padding, an expert no token picks costs nothing; or JAX's megablox
Pallas kernel, which expert parallelism's exchange takes on TPU). The outputs are put back in token
order and summed with the routing weights (``combine``).

Dropless by default. With a ``capacity_factor`` an expert takes at most ``capacity(length)`` =
ceil(capacity_factor x length x top_k / experts) copies from each row (sequence) of the batch, the
earlier tokens of the row first (``ranks_in_row``); a dropped copy adds nothing (its token goes on
through the residual stream). The capacity is per row, so every layout that splits the batch or the
sequence drops the same copies as one device.

``balance_loss`` is the auxiliary loss that keeps the loads even, ``E * sum_e f_e P_e`` with
``f_e`` the fraction of the copies routed to expert e (before any drop) and ``P_e`` the mean
router probability of e, from sums (``BalanceSums``) that a layout adds up over its devices first.
``bias_steering`` is the auxiliary-loss-free alternative's update of the bias from the same sums.

Expert weights are stacked on a leading ``experts`` dim: gate and up (experts, embed, mlp), down
(experts, mlp, embed); the router (embed, experts). This module is the arithmetic alone; the model
calls ``jaxpar.nn.mixture_of_experts``, which runs it here or, under expert parallelism, around the
exchange of ``jaxpar/parallel/expert/``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import ops as megablox

from jaxpar.errors import JaxparError

SCORES = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class Routing:
    experts: int
    top_k: int
    score: str = "softmax"  # how logits become the weights the choice is made by
    groups: int = 1  # group-limited routing: the experts in this many equal groups
    top_groups: int = 1  # ... of which each token's top_k come from this many
    capacity_factor: float | None = None  # None: dropless

    def __post_init__(self):
        e, k = self.experts, self.top_k
        if not 1 <= k <= e:
            raise JaxparError(f"top_k={k} must be between 1 and the number of experts ({e}): each token is sent to "
                              f"top_k distinct experts; use e.g. top_k={min(2, e)}")
        if self.score not in SCORES:
            raise JaxparError(f"router score {self.score!r} is not one of {', '.join(SCORES)}")
        if self.groups < 1 or e % self.groups or not 1 <= self.top_groups <= self.groups:
            raise JaxparError(f"group-limited routing needs groups dividing the {e} experts and 1 <= top_groups <= groups; "
                              f"got groups={self.groups}, top_groups={self.top_groups} (groups=1 turns it off)")
        if self.top_groups * (e // self.groups) < k:
            raise JaxparError(f"top_groups={self.top_groups} groups of {e // self.groups} experts hold fewer than "
                              f"top_k={k} experts; raise top_groups to at least {math.ceil(k / (e // self.groups))}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise JaxparError(f"capacity_factor={self.capacity_factor} must be positive (copies an expert takes per row, "
                              f"as a multiple of an even share), or None for dropless routing; e.g. 1.25")

    def capacity(self, length: int) -> int | None:
        """Copies an expert takes from one row of ``length`` tokens (None: dropless)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * length * self.top_k / self.experts)


class BalanceSums(NamedTuple):
    """What the load-balancing loss needs, as sums a layout can add up over its devices."""

    copies: jax.Array  # (experts,) token copies routed to each expert (before any drop)
    probs: jax.Array  # (experts,) each expert's router probability summed over the tokens
    tokens: jax.Array  # () tokens summed over


def route(logits, routing: Routing, bias=None):
    """(weights, experts, probs) for router ``logits`` (tokens, experts): each token's ``top_k``
    experts (tokens, top_k) and their weights, and every expert's probability (tokens, experts)
    for the balance loss (the softmax of the logits; the normalised sigmoid scores)."""
    logits = logits.astype(jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1) if routing.score == "softmax" else jax.nn.sigmoid(logits)
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    if routing.groups > 1:
        choice = _within_top_groups(choice, routing)
    _, experts = jax.lax.top_k(choice, routing.top_k)
    top = jnp.take_along_axis(scores, experts, axis=-1)
    probs = scores if routing.score == "softmax" else scores / jnp.sum(scores, axis=-1, keepdims=True)
    return top / jnp.sum(top, axis=-1, keepdims=True), experts, probs


def _within_top_groups(choice, routing: Routing):
    """``choice`` with the experts outside each token's ``top_groups`` best groups (a group's worth:
    the sum of its best two, or its best where it holds one) pushed below any score."""
    grouped = choice.reshape(*choice.shape[:-1], routing.groups, -1)
    worth = jnp.sum(jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0], axis=-1)
    _, kept = jax.lax.top_k(worth, routing.top_groups)
    keep = jnp.sum(jax.nn.one_hot(kept, routing.groups, dtype=jnp.bool_), axis=-2, dtype=jnp.bool_)
    return jnp.where(keep[..., None], grouped, -jnp.inf).reshape(choice.shape)


def balance_sums(experts, probs, num_experts: int) -> BalanceSums:
    """This device's ``BalanceSums`` of its token copies ``experts`` (..., top_k) and ``probs`` (..., experts)."""
    copies = jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=jnp.int32), axis=tuple(range(experts.ndim)))
    probs = probs.reshape(-1, num_experts)
    return BalanceSums(copies, jnp.sum(probs, axis=0), jnp.asarray(probs.shape[0], jnp.float32))


def balance_loss(sums: BalanceSums, top_k: int):
    """``E * sum_e f_e P_e`` from (all devices') sums: 1 when copies and probabilities are
    uniform, E when every token goes to one expert with probability 1."""
    fraction = sums.copies / (sums.tokens * top_k)
    return sums.copies.shape[0] * jnp.sum(fraction * sums.probs / sums.tokens)


def bias_steering(bias, copies, rate: float):
    """A term of the loss whose value is 0 and whose gradient on the routing ``bias`` (experts,) is
    ``rate * sign(copies - their mean)``, for the batch's token ``copies`` per expert (before any
    drop): a step that subtracts the gradient (``jaxpar.nn.RuleUpdated``) raises the bias of the
    experts that got less than an even share and lowers it for those that got more, by ``rate``
    (DeepSeek-V3's auxiliary-loss-free balancing and its update speed)."""
    copies = copies.astype(jnp.float32)
    step = jax.lax.stop_gradient(rate * jnp.sign(copies - jnp.mean(copies)))
    return jnp.sum(step * (bias - jax.lax.stop_gradient(bias)).astype(jnp.float32))


def ranks_in_row(experts, num_experts: int, earlier=None):
    """Each copy's rank among its expert's copies in its row: ``experts`` (rows, length, top_k), in
    row order; ``earlier`` (rows, experts): copies each expert got before these positions (from the
    row's other pieces). A token's top_k experts are distinct, so a position adds at most one copy
    to an expert."""
    hits = jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=jnp.int32), axis=2)  # (rows, length, experts)
    before = jnp.cumsum(hits, axis=1) - hits + (0 if earlier is None else earlier[:, None, :])
    return jnp.take_along_axis(before, experts, axis=2)


def keep_within_capacity(experts, ranks, routing: Routing, length: int):
    """``experts`` with every copy beyond its expert's capacity per row (``ranks`` from
    ``ranks_in_row``; ``length`` the whole row's) replaced by ``routing.experts``: a group of its
    own after every expert's, which ``dispatch`` sorts last and no expert runs."""
    capacity = routing.capacity(length)
    return experts if capacity is None else jnp.where(ranks < capacity, experts, routing.experts)


def dispatch(experts, num_experts: int):
    """(order, group_sizes) of the token copies (tokens, top_k) ``experts`` picks: ``order`` lists the
    flat copies (token * top_k + slot) sorted by expert, stable, so each expert's copies are one
    contiguous group (dropped copies, marked ``num_experts``, last); ``group_sizes[e]`` counts
    expert e's (0 for an expert no token picked)."""
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return order, jnp.sum(jax.nn.one_hot(flat, num_experts, dtype=jnp.int32), axis=0)


def experts_mlp(copies, group_sizes, w_gate, w_up, w_down, kernel: str = "ragged_dot", interpret: bool = False):
    """Every expert's SwiGLU on its group of the sorted ``copies`` (rows, embed): three grouped
    matmuls, by ``kernel`` ("ragged_dot" or "megablox"; ``interpret``: megablox's Pallas kernel in
    interpret mode, off TPU); rows past the groups' total come out zero. Under megablox the
    gradient of those rows of ``copies`` is left unwritten: read only the groups' rows of it."""
    if kernel == "ragged_dot":
        hidden = jax.nn.silu(jax.lax.ragged_dot(copies, w_gate, group_sizes)) * jax.lax.ragged_dot(copies, w_up, group_sizes)
        return jax.lax.ragged_dot(hidden, w_down, group_sizes)
    # megablox's gmm leaves the rows past the groups unwritten (each row of its output reads only
    # its own row, so they stay apart): the output is zeroed there. The backward pass leaves the
    # same rows of the copies' cotangent unwritten: the exchange, the one caller, sends back only the
    # rows that came (zeroing them would cost 0.42 GB more temporaries on Mixtral-8x7B)
    inside = (jnp.arange(copies.shape[0]) < jnp.sum(group_sizes))[:, None]
    sizes = group_sizes.astype(jnp.int32)

    def gmm(lhs, rhs):
        return megablox.gmm(lhs, rhs, sizes, preferred_element_type=lhs.dtype, interpret=interpret,
                            tiling=megablox_tiling(lhs.shape[0], *rhs.shape[1:]))

    out = gmm(jax.nn.silu(gmm(copies, w_gate)) * gmm(copies, w_up), w_down)
    return jnp.where(inside, out, jnp.zeros((), out.dtype))


MEGABLOX_TILE = (512, 1024, 1024)  # (rows, contracted, out): megablox gmm's tiles, each cut to its dim


def megablox_tiling(rows: int, contracted: int, out: int) -> tuple[int, int, int] | None:
    """The tiles of megablox's gmm for a (rows, contracted) x (groups, contracted, out) grouped
    matmul, or None where a dim is not a whole number of them (the kernel needs whole tiles)."""
    dims = (rows, contracted, out)
    tiles = tuple(min(t, d) for t, d in zip(MEGABLOX_TILE, dims))
    return tiles if all(d % t == 0 for d, t in zip(dims, tiles)) else None


def combine(outputs, order, weights):
    """The tokens' outputs (tokens, embed) from the expert ``outputs`` of the sorted copies: each
    copy put back in token order and the top_k copies of a token summed with its routing ``weights``."""
    tokens, top_k = weights.shape
    unsorted = jnp.zeros_like(outputs).at[order].set(outputs)
    return jnp.einsum("tkd,tk->td", unsorted.reshape(tokens, top_k, -1), weights.astype(outputs.dtype))


def mixture(x, router, w_gate, w_up, w_down, routing: Routing, bias=None):
    """(output, ``BalanceSums``) of the mixture on tokens ``x`` (rows, length, embed), all on this device."""
    rows, length, width = x.shape
    weights, experts, probs = route(jnp.einsum("rle,ex->rlx", x, router), routing, bias)
    sums = balance_sums(experts, probs, routing.experts)
    kept = keep_within_capacity(experts, ranks_in_row(experts, routing.experts), routing, length)
    flat = x.reshape(rows * length, width)
    order, group_sizes = dispatch(kept, routing.experts)
    outputs = experts_mlp(jnp.take(flat, order // routing.top_k, axis=0), group_sizes, w_gate, w_up, w_down)
    return combine(outputs, order, weights.reshape(-1, routing.top_k)).reshape(x.shape), sums
