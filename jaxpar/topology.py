"""Topologies: the hardware a layout runs on, read from ``meshes/<name>.toml``, built from a TPU
slice name (``v5p-64``, ``2xv5p-64``: the table in ``jaxpar/tpu_slices.py``), or from JAX's devices.

The TOML schema is documented in ``meshes/README.md``. Files use vendor units (GB/s, GiB, TFLOP/s);
a ``Topology`` holds SI base units (bytes, bytes/s, FLOP/s) so that cost models never convert.

A heterogeneous file holds several device groups (``[[groups]]``: a node of H100s and a node of
A100s, two TPU generations), each with its own chip figures, and the bandwidth between groups. Its
``Topology`` keeps the one-kind fields every other module reads, as the cluster would be if every
chip were its slowest kind (the smallest HBM, FLOP/s and links), and lists the groups in
``groups``; only the planner (``jaxpar.planner``) prices each group at its own speed. A file
without groups is one group (``device_groups``).
JAX is imported only inside ``local_topology()``: reading a file must not initialise a backend.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import pathlib
import tomllib
from dataclasses import dataclass

from jaxpar.errors import TopologyError
from jaxpar.tpu_slices import GENERATIONS, parse_slice_name

PLATFORMS = ("cpu", "tpu", "gpu")
GB, GIB, TERA = 1e9, 2**30, 1e12


@dataclass(frozen=True)
class DeviceGroup:
    """Chips of one kind in a cluster, with their own figures (SI units, as ``Topology``'s)."""

    name: str
    chip: str
    num_chips: int
    ici_shape: tuple[int, ...]  # one node / slice of this group
    dcn_shape: tuple[int, ...]  # its nodes / slices
    ici_bandwidth: float
    ici_links_per_chip: int
    dcn_bandwidth: float  # between this group's own nodes
    hbm_bytes: int
    hbm_bandwidth: float
    peak_bf16_flops: float
    tpu_topology: str | None = None


@dataclass(frozen=True)
class Topology:
    name: str
    platform: str
    chip: str
    num_chips: int
    ici_shape: tuple[int, ...]  # chip grid of one slice / node
    dcn_shape: tuple[int, ...]  # slices / nodes
    ici_bandwidth: float  # bytes/s per link, one direction
    ici_links_per_chip: int
    dcn_bandwidth: float  # bytes/s per chip, one direction
    hbm_bytes: int
    hbm_bandwidth: float  # bytes/s
    peak_bf16_flops: float  # FLOP/s per chip
    tpu_topology: str | None = None  # one slice, as get_topology_desc takes it
    source: str = ""  # path of the file it came from
    groups: tuple[DeviceGroup, ...] = ()  # a heterogeneous cluster's device groups (empty: one kind)
    group_bandwidth: float = 0.0  # bytes/s per chip between groups, one direction (heterogeneous only)
    # a pipeline's links between stages where they are slower than the rest (internet-grade: 80-200
    # Mb/s, 50 ms): bytes/s one direction and seconds before a transfer's first byte; 0: the stages
    # are joined by the links above
    stage_link_bandwidth: float = 0.0
    stage_link_latency: float = 0.0

    @property
    def is_heterogeneous(self) -> bool:
        return len(self.groups) > 1

    @property
    def device_groups(self) -> tuple[DeviceGroup, ...]:
        """The groups of chips of one kind, in device order: a one-kind topology is one group."""
        if self.groups:
            return self.groups
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(DeviceGroup) if f.name != "name"}
        return (DeviceGroup(name=self.chip, **fields),)

    def group_view(self, group: DeviceGroup) -> Topology:
        """``group`` alone as a one-kind Topology (the cost models' unit: one kind, ICI and DCN)."""
        fields = {f.name: getattr(group, f.name) for f in dataclasses.fields(DeviceGroup) if f.name != "name"}
        return Topology(name=f"{self.name}/{group.name}", platform=self.platform, source=self.source, **fields)

    @property
    def num_slices(self) -> int:
        return math.prod(self.dcn_shape)

    @property
    def chips_per_slice(self) -> int:
        return math.prod(self.ici_shape)

    @property
    def is_multi_slice(self) -> bool:
        return self.num_slices > 1


# TOML key -> (kind, unit factor into the Topology field). Kinds: str, int, num, shape.
_KEYS = {
    "name": ("str", None),
    "platform": ("str", None),
    "chip": ("str", None),
    "num_chips": ("int", None),
    "ici_shape": ("shape", None),
    "dcn_shape": ("shape", None),
    "ici_bandwidth_gbps": ("num", GB),
    "ici_links_per_chip": ("int", None),
    "dcn_bandwidth_gbps": ("num", GB),
    "hbm_gib": ("num", GIB),
    "hbm_bandwidth_gbps": ("num", GB),
    "peak_bf16_tflops": ("num", TERA),
    "tpu_topology": ("str", None),
    "stage_link_mbps": ("num", None),
    "stage_link_latency_ms": ("num", None),
}
_OPTIONAL = {"tpu_topology", "stage_link_mbps", "stage_link_latency_ms"}
_EXAMPLES = {"str": '"text"', "int": "8", "num": "100.0", "shape": "[4, 4, 8]"}


def meshes_dir() -> pathlib.Path:
    """``$JAXPAR_MESHES`` if set, else the topology files: ``jaxpar/meshes/`` where the package is
    installed (a wheel ships the repository's ``meshes/`` there, see pyproject.toml), else the top-level
    ``meshes/`` beside the package in a source checkout (run in place or installed editable)."""
    env = os.environ.get("JAXPAR_MESHES")
    if env:
        return pathlib.Path(env)
    package = pathlib.Path(__file__).resolve().parent
    shipped = package / "meshes"
    return shipped if shipped.is_dir() else package.parent / "meshes"


def list_topologies() -> list[str]:
    """Sorted names of the topology files in ``meshes_dir()``."""
    d = meshes_dir()
    return sorted(p.stem for p in d.glob("*.toml")) if d.is_dir() else []


def load_topology(name_or_path: str | os.PathLike) -> Topology:
    """Load a topology by name (``"tpu-v5p-256"``, from ``meshes_dir()``), by TPU slice name
    (``"v5p-64"``, ``"2xv5p-64"``: see ``tpu_slice``) or by path to a .toml file.

    A file in ``meshes_dir()`` wins over a slice of the same name, so a custom file can replace one."""
    s = str(name_or_path)
    looks_like_path = s.endswith(".toml") or os.sep in s or "/" in s
    path = pathlib.Path(s) if looks_like_path else meshes_dir() / f"{s}.toml"
    if not path.is_file():
        if looks_like_path:
            raise TopologyError(f"topology file {path} does not exist; give an existing .toml file")
        slice_topology = tpu_slice(s)
        if slice_topology is None:
            raise TopologyError(_unknown_name(s))
        return slice_topology
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:  # its message names the line and column
        raise TopologyError(f"{path}: not valid TOML: {e}; fix the syntax there") from None
    return _from_dict(data, path)


def tpu_slice(name: str) -> Topology | None:
    """The Topology of a Cloud TPU slice by Google's name: ``"v5p-64"`` (32 chips: v4 and v5p names
    count TensorCores), ``"v5e-16"`` (16 chips: v5e and v6e names count chips), ``"2xv5p-64"`` (two
    slices over DCN). None when ``name`` is not shaped like a slice name; TopologyError listing the
    valid ones when it is but names no generation or size in ``jaxpar.tpu_slices.GENERATIONS``."""
    parsed = parse_slice_name(name)
    if parsed is None:
        return None
    g, shape, num_slices = parsed
    return Topology(
        name=name, platform="tpu", chip=f"tpu-{g.name}",
        num_chips=math.prod(shape) * num_slices, ici_shape=shape, dcn_shape=(num_slices,),
        ici_bandwidth=g.ici_bandwidth_gbps * GB, ici_links_per_chip=g.ici_links_per_chip,
        dcn_bandwidth=g.dcn_bandwidth_gbps * GB,
        hbm_bytes=int(g.hbm_gib * GIB), hbm_bandwidth=g.hbm_bandwidth_gbps * GB,
        peak_bf16_flops=g.peak_bf16_tflops * TERA,
        tpu_topology=f"{g.name}:{'x'.join(map(str, shape))}", source="jaxpar/tpu_slices.py",
    )


def _unknown_name(name: str) -> str:
    known = list_topologies()
    bare = name.removeprefix("tpu-")  # a file-style name for a slice that has no file
    try:
        is_slice = bare != name and parse_slice_name(bare) is not None
    except TopologyError:  # shaped like a slice name, but not one in the table
        is_slice = False
    if is_slice:
        hint = f" Did you mean the slice {bare!r}?"
    else:
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
        hint = f" Did you mean {close[0]!r}?" if close else ""
    return (
        f"unknown topology {name!r}.{hint} Known topologies in {meshes_dir()}: "
        f"{', '.join(known) or '(none)'}. Pass one of these, a TPU slice by Google's name "
        f"(v5p-64, v5e-16, 2xv5p-64; generations {', '.join(GENERATIONS)}), a path to a .toml file, "
        f"or add {name}.toml there (schema in meshes/README.md)."
    )


def _check_value(key: str, value, kind: str, where: str):
    """Type and sign of one value; returns it normalised (shapes as tuples)."""
    bad_type = {
        "str": not isinstance(value, str),
        # bool is an int in Python; `true` is never a chip count.
        "int": not isinstance(value, int) or isinstance(value, bool),
        "num": not isinstance(value, (int, float)) or isinstance(value, bool),
        "shape": not isinstance(value, list)
        or not value
        or any(not isinstance(v, int) or isinstance(v, bool) for v in value),
    }[kind]
    if bad_type:
        want = {"str": "a string", "int": "an integer", "num": "a number",
                "shape": "a non-empty array of integers"}[kind]
        raise TopologyError(
            f"{where}: key {key!r} must be {want}, got {value!r} ({type(value).__name__}); "
            f"write e.g. {key} = {_EXAMPLES[kind]}"
        )
    if kind == "str" and not value.strip():
        raise TopologyError(f"{where}: key {key!r} is empty; give it a value")
    if kind in ("int", "num") and not value > 0:
        raise TopologyError(f"{where}: key {key!r} must be positive, got {value!r}")
    if kind == "shape":
        if any(v <= 0 for v in value):
            raise TopologyError(f"{where}: every entry of {key!r} must be positive, got {value!r}")
        return tuple(value)
    return value


def _checked_keys(data: dict, keys: dict, optional: set, where: str) -> dict:
    """Every key known and present, every value of its kind and sign (normalised)."""
    for key in data:
        if key not in keys:
            close = difflib.get_close_matches(key, list(keys), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TopologyError(f"{where}: unknown key {key!r}{hint} (keys: meshes/README.md)")
    missing = [k for k in keys if k not in data and k not in optional]
    if missing:
        raise TopologyError(
            f"{where}: missing required key {missing[0]!r}"
            + (f" (also missing: {', '.join(missing[1:])})" if missing[1:] else "")
            + f"; add e.g. {missing[0]} = {_EXAMPLES[keys[missing[0]][0]]} (meaning: meshes/README.md)"
        )
    return {k: _check_value(k, data[k], keys[k][0], where) for k in data}


def _from_dict(data: dict, path: pathlib.Path) -> Topology:
    where = str(path)
    if "groups" in data:
        return _from_groups(data, path)
    v = _checked_keys(data, _KEYS, _OPTIONAL, where)

    if v["platform"] not in PLATFORMS:
        raise TopologyError(
            f"{where}: key 'platform' is {v['platform']!r}; it must be one of {', '.join(PLATFORMS)}"
        )
    _check_name(v["name"], path)
    _check_chip_count(v, where)
    if v["platform"] == "tpu":
        _check_tpu_topology(v, where)

    return Topology(
        name=v["name"], platform=v["platform"], chip=v["chip"], num_chips=v["num_chips"],
        ici_shape=v["ici_shape"], dcn_shape=v["dcn_shape"],
        ici_bandwidth=float(v["ici_bandwidth_gbps"]) * GB,
        ici_links_per_chip=v["ici_links_per_chip"],
        dcn_bandwidth=float(v["dcn_bandwidth_gbps"]) * GB,
        hbm_bytes=int(v["hbm_gib"] * GIB),
        hbm_bandwidth=float(v["hbm_bandwidth_gbps"]) * GB,
        peak_bf16_flops=float(v["peak_bf16_tflops"]) * TERA,
        tpu_topology=v.get("tpu_topology"), source=where,
        stage_link_bandwidth=v.get("stage_link_mbps", 0.0) * 1e6 / 8, stage_link_latency=v.get("stage_link_latency_ms", 0.0) / 1e3,
    )


def _check_name(name: str, path: pathlib.Path) -> None:
    if name != path.stem:
        raise TopologyError(
            f"{path}: key 'name' is {name!r} but the file is {path.name}; "
            f"name the file {name}.toml or set name = {path.stem!r}"
        )


def _check_chip_count(v: dict, where: str) -> None:
    expected = math.prod(v["ici_shape"]) * math.prod(v["dcn_shape"])
    if v["num_chips"] != expected:
        raise TopologyError(
            f"{where}: key 'num_chips' is {v['num_chips']} but prod(ici_shape={list(v['ici_shape'])}) "
            f"* prod(dcn_shape={list(v['dcn_shape'])}) = {expected}; fix num_chips or the shapes"
        )


# A heterogeneous file: these keys at the top, and one [[groups]] table per kind of chip with the
# one-kind keys but name and platform (a group's name is its own label)
_CLUSTER_KEYS = {"name": ("str", None), "platform": ("str", None), "num_chips": ("int", None),
                 "group_bandwidth_gbps": ("num", GB), "groups": ("groups", None)}
_GROUP_KEYS = {k: kind for k, kind in _KEYS.items() if k != "platform"}


def _from_groups(data: dict, path: pathlib.Path) -> Topology:
    """A heterogeneous cluster: each group checked as a one-kind file is, then the whole."""
    where = str(path)
    top = _checked_keys({k: v for k, v in data.items() if k != "groups"}, _CLUSTER_KEYS, {"groups"}, where)
    if top["platform"] not in PLATFORMS:
        raise TopologyError(f"{where}: key 'platform' is {top['platform']!r}; it must be one of {', '.join(PLATFORMS)}")
    _check_name(top["name"], path)
    tables = data["groups"]
    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        raise TopologyError(f"{where}: 'groups' must be one or more [[groups]] tables (a node of one kind of chip each)")
    groups = tuple(_group(table, i, top["platform"], where) for i, table in enumerate(tables))
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        raise TopologyError(f"{where}: group names {names} repeat; give every [[groups]] table its own name")
    total = sum(g.num_chips for g in groups)
    if top["num_chips"] != total:
        raise TopologyError(f"{where}: key 'num_chips' is {top['num_chips']} but the groups hold {total} chips "
                            f"({', '.join(f'{g.name} {g.num_chips}' for g in groups)}); fix num_chips or a group's")
    return _cluster(top, groups, where)


def _group(table: dict, index: int, platform: str, where: str) -> DeviceGroup:
    at = f"{where}: group {table.get('name', index)!r}"
    v = _checked_keys(table, _GROUP_KEYS, _OPTIONAL, at)
    _check_chip_count(v, at)
    if platform == "tpu":
        _check_tpu_topology(v, at)
    return DeviceGroup(
        name=v["name"], chip=v["chip"], num_chips=v["num_chips"], ici_shape=v["ici_shape"], dcn_shape=v["dcn_shape"],
        ici_bandwidth=float(v["ici_bandwidth_gbps"]) * GB, ici_links_per_chip=v["ici_links_per_chip"],
        dcn_bandwidth=float(v["dcn_bandwidth_gbps"]) * GB, hbm_bytes=int(v["hbm_gib"] * GIB),
        hbm_bandwidth=float(v["hbm_bandwidth_gbps"]) * GB, peak_bf16_flops=float(v["peak_bf16_tflops"]) * TERA,
        tpu_topology=v.get("tpu_topology"),
    )


def _cluster(top: dict, groups: tuple[DeviceGroup, ...], where: str) -> Topology:
    """The one-kind view of a cluster: every chip as the slowest of its kinds, in nodes of the
    largest size every group's nodes divide into (what a mesh over all of them can assume)."""
    node = math.gcd(*(math.prod(g.ici_shape) for g in groups))
    same = all(g.ici_shape == groups[0].ici_shape for g in groups)
    between = float(top["group_bandwidth_gbps"]) * GB
    topologies = {g.tpu_topology for g in groups}
    return Topology(
        name=top["name"], platform=top["platform"], chip="+".join(dict.fromkeys(g.chip for g in groups)),
        num_chips=top["num_chips"], ici_shape=groups[0].ici_shape if same else (node,),
        dcn_shape=(top["num_chips"] // (math.prod(groups[0].ici_shape) if same else node),),
        ici_bandwidth=min(g.ici_bandwidth for g in groups), ici_links_per_chip=min(g.ici_links_per_chip for g in groups),
        dcn_bandwidth=min([between] + [g.dcn_bandwidth for g in groups if g.num_chips > math.prod(g.ici_shape)]),
        hbm_bytes=min(g.hbm_bytes for g in groups), hbm_bandwidth=min(g.hbm_bandwidth for g in groups),
        peak_bf16_flops=min(g.peak_bf16_flops for g in groups),
        tpu_topology=topologies.pop() if len(topologies) == 1 and same else None, source=where,
        groups=groups, group_bandwidth=between,
    )


def _check_tpu_topology(v: dict, where: str) -> None:
    """A TPU file names its slice for ahead-of-time compiles, and that slice must be ici_shape."""
    topo = v.get("tpu_topology")
    shape_text = "x".join(map(str, v["ici_shape"]))
    if topo is None:
        raise TopologyError(
            f"{where}: platform is 'tpu' but key 'tpu_topology' is missing; add e.g. "
            f"tpu_topology = \"v5p:{shape_text}\" (one slice, as get_topology_desc takes it)"
        )
    kind, _, dims = topo.partition(":")
    try:
        topo_shape = tuple(int(d) for d in dims.split("x"))
    except ValueError:
        topo_shape = None
    if not kind or topo_shape is None:
        raise TopologyError(
            f"{where}: key 'tpu_topology' is {topo!r}; write it as \"<version>:<AxBxC>\", "
            f"e.g. \"v5p:{shape_text}\""
        )
    if topo_shape != v["ici_shape"]:
        raise TopologyError(
            f"{where}: key 'tpu_topology' is {topo!r} but ici_shape is {list(v['ici_shape'])}; "
            f"they describe the same slice, so make them agree (e.g. \"{kind}:{shape_text}\")"
        )


def local_topology() -> Topology:
    """The devices JAX sees here, as one slice named like ``cpu-8``.

    Only the count and platform are real; bandwidths and FLOP/s are nominal (JAX does not report
    them). HBM is the device's memory limit where the backend reports one.
    """
    import jax  # here, not at module import: loading files must not start a backend

    devices = jax.devices()
    n, platform = len(devices), devices[0].platform
    stats = devices[0].memory_stats() or {}  # None on CPU
    return Topology(
        name=f"{platform}-{n}", platform=platform,
        chip="cpu" if platform == "cpu" else devices[0].device_kind,
        num_chips=n, ici_shape=(n,), dcn_shape=(1,),
        ici_bandwidth=10 * GB, ici_links_per_chip=1, dcn_bandwidth=1 * GB,  # nominal
        hbm_bytes=int(stats.get("bytes_limit", 16 * GIB)),  # nominal where unreported
        hbm_bandwidth=50 * GB, peak_bf16_flops=1 * TERA,  # nominal
        source="jax.devices()",
    )
