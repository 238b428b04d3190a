"""Bounds on a network's outputs over a box of inputs: IBP (interval arithmetic), CROWN (backward
linear bounds through the ReLUs' linear relaxations) and alpha-CROWN (CROWN with the relaxations'
lower slopes optimised by gradient steps), written once for every layout.

Each function runs inside ``shard_map`` over a mesh of ``data`` (batches of regions), ``fsdp``
(weights sharded, gathered layer by layer at each use) and ``tensor`` (Megatron's column/row split
of the dense layers and of the bound matrices). ``Placement`` says where each layer's weights and
activations lie and does the collectives; on one device every axis has size 1 and the same code
runs with no communication, which is what makes the sharded bounds comparable to one device's.

Conventions: a batch of B regions; ``c``/``r`` centre and radius of an interval; ``A`` a bound
matrix of shape (B, S, *shape) for S specifications (rows of ``spec @ y``); bounds are
``(lower, upper)`` of shape (B, S).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax

from jaxpar.verify.network import Affine, Network, ReLU

ROLES = ("full", "column", "row", "zone")  # a layer under tensor=T: whole, split by outputs / inputs, between the two


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a network's layers lie: ``roles[i]`` of ``ROLES`` under ``tensor``; ``gather[i]`` the
    dim of layer i's weight split over ``fsdp`` (None: whole on every device)."""

    roles: tuple
    gather: tuple
    tensor: int = 1  # the tensor degree (a split zone's activations are 1/tensor of a layer's)
    rows: int = 1  # the fsdp degree: each device takes 1/rows of the specifications (A's rows) where they split

    def own_rows(self, count: int) -> tuple[int, int]:
        """(first, how many) of ``count`` specifications this device bounds: its share under fsdp
        when they split evenly, else all of them (a row's bound needs no other row)."""
        if self.rows == 1 or count % self.rows:
            return 0, count
        share = count // self.rows
        return jax.lax.axis_index("fsdp") * share, share

    def all_rows(self, bounds: tuple, count: int) -> tuple:
        """Every device's bounds of its own rows, put together on each (``own_rows``)."""
        if self.rows == 1 or count % self.rows:
            return bounds
        return tuple(jax.lax.all_gather(x, "fsdp", axis=1, tiled=True, to="invarying") for x in bounds)

    def weight(self, i: int, w, tie):
        """Layer i's weight for use now (an FSDP shard gathered whole), made to depend on ``tie``
        (the data it is about to meet, ``after``). So each use is its own gather, which XLA neither
        merges with another pass's nor keeps alive from one pass to the next, and nothing computed
        from the weights alone (``|w|``, a transpose) is made at the start and held; one device
        runs the same program."""
        if w is None:
            return w
        w = after(w, tie)
        if self.gather[i] is None:
            return w
        return jax.lax.all_gather(w, "fsdp", axis=self.gather[i], tiled=True, to="invarying")

    def forward(self, i: int, layer: Affine, w, b, c, r):
        """The interval (centre, radius) after affine layer i: exact, ``|w|`` maps the radius."""
        w = self.weight(i, w, c)
        centre, radius = layer.linear(c, w), (r if w is None else layer.linear(r, jnp.abs(w)))
        if self.roles[i] == "row":  # each device holds a share of the inputs: partial sums
            centre, radius = jax.lax.psum((centre, radius), "tensor")
        return centre + (0 if b is None else b), radius

    def backward(self, i: int, layer: Affine, w, b, lo_a, up_a):
        """(the lower and upper bounds' A through affine layer i, the bias's part of each bound,
        whether those parts are partial sums over tensor). A column layer's transpose sums over its
        split outputs: the one all-reduce of the A matrices. The weight is gathered once for both."""
        w = self.weight(i, w, lo_a)
        bias = 0.0 if b is None else jnp.stack([contract(lo_a, b, len(layer.out_shape)), contract(up_a, b, len(layer.out_shape))])
        lo_a, up_a = layer.transpose(lo_a, w), layer.transpose(up_a, w)
        if self.roles[i] == "column":
            lo_a, up_a = jax.lax.psum((lo_a, up_a), "tensor")
        return lo_a, up_a, bias, self.roles[i] in ("column", "zone")


def after(x, tie):
    """``x`` made to depend on ``tie`` (a tree; one of its values): ``x`` minus +0.0 times that
    value, exactly ``x`` for finite data, with no gradient through ``tie``. XLA then computes
    ``x``'s uses only once ``tie`` exists. (An optimization barrier would do it too, but would type
    ``tie`` as varying over every axis ``x`` varies over.)"""
    return x - jnp.abs(jax.lax.stop_gradient(jax.tree.leaves(tie)[0].ravel()[0])) * 0.0


def contract(a, x, ndim: int):
    """sum over the example dims of ``a`` (B, S, *shape) times ``x`` (shape, or (B, *shape)): a
    matrix-vector product (a sum of ``a * x`` would have XLA:CPU build ``x`` out to ``a``'s shape)."""
    rows = a.reshape((*a.shape[:2], -1))
    if x.ndim == ndim:
        return rows @ x.reshape(-1)
    return jnp.einsum("bsn,bn->bs", rows, x.reshape((x.shape[0], -1)))


def ibp(net: Network, place: Placement, weights, lower, upper):
    """[lower, upper] of the output (B, *out_shape), by interval arithmetic."""
    c, r = (upper + lower) / 2, (upper - lower) / 2
    for i, (layer, (w, b)) in enumerate(zip(net.layers, weights)):
        if isinstance(layer, Affine):
            c, r = place.forward(i, layer, w, b, c, r)
        elif isinstance(layer, ReLU):
            lo, hi = jnp.maximum(c - r, 0), jnp.maximum(c + r, 0)
            c, r = (hi + lo) / 2, (hi - lo) / 2
        else:
            c, r = (x.reshape((x.shape[0], *layer.out_shape)) for x in (c, r))
    return c - r, c + r


def relaxation(lower, upper):
    """A ReLU's linear relaxation on [lower, upper]: (upper line's slope, its intercept, CROWN's
    lower slope): 1 where always active, 0 where never, the chord above and 0 or 1 below (whichever
    leaves less area) where unstable."""
    active, unstable = lower >= 0, (lower < 0) & (upper > 0)
    chord = jnp.where(unstable, upper / jnp.where(unstable, upper - lower, 1.0), active.astype(lower.dtype))
    intercept = jnp.where(unstable, -chord * lower, 0.0)
    below = jnp.where(unstable, (upper > -lower).astype(lower.dtype), active.astype(lower.dtype))
    return chord, intercept, below


def backward(net: Network, place: Placement, weights, start: int, a, relax: dict, lower, upper):
    """Bounds (lower, upper) of ``A y_start`` over the input box, ``A`` (B, S, *shape) on layer
    ``start``'s output, through the layers before it. ``relax[k]``: ReLU k's (chord, intercept,
    lower slope for the lower bound, lower slope for the upper bound)."""
    lo_a, up_a = a, a
    full, partial = jnp.zeros(a.shape[:2]), jnp.zeros(a.shape[:2])
    for i in range(start, -1, -1):
        layer, (w, b) = net.layers[i], weights[i]
        if isinstance(layer, Affine):
            lo_a, up_a, bias, split = place.backward(i, layer, w, b, lo_a, up_a)
            full, partial = (full, partial + bias) if split else (full + bias, partial)
        elif isinstance(layer, ReLU):
            chord, intercept, low_slope, up_slope = relax[i]
            lo_a, lo_bias = _relu_back(lo_a, chord, intercept, low_slope, upper_bound=False)
            up_a, up_bias = _relu_back(up_a, chord, intercept, up_slope, upper_bound=True)
            bias = jnp.stack([lo_bias, up_bias])
            full, partial = (full, partial + bias) if place.roles[i] == "zone" else (full + bias, partial)
        else:
            lo_a, up_a = (x.reshape((*x.shape[:2], *layer.in_shape)) for x in (lo_a, up_a))
    full = full + jax.lax.psum(partial, "tensor")
    c, r = (upper + lower) / 2, (upper - lower) / 2
    n = len(net.in_shape)
    return (contract(lo_a, c, n) - contract(jnp.abs(lo_a), r, n) + full[0],
            contract(up_a, c, n) + contract(jnp.abs(up_a), r, n) + full[1])


def _relu_back(a, chord, intercept, slope, upper_bound: bool):
    """A through a relaxed ReLU: a bound's positive coefficients take the side it bounds toward
    (the lower line for a lower bound), its negative ones the other side."""
    pos, neg = jnp.maximum(a, 0), jnp.minimum(a, 0)
    if upper_bound:
        return pos * chord[:, None] + neg * slope, contract(pos, intercept, intercept.ndim - 1)
    return pos * slope + neg * chord[:, None], contract(neg, intercept, intercept.ndim - 1)


def crown_relaxations(net: Network, place: Placement, weights, lower, upper) -> dict:
    """Each ReLU's relaxation from CROWN's bounds on its pre-activation (every neuron a
    specification, through the relaxations of the ReLUs before it). Each device bounds its own
    rows (``Placement.own_rows``); under tensor, a ReLU in a split zone gets its own share of the
    neurons' relaxations, and the identity A starts as its own columns."""
    relax, done = {}, lower  # (done: the last bounds computed, which the next pass's start waits for)
    for k, layer in enumerate(net.layers):
        if not isinstance(layer, ReLU):
            continue
        shape, split = layer.shape, place.roles[k] == "zone"
        count = math.prod(shape)  # every neuron of the layer, split or not
        first, rows = place.own_rows(count)
        column, columns = (jax.lax.axis_index("tensor") * (count // place.tensor), count // place.tensor) if split else (0, count)
        eye = ((first + jnp.arange(rows))[:, None] == (column + jnp.arange(columns))[None, :]).astype(lower.dtype)
        # after the bounds before it: else the identity is a constant, and XLA computes every
        # pass's first step at the start and holds them all until their pass
        eye = after(eye, done)
        shape = (columns,) if split else shape
        a = jnp.broadcast_to(eye.reshape((rows, *shape)), (lower.shape[0], rows, *shape))
        lo, hi = place.all_rows(backward(net, place, weights, k - 1, a, relax, lower, upper), count)
        done = lo  # (every neuron's, the same on every device)
        if split:
            lo, hi = (jax.lax.dynamic_slice_in_dim(x, column, columns, axis=1) for x in (lo, hi))
        lo, hi = lo.reshape((-1, *shape)), hi.reshape((-1, *shape))
        chord, intercept, below = relaxation(lo, hi)
        relax[k] = (chord, intercept, below[:, None], below[:, None])
    return relax


def crown(net: Network, place: Placement, weights, lower, upper, spec):
    """CROWN's (lower, upper) of ``spec @ y`` (spec (B, S, *out_shape))."""
    relax = crown_relaxations(net, place, weights, lower, upper)
    first, rows = place.own_rows(spec.shape[1])
    own = jax.lax.dynamic_slice_in_dim(spec, first, rows, axis=1)
    return place.all_rows(backward(net, place, weights, len(net.layers) - 1, own, relax, lower, upper), spec.shape[1])


def alpha_crown(net: Network, place: Placement, weights, lower, upper, spec, steps: int, learning_rate: float):
    """alpha-CROWN's (lower, upper) of ``spec @ y``: the lower slopes of the ReLUs' relaxations,
    one per (region, specification, neuron) and bound side, optimised by ``steps`` Adam steps from
    CROWN's (projected to [0, 1]), keeping each bound's best; so never looser than CROWN. The
    intermediate layers' bounds are CROWN's."""
    relax = crown_relaxations(net, place, weights, lower, upper)
    count = spec.shape[1]
    first, specs = place.own_rows(count)
    spec = jax.lax.dynamic_slice_in_dim(spec, first, specs, axis=1)
    alphas = {k: tuple(jnp.broadcast_to(s, (s.shape[0], specs, *s.shape[2:])) for s in (low, up))
              for k, (_, _, low, up) in relax.items()}

    def bounds_of(alphas):
        slopes = {k: (chord, intercept, *alphas[k]) for k, (chord, intercept, _, _) in relax.items()}
        return backward(net, place, weights, len(net.layers) - 1, spec, slopes, lower, upper)

    def loss(alphas):
        lo, up = bounds_of(alphas)
        return jnp.sum(up) - jnp.sum(lo), (lo, up)

    optimizer = optax.adam(learning_rate)

    def step(carry, _):
        alphas, state, best_lo, best_up = carry
        (_, (lo, up)), grads = jax.value_and_grad(loss, has_aux=True)(alphas)
        updates, state = optimizer.update(grads, state, alphas)
        alphas = jax.tree.map(lambda a: jnp.clip(a, 0.0, 1.0), optax.apply_updates(alphas, updates))
        return (alphas, state, jnp.maximum(best_lo, lo), jnp.minimum(best_up, up)), None

    lo, up = bounds_of(alphas)
    (alphas, _, lo, up), _ = jax.lax.scan(step, (alphas, optimizer.init(alphas), lo, up), None, length=steps)
    last_lo, last_up = bounds_of(alphas)
    return place.all_rows((jnp.maximum(lo, last_lo), jnp.minimum(up, last_up)), count)
