"""Parallel specs, ICI/DCN split and the hybrid device order."""
import jax
import numpy as np
import pytest

from jaxpar.errors import SpecError
from jaxpar import mesh as mesh_lib
from jaxpar.mesh import make_mesh, split_ici_dcn
from jaxpar.parallel import AXES, DCN_AXES


def parse_spec(text, num_devices):
    return mesh_lib.parse_spec(text, num_devices, AXES, DCN_AXES)


def test_fill_takes_the_remaining_devices():
    spec = parse_spec("data=2,fsdp=-1,tensor=2", 16)
    assert spec.degrees == {"federation": 1, "stage": 1, "data": 2, "fsdp_group": 1, "fsdp": 4, "expert": 1, "block": 1, "context": 1, "context_a2a": 1, "tp_x": 1, "tp_y": 1, "tensor": 2}


@pytest.mark.parametrize(
    "text, culprit",
    [
        ("data=3,fsdp=2", "multiplies to 6"),
        ("data=2,fsdp=-1,tensor=-1", "only one axis"),
        ("model=8", "'model'"),
        ("fsdp=x", "'x'"),
        ("fsdp", "no degree"),
        ("fsdp=0", "degree 0"),
        ("data=3,fsdp=-1", "does not divide"),
    ],
)
def test_bad_specs_name_the_culprit(text, culprit):
    with pytest.raises(SpecError, match=culprit):
        parse_spec(text, 8)


def test_dcn_goes_to_data_and_stage_only():
    ici, dcn = split_ici_dcn(parse_spec("data=4,fsdp=8,tensor=4", 128), 2)
    assert dcn["data"] == 2 and ici["data"] == 2 and all(dcn[a] == 1 for a in AXES if a != "data")
    with pytest.warns(UserWarning, match=r"puts \['fsdp'\] across the slow links.*data=2"):
        ici, dcn = split_ici_dcn(parse_spec("fsdp=8,tensor=2", 16), 2)
    assert dcn["fsdp"] == 2 and ici["fsdp"] == 4


def test_mesh_has_every_canonical_axis_in_order():
    mesh = make_mesh(parse_spec("fsdp=4,tensor=2", 8))
    assert mesh.axis_names == AXES
    assert dict(mesh.shape) == {"federation": 1, "stage": 1, "data": 1, "fsdp_group": 1, "fsdp": 4, "expert": 1, "block": 1, "context": 1, "context_a2a": 1, "tp_x": 1, "tp_y": 1, "tensor": 2}


def test_hybrid_order_keeps_ici_groups_inside_a_slice():
    # 2 slices of 4 devices: slice s holds devices 4s..4s+3
    mesh = make_mesh(parse_spec("data=4,fsdp=2", 8), jax.devices(), num_slices=2)
    ids = np.vectorize(lambda d: d.id)(mesh.devices).squeeze()  # (data=4, fsdp=2)
    slice_of = ids // 4
    # along fsdp (pure ICI) a group never leaves its slice
    assert (slice_of[:, 0] == slice_of[:, 1]).all()
    # data = dcn(2) outer x ici(2) inner: the outer half changes slice, the inner does not
    assert list(slice_of[:, 0]) == [0, 0, 1, 1]
