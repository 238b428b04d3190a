"""Federated training over ``federation=G`` (``parallel/federation``): G copies of the model, one per
group of devices, each trained by its own ``Trainer`` under the rest of the strategy, merged every
``local_steps`` steps.

Between merges nothing crosses ``federation``: a group's step is compiled for the group's own
devices (the global mesh's slice at its index), so each group's program can hold no collective
over the other groups' devices. A merge is one program over the whole mesh: each group's arrays
are stacked along a new leading dim split over ``federation`` (each shard reshaped where it lives:
nothing moves between devices); for the mean over that dim each device all-reduces over
``federation`` its part of its shard (the whole shard, or under FL+HSDP the 1/r of it that it
takes among the r devices of its group holding the same shard, gathered inside the group after),
and each group gets its slice of the result back, again without a copy between devices. The model as of the last merge (the
anchor) and the outer optimizer's momentum live in every group, identical, so the outer step is
computed where each shard lives and adds no traffic.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.traverse_util import flatten_dict as flatten
from flax.traverse_util import unflatten_dict as nest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar.collectives import compressed
from jaxpar.errors import LayoutError
from jaxpar.parallel import Strategy, build_layout, federation, parse_strategy
from jaxpar.rules import Layout
from jaxpar.train import grad_sync
from jaxpar.train.config import TrainConfig
from jaxpar.train.state import TrainState
from jaxpar.train.step import Trainer


class GroupState(NamedTuple):
    """One group's copy: its TrainState, the model as of the last merge (the anchor: what a merge
    measures each copy's change from, and what the outer optimizer steps) and (outer sgd or
    nesterov) the outer optimizer's state."""

    train: TrainState
    anchor: Any
    outer: Any = None


def inner_strategy(strategy: Strategy) -> str:
    """The strategy each group runs: ``strategy`` without ``federation`` and its options."""
    degrees = [f"{axis}={degree}" for axis, degree in strategy.written_degrees.items() if axis != "federation" and degree > 1]
    options = [f"{key}={text}" for key, text in strategy.given.items() if key not in federation.OPTIONS]
    return ",".join(degrees + options)


def outer_optimizer(options: dict) -> optax.GradientTransformation | None:
    """The outer optimizer of ``options["outer"]`` (None for plain averaging)."""
    if options["outer"] == "avg":
        return None
    momentum = options["outer_momentum"] or None
    return optax.sgd(options["outer_lr"], momentum=momentum, nesterov=options["outer"] == "nesterov" and momentum is not None)


class FederatedTrainer:
    """G ``Trainer``s, one per group of ``layout``'s ``federation`` axis, and their merges.

    ``strategy``: the parsed strategy ``layout`` was built from (its federation options: local
    steps, outer optimizer); the rest as for ``Trainer``. Each group reads ``batch_size / G``
    rows of every global batch: group g rows [g b, (g + 1) b). ``cfg.grad_sync`` (dynamiq, int8)
    compresses the merges (``merge_sync``), the reductions that cross the groups; a group's own
    reductions stay exact unless ``cfg.grad_sync_axes`` names their axes."""

    def __init__(self, layout: Layout, strategy: Strategy, model_fn, loss_fn, cfg: TrainConfig = TrainConfig(), optimizer=None):
        self.layout, self.options = layout, strategy.options
        self.size = layout.mesh.shape["federation"]
        inner = parse_strategy(inner_strategy(strategy), layout.mesh.size // self.size)
        self.merge_sync, group_cfg = _split_sync(cfg, layout)
        self.groups = [Trainer(_group_layout(layout, inner, g), model_fn, loss_fn, group_cfg, optimizer) for g in range(self.size)]
        self.outer = outer_optimizer(self.options)
        self.fragments, self.delay = self.options["fragments"], self.options["merge_delay"]
        self.layers = check_fragments(self.groups[0], self.fragments, self.local_steps)
        self._merges: dict[tuple, Any] = {}

    @property
    def local_steps(self) -> int:
        return self.options["local_steps"]

    def init(self, seed: int = 0) -> list[GroupState]:
        """Every group's copy from the same seed (the same values), and its anchor and outer state."""
        return self.start_from([group.init(seed) for group in self.groups])

    def start_from(self, trains: list[TrainState]) -> list[GroupState]:
        """Each group's state from its ``TrainState`` (the same weights in every group: from one
        seed, or one checkpoint's), with the anchor a copy of them and a fresh outer state."""
        states = []
        for train in trains:
            anchor = jax.tree.map(jnp.copy, train.params)
            states.append(GroupState(train, anchor, self.outer.init(anchor) if self.outer else None))
        return states

    def put_process_batch(self, batch_size: int, rows) -> list:
        """Each group's rows of a global batch of ``batch_size`` (``rows(start, stop)`` on the host,
        as ``Trainer.put_process_batch`` takes it)."""
        if batch_size % self.size:
            raise LayoutError(f"batch of {batch_size} rows does not split over federation={self.size} groups; "
                              f"use a multiple of {self.size}")
        share = batch_size // self.size
        return [group.put_process_batch(share, lambda a, b, g=g: rows(g * share + a, g * share + b))
                for g, group in enumerate(self.groups)]

    def step(self, states: list[GroupState], batches: list) -> tuple[list[GroupState], dict]:
        """One step of every group on its batch (dispatched together: they run at once on their
        devices), then the merge when ``local_steps`` steps have passed since the last. Metrics:
        the mean loss over the groups (the global batch's), each group's, and at a merge each
        group's drift (the norm of its change since the last merge)."""
        outs = [group.step(state.train, batch) for group, state, batch in zip(self.groups, states, batches)]
        states = [state._replace(train=train) for state, (train, _) in zip(states, outs)]
        losses = [float(metrics["loss"]) for _, metrics in outs]
        metrics = {"loss": float(np.mean(losses)), "group_losses": losses, "drift": None, "fragment": None}
        step = int(states[0].train.step)
        if self.delay and step > self.delay and self.fragment_due(step - self.delay) is not None:
            states = self.mix(states, self.fragment_due(step - self.delay))
        due = self.fragment_due(step)
        if due is not None:
            states, metrics["drift"] = self.merge(states, due, seed=step, apply=not self.delay)
            metrics["fragment"] = due
        return states, metrics

    def merge_bytes(self) -> float:
        """Bytes each device sends across the groups per merge of the whole model, uncompressed:
        2 p (G - 1) / G for its part p of the weights (its shard, split over the devices of its
        group that hold the same shard): 2 (Psi / n) (G - 1) / G for groups of n devices."""
        mesh = self.layout.mesh
        part = sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
                   / math.prod(mesh.shape[a] for a in _replicas(mesh, leaf.sharding.spec))
                   for leaf in jax.tree.leaves(self.groups[0].abstract_state().params))
        return 2.0 * part * (self.size - 1) / self.size

    def fragment_due(self, step: int) -> int | None:
        """The fragment that merges after ``step`` steps, if any: fragment f every ``local_steps``
        steps at offset (f + 1) H / F, so the F fragments' merges are spread evenly over the H steps."""
        return fragment_due(step, self.local_steps, self.fragments)

    def merge(self, states: list[GroupState], fragment: int = 0, seed: int = 0,
              apply: bool = True) -> tuple[list[GroupState], list[float]]:
        """(the groups' copies of ``fragment`` merged: averaged, or stepped by the outer optimizer,
        shard by shard; each group's drift, the norm of its fragment's change since its last merge).
        ``seed``: the compressed merge's dither (the step: a new one at every merge). ``apply=False``
        (a delayed merge) leaves the copies as they are: the merged fragment is the new anchor's,
        which ``mix`` brings in later."""
        stacked = _stack(self.layout.mesh, [_mergeable(state, self.options) for state in states])
        if (fragment, apply) not in self._merges:  # each group's slice stays on its devices
            self._merges[fragment, apply] = jax.jit(self.merge_fn(fragment, apply), donate_argnums=0,
                                                    out_shardings=(jax.tree.map(lambda x: x.sharding, stacked), None))
        merged, drift = self._merges[fragment, apply](stacked, np.uint32(seed))
        return ([_merged_state(state, new, self.options) for state, new in zip(states, _unstack(self.groups, merged))],
                [float(d) for d in np.asarray(drift)])

    def merge_all(self, states: list[GroupState], but: int | None = None) -> tuple[list[GroupState], list[float]]:
        """Every fragment merged but ``but`` (one that just was): one model in every group; the
        drift over them all. With ``merge_delay``, a fragment merged in the last steps, its result
        not in the copies yet, is brought in whole instead."""
        squares, step = np.zeros(self.size), int(states[0].train.step)
        pending = {self.fragment_due(s) for s in range(max(step - self.delay + 1, 1), step + 1)} if self.delay else set()
        for fragment in range(self.fragments):
            if fragment in pending:
                states = self.mix(states, fragment, keep=0.0)
                continue
            if fragment == but:
                continue
            states, drift = self.merge(states, fragment, seed=step)
            squares += np.square(drift)
        return states, [float(d) for d in np.sqrt(squares)]

    def mix(self, states: list[GroupState], fragment: int, keep: float | None = None) -> list[GroupState]:
        """A delayed merge of ``fragment`` brought into each copy: its part becomes ``keep``
        (default ``merge_mix``) of itself plus the rest of the anchor's (the merged fragment). No
        communication."""
        mesh = self.layout.mesh
        params = _stack(mesh, [state.train.params for state in states])
        keep = self.options["merge_mix"] if keep is None else keep
        if ("mix", fragment, keep) not in self._merges:
            cuts, puts = fragment_views(self.groups[0], self.fragments, self.layers, fragment)

            def mix(params, anchor):
                return put(params, mixed(cut(params, cuts), cut(anchor, cuts), keep), puts)

            self._merges["mix", fragment, keep] = jax.jit(mix, donate_argnums=0,
                                                          out_shardings=jax.tree.map(lambda x: x.sharding, params))
        brought_in = self._merges["mix", fragment, keep](params, _stack(mesh, [state.anchor for state in states]))
        return [state._replace(train=state.train._replace(params=part)) for state, part in zip(states, _unstack(self.groups, brought_in))]

    def stacked(self, states: list[GroupState]) -> dict:
        """The groups' states as one tree on the global mesh (each leaf's copies stacked along a
        leading dim split over ``federation``): what a checkpoint holds."""
        return _stack(self.layout.mesh, [state._asdict() for state in states])

    def unstacked(self, tree: dict) -> list[GroupState]:
        """``stacked``'s inverse (a restored checkpoint back into each group's devices)."""
        parts = _unstack(self.groups, tree)
        return [GroupState(TrainState(*part["train"]), part["anchor"], part["outer"]) for part in parts]

    def abstract_stacked(self) -> dict:
        """``stacked``'s shapes and shardings, from the model alone (nothing allocated): what a
        checkpoint is restored into."""
        train = self.groups[0].abstract_state()
        outer = None
        if self.outer is not None:  # the outer state's param-shaped leaves laid out as the weights
            shapes = jax.eval_shape(self.outer.init, train.params)
            outer = optax.tree_map_params(self.outer, lambda _, p: p, shapes, train.params)
        group = GroupState(train, train.params, outer)._asdict()

        def stack(leaf):
            sharding = NamedSharding(self.layout.mesh, PartitionSpec("federation", *leaf.sharding.spec))
            return jax.ShapeDtypeStruct((self.size, *leaf.shape), leaf.dtype, sharding=sharding)

        return jax.tree.map(stack, group)

    def merge_fn(self, fragment: int = 0, apply: bool = True):
        """The merge of ``fragment`` on stacked arrays (a leading dim of G, one entry per group): a
        pure function of ({"params", "anchor", "outer", "opt"}, a uint32 dither seed) -> (the same,
        that fragment merged, each group's drift) whose only communication is the mean of the
        fragment over that dim (and G floats of drift). A fragment is its share of the stacked
        layers (fragment 0 also holds the weights outside them); the rest of every array is left
        as it is. Compressed (``merge_sync``), the mean is of each copy's change, through the
        compressed all-reduce: the same bits in every group."""
        outer, merge_opt, sync, mesh = self.outer, self.options["merge_opt_state"], self.merge_sync, self.layout.mesh
        cuts, puts = fragment_views(self.groups[0], self.fragments, self.layers, fragment)
        specs = _stacked_specs(self.groups[0])  # (a fragment cuts the layers dim, which no spec splits)

        def mean(tree):
            return jax.tree.map(lambda x: jnp.broadcast_to(jnp.mean(x, axis=0, keepdims=True), x.shape)
                                if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

        def merge(stacked: dict, seed):
            out = dict(stacked)
            params, anchor = cut(stacked["params"], cuts), cut(stacked["anchor"], cuts)
            change = jax.tree.map(lambda a, p: a - p, anchor, params)
            drift = jnp.sqrt(sum(jnp.sum(jnp.square(c), axis=tuple(range(1, c.ndim))) for c in jax.tree.leaves(change)))
            if outer is None and sync is None:
                anchor = _shard_mean(None, mesh, specs, params, seed)  # the copies' mean
            else:  # the mean pseudo-gradient: the anchor minus the mean copy
                delta = _shard_mean(sync, mesh, specs, change, seed)
                if outer is None:
                    anchor = jax.tree.map(lambda a, d: a - d, anchor, delta)
                else:
                    cut_state, put_state = state_views(outer, stacked["outer"], cuts, puts)
                    updates, moved = outer.update(delta, cut_state, anchor)
                    out["outer"], anchor = put_state(moved), optax.apply_updates(anchor, updates)
            out["anchor"] = put(stacked["anchor"], anchor, puts)
            if apply:
                out["params"] = put(stacked["params"], anchor, puts)
            if merge_opt:
                out["opt"] = mean(stacked["opt"])
            return out, drift

        return merge


def _split_sync(cfg: TrainConfig, layout: Layout) -> tuple[grad_sync.GradSync | None, TrainConfig]:
    """(the merges' compressed sync, or None; the groups' config): ``cfg.grad_sync`` applies to
    the merges when ``cfg.grad_sync_axes`` is unset (federation crosses the slow links) or names
    ``federation``, and to a group's own reductions over the other axes it names."""
    sync = grad_sync.resolve(cfg, layout)
    if sync is None:
        return None, cfg
    axes = ("federation",) if cfg.grad_sync_axes is None else sync.axes
    inside = tuple(a for a in axes if a != "federation")
    group_cfg = (dataclasses.replace(cfg, grad_sync_axes=inside) if inside else
                 dataclasses.replace(cfg, grad_sync="exact", grad_sync_bits=None, grad_sync_axes=None))
    return (dataclasses.replace(sync, axes=("federation",)) if "federation" in axes else None), group_cfg


def _stacked_specs(group: Trainer):
    """Each weight's PartitionSpec stacked over ``federation`` (a tree shaped like the params)."""
    return jax.tree.map(lambda leaf: PartitionSpec("federation", *leaf.sharding.spec), group.abstract_state().params)


def _replicas(mesh: Mesh, spec: PartitionSpec) -> tuple[str, ...]:
    """The axes of a group over which a leaf laid out by ``spec`` is replicated (HSDP's data)."""
    named = {a for part in spec if part is not None for a in ((part,) if isinstance(part, str) else part)}
    return tuple(a for a in mesh.axis_names if a != "federation" and mesh.shape[a] > 1 and a not in named)


def _shard_mean(sync: grad_sync.GradSync | None, mesh: Mesh, specs, tree, seed):
    """The mean over the leading (group) dim of ``tree``'s stacked leaves. Where r devices of a
    group hold the same shard (HSDP's ``data`` replicas), each reduces over ``federation`` only its
    1/r part of it and the parts are then gathered inside the group, so that 2 (Psi / n) (G - 1) / G
    bytes cross the groups for groups of n devices; the leaves replicated alike go as one message,
    through ``sync``'s compressed all-reduce when given (the same bits in every group)."""
    leaves, treedef = jax.tree.flatten(tree)
    leaf_specs = tuple(treedef.flatten_up_to(specs))
    spreads = [_replicas(mesh, spec) for spec in leaf_specs]
    groups = mesh.shape["federation"]

    def reduce(part, seed):
        if sync is None:
            return jax.lax.psum(part, "federation")
        return compressed.all_reduce(part, "federation", scheme=sync.scheme, bits=sync.bits, seed=seed,
                                     min_size=sync.min_size, impl=sync.impl)

    def local(seed, *blocks):
        out = list(blocks)
        for spread in dict.fromkeys(spreads):
            mine = [i for i, s in enumerate(spreads) if s == spread]
            flat = grad_sync.pack([blocks[i] for i in mine])
            ranks = math.prod(mesh.shape[a] for a in spread)
            parts = jnp.pad(flat, (0, -flat.size % ranks)).reshape(ranks, -1)
            part = parts[jax.lax.axis_index(spread)] if spread else parts[0]
            total = reduce(part, seed) / groups
            whole = jax.lax.all_gather(total, spread, axis=0, tiled=True) if spread else total
            for i, piece in zip(mine, grad_sync.unpack(whole, [blocks[i].shape for i in mine])):
                out[i] = piece.astype(blocks[i].dtype)
        return tuple(out)

    means = jax.shard_map(local, mesh=mesh, in_specs=(PartitionSpec(), *leaf_specs), out_specs=leaf_specs,
                          check_vma=False)(seed, *leaves)
    return treedef.unflatten(means)


def fragment_due(step: int, local_steps: int, fragments: int) -> int | None:
    """The fragment that merges after ``step`` steps, if any (``FederatedTrainer.fragment_due``)."""
    h, f = local_steps, fragments
    return next((k for k in range(f) if step % h == (k + 1) * h // f % h), None)


def check_fragments(group: Trainer, fragments: int, local_steps: int) -> int:
    """The model's stacked layers (0 where it stacks none), refusing fragments that do not divide
    them or the local steps."""
    layers = {shape[0] for path, shape in _shapes(group).items() if group.names[path][:1] == ("layers",)}
    count = layers.pop() if len(layers) == 1 else 0
    if fragments == 1:
        return count
    if not count:
        raise LayoutError(f"fragments={fragments} merges the stacked layers a share at a time, and this model stacks none "
                          f"(no weight whose first logical axis is 'layers'); use fragments=1")
    if count % fragments or local_steps % fragments:
        raise LayoutError(f"fragments={fragments} must divide the model's {count} layers and local_steps={local_steps}; "
                          f"give a divisor of both")
    return count


def _shapes(group: Trainer) -> dict:
    return {path: tuple(leaf.shape) for path, leaf in flatten(group.abstract_state().params).items()}


def fragment_views(group: Trainer, fragments: int, layers: int, fragment: int, stacked: bool = True):
    """(cuts, puts): trees shaped like the params, of each leaf's view of ``fragment`` (on trees
    stacked over the groups, or on one copy's with ``stacked=False``): ``cut(x)`` its part (layers
    [a, b) of a leaf stacked over ``layers``; the whole of another in fragment 0, none of it in the
    others) and ``put(x, part)`` the leaf with that part replaced."""
    a, b = fragment * layers // fragments, (fragment + 1) * layers // fragments
    layer_rows = (slice(None),) * stacked + (slice(a, b),)
    nothing = (slice(None),) * stacked + (slice(0, 0),)

    def views(path):
        if fragments > 1 and group.names[path][:1] == ("layers",):
            return (lambda x: x[layer_rows]), (lambda full, part: full.at[layer_rows].set(part))
        if fragment == 0:
            return (lambda x: x), (lambda full, part: part)
        return (lambda x: x[nothing]), (lambda full, part: full)

    table = {path: views(path) for path in _shapes(group)}
    return nest({p: view for p, (view, _) in table.items()}), nest({p: view for p, (_, view) in table.items()})


def mixed(copy, merged, keep: float):
    """A delayed merge's result brought into a copy: ``keep`` of the copy plus the rest of the
    merged tree (Streaming DiLoCo's mix)."""
    return jax.tree.map(lambda p, a: keep * p + (1 - keep) * a, copy, merged)


def cut(tree, cuts):
    """Each leaf's part (``fragment_views``'s cuts)."""
    return jax.tree.map(lambda x, view: view(x), tree, cuts)


def put(tree, part, puts):
    """``tree`` with each leaf's part replaced by ``part``'s (``fragment_views``'s puts)."""
    return jax.tree.map(lambda x, piece, view: view(x, piece), tree, part, puts)


def state_views(outer: optax.GradientTransformation, state, cuts, puts):
    """(the outer optimizer's ``state`` cut to a fragment, ``put_state(moved)``: the whole state
    with the fragment's part replaced by ``moved``'s): each copy of the params tree in it goes
    through the views; its other fields are ``moved``'s."""
    cut_state = optax.tree_map_params(outer, lambda x, cut: cut(x), state, cuts)
    writers = optax.tree_map_params(outer, lambda _, put: put, state, puts, transform_non_params=lambda _: _moved)
    return cut_state, lambda moved: jax.tree.map(lambda full, part, put: put(full, part), state, moved, writers)


def _moved(full, part):
    return part


def _group_layout(layout: Layout, inner: Strategy, g: int) -> Layout:
    """Group ``g``'s layout: ``inner``'s rules on the global mesh's slice at federation index g
    (the same devices in the same places, so a group's shards are the stacked arrays' shards)."""
    index = layout.mesh.axis_names.index("federation")
    devices = np.take(layout.mesh.devices, [g], axis=index)
    built = build_layout(inner, list(devices.flat))
    return dataclasses.replace(built, mesh=Mesh(devices, layout.mesh.axis_names, axis_types=layout.mesh.axis_types))


def _mergeable(state: GroupState, options: dict) -> dict:
    """What a merge reads of a group's state."""
    out = {"params": state.train.params, "anchor": state.anchor}
    if state.outer is not None:
        out["outer"] = state.outer
    if options["merge_opt_state"]:
        out["opt"] = state.train.opt_state
    return out


def _merged_state(state: GroupState, new: dict, options: dict) -> GroupState:
    train = state.train._replace(params=new["params"], opt_state=new["opt"] if options["merge_opt_state"] else state.train.opt_state)
    return GroupState(train, new["anchor"], new.get("outer"))


def _stack(mesh: Mesh, trees: list) -> Any:
    """The groups' trees as one, each leaf with a leading dim of G split over ``federation``, made
    of the groups' own device buffers (a group's leaf of shape s is its slice (1, *s))."""
    def stack(*leaves):
        spec = leaves[0].sharding.spec
        shards = [shard.data[None] for leaf in leaves for shard in leaf.addressable_shards]
        sharding = NamedSharding(mesh, PartitionSpec("federation", *spec))
        return jax.make_array_from_single_device_arrays((len(leaves), *leaves[0].shape), sharding, shards)

    return jax.tree.map(stack, *trees)


def _unstack(groups: list[Trainer], tree) -> list:
    """``_stack``'s inverse: each group's slice of every leaf, on the group's devices."""
    def part(g: int, leaf):
        mesh = groups[g].layout.mesh
        devices = set(mesh.devices.flat)
        shards = [shard.data[0] for shard in leaf.addressable_shards if shard.device in devices]
        spec = PartitionSpec(*leaf.sharding.spec[1:])
        return jax.make_array_from_single_device_arrays(leaf.shape[1:], NamedSharding(mesh, spec), shards)

    return [jax.tree.map(lambda leaf, g=g: part(g, leaf), tree) for g in range(len(groups))]
