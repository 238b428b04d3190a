"""BD3-LM (jaxpar/models/bd3lm.py): the three-part mask against its definition written token by
token, the corruption (deterministic, only the noisy half, each block masked at its level) and the
loss against a plain-jnp forward written here from the definitions. Layouts against one device:
tests/test_block_parallel.py.

Tolerances (float32 on CPU): attention outputs within 1e-5 of the reference's largest entry; the
loss and its gradients within rtol 1e-5 / 1e-4 and atol 1e-6 / 1e-5 (the same sums in other
orders; measured differences are ~1e-7). Masked fractions: within 0.01 of t, each over 64,000
tokens (a standard deviation of at most 0.002: 5 or more of them).
"""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar import attention as A
from jaxpar.errors import JaxparError
from jaxpar.models import bd3lm, family_of, model_config
from jaxpar.rules import LOGICAL_AXES
from jaxpar.train import data
from jaxpar.train.state import abstract_model

CFG = bd3lm.CONFIGS["bd3lm-tiny"]
MASK = CFG.mask_id
SMALL = dataclasses.replace(CFG, layers=2)  # the tiny shapes with fewer layers: the plain forward compiles unrolled
FRACTION_TOL = 0.01


@functools.cache
def small_model():
    return bd3lm.BD3LM(SMALL, rngs=nnx.Rngs(0))


def three_part(length: int, block_size: int, window: int | None = None) -> np.ndarray:
    """(2L, 2L) bool from the definition: [noisy | clean] tokens, each half cut into blocks; with a
    sliding window of W tokens a block reads only the W / B clean blocks before its own."""
    pos = np.arange(2 * length)
    noisy = pos < length
    block = (pos % length) // block_size
    qn, kn, qb, kb = noisy[:, None], noisy[None, :], block[:, None], block[None, :]
    near = kb >= qb - (length if window is None else window) // block_size
    return (qn & kn & (qb == kb)) | (qn & ~kn & (kb < qb) & near) | (~qn & ~kn & (kb <= qb) & near)


def dense_attention(q, k, v, allowed):
    """softmax(q k^T / sqrt(d), masked by ``allowed``) v; GQA by repeating the kv heads."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    p = jax.nn.softmax(jnp.where(allowed, s, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


# --- the mask --------------------------------------------------------------------------------------


@pytest.mark.parametrize("length, block_size, window", [(16, 4, None), (24, 8, None), (8, 8, None), (6, 1, None), (32, 4, 8), (24, 8, 8)])
def test_mask_is_the_three_part_mask(length, block_size, window):
    want = three_part(length, block_size, window)
    mask = bd3lm.block_diffusion_mask(length, block_size, window)
    assert np.array_equal(np.asarray(mask.dense(2 * length, 2 * length))[0], want)
    # a chunk pair at traced offsets (a ring's): the same entries, from the block counts
    q0, k0 = length // 2, block_size
    chunk = jax.jit(lambda qo, ko: mask.dense(length, length, qo, ko))(q0, k0)
    assert np.array_equal(np.asarray(chunk)[0], want[q0:q0 + length, k0:k0 + length])


# blockwise tiles of (queries, keys) that span two mask blocks, and that cut them in half
@pytest.mark.parametrize("length, block_size, tiles", [(16, 4, (8, 8)), (32, 8, (4, 16))])
def test_attention_under_the_mask_equals_dense_softmax(length, block_size, tiles):
    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.normal(size=(2, 2 * length, h, 8)), jnp.float32) for h in (4, 2, 2))
    want = dense_attention(q, k, v, three_part(length, block_size))
    mask = bd3lm.block_diffusion_mask(length, block_size)
    scale = float(jnp.max(jnp.abs(want)))
    for impl, (tile_q, tile_kv) in (("naive", (512, 512)), ("blockwise", tiles)):
        got = jax.jit(lambda q, k, v: A.attention(q, k, v, mask, implementation=impl, block_q=tile_q, block_kv=tile_kv))(q, k, v)
        assert float(jnp.max(jnp.abs(got - want))) <= 1e-5 * scale, impl


# --- the corruption --------------------------------------------------------------------------------


def clean_tokens(rows, length, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=(rows, length)).astype(np.int32)


def test_corruption_is_deterministic_and_touches_only_masked_noisy_tokens():
    tokens, length = clean_tokens(8, 32), 32
    batch = bd3lm.corrupt(tokens, 8, (3, 7), mask_id=MASK)
    again = bd3lm.corrupt(tokens, 8, np.random.default_rng((3, 7)), mask_id=MASK)
    other = bd3lm.corrupt(tokens, 8, (3, 8), mask_id=MASK)
    assert all(np.array_equal(batch[key], again[key]) for key in batch)
    assert not np.array_equal(batch["inputs"], other["inputs"])
    assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
        "inputs": ((8, 64), np.int32), "targets": ((8, 64), np.int32), "positions": ((8, 64), np.int32), "weights": ((8, 64), np.float32)}
    noisy, clean = batch["inputs"][:, :length], batch["inputs"][:, length:]
    assert np.array_equal(clean, tokens)
    changed = noisy != tokens
    assert np.all(noisy[changed] == MASK) and changed.any() and (~changed).any()
    assert np.array_equal(batch["targets"], np.concatenate([tokens, tokens], 1))
    assert np.array_equal(batch["positions"], np.tile(np.arange(length), (8, 2)))
    # weights: 2 / t_b on masked noisy tokens, one t per block and inside the range; 0 elsewhere
    w = batch["weights"]
    assert np.all(w[:, length:] == 0) and np.all(w[:, :length][~changed] == 0)
    assert np.all(w[:, :length][changed] > 0)
    lo, hi = bd3lm.T_RANGE
    for row in range(8):
        for block in range(4):
            cut = slice(block * 8, block * 8 + 8)
            levels = 2 / w[row, cut][changed[row, cut]]
            if levels.size:
                assert np.ptp(levels) <= 1e-5 and lo - 1e-6 <= levels[0] <= hi + 1e-6


def test_weights_are_two_over_t_at_the_given_levels():
    t = np.array([[0.2, 0.5, 1.0, 0.9]] * 3, np.float32)
    batch = bd3lm.mask_tokens(clean_tokens(3, 16), 4, t, 0, mask_id=MASK)
    masked = batch["inputs"][:, :16] == MASK
    want = np.where(masked, 2 / np.repeat(t, 4, axis=1), 0)
    np.testing.assert_allclose(batch["weights"], np.concatenate([want, np.zeros_like(want)], 1), rtol=1e-6)
    assert masked[:, 8:12].all()  # t = 1 masks the whole block


def test_each_block_is_masked_at_its_noise_level():
    rows, length, size = 8000, 32, 8
    levels = np.array([0.1, 0.4, 0.7, 0.95], np.float32)  # one per block
    batch = bd3lm.mask_tokens(clean_tokens(rows, length), size, np.tile(levels, (rows, 1)), 5, mask_id=MASK)
    fraction = (batch["inputs"][:, :length] == MASK).reshape(rows, 4, size).mean(axis=(0, 2))
    np.testing.assert_allclose(fraction, levels, atol=FRACTION_TOL)  # 64,000 tokens per level: sd <= 0.002
    # drawn levels: uniform in the range, and each block's fraction follows its own level
    rows, length, size = 20_000, 16, 4
    t = bd3lm.noise_levels(1, rows, length // size)
    lo, hi = bd3lm.T_RANGE
    assert t.min() >= lo and t.max() <= hi and abs(t.mean() - (lo + hi) / 2) < FRACTION_TOL
    batch = bd3lm.mask_tokens(clean_tokens(rows, length), size, t, 2, mask_id=MASK)
    per_block = (batch["inputs"][:, :length] == MASK).reshape(rows, -1, size).mean(-1)
    bins = np.digitize(t, np.linspace(lo, hi, 6)[1:-1])  # 5 bins of t, ~16,000 blocks each
    for b in range(5):
        assert abs(per_block[bins == b].mean() - t[bins == b].mean()) < FRACTION_TOL
    # corrupt draws the levels and the masks from one generator, in that order
    g1, g2 = np.random.default_rng(9), np.random.default_rng(9)
    tokens = clean_tokens(4, 16)
    via = bd3lm.mask_tokens(tokens, 4, bd3lm.noise_levels(g2, 4, 4), g2, mask_id=MASK)
    assert all(np.array_equal(v, via[k]) for k, v in bd3lm.corrupt(tokens, 4, g1, mask_id=MASK).items())


# --- the loss against a plain forward --------------------------------------------------------------


def rms_norm(x, scale, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale


def rope(x, positions, theta):
    """Half-split rotary embedding: pair (i, i + d/2) rotated by position x theta^(-i / (d/2))."""
    half = x.shape[-1] // 2
    angle = positions[:, :, None, None] * theta ** (-jnp.arange(half) / half)
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * jnp.cos(angle) - b * jnp.sin(angle), b * jnp.cos(angle) + a * jnp.sin(angle)], -1)


def reference_loss(params, cfg, x0, t, inputs, block_size):
    """The objective from its definitions: [x_t ; x_0] through the layers with dense attention
    under the (2L, 2L) mask; cross-entropy over the data's ids at the masked noisy tokens, weighted
    by 1/t of their block, mean over the noisy positions."""
    length = x0.shape[1]
    positions = jnp.tile(jnp.arange(length), 2)[None].astype(jnp.float32)
    allowed = three_part(length, block_size)
    x = params["embedding"][inputs]
    w = params["layers"]
    for i in range(cfg.layers):
        h = rms_norm(x, w["attn_norm"][i], cfg.norm_eps)
        q = rope(jnp.einsum("ble,ehd->blhd", h, w["wq"][i]), positions, cfg.rope_theta)
        k = rope(jnp.einsum("ble,ekd->blkd", h, w["wk"][i]), positions, cfg.rope_theta)
        v = jnp.einsum("ble,ekd->blkd", h, w["wv"][i])
        x = x + jnp.einsum("blhd,hde->ble", dense_attention(q, k, v, allowed), w["wo"][i])
        h = rms_norm(x, w["mlp_norm"][i], cfg.norm_eps)
        x = x + (jax.nn.silu(h @ w["w_gate"][i]) * (h @ w["w_up"][i])) @ w["w_down"][i]
    logits = rms_norm(x, params["final_norm"], cfg.norm_eps) @ params["unembedding"]
    log_p = jax.nn.log_softmax(logits[:, :length, : cfg.data_vocab], -1)  # MASK and padding are never the answer
    nll = -jnp.take_along_axis(log_p, x0[..., None], -1)[..., 0]
    masked = inputs[:, :length] == cfg.mask_id
    return jnp.mean(jnp.where(masked, nll / jnp.repeat(t, block_size, axis=1), 0.0))


def test_loss_and_gradients_equal_the_plain_forward():
    length, size = 32, 8
    x0 = clean_tokens(2, length, seed=4)
    t = bd3lm.noise_levels(4, 2, length // size)
    batch = bd3lm.mask_tokens(x0, size, t, 4, mask_id=MASK)
    graphdef, state = nnx.split(small_model())
    params = nnx.to_pure_dict(state)

    def model_loss(p):
        nnx.replace_by_pure_dict(state, p)
        model, inputs = nnx.merge(graphdef, state), jax.tree.map(jnp.asarray, batch)
        beyond_data = jax.nn.softmax(model(inputs["inputs"], inputs["positions"], size), -1)[..., SMALL.data_vocab:].max()
        return bd3lm.loss_fn(model, inputs, size), beyond_data

    (loss, beyond_data), grads = jax.jit(jax.value_and_grad(model_loss, has_aux=True))(params)
    ref, ref_grads = jax.jit(jax.value_and_grad(reference_loss), static_argnums=(1, 5))(params, SMALL, jnp.asarray(x0), jnp.asarray(t),
                                                                                      jnp.asarray(batch["inputs"]), size)
    assert float(loss) == pytest.approx(float(ref), rel=1e-5)
    assert 3 < float(loss) < 30  # about ln(256) per masked token, times 1/t and the masked fraction
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), grads, ref_grads)
    assert float(beyond_data) == 0.0  # no probability on MASK or the padding ids


# --- configs and bad input -------------------------------------------------------------------------


def test_configs_are_known_by_name_with_their_family():
    tiny = model_config("bd3lm-tiny")
    assert family_of(tiny).name == "bd3lm" and family_of(model_config("tiny")).name == "llama"
    assert tiny.mask_id == 256 and tiny.vocab_size % bd3lm.VOCAB_MULTIPLE == 0 and tiny.vocab_size > 256
    big = model_config("bd3lm-8b")
    assert big.mask_id == 128_256 and big.embed == 4096 and big.layers == 32
    assert big.num_params() == pytest.approx(8.03e9, rel=0.01)
    _, state = abstract_model(lambda r: bd3lm.BD3LM(big, rngs=r))  # shapes only
    count = 0
    for path, var in nnx.to_flat_state(state):
        names = var.get_metadata()["out_sharding"]
        assert len(names) == var.get_value().ndim and set(names) <= set(LOGICAL_AXES), path
        count += var.get_value().size
    assert count == big.num_params()


def test_bad_input_is_refused_in_words():
    with pytest.raises(JaxparError, match=r"block_size=5 does not divide the sequence length 32: choose a block size among 1, 2, 4, 8, 16, 32"):
        bd3lm.block_diffusion_mask(32, 5)
    with pytest.raises(JaxparError, match=r"block_size=6 does not divide the sequence length 16"):
        bd3lm.corrupt(clean_tokens(2, 16), 6, 0, mask_id=MASK)
    for bad in (0, -4, 2.0):
        with pytest.raises(JaxparError, match=r"must be a positive int"):
            bd3lm.corrupt(clean_tokens(2, 16), bad, 0, mask_id=MASK)
    with pytest.raises(JaxparError, match=r"0 < t_min <= t_max <= 1"):
        bd3lm.corrupt(clean_tokens(2, 16), 4, 0, mask_id=MASK, t_range=(0.0, 1.0))
    with pytest.raises(JaxparError, match=r"token ids must lie in \[0, mask_id=256\)"):
        bd3lm.corrupt(np.full((2, 16), 256), 4, 0, mask_id=MASK)
    model = small_model()
    with pytest.raises(JaxparError, match=r"block_size=16 does not divide the sequence length 24"):
        model(jnp.zeros((1, 48), jnp.int32))
    with pytest.raises(JaxparError, match=r"even number of tokens"):
        model(jnp.zeros((1, 33), jnp.int32), block_size=1)
    for bad in (6, 0, -4):  # a window is whole blocks of clean context
        with pytest.raises(JaxparError, match=rf"window={bad} must be a positive multiple of the block size 4 .* e.g. 4, 8, 16, 32"):
            bd3lm.block_diffusion_mask(32, 4, bad)
    with pytest.raises(JaxparError, match=r"window=8 must be a positive multiple of the block size 16"):
        dataclasses.replace(SMALL, window=8)


# --- the main job: `jaxpar train --model bd3lm-tiny --block-size 16` ---------------------------------


def test_main_job_trains_the_diffusion_objective():
    from jaxpar.report import step_report
    from jaxpar.topology import load_topology
    from jaxpar.run import RunConfig, run_training

    run = RunConfig(model="bd3lm-tiny", block_size=16, strategy="data=2,fsdp=2,tensor=2", steps=20, batch_size=8, seq_len=64)
    report = run_training(run, load_topology("cpu-8"), progress=None, analyze=step_report)
    losses = report["losses"]
    # measured: 6.7 at the start, about 3.4 after 20 steps (the byte-level masked tokens' 1/t-weighted loss)
    assert np.mean(losses[-5:]) < 0.7 * losses[0], losses
    assert np.isfinite(report["held_out_loss"])
    # the analytic optimum of the layout, at the model's length [x_t ; x_0] = 2 x 64, is what ran
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        assert report["communication"][kind]["ratio"] == pytest.approx(1.0, abs=0.02)


def test_a_diffusion_row_is_the_same_whichever_process_reads_it():
    tokens = np.arange(4000, dtype=np.int32) % 256
    whole = data.family_batch_at(tokens, 3, 8, 32, 0, 0, 8, bd3lm.FAMILY, CFG)
    parts = [data.family_batch_at(tokens, 3, 8, 32, 0, a, b, bd3lm.FAMILY, CFG) for a, b in ((0, 3), (3, 8))]
    for key, array in whole.items():
        np.testing.assert_array_equal(array, np.concatenate([p[key] for p in parts]))
    assert whole["inputs"].shape == (8, 64) and (whole["inputs"][:, :32] == MASK).any()


def test_main_job_refuses_what_the_model_cannot_take():
    from jaxpar.run import RunConfig, run_model_config

    with pytest.raises(JaxparError, match="--block-size 16 is for block diffusion models"):
        run_model_config(RunConfig(model="tiny", block_size=16))
    with pytest.raises(JaxparError, match="among 1, 2, 4, 5, 8, 10, 20, 40"):
        run_model_config(RunConfig(model="bd3lm-tiny", seq_len=40, block_size=16))
    with pytest.raises(JaxparError, match="drop --packing"):
        run_model_config(RunConfig(model="bd3lm-tiny", seq_len=64, packing=True))
    with pytest.raises(JaxparError, match="--window 32 is for block diffusion models"):
        run_model_config(RunConfig(model="tiny", window=32))
    with pytest.raises(JaxparError, match="window=24 must be a positive multiple of the block size 16"):
        run_model_config(RunConfig(model="bd3lm-tiny", seq_len=64, window=24))
    assert run_model_config(RunConfig(model="bd3lm-tiny", seq_len=64, block_size=8, window=24)).window == 24


@pytest.mark.tpu_aot
def test_compiles_for_a_tpu_pod_with_splash_under_the_three_part_mask():
    pytest.importorskip("libtpu", reason="pip install -e .[tpu] brings the TPU compiler")
    from jaxpar import aot
    from jaxpar.topology import load_topology

    report = aot.compile_report("bd3lm-tiny", load_topology("v5p-8"), "fsdp=4", 16, 128, block_size=16, alternatives=0)
    assert report["compiler"] == "tpu" and report["attention"] == "splash"  # the block mask as splash's NumpyMask
    # the model reads [x_t ; x_0]: twice the sequence's FLOPs
    assert report["model_flops_per_step"] == CFG.flops_per_token(256) * 16 * 256
