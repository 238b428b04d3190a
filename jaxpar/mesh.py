"""Parallel specs -> jax Mesh.

A parallel spec gives the degree of each canonical mesh axis, e.g. ``"data=2,fsdp=-1,tensor=2"``;
``-1`` fills the rest of the devices (as in MaxText). On a multi-slice (or multi-node) topology the
degrees are split into an ICI part (inside a slice) and a DCN part (across slices): only the axes
that their strategy lets cross DCN (``ParallelSpec.dcn_axes``) may, and the mesh gets the hybrid ICI x DCN device order.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

from jaxpar.errors import SpecError


@dataclasses.dataclass(frozen=True)
class ParallelSpec:
    """Degree of every canonical axis (1 where the spec did not name it)."""

    degrees: dict[str, int]  # every mesh axis, outermost first (the strategies' order: ``jaxpar.parallel.AXES``)
    # the axes whose traffic is light enough to cross the slow links between slices or nodes
    dcn_axes: frozenset[str] = dataclasses.field(default=frozenset(), compare=False)

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(self.degrees)

    @property
    def num_devices(self) -> int:
        return math.prod(self.degrees.values())

    def __str__(self) -> str:
        named = [f"{a}={d}" for a, d in self.degrees.items() if d > 1]
        return ",".join(named) or "data=1"


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, smallest first (degrees that split ``n`` devices evenly)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def parse_degrees(spec: str) -> dict[str, int]:
    """``"data=2,fsdp=-1"`` -> ``{"data": 2, "fsdp": -1}``, refusing entries that are not ``axis=int``."""
    items: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep:
            raise SpecError(f"spec entry {part!r} has no degree: write it as '{key}=N' (N, or -1 to fill)")
        if key in items:  # else the last would silently win
            raise SpecError(f"axis {key!r} is given twice in spec {spec!r} ({key}={items[key]} and {part}); give each axis once")
        try:
            items[key] = int(value)
        except ValueError:
            raise SpecError(f"spec entry {part!r}: degree {value!r} is not an integer") from None
    return items


def parse_spec(spec: str | dict[str, int], num_devices: int, axes: tuple[str, ...], dcn_axes=frozenset()) -> ParallelSpec:
    """Parse ``"data=2,fsdp=-1,tensor=2"`` (or a dict) into degrees whose product is ``num_devices``,
    over the mesh ``axes`` (outermost first) the strategies declare, of which ``dcn_axes`` may cross
    the slow links (this module only orders and splits them: ``jaxpar.parallel`` owns them)."""
    if num_devices < 1:
        raise SpecError(f"spec {spec!r} is laid over {num_devices} devices; pass the device count, at least 1")
    items = parse_degrees(spec) if isinstance(spec, str) else dict(spec)
    unknown = [k for k in items if k not in axes]
    if unknown:
        raise SpecError(f"unknown mesh axis {unknown[0]!r} in spec {spec!r}; the axes are {', '.join(axes)}")
    fills = [k for k, v in items.items() if v == -1]
    if len(fills) > 1:
        raise SpecError(f"spec {spec!r} has -1 on {fills}; only one axis may fill the remaining devices")
    bad = [k for k, v in items.items() if v == 0 or v < -1]
    if bad:
        raise SpecError(f"axis {bad[0]!r} in spec {spec!r} has degree {items[bad[0]]}; use a positive degree or -1")
    fixed = math.prod(v for v in items.values() if v != -1)
    if fills:
        if num_devices % fixed:
            raise SpecError(
                f"spec {spec!r}: the fixed degrees multiply to {fixed}, which does not divide the "
                f"{num_devices} devices, so '{fills[0]}=-1' cannot fill the rest"
            )
        items[fills[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise SpecError(
            f"spec {spec!r} multiplies to {fixed} devices but {num_devices} are available; "
            f"change a degree or put -1 on one axis to fill the rest"
        )
    return ParallelSpec({a: items.get(a, 1) for a in axes}, frozenset(dcn_axes))


def split_ici_dcn(spec: ParallelSpec, num_slices: int) -> tuple[dict[str, int], dict[str, int]]:
    """Split the degrees into (ICI, DCN) parts: DCN takes ``num_slices`` from the outermost axes.

    The DCN-capable axes (``stage``, ``data``) take the slices first. Where they cannot cover them,
    the next axes outermost-first do, with a warning naming the axis that now crosses the slow links
    (``dcn_misplaced`` lists them; ``jaxpar compile`` prices the traffic). Raises only when no split
    exists at all.
    """
    ici, dcn = dict(spec.degrees), {a: 1 for a in spec.axes}
    remaining = num_slices
    for allowed in (True, False):
        for axis in spec.axes:
            if remaining > 1 and (axis in spec.dcn_axes) == allowed and ici[axis] > 1:
                take = math.gcd(ici[axis], remaining)
                ici[axis] //= take
                dcn[axis] *= take
                remaining //= take
    if remaining != 1:
        raise SpecError(f"spec {spec} cannot be split over {num_slices} slices: no axis degrees divide into them")
    misplaced = dcn_misplaced(spec, dcn)
    if misplaced:
        warnings.warn(
            f"spec {spec} on {num_slices} slices puts {misplaced} across the slow links between slices "
            f"(only {sorted(spec.dcn_axes)} should cross them); give 'data' a degree that is a multiple of "
            f"{num_slices}, e.g. data={num_slices}",
            stacklevel=2,
        )
    return ici, dcn


def dcn_misplaced(spec: ParallelSpec, dcn: dict[str, int]) -> list[str]:
    """Axes that cross slices (``dcn``: their DCN degrees) though their traffic should not."""
    return [a for a, d in dcn.items() if d > 1 and a not in spec.dcn_axes]


def make_mesh(spec: ParallelSpec, devices=None, num_slices: int = 1):
    """Build a ``jax.sharding.Mesh`` over the canonical axes (all of them, degree 1 where unused).

    With ``num_slices > 1`` the device order is hybrid: the DCN part of each axis is outermost, so
    that every ICI group lies inside one slice.
    """
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    devices = list(jax.devices() if devices is None else devices)
    if spec.num_devices != len(devices):
        raise SpecError(f"spec {spec} needs {spec.num_devices} devices but {len(devices)} were given")
    if num_slices > 1:
        grid = _hybrid_grid(spec, devices, num_slices)
    elif devices[0].platform == "tpu":
        from jax.experimental import mesh_utils  # follows the physical torus so axes map onto rings

        grid = mesh_utils.create_device_mesh(tuple(spec.degrees.values()), devices, allow_split_physical_axes=True)
    else:
        grid = np.array(devices, dtype=object).reshape(tuple(spec.degrees.values()))
    return Mesh(grid, spec.axes, axis_types=(AxisType.Auto,) * len(spec.axes))


def _hybrid_grid(spec: ParallelSpec, devices, num_slices: int):
    """Device grid whose every axis is (DCN part outer) x (ICI part inner).

    Devices are grouped into slices by ``slice_index`` where JAX reports one (TPU), else into equal
    consecutive blocks (simulated devices, one host per slice)."""
    import numpy as np

    ici, dcn = split_ici_dcn(spec, num_slices)
    if len(devices) % num_slices:
        raise SpecError(f"{len(devices)} devices cannot form {num_slices} equal slices")
    if all(getattr(d, "slice_index", None) is not None for d in devices):
        if devices[0].platform == "tpu":
            from jax.experimental import mesh_utils  # physical torus order inside each slice

            return mesh_utils.create_hybrid_device_mesh(
                list(ici.values()), list(dcn.values()), devices, allow_split_physical_axes=True
            )
        devices = sorted(devices, key=lambda d: (d.slice_index, d.id))
    per_slice = len(devices) // num_slices
    slices = np.array(devices, dtype=object).reshape((num_slices, per_slice))
    # (dcn_0..dcn_5, ici_0..ici_5) -> interleave -> each axis = dcn * ici
    full = slices.reshape(tuple(dcn.values()) + tuple(ici.values()))
    n = len(spec.axes)
    full = full.transpose([i for pair in zip(range(n), range(n, 2 * n)) for i in pair])
    return full.reshape(tuple(spec.degrees.values()))
