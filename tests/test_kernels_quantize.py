"""The quantizer's Pallas kernels against their pure-JAX twins, bit for bit.

On CPU the kernels run in interpret mode; ``tpu_aot`` compiles the TPU kernels through Mosaic for a
TPU topology; ``gpu`` runs the Triton kernels on a GPU (run with ``JAX_PLATFORMS=cuda,cpu``: the
suite's default is CPU only)."""
import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.collectives import quantize as Q
from jaxpar.kernels import quantize as K
from jaxpar.kernels import wire as W

GROUPS = 600  # neither a multiple of the TPU tile (512 groups for a message this size) nor the GPU's (128)
START = np.uint32(2**32 - 5000)  # the value index wraps around uint32 inside the message
MSEED = W.message_seed(7, 3, 1)
# jitted: one compile each, where eager mode compiles every operation on its own
twin_encode, twin_decode = jax.jit(W.encode_groups), jax.jit(W.decode_groups)


def twin_decode_ieee(planes, gscale, width, mseed, start, local):
    """The twin's decode with its accumulate done as a separate float32 add, as the twin computes
    it run eagerly. Under jit XLA may fuse the twin's multiply, select and add and contract them
    into an FMA (XLA:CPU does), which moves the last bit of some sums: not a semantics a kernel
    can follow, since it depends on XLA's fusion. The kernels keep the add separate."""
    values = twin_decode(planes, gscale, width, mseed, start, None)
    return values if local is None else values + local


def _messages(groups, seed=0):
    """Heavy-tailed groups whose magnitudes span ~12 orders, with the twins' own scales, mixed
    widths 2..12, an all-zero block (scale 0), a block holding NaN and inf (scale NaN), a group of
    exact rounding ties and a few groups whose scale is too small (the clip binds)."""
    rng = np.random.default_rng(seed)
    blocks = -(-groups // W.GROUPS_PER_BLOCK)
    values = rng.standard_t(1.5, size=(blocks * W.GROUPS_PER_BLOCK, W.GROUP))
    values *= np.exp(rng.uniform(-14, 14, size=(values.shape[0], 1)))
    values = values.astype(np.float32)
    values[8:16] = 0.0  # block 1: scale 0
    values[16, 3], values[17, 0], values[18, 5] = np.nan, np.inf, -np.inf  # block 2: scale NaN
    values[24] = 0.0
    values[24, :6] = [0.5, -0.5, 1.5, -1.5, 2.5, -2.5]  # exact ties: step 1 below
    gscale = np.array(jax.jit(lambda x: Q.group_scales(*Q.block_scales(x)))(values.reshape(-1)))
    assert gscale[8] == 0 and np.isnan(gscale[16]), "the fixture lost its zero or NaN block"
    gscale[40:44] *= 0.3  # out-of-range values: the clip to [-L, L] binds
    width = rng.integers(W.MIN_BITS, W.MAX_BITS + 1, size=values.shape[0]).astype(np.int32)
    gscale[24], width[24] = 2.5, 3  # step = 2.5 / (L - 1/2) = 1
    local = rng.normal(size=values.shape).astype(np.float32)
    return values[:groups], gscale[:groups], width[:groups], local[:groups]


@pytest.fixture(scope="module")
def message():
    return tuple(jnp.asarray(a) for a in _messages(GROUPS))


def _bit_mismatch(got, want) -> str:
    """'' when ``got`` and ``want`` hold the same bits, else what differs (shape, dtype or words)."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"kernel {got.dtype}{list(got.shape)}, twin {want.dtype}{list(want.shape)}"
    bits = np.uint32 if got.dtype.itemsize == 4 else got.dtype
    differ = np.argwhere(got.view(bits) != want.view(bits))
    if differ.size == 0:
        return ""
    first = tuple(differ[0])
    return f"{len(differ)} words differ from the twin, first at {list(first)}: kernel {got[first]!r}, twin {want[first]!r}"


def test_fixture_exercises_every_path(message):
    """The inputs reach what the kernels must reproduce: every width, codes at both ends of a
    group's range (all bits clear, all bits set) and the clip."""
    values, gscale, width, _ = (np.asarray(a) for a in message)
    assert set(width.tolist()) == set(range(W.MIN_BITS, W.MAX_BITS + 1))
    planes = np.asarray(twin_encode(*message[:3], MSEED, START))
    lanes = np.arange(W.GROUP, dtype=np.uint32)
    codes = ((planes[:, None, :] >> lanes[None, :, None]) & 1) @ (1 << np.arange(W.MAX_BITS))  # [groups, 32]
    top = 2 ** width[:, None] - 2  # 2L
    assert (codes == 0).any() and (codes == top).any()
    assert (np.abs(values[40:44]) > gscale[40:44, None]).any()


@pytest.mark.parametrize("seeded", [True, False], ids=["dither", "nearest"])
@pytest.mark.parametrize("backend", K.BACKENDS)
def test_encode_kernel_equals_twin(message, backend, seeded):
    values, gscale, width, _ = message
    mseed = MSEED if seeded else None
    want = twin_encode(values, gscale, width, mseed, START)
    got = K.encode_groups_kernel(values, gscale, width, mseed, START, backend=backend, interpret=True)
    assert _bit_mismatch(got, want) == "", f"{backend} encode: {_bit_mismatch(got, want)}"


@pytest.mark.parametrize(
    "seeded,accumulate",
    [
        pytest.param(True, True, id="dither+local"),
        pytest.param(False, False, id="nearest"),
        # the same code paths, combined the other way round
        pytest.param(True, False, id="dither", marks=pytest.mark.slow),
        pytest.param(False, True, id="nearest+local", marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("backend", K.BACKENDS)
def test_decode_kernel_equals_twin(message, backend, seeded, accumulate):
    """Decoding arbitrary words (every plane, whatever the width), so that no bit is left unread."""
    _, gscale, width, local = message
    planes = jnp.asarray(np.random.default_rng(1).integers(0, 2**32, size=(GROUPS, W.MAX_BITS), dtype=np.uint32))
    mseed = MSEED if seeded else None
    local = local if accumulate else None
    want = twin_decode_ieee(planes, gscale, width, mseed, START, local)
    got = K.decode_groups_kernel(planes, gscale, width, mseed, START, local, backend=backend, interpret=True)
    assert np.isnan(np.asarray(got)[16]).all()  # the NaN-scale group decodes as NaN
    assert _bit_mismatch(got, want) == "", f"{backend} decode: {_bit_mismatch(got, want)}"


def test_pallas_impl_takes_the_twins_arguments(message):
    """``pallas_impl()`` gives the kernels as a ``GroupImpl``: called with the twins' arguments
    they trace to a kernel (the default device's backend; interpret mode on CPU)."""
    impl = K.pallas_impl()
    for kernel, twin in ((impl.encode, W.encode_groups), (impl.decode, W.decode_groups)):
        twin_parameters = list(inspect.signature(twin).parameters.values())
        assert list(inspect.signature(kernel).parameters.values())[: len(twin_parameters)] == twin_parameters
    values, gscale, width, local = message
    planes = jnp.zeros((GROUPS, W.MAX_BITS), jnp.uint32)
    encoded = jax.make_jaxpr(impl.encode)(values, gscale, width, MSEED)
    decoded = jax.make_jaxpr(impl.decode)(planes, gscale, width, MSEED, 0, local)
    for jaxpr in (encoded, decoded):
        assert "pallas_call" in str(jaxpr) and "interpret=InterpretParams(" in str(jaxpr)  # TPU's, interpreted


def test_kernels_batch_under_vmap():
    """The collectives vmap the quantizer over chunks, each with its own seed: the batched grid
    must still give every tile its own value indices (two tiles a message here)."""
    values, gscale, width, _ = (jnp.asarray(a).reshape(2, 200, *a.shape[1:]) for a in _messages(400, seed=5))
    seeds = jax.vmap(lambda c: W.message_seed(7, 0, c))(jnp.arange(2))
    planes = jax.vmap(lambda *a: K.encode_groups_kernel(*a, START, backend="gpu", interpret=True))(values, gscale, width, seeds)
    want = jax.vmap(lambda *a: twin_encode(*a, START))(values, gscale, width, seeds)
    assert _bit_mismatch(planes, want) == "", f"vmapped encode: {_bit_mismatch(planes, want)}"
    decoded = jax.vmap(lambda *a: K.decode_groups_kernel(*a, START, backend="gpu", interpret=True))(planes, gscale, width, seeds)
    want = jax.vmap(lambda *a: twin_decode(*a, START))(planes, gscale, width, seeds)
    assert _bit_mismatch(decoded, want) == "", f"vmapped decode: {_bit_mismatch(decoded, want)}"


def test_kernels_check_their_arguments(message):
    values, gscale, width, local = message
    with pytest.raises(ValueError, match=r"group_scale \(599,\).*\[600\]"):
        K.encode_groups_kernel(values, gscale[:-1], width, None, interpret=True)
    with pytest.raises(ValueError, match=r"planes: expected shape \[groups, 12\], got \(600, 32\)"):
        K.decode_groups_kernel(values, gscale, width, None, interpret=True)
    with pytest.raises(ValueError, match=r"local: expected shape \[600, 32\]"):
        K.decode_groups_kernel(jnp.zeros((GROUPS, W.MAX_BITS), jnp.uint32), gscale, width, None, local=local[:10], interpret=True)
    with pytest.raises(ValueError, match="backend='cuda'"):
        K.encode_groups_kernel(values, gscale, width, None, backend="cuda", interpret=True)


def test_pallas_impl_routes_the_whole_message_quantizers():
    """Given ``impl=pallas_impl(...)`` the whole-message functions trace the kernels and give the
    twins' bits; by default they trace the twins."""
    x = jnp.asarray(_messages(32, seed=2)[0].reshape(-1))
    local = jnp.linspace(-1.0, 1.0, x.size, dtype=jnp.float32)
    runs = {}
    for name, impl in (("twin", W.TWINS), ("kernel", K.pallas_impl("gpu", interpret=True))):
        def round_trip(x):
            packed = Q.quantize_dynamiq(x, 3.5, MSEED, impl=impl)
            return packed, Q.dequantize_dynamiq(packed, 3.5, MSEED, impl=impl)

        def uniform(x, local):
            return Q.dequantize_uniform(Q.quantize_uniform(x, 4, None, impl=impl), 4, None, local, impl=impl)

        traced = jax.jit(round_trip).trace(x), jax.jit(uniform).trace(x, local)
        assert sum(str(t.jaxpr).count("pallas_call") for t in traced) == (4 if name == "kernel" else 0), name
        runs[name] = traced[0].lower().compile()(x), traced[1].lower().compile()(x, local)
    (want, want_uniform), (got, got_uniform) = runs["twin"], runs["kernel"]
    for w, g, what in zip(jax.tree.leaves(want), jax.tree.leaves(got), ("words", "codes", "scales", "decoded")):
        assert _bit_mismatch(g, w) == "", f"{what}: {_bit_mismatch(g, w)}"
    # the accumulate: equal but for the last bit of sums XLA contracts into an FMA (twin_decode_ieee)
    np.testing.assert_allclose(got_uniform, want_uniform, rtol=1e-6, atol=0)
    # and the default is the twins
    assert "pallas_call" not in str(jax.make_jaxpr(lambda x: Q.quantize_dynamiq(x, 3.5, MSEED))(x))


def test_gpu_kernels_lower_to_triton(message):
    """Without a GPU: the Triton lowering accepts the kernels (power-of-two tensors, ops it has
    rules for). Compiling the Triton IR needs the GPU (the ``gpu`` tests)."""
    values, gscale, width, local = message
    planes = jnp.zeros((GROUPS, W.MAX_BITS), jnp.uint32)
    enc = lambda v, s, w, m: K.encode_groups_kernel(v, s, w, m, START, backend="gpu")  # noqa: E731
    dec = lambda p, s, w, m, x: K.decode_groups_kernel(p, s, w, m, START, x, backend="gpu")  # noqa: E731
    for fn, args in ((enc, (values, gscale, width, MSEED)), (dec, (planes, gscale, width, MSEED, local))):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text


# --- TPU: Mosaic compiles the kernels for a real chip, ahead of time -------------------------------

TOPOLOGIES = [
    "v5e:2x2",
    pytest.param("v5p:2x2x1", marks=pytest.mark.slow),
    pytest.param("v6e:2x2", marks=pytest.mark.slow),
]


@pytest.mark.tpu_aot
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_tpu_kernels_compile_ahead_of_time(topology, monkeypatch):
    pytest.importorskip("libtpu", reason="pip install -e .[tpu] brings the TPU compiler")
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only: no lock on a chip
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    try:
        devices = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
    except Exception as err:  # an old libtpu may not know the chip
        pytest.skip(f"libtpu has no {topology} topology: {err}")
    on_chip = NamedSharding(Mesh(np.array(devices[:1]), ("x",)), PartitionSpec())
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=on_chip)  # noqa: E731
    groups = 5000  # 3 tiles of 2048 groups, the last one partial
    values, planes = spec((groups, W.GROUP), jnp.float32), spec((groups, W.MAX_BITS), jnp.uint32)
    gscale, width, mseed = spec((groups,), jnp.float32), spec((groups,), jnp.int32), spec((), jnp.uint32)
    encode = jax.jit(lambda v, s, w, m: K.encode_groups_kernel(v, s, w, m, START, backend="tpu"))
    decode = jax.jit(lambda p, s, w, m, x: K.decode_groups_kernel(p, s, w, m, START, x, backend="tpu"))
    # vmapped over chunks with their own seeds, as the collectives call it
    batched = jax.jit(jax.vmap(lambda p, s, w, m: K.decode_groups_kernel(p, s, w, m, START, backend="tpu")))
    batch = lambda a: spec((2, *a.shape), a.dtype)  # noqa: E731
    hlo = {}
    for name, fn, args in (
        ("encode", encode, (values, gscale, width, mseed)),
        ("decode", decode, (planes, gscale, width, mseed, values)),
        ("vmapped decode", batched, tuple(map(batch, (planes, gscale, width, mseed)))),
    ):
        hlo[name] = fn.lower(*args).compile().as_text()
        assert 'custom_call_target="tpu_custom_call"' in hlo[name], f"{name}: the kernel did not go through Mosaic"
    assert "u32[1536,48]" in hlo["encode"]  # 3 tiles of [512 rows, 4 groups x 12 planes]


# --- GPU: the Triton kernels for real ---------------------------------------------------------------


def _gpu():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("no GPU visible (the suite defaults to JAX_PLATFORMS=cpu: run with JAX_PLATFORMS=cuda,cpu)")


@pytest.mark.gpu
@pytest.mark.parametrize("seeded", [True, False], ids=["dither", "nearest"])
def test_gpu_kernels_equal_twins_on_the_gpu(seeded):
    gpu = _gpu()
    values, gscale, width, local = jax.device_put(_messages(40_000, seed=3), gpu)
    mseed = jax.device_put(MSEED, gpu) if seeded else None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The Pallas Triton backend is deprecated", DeprecationWarning)
        want = jax.jit(lambda *a: W.encode_groups(*a, START))(values, gscale, width, mseed)
        got = jax.jit(lambda *a: K.encode_groups_kernel(*a, START, backend="gpu"))(values, gscale, width, mseed)
        assert _bit_mismatch(got, want) == "", f"gpu encode: {_bit_mismatch(got, want)}"
        planes = jax.device_put(np.random.default_rng(4).integers(0, 2**32, size=(40_000, W.MAX_BITS), dtype=np.uint32), gpu)
        for acc in (local, None):
            want = twin_decode_ieee(planes, gscale, width, mseed, START, acc)
            kernel = jax.jit(lambda p, s, w, m, x: K.decode_groups_kernel(p, s, w, m, START, x, backend="gpu"))
            got = kernel(planes, gscale, width, mseed, acc)
            assert _bit_mismatch(got, want) == "", f"gpu decode, local={acc is not None}: {_bit_mismatch(got, want)}"
