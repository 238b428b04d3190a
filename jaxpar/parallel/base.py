"""The hooks a strategy implements, each with a no-op default here.

A strategy is a module (or a folder whose ``__init__`` is that module) that defines the hooks it
needs; ``hooks(module)`` fills in the rest from this module, and generic code (``build_layout``,
the trainer, batch placement, the report, compile options) calls every strategy's hooks in turn,
never naming one. A hook whose strategy is not active in a layout returns its default.

The static half, read before any device is used:

- ``AXES``, ``CROSSES_DCN``, ``OPTIONS``, ``REPLICABLE``: its mesh axes, whether they may span
  slow links, its options (``{key: (parse(key, text), default)}``), logical axes kept whole where
  a dim is too short to split over its axes; ``NEEDS_MODEL``: what its axes need of a model, in
  words, where only some model families have it (``Family.axes`` lists the axes a family takes);
  ``RUNNER``: the module whose ``train(run, topology, progress)`` trains a run that uses its axes,
  where the one-program step cannot (federation's groups: ``jaxpar.federate``);
- ``fold(degrees, num_devices)``: the degrees as written -> as the mesh holds them, and
  ``unfold(degrees, written)``: the mesh's degrees it re-split -> as written (``written_degrees``);
  ``reshape(degrees, options)``: where its options re-split the degrees;
- ``check(strategy)``: refuse degrees and options that cannot work;
- ``check_model(strategy, model_cfg, seq_len)``: refuse a model and length it cannot split;
- ``rules(strategy, compute, stored)``: its part of the layout's mappings;
- ``roles(strategy)``: ``{role: mesh axes}`` its runtime reads off the layout (``Layout.role``);
- ``settings(strategy)``: ``{name: value}`` of its options its runtime reads off the layout
  (``Layout.settings``: subspace's k);
- ``traffic(strategy, ctx)``: its analytic bytes on the wire (what it stores follows from its
  ``rules``: ``analysis.memory.zero_table``).

What it asks of a run, a model and a batch, checked by the trainer before anything compiles:

- ``choose_regather(kept_bytes, state_bytes, memory_bytes)``: under ``regather=auto``, whether
  to gather the layers' weights again for the backward pass, and why (None: not its choice);
- ``ignores(strategy)``: ``{TrainConfig field: why}`` of the options that would do nothing under
  the strategy as given (refused where set: ``run.check_unused_options``);
- ``check_run(planned, cfg)``: refuse a ``TrainConfig`` it cannot run (an attention kernel...);
  ``planned`` is the Layout, or the Strategy before a mesh exists (both answer ``role``);
- ``check_weights(layout, weights)``: refuse weights (``{path: (logical names, shape)}``) it
  cannot split;
- ``check_calls(layout, calls)``: refuse a model that never made a jaxpar call it needs;
- ``manual_only(layout, calls)``: what of it only jaxpar's manual step runs, in words (None: nothing);
- ``check_batch(layout, batch, length)``: refuse a batch it cannot split;
- ``comparable(layout)``: why one device is not its oracle (None: it is);
- ``changed(saved, strategy)``: why weights trained under the ``saved`` strategy are another
  function under ``strategy`` (None: they are not), for a resume.

What it adds to a step:

- ``local_batch(layout, batch)``: this device's part of a batch inside the manual step;
- ``runtime_axes(layout)``: mesh axes its own runtime finishes the sums over;
- ``places(layout, length)``: where in its row each position this device holds sits, for rows of
  ``length`` (an int array; None: not a split of its own);
- ``attention_kernel(layout)``: the kernel it runs whatever a run asks (None: the run's choice);
- ``compiler_options(layout)``: ``jax.jit`` compiler options its programs need;
- ``serves_manually(layout)``: whether serving runs only inside one shard_map, where jaxpar's own
  collectives run it (delayed TP: each device's own residual stream);
- ``pipeline_pieces(layout, pieces)``: a pipeline's pieces as it runs them (subspace: boundaries
  that carry coordinates), else ``pieces``.

And its part of the report: ``report(layout, measured, cfg)`` (``measured``: a
``report.Measured`` of the compiled step) returns its section (None: none), ``summary(section)``
the section's lines in ``jaxpar train``'s summary.
"""

from __future__ import annotations

import types
from collections.abc import Callable

from jaxpar.errors import SpecError

# --- option parsers: ``OPTIONS`` values are (parse(key, text), default) -----------------------------


def option_of(values: dict, fix: str) -> Callable:
    """A parser of an option that takes one of ``values`` (text, any case -> value); any other
    text is refused with ``fix`` (what to give instead)."""
    def parse(key: str, text: str):
        if text.strip().lower() in values:
            return values[text.strip().lower()]
        raise SpecError(f"option {key}={text!r}: {fix}")
    return parse


def count_option(valid: Callable[[int], bool], fix: str) -> Callable:
    """A parser of a whole-number option that ``valid`` accepts; anything else refused with ``fix``."""
    def parse(key: str, text: str) -> int:
        try:
            number = int(text)
        except ValueError:
            number = None
        if number is None or not valid(number):
            raise SpecError(f"option {key}={text!r}: {fix}")
        return number
    return parse


SWITCH_WORDS = {**dict.fromkeys(("on", "1", "true", "yes"), True), **dict.fromkeys(("off", "0", "false", "no"), False)}
switch = option_of(SWITCH_WORDS, "use on or off")  # an on/off option (``sp=on``)

# --- the hooks and their defaults --------------------------------------------------------------------

_NOT_HOOKS = set(globals()) | {"_NOT_HOOKS"}  # what is above: imports and parsers

AXES: tuple[str, ...] = ()
CROSSES_DCN = False
OPTIONS: dict = {}
REPLICABLE: frozenset[str] = frozenset()
NEEDS_MODEL: str | None = None
RUNNER: str | None = None


def fold(degrees: dict[str, int], num_devices: int) -> dict[str, int]:
    return degrees


def unfold(degrees: dict[str, int], written: dict[str, int]) -> dict[str, int]:
    return {}


def reshape(degrees: dict, options: dict) -> dict:
    return degrees


def check(strategy) -> None:
    pass


def check_model(strategy, cfg, seq_len: int) -> None:
    pass


def rules(strategy, compute: dict, stored: dict) -> None:
    pass


def roles(strategy) -> dict[str, tuple[str, ...]]:
    return {}


def settings(strategy) -> dict:
    return {}


def traffic(strategy, ctx) -> dict:
    return {}


def choose_regather(kept_bytes: float, state_bytes: float, memory_bytes: float | None) -> tuple[bool, str] | None:
    return None


def ignores(strategy) -> dict[str, str]:
    return {}


def check_run(planned, cfg) -> None:
    pass


def check_weights(layout, weights: dict) -> None:
    pass


def check_calls(layout, calls) -> None:
    pass


def manual_only(layout, calls) -> str | None:
    return None


def check_batch(layout, batch, length: int | None) -> None:
    pass


def comparable(layout) -> str | None:
    return None


def changed(saved, strategy) -> str | None:
    return None


def local_batch(layout, batch):
    return batch


def runtime_axes(layout) -> tuple[str, ...]:
    return ()


def places(layout, length: int):
    return None


def attention_kernel(layout) -> str | None:
    return None


def compiler_options(layout) -> dict:
    return {}


def serves_manually(layout) -> bool:
    return False


def pipeline_pieces(layout, pieces):
    return pieces


def nonfinite_cause(layout) -> str | None:
    return None


def report(layout, measured, cfg) -> dict | None:
    return None


def summary(section: dict) -> list[str]:
    return []


HOOKS = tuple(name for name in list(globals()) if name not in _NOT_HOOKS and not name.startswith("_"))


def hooks(module) -> types.SimpleNamespace:
    """``module``'s hooks, each missing one taken from this module's defaults; ``name`` is the
    module's last dotted part (``fsdp``), which names its report section."""
    defaults = globals()
    found = {name: getattr(module, name, defaults[name]) for name in HOOKS}
    return types.SimpleNamespace(name=module.__name__.rpartition(".")[2], module=module, **found)
