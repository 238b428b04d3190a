"""The attention op (jaxpar/attention.py): blockwise against the naive reference, chunks merged by
online softmax against the whole, memory growth, splash for TPU ahead of time, bad input.

Tolerances (float32 on CPU): values and gradients agree within 1e-5 of the largest entry of the
reference (the two sum the same terms in different orders; measured differences are ~1e-6).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import attention as A
from jaxpar.errors import JaxparError

B, L, H, KV, D = 2, 32, 4, 2, 8  # GQA: two query heads per kv head
BQ, BK = 8, 16  # unequal blocks, so query and key tiling differ
TOL = 1e-5
DIFFUSION_BLOCK = 4  # block diffusion: L = 2 halves x 4 blocks x 4 tokens


def error(got, want) -> float:
    """Largest difference, as a fraction of the reference's largest entry."""
    return float(jnp.max(jnp.abs(got - want))) / float(jnp.max(jnp.abs(want)))


def qkv(seed=0, length=L, dtype=jnp.float32):
    r = np.random.default_rng(seed)
    return tuple(jnp.asarray(r.normal(size=s), dtype) for s in ((B, length, H, D), (B, length, KV, D), (B, length, KV, D)))


def segment_ids(seed=0, length=L):
    """Packed documents: each row cut at random places into 3-6 segments."""
    r = np.random.default_rng(seed + 100)
    rows = []
    for _ in range(B):
        cuts = np.sort(r.choice(np.arange(1, length), size=r.integers(2, 6), replace=False))
        rows.append(np.searchsorted(cuts, np.arange(length), side="right"))
    return jnp.asarray(np.stack(rows), jnp.int32)


def block_diffusion(n: int, size: int) -> A.Mask:
    """Issue 16's mask over [noisy blocks | clean blocks], n blocks each: noisy block i sees noisy
    block i and clean blocks < i; clean block j sees clean blocks <= j."""

    def allowed(qb, kb):
        if qb < n:  # noisy query block
            return kb == qb if kb < n else kb - n < qb
        return n <= kb <= qb  # clean query block: clean keys up to its own block

    return A.Mask(blocks=A.BlockMask(allowed, size, num_blocks=(2 * n, 2 * n)))


def block_diffusion_dense(n: int, size: int) -> np.ndarray:
    """The same mask written token by token, without block indices."""
    pos = np.arange(2 * n * size)
    noisy = pos < n * size
    idx = (pos % (n * size)) // size  # block number inside its half
    qn, kn, qi, ki = noisy[:, None], noisy[None, :], idx[:, None], idx[None, :]
    return (qn & kn & (qi == ki)) | (qn & ~kn & (ki < qi)) | (~qn & ~kn & (ki <= qi))


def masks():
    seg = segment_ids()
    return {
        "causal": A.CAUSAL,
        "bidirectional": A.BIDIRECTIONAL,
        "segments": A.CAUSAL.with_segments(seg),
        "window": A.Mask(window=(5, 3)),
        "causal+window": A.Mask(causal=True, window=(6, 0)),
        "block diffusion": block_diffusion(L // (2 * DIFFUSION_BLOCK), DIFFUSION_BLOCK),
    }


MASKS = list(masks())


def value_and_grads(fn, q, k, v):
    """The output and the gradients w.r.t. q, k, v of a random linear function of it."""
    w = jnp.asarray(np.random.default_rng(7).normal(size=q.shape), jnp.float32)

    def loss(q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out * w), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


@pytest.mark.parametrize("name", MASKS)
def test_blockwise_equals_naive_in_values_and_gradients(name):
    mask = masks()[name]
    q, k, v = qkv()
    ref, ref_grads = value_and_grads(lambda q, k, v: A.attention(q, k, v, mask, implementation="naive"), q, k, v)
    out, grads = value_and_grads(lambda q, k, v: A.attention(q, k, v, mask, implementation="blockwise", block_q=BQ, block_kv=BK), q, k, v)
    assert error(out, ref) <= TOL
    for got, want in zip(grads, ref_grads):
        assert error(got, want) <= TOL
    # every query sees some key, and every mask but the bidirectional one hides some
    dense = np.asarray(mask.dense(L, L))
    assert dense.any(-1).all() and dense.all() == (name == "bidirectional")


def test_block_diffusion_mask_is_the_three_part_mask():
    n = 4
    mask = block_diffusion(n, DIFFUSION_BLOCK)
    want = block_diffusion_dense(n, DIFFUSION_BLOCK)
    assert np.array_equal(np.asarray(mask.dense(L, L))[0], want)
    # on aligned tiles the plan is exactly the tiles that hold an allowed entry
    plan = A.block_plan(mask, L, L, DIFFUSION_BLOCK, DIFFUSION_BLOCK)
    tiles = want.reshape(2 * n, DIFFUSION_BLOCK, 2 * n, DIFFUSION_BLOCK).any((1, 3))
    assert np.array_equal(plan, tiles) and plan.sum() < plan.size // 2
    # and at a chunk's offsets, the chunk's part of the same mask
    assert np.array_equal(np.asarray(mask.dense(8, 16, q_offset=16, kv_offset=8))[0], want[16:24, 8:24])


def test_empty_blocks_are_not_computed():
    """NaN values in the last key block: under a causal mask only the last query block may see it.
    A block computed and then masked would multiply NaN by 0 into every row (as naive does)."""
    q, k, v = qkv()
    v = v.at[:, -BK:].set(jnp.nan)
    run = jax.jit(A.attention, static_argnames=("implementation", "block_q", "block_kv"))
    out = run(q, k, v, A.CAUSAL, implementation="blockwise", block_q=BQ, block_kv=BK)
    assert bool(jnp.isfinite(out[:, : L - BK]).all()) and bool(jnp.isnan(out[:, L - BK :]).all())
    assert bool(jnp.isnan(run(q, k, v, A.CAUSAL, implementation="naive")[:, 0]).all())
    plan = A.block_plan(A.CAUSAL, L, L, BQ, BK)
    assert plan.sum() == sum(min(i * BQ // BK + 1, L // BK) for i in range(L // BQ))  # the lower triangle of tiles


@pytest.mark.parametrize("name", ["causal", "segments", "block diffusion"])
def test_chunks_merged_equal_the_whole(name):
    """Each q chunk against every kv chunk at its offsets, merged by online softmax: as a ring
    would. Values and gradients (the lse cotangent flows through merge) against naive on the whole."""
    mask = masks()[name]
    q, k, v = qkv(1)
    qc, kc = 16, 16  # 2 x 2 chunks: causal leaves the pair (q 0, kv 1) empty (lse -inf)

    def chunked(q, k, v):
        rows = []
        for i in range(0, L, qc):
            acc = None
            for j in range(0, L, kc):
                m = mask
                if mask.segments is not None:
                    m = mask.with_segments(mask.segments.q[:, i : i + qc], mask.segments.kv[:, j : j + kc])
                part = A.attention_chunk(q[:, i : i + qc], k[:, j : j + kc], v[:, j : j + kc], m, q_offset=i, kv_offset=j, block_q=BQ, block_kv=BK // 2)
                acc = part if acc is None else A.merge(acc, part)
            rows.append(acc[0])
        return jnp.concatenate(rows, axis=1)

    ref, ref_grads = value_and_grads(lambda q, k, v: A.attention(q, k, v, mask, implementation="naive"), q, k, v)
    out, grads = value_and_grads(chunked, q, k, v)
    assert error(out, ref) <= TOL
    for got, want in zip(grads, ref_grads):
        assert error(got, want) <= TOL


def test_traced_offsets_give_the_same_as_static_ones():
    """A ring's kv offset depends on the step: a scan over kv chunks with traced offsets."""
    seg = segment_ids(3)
    mask = block_diffusion(L // (2 * DIFFUSION_BLOCK), DIFFUSION_BLOCK).with_segments(seg)
    q, k, v = qkv(2)
    kc = 8

    @jax.jit
    def ring_like(q, k, v):
        def step(acc, c):
            ks = jax.lax.dynamic_slice_in_dim(k, c * kc, kc, 1)
            vs = jax.lax.dynamic_slice_in_dim(v, c * kc, kc, 1)
            sk = jax.lax.dynamic_slice_in_dim(seg, c * kc, kc, 1)
            part = A.attention_chunk(q, ks, vs, mask.with_segments(seg, sk), q_offset=0, kv_offset=c * kc, block_q=BQ, block_kv=kc)
            return A.merge(acc, part), None

        init = (jnp.zeros(q.shape), jnp.full(q.shape[:3], -jnp.inf))
        return jax.lax.scan(step, init, jnp.arange(L // kc))[0]

    out, lse = ring_like(q, k, v)
    ref, ref_lse = A.attention_chunk(q, k, v, mask, implementation="naive")
    assert error(out, ref) <= TOL
    assert error(lse, ref_lse) <= TOL


def test_bfloat16_inputs_keep_float32_statistics():
    q, k, v = qkv(dtype=jnp.bfloat16)
    out, lse = A.attention_chunk(q, k, v, A.CAUSAL, block_q=BQ, block_kv=BK)
    assert out.dtype == jnp.float32 and lse.dtype == jnp.float32
    assert A.attention(q, k, v, A.CAUSAL, implementation="blockwise", block_q=BQ, block_kv=BK).dtype == jnp.bfloat16
    ref = A.attention(*(x.astype(jnp.float32) for x in (q, k, v)), A.CAUSAL, implementation="naive")
    assert error(out, ref) <= 2e-2  # bf16 probabilities in the p @ v product


def temp_bytes(impl: str, length: int) -> int:
    """Temporaries of the compiled gradient of sum(attention), one head of 8, batch 1."""
    shape = jax.ShapeDtypeStruct((1, length, 1, 8), jnp.float32)
    loss = lambda q, k, v: A.attention(q, k, v, A.CAUSAL, implementation=impl, block_q=32, block_kv=32).sum()
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(shape, shape, shape).compile().memory_analysis().temp_size_in_bytes


def test_blockwise_memory_grows_linearly_and_naive_quadratically():
    naive = temp_bytes("naive", 512) / temp_bytes("naive", 256)
    blockwise = temp_bytes("blockwise", 512) / temp_bytes("blockwise", 256)
    print(f"temporaries 512 / 256: naive {naive:.2f}, blockwise {blockwise:.2f}")
    assert naive > 3.2, naive
    assert blockwise < 2.4, blockwise


def test_auto_chooses_by_backend_and_mask():
    seg = A.CAUSAL.with_segments(segment_ids())
    assert A.choose_implementation("auto", A.CAUSAL, jnp.bfloat16, backend="tpu", lengths=(256, 256)) == "splash"
    assert A.choose_implementation("auto", A.CAUSAL, jnp.bfloat16, backend="tpu", lengths=(100, 100)) == "blockwise"
    assert A.choose_implementation("auto", A.CAUSAL, jnp.bfloat16, backend="gpu") == "cudnn"
    assert A.choose_implementation("auto", A.Mask(causal=True, window=(64, 0)), jnp.bfloat16, backend="gpu") == "cudnn"
    assert A.choose_implementation("auto", seg, jnp.bfloat16, backend="gpu") == "blockwise"
    assert A.choose_implementation("auto", A.CAUSAL, jnp.float32, backend="gpu") == "blockwise"
    assert A.choose_implementation("auto", A.CAUSAL, jnp.float32, backend="cpu") == "blockwise"


def test_bad_input_is_refused_in_words():
    q, k, v = qkv()
    with pytest.raises(JaxparError, match=r"unknown attention implementation 'flash': choose one of auto, naive"):
        A.attention(q, k, v, A.CAUSAL, implementation="flash")
    with pytest.raises(JaxparError, match=r"'cudnn' cannot do segments .*use 'splash' \(TPU\), 'blockwise'"):
        A.attention(q, k, v, A.CAUSAL.with_segments(segment_ids()), implementation="cudnn")
    with pytest.raises(JaxparError, match=r"'cudnn' cannot do a block mask"):
        A.attention(q, k, v, masks()["block diffusion"], implementation="cudnn")
    with pytest.raises(JaxparError, match=r"'cudnn' cannot do window=\(5, 3\)"):
        A.attention(q, k, v, A.Mask(window=(5, 3)), implementation="cudnn")
    with pytest.raises(JaxparError, match=r"'cudnn' cannot do dtype float32"):
        A.attention(q, k, v, A.CAUSAL, implementation="cudnn")
    with pytest.raises(JaxparError, match=r"'cudnn' needs a GPU; this backend is 'cpu'"):
        A.attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), A.CAUSAL, implementation="cudnn")
    with pytest.raises(JaxparError, match=r"4 query heads are not a multiple of 3 kv heads"):
        A.attention(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2), A.CAUSAL)
    with pytest.raises(JaxparError, match=r"length 32 is not a multiple of block_q=12"):
        A.attention(q, k, v, A.CAUSAL, implementation="blockwise", block_q=12)
    with pytest.raises(JaxparError, match=r"window=\(-1, 2\)"):
        A.attention(q, k, v, A.Mask(window=(-1, 2)))
    with pytest.raises(JaxparError, match=r"segment ids of shapes \(2, 16\) \(q\)"):
        A.attention(q, k, v, A.CAUSAL.with_segments(segment_ids()[:, :16]))
    with pytest.raises(JaxparError, match=r"multiples of 128; got q_len 32"):
        A.attention(q, k, v, A.CAUSAL, implementation="splash")
    no_count = A.Mask(blocks=A.BlockMask(lambda a, b: a >= b, 4))
    with pytest.raises(JaxparError, match=r"traced offsets or at given token places \(Mask.at\) needs .*num_blocks="):
        jax.jit(lambda off: A.attention_chunk(q, k, v, no_count, kv_offset=off)[0])(0)


# --- splash ----------------------------------------------------------------------------------------


SPLASH_MASKS = {
    "causal+segments": lambda n: A.CAUSAL.with_segments(jnp.asarray(np.repeat([[0, 1]], 1, 0).repeat(n // 2, 1), jnp.int32)),
    "block diffusion": lambda n: block_diffusion(2, n // 4),
}


def splash_problem(length=256, dtype=jnp.bfloat16):
    return [jax.ShapeDtypeStruct(s, dtype) for s in ((1, length, 2, 128), (1, length, 1, 128), (1, length, 1, 128))]


@pytest.mark.tpu_aot
@pytest.mark.parametrize("name", list(SPLASH_MASKS))
def test_splash_compiles_for_tpu_ahead_of_time(name, monkeypatch):
    pytest.importorskip("libtpu", reason="pip install -e .[tpu] brings the TPU compiler")
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only: no chip held
    from jax.experimental.topologies import get_topology_desc

    try:
        device = get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices[0]
    except Exception as err:
        pytest.skip(f"no TPU topology v5e:2x2: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
    mask = SPLASH_MASKS[name](256)
    sharding = jax.sharding.SingleDeviceSharding(device)
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in splash_problem()]
    loss = lambda q, k, v: A.attention(q, k, v, mask, implementation="splash", block_q=128, block_kv=128).astype(jnp.float32).sum()
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile().as_text()
    # the forward and the two backward kernels are Mosaic custom calls, not XLA dots over scores
    assert text.count("tpu_custom_call") >= 3, text[:2000]
    assert "splash" in text


def test_splash_in_interpret_mode_equals_naive():
    """The mask mapping onto splash's classes (LocalMask, CausalMask, NumpyMask, SegmentIds), run
    by Pallas's interpreter on the CPU (forward only; the TPU compile above covers the backward)."""
    r = np.random.default_rng(4)
    q, k, v = (jnp.asarray(r.normal(size=s.shape), jnp.float32) for s in splash_problem(128, jnp.float32))
    q, k, v = q[..., :8], k[..., :8], v[..., :8]
    seg = jnp.asarray(np.repeat([[0, 1]], 64, 1), jnp.int32)
    for mask in (A.Mask(window=(5, 3)).with_segments(seg), block_diffusion(4, 16)):
        out = A.attention(q, k, v, mask, implementation="splash", block_q=128, block_kv=128, interpret=True)
        assert error(out, A.attention(q, k, v, mask, implementation="naive")) <= TOL


def test_splash_runs_inside_the_steps_shard_map():
    """Inside a shard_map with its varying-axes checks on (as jaxpar's step runs the model), the
    splash kernels' outputs are typed by ``use_implementation``; values and gradients, in Pallas's
    interpreter, equal the naive attention's."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    r = np.random.default_rng(5)
    q, k, v = (jnp.asarray(r.normal(size=(8, 128, 1, 8)), jnp.float32) for _ in range(3))
    weights = jnp.cos(jnp.arange(q.size, dtype=jnp.float32)).reshape(q.shape)
    local = lambda q, k, v: A.attention(q, k, v, A.CAUSAL, block_q=128, block_kv=128, interpret=True)  # noqa: E731
    mapped = jax.shard_map(local, mesh=mesh, in_specs=(P("data"),) * 3, out_specs=P("data"))
    with A.use_implementation("splash"):
        grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(mapped(q, k, v) * weights), argnums=(0, 1, 2)))(q, k, v)
    ref = jax.grad(lambda q, k, v: jnp.sum(A.attention(q, k, v, A.CAUSAL, implementation="naive") * weights), argnums=(0, 1, 2))(q, k, v)
    for got, want in zip(grads, ref):
        assert error(got, want) <= TOL
