"""Topology files, TPU slice names and their loader: everything shipped is consistent, every bad name
or file is explained."""
import ast
import dataclasses
import importlib.util
import math
import pathlib
import re

import pytest

from jaxpar.errors import TopologyError
from jaxpar.topology import (
    GIB,
    Topology,
    list_topologies,
    load_topology,
    local_topology,
    meshes_dir,
)
from jaxpar.tpu_slices import GENERATIONS

SHIPPED = [
    "cpu-1", "cpu-4", "cpu-8", "tpu-v4-128", "tpu-v5e-256", "tpu-v5p-256", "tpu-v5p-1024",
    "tpu-v6e-256", "tpu-v5p-256x2", "tpu-v6e-256x2", "gpu-h100-8", "gpu-h100-64", "gpu-h200-8", "gpu-h200-16",
]
TPU_FILES = [n for n in list_topologies() if n.startswith("tpu-")]
SLICES = [name for g in GENERATIONS.values() for name in g.slices]

# A valid file; each bad-input case below edits one line of it.
GOOD = """\
name = "good"
platform = "tpu"
chip = "tpu-v5p"
num_chips = 64
ici_shape = [4, 4, 4]
dcn_shape = [1]
tpu_topology = "v5p:4x4x4"
peak_bf16_tflops = 459.0
hbm_gib = 95
hbm_bandwidth_gbps = 2765.0
ici_links_per_chip = 6
ici_bandwidth_gbps = 100.0
dcn_bandwidth_gbps = 6.25
"""


def write(tmp_path: pathlib.Path, text: str, name: str = "good") -> pathlib.Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


def edit(key: str, line: str | None) -> str:
    """GOOD with the line of `key` replaced by `line` (None deletes it)."""
    out = [(line if l.startswith(f"{key} =") else l) for l in GOOD.splitlines()]
    return "\n".join(l for l in out if l is not None) + "\n"


def test_stage_links_are_read_in_megabits_and_milliseconds(tmp_path):
    t = load_topology(write(tmp_path, GOOD + "stage_link_mbps = 200\nstage_link_latency_ms = 50\n"))
    assert (t.stage_link_bandwidth, t.stage_link_latency) == (25e6, 0.05)  # bytes/s, seconds
    assert load_topology(write(tmp_path, GOOD)).stage_link_bandwidth == 0.0  # none: the stages ride the links above
    with pytest.raises(TopologyError, match=r"'stage_link_mbps' must be positive, got -1"):
        load_topology(write(tmp_path, GOOD + "stage_link_mbps = -1\n"))


# --- shipped files ---------------------------------------------------------------------------

def test_all_required_topologies_are_shipped():
    assert set(SHIPPED) <= set(list_topologies())
    assert list_topologies() == sorted(list_topologies())


@pytest.mark.parametrize("name", list_topologies())
def test_shipped_file_loads_and_is_consistent(name):
    t = load_topology(name)
    assert t.name == name
    assert t.num_chips == math.prod(t.ici_shape) * math.prod(t.dcn_shape)
    assert t.num_chips == t.num_slices * t.chips_per_slice
    assert t.platform in ("cpu", "tpu", "gpu")
    assert (t.tpu_topology is not None) == (t.platform == "tpu")
    assert pathlib.Path(t.source) == meshes_dir() / f"{name}.toml"
    for v in (t.ici_bandwidth, t.dcn_bandwidth, t.hbm_bytes, t.hbm_bandwidth, t.peak_bf16_flops):
        assert v > 0
    # Every shipped number names its source: files carry comments beyond the header.
    text = (meshes_dir() / f"{name}.toml").read_text()
    assert text.count("#") >= 2


@pytest.mark.parametrize(
    "name, chips, slices",
    [
        ("tpu-v5p-256", 128, 1),  # v5p named by TensorCores
        ("tpu-v5p-1024", 512, 1),
        ("tpu-v4-128", 64, 1),  # v4 named by TensorCores
        ("tpu-v5e-256", 256, 1),  # v5e named by chips
        ("tpu-v6e-256", 256, 1),  # v6e named by chips
        ("tpu-v5p-256x2", 256, 2),
        ("tpu-v6e-256x2", 512, 2),
        ("gpu-h100-8", 8, 1),
        ("gpu-h100-64", 64, 8),
        ("cpu-8", 8, 1),
        ("cpu-4", 4, 1),
        ("cpu-1", 1, 1),
    ],
)
def test_chip_counts_follow_google_naming(name, chips, slices):
    t = load_topology(name)
    assert (t.num_chips, t.num_slices, t.is_multi_slice) == (chips, slices, slices > 1)


def test_units_are_converted_to_bytes_and_flops():
    t = load_topology("tpu-v5p-256")
    assert t.peak_bf16_flops == 459e12
    assert t.hbm_bytes == 95 * GIB
    assert t.hbm_bandwidth == 2765e9
    assert t.ici_bandwidth == 100e9 and t.ici_links_per_chip == 6
    assert t.dcn_bandwidth == 6.25e9
    assert t.tpu_topology == "v5p:4x4x8" and t.ici_shape == (4, 4, 8)


def test_load_by_path_equals_load_by_name():
    assert load_topology(meshes_dir() / "cpu-8.toml") == load_topology("cpu-8")


def test_topology_is_frozen():
    with pytest.raises(AttributeError):
        load_topology("cpu-8").num_chips = 4


def test_meshes_dir_holds_every_file_of_the_top_level_meshes(monkeypatch):
    # the checkout's meshes/ is what a wheel ships as jaxpar/meshes/ (pyproject.toml's package-dir)
    monkeypatch.delenv("JAXPAR_MESHES", raising=False)
    top = pathlib.Path(__file__).resolve().parent.parent / "meshes"
    names = sorted(p.name for p in top.iterdir() if p.suffix == ".toml" or p.name == "README.md")
    assert "cpu-8.toml" in names and "README.md" in names
    assert {n: (meshes_dir() / n).read_text() for n in names} == {n: (top / n).read_text() for n in names}


def test_meshes_dir_follows_env(tmp_path, monkeypatch):
    write(tmp_path, GOOD)
    monkeypatch.setenv("JAXPAR_MESHES", str(tmp_path))
    assert meshes_dir() == tmp_path
    assert list_topologies() == ["good"]
    assert load_topology("good").num_chips == 64


# --- bad input -------------------------------------------------------------------------------

def test_unknown_name_lists_known_and_suggests_closest():
    with pytest.raises(TopologyError) as e:
        load_topology("tpu-v5p-265")
    msg = str(e.value)
    assert "'tpu-v5p-265'" in msg
    assert "Did you mean 'tpu-v5p-256'" in msg
    assert all(name in msg for name in SHIPPED)


def test_missing_path_is_named(tmp_path):
    with pytest.raises(TopologyError, match="nope.toml"):
        load_topology(tmp_path / "nope.toml")


def test_invalid_toml_names_the_line(tmp_path):
    path = write(tmp_path, GOOD.replace('chip = "tpu-v5p"', "chip = tpu v5p"))
    with pytest.raises(TopologyError) as e:
        load_topology(path)
    assert str(path) in str(e.value) and "line 3" in str(e.value)


@pytest.mark.parametrize(
    "key, line, expected",
    [
        # missing required keys
        ("hbm_gib", None, ["missing required key 'hbm_gib'"]),
        ("platform", None, ["missing required key 'platform'"]),
        # wrong types
        ("num_chips", 'num_chips = "64"', ["'num_chips'", "integer", "'64'"]),
        ("num_chips", "num_chips = 64.0", ["'num_chips'", "integer"]),
        ("ici_links_per_chip", "ici_links_per_chip = true", ["'ici_links_per_chip'", "integer"]),
        ("hbm_gib", 'hbm_gib = "95"', ["'hbm_gib'", "number"]),
        ("ici_shape", 'ici_shape = "4x4x4"', ["'ici_shape'", "array"]),
        ("ici_shape", "ici_shape = [4, 4.5, 4]", ["'ici_shape'", "array of integers"]),
        ("dcn_shape", "dcn_shape = []", ["'dcn_shape'", "non-empty"]),
        ("chip", "chip = 5", ["'chip'", "string"]),
        # non-positive numbers
        ("hbm_gib", "hbm_gib = 0", ["'hbm_gib'", "positive"]),
        ("peak_bf16_tflops", "peak_bf16_tflops = -1.0", ["'peak_bf16_tflops'", "positive"]),
        ("ici_shape", "ici_shape = [4, 0, 4]", ["'ici_shape'", "positive"]),
        # chip count disagrees with the shapes
        ("num_chips", "num_chips = 128", ["'num_chips' is 128", "= 64"]),
        ("dcn_shape", "dcn_shape = [2]", ["'num_chips' is 64", "= 128"]),
        # platform outside cpu/tpu/gpu
        ("platform", 'platform = "npu"', ["'platform'", "'npu'", "cpu, tpu, gpu"]),
        # a typo'd key
        ("hbm_gib", "hbm_gb = 95", ["unknown key 'hbm_gb'", "did you mean 'hbm_gib'"]),
        # TPU files need a slice name that matches ici_shape
        ("tpu_topology", None, ["'tpu_topology' is missing"]),
        ("tpu_topology", 'tpu_topology = "v5p:4x4x8"', ["'tpu_topology'", "[4, 4, 4]"]),
        ("tpu_topology", 'tpu_topology = "v5p-128"', ["'tpu_topology'", "<version>:<AxBxC>"]),
        # name must match the file
        ("name", 'name = "other"', ["'name' is 'other'", "good.toml"]),
    ],
)
def test_bad_file_names_file_and_culprit(tmp_path, key, line, expected):
    path = write(tmp_path, edit(key, line))
    with pytest.raises(TopologyError) as e:
        load_topology(path)
    msg = str(e.value)
    assert str(path) in msg
    for part in expected:
        assert part in msg
    assert isinstance(e.value, ValueError)


def test_good_fixture_is_valid(tmp_path):
    # Guards the cases above: each one fails only because of its own edit.
    assert load_topology(write(tmp_path, GOOD)).num_chips == 64


# --- local devices ---------------------------------------------------------------------------

def test_local_topology_sees_eight_simulated_cpus():
    t = local_topology()
    assert isinstance(t, Topology)
    assert (t.name, t.platform, t.num_chips, t.num_slices) == ("cpu-8", "cpu", 8, 1)
    assert t.ici_shape == (8,) and not t.is_multi_slice


def test_topology_module_does_not_import_jax_at_top_level():
    src = pathlib.Path(importlib.util.find_spec("jaxpar.topology").origin).read_text()
    top = ast.parse(src).body
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in top if isinstance(n, ast.ImportFrom) and n.module]
    assert not [m for m in names if m == "jax" or m.startswith("jax.")]


# --- TPU slices by Google's name ---------------------------------------------------------------

@pytest.mark.parametrize(
    "name, chips, ici_shape, tpu_topology, slices",
    [
        ("v5p-64", 32, (4, 4, 2), "v5p:4x4x2", 1),  # v5p names count TensorCores, 2 per chip
        ("v4-32", 16, (2, 2, 4), "v4:2x2x4", 1),  # so do v4 names
        ("v5e-16", 16, (4, 4), "v5e:4x4", 1),  # v5e names count chips
        ("v6e-128", 128, (8, 16), "v6e:8x16", 1),  # so do v6e names
        ("2xv5p-64", 64, (4, 4, 2), "v5p:4x4x2", 2),  # two slices over DCN; tpu_topology is one
    ],
)
def test_tpu_slice_by_name(name, chips, ici_shape, tpu_topology, slices):
    t = load_topology(name)
    assert (t.name, t.platform, t.num_chips) == (name, "tpu", chips)
    assert (t.ici_shape, t.tpu_topology) == (ici_shape, tpu_topology)
    assert (t.dcn_shape, t.num_slices, t.chips_per_slice) == ((slices,), slices, chips // slices)


def file_to_slice_name(file_name: str) -> str:
    """``tpu-v5p-256x2`` (file: count last) -> ``2xv5p-256`` (slice name: count first)."""
    one_slice, count = re.fullmatch(r"tpu-(v\w+-\d+)(?:x(\d+))?", file_name).groups()
    return f"{count}x{one_slice}" if count else one_slice


@pytest.mark.parametrize("name", TPU_FILES)
def test_shipped_tpu_file_equals_the_slice_of_its_name(name):
    # The table and the files carry the same figures; this keeps them from drifting apart.
    from_file = load_topology(name)
    from_table = load_topology(file_to_slice_name(name))
    assert dataclasses.replace(from_table, name=from_file.name, source=from_file.source) == from_file


def test_every_generation_has_a_shipped_file_to_agree_with():
    assert {load_topology(n).chip for n in TPU_FILES} == {f"tpu-{g}" for g in GENERATIONS}


@pytest.mark.parametrize("generation", list(GENERATIONS))
def test_generation_table_is_consistent(generation):
    g = GENERATIONS[generation]
    assert all(len(shape) == g.torus_dims for shape in g.shapes)
    assert g.ici_links_per_chip == 2 * g.torus_dims  # one link each way along each torus dimension
    chips = [math.prod(shape) for shape in g.shapes]
    assert chips == sorted(set(chips))  # smallest first, one shape per size


@pytest.mark.parametrize(
    "name, expected",
    [
        ("v3-8", ["'v3'", "'v3-8'", "v4, v5e, v5p, v6e"]),
        ("v7x-8", ["'v7x'", "v4, v5e, v5p, v6e"]),
        ("v5p-63", ["'v5p-63'", "TensorCores (2 per chip)", "v5p slices: v5p-8, v5p-16, v5p-32, v5p-64, v5p-128,"]),
        ("v5p-65", ["'v5p-65'", "v5p-64, v5p-128"]),
        ("v5e-12", ["'v5e-12'", "count chips", "v5e slices: v5e-4, v5e-8, v5e-16, v5e-32,"]),
        ("v4-64x2", ["'v4-64x2'", "Known topologies"]),  # the file-style multi-slice order is not a slice name
        ("2xv6e-100", ["'2xv6e-100'", "v6e slices: v6e-4,"]),
        ("0xv5p-64", ["'0xv5p-64'", "0 slices", "2xv5p-64"]),
    ],
)
def test_bad_slice_name_lists_the_valid_ones(name, expected):
    with pytest.raises(TopologyError) as e:
        load_topology(name)
    for part in expected:
        assert part in str(e.value)


def test_unknown_name_mentions_slice_names():
    with pytest.raises(TopologyError) as e:
        load_topology("h100")
    assert "TPU slice by Google's name (v5p-64" in str(e.value) and "2xv5p-64" in str(e.value)


def test_file_style_name_of_a_slice_suggests_the_slice():
    with pytest.raises(TopologyError, match="Did you mean the slice 'v5p-64'"):
        load_topology("tpu-v5p-64")


def test_file_wins_over_slice_of_the_same_name(tmp_path, monkeypatch):
    write(tmp_path, edit("name", 'name = "v5p-64"'), name="v5p-64")  # 64 chips; the table's v5p-64 has 32
    monkeypatch.setenv("JAXPAR_MESHES", str(tmp_path))
    assert load_topology("v5p-64").num_chips == 64


# --- TPU topologies, checked by libtpu where it is installed ----------------------------------

def described_chips(t: Topology, monkeypatch) -> set[tuple]:
    """(slice, chip coordinates) of every device libtpu describes for ``t``."""
    pytest.importorskip("libtpu", reason="libtpu describes TPU topologies; pip install -e .[tpu]")
    # Ahead-of-time compiles hold no chip; without this a second test process fails on libtpu's lockfile.
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental.topologies import get_topology_desc

    kwargs = {"num_slices": t.num_slices} if t.is_multi_slice else {}
    devices = get_topology_desc(platform="tpu", topology_name=t.tpu_topology, **kwargs).devices
    # By coordinates, not devices: v4 descriptions list one device per TensorCore (2 per chip).
    # Single-slice devices have no slice_index.
    return {(getattr(d, "slice_index", 0), tuple(d.coords)) for d in devices}


@pytest.mark.tpu_aot
@pytest.mark.parametrize("name", TPU_FILES + SLICES + ["2xv5p-64", "2xv5e-16", "2xv4-32"])
def test_tpu_topology_is_accepted_by_jax(name, monkeypatch):
    t = load_topology(name)
    chips = described_chips(t, monkeypatch)
    assert len(chips) == t.num_chips
    assert len({s for s, _ in chips}) == t.num_slices
    extent = tuple(max(c[i] for _, c in chips) + 1 for i in range(len(t.ici_shape)))
    assert extent == t.ici_shape
