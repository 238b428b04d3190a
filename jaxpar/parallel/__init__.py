"""Strategies: a parallel spec plus options, composed into one ``Layout``.

A strategy string names mesh-axis degrees and options, e.g.::

    "fsdp=4,tensor=2"              FSDP (ZeRO-3) x Megatron TP
    "fsdp=8,zero=1"                ZeRO-1 over 8 devices
    "data=2,fsdp=4"                HSDP: shard inside groups of 4, replicate across 2 groups
    "data=2,tensor=4,sp=on"        DP x TP with sequence parallelism
    "tensor=4,delay=1"             delayed TP: each sublayer's all-reduce read one sublayer later
    "stage=4,data=2,subspace=160"  a pipeline whose boundaries carry 160 coordinates a position
    "tensor=4,sp=on,tp_overlap=on" collective matmul: SP's gathers and reductions as rings under the matmuls
    "fsdp=8,regather=on"           FSDP that gathers weights again for the backward pass
    "fsdp=8,param_shards=4"        hierarchical ZeRO: weights split in groups of 4, the rest over 8
    "fsdp=4,context=2"             FSDP x context parallelism (ring attention over 2 devices)
    "fsdp=2,block=4"               FSDP x block parallelism (a block diffusion model's noisy blocks over 4)
    "tp_x=2,tp_y=2,fsdp=2"         AxoNN's 4D TP: embed over tp_x, heads/mlp/vocab over tp_y, Z = fsdp
    "federation=2,fsdp=4"          FL+FSDP: two groups train their own copies, merged every local_steps steps

Each strategy is one module of this package, or one folder with its runtime beside it
(``context/``, ``block/``), and holds everything it is: the hooks of ``base.py``, each with a
no-op default there. ``build_layout``, the trainer, batch placement, the report and the compile
options call every strategy's hooks in turn (``STRATEGIES`` order is the mesh's, outermost first);
the stored mappings start from the compute mapping of every weight axis, so a strategy's ``rules``
adds to ``stored`` only what is stored split more than it is computed, and the gradient reductions
follow from these (``train/reductions.py``). A new strategy is one new module (or folder) and one
line below.

Strategies that are options of another say so in their module: ``sequence`` (``sp=on``),
``overlap`` (``tp_overlap=on``) and ``delayed`` (``delay=1``) of ``tensor``; ``hierarchical_zero``
(``param_shards=``) of ``fsdp``; ``subspace`` (``subspace=k``) of ``stage``.
"""

from __future__ import annotations

import dataclasses
import warnings

from jaxpar import mesh as mesh_lib
from jaxpar.errors import SpecError
from jaxpar.parallel import (axonn, block, context, data, delayed, expert, federation, fsdp, hierarchical_zero, overlap, sequence, stage,
                             subspace, tensor)
from jaxpar.parallel.base import hooks
from jaxpar.rules import LOGICAL_AXES, Layout

STRATEGIES = tuple(hooks(module) for module in (
    federation, stage, subspace, data, hierarchical_zero, fsdp, expert, block, context, axonn, tensor, sequence, delayed, overlap))
OPTIONS = {key: (module, *parse) for module in STRATEGIES for key, parse in module.OPTIONS.items()}
AXES = tuple(a for module in STRATEGIES for a in module.AXES)  # the mesh's axes, outermost (slowest links) first
DCN_AXES = frozenset(a for module in STRATEGIES if module.CROSSES_DCN for a in module.AXES)  # may cross slices
ACTIVATION_AXES = ("batch", "length", "residual_length")  # logical axes no weight has


@dataclasses.dataclass(frozen=True)
class Strategy:
    spec: mesh_lib.ParallelSpec  # the mesh's degrees (after any strategy re-split them)
    options: dict  # every option, given or default
    given: dict = dataclasses.field(default_factory=dict)  # the options as written (key -> text)
    written: str = ""  # the degrees as written, e.g. "fsdp=8" for fsdp=4 x fsdp_group=2
    # the degrees as written where a strategy's ``fold`` re-split them (CSBP's block=P: the mesh's
    # block axis is P / C), else the mesh's
    written_degrees: dict = dataclasses.field(default_factory=dict)

    @property
    def degrees(self) -> dict[str, int]:
        return self.spec.degrees

    @property
    def zero_stage(self) -> int:
        return self.options["zero"]

    @property
    def sequence_parallel(self) -> bool:
        return self.options["sp"]

    @property
    def regather(self) -> bool | None:
        """True / False as given; None for auto (the trainer chooses by memory)."""
        return self.options["regather"]

    def role(self, name: str) -> tuple[str, ...]:
        """The mesh axes (of more than one device) a strategy's runtime plays ``name`` over, as
        ``Layout.role`` will say once the mesh exists."""
        axes = next((axes for module in STRATEGIES if (axes := module.roles(self).get(name))), ())
        return tuple(a for a in axes if self.degrees.get(a, 1) > 1)

    def __str__(self) -> str:
        return ",".join([self.written or str(self.spec)] + [f"{k}={v}" for k, v in self.given.items()])


def parse_strategy(text: str, num_devices: int) -> Strategy:
    """Parse ``"data=2,fsdp=-1,tensor=2,zero=3,sp=off"`` for ``num_devices`` devices."""
    axes, given = [], {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key = part.partition("=")[0].strip()
        if key not in OPTIONS and key not in AXES:  # before its value is read as a degree
            raise SpecError(f"{key!r} in strategy {text!r} is not a mesh axis or an option; the axes are "
                            f"{', '.join(AXES)}, the options {', '.join(OPTIONS)}")
        if key in OPTIONS:
            if key in given:  # else the last would silently win
                raise SpecError(f"option {key!r} is given twice in strategy {text!r} ({key}={given[key]} and {part}); give it once")
            given[key] = part.partition("=")[2].strip()
        else:
            axes.append(part)
    written = ",".join(axes)
    folded = mesh_lib.parse_degrees(written)
    for module in STRATEGIES:  # block=P,context=C: P devices in all
        folded = module.fold(folded, num_devices)
    if folded != mesh_lib.parse_degrees(written):
        spec = mesh_lib.parse_spec(folded, num_devices, AXES, DCN_AXES)
    else:
        spec = mesh_lib.parse_spec(written if axes else {"data": -1}, num_devices, AXES, DCN_AXES)
    options = {key: (parse(key, given[key]) if key in given else default) for key, (_, parse, default) in OPTIONS.items()}
    degrees = spec.degrees
    for module in STRATEGIES:
        degrees = module.reshape(degrees, options)
    unfolded = {}  # what a fold re-split, as written
    for module in STRATEGIES:
        unfolded.update(module.unfold(degrees, mesh_lib.parse_degrees(written)))
    shown = str(dataclasses.replace(spec, degrees=dict(spec.degrees, **unfolded))) if degrees != spec.degrees or unfolded else ""
    strategy = Strategy(dataclasses.replace(spec, degrees=degrees), options, given, shown, dict(degrees, **unfolded))
    for module in STRATEGIES:
        module.check(strategy)
    return strategy


def build_layout(strategy: Strategy, devices=None, num_slices: int = 1, extra_rules=None, aliases=None) -> Layout:
    """Compose the strategies' rules into a Layout over ``devices`` (default: all JAX devices).

    ``extra_rules`` adds compute rules for logical axes of a user's own model (stored the same way).
    ``aliases`` maps a user model's own logical names onto jaxpar's (``{"hidden": "mlp"}``): each
    alias is laid out as its target in every mapping.
    """
    for alias, target in (aliases or {}).items():
        if target not in LOGICAL_AXES or alias in LOGICAL_AXES:
            raise SpecError(f"alias {alias!r} -> {target!r}: map a name of your model's own onto one of jaxpar's "
                            f"logical axes ({', '.join(LOGICAL_AXES)})")
    mesh = mesh_lib.make_mesh(strategy.spec, devices, num_slices)
    compute = {name: () for name in LOGICAL_AXES}
    extra = {mapping: {name: () for name in LOGICAL_AXES if name not in ACTIVATION_AXES} for mapping in ("param", "optimizer", "grad")}
    for module in STRATEGIES:
        module.rules(strategy, compute, extra)
    compute.update(extra_rules or {})
    stored = {mapping: {name: compute.get(name, ()) + axes for name, axes in rules.items()} for mapping, rules in extra.items()}
    for mapping, rules in stored.items():  # a user's own logical axes are stored as computed
        rules.update({name: axes for name, axes in (extra_rules or {}).items() if name not in rules})
    for rules in (compute, *stored.values()):
        rules.update({alias: rules[target] for alias, target in (aliases or {}).items()})
    dcn_axes: tuple[str, ...] = ()
    if num_slices > 1:
        with warnings.catch_warnings():  # make_mesh has already warned about a misplaced axis
            warnings.simplefilter("ignore")
            _, dcn = mesh_lib.split_ici_dcn(strategy.spec, num_slices)
        dcn_axes = tuple(a for a, d in dcn.items() if d > 1)
    roles = {role: axes for module in STRATEGIES for role, axes in module.roles(strategy).items()}
    settings = {name: value for module in STRATEGIES for name, value in module.settings(strategy).items()}
    return Layout(
        mesh, compute, stored["param"], stored["optimizer"], stored["grad"], regather=strategy.regather, dcn_axes=dcn_axes,
        replicable=frozenset().union(*(module.REPLICABLE for module in STRATEGIES)), roles=roles, settings=settings,
    )


def pipeline_pieces(layout: Layout, pieces):
    """A pipeline's pieces as the layout's strategies run them (``base.pipeline_pieces``)."""
    for module in STRATEGIES:
        pieces = module.pipeline_pieces(layout, pieces)
    return pieces


def runner(strategy: Strategy) -> str | None:
    """The module whose ``train`` runs ``strategy`` where the one-program step cannot (a strategy's
    ``RUNNER``, when its axes are in use), else None."""
    return next((module.RUNNER for module in STRATEGIES
                 if module.RUNNER and any(strategy.degrees.get(a, 1) > 1 for a in module.AXES)), None)


def choose_regather(kept_bytes: float, state_bytes: float, memory_bytes: float | None) -> tuple[bool, str]:
    """(regather, why) under ``regather=auto``: the strategy that gathers stacked layers decides."""
    return next(choice for module in STRATEGIES if (choice := module.choose_regather(kept_bytes, state_bytes, memory_bytes)))


def check_model(strategy: Strategy, model_cfg, seq_len: int) -> None:
    """Every strategy's refusals of a model config and sequence length (before anything is built)."""
    for module in STRATEGIES:
        module.check_model(strategy, model_cfg, seq_len)


def check_run(planned, cfg) -> None:
    """Every strategy's refusals of a ``TrainConfig`` (``planned``: the Layout, or the Strategy
    before any mesh exists: both answer ``role``)."""
    for module in STRATEGIES:
        module.check_run(planned, cfg)


def changed(saved: Strategy, strategy: Strategy) -> str | None:
    """Why weights trained under ``saved`` compute another function under ``strategy`` (None: the same)."""
    return next((why for module in STRATEGIES if (why := module.changed(saved, strategy))), None)


def compiler_options(layout: Layout | None) -> dict | None:
    """``jax.jit``'s compiler_options for a program under ``layout``: every strategy's (None: none)."""
    options = {} if layout is None else {k: v for module in STRATEGIES for k, v in module.compiler_options(layout).items()}
    return options or None


def serves_manually(layout: Layout | None) -> bool:
    """Whether serving under ``layout`` runs inside one shard_map (a strategy only jaxpar's own
    collectives run: delayed TP) rather than partitioned by XLA."""
    return layout is not None and any(module.serves_manually(layout) for module in STRATEGIES)


def attention_kernel(layout: Layout) -> str | None:
    """The attention kernel a strategy of ``layout`` runs whatever a run asks (None: the run's choice)."""
    return next((kernel for module in STRATEGIES if (kernel := module.attention_kernel(layout))), None)


def runtime_axes(layout: Layout) -> tuple[str, ...]:
    """Mesh axes the strategies' own runtimes finish the sums over (the context ring...)."""
    return tuple(a for module in STRATEGIES for a in module.runtime_axes(layout))


def token_places(layout: Layout, length: int):
    """Where in its row each position this device holds sits, for rows of ``length`` (None: no
    strategy splits the rows with places of its own)."""
    return next((at for module in STRATEGIES if (at := module.places(layout, length)) is not None), None)


def nonfinite_cause(layout: Layout) -> str | None:
    """What besides the numbers makes a step of ``layout`` non-finite, in words (None: nothing)."""
    return next((why for module in STRATEGIES if (why := module.nonfinite_cause(layout))), None)


def comparable(layout: Layout) -> str | None:
    """Why one device is not ``layout``'s oracle, in words (None: it is)."""
    return next((why for module in STRATEGIES if (why := module.comparable(layout))), None)
