"""The ring all-gather kernel (remote DMAs + semaphores): run in Pallas' TPU interpreter on the
simulated CPU devices it gathers exactly what the ppermute ring does, bit for bit, without races or
leftover semaphore counts; the all-reduce built on it equals ``compressed.all_reduce``; it compiles
for real TPU topologies; bad input is refused by name."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpar.collectives import compressed, quantize
from jaxpar.kernels import ring, wire

BITS = 5.125


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    # the interpreter keeps global state after a kernel fails; later kernels need it cleared
    yield
    pltpu.reset_tpu_interpret_mode_state()


def _mesh(ranks):
    return Mesh(np.array(jax.devices()[:ranks]), ("data",))


def _per_rank(mesh, fn):
    """jit(shard_map) of fn(rank's pytree) -> pytree, each leaf in and out as [ranks, ...]."""
    body = lambda t: jax.tree.map(lambda a: a[None], fn(jax.tree.map(lambda a: a[0], t)))  # noqa: E731
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False))


def _bits(tree):
    """Leaves as integer bit patterns (float32 -> uint32), so NaN payloads compare too."""
    return [np.asarray(a).view(np.uint32) if np.asarray(a).dtype == np.float32 else np.asarray(a) for a in jax.tree.leaves(tree)]


def _assert_bitwise_equal(a, b):
    for x, y in zip(_bits(a), _bits(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


def _check_clean_run(capfd, result):
    """The interpreter's race detector saw no unordered access to a buffer, and every semaphore
    ended at zero (it only prints leftovers). Waits for ``result`` first: dispatch is async."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call  # the detector's verdict is not public

    jax.block_until_ready(result)
    out = capfd.readouterr().out
    assert "RACE DETECTED" not in out and "non-zero count" not in out, out[:2000]
    assert not interpret_pallas_call.races.races_found


def _message(v):
    """Rank r's compressed message of its values, with the seed of chunk r at hop 7."""
    rank = jax.lax.axis_index("data")
    return quantize.quantize_dynamiq(v, BITS, wire.message_seed(0, 7, rank))


def _values(ranks, n, seed=0):
    x = np.random.default_rng(seed).standard_t(3, size=(ranks, n)).astype(np.float32)
    if ranks > 2:
        x[2, 300] = np.inf  # its block's scale becomes NaN: the payload must travel bit for bit
    return jnp.asarray(x)


# --- (a) the kernel gathers what the ppermute ring gathers ---------------------------------------


@pytest.mark.parametrize("ranks, mode", [(8, "on_wait"), (4, "eager"), (2, "on_wait")])
def test_kernel_gathers_packed_messages_like_ppermute(ranks, mode, capfd):
    """Each rank's real Packed message (~3 KB), gathered by the kernel under the race detector.
    ``on_wait`` DMAs land only when waited for, ``eager`` ones at once: two interleavings."""
    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode=mode)
    x = _values(ranks, 4096)

    mesh = _mesh(ranks)
    own = _per_rank(mesh, _message)(x)
    # separate programs: XLA's collectives and the interpreter's cross-device waits stay apart
    kernel = _per_rank(mesh, lambda p: ring.ring_all_gather_packed(p, "data", interpret=params))(own)
    _check_clean_run(capfd, kernel)
    xla = _per_rank(mesh, lambda p: ring.ring_all_gather_packed(p, "data", transport="ppermute"))(own)
    _assert_bitwise_equal(kernel, xla)
    # and both are the real thing: every rank holds every owner's message in row `owner`
    for rank in range(ranks):
        _assert_bitwise_equal(jax.tree.map(lambda g: g[rank], kernel), own)
    assert own.codes.shape[-1] == 4096 // wire.GROUP
    if ranks > 2:
        assert np.isnan(np.asarray(own.scales)[2]).any()


def test_pack_roundtrip_is_bit_exact():
    """Codes that do not fill a word, NaN scales with a payload, and the uniform quantizer's empty
    codes all come back as they went in."""
    nan_payload = np.array([0x7FC01234], np.uint32).view(np.float32)[0]
    cases = [
        wire.Packed(
            jnp.arange(7, dtype=jnp.uint32) * np.uint32(0x9E3779B9), jnp.arange(250, 255, dtype=jnp.uint8), jnp.array([1.5, nan_payload, -0.0])
        ),
        wire.Packed(jnp.arange(3, dtype=jnp.uint32), jnp.zeros((0,), jnp.uint8), jnp.array([2.0], jnp.float32)),
    ]
    for packed in cases:
        buffer = ring.pack(packed)
        assert buffer.dtype == jnp.uint32 and buffer.shape == (packed.words.size + -(-packed.codes.size // 4) + packed.scales.size,)
        _assert_bitwise_equal(ring.unpack(buffer, packed), packed)
        _assert_bitwise_equal(ring.unpack(jnp.stack([buffer, buffer]), packed), jax.tree.map(lambda a: jnp.stack([a, a]), packed))


def test_one_rank_is_its_own_message():
    x = jnp.arange(5, dtype=jnp.float32)[None]
    out = _per_rank(_mesh(1), lambda v: ring.ring_all_gather(v, "data", interpret=pltpu.InterpretParams()))(x)
    np.testing.assert_array_equal(out, x[:, None])


# --- (b) the compressed all-reduce through the kernel --------------------------------------------


@pytest.mark.parametrize("ranks", [4])  # (8 ranks: the same ring, 20-35 s more of XLA compiles)
def test_all_reduce_through_kernel_equals_compressed_ring(ranks, capfd):
    x = _values(ranks, 5000)  # 5000: not a multiple of ranks x BLOCK, so chunks are padded
    seed = 11
    ref = _per_rank(_mesh(ranks), lambda v: compressed.all_reduce(v, "data", bits=BITS, seed=seed, algorithm="ring", min_size=16))(x)
    jax.block_until_ready(ref)
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams(detect_races=True)):
        # one program: the kernel waits on the reduce-scatter's ppermutes, so they finish first
        out = _per_rank(_mesh(ranks), lambda v: compressed.all_reduce(
            v, "data", bits=BITS, seed=seed, algorithm="ring", min_size=16, all_gather_transport="pallas_ring"))(x)
    _check_clean_run(capfd, out)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint32), np.asarray(ref).view(np.uint32))
    # not vacuous: the sum is compressed (not exact) and the same on every rank
    exact = np.asarray(x, np.float64).sum(0)
    finite = np.isfinite(exact)
    assert not np.array_equal(np.asarray(out[0])[finite], exact[finite].astype(np.float32))
    for rank in range(1, ranks):
        np.testing.assert_array_equal(np.asarray(out[rank]).view(np.uint32), np.asarray(out[0]).view(np.uint32))


# --- (c) Mosaic: compiled ahead of time for TPU slices -------------------------------------------


def _tpu_devices(name, monkeypatch):
    pytest.importorskip("libtpu", reason="pip install -e .[tpu] brings the TPU compiler")
    # ahead-of-time compiles hold no chip; without this a second process fails on libtpu's lock
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental.topologies import get_topology_desc

    try:
        return get_topology_desc(platform="tpu", topology_name=name).devices
    except Exception as err:  # libtpu present but refusing this topology: nothing to compile for
        pytest.skip(f"no TPU topology {name}: {type(err).__name__}: {str(err).splitlines()[0][:200]}")


@pytest.mark.tpu_aot
@pytest.mark.parametrize("topology", ["v5e:2x4", "v5p:2x2x1", "v6e:2x2"])
def test_kernel_compiles_for_tpu_topology(topology, monkeypatch):
    devices = _tpu_devices(topology, monkeypatch)
    mesh = Mesh(np.array(devices), ("data",))
    arg = jax.ShapeDtypeStruct((len(devices), 4096), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    text = _per_rank(mesh, lambda v: ring.ring_all_gather_packed(_message(v), "data")).lower(arg).compile().as_text()
    # the gather is the Mosaic kernel, not XLA's collective-permutes
    assert "tpu_custom_call" in text and "collective-permute" not in text


@pytest.mark.tpu_aot
@pytest.mark.slow  # XLA:TPU compiles the dynamiq reduce hops: three on 4 chips (seven on 8 took twice as long)
def test_all_reduce_through_kernel_compiles_for_tpu(monkeypatch):
    # 4 ranks, as the CPU run of the same all-reduce above; the kernel alone compiles for 8 chips
    # (v5e:2x4) in test_kernel_compiles_for_tpu_topology
    devices = _tpu_devices("v5e:2x2", monkeypatch)
    mesh = Mesh(np.array(devices), ("data",))
    arg = jax.ShapeDtypeStruct((len(devices), 4096), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    text = _per_rank(mesh, lambda v: compressed.all_reduce(v, "data", bits=BITS, seed=3, algorithm="ring", min_size=16, all_gather_transport="pallas_ring")).lower(arg).compile().as_text()
    assert "tpu_custom_call" in text and "collective-permute" in text  # the reduce-scatter's hops stay XLA's


# --- (d) bad input -------------------------------------------------------------------------------


def test_message_that_is_not_one_dimensional_is_refused():
    x = jnp.zeros((2, 8, 16), jnp.uint32)
    with pytest.raises(ValueError, match=r"1-D message per rank; got shape \(8, 16\)"):
        _per_rank(_mesh(2), lambda v: ring.ring_all_gather(v, "data", interpret=pltpu.InterpretParams()))(x)


def test_axis_that_does_not_exist_is_refused():
    x = jnp.zeros((2, 16), jnp.uint32)
    with pytest.raises(ValueError, match=r"axis 'model' is not a mesh axis in scope"):
        _per_rank(_mesh(2), lambda v: ring.ring_all_gather(v, "model", interpret=pltpu.InterpretParams()))(x)
    with pytest.raises(ValueError, match=r"axis 'model' is not a mesh axis in scope"):
        _per_rank(_mesh(2), lambda v: ring.ring_all_gather_packed(_message(jnp.zeros(256)), "model", transport="ppermute"))(x)


def test_wrong_dtype_size_and_transport_are_refused():
    ok = pltpu.InterpretParams()
    with pytest.raises(ValueError, match=r"32-bit words; got dtype bfloat16"):
        _per_rank(_mesh(2), lambda v: ring.ring_all_gather(v, "data", interpret=ok))(jnp.zeros((2, 16), jnp.bfloat16))
    big = ring.MAX_MESSAGE_BYTES // 4 + 1
    with pytest.raises(ValueError, match=rf"message of {big} words .* larger than a receive slot"):
        jax.eval_shape(_per_rank(_mesh(2), lambda v: ring.ring_all_gather(v, "data", interpret=ok)), jax.ShapeDtypeStruct((2, big), jnp.uint32))
    with pytest.raises(ValueError, match=r"transport 'nccl' is not one of pallas_ring, ppermute"):
        _per_rank(_mesh(2), lambda v: ring.ring_all_gather_packed(_message(v), "data", transport="nccl"))(jnp.zeros((2, 256)))
    with pytest.raises(ValueError, match=r"Packed.codes must be 1-D uint8; got int32"):
        ring.pack(wire.Packed(jnp.zeros(4, jnp.uint32), jnp.zeros(8, jnp.int32), jnp.zeros(1, jnp.float32)))


# --- bigger messages, other meshes --------------------------------------------------------------


@pytest.mark.parametrize("mode", ["on_wait", "eager"])
def test_large_message(mode, capfd):
    """A 200 KB message: many rows per slot, and 200 KB of DMA per hop under the race detector.
    Four ranks: with eight, the interpreter hangs on this 2-core machine once its buffers pass
    ~100 KB (all eight device threads block converting a callback argument)."""
    x = jnp.asarray(np.random.default_rng(1).integers(0, 2**32, size=(4, 50_000), dtype=np.uint32))
    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode=mode)
    kernel = _per_rank(_mesh(4), lambda v: ring.ring_all_gather(v, "data", interpret=params))(x)
    _check_clean_run(capfd, kernel)
    xla = _per_rank(_mesh(4), lambda v: ring.ring_all_gather_ppermute(v, "data"))(x)
    _assert_bitwise_equal(kernel, xla)
    np.testing.assert_array_equal(kernel[3], x)


@pytest.mark.parametrize("axis", ["a", "b"])
def test_one_axis_of_a_two_dimensional_mesh(axis, capfd):
    """Gathering over one axis of a 2 x 4 mesh: the neighbours keep their coordinate on the other."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    x = jnp.asarray(np.random.default_rng(2).integers(0, 2**32, size=(2, 4, 700), dtype=np.uint32))
    params = pltpu.InterpretParams(detect_races=True)

    def on_mesh(gather):
        body = lambda v: gather(v[0, 0])[None, None]  # noqa: E731
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("a", "b"), out_specs=P("a", "b"), check_vma=False))(x)

    kernel = on_mesh(lambda v: ring.ring_all_gather(v, axis, interpret=params))
    _check_clean_run(capfd, kernel)
    xla = on_mesh(lambda v: ring.ring_all_gather_ppermute(v, axis))
    _assert_bitwise_equal(kernel, xla)
    assert kernel.shape == (2, 4, mesh.shape[axis], 700)
    # device (i, j) holds x[k, j] (over a) or x[i, k] (over b) in row k
    expected = np.asarray(x).transpose(1, 0, 2)[None] if axis == "a" else np.asarray(x)[:, None]
    np.testing.assert_array_equal(kernel, np.broadcast_to(expected, kernel.shape))
