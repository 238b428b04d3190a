"""Per-device memory of a training layout: measured on compiled programs, and the ZeRO table.

Measured:
- parameters: output bytes of the compiled parameter initialisation (stored layout);
- optimizer state: output bytes of the compiled optimizer initialisation;
- gradient accumulation buffer: the per-device shapes of the buffer the compiled step's
  micro-batch loop carries (recorded when the step is traced);
- temporaries, arguments, outputs, generated code: ``compiled.memory_analysis()`` of the step.

The ZeRO table (Psi weights, per device, after tensor parallelism divides what it shards): weights
4 bytes (float32 master copy; bf16 copies for compute are transient), gradient accumulation 4
bytes, Adam moments 8 bytes, each divided by the ways the strategies split it (``fsdp`` from the
ZeRO stage that shards it: ZeRO-1 optimizer, ZeRO-2 + gradients, ZeRO-3 + weights; hierarchical
ZeRO's groups divide the gradients and optimizer state again).
"""

from __future__ import annotations

import math

import jax

from jaxpar.parallel import STRATEGIES
from jaxpar.rules import LOOKUP_AXIS, gather_plan

BYTES_PER_PARAM = {"parameters": 4, "gradient_accumulation": 4, "optimizer": 8}


def tensor_local_params(trainer, only_layers: bool = False, split_over: str | None = None) -> float:
    """Weights one device holds after tensor parallelism, expert parallelism and the pipeline (a
    stage stores only its own layers) divide them, before any data-parallel sharding; with
    ``only_layers``, just the stacked layer weights (logical axis ``layers``); with ``split_over``,
    just the weights whose compute layout splits them over that mesh axis."""
    layout, total = trainer.layout, 0.0
    for path, names in trainer.names.items():
        axes = [a for n in names for a in layout.axes_of(n, "compute")]
        if (only_layers and "layers" not in names) or (split_over is not None and split_over not in axes):
            continue
        numel = math.prod(trainer.abstract_leaf(path).shape)
        ways = math.prod(layout.mesh.shape[a] for a in axes)
        if "layers" in names:
            ways *= math.prod(layout.mesh.shape[a] for a in layout.axes_of("layers", "param"))
        total += numel / ways
    return total


def stored_tables(trainer) -> tuple[float, int, int]:
    """(weights per device after tensor parallelism, summed row width, count) of the lookup tables that
    ``jaxpar.nn.embed_lookup`` reads at their stored shards inside the manual step (``rules.stored_table``:
    first logical axis ``vocab``, only the last dim split in storage): never gathered, their rows
    travel instead."""
    layout, psi, width, count = trainer.layout, 0.0, 0, 0
    for path, names in trainer.names.items():
        if not names or names[0] != LOOKUP_AXIS:
            continue
        shape = trainer.abstract_leaf(path).shape
        if [dim for dim, _ in gather_plan(names, layout)] != [len(shape) - 1]:
            continue
        compute_ways = lambda name: math.prod(layout.mesh.shape[a] for a in layout.axes_of(name, "compute") if a not in layout.batch_axes)  # noqa: E731
        psi += math.prod(shape) / math.prod(compute_ways(n) for n in names)
        width += shape[-1] // compute_ways(names[-1])
        count += 1
    return psi, width, count


def replicated_params(trainer) -> float:
    """Weights (per device, after the pipeline) kept whole over mesh axes their logical names would
    split, because the dim is too short (``Layout.replicable``: GQA key/value heads under TP)."""
    layout, total = trainer.layout, 0.0
    for path, names in trainer.names.items():
        written = trainer.written_names[path]
        if names == written:
            continue
        numel = math.prod(trainer.abstract_leaf(path).shape)
        if "layers" in names:
            numel /= math.prod(layout.mesh.shape[a] for a in layout.axes_of("layers", "param"))
        total += numel / math.prod(layout.mesh.shape[a] for n in names for a in layout.axes_of(n, "compute") if a not in layout.batch_axes)
    return total


def zero_table(trainer, strategy) -> dict[str, float]:
    """Bytes per device the ZeRO table predicts for this layout: each kind of state divided by the
    ways every strategy splits it (``memory(strategy, mesh)`` in each strategy module)."""
    psi = tensor_local_params(trainer)
    ways = {kind: 1 for kind in BYTES_PER_PARAM}
    for module in STRATEGIES:
        for kind, n in module.memory(strategy, trainer.layout.mesh.shape).items():
            ways[kind] *= n
    return {kind: BYTES_PER_PARAM[kind] * psi / ways[kind] for kind in BYTES_PER_PARAM}


def measured_memory(trainer, compiled_step) -> dict[str, int]:
    """Bytes per device by kind, read from compiled programs (see the module docstring)."""
    params, opt = trainer.init_programs()
    step = compiled_step.memory_analysis()
    opt_bytes = opt.memory_analysis().output_size_in_bytes
    # optax keeps a step counter per state; it is not part of the per-parameter table
    opt_bytes -= sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(trainer.abstract_state().opt_state) if x.ndim == 0)
    return {
        "parameters": params.memory_analysis().output_size_in_bytes,
        "optimizer": opt_bytes,
        "gradient_accumulation": trainer.plan.accumulator_bytes,
        "temporaries": step.temp_size_in_bytes,
        "arguments": step.argument_size_in_bytes,
        "outputs": step.output_size_in_bytes,
        "generated_code": step.generated_code_size_in_bytes,
    }
