"""The hooks a strategy implements, each with a no-op default here.

A strategy is a module (or a folder whose ``__init__`` is that module) that defines the hooks it
needs; ``hooks(module)`` fills in the rest from this module, and generic code (``build_layout``,
the trainer, batch placement, the report, compile options) calls every strategy's hooks in turn,
never naming one. A hook whose strategy is not active in a layout returns its default.

The static half, read before any device is used:

- ``AXES``, ``CROSSES_DCN``, ``OPTIONS``, ``REPLICABLE``: its mesh axes, whether they may span
  slow links, its options (``{key: (parse(key, text), default)}``), logical axes kept whole where
  a dim is too short to split over its axes;
- ``fold(degrees, num_devices)``: the degrees as written -> as the mesh holds them;
  ``reshape(degrees, options)``: where its options re-split the degrees;
- ``check(strategy)``: refuse degrees and options that cannot work;
- ``rules(strategy, compute, stored)``: its part of the layout's mappings;
- ``roles(strategy)``: ``{role: mesh axes}`` its runtime reads off the layout (``Layout.role``);
- ``traffic(strategy, ctx)``, ``memory(strategy, mesh_shape)``: its analytic bytes.

What it asks of a run, a model and a batch, checked by the trainer before anything compiles:

- ``check_run(planned, cfg)``: refuse a ``TrainConfig`` it cannot run (an attention kernel...);
  ``planned`` is the Layout, or the Strategy before a mesh exists (both answer ``role``);
- ``check_weights(layout, weights)``: refuse weights (``{path: (logical names, shape)}``) it
  cannot split;
- ``check_calls(layout, calls)``: refuse a model that never made a jaxpar call it needs;
- ``manual_only(layout, calls)``: what of it only jaxpar's manual step runs, in words (None: nothing);
- ``check_batch(layout, batch, length)``: refuse a batch it cannot split;
- ``comparable(layout)``: why one device is not its oracle (None: it is).

What it adds to a step:

- ``local_batch(layout, batch)``: this device's part of a batch inside the manual step;
- ``runtime_axes(layout)``: mesh axes its own runtime finishes the sums over;
- ``attention_kernel(layout)``: the kernel it runs whatever a run asks (None: the run's choice);
- ``compiler_options(layout)``: ``jax.jit`` compiler options its programs need.

And its part of the report: ``report(layout, measured, cfg)`` (``measured``: a
``report.Measured`` of the compiled step) returns its section (None: none), ``summary(section)``
the section's lines in ``jaxpar train``'s summary.
"""

from __future__ import annotations

import types

AXES: tuple[str, ...] = ()
CROSSES_DCN = False
OPTIONS: dict = {}
REPLICABLE: frozenset[str] = frozenset()


def fold(degrees: dict[str, int], num_devices: int) -> dict[str, int]:
    return degrees


def reshape(degrees: dict, options: dict) -> dict:
    return degrees


def check(strategy) -> None:
    pass


def rules(strategy, compute: dict, stored: dict) -> None:
    pass


def roles(strategy) -> dict[str, tuple[str, ...]]:
    return {}


def traffic(strategy, ctx) -> dict:
    return {}


def memory(strategy, mesh) -> dict:
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


def local_batch(layout, batch):
    return batch


def runtime_axes(layout) -> tuple[str, ...]:
    return ()


def attention_kernel(layout) -> str | None:
    return None


def compiler_options(layout) -> dict:
    return {}


def report(layout, measured, cfg) -> dict | None:
    return None


def summary(section: dict) -> list[str]:
    return []


HOOKS = tuple(name for name, value in list(globals().items())
              if not name.startswith("_") and name not in ("annotations", "types", "HOOKS"))


def hooks(module) -> types.SimpleNamespace:
    """``module``'s hooks, each missing one taken from this module's defaults; ``name`` is the
    module's last dotted part (``fsdp``), which names its report section."""
    defaults = globals()
    found = {name: getattr(module, name, defaults[name]) for name in HOOKS}
    return types.SimpleNamespace(name=module.__name__.rpartition(".")[2], module=module, **found)
