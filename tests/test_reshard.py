"""Cross-mesh resharding: exact results on the destination sharding, the plan's bytes equal to what
the compiled program moves (read from its HLO) and to the minimum counted element by element,
balanced senders, broadcast cheaper than naive sends, and clear errors for bad input."""
import math
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P

from jaxpar.analysis import hlo
from jaxpar.collectives.reshard import compile_reshard, plan_reshard, reshard
from jaxpar.errors import JaxparError, LayoutError

SHAPE = (20, 12)  # rows split 2 or 4 ways, cols 4 ways; some broadcast pieces are uneven (10 rows / 4)
LAYOUTS = ("replicated", "rows", "cols", "2d")


def measured_links(program) -> dict[tuple[int, int], int]:
    """(sender, receiver) device ids -> bytes, read from the compiled program's collective-permutes."""
    return hlo.link_bytes(program.compiled.as_text(), program.mesh)


def spec(layout: str, mesh: Mesh) -> P:
    a, b = mesh.axis_names
    return {"replicated": P(), "rows": P(a), "cols": P(None, (a, b)), "2d": P(a, b)}[layout]


def meshes(config: str) -> tuple[Mesh, Mesh]:
    d = jax.devices()
    src = Mesh(np.array(d[:4]).reshape(2, 2), ("x", "y"))
    dst = {
        "disjoint": lambda: Mesh(np.array(d[4:]).reshape(2, 2), ("u", "v")),
        "overlap": lambda: Mesh(np.array(d[2:6]).reshape(2, 2), ("u", "v")),
        # another shape, and the devices in reverse order
        "2x2-to-4x1": lambda: Mesh(np.array(d[7:3:-1]).reshape(4, 1), ("p", "q")),
    }[config]()
    return src, dst


def case(config, src_layout, dst_layout, dtype=jnp.int32, shape=SHAPE):
    src_mesh, dst_mesh = meshes(config)
    src = NamedSharding(src_mesh, spec(src_layout, src_mesh))
    dst = NamedSharding(dst_mesh, spec(dst_layout, dst_mesh))
    x = jax.device_put(jnp.arange(math.prod(shape), dtype=dtype).reshape(shape), src)
    return x, src, dst


PAIRS = [(c, s, t) for c in ("disjoint", "overlap", "2x2-to-4x1") for s in LAYOUTS for t in LAYOUTS]
IDS = [f"{c}-{s}-to-{t}" for c, s, t in PAIRS]


# ---------------------------------------------------------------- independent counts


def _box(index, shape):
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def crossings(shape, itemsize, src, dst) -> tuple[int, int]:
    """(bytes crossing once per destination group, bytes crossing once per receiver): an element
    crosses for a receiver that does not hold it in the source layout."""
    held = {d.id: np.zeros(shape, bool) for d in dst.device_set}
    for d, index in src.devices_indices_map(shape).items():
        if d.id in held:
            held[d.id][index] = True
    groups = defaultdict(list)  # destination box -> what each of its receivers lacks there
    for d, index in dst.devices_indices_map(shape).items():
        groups[_box(index, shape)].append(~held[d.id][index])
    per_group = sum(np.logical_or.reduce(lacks).sum() for lacks in groups.values())
    per_receiver = sum(lack.sum() for lacks in groups.values() for lack in lacks)
    return int(per_group) * itemsize, int(per_receiver) * itemsize


# ---------------------------------------------------------------- every layout pair


@pytest.mark.parametrize("config, src_layout, dst_layout", PAIRS, ids=IDS)
def test_result_is_the_source_on_the_destination_sharding(config, src_layout, dst_layout):
    x, src, dst = case(config, src_layout, dst_layout)
    y = reshard(x, dst)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    assert y.sharding == dst
    for shard in y.addressable_shards:  # each destination device holds exactly its own block
        np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(x)[shard.index])


@pytest.mark.parametrize("config, src_layout, dst_layout", PAIRS, ids=IDS)
def test_compiled_program_moves_the_planned_bytes_and_no_more_than_the_minimum(config, src_layout, dst_layout):
    x, src, dst = case(config, src_layout, dst_layout)
    program = compile_reshard(x.shape, x.dtype, src, dst)  # cached: the program the test above ran
    plan = program.plan
    kinds = {c.kind for c in hlo.collectives(program.compiled.as_text(), program.mesh)}
    assert kinds <= {"collective-permute"}, "only the planned ppermutes move data"
    assert measured_links(program) == plan.link_bytes()
    minimum, naive = crossings(x.shape, x.dtype.itemsize, src, dst)
    assert plan.cross_mesh_bytes == minimum
    assert plan.naive_bytes == naive
    # Each receiver still gets every element it lacks: what does not cross is all-gathered in B.
    assert plan.gather_bytes == naive - minimum
    assert sum(measured_links(program).values()) == naive
    if config != "overlap":  # disjoint meshes: every source -> destination link crosses between them
        a = {d.id for d in src.device_set}
        crossed = sum(b for (s, r), b in measured_links(program).items() if s in a and r not in a)
        assert crossed == minimum == x.nbytes  # each element crosses once: one destination group each


@pytest.mark.parametrize("broadcast", [True, False])
@pytest.mark.parametrize("config, src_layout, dst_layout", [p for p in PAIRS if p[0] != "overlap"],
                         ids=[i for p, i in zip(PAIRS, IDS) if p[0] != "overlap"])
def test_most_loaded_sender_within_one_piece_of_the_mean(config, src_layout, dst_layout, broadcast):
    _, src, dst = case(config, src_layout, dst_layout)
    plan = plan_reshard(SHAPE, jnp.int32, src, dst, broadcast=broadcast)
    load = plan.sender_load
    largest = max(s.nbytes for t in plan.tiles for s in t.sends)
    assert max(load.values()) <= -(-plan.cross_mesh_bytes // len(load)) + largest


def test_replicas_share_the_sending():
    # One source box held by 4 replicas, needed as 4 column blocks: each replica sends one block.
    # (Always sending from the first replica would load one device with everything.)
    _, src, dst = case("disjoint", "replicated", "cols")
    plan = plan_reshard(SHAPE, jnp.int32, src, dst)
    assert sorted(plan.sender_load.values()) == [plan.cross_mesh_bytes // 4] * 4


@pytest.mark.parametrize("src_layout", ["rows", "2d"])
def test_broadcast_crosses_fewer_bytes_than_naive_to_a_replicated_destination(src_layout):
    x, src, dst = case("disjoint", src_layout, "replicated")
    a = {d.id for d in src.device_set}
    crossed = {}
    for broadcast in (True, False):
        program = compile_reshard(x.shape, x.dtype, src, dst, broadcast=broadcast)
        np.testing.assert_array_equal(np.asarray(program(x)), np.asarray(x))
        crossed[broadcast] = sum(b for (s, r), b in measured_links(program).items() if s in a and r not in a)
    assert crossed[True] == x.nbytes and crossed[False] == 4 * x.nbytes  # 4 receivers per element


# ---------------------------------------------------------------- odd shapes, dtypes, devices


def test_tile_smaller_than_its_receivers_and_other_dtype():
    # A 2x3 bfloat16 array to 4 receivers: 3 pieces along the longer dim, the 4th receiver gets
    # everything from the all-gather.
    x, src, dst = case("disjoint", "replicated", "replicated", dtype=jnp.bfloat16, shape=(2, 3))
    program = compile_reshard(x.shape, x.dtype, src, dst)
    assert [len(t.sends) for t in program.plan.tiles] == [3]
    y = program(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    assert y.dtype == jnp.bfloat16 and program.plan.cross_mesh_bytes == x.nbytes


def test_three_dims_and_same_devices_in_another_order():
    d = jax.devices()
    src = NamedSharding(Mesh(np.array(d[:4]).reshape(2, 2), ("x", "y")), P("x", None, "y"))
    dst = NamedSharding(Mesh(np.array([d[3], d[1], d[2], d[0]]), ("z",)), P(None, "z"))
    x = jax.device_put(jnp.arange(4 * 8 * 6, dtype=jnp.float32).reshape(4, 8, 6), src)
    y = reshard(x, dst)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    assert y.sharding == dst


def test_device_holding_its_tile_already_sends_nothing():
    # Devices 2 and 3 are in both meshes; as column shards of the source each already holds a
    # quarter of the rows it needs, and copies it locally.
    _, src, dst = case("overlap", "cols", "rows")
    plan = plan_reshard(SHAPE, jnp.int32, src, dst)
    assert {(d, t.box) for t in plan.tiles for d in t.local} == {(2, ((0, 10), (6, 9))), (3, ((0, 10), (9, 12)))}
    assert not any(s.receiver in t.holders for t in plan.tiles for s in t.sends)
    tile, nbytes = 10 * 3 * 4, math.prod(SHAPE) * 4
    # Naive: two receivers per element, less the two local tiles; broadcast: one crossing each.
    assert plan.naive_bytes == 2 * nbytes - 2 * tile and plan.cross_mesh_bytes == nbytes


def test_describe_lists_transfers_and_totals():
    _, src, dst = case("disjoint", "rows", "replicated")
    text = str(plan_reshard(SHAPE, jnp.int32, src, dst))
    assert "tile [0:10, 0:12] 480 B  holders [0, 1]  receivers [4, 5, 6, 7]" in text
    assert "send [0:10, 0:3] 0 -> 4  120 B" in text
    assert "cross-mesh bytes: 960 (naive per-receiver sends: 3840)" in text
    assert "sender load: 0: 240 B, 1: 240 B, 2: 240 B, 3: 240 B" in text


# ---------------------------------------------------------------- bad input


def test_bad_input_is_refused_with_the_value_and_the_fix():
    x, src, dst = case("disjoint", "rows", "2d")
    _, dst_mesh = meshes("disjoint")
    with pytest.raises(LayoutError, match=r"dim 0 of shape \(10, 12\) has 10 elements.*4 equal shards.*divisible by 4"):
        plan_reshard((10, 12), jnp.int32, src, NamedSharding(dst_mesh, P(("u", "v"))))
    with pytest.raises(LayoutError, match=r"P\('u', 'v'\) has 2 entries but the array has shape \(20,\)"):
        plan_reshard((20,), jnp.int32, NamedSharding(src.mesh, P("x")), dst)
    abstract = NamedSharding(AbstractMesh((2, 2), ("u", "v")), P())
    with pytest.raises(JaxparError, match=r"mesh is abstract.*names no devices"):
        reshard(x, abstract)
    with pytest.raises(JaxparError, match=r"not a jax.sharding.Sharding"):
        reshard(x, P("u"))
    with pytest.raises(JaxparError, match=r"takes a jax.Array, got ndarray"):
        reshard(np.asarray(x), dst)
    with pytest.raises(JaxparError, match=r"scalar.*jax.device_put"):
        reshard(jnp.float32(1), dst)
