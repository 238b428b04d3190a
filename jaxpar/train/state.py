"""The training state, and what a layout makes of a model's weights before any of them exists.

``ShardedState`` reads the abstract model (shapes and logical names, no memory), checks every
weight against every mapping of the layout, and derives from the names alone the specs and
shardings of the weights, the optimizer state and the gradient; its compiled initialisers then
write each array straight into its layout. So a model the layout cannot hold is refused before any
device memory is touched, and the same seed gives the same values on any layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.traverse_util import unflatten_dict as nest
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.errors import LayoutError
from jaxpar.nn import RuleUpdated
from jaxpar.rules import Layout, logical_names

if TYPE_CHECKING:
    from jaxpar.train.config import TrainConfig


class TrainState(NamedTuple):
    params: Any  # pure dict of arrays, shaped like the model's nnx.State
    opt_state: Any  # (None under PipeDream: each stage's optimizer state is in ``stream``)
    step: jax.Array
    stream: Any = None  # PipeDream's pipeline between steps (``train/pipedream.py``); None otherwise


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
    """The learning rate by step: linear warm-up, then cosine decay to 10%."""
    return optax.warmup_cosine_decay_schedule(
        0.0, cfg.learning_rate, max(cfg.warmup_steps, 1), max(cfg.total_steps, cfg.warmup_steps + 1), cfg.learning_rate * 0.1
    )


def make_optimizer(cfg: TrainConfig, updates_per_step: int = 1) -> optax.GradientTransformation:
    """AdamW at ``learning_rate_schedule``, read in steps of ``updates_per_step`` updates
    (PipeDream updates a stage once per micro-batch). (Clipping by the global gradient norm,
    ``cfg.clip_norm``, is done by the step itself, where the gradient shards are reduced.)"""
    rate = learning_rate_schedule(cfg)
    if updates_per_step > 1:
        rate = lambda count, rate=rate: rate(count // updates_per_step)  # noqa: E731
    return optax.adamw(rate, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay)


def bytes_per_device(tree) -> int:
    """Bytes one device holds of the arrays (or sharded ShapeDtypeStructs) of ``tree``, scalars
    (optax's step counters) left out."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree) if x.ndim)


def abstract_model(model_fn: Callable[[nnx.Rngs], nnx.Module]):
    """(graphdef, abstract nnx.State) of the model: shapes and logical names, no memory."""
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: model_fn(nnx.Rngs(0)))
    return nnx.split(model)


def variables(state) -> dict:
    """Pure dict path -> Variable, for walking weights with their names."""
    return {path: var for path, var in nnx.to_flat_state(state)}


def rule_updated_paths(abstract) -> frozenset:
    """The paths of the weights the optimizer leaves alone (``nn.RuleUpdated``)."""
    return frozenset(path for path, var in variables(abstract).items() if isinstance(var, RuleUpdated))


def leave_to_rules(optimizer: optax.GradientTransformation, abstract) -> optax.GradientTransformation:
    """``optimizer`` for every weight but the ``nn.RuleUpdated`` ones, which step by minus their
    gradient and hold no optimizer state (``optimizer`` itself where the model has none)."""
    rules = rule_updated_paths(abstract)
    if not rules:
        return optimizer
    labels = nest({path: "rule" if path in rules else "trained" for path in variables(abstract)})
    return optax.partition({"trained": optimizer, "rule": optax.scale(-1.0)}, labels)



class ShardedState:
    """The weights of ``model_fn`` and their optimizer state as ``layout`` stores them.

    ``graphdef, abstract`` is ``abstract_model(model_fn)``. Building one checks the layout (every
    weight in every mapping) and allocates nothing; ``init`` and ``init_programs`` compile and run.
    """

    def __init__(self, layout: Layout, model_fn, optimizer: optax.GradientTransformation, graphdef, abstract):
        self.layout, self.model_fn, self.optimizer = layout, model_fn, optimizer
        self.graphdef, self.abstract = graphdef, abstract
        flat = self._variables = variables(abstract)
        # per weight: its logical names as the model wrote them, and as the layout lays them out
        self.names, self.written_names = {}, {}
        for path, var in flat.items():
            value = var.get_value()
            names = logical_names(var) or (None,) * value.ndim
            if len(names) != value.ndim:
                raise LayoutError(f"weight {'/'.join(map(str, path))} has shape {value.shape} but {len(names)} logical names {names}")
            self.written_names[path] = names
            self.names[path] = layout.effective_names(names, value.shape)  # replicated short dims unnamed
        self._check_layout()
        self.param_specs = nest({p: self._spec(p, "param") for p in flat})
        self.opt_specs_by_param = nest({p: self._spec(p, "optimizer") for p in flat})
        self.grad_specs_by_param = nest({p: self._spec(p, "grad") for p in flat})
        abstract_params = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), nnx.to_pure_dict(abstract))
        abstract_opt = jax.eval_shape(optimizer.init, abstract_params)
        self.rule_updated = rule_updated_paths(abstract)  # (``leave_to_rules``: no optimizer state, where MaskedNode stands)
        self.opt_specs = optax.tree_map_params(
            optimizer, lambda state, spec: state if isinstance(state, optax.MaskedNode) else spec, abstract_opt,
            self.opt_specs_by_param, transform_non_params=lambda _: PartitionSpec(),
            is_leaf=lambda x: isinstance(x, (PartitionSpec, optax.MaskedNode)),
        )
        shard = lambda specs: jax.tree.map(  # noqa: E731
            lambda s: NamedSharding(layout.mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
        )
        self.state_shardings = TrainState(shard(self.param_specs), shard(self.opt_specs), NamedSharding(layout.mesh, PartitionSpec()))
        self._init_programs = None

    # --- layout checks, before any device memory is touched --------------------------------

    def _spec(self, path, mapping):
        return self.layout.spec(self.names[path], mapping)

    def _check_layout(self):
        for path, var in self._variables.items():
            what = f"weight {'/'.join(map(str, path))}"
            for mapping in ("param", "optimizer", "grad", "compute"):
                names = self.names[path]
                if mapping == "compute":
                    names = tuple(None if n == "layers" else n for n in names)
                self.layout.spec(names, mapping, var.get_value().shape, what)

    # --- state ---------------------------------------------------------------------------

    def init(self, seed: int = 0) -> TrainState:
        """Sharded parameters and optimizer state; the same seed gives the same values on any layout."""
        return self.start_from(self.init_programs()[0](jax.random.key(seed)))

    def start_from(self, params) -> TrainState:
        """Step 0 with these parameters (laid out as the state's) and a fresh optimizer state."""
        step = jax.device_put(jnp.zeros((), jnp.int32), self.state_shardings.step)
        return TrainState(params, self.init_programs()[1](params), step)

    def init_programs(self):
        """The compiled initialisers of the parameters (from a key) and of the optimizer state
        (from the parameters), each writing straight into its layout. Compiled once: ``init``
        runs them, and memory analysis reads their output sizes."""
        if self._init_programs is None:

            def init_params(key):
                with nnx.use_eager_sharding(False):
                    return nnx.to_pure_dict(nnx.state(self.model_fn(nnx.Rngs(key))))

            key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
            params = jax.jit(init_params, out_shardings=self.state_shardings.params).lower(key).compile()
            opt = jax.jit(self.optimizer.init, out_shardings=self.state_shardings.opt_state)
            self._init_programs = (params, opt.lower(self.abstract_state().params).compile())
        return self._init_programs

    def abstract_state(self) -> TrainState:
        """ShapeDtypeStructs with shardings: enough to compile a step without allocating anything."""
        shapes = jax.eval_shape(lambda: self.init_shapes())
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, self.state_shardings)

    def init_shapes(self):
        params = jax.tree.map(lambda v: jnp.zeros(v.shape, v.dtype), nnx.to_pure_dict(self.abstract))
        return TrainState(params, self.optimizer.init(params), jnp.zeros((), jnp.int32))

    # --- the weights as a model ------------------------------------------------------------

    def abstract_leaf(self, path):
        """ShapeDtypeStruct of one weight by its path."""
        return self._variables[path].get_value()

    def with_values(self, pure):
        """The abstract nnx.State holding the weights of pure dict ``pure``."""
        state = jax.tree.map(lambda v: v, self.abstract)
        nnx.replace_by_pure_dict(state, pure)
        return state

    def merge(self, pure):
        """The model with the weights of pure dict ``pure``."""
        return nnx.merge(self.graphdef, self.with_values(pure))

    def stored_bytes_per_device(self) -> dict[str, int]:
        """Weights and optimizer state one device stores, from the shardings the step uses."""
        state = self.abstract_state()
        return {"parameters": bytes_per_device(state.params), "optimizer": bytes_per_device(state.opt_state)}

    def gathered_layer_bytes(self, itemsize: int, stored: bool = False) -> int:
        """Bytes per device of the stacked layer weights the layout gathers for compute (stored
        split more than computed), all layers at once, at ``itemsize`` bytes each: what keeping
        them for the backward pass holds (``stored``: their stored shards, what a stack of their
        gradients holds). 0 when nothing stacked is gathered."""
        total = 0
        for path, names in self.names.items():
            if "layers" not in names:
                continue
            whole = lambda spec: tuple(spec) + (None,) * (len(names) - len(spec))  # noqa: E731
            stored_spec, computed = whole(self._spec(path, "param")), whole(self._spec(path, "compute"))
            layers = names.index("layers")
            if all(stored_spec[d] == computed[d] for d in range(len(names)) if d != layers):
                continue  # not gathered (a pipeline's stage split of the layers is no gather)
            # the stage's own layers, each laid out as computed
            spec = PartitionSpec(*(stored_spec[d] if d == layers or stored else computed[d] for d in range(len(names))))
            total += math.prod(NamedSharding(self.layout.mesh, spec).shard_shape(self.abstract_leaf(path).shape)) * itemsize
        return total

    def stacked_marks(self):
        """A tree like the params, True at the stacked layer weights (logical axis ``layers``)."""
        return nest({p: "layers" in names for p, names in self.names.items()})
