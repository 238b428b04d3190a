"""Logical rules and layouts, the active layout while a step is traced, and the framework's
weight gathers (the calls a model makes are in ``jaxpar/nn.py``).

A model names the dims of its weights and activations with *logical* axes (``batch``, ``embed``,
``mlp``...). A ``Layout`` is a mesh plus rules (logical axis -> mesh axes) in four mappings:

- ``compute``: how activations, and weights while in use, are laid out;
- ``param``: how weights are stored (FSDP/ZeRO-3 shards ``embed`` over ``fsdp`` here);
- ``optimizer``: how optimizer state is stored (ZeRO-1 and up shard it);
- ``grad``: how the gradient accumulation buffer is kept (ZeRO-2 and up shard it).

On jaxpar's manual path the training step runs the model inside one ``shard_map`` over every mesh
axis, so each collective is placed on purpose: a model never imports a mesh, it calls
``jaxpar.nn`` with logical names, and the active layout (``use_layout``) turns those calls into
collectives (or into nothing on one device); the step gathers the weights (``gather_params``,
``gather_layers_when_read``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.errors import LayoutError

Rules = Mapping[str, tuple[str, ...]]
Names = Sequence[str | None]

# Logical axes every jaxpar model may use, each with what it names.
LOGICAL_AXES = {
    "batch": "examples in a batch",
    "length": "positions inside attention and MLP blocks",
    "residual_length": "positions in the residual stream (norms, residual adds)",
    "embed": "model width",
    "mlp": "MLP hidden width",
    "heads": "query heads",
    "kv_heads": "key/value heads",
    "head_dim": "width of one head",
    "vocab": "vocabulary",
    "experts": "experts of a mixture-of-experts layer",
    "layers": "stacked layers (scanned)",
}

# a top-level weight whose first logical axis is this is a lookup table: the model reads rows of it
# by token id, which ``jaxpar.nn.embed_lookup`` does at the stored shard, with no gather
LOOKUP_AXIS = "vocab"
GATHERED = "gathered_params"  # checkpoint name of weights gathered for compute (FSDP policies use it)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh plus the four mappings; everything needed to turn logical names into shardings."""

    mesh: jax.sharding.Mesh
    compute: Rules
    param: Rules
    optimizer: Rules
    grad: Rules
    # FSDP: gather weights again in the backward pass instead of keeping them; None: auto, the
    # trainer chooses by memory (parallel/fsdp.py's choose_regather)
    regather: bool | None = False
    dcn_axes: tuple[str, ...] = ()  # mesh axes that cross the slow links between slices / nodes
    # logical axes kept whole (replicated) where a dim is shorter than its mesh axes and they are a
    # multiple of it: GQA's key/value heads under a tensor degree above their count (as Megatron does)
    replicable: frozenset[str] = frozenset()
    # each strategy's roles: the mesh axes its runtime reads off the layout ({role: axes}, from the
    # strategies' ``roles`` hook), e.g. the axes attention runs a context ring over
    roles: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    # each strategy's settings its runtime reads ({name: value}, the ``settings`` hook), e.g. subspace's k
    settings: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def effective_names(self, names: Names, shape) -> tuple:
        """``names`` with each replicable logical axis that its dim is too short to split replaced
        by None (that dim is then laid out whole in every mapping)."""
        out = []
        for dim, name in enumerate(names):
            ways = math.prod(self.mesh.shape[a] for a in self._live(self.compute.get(name, ()))) if name else 1
            short = name in self.replicable and shape[dim] < ways and ways % shape[dim] == 0
            out.append(None if short else name)
        return tuple(out)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """Mesh axes the batch is split over: gradients are summed over these."""
        return self._live(self.compute.get("batch", ()))

    @property
    def batch_shards(self) -> int:
        """Devices the batch is split over (each computes the mean loss of its own shard)."""
        return math.prod(self.mesh.shape[a] for a in self.batch_axes)

    def role(self, name: str) -> tuple[str, ...]:
        """The mesh axes (of more than one device) a strategy's runtime plays ``name`` over."""
        return self._live(self.roles.get(name, ()))

    @property
    def sequence_axes(self) -> tuple[str, ...]:
        """Mesh axes the positions of a sequence are split over (not its examples)."""
        return tuple(a for a in self.axes_of("length") if a not in self.batch_axes)

    @property
    def loss_axes(self) -> tuple[str, ...]:
        """Mesh axes the tokens of a batch are split over (its examples, and under context
        parallelism its positions): the loss and the gradients are summed over these."""
        return self.batch_axes + self.sequence_axes

    @property
    def loss_shards(self) -> int:
        """Devices the tokens are split over (each computes the mean loss of its own)."""
        return math.prod(self.mesh.shape[a] for a in self.loss_axes)

    def _live(self, axes: Sequence[str]) -> tuple[str, ...]:
        # Axes of degree 1 change nothing; leaving them out keeps specs and collectives clean.
        return tuple(a for a in axes if self.mesh.shape[a] > 1)

    def spec(self, names: Names | None, mapping: str = "compute", shape=None, what: str = "tensor") -> PartitionSpec:
        """PartitionSpec for dims with these logical names under one mapping, checked.

        Raises ``LayoutError`` for a logical name no rule knows, for two dims claiming one mesh
        axis, and (when ``shape`` is given) for a dim not divisible by its mesh axes.
        """
        rules: Rules = getattr(self, mapping)
        if names is None:
            return PartitionSpec()
        if shape is not None:
            names = self.effective_names(names, shape)
        for dim, name in enumerate(names):
            if name is not None and name not in rules:
                raise LayoutError(
                    f"{what}: logical axis {name!r} (dim {dim}) has no rule; known logical axes are "
                    f"{sorted(rules)}. Rename the dim or add a rule for {name!r}"
                )
        entries, owner = [], {}
        for dim, (name, axes) in enumerate(zip(names, self.dim_axes(names, mapping))):
            for axis in axes:
                if axis in owner:
                    raise LayoutError(
                        f"{what}: logical axes {owner[axis]!r} and {name!r} both map to mesh axis {axis!r} "
                        f"in the {mapping} rules; a mesh axis can shard only one dim of a tensor. "
                        f"Change one of the two rules"
                    )
                owner[axis] = name
            if shape is not None and axes:
                ways = math.prod(self.mesh.shape[axis] for axis in axes)
                if shape[dim] % ways:
                    raise LayoutError(
                        f"{what}: dim {dim} ({name!r}, size {shape[dim]}) is not divisible by mesh axes "
                        f"{axes} ({ways} ways) in the {mapping} mapping; change the degree of "
                        f"{'/'.join(axes)} or the size of {name!r}"
                    )
            entries.append(axes[0] if len(axes) == 1 else (axes or None))
        while entries and entries[-1] is None:
            entries.pop()  # P("fsdp", None) and P("fsdp") mean the same; keep the short form
        return PartitionSpec(*entries)

    def dim_axes(self, names: Names, mapping: str = "compute") -> tuple[tuple[str, ...], ...]:
        """Each dim's mesh axes (of more than one device) under ``mapping``, for a tensor of these
        logical names. A stored mapping (param, optimizer, grad) leaves out of a dim the axes the
        compute mapping splits another dim of the same tensor over: an expert weight, computed split
        over ``expert`` on its ``experts`` dim, is not stored split over it again on ``embed``,
        where the other weights are (``parallel/expert``)."""
        dims = tuple(self.axes_of(name, mapping) for name in names)
        if mapping == "compute":
            return dims
        computed_on = {a: dim for dim, name in enumerate(names) for a in self.axes_of(name)}
        return tuple(tuple(a for a in axes if computed_on.get(a, dim) == dim) for dim, axes in enumerate(dims))

    def sharding(self, names: Names | None, mapping: str = "compute", shape=None, what: str = "tensor") -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(names, mapping, shape, what))

    def axes_of(self, name: str | None, mapping: str = "compute") -> tuple[str, ...]:
        return () if name is None else self._live(getattr(self, mapping).get(name, ()))


# --- the active layout while a step is traced ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Active:
    layout: Layout
    manual: bool
    compute_dtype: jnp.dtype
    grad_reduce_dtype: jnp.dtype
    grad_sync: object = None  # compressed gradient sync of the step (see use_layout)
    grad_seed: object = None  # its dither seed this step (traced)


_ACTIVE: contextvars.ContextVar[_Active | None] = contextvars.ContextVar("jaxpar_layout", default=None)
# names of the model-facing calls a model made while ``record_model_calls`` is on (how the trainer
# tells a model written for jaxpar's manual step from one written for plain Flax)
_CALLS: contextvars.ContextVar[list | None] = contextvars.ContextVar("jaxpar_model_calls", default=None)


@contextlib.contextmanager
def record_model_calls():
    """Collect, into the list this yields, the name of every model-facing call made inside."""
    calls: list[str] = []
    token = _CALLS.set(calls)
    try:
        yield calls
    finally:
        _CALLS.reset(token)


def _called(name: str):
    calls = _CALLS.get()
    if calls is not None:
        calls.append(name)


@contextlib.contextmanager
def use_layout(
    layout: Layout | None, *, manual: bool = False, compute_dtype=jnp.float32, grad_reduce_dtype=jnp.float32,
    grad_sync=None, grad_seed=None,
):
    """Make ``layout`` the one the model-facing calls below obey (``manual``: inside shard_map).

    ``grad_sync`` (a ``train.grad_sync.GradSync``) with its traced ``grad_seed``: weight gathers
    reduce-scatter their gradient over its axes compressed (ZeRO-3 under a compressed sync)."""
    active = None
    if layout is not None:
        active = _Active(layout, manual, jnp.dtype(compute_dtype), jnp.dtype(grad_reduce_dtype), grad_sync, grad_seed)
    token = _ACTIVE.set(active)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def varying_axes(x) -> set[str]:
    """Manual mesh axes over which ``x`` differs from device to device (shard_map's type of x)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax >= 0.10 keeps it here
    return set(mat.varying if mat is not None else getattr(aval, "vma", ()))


def unfinished_axes(x, names, layout: Layout, exempt=()) -> list[str]:
    """The model-parallel mesh axes (those a logical axis other than the batch maps to, less
    ``exempt``) over which ``x``, laid out as ``names``, differs although none of its dims is split
    there: inside a manual step, the mark of a sum over a sharded logical axis nobody finished."""
    model_axes = {a for name in layout.compute if name != "batch" for a in layout.axes_of(name)} - set(exempt)
    split = {a for name in names for a in layout.axes_of(name)}
    return sorted((varying_axes(x) & model_axes) - split)


def vary_over(x, axes):
    """``x`` typed to differ over the manual mesh ``axes`` too (inside shard_map: a loop's carry,
    switch branches and values added together must agree in type; a backward pass then sums
    ``x``'s gradient once, where it is cast)."""
    missing = tuple(sorted(set(axes) - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def vary_everywhere(x, layout: Layout):
    """``x`` marked as differing over every mesh axis of ``layout`` (of degree above 1)."""
    return vary_over(x, [a for a in layout.mesh.axis_names if layout.mesh.shape[a] > 1])


def manual_layout(call: str) -> Layout | None:
    """Record a model's jaxpar ``call``; the active layout when inside jaxpar's manual step, else None."""
    _called(call)
    active = _ACTIVE.get()
    return active.layout if active is not None and active.manual else None


def logical_names(variable) -> tuple[str | None, ...] | None:
    """Logical names of an nnx Variable (from ``nnx.with_partitioning``), or None if it has none."""
    meta = variable.get_metadata()
    names = meta.get("out_sharding", meta.get("sharding_names", meta.get("sharding")))
    return None if names is None else tuple(names)


def stored_shape(names, shape) -> tuple[int, ...]:
    """The shape a weight of logical ``names`` and global ``shape`` has where the model runs: its
    stored shard inside jaxpar's manual step, the whole weight elsewhere."""
    active = _ACTIVE.get()
    if active is None or not active.manual:
        return tuple(shape)
    layout = active.layout
    spec = layout.spec(layout.effective_names(names, shape), "param")
    return tuple(jax.sharding.NamedSharding(layout.mesh, spec).shard_shape(tuple(shape)))


def gather_plan(names, layout: Layout) -> list[tuple[int, tuple[str, ...]]]:
    """(dim, mesh axes) a weight is all-gathered over, from its stored to its compute layout."""
    plan = []
    for dim, (stored, computed) in enumerate(zip(layout.dim_axes(names, "param"), layout.dim_axes(names))):
        extra = tuple(a for a in stored if a not in computed)
        if extra:
            plan.append((dim, extra))
    return plan


def _gather_weight(value, names, layout: Layout, dtype, reduce_dtype):
    """All-gather one weight's storage shards into its compute layout, cast to ``dtype``.

    The backward pass reduce-scatters the gradient in ``reduce_dtype`` (never silently bf16)."""
    plan = gather_plan(names, layout)
    stored_dtype = value.dtype

    @jax.custom_vjp
    def gather(x):
        y = x.astype(dtype)
        for dim, axes in plan:
            y = jax.lax.all_gather(y, axes, axis=dim, tiled=True)
        return y

    def gather_bwd(_, ct):
        g = ct.astype(reduce_dtype)
        for dim, axes in reversed(plan):
            g = jax.lax.psum_scatter(g, axes, scatter_dimension=dim, tiled=True)
        # the shard is made here: XLA:TPU lowers a reduce-scatter as an all-reduce whose use keeps
        # the slice, and fused into the optimizer's update at the step's end, that slice kept the
        # whole all-reduced gradient live (Mixtral-8x7B: the unembedding's 250 MiB, through every layer)
        return (jax.lax.optimization_barrier(g).astype(stored_dtype),)

    gather.defvjp(lambda x: (gather(x), None), gather_bwd)
    if not plan:
        return value.astype(dtype)
    return checkpoint_name(gather(value), GATHERED)


def _compressed_gather(values, names, plans, active: _Active) -> list:
    """All-gather several weights whose gathers run over the same axes (one plan shape) and that
    ``active.grad_sync`` compresses; the backward reduce-scatters their gradients as one bucket
    per gather stage (one compressed collective for all of a layer's weights, not one each).

    The step's dither seed is an argument of the custom_vjp: a tracer closed over by the backward
    pass could leak out of it."""
    sync, dtype = active.grad_sync, active.compute_dtype
    stages = [axes for _, axes in plans[0]]
    stored = [v.dtype for v in values]
    tag = ("gather", tuple(names), tuple(v.shape for v in values))  # names the reduction in its dither seed

    @jax.custom_vjp
    def gather(xs, seed):
        out = []
        for x, plan in zip(xs, plans):
            y = x.astype(dtype)
            for dim, axes in plan:
                y = jax.lax.all_gather(y, axes, axis=dim, tiled=True)
            out.append(y)
        return tuple(out)

    def gather_bwd(seed, cts):
        grads = list(cts)
        for stage in reversed(range(len(stages))):
            axes, dims = stages[stage], [plan[stage][0] for plan in plans]
            if sync.compresses(axes):
                grads = sync.reduce_scatter_bucket(list(zip(grads, dims)), axes, seed, tag + (stage,))
            else:
                grads = [jax.lax.psum_scatter(g.astype(jnp.float32), axes, scatter_dimension=d, tiled=True) for g, d in zip(grads, dims)]
        return tuple(g.astype(t) for g, t in zip(grads, stored)), None  # the seed is an integer: no cotangent

    gather.defvjp(lambda xs, seed: (gather(xs, seed), seed), gather_bwd)
    return [checkpoint_name(y, GATHERED) for y in gather(tuple(values), active.grad_seed)]


def _compute_names(var, value) -> tuple:
    names = logical_names(var) or (None,) * value.ndim
    if len(names) == value.ndim + 1 and "layers" in names:
        names = tuple(n for n in names if n != "layers")  # a slice of a stacked layer weight
    return names


def gathered(var):
    """One nnx weight as an array in its compute layout and dtype (gathered from its stored shards
    inside jaxpar's step; the unchanged value elsewhere). Stacked layer weights must be sliced
    first: their ``layers`` name is dropped once the dim is gone."""
    _called("gathered")
    value = var.get_value()
    return _gather_value(value, _compute_names(var, value))


def _gather_value(value, names):
    active = _ACTIVE.get()
    if active is None or not jnp.issubdtype(value.dtype, jnp.floating):
        return value
    if not active.manual:  # XLA gathers: say where the value must be laid out as computed
        return jax.lax.with_sharding_constraint(value.astype(active.compute_dtype), active.layout.sharding(names, shape=value.shape))
    if active.grad_sync is not None:
        plan = gather_plan(names, active.layout)
        if any(active.grad_sync.compresses(axes) for _, axes in plan):
            return _local_replica(_compressed_gather([value], [names], [plan], active)[0], names, active.layout)
    return _local_replica(_gather_weight(value, names, active.layout, active.compute_dtype, active.grad_reduce_dtype),
                          names, active.layout)


def _local_replica(value, names, layout: Layout):
    """``value`` with each replicable dim that the layout keeps whole (``Layout.replicable``: it is
    shorter than its mesh axes) cut to the one entry this device's share of the matching split dim
    reads: with more tensor shards T than key/value heads K, the query heads of device t all read
    key/value head t*K//T. So a model that takes its head counts from its kernels sees a consistent
    local grouped attention; the backward pass sums each head's gradient over the devices reading it."""
    for dim, name in enumerate(names):
        axes = layout.axes_of(name) if name in layout.replicable else ()
        if not axes or any(a in varying_axes(value) for a in axes) or layout.axes_of("heads") != axes:
            continue  # not replicable, split like any other dim, or the query heads are not split alike
        ways, size = math.prod(layout.mesh.shape[a] for a in axes), value.shape[dim]
        index = 0
        for axis in axes:
            index = index * layout.mesh.shape[axis] + jax.lax.axis_index(axis)
        value = jax.lax.dynamic_slice_in_dim(value, index * size // ways, 1, axis=dim)
    return value


def _read_table(var, value):
    return _gather_value(value, _compute_names(var, value))


def stored_table(table):
    """``(stored shard, mesh axes)`` of a lookup table (an nnx Variable) inside jaxpar's manual
    step where its stored layout splits only its ``embed`` dim, over those mesh axes; None where
    the table is to be read whole (one device, XLA's partitioner, an array, no such split)."""
    if getattr(table, "get_metadata", None) is None or table.get_metadata().get("on_get_value") is not _read_table:
        return None
    value = table.get_raw_value()
    plan = gather_plan(_compute_names(table, value), _ACTIVE.get().layout)
    if [dim for dim, _ in plan] != [value.ndim - 1]:
        return None
    return value, plan[0][1]


def gather_layers_when_read(state):
    """The framework's per-layer gathers: every read of one layer's slice of a stacked weight
    (logical axis ``layers``) in ``state`` returns it gathered into its compute layout, so a
    model's own layer loop (``jax.lax.scan``, ``nnx.scan``) gathers one layer at a time, with no
    call of the model's. (Under a compressed sync each weight's reduction is then its own bucket.)"""
    from flax import nnx

    active = _ACTIVE.get()
    for _, var in nnx.to_flat_state(state):
        names = logical_names(var) or ()
        if "layers" in names and len(names) == var.get_value().ndim:
            if _narrow_stack(var.get_raw_value(), names, active):
                # the whole stack cast once, before the loop: each layer's gradient then comes back
                # in the reduction dtype (what its reduce-scatter made) and the loop stacks it so,
                # not in float32, which would double what the end of the backward pass holds
                var.set_raw_value(var.get_raw_value().astype(active.compute_dtype))
            # the names are taken now: inside nnx.scan the slice's own metadata has lost "layers"
            var.set_metadata("on_get_value", functools.partial(_read_layer, names=names))


def _narrow_stack(value, names, active) -> bool:
    """Whether a stacked weight may be cast to the compute dtype before the layer loop: inside the
    manual step, gathered per layer, with gradients reduced in that same narrower dtype (so the
    cast's backward widens only what was reduced in it already; a compressed sync keeps its own)."""
    return (active is not None and active.manual and active.grad_sync is None
            and active.grad_reduce_dtype == active.compute_dtype
            and jnp.issubdtype(value.dtype, jnp.floating) and active.compute_dtype.itemsize < value.dtype.itemsize
            and bool(gather_plan(tuple(n for n in names if n != "layers"), active.layout)))


def _read_layer(var, value, names):
    if value.ndim == len(names):  # the whole stack, read as it is stored
        return value
    return _gather_value(value, tuple(n for n in names if n != "layers"))


def gather_params(state):
    """Weights of an nnx State, gathered for compute and cast to the compute dtype.

    jaxpar's step calls this on a model's whole state before running it. Stacked layer weights
    (logical axis ``layers`` still present) are left alone: a model gathers them one layer at a
    time inside its layer scan, by calling this on the layer's slice. Under a compressed gradient
    sync, the weights whose gradients it reduce-scatters compressed are gathered together, so that
    the backward pass reduces them in one bucket. Lookup tables (first logical axis ``vocab``) are
    gathered only when read: ``jaxpar.nn.embed_lookup`` reads rows of their stored shards.
    """
    from flax import nnx

    _called("gather_params")
    active = _ACTIVE.get()

    def stacked(var):
        names = logical_names(var) or ()
        return "layers" in names and len(names) == var.get_value().ndim  # gathered per layer in the scan

    def gather_one(var):
        if stacked(var):
            return var
        if active is not None and active.manual and (logical_names(var) or (None,))[0] == LOOKUP_AXIS:
            # a table the model reads rows of by id: ``jaxpar.nn.embed_lookup`` reads its stored
            # shard with no gather; any other read of it gathers it then (a tied output layer)
            return var.replace(on_get_value=_read_table)
        return var.replace(value=gathered(var))

    is_var = lambda v: isinstance(v, nnx.Variable)  # noqa: E731
    if active is None or not active.manual or active.grad_sync is None:
        return jax.tree.map(gather_one, state, is_leaf=is_var)
    leaves, treedef = jax.tree.flatten(state, is_leaf=is_var)
    out, buckets = list(leaves), {}
    for i, var in enumerate(leaves):
        if not is_var(var) or stacked(var):
            continue
        value = var.get_value()
        names = _compute_names(var, value)
        plan = gather_plan(names, active.layout)
        if jnp.issubdtype(value.dtype, jnp.floating) and any(active.grad_sync.compresses(axes) for _, axes in plan):
            # one bucket per gather and per type: a bucket's sum varies over every axis one of its
            # weights varies over (under TP, norm scales do not vary over tensor, the rest do)
            key = (tuple(axes for _, axes in plan), frozenset(varying_axes(value)))
            buckets.setdefault(key, []).append((i, value, names, plan))
        else:
            out[i] = gather_one(var)
    for members in buckets.values():
        values = _compressed_gather([m[1] for m in members], [m[2] for m in members], [m[3] for m in members], active)
        for (i, *_), value in zip(members, values):
            out[i] = leaves[i].replace(value=value)
    return jax.tree.unflatten(treedef, out)
