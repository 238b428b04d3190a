"""Topology files and their loader: every shipped file is consistent, every bad file is explained."""
import ast
import importlib.util
import math
import pathlib

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

SHIPPED = [
    "cpu-1", "cpu-4", "cpu-8", "tpu-v4-128", "tpu-v5e-256", "tpu-v5p-256", "tpu-v5p-1024",
    "tpu-v6e-256", "tpu-v5p-256x2", "tpu-v6e-256x2", "gpu-h100-8", "gpu-h100-64", "gpu-h200-8",
]

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


# --- TPU slice names, checked by libtpu where it is installed ---------------------------------

@pytest.mark.tpu_aot
@pytest.mark.parametrize("name", [n for n in list_topologies() if n.startswith("tpu-")])
def test_tpu_topology_is_accepted_by_jax(name, monkeypatch):
    pytest.importorskip("libtpu")
    # Ahead-of-time compiles hold no chip; without this a second test process fails on libtpu's lockfile.
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental.topologies import get_topology_desc

    t = load_topology(name)
    devices = get_topology_desc(platform="tpu", topology_name=t.tpu_topology).devices
    # Count chips by coordinates: v4 descriptions list one device per TensorCore (2 per chip).
    coords = {tuple(d.coords) for d in devices}
    assert len(coords) == t.chips_per_slice
    extent = tuple(max(c[i] for c in coords) + 1 for i in range(len(t.ici_shape)))
    assert extent == t.ici_shape
