"""jaxpar.analysis.hlo on programs compiled here (8 simulated CPU devices) and on HLO snippets in
the formats other backends print (GPU async pairs, TPU loops without known_trip_count)."""
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.analysis.hlo import (Collective, by_axes, collectives, replica_groups, shape_bytes,
                                 summarize)

AUTO = jax.sharding.AxisType.Auto
X = jnp.ones((8, 16, 32), jnp.float32)  # sharded P('a','b','c') on 2x2x2: local (4, 8, 16)
LOCAL = 4 * 8 * 16 * 4  # bytes of one device's block


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(AUTO,) * 3)


def compiled_text(f, *args):
    return jax.jit(f).lower(*args).compile().as_text()


def shard(mesh, body):
    # check_vma=False: outputs of gathers are replicated in ways shard_map cannot prove.
    spec = P("a", "b", "c")
    return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)


def only(cols, kind=None):
    cols = [c for c in cols if kind is None or c.kind == kind]
    assert len(cols) == 1, cols
    return cols[0]


# ---------------------------------------------------------------- one collective each, shard_map


@pytest.mark.parametrize("axes, n", [("b", 2), (("a", "c"), 4), (("a", "b", "c"), 8)])
def test_psum(mesh, axes, n):
    c = only(collectives(compiled_text(shard(mesh, lambda x: jax.lax.psum(x, axes)), X), mesh))
    assert (c.kind, c.dtype, c.group_size, c.executions) == ("all-reduce", "f32", n, 1)
    assert c.mesh_axes == tuple(axes)
    assert c.operand_bytes == c.result_bytes == LOCAL
    assert c.bytes_per_execution == 2 * LOCAL * (n - 1) / n


@pytest.mark.parametrize("axes, n", [("b", 2), (("a", "c"), 4)])
def test_all_gather(mesh, axes, n):
    f = shard(mesh, lambda x: jax.lax.all_gather(x, axes, axis=1, tiled=True))
    c = only(collectives(compiled_text(f, X), mesh))
    assert (c.kind, c.group_size, c.mesh_axes) == ("all-gather", n, tuple(axes))
    assert (c.operand_bytes, c.result_bytes) == (LOCAL, LOCAL * n)
    assert c.bytes_per_execution == LOCAL * n * (n - 1) / n


@pytest.mark.parametrize("axes, n", [("c", 2), (("a", "b"), 4)])
def test_reduce_scatter(mesh, axes, n):
    f = shard(mesh, lambda x: jax.lax.psum_scatter(x, axes, scatter_dimension=1, tiled=True))
    c = only(collectives(compiled_text(f, X), mesh))
    assert (c.kind, c.group_size, c.mesh_axes) == ("reduce-scatter", n, tuple(axes))
    assert (c.operand_bytes, c.result_bytes) == (LOCAL, LOCAL // n)
    assert c.bytes_per_execution == LOCAL * (n - 1) / n


@pytest.mark.parametrize("axes, n", [("a", 2), (("b", "c"), 4)])
def test_all_to_all(mesh, axes, n):
    f = shard(mesh, lambda x: jax.lax.all_to_all(x, axes, 0, 1, tiled=True))
    c = only(collectives(compiled_text(f, X), mesh))
    # CPU splits the operand into a tuple of n pieces: their bytes must add up to the block.
    assert (c.kind, c.group_size, c.mesh_axes) == ("all-to-all", n, tuple(axes))
    assert c.operand_bytes == c.result_bytes == LOCAL
    assert c.bytes_per_execution == LOCAL * (n - 1) / n


def test_ppermute_swap_one_axis(mesh):
    f = shard(mesh, lambda x: jax.lax.ppermute(x, "b", [(0, 1), (1, 0)]))
    c = only(collectives(compiled_text(f, X), mesh))
    assert (c.kind, c.group_size, c.mesh_axes) == ("collective-permute", 2, ("b",))
    assert c.bytes_per_execution == c.operand_bytes == LOCAL


def test_ppermute_ring_two_axes(mesh):
    ring = [(i, (i + 1) % 4) for i in range(4)]
    f = shard(mesh, lambda x: jax.lax.ppermute(x, ("a", "b"), ring))
    c = only(collectives(compiled_text(f, X), mesh))
    assert (c.kind, c.group_size, c.mesh_axes) == ("collective-permute", 4, ("a", "b"))
    assert c.bytes_per_execution == LOCAL


# ---------------------------------------------------------------- loops


def scan5(x):
    def body(c, _):
        return c + jax.lax.psum(c, "b"), None
    return jax.lax.scan(body, x, None, length=5)[0]


def nested(x):
    def inner(c, _):
        return c * 2 + jax.lax.psum(c, "c"), None

    def outer(c, _):
        g = jax.lax.all_gather(c, "a", axis=0, tiled=True)  # once per outer iteration
        return jax.lax.scan(inner, c + g[: c.shape[0]], None, length=4)[0], None
    return jax.lax.scan(outer, x, None, length=3)[0]


def check_scan5(cols):
    c = only(cols)
    assert (c.kind, c.mesh_axes, c.executions) == ("all-reduce", ("b",), 5)
    assert c.bytes_per_step == 5 * 2 * LOCAL * (2 - 1) / 2
    assert summarize(cols)["all-reduce"] == {"count": 5, "bytes_per_device": c.bytes_per_step}


def check_nested(cols):
    ag, ar = only(cols, "all-gather"), only(cols, "all-reduce")
    assert (ag.mesh_axes, ag.executions) == (("a",), 3)
    assert (ar.mesh_axes, ar.executions) == (("c",), 12)


def test_scan_of_5(mesh):
    check_scan5(collectives(compiled_text(shard(mesh, scan5), X), mesh))


def test_nested_scans_3_by_4(mesh):
    check_nested(collectives(compiled_text(shard(mesh, nested), X), mesh))


def test_trip_count_read_from_the_loop_condition(mesh):
    # TPU programs carry no known_trip_count: the count must come from the condition instead.
    for fn, check in [(scan5, check_scan5), (nested, check_nested)]:
        text = compiled_text(shard(mesh, fn), X)
        assert '"known_trip_count"' in text
        stripped = re.sub(r'"known_trip_count":\{"n":"\d+"\}', "", text)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check(collectives(stripped, mesh))


# ---------------------------------------------------------------- device order, GSPMD syntaxes


def test_ids_are_positions_in_the_mesh_not_device_ids():
    order = [3, 1, 4, 0, 7, 5, 2, 6]
    mesh = jax.sharding.Mesh(np.array(jax.devices())[order].reshape(2, 4), ("x", "y"),
                             axis_types=(AUTO, AUTO))
    x = jnp.ones((8, 16))
    for axis in ("x", "y"):
        f = jax.shard_map(lambda v: jax.lax.psum(v, axis), mesh=mesh, in_specs=P("x", "y"),
                          out_specs=P("x", "y"))
        c = only(collectives(compiled_text(f, x), mesh))
        assert c.mesh_axes == (axis,)  # Device.id would give ('x', 'y') for both
    ring = [(i, (i + 1) % 4) for i in range(4)]
    f = jax.shard_map(lambda v: jax.lax.ppermute(v, "y", ring), mesh=mesh, in_specs=P("x", "y"),
                      out_specs=P("x", "y"))
    assert only(collectives(compiled_text(f, x), mesh)).mesh_axes == ("y",)


@pytest.mark.parametrize("shape", [(2, 2, 2), (2, 4), (4, 2)])
def test_gspmd_collectives_span_the_sharded_axes(shape):
    # jit with shardings: XLA's partitioner prints iota and mesh[...] replica groups.
    names = ("a", "b", "c")[: len(shape)]
    mesh = jax.make_mesh(shape, names, axis_types=(AUTO,) * len(shape))
    x = jax.device_put(jnp.ones((64, 32)), NamedSharding(mesh, P(names[0], names[-1])))
    seen = []
    # sum over dim 0: all-reduce over the first axis; replicate: gathers over all the axes used.
    cols = collectives(compiled_text(jax.jit(lambda v: v.sum(0), out_shardings=NamedSharding(
        mesh, P(names[-1]))), x), mesh)
    c = only(cols)
    assert (c.kind, c.mesh_axes, c.operand_bytes) == ("all-reduce", (names[0],), 32 // shape[-1] * 4)
    seen += cols
    cols = collectives(compiled_text(jax.jit(lambda v: v * 2, out_shardings=NamedSharding(
        mesh, P())), x), mesh)
    assert {c.kind for c in cols} == {"all-gather"}
    assert sorted(a for c in cols for a in c.mesh_axes) == sorted({names[0], names[-1]})
    assert sum(c.bytes_per_execution for c in cols) == 64 * 32 * 4 * (1 - 1 / (shape[0] * shape[-1]))
    seen += cols
    assert all(c.group_size == np.prod([mesh.shape[a] for a in c.mesh_axes]) for c in seen)


def test_gspmd_one_axis_mesh():
    # XLA prints a 1-D mesh as mesh['axis_0'=8,'axis_1'=1] {'axis_0'}.
    mesh = jax.make_mesh((8,), ("d",), axis_types=(AUTO,))
    x = jax.device_put(jnp.ones((64, 32)), NamedSharding(mesh, P("d")))
    text = compiled_text(jax.jit(lambda v: v.sum(0), out_shardings=NamedSharding(mesh, P())), x)
    c = only(collectives(text, mesh))
    assert (c.kind, c.group_size, c.mesh_axes, c.operand_bytes) == ("all-reduce", 8, ("d",), 128)


def test_gspmd_iota_groups():
    # A matmul whose contraction is sharded: XLA prints iota groups such as [4,2]<=[2,4]T(1,0).
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AUTO, AUTO))
    v = jax.device_put(jnp.ones((64, 32)), NamedSharding(mesh, P("x", "y")))
    text = compiled_text(jax.jit(lambda a: a.T @ a, out_shardings=NamedSharding(mesh, P("x"))), v)
    assert "<=[" in text
    cols = collectives(text, mesh)
    # Whatever plan XLA picks (it differs under an outer jit): the contraction is sharded over
    # x, so partial sums are reduced over x; gathers bring in the y shards (possibly half at a time).
    assert [(c.mesh_axes, c.group_size) for c in cols if c.kind == "all-reduce"] == [(("x",), 2)]
    gathers = [c for c in cols if c.kind == "all-gather"]
    assert gathers and all(c.mesh_axes == ("y",) and c.group_size in (2, 4) for c in gathers)


def test_gspmd_groups_equal_shard_map_groups(mesh):
    # The same reduction written both ways must give the same groups, whatever the syntax.
    x = jax.device_put(jnp.ones((16, 16)), NamedSharding(mesh, P(None, "b")))
    gspmd = compiled_text(jax.jit(lambda v: v.sum(1), out_shardings=NamedSharding(mesh, P())), x)
    manual = compiled_text(jax.shard_map(lambda v: jax.lax.psum(v.sum(1), "b"), mesh=mesh,
                                         in_specs=P(None, "b"), out_specs=P()), x)

    def groups(text):
        attrs = re.search(r"all-reduce\(.*", text)[0]
        return sorted(sorted(g) for g in replica_groups(attrs, 8).tolist())
    assert groups(gspmd) == groups(manual) == [[0, 2], [1, 3], [4, 6], [5, 7]]


# ---------------------------------------------------------------- replica group syntaxes


@pytest.mark.parametrize("attrs, expected", [
    ("replica_groups={{0,2},{1,3}}, x=1", [[0, 2], [1, 3]]),
    ("replica_groups={}, to_apply=%add", [list(range(8))]),
    ("channel_id=1, use_global_device_ids=true", [list(range(8))]),
    ("replica_groups=[4,2]<=[8], dimensions={0}", [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ("replica_groups=[2,4]<=[4,2]T(1,0)", [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ("replica_groups=[4,2]<=[2,2,2]T(0,2,1)", [[0, 2], [1, 3], [4, 6], [5, 7]]),
    ("replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}", [list(range(8))]),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, dimensions={0}",
     [[0, 4], [1, 5], [2, 6], [3, 7]]),
    # devices[i,j,k] = 4i + 2k + j: axis_1 steps by 1
    ("replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2], device_ids=([2,2,2]T(0,2,1)) "
     "{'axis_1'}", [[0, 1], [2, 3], [4, 5], [6, 7]]),
    # devices[i,j] = 2j + i on a 2x4 mesh
    ("replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}",
     [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=(3,1,4,0,7,5,2,6) {'axis_0'}",
     [[3, 7], [1, 5], [4, 2], [0, 6]]),
    # sub-axes: axis_0 (size 8) split major-to-minor into [pre, size, rest]
    ("replica_groups=mesh['axis_0'=8] {'axis_0':(1)2}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("replica_groups=mesh['axis_0'=8] {'axis_0':(2)2}", [[0, 2], [1, 3], [4, 6], [5, 7]]),
    ("replica_groups=mesh['axis_0'=8] {'axis_0':(1)2,'axis_0':(4)2}",
     [[0, 1, 4, 5], [2, 3, 6, 7]]),
    ("replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_0':(2)2}",
     [[0, 1], [2, 3], [4, 5], [6, 7]]),
])
def test_replica_group_syntaxes(attrs, expected):
    got = replica_groups(attrs, 8).tolist()
    assert sorted(sorted(g) for g in got) == sorted(sorted(g) for g in expected)


def test_shape_bytes():
    assert shape_bytes("f32[16,64]{1,0}") == 4096
    assert shape_bytes("f32[]") == 4
    assert shape_bytes("(f32[], bf16[128,64]{1,0:T(8,128)(2,1)S(1)})") == 4 + 128 * 64 * 2
    sizes = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
             "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1,
             "c64": 8, "c128": 16}
    for dtype, size in sizes.items():
        assert shape_bytes(f"{dtype}[3,5]{{1,0}}") == 15 * size, dtype


# ---------------------------------------------------------------- other backends' formats

# The shapes of GPU async collectives: -start/-done pairs, sugared and as async-start wrappers,
# a combined (tuple) all-reduce, all inside a loop of 7.
GPU = """HloModule gpu, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%rs_wrapped (p0: f32[64,8]) -> f32[16,8] {
  %p0 = f32[64,8]{1,0} parameter(0)
  ROOT %rs = f32[16,8]{1,0} reduce-scatter(%p0), channel_id=3, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true, to_apply=%add
}

%body (bp: (s32[], f32[16,8], f32[64,8])) -> (s32[], f32[16,8], f32[64,8]) {
  %bp = (s32[], f32[16,8]{1,0}, f32[64,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%bp), index=0
  %v = f32[16,8]{1,0} get-tuple-element(%bp), index=1
  %w = f32[64,8]{1,0} get-tuple-element(%bp), index=2
  %zf = f32[] constant(0)
  %ag-start = (f32[16,8]{1,0}, f32[64,8]{1,0}) all-gather-start(f32[16,8]{1,0} %v), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %ag-done = f32[64,8]{1,0} all-gather-done(%ag-start)
  %ar-start = (f32[], f32[64,8]{1,0}) all-reduce-start(%zf, %ag-done), channel_id=2, replica_groups=[4,2]<=[8], use_global_device_ids=true, to_apply=%add
  %ar-done = (f32[], f32[64,8]{1,0}) all-reduce-done(%ar-start)
  %rs-start = ((f32[64,8]{1,0}), f32[16,8]{1,0}, s32[]) async-start(%w), calls=%rs_wrapped
  %rs-done = f32[16,8]{1,0} async-done(%rs-start), calls=%rs_wrapped
  %a2a-start = ((f32[64,8]{1,0}), f32[64,8]{1,0}) all-to-all-start(%w), channel_id=4, replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}
  %a2a-done = f32[64,8]{1,0} all-to-all-done(%a2a-start)
  %cp-start = (f32[16,8]{1,0}, f32[16,8]{1,0}, u32[], u32[]) collective-permute-start(%rs-done), channel_id=5, source_target_pairs={{0,1},{1,0},{2,3},{3,2},{4,5},{5,4},{6,7},{7,6}}
  %cp-done = f32[16,8]{1,0} collective-permute-done(%cp-start)
  %one = s32[] constant(1)
  %i1 = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[16,8]{1,0}, f32[64,8]{1,0}) tuple(%i1, %cp-done, %a2a-done)
}

%cond (cp: (s32[], f32[16,8], f32[64,8])) -> pred[] {
  %cp = (s32[], f32[16,8]{1,0}, f32[64,8]{1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%cp), index=0
  %n = s32[] constant(7)
  ROOT %lt = pred[] compare(%ci, %n), direction=LT
}

ENTRY %main (x: f32[16,8], y: f32[64,8]) -> f32[16,8] {
  %x = f32[16,8]{1,0} parameter(0)
  %y = f32[64,8]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[16,8]{1,0}, f32[64,8]{1,0}) tuple(%zero, %x, %y)
  %loop = (s32[], f32[16,8]{1,0}, f32[64,8]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"7"}}
  ROOT %out = f32[16,8]{1,0} get-tuple-element(%loop), index=1
}
"""


@pytest.fixture(scope="module")
def mesh24():
    return jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AUTO, AUTO))


def test_gpu_async_forms_counted_once(mesh24):
    found = collectives(GPU, mesh24)
    cols = {c.kind: c for c in found if not c.scalars}
    assert sorted(cols) == sorted(["all-gather", "all-reduce", "reduce-scatter", "all-to-all",
                                   "collective-permute"])
    assert all(c.executions == 7 for c in found)
    ag, ar, rs = cols["all-gather"], cols["all-reduce"], cols["reduce-scatter"]
    assert (ag.operand_bytes, ag.result_bytes, ag.mesh_axes) == (512, 2048, ("tensor",))
    # the combined all-reduce of a scalar and a 512-float array: the scalar counted apart
    scalar = next(c for c in found if c.scalars)
    assert (ar.operand_bytes, ar.result_bytes, ar.group_size, scalar.operand_bytes, scalar.name) == (2048, 2048, 2, 4, ar.name)
    assert ar.mesh_axes == ("tensor",) and ar.dtype == "f32"
    assert (rs.operand_bytes, rs.result_bytes, rs.group_size, rs.name) == (2048, 512, 4, "rs")
    assert cols["all-to-all"].mesh_axes == ("data",)
    cp = cols["collective-permute"]
    assert (cp.result_bytes, cp.group_size, cp.mesh_axes) == (512, 2, ("tensor",))
    assert summarize(list(cols.values()))["all-gather"] == {"count": 7,
                                                             "bytes_per_device": 7 * 2048 * 3 / 4}


def test_gpu_loop_without_known_trip_count(mesh24):
    text = GPU.replace(', backend_config={"known_trip_count":{"n":"7"}}', "")
    assert {c.executions for c in collectives(text, mesh24)} == {7}
    text = text.replace("constant(0)\n  %init", "constant(3)\n  %init")  # start at 3: 4 trips
    assert {c.executions for c in collectives(text, mesh24)} == {4}
    text = text.replace("direction=LT", "direction=LE")  # 3..7 inclusive: 5 trips
    assert {c.executions for c in collectives(text, mesh24)} == {5}


def test_unreadable_trip_count_warns_and_counts_once(mesh24):
    text = GPU.replace("direction=LT", "direction=EQ")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # known_trip_count is enough: the condition is not read
        assert {c.executions for c in collectives(text, mesh24)} == {7}
    text = text.replace(', backend_config={"known_trip_count":{"n":"7"}}', "")
    with pytest.warns(UserWarning, match="trip count"):
        cols = collectives(text, mesh24)
    assert {c.executions for c in cols} == {1}


# As the TPU compiler prints it (v5p AOT, jax 0.10): layouts with tiles and memory spaces,
# /*index=N*/ comments inside tuples, no known_trip_count, a conditional inside the loop.
TPU = """HloModule tpu, is_scheduled=true, num_partitions=8

%branch_a (pa: f32[32,64]) -> f32[32,64] {
  %pa = f32[32,64]{1,0:T(8,128)} parameter(0)
  ROOT %ps = f32[32,64]{1,0:T(8,128)} all-reduce(%pa), channel_id=2, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, use_global_device_ids=true, to_apply=%add
}

%branch_b (pb: f32[32,64]) -> f32[32,64] {
  ROOT %pb = f32[32,64]{1,0:T(8,128)} parameter(0)
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%wide.body (wp: (s32[], f32[32,64], s32[], f32[], f32[], /*index=5*/pred[])) -> (s32[], f32[32,64], s32[], f32[], f32[], /*index=5*/pred[]) {
  %c1 = s32[]{:T(128)} constant(2)
  %wp = (s32[]{:T(128)}, f32[32,64]{1,0:T(8,128)S(1)}, s32[]{:T(128)}, f32[]{:T(128)}, f32[]{:T(128)}, /*index=5*/pred[]{:T(512)}) parameter(0)
  %iv = s32[]{:T(128)} get-tuple-element(%wp), index=2
  %v = f32[32,64]{1,0:T(8,128)S(1)} get-tuple-element(%wp), index=1
  %flag = pred[]{:T(512)} get-tuple-element(%wp), index=5
  %next = s32[]{:T(128)} add(%iv, %c1)
  %cps = (f32[32,64]{1,0:T(8,128)}, f32[32,64]{1,0:T(8,128)}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%v), channel_id=1, source_target_pairs={{0,4},{4,0},{1,5},{5,1},{2,6},{6,2},{3,7},{7,3}}
  %cpd = f32[32,64]{1,0:T(8,128)} collective-permute-done(%cps)
  %cond = f32[32,64]{1,0:T(8,128)} conditional(%flag, %cpd, %cpd), true_computation=%branch_a, false_computation=%branch_b
  ROOT %t = (s32[]{:T(128)}, f32[32,64]{1,0:T(8,128)S(1)}, s32[]{:T(128)}, f32[]{:T(128)}, f32[]{:T(128)}, /*index=5*/pred[]{:T(512)}) tuple(%iv, %cond, %next, %iv, %iv, %flag)
}

%wide.cond (wc: (s32[], f32[32,64], s32[], f32[], f32[], /*index=5*/pred[])) -> pred[] {
  %lim = s32[]{:T(128)} constant(12)
  %wc = (s32[]{:T(128)}, f32[32,64]{1,0:T(8,128)S(1)}, s32[]{:T(128)}, f32[]{:T(128)}, f32[]{:T(128)}, /*index=5*/pred[]{:T(512)}) parameter(0)
  %g = s32[]{:T(128)} get-tuple-element(%wc), index=2
  ROOT %lt = pred[]{:T(512)} compare(%lim, %g), direction=GT
}

ENTRY %main (x: f32[32,64], f: pred[]) -> f32[32,64] {
  %x = f32[32,64]{1,0:T(8,128)} parameter(0)
  %f = pred[]{:T(512)} parameter(1)
  %z = s32[]{:T(128)} constant(0)
  %zc = s32[]{:T(128)} copy(%z)
  %fz = f32[]{:T(128)} constant(0)
  %init = (s32[]{:T(128)}, f32[32,64]{1,0:T(8,128)S(1)}, s32[]{:T(128)}, f32[]{:T(128)}, f32[]{:T(128)}, /*index=5*/pred[]{:T(512)}) tuple(%z, %x, %zc, %fz, %fz, %f)
  %w = (s32[]{:T(128)}, f32[32,64]{1,0:T(8,128)S(1)}, s32[]{:T(128)}, f32[]{:T(128)}, f32[]{:T(128)}, /*index=5*/pred[]{:T(512)}) while(%init), condition=%wide.cond, body=%wide.body
  ROOT %o = f32[32,64]{1,0:T(8,128)} get-tuple-element(%w), index=1
}
"""


def test_tpu_format_loop_read_from_condition(mesh24):
    # induction variable at tuple index 2, step 2, limit on the left: 0, 2, ..., 10 -> 6 trips
    cols = {c.kind: c for c in collectives(TPU, mesh24)}
    cp, ar = cols["collective-permute"], cols["all-reduce"]
    assert (cp.executions, cp.operand_bytes, cp.mesh_axes, cp.group_size) == (6, 8192, ("data",), 2)
    assert (ar.executions, ar.mesh_axes, ar.group_size) == (6, ("data",), 2)  # branch: upper bound


def test_self_pairs_send_nothing(mesh24):
    text = TPU.replace("{{0,4},{4,0},{1,5},{5,1},{2,6},{6,2},{3,7},{7,3}}", "{{0,0},{1,1}}")
    cp = only(collectives(text, mesh24), "collective-permute")
    assert (cp.group_size, cp.mesh_axes, cp.bytes_per_execution) == (1, (), 0.0)


def test_summaries():
    def col(kind, axes, nbytes, n, runs):
        return Collective(kind, "c", "f32", nbytes, nbytes, n, axes, runs)
    cols = [col("all-reduce", ("data",), 100, 2, 3), col("all-reduce", ("tensor",), 100, 4, 1),
            col("all-gather", ("data",), 80, 2, 1)]
    assert summarize(cols) == {"all-reduce": {"count": 4, "bytes_per_device": 3 * 100 + 150},
                               "all-gather": {"count": 1, "bytes_per_device": 40}}
    assert by_axes(cols) == {("all-reduce", ("data",)): {"count": 3, "bytes_per_device": 300},
                             ("all-reduce", ("tensor",)): {"count": 1, "bytes_per_device": 150},
                             ("all-gather", ("data",)): {"count": 1, "bytes_per_device": 40}}


# As XLA:TPU prints an all-gather overlapped with compute (v5e, jax 0.10): a chain of fusions (start,
# continuation, done), each holding a copy of the all-gather with one channel_id and chain_id. Here
# the collective pipeliner's shape: the first start before the loop, then start, continuation and
# done in the loop body. The two reduce-scatters share channel_id=1 but are different collectives.
CHAIN = """HloModule chain, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%ag_start (s0: bf16[1,4,16]) -> (bf16[1,4,16], bf16[1,16,16]) {
  %s0 = bf16[1,4,16]{2,1,0:T(4,128)(2,1)} parameter(0)
  %ag.1 = bf16[1,16,16]{2,1,0:T(8,128)(2,1)} all-gather(%s0), channel_id=6, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={1}, use_global_device_ids=true, frontend_attributes={chain_id="1"}
  ROOT %cc.1 = (bf16[1,4,16]{2,1,0:T(4,128)(2,1)S(1)}, bf16[1,16,16]{2,1,0:T(8,128)(2,1)S(1)}) custom-call(%ag.1), custom_call_target="AsyncCollectiveStart"
}

%ag_start.clone (s1: bf16[1,4,16]) -> (bf16[1,4,16], bf16[1,16,16]) {
  %s1 = bf16[1,4,16]{2,1,0:T(4,128)(2,1)} parameter(0)
  %ag.2 = bf16[1,16,16]{2,1,0:T(8,128)(2,1)} all-gather(%s1), channel_id=6, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={1}, use_global_device_ids=true, frontend_attributes={chain_id="1"}
  ROOT %cc.2 = (bf16[1,4,16]{2,1,0:T(4,128)(2,1)S(1)}, bf16[1,16,16]{2,1,0:T(8,128)(2,1)S(1)}) custom-call(%ag.2), custom_call_target="AsyncCollectiveStart"
}

%async_collective_fusion (c0: bf16[1,4,16], c1: bf16[1,16,16], x: bf16[16,16]) -> (bf16[16,16], bf16[1,4,16], bf16[1,16,16]) {
  %c0 = bf16[1,4,16]{2,1,0:T(4,128)(2,1)S(1)} parameter(0)
  %c1 = bf16[1,16,16]{2,1,0:T(8,128)(2,1)S(1)} parameter(1)
  %x = bf16[16,16]{1,0:T(8,128)(2,1)} parameter(2)
  %ag.3 = bf16[1,16,16]{2,1,0:T(8,128)(2,1)S(1)} all-gather(%c0), channel_id=6, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={1}, use_global_device_ids=true, frontend_attributes={chain_id="1"}
  %mm = bf16[16,16]{1,0:T(8,128)(2,1)} dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (bf16[16,16]{1,0:T(8,128)(2,1)}, bf16[1,4,16]{2,1,0:T(4,128)(2,1)S(1)}, bf16[1,16,16]{2,1,0:T(8,128)(2,1)S(1)}) tuple(%mm, %c0, %ag.3)
}

%ag_done (d0: bf16[1,4,16], d1: bf16[1,16,16]) -> bf16[1,16,16] {
  %d0 = bf16[1,4,16]{2,1,0:T(4,128)(2,1)S(1)} parameter(0)
  %d1 = bf16[1,16,16]{2,1,0:T(8,128)(2,1)S(1)} parameter(1)
  %ag.4 = bf16[1,16,16]{2,1,0:T(8,128)(2,1)} all-gather(%d0), channel_id=6, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={1}, use_global_device_ids=true, frontend_attributes={chain_id="1"}
  ROOT %cc.4 = bf16[1,16,16]{2,1,0:T(8,128)(2,1)S(1)} custom-call(%d0, %d1, %ag.4), custom_call_target="AsyncCollectiveDone"
}

%body (bp: (s32[], bf16[1,4,16], bf16[1,16,16], bf16[16,16], f32[64,8])) -> (s32[], bf16[1,4,16], bf16[1,16,16], bf16[16,16], f32[64,8]) {
  %bp = (s32[]{:T(128)}, bf16[1,4,16]{2,1,0:T(4,128)(2,1)S(1)}, bf16[1,16,16]{2,1,0:T(8,128)(2,1)S(1)}, bf16[16,16]{1,0:T(8,128)(2,1)}, f32[64,8]{1,0:T(8,128)}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%bp), index=0
  %shard = bf16[1,4,16]{2,1,0:T(4,128)(2,1)S(1)} get-tuple-element(%bp), index=1
  %buf = bf16[1,16,16]{2,1,0:T(8,128)(2,1)S(1)} get-tuple-element(%bp), index=2
  %x = bf16[16,16]{1,0:T(8,128)(2,1)} get-tuple-element(%bp), index=3
  %g = f32[64,8]{1,0:T(8,128)} get-tuple-element(%bp), index=4
  %step = (bf16[16,16]{1,0:T(8,128)(2,1)}, bf16[1,4,16]{2,1,0:T(4,128)(2,1)S(1)}, bf16[1,16,16]{2,1,0:T(8,128)(2,1)S(1)}) fusion(%shard, %buf, %x), kind=kOutput, calls=%async_collective_fusion
  %mm = bf16[16,16]{1,0:T(8,128)(2,1)} get-tuple-element(%step), index=0
  %s = bf16[1,4,16]{2,1,0:T(4,128)(2,1)S(1)} get-tuple-element(%step), index=1
  %p = bf16[1,16,16]{2,1,0:T(8,128)(2,1)S(1)} get-tuple-element(%step), index=2
  %gathered = bf16[1,16,16]{2,1,0:T(8,128)(2,1)S(1)} fusion(%s, %p), kind=kCustom, calls=%ag_done
  %next = (bf16[1,4,16]{2,1,0:T(4,128)(2,1)S(1)}, bf16[1,16,16]{2,1,0:T(8,128)(2,1)S(1)}) fusion(%s), kind=kCustom, calls=%ag_start.clone
  %ns = bf16[1,4,16]{2,1,0:T(4,128)(2,1)S(1)} get-tuple-element(%next), index=0
  %np = bf16[1,16,16]{2,1,0:T(8,128)(2,1)S(1)} get-tuple-element(%next), index=1
  %rs.1 = f32[16,8]{1,0:T(8,128)} reduce-scatter(%g), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true, to_apply=%add
  %rs.2 = f32[16,8]{1,0:T(8,128)} reduce-scatter(%g), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true, to_apply=%add
  %one = s32[]{:T(128)} constant(1)
  %i1 = s32[]{:T(128)} add(%i, %one)
  ROOT %t = (s32[]{:T(128)}, bf16[1,4,16]{2,1,0:T(4,128)(2,1)S(1)}, bf16[1,16,16]{2,1,0:T(8,128)(2,1)S(1)}, bf16[16,16]{1,0:T(8,128)(2,1)}, f32[64,8]{1,0:T(8,128)}) tuple(%i1, %ns, %np, %mm, %g)
}

%cond (cp: (s32[], bf16[1,4,16], bf16[1,16,16], bf16[16,16], f32[64,8])) -> pred[] {
  %cp = (s32[]{:T(128)}, bf16[1,4,16]{2,1,0:T(4,128)(2,1)S(1)}, bf16[1,16,16]{2,1,0:T(8,128)(2,1)S(1)}, bf16[16,16]{1,0:T(8,128)(2,1)}, f32[64,8]{1,0:T(8,128)}) parameter(0)
  %ci = s32[]{:T(128)} get-tuple-element(%cp), index=0
  %n = s32[]{:T(128)} constant(7)
  ROOT %lt = pred[]{:T(512)} compare(%ci, %n), direction=LT
}

ENTRY %main (w: bf16[1,4,16], x: bf16[16,16], g: f32[64,8]) -> bf16[16,16] {
  %w = bf16[1,4,16]{2,1,0:T(4,128)(2,1)} parameter(0)
  %x = bf16[16,16]{1,0:T(8,128)(2,1)} parameter(1)
  %g = f32[64,8]{1,0:T(8,128)} parameter(2)
  %first = (bf16[1,4,16]{2,1,0:T(4,128)(2,1)S(1)}, bf16[1,16,16]{2,1,0:T(8,128)(2,1)S(1)}) fusion(%w), kind=kCustom, calls=%ag_start
  %fs = bf16[1,4,16]{2,1,0:T(4,128)(2,1)S(1)} get-tuple-element(%first), index=0
  %fp = bf16[1,16,16]{2,1,0:T(8,128)(2,1)S(1)} get-tuple-element(%first), index=1
  %zero = s32[]{:T(128)} constant(0)
  %init = (s32[]{:T(128)}, bf16[1,4,16]{2,1,0:T(4,128)(2,1)S(1)}, bf16[1,16,16]{2,1,0:T(8,128)(2,1)S(1)}, bf16[16,16]{1,0:T(8,128)(2,1)}, f32[64,8]{1,0:T(8,128)}) tuple(%zero, %fs, %fp, %x, %g)
  %loop = (s32[]{:T(128)}, bf16[1,4,16]{2,1,0:T(4,128)(2,1)S(1)}, bf16[1,16,16]{2,1,0:T(8,128)(2,1)S(1)}, bf16[16,16]{1,0:T(8,128)(2,1)}, f32[64,8]{1,0:T(8,128)}) while(%init), condition=%cond, body=%body
  %sum = f32[8]{0:T(128)} all-reduce(%g), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  ROOT %out = bf16[16,16]{1,0:T(8,128)(2,1)} get-tuple-element(%loop), index=3
}
"""


def test_copies_of_one_chained_collective_count_once(mesh24):
    cols = collectives(CHAIN, mesh24)
    ag = only(cols, "all-gather")  # four copies of channel 6, chain 1
    assert (ag.name, ag.mesh_axes, ag.operand_bytes, ag.result_bytes) == ("ag.1", ("tensor",), 128, 512)
    assert ag.executions == 7  # the copies in the loop body run every trip; the one before it, once
    # the same channel_id without a chain_id: different collectives, each counted
    assert [(c.name, c.executions) for c in cols if c.kind == "reduce-scatter"] == [("rs.1", 7), ("rs.2", 7)]
    assert only(cols, "all-reduce").executions == 1
    assert summarize(cols)["all-gather"] == {"count": 7, "bytes_per_device": 7 * 512 * 3 / 4}
    # without the chain_id every copy is a collective of its own
    plain = collectives(CHAIN.replace(', frontend_attributes={chain_id="1"}', ""), mesh24)
    assert [c.executions for c in plain if c.kind == "all-gather"] == [1, 7, 7, 7]


@pytest.mark.tpu_aot
def test_v5e_counts_the_fsdp_gathers_as_v5p_and_the_formula_do():
    # XLA:TPU for v5e splits the layer loop's weight all-gathers into chains of fusions that hold
    # copies of them (v5p prints each once): the same step must move the same bytes on both.
    pytest.importorskip("libtpu", reason="pip install -e .[tpu] brings the TPU compiler")
    from jaxpar import aot
    from jaxpar.analysis import traffic
    from jaxpar.models import llama
    from jaxpar.parallel import build_layout, parse_strategy
    from jaxpar.topology import load_topology
    from jaxpar.train.step import TrainConfig, Trainer

    cfg, batch_shape = llama.CONFIGS["tiny"], (16, 64)
    sent = {}
    for slice_name in ("v5e-4", "v5p-8"):  # 2x2 and 2x2x1 chips
        strategy = parse_strategy("fsdp=4", 4)
        topology = load_topology(slice_name)
        tpu_topology = topology.tpu_topology
        layout = build_layout(strategy, aot.tpu_devices(topology))
        trainer = Trainer(layout, lambda r: llama.Llama(cfg, rngs=r), llama.loss_fn, TrainConfig(compute_dtype="bfloat16"))
        batch = trainer.abstract_batch(*batch_shape)
        text = trainer.jit_step(batch).lower(trainer.abstract_state(), batch).compile().as_text()
        if tpu_topology.startswith("v5e"):  # the copies this test is about are there
            copies = re.findall(r'all-gather\([^\n]*channel_id=(\d+)[^\n]*chain_id="(\d+)"', text)
            assert len(copies) > len(set(copies))
        totals = summarize(collectives(text, layout.mesh))
        sent[tpu_topology] = {kind: totals[kind]["bytes_per_device"] for kind in ("all-gather", "reduce-scatter")}
    v5e, v5p = sent.values()
    formula = traffic.optimal_traffic_by_axis(trainer, strategy, batch_shape, cfg)
    assert v5e["all-gather"] == v5p["all-gather"] == pytest.approx(formula[("all-gather", "fsdp")], rel=0.02)
    # The loop's reduce-scatters all carry channel_id=1, yet each is a collective of its own. (3%: XLA
    # reduces the embedding gradient from bf16 operands, which the formula counts in float32.)
    assert v5e["reduce-scatter"] == v5p["reduce-scatter"] == pytest.approx(formula[("reduce-scatter", "fsdp")], rel=0.03)
