"""Per-device memory of a training layout: measured on compiled programs, and the ZeRO table.

Measured:
- parameters: output bytes of the compiled parameter initialisation (stored layout);
- optimizer state: output bytes of the compiled optimizer initialisation;
- gradient accumulation buffer: the per-device shapes of the buffer the compiled step's
  micro-batch loop carries (recorded when the step is traced);
- temporaries, arguments, outputs, generated code: ``compiled.memory_analysis()`` of the step.

The ZeRO table (Psi weights, per device, after tensor parallelism divides what it shards): weights
4 bytes (float32 master copy; bf16 copies for compute are transient), gradient accumulation 4
bytes, Adam moments 8 bytes, each weight's divided by the ways its stored mapping splits it over
the batch axes (``fsdp`` from the ZeRO stage that shards it: ZeRO-1 optimizer, ZeRO-2 +
gradients, ZeRO-3 + weights; hierarchical ZeRO's groups divide the gradients and optimizer state
again; expert parallelism's axis joins fsdp for the weights outside the experts).
"""

from __future__ import annotations

import dataclasses
import math

import jax

from jaxpar.rules import LOOKUP_AXIS, gather_plan

BYTES_PER_PARAM = {"parameters": 4, "gradient_accumulation": 4, "optimizer": 8}
MAPPING_OF = {"parameters": "param", "gradient_accumulation": "grad", "optimizer": "optimizer"}  # the Layout mapping storing each
STORED_MAPPINGS = tuple(MAPPING_OF.values())


@dataclasses.dataclass(frozen=True)
class WeightShare:
    """One weight as the analytic formulas see it: ``psi``, its weights on one device after tensor
    parallelism, expert parallelism and the pipeline divide it, and the batch axes each stored
    mapping splits that further over (ZeRO over ``fsdp``; ``expert`` too for the weights outside
    the experts)."""

    psi: float
    layer: bool  # a stacked layer weight (logical axis ``layers``)
    computed_over: frozenset  # mesh axes its compute layout splits it over
    stored_over: dict  # mapping ("param", "optimizer", "grad") -> batch axes it is split over beyond compute
    ways: dict  # mapping -> how many ways those axes split it
    # a lookup table ``jaxpar.nn.embed_lookup`` reads at its stored shards: its row width on one
    # device (its rows travel instead of the table); 0 for every other weight
    table_width: int = 0

    def stored(self, mapping: str) -> float:
        """Its weights on one device as ``mapping`` stores them."""
        return self.psi / self.ways[mapping]


def weight_shares(trainer) -> list[WeightShare]:
    """Every weight of ``trainer`` (a Trainer, or the planner's stand-in) as a ``WeightShare``. On
    the GSPMD path a lookup table is gathered like any weight (``train/gspmd.py`` lays it out for
    compute where it is read), so none has a ``table_width``."""
    layout, shares = trainer.layout, []
    gspmd = on_gspmd_path(trainer)
    for path, names in trainer.names.items():
        shape = trainer.abstract_leaf(path).shape
        computed = {a for dim in layout.dim_axes(names) for a in dim}
        ways = math.prod(layout.mesh.shape[a] for a in computed)
        if "layers" in names:
            ways *= math.prod(layout.mesh.shape[a] for a in layout.axes_of("layers", "param"))
        stored_over = {m: tuple(a for dim in layout.dim_axes(names, m) for a in dim if a in layout.batch_axes and a not in computed)
                       for m in STORED_MAPPINGS}
        shares.append(WeightShare(math.prod(shape) / ways, "layers" in names, frozenset(computed), stored_over,
                                  {m: math.prod(layout.mesh.shape[a] for a in axes) for m, axes in stored_over.items()},
                                  0 if gspmd else _table_width(layout, names, shape)))
    return shares


def on_gspmd_path(trainer) -> bool:
    """Whether XLA's partitioner places ``trainer``'s collectives (the planner's stand-in has no path)."""
    return getattr(getattr(trainer, "plan", None), "path", None) == "gspmd"


def _table_width(layout, names, shape) -> int:
    """Row width on one device of a lookup table read at its stored shards (``rules.stored_table``:
    first logical axis ``vocab``, only the last dim split in storage), else 0."""
    if not names or names[0] != LOOKUP_AXIS or [dim for dim, _ in gather_plan(names, layout)] != [len(shape) - 1]:
        return 0
    return shape[-1] // math.prod(layout.mesh.shape[a] for a in layout.dim_axes(names)[-1])


def tensor_local_params(trainer, only_layers: bool = False) -> float:
    """Weights one device holds after tensor parallelism, expert parallelism and the pipeline (a
    stage stores only its own layers) divide them, before any data-parallel sharding; with
    ``only_layers``, just the stacked layer weights (logical axis ``layers``)."""
    return sum(w.psi for w in weight_shares(trainer) if w.layer or not only_layers)


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


def zero_table(trainer) -> dict[str, float]:
    """Bytes per device the ZeRO table predicts for this layout: each weight's bytes of each kind
    of state divided by the ways its stored mapping splits it."""
    shares = weight_shares(trainer)
    return {kind: BYTES_PER_PARAM[kind] * sum(w.stored(mapping) for w in shares) for kind, mapping in MAPPING_OF.items()}


def measured_memory(trainer, compiled_step) -> dict[str, int]:
    """Bytes per device by kind, read from compiled programs (see the module docstring)."""
    params, opt = trainer.init_programs()
    step = compiled_step.memory_analysis()
    opt_bytes = opt.memory_analysis().output_size_in_bytes
    # optax keeps a step counter per state; it is not part of the per-parameter table
    opt_bytes -= sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(trainer.abstract_state().opt_state) if x.ndim == 0)
    measured = {
        "parameters": params.memory_analysis().output_size_in_bytes,
        "optimizer": opt_bytes,
        "gradient_accumulation": trainer.plan.accumulator_bytes,
        "temporaries": step.temp_size_in_bytes,
        "arguments": step.argument_size_in_bytes,
        "outputs": step.output_size_in_bytes,
        "generated_code": step.generated_code_size_in_bytes,
    }
    if trainer.pipedream is not None:  # each stage's optimizer state is in the stream, and no gradient is accumulated
        held = trainer.pipedream.stream_bytes(trainer.abstract_state().stream)
        measured.update(optimizer=held["optimizer"], gradient_accumulation=0, pipedream_stream=held["stream"])
    return measured
