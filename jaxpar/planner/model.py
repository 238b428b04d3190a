"""What the planner knows of a model and of a layout no device builds.

``ModelShapes``: every weight's shape and logical names, from one abstract trace of the model
(``nnx.eval_shape``, no memory), so that the analytic formulas the report checks against compiled
programs (``jaxpar.analysis.traffic``, ``memory``) price a candidate without a Trainer.
``planned_step`` builds a candidate's real ``Layout`` over stand-in devices (a mesh of placeholders:
the rules, roles and divisibility checks are the strategies' own) and the few things of a Trainer
those formulas read.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import warnings

from jaxpar import models
from jaxpar.parallel import build_layout
from jaxpar.rules import logical_names
from jaxpar.train.config import TrainConfig
from jaxpar.train.state import abstract_model, variables

# The formulas read a device's platform only for what its collectives carry (XLA:CPU widens bf16 to
# f32) and whether the ragged all-to-all runs; a TPU answers both as a GPU does, and a stand-in
# "tpu" device would send the mesh builder to libtpu for a torus order
_STAND_IN_PLATFORM = {"tpu": "gpu", "gpu": "gpu", "cpu": "cpu"}


@dataclasses.dataclass(frozen=True)
class _StandIn:
    """A placeholder device: a mesh's shape and platform, nothing to run on."""

    id: int
    platform: str


@dataclasses.dataclass(frozen=True)
class ModelShapes:
    shapes: dict  # weight path -> shape
    names: dict  # weight path -> logical names as the model wrote them
    dtypes: dict  # weight path -> dtype

    @staticmethod
    @functools.cache
    def of(cfg) -> ModelShapes:
        model_fn, _ = models.model_and_loss(cfg)
        _, abstract = abstract_model(model_fn)
        shapes, names, dtypes = {}, {}, {}
        for path, var in variables(abstract).items():
            value = var.get_value()
            shapes[path], dtypes[path] = value.shape, value.dtype
            names[path] = logical_names(var) or (None,) * value.ndim
        return ModelShapes(shapes, names, dtypes)


class PlannedStep:
    """The part of a ``Trainer`` the analysis formulas read (``traffic.traffic_context``,
    ``memory.zero_table``, ``tensor_local_params``): layout, step options, weights and their names,
    and the plan's regather and pipeline schedule."""

    def __init__(self, layout, cfg: TrainConfig, shapes: ModelShapes, regather: bool, schedule=None):
        self.layout, self.cfg, self._shapes = layout, cfg, shapes
        self.written_names = shapes.names
        self.names = {path: layout.effective_names(names, shapes.shapes[path]) for path, names in shapes.names.items()}
        self.plan = types.SimpleNamespace(regather=regather, schedule=schedule)

    def abstract_leaf(self, path):
        return types.SimpleNamespace(shape=self._shapes.shapes[path], dtype=self._shapes.dtypes[path])


def planned_layout(strategy, platform: str, num_slices: int):
    """``strategy``'s Layout over stand-in devices, refused (LayoutError) where it cannot hold the
    model: the same composition ``build_layout`` makes for real devices."""
    devices = [_StandIn(i, _STAND_IN_PLATFORM[platform]) for i in range(strategy.spec.num_devices)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an axis across slices is priced, not warned about
        return build_layout(strategy, devices, num_slices=num_slices)


def check_divides(layout, step: PlannedStep) -> None:
    """Every weight in every mapping splits evenly (as ``ShardedState`` checks before a run)."""
    for path, names in step.names.items():
        shape = step._shapes.shapes[path]
        for mapping in ("param", "optimizer", "grad", "compute"):
            laid = tuple(None if n == "layers" and mapping == "compute" else n for n in names)
            layout.spec(laid, mapping, shape, f"weight {'/'.join(map(str, path))}")


def weight_count(shapes: ModelShapes, only=None) -> int:
    """Weights of the model (``only``: those whose logical names include it)."""
    return sum(math.prod(s) for p, s in shapes.shapes.items() if only is None or only in shapes.names[p])


def model_config(model):
    """The config of ``model`` (a name in ``jaxpar.models.CONFIGS`` or a config), refused in words."""
    if isinstance(model, str):
        return models.model_config(model)
    models.family_of(model)  # refuses a config of no registered family
    return model
