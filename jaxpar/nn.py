"""The calls a model makes: layout-aware building blocks that work on one device and, unchanged,
on the local shards inside jaxpar's manual step. A model that makes none of them takes the GSPMD
path instead (``train/gspmd.py``), where XLA places the collectives.

- ``constrain(x, names)``: the compute layout of an activation;
- ``enter_block(x, src, dst)``: the residual stream entering an attention or MLP block
  (all-gathered along the sequence under SP; Megatron's f);
- ``reduce_partial(x, contracted, dst)``: finish a sum over a sharded logical axis (a row-parallel
  matmul; Megatron's g: all-reduce, or reduce-scatter under SP);
- ``shard_offset``, ``shard_count``, ``sum_over``: this device's index into a sharded dim, the
  devices it is split over, and sums across it;
- ``embed_lookup``, ``cross_entropy``: vocab-parallel embedding and next-token loss;
- ``start_delayed``, ``residual_add``, ``finish_delayed``: the residual stream's adds, where
  delayed tensor parallelism (``delay=1``, ``parallel/delayed/``) reads each sublayer's sum one
  sublayer late;
- ``block_share(batch, block_size)``: a block diffusion loss's share of a batch under block
  parallelism (its runtime: ``parallel/block/blocks.py``);
- ``mixture_of_experts(x, names, ...)``: a routed mixture-of-experts MLP (``jaxpar.experts``),
  its tokens exchanged over the expert axis under expert parallelism (``parallel/expert/``);
- ``RuleUpdated``: the type of a weight the optimizer leaves alone, moved each step by exactly
  minus its gradient (a rule the model writes into its loss: a mixture's routing bias).

The runtimes of the strategies these calls drive (collective matmul's rings, block sharing) live
in their strategies' folders under ``parallel/``.

Per-layer gathers and remat need no call: the step does them (``rules.gather_layers_when_read``,
``train/remat.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar import experts, parallel
from jaxpar.errors import LayoutError
from jaxpar.parallel.block import blocks
from jaxpar.parallel.expert import exchange
from jaxpar.parallel.overlap import OVERLAPPED, collective_matmul
from jaxpar.parallel.delayed import residual
from jaxpar.parallel.subspace import SUBSPACE
from jaxpar.parallel.subspace import codec as subspace_codec
from jaxpar.parallel.tensor import DELAYED
from jaxpar.rules import (_ACTIVE, Layout, Names, _called, manual_layout, stored_table, unfinished_axes, vary_everywhere, vary_over,
                          varying_axes)

block_share = blocks.share  # a block diffusion loss's share of a batch (block parallelism's runtime)


def _check_rank(x, names):
    if x.ndim != len(names):
        raise LayoutError(f"array of shape {x.shape} was given {len(names)} logical names {tuple(names)}; give one per dim")


def constrain(x, names: Names):
    """Declare the compute layout of activation ``x`` by logical names."""
    _check_rank(x, names)
    _called("constrain")
    active = _ACTIVE.get()
    if active is None or active.manual:
        return x  # on one device nothing to do; in manual mode x is already the local shard
    return jax.lax.with_sharding_constraint(x, active.layout.sharding(names, shape=x.shape))


def enter_block(x, src: Names, dst: Names, then=None):
    """Move ``x`` from layout ``src`` to ``dst`` where ``dst`` shards less (e.g. the sequence-parallel
    residual stream entering an attention or MLP block): all-gathers the dims that lose mesh axes.
    With ``then`` (the block's first, column-parallel matmuls, acting on each position alone):
    ``then`` of the result, which collective matmul (``tp_overlap=on``) computes chunk by chunk as
    the gather's ring brings them.

    In jaxpar's step, refuses an ``x`` that differs across a model-parallel mesh axis none of its
    ``src`` dims is split over: it holds a partial sum that was never finished (see ``_unfinished``)."""
    _check_rank(x, dst)
    then = then or (lambda h: h)
    layout = manual_layout("enter_block")
    if layout is None:
        return then(constrain(x, dst))
    _refuse_unfinished_sum(x, src, layout, "enter_block")
    # The block's work is split over every mesh axis; marking x as varying once here makes the
    # backward pass sum x's gradient in one all-reduce (Megatron's f), not one per use of x.
    x = vary_everywhere(x, layout)
    ring = None
    for dim, (s, d) in enumerate(zip(src, dst)):
        lost = tuple(a for a in layout.axes_of(s) if a not in layout.axes_of(d))
        if lost and lost == layout.role(OVERLAPPED)[:1] and ring is None:
            ring = (lost[0], dim)  # gathered by the ring, under then's matmuls
        elif lost:
            x = jax.lax.all_gather(x, lost, axis=dim, tiled=True)
    return then(x) if ring is None else collective_matmul.gather_then(x, then, *ring)


def _refuse_unfinished_sum(x, names: Names, layout: Layout, where: str):
    """Raise if ``x`` (laid out as ``names``) varies over a model-parallel mesh axis (one some
    logical axis other than the batch maps to) that none of its dims is split over.

    Inside the manual step such a value can only be a sum over a logical axis sharded on that mesh
    axis that nobody finished (a row-parallel matmul output without ``reduce_partial``): its shards
    are partial sums, and a later sum over the same axis (a vocab-parallel loss) would hide it."""
    # (under delayed TP the residual stream differs across the delayed axes on purpose)
    unfinished = unfinished_axes(x, names, layout, layout.role(DELAYED))
    if unfinished:
        origin = _origin(x, unfinished[0])
        raise LayoutError(
            f"the tensor entering {where} with logical names {tuple(names)} (shape {tuple(x.shape)}) differs across "
            f"mesh axis {'/'.join(unfinished)}, over which none of its dims is split: it holds unfinished partial sums"
            f"{f', made by {origin}' if origin else ''}. A sum over a logical axis sharded on {unfinished[0]!r} "
            f"(a row-parallel matmul, a one-hot lookup in a vocabulary-split table) was used without finishing it; wrap "
            f"that sum in jaxpar.nn.reduce_partial(x, contracted_names, output_names), or look rows up with "
            f"jaxpar.nn.embed_lookup"
        )


def _origin(x, axis: str) -> str | None:
    """Best effort: the op (primitive and source line) that first made ``x`` vary over ``axis``,
    walking back through the ops that produced it. Reads JAX's tracing internals, so it gives up
    quietly (None) when they differ."""
    try:
        from jax._src import source_info_util

        node = x
        for _ in range(64):
            while hasattr(node, "primal"):  # under autodiff: the traced primal value
                node = node.primal
            eqn = getattr(node, "parent", None)
            if eqn is None:
                return None
            if eqn.primitive.name in ("dot_general", "reduce_sum"):
                return f"{eqn.primitive.name} at {source_info_util.summarize(eqn.source_info)}"
            inputs = [t for t in eqn.in_tracers if hasattr(t, "aval") and axis in varying_axes(t)]
            if not inputs or eqn.primitive.name == "pcast":
                return None
            node = inputs[-1]
    except Exception:  # noqa: BLE001 - a hint in an error message must never raise itself
        return None
    return None


def reduce_partial(x, contracted: Sequence[str], dst: Names, project=None):
    """``x`` holds partial sums because logical axes ``contracted`` were summed away while sharded
    (a row-parallel matmul); finish the sum and lay the result out as ``dst``. With ``project``
    (the row-parallel matmul itself, acting on each position alone): the finished sum of
    ``project(x)``, which collective matmul (``tp_overlap=on``) computes hop by hop of its ring.

    Reduce-scatters along a ``dst`` dim that the summed mesh axes shard (Megatron sequence
    parallelism), all-reduces otherwise (Megatron tensor parallelism)."""
    layout = manual_layout("reduce_partial")
    if layout is None or project is None:
        x, project = (x if project is None else project(x)), None
        _check_rank(x, dst)
        if layout is None:
            return constrain(x, dst)
    pending = [a for name in contracted for a in layout.axes_of(name)]
    for dim, name in enumerate(dst):
        scatter = tuple(a for a in layout.axes_of(name) if a in pending)
        if scatter and scatter == layout.role(OVERLAPPED)[:1] and project is not None:
            x, project = collective_matmul.project_then_scatter(x, project, scatter[0], dim), None
        elif scatter:
            x = jax.lax.psum_scatter(x if project is None else project(x), scatter, scatter_dimension=dim, tiled=True)
            project = None
        pending = [a for a in pending if a not in scatter]
    x = x if project is None else project(x)
    return jax.lax.psum(x, tuple(pending)) if pending else x


# --- the residual stream: each sublayer's finished sum added, now or (delayed TP) one sublayer late ---


def start_delayed(x, names: Names):
    """``(x, pending)``: the residual stream ``x`` (laid out as ``names``) entering a model's first
    sublayer, and the partial sum still to be added to it, to carry from sublayer to sublayer with
    ``residual_add`` (None, unless the layout delays: then zeros, and ``x`` becomes this device's
    own copy of the stream: ``parallel/delayed/residual.py``)."""
    _check_rank(x, names)
    if not residual.delayed_axes("start_delayed"):
        return x, None
    return residual.start(x)


def residual_add(x, partial, contracted: Sequence[str], names: Names, pending=None, project=None):
    """``(x + the finished sum of partial, pending)`` for a sublayer's output ``partial`` (partial
    sums over the sharded logical axes ``contracted``, as ``reduce_partial`` takes them; with
    ``project``, of ``project(partial)``) and the residual stream ``x`` laid out as ``names``.

    Under delayed tensor parallelism (``pending`` from ``start_delayed``): each device adds its own
    ``partial`` at once and the other devices' share of ``pending`` (the previous sublayer's
    partial, whose all-reduce was issued when it was made), and ``partial`` becomes the pending
    sum; the all-reduce of this sublayer's sum is then read only by the next sublayer's add.

    Under ``subspace=k`` the finished sum is projected onto the layout's k-dimensional subspace
    (``parallel/subspace``), so that a pipeline boundary carries k coordinates of the stream."""
    _check_rank(x, names)
    axes = residual.delayed_axes("residual_add")
    if pending is None:
        if axes:
            raise LayoutError("residual_add under delay=1 needs the pending partial sum: start the residual stream with "
                              "jaxpar.nn.start_delayed and carry what residual_add returns from sublayer to sublayer")
        added = reduce_partial(partial, contracted, names, project)
        active = _ACTIVE.get()
        k = active.layout.settings.get(SUBSPACE, 0) if active is not None else 0
        return x + (subspace_codec.project(added, k) if k else added), None
    return residual.add_late(x, partial if project is None else project(partial), pending, contracted, axes)


def finish_delayed(x, pending):
    """The residual stream after the last sublayer: ``x`` with the pending partial sum added (every
    device's copy then holds the same values)."""
    if pending is None:
        return x
    return residual.finish(x, pending, residual.delayed_axes("finish_delayed"))


def shard_offset(names: Names, dim: int, local_size: int):
    """Index of the first entry of this device's shard along logical dim ``names[dim]`` (0 on one device)."""
    layout = manual_layout("shard_offset")
    if layout is None:
        return 0
    index = 0
    for axis in layout.axes_of(names[dim]):
        index = index * layout.mesh.shape[axis] + jax.lax.axis_index(axis)
    return index * local_size


def shard_count(names: Names, dim: int) -> int:
    """Devices logical dim ``names[dim]`` is split over (1 on one device)."""
    layout = manual_layout("shard_count")
    return 1 if layout is None else math.prod(layout.mesh.shape[a] for a in layout.axes_of(names[dim]))


def sum_over(x, names: Names, dims: Sequence[int], op: str = "sum"):
    """Reduce ``x`` (``op`` = sum or max) over ``dims``, across devices too where those dims are sharded."""
    layout = manual_layout("sum_over")
    local = jnp.sum(x, axis=tuple(dims)) if op == "sum" else jnp.max(x, axis=tuple(dims))
    if layout is None:
        return local
    axes = tuple(a for d in dims for a in layout.axes_of(names[d]))
    if not axes:
        return local
    return jax.lax.psum(local, axes) if op == "sum" else jax.lax.pmax(local, axes)


# --- weights: gathered from their stored layout to the compute layout at use ----------------


def embed_lookup(table, tokens, out_names: Names, table_names: Names = ("vocab", "embed")):
    """Rows of ``table`` (an nnx Variable, or its value) for ``tokens``.

    With the vocabulary sharded each device looks up the ids in its own range and the partial
    results are summed (Megatron's vocab-parallel embedding). Given the Variable inside jaxpar's
    step where the stored table splits its ``embed`` dim (FSDP), the table is never gathered: each
    device looks up the ids of every device it is split with in its own columns, and one all-to-all
    hands each its own tokens' whole rows (the gradient comes back the same way and is summed into
    the stored shard, so no reduce-scatter of a gradient the table's size, nor a gathered table,
    is ever held)."""
    layout = manual_layout("embed_lookup")
    stored = stored_table(table) if layout is not None else None
    if stored is None:
        return _lookup(table[...] if hasattr(table, "get_raw_value") else table, tokens, out_names, table_names)
    shard, axes = stored
    ids = jax.lax.all_gather(vary_over(tokens, axes), axes, axis=0, tiled=True)
    # rows in the stored dtype, cast after the lookup: the scatter-add that is its backward sums
    # the group's gradients in float32 (only single tokens' rows travel in the compute dtype)
    rows = _rows(shard, ids, table_names).astype(_ACTIVE.get().compute_dtype)
    rows = jax.lax.all_to_all(rows, axes, 0, rows.ndim - 1, tiled=True)
    return reduce_partial(rows, (table_names[0],), out_names)


def _rows(table, tokens, table_names: Names):
    """This device's rows of ``table`` for ``tokens``, zero for ids outside its vocabulary range."""
    offset = shard_offset(table_names, 0, table.shape[0])
    local = tokens - offset
    inside = (local >= 0) & (local < table.shape[0])
    rows = jnp.take(table, jnp.clip(local, 0, table.shape[0] - 1), axis=0)
    return jnp.where(inside[..., None], rows, jnp.zeros((), rows.dtype))


def _lookup(table, tokens, out_names: Names, table_names: Names):
    return reduce_partial(_rows(table, tokens, table_names), (table_names[0],), out_names)


def cross_entropy(logits, targets, names: Names = ("batch", "length", "vocab"), weights=None):
    """Mean next-token cross-entropy in float32, exact when the vocabulary dim is sharded;
    ``weights`` (shaped like ``targets``) scale each token's loss first (0 leaves padding out)."""
    logits = logits.astype(jnp.float32)
    vocab_dim = logits.ndim - 1
    peak = sum_over(jax.lax.stop_gradient(logits), names, [vocab_dim], op="max")  # for stability only
    shifted = logits - peak[..., None]
    log_total = jnp.log(sum_over(jnp.exp(shifted), names, [vocab_dim]))
    offset = shard_offset(names, vocab_dim, logits.shape[vocab_dim])
    hit = jax.nn.one_hot(targets - offset, logits.shape[vocab_dim], dtype=logits.dtype)
    picked = sum_over(shifted * hit, names, [vocab_dim])
    losses = log_total - picked
    return jnp.mean(losses if weights is None else losses * weights)


# --- mixture of experts ------------------------------------------------------------------------


class RuleUpdated(nnx.Variable):
    """A weight the optimizer leaves alone: each training step subtracts its gradient from it as it
    is (no optimizer state, no weight decay, no clipping, outside the gradient norm). The model
    writes the weight's update rule into its loss as a term whose value is 0 and whose gradient is
    the step to take (``jaxpar.experts.bias_steering``), so every layout, path and accumulation
    computes the step as it computes any gradient."""


def mixture_of_experts(x, names: Names, router, w_gate, w_up, w_down, routing: experts.Routing, bias=None):
    """(output, the whole batch's ``experts.BalanceSums``) of a routed mixture of experts on tokens
    ``x`` (rows, length, embed) laid out as ``names`` (``jaxpar.experts``): ``router`` (embed,
    experts), the experts' stacked SwiGLU weights ``w_gate``, ``w_up`` (experts, embed, mlp) and
    ``w_down`` (experts, mlp, embed), ``bias`` (experts,) added to the scores for the choice only.

    The output holds partial sums over the layout's axes of ``mlp`` (expert-tensor parallelism), as
    a dense MLP's down projection does: finish it with ``residual_add(..., ("mlp",), ...)``. The
    sums are the same on every device: ``experts.balance_loss`` of them is the load-balancing loss,
    ``experts.bias_steering`` of their copies the routing bias's update."""
    _check_rank(x, names)
    layout = manual_layout("mixture_of_experts")
    if layout is None:
        return experts.mixture(x, router, w_gate, w_up, w_down, routing, bias)
    rows, length, width = x.shape
    weights, chosen, probs = experts.route(jnp.einsum("rle,ex->rlx", x, router), routing, bias)
    sums = _whole_batch(experts.balance_sums(chosen, probs, routing.experts), names, probs, layout)
    whole = length * shard_count(names, 1)
    kept = experts.keep_within_capacity(chosen, _ranks_in_row(chosen, names, routing, layout), routing, whole)
    flat, tokens = x.reshape(rows * length, width), rows * length
    axes = layout.axes_of("experts")
    if not axes:  # every expert on this device
        order, group_sizes = experts.dispatch(kept, routing.experts)
        outputs = experts.experts_mlp(jnp.take(flat, order // routing.top_k, axis=0), group_sizes, w_gate, w_up, w_down)
        out = experts.combine(outputs, order, weights.reshape(tokens, -1))
    else:
        slot = exchange.slot_rows(tokens, routing.top_k, w_gate.shape[0], rows, routing.capacity(whole))
        devices = math.prod(layout.mesh.shape[a] for a in axes)
        kernel = exchange.grouped_kernel(layout, devices * slot, width, w_gate.shape[-1])
        out = exchange.mixture(flat, kept.reshape(tokens, -1), weights.reshape(tokens, -1), w_gate, w_up, w_down,
                               routing.experts, axes, exchange.runs_ragged(layout), slot, kernel)
    return out.reshape(x.shape), sums


def _whole_batch(sums: experts.BalanceSums, names: Names, probs, layout: Layout) -> experts.BalanceSums:
    """The whole batch's balance sums from this device's: added up over the axes the tokens are
    split over and, in the same all-reduce, averaged over the axes that hold copies of the same
    tokens (tensor parallelism): the loss is then one value on every device, and each copy's
    gradient a share that the block entry's backward all-reduce adds back up."""
    token_axes = layout.axes_of(names[0]) + layout.axes_of(names[1])
    repeats = tuple(sorted(varying_axes(probs) - set(token_axes)))
    axes = token_axes + repeats
    if not axes:
        return sums
    share = math.prod(layout.mesh.shape[a] for a in repeats)
    return experts.BalanceSums(*(jax.lax.psum(s.astype(jnp.float32) / share, axes) for s in sums))


def _ranks_in_row(chosen, names: Names, routing: experts.Routing, layout: Layout):
    """``experts.ranks_in_row`` of this device's copies ``chosen`` (rows, length, top_k) among their
    whole rows' (None where dropless): where the layout splits the sequence, every device of the
    split adds its copies at their places in the row first (rows x length x experts int32)."""
    if routing.capacity_factor is None:
        return None
    length_axes = layout.axes_of(names[1])
    if not length_axes:
        return experts.ranks_in_row(chosen, routing.experts)
    rows, length, _ = chosen.shape
    whole = length * shard_count(names, 1)
    places = parallel.token_places(layout, whole)
    if places is None:
        raise LayoutError(f"a capacity factor drops copies by their place in the row, and this layout splits the rows "
                          f"over {', '.join(length_axes)} in a way that gives no places; route dropless (no capacity factor)")
    hits = jnp.sum(jax.nn.one_hot(chosen, routing.experts, dtype=jnp.int32), axis=2)
    row = jax.lax.psum(jnp.zeros((rows, whole, routing.experts), jnp.int32).at[:, places].set(hits), length_axes)
    before = jnp.take(jnp.cumsum(row, axis=1) - row, places, axis=1)
    return jnp.take_along_axis(before, chosen, axis=2)
