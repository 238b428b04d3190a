"""Strategies: a parallel spec plus options, composed into one ``Layout``.

A strategy string names mesh-axis degrees and options, e.g.::

    "fsdp=4,tensor=2"              FSDP (ZeRO-3) x Megatron TP
    "fsdp=8,zero=1"                ZeRO-1 over 8 devices
    "data=2,fsdp=4"                HSDP: shard inside groups of 4, replicate across 2 groups
    "data=2,tensor=4,sp=on"        DP x TP with sequence parallelism
    "fsdp=8,regather=on"           FSDP that gathers weights again for the backward pass

Each strategy lives in its own file (data.py, fsdp.py, hsdp.py, tensor.py, sequence.py) with its
rules and its analytic traffic; this module composes them.
"""

from __future__ import annotations

import dataclasses
import warnings

from jaxpar import mesh as mesh_lib
from jaxpar.errors import SpecError
from jaxpar.parallel import data, fsdp, sequence, tensor
from jaxpar.rules import LOGICAL_AXES, Layout

OPTIONS = ("zero", "sp", "regather")  # strategy-string keys that are options, not mesh axes
_TRUE, _FALSE = {"on", "1", "true", "yes"}, {"off", "0", "false", "no"}


@dataclasses.dataclass(frozen=True)
class Strategy:
    spec: mesh_lib.ParallelSpec
    zero_stage: int = 3
    sequence_parallel: bool = False
    regather: bool = False

    def __str__(self) -> str:
        parts = [str(self.spec)]
        if self.spec.degrees["fsdp"] > 1 and self.zero_stage != 3:
            parts.append(f"zero={self.zero_stage}")
        if self.sequence_parallel:
            parts.append("sp=on")
        if self.regather:
            parts.append("regather=on")
        return ",".join(parts)


def _flag(key: str, value: str) -> bool:
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise SpecError(f"option {key}={value!r}: use on or off")


def parse_strategy(text: str, num_devices: int) -> Strategy:
    """Parse ``"data=2,fsdp=-1,tensor=2,zero=3,sp=off"`` for ``num_devices`` devices."""
    axes, options = [], {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key = part.partition("=")[0].strip()
        if key in OPTIONS:
            if key in options:  # else the last would silently win
                raise SpecError(f"option {key!r} is given twice in strategy {text!r} ({key}={options[key]} and {part}); give it once")
            options[key] = part.partition("=")[2]
        else:
            axes.append(part)
    spec = mesh_lib.parse_spec(",".join(axes), num_devices) if axes else mesh_lib.parse_spec({"data": -1}, num_devices)
    zero = 3
    if "zero" in options:
        try:
            zero = int(options["zero"])
        except ValueError:
            raise SpecError(f"option zero={options['zero']!r}: use 1, 2 or 3") from None
        fsdp.check_stage(zero)
        if spec.degrees["fsdp"] == 1:
            raise SpecError(f"zero={zero} shards over the fsdp axis, but strategy {text!r} has fsdp=1; add e.g. fsdp=-1")
    sp = _flag("sp", options["sp"]) if "sp" in options else False
    if sp and spec.degrees["tensor"] == 1:
        raise SpecError(f"sp=on splits the sequence over the tensor axis, but strategy {text!r} has tensor=1; add tensor=N")
    regather = _flag("regather", options["regather"]) if "regather" in options else False
    return Strategy(spec, zero, sp, regather)


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
    # Compute mapping: batch over every data-parallel axis, Megatron dims over tensor.
    compute = {name: () for name in LOGICAL_AXES}
    compute["batch"] = data.BATCH_AXES + ("fsdp",)
    compute["length"] = ("context",)
    compute[sequence.LOGICAL_AXIS] = ("context",) + (("tensor",) if strategy.sequence_parallel else ())
    for name in tensor.LOGICAL_AXES:
        compute[name] = ("tensor",)
    compute["experts"] = ("expert",)
    compute.update(extra_rules or {})
    # Stored mappings: as computed, plus embed over fsdp where the ZeRO stage says so.
    sharded = fsdp.mappings(strategy.zero_stage) if strategy.spec.degrees["fsdp"] > 1 else {}
    stored = {}
    for mapping in ("param", "optimizer", "grad"):
        rules = {name: axes for name, axes in compute.items() if name not in ("batch", "length", sequence.LOGICAL_AXIS)}
        if sharded.get(mapping):
            rules[fsdp.SHARDED_LOGICAL_AXIS] = rules[fsdp.SHARDED_LOGICAL_AXIS] + ("fsdp",)
        if strategy.spec.degrees["stage"] > 1:
            rules["layers"] = ("stage",)  # pipeline: each stage stores its own consecutive layers
        stored[mapping] = rules
    for rules in (compute, *stored.values()):
        rules.update({alias: rules[target] for alias, target in (aliases or {}).items()})
    dcn_axes: tuple[str, ...] = ()
    if num_slices > 1:
        with warnings.catch_warnings():  # make_mesh has already warned about a misplaced axis
            warnings.simplefilter("ignore")
            _, dcn = mesh_lib.split_ici_dcn(strategy.spec, num_slices)
        dcn_axes = tuple(a for a, d in dcn.items() if d > 1)
    return Layout(
        mesh, compute, stored["param"], stored["optimizer"], stored["grad"], regather=strategy.regather, dcn_axes=dcn_axes
    )
