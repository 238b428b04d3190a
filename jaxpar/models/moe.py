"""A routed mixture-of-experts MLP on one device: the block the MoE model family is built from.

Each token's router logits pick its ``top_k`` experts (softmax over all experts, the chosen
probabilities renormalised to sum to 1). The token copies are sorted by expert (``dispatch``), so
each expert's tokens are one contiguous group, and every expert's SwiGLU runs as one grouped matmul
over the groups (``jax.lax.ragged_dot``: no padding, no token dropped, an expert that receives no
token costs nothing). The outputs are put back in token order and summed with the routing weights
(``combine``). ``load_balancing_loss`` is the auxiliary loss that keeps the experts' loads even:
``E * sum_e f_e P_e``, with ``f_e`` the fraction of token copies routed to expert e and ``P_e`` the
mean router probability of e.

The expert weights are stacked on a leading ``experts`` dim: gate and up (experts, embed, mlp),
down (experts, mlp, embed); the router (embed, experts).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.errors import JaxparError


def check_routing(num_experts: int, top_k: int) -> None:
    """Refuse a top-k the experts cannot give, before any work."""
    if not 1 <= top_k <= num_experts:
        raise JaxparError(f"top_k={top_k} must be between 1 and the number of experts ({num_experts}): each token is "
                          f"sent to top_k distinct experts; use e.g. top_k={min(2, num_experts)}")


def route(logits, top_k: int):
    """(weights, experts, probabilities) of (tokens, experts) router ``logits``: each token's
    ``top_k`` experts (tokens, top_k), their softmax probabilities renormalised to sum to 1, and
    every expert's probability (tokens, experts) for the auxiliary loss."""
    check_routing(logits.shape[-1], top_k)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top, experts = jax.lax.top_k(probs, top_k)
    return top / jnp.sum(top, axis=-1, keepdims=True), experts, probs


def dispatch(experts, num_experts: int):
    """(order, group_sizes) of the token copies (tokens, top_k) ``experts`` picks: ``order`` lists the
    flat copies (token * top_k + slot) sorted by expert, stable, so each expert's copies are one
    contiguous group; ``group_sizes[e]`` counts expert e's (0 for an expert no token picked)."""
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return order, jnp.bincount(flat, length=num_experts).astype(jnp.int32)


def combine(outputs, order, weights):
    """The tokens' outputs (tokens, embed) from the expert ``outputs`` of the sorted copies: each
    copy put back in token order and the top_k copies of a token summed with its routing ``weights``."""
    tokens, top_k = weights.shape
    unsorted = jnp.zeros_like(outputs).at[order].set(outputs)
    return jnp.einsum("tkd,tk->td", unsorted.reshape(tokens, top_k, -1), weights.astype(outputs.dtype))


def experts_mlp(x, order, group_sizes, w_gate, w_up, w_down, top_k: int):
    """Every expert's SwiGLU on its group of the copies of tokens ``x`` (tokens, embed), sorted by
    ``order``: three grouped matmuls (``jax.lax.ragged_dot``)."""
    copies = jnp.take(x, order // top_k, axis=0)  # copy j of the sorted list is token order[j] // top_k
    hidden = jax.nn.silu(jax.lax.ragged_dot(copies, w_gate, group_sizes)) * jax.lax.ragged_dot(copies, w_up, group_sizes)
    return jax.lax.ragged_dot(hidden, w_down, group_sizes)


def load_balancing_loss(probs, experts, num_experts: int):
    """``E * sum_e f_e P_e``: ``f_e`` the fraction of the token copies routed to expert e, ``P_e`` the
    mean router probability of e over the tokens; 1 when both are uniform, E when every token
    goes to one expert with probability 1."""
    fraction = jnp.bincount(experts.reshape(-1), length=num_experts) / experts.size
    return num_experts * jnp.sum(fraction * jnp.mean(probs, axis=0))


def moe_mlp(x, router, w_gate, w_up, w_down, top_k: int):
    """(the mixture's output, its load-balancing loss) for tokens ``x`` (tokens, embed): dropless,
    every token through its ``top_k`` experts."""
    num_experts = router.shape[-1]
    weights, experts, probs = route(x @ router, top_k)
    order, group_sizes = dispatch(experts, num_experts)
    outputs = experts_mlp(x, order, group_sizes, w_gate, w_up, w_down, top_k)
    return combine(outputs, order, weights), load_balancing_loss(probs, experts, num_experts)
