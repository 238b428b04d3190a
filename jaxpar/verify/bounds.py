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

    def backward(self, i: int, layer: Affine, w, b, lo_a, up_a, split_rows: bool = False):
        """(the lower and upper bounds' A through affine layer i, the bias's part of each bound,
        whether those parts are per-device parts to sum over tensor). The weight is gathered once
        for both A. Under tensor, A's columns follow the activations inside a split zone; at a
        column layer, whose transpose sums over its split outputs, A is all-reduced whole, or with
        ``split_rows`` summed into 1/tensor of its rows on each device (``_scatter_rows``), which a
        row layer's transpose passes round (``_gather_rows``): A is then never whole on a device."""
        w = self.weight(i, w, lo_a)
        bias = 0.0 if b is None else jnp.stack([contract(lo_a, b, len(layer.out_shape)), contract(up_a, b, len(layer.out_shape))])
        transpose = lambda a: (layer.transpose(a[0], w), layer.transpose(a[1], w))
        role = self.roles[i]
        if split_rows and role == "column":
            lo_a, up_a = self._scatter_rows(transpose, (lo_a, up_a))
        elif split_rows and role == "row":
            lo_a, up_a = self._gather_rows(transpose, (lo_a, up_a))
        else:
            lo_a, up_a = transpose((lo_a, up_a))
            if role == "column":
                lo_a, up_a = jax.lax.psum((lo_a, up_a), "tensor")
        return lo_a, up_a, bias, role in ("column", "zone")

    def _ring(self, x):
        """``x`` from the previous device of the tensor ring."""
        return jax.lax.ppermute(x, "tensor", [(j, (j + 1) % self.tensor) for j in range(self.tensor)])

    def _scatter_rows(self, transpose, a):
        """A column layer's transpose of A (all rows, its columns split), summed over the devices
        into this device's 1/tensor of the rows: each block of rows is transposed where it is and
        its sum carried round the ring, adding each device's part (a reduce-scatter of the
        products, so no device holds the whole product)."""
        count = a[0].shape[1] // self.tensor
        here, total = jax.lax.axis_index("tensor"), None
        for step in range(self.tensor):
            block = (here + self.tensor - 1 - step) % self.tensor  # the one this device's sum reaches last is its own
            if total is not None:
                total = self._ring(total)
            tie = a if total is None else total  # (each block's product after the sum it joins, so one at a time)
            part = transpose(tuple(jax.lax.dynamic_slice_in_dim(after(x, tie), block * count, count, axis=1) for x in a))
            total = part if total is None else tuple(s + p for s, p in zip(total, part))
        return total

    def _gather_rows(self, transpose, a):
        """A row layer's transpose of A split by rows (this device's 1/tensor of them): each
        block of rows passes round the ring and meets this device's rows of the weight (its share
        of the layer's inputs), filling all of A's rows over this device's columns."""
        count = a[0].shape[1]
        here, block, whole = jax.lax.axis_index("tensor"), a, None
        for step in range(self.tensor):
            if step:
                block = self._ring(block)
            part = transpose(block)  # rows of the device ``step`` places back on the ring
            if whole is None:
                # (made after the first part: else XLA makes every pass's at the start and holds them)
                whole = tuple(after(jnp.zeros((p.shape[0], count * self.tensor, *p.shape[2:]), p.dtype), p) for p in part)
            at = (here + self.tensor - step) % self.tensor * count
            whole = tuple(jax.lax.dynamic_update_slice_in_dim(x, p, at, axis=1) for x, p in zip(whole, part))
        return whole

    def spread(self, x):
        """Bound parts (2, B, rows) of this device's 1/tensor of the rows, placed among zeros for
        the other devices' rows: a sum over tensor then puts every device's rows together."""
        count = x.shape[-1]
        whole = jnp.zeros((*x.shape[:-1], count * self.tensor), x.dtype)
        return jax.lax.dynamic_update_slice_in_dim(whole, x, jax.lax.axis_index("tensor") * count, axis=-1)


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


def backward(net: Network, place: Placement, weights, start: int, a, relax: dict, lower, upper, split_rows: bool = False):
    """Bounds (lower, upper) of ``A y_start`` over the input box, ``A`` (B, S, *shape) on layer
    ``start``'s output, through the layers before it. ``relax[k]``: ReLU k's (chord, intercept,
    lower slope for the lower bound, lower slope for the upper bound). With ``split_rows`` (under
    tensor, S a multiple of it) outside split zones this device holds 1/tensor of A's rows
    (``Placement.backward``): ``a`` is those rows unless layer ``start`` is in a zone."""
    lo_a, up_a = a, a
    whole, partial = 0.0, 0.0  # the bias terms: complete, and per-device parts to sum over tensor

    def add(term, columns_split: bool):
        if columns_split:  # A's columns split: a part of the sum
            return whole, partial + term
        if split_rows:  # this device's rows, complete: among zeros for the others'
            return whole, partial + place.spread(term)
        return whole + term, partial

    for i in range(start, -1, -1):
        layer, (w, b) = net.layers[i], weights[i]
        if isinstance(layer, Affine):
            lo_a, up_a, bias, columns_split = place.backward(i, layer, w, b, lo_a, up_a, split_rows)
            whole, partial = add(bias, columns_split)
        elif isinstance(layer, ReLU):
            chord, intercept, low_slope, up_slope = relax[i]
            lo_a, lo_bias = _relu_back(lo_a, chord, intercept, low_slope, upper_bound=False)
            up_a, up_bias = _relu_back(up_a, chord, intercept, up_slope, upper_bound=True)
            whole, partial = add(jnp.stack([lo_bias, up_bias]), place.roles[i] == "zone")
        else:
            lo_a, up_a = (x.reshape((*x.shape[:2], *layer.in_shape)) for x in (lo_a, up_a))
    c, r = (upper + lower) / 2, (upper - lower) / 2
    n = len(net.in_shape)
    whole, partial = add(jnp.stack([contract(lo_a, c, n) - contract(jnp.abs(lo_a), r, n),
                                    contract(up_a, c, n) + contract(jnp.abs(up_a), r, n)]), False)
    total = whole + jax.lax.psum(partial, "tensor")
    return total[0], total[1]


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
    rows (``Placement.own_rows``). Under tensor, a ReLU in a split zone gets its own share of the
    neurons' relaxations and the identity A starts as its own columns; elsewhere each device
    starts from its 1/tensor of the rows (``backward``'s ``split_rows``, where they divide)."""
    relax, done = {}, lower  # (done: the last bounds computed, which the next pass's start waits for)
    for k, layer in enumerate(net.layers):
        if not isinstance(layer, ReLU):
            continue
        shape, split = layer.shape, place.roles[k] == "zone"
        count = math.prod(shape)  # every neuron of the layer, split or not
        first, rows = place.own_rows(count)
        split_rows = place.tensor > 1 and rows % place.tensor == 0
        if split_rows and not split:
            rows //= place.tensor
            first = first + jax.lax.axis_index("tensor") * rows
        column, columns = (jax.lax.axis_index("tensor") * (count // place.tensor), count // place.tensor) if split else (0, count)
        eye = ((first + jnp.arange(rows))[:, None] == (column + jnp.arange(columns))[None, :]).astype(lower.dtype)
        # after the bounds before it: else the identity is a constant, and XLA computes every
        # pass's first step at the start and holds them all until their pass
        eye = after(eye, done)
        shape = (columns,) if split else shape
        a = jnp.broadcast_to(eye.reshape((rows, *shape)), (lower.shape[0], rows, *shape))
        lo, hi = place.all_rows(backward(net, place, weights, k - 1, a, relax, lower, upper, split_rows), count)
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
