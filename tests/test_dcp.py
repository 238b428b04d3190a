"""Data-centric parallel (train/dcp.py): a long-tailed batch of the corpus's documents, planned by
its lengths, gives the gradient one device gives (float32, within 1e-5 of the largest entry of
each weight's gradient; measured ~1e-7), with less work imbalance than static context parallelism.
"""
import jax
import numpy as np
from jax._src.dispatch import BACKEND_COMPILE_EVENT  # (jax.monitoring's name for an XLA compile)
import pytest
from flax import nnx

from jaxpar.errors import JaxparError
from jaxpar.models import llama
from jaxpar.train import data, dcp
from jaxpar.train.step import TrainConfig

TINY = llama.CONFIGS["tiny"]
CAPACITY = 32  # token positions a device holds per row
BUDGET = 1e9  # bytes of activations per device: no remat, one call per bucket


def model_fn(rngs):
    return llama.Llama(TINY, rngs=rngs)


@pytest.fixture(scope="module")
def sequences():
    """Long-tailed: 28 short documents, and 2 long ones that need 4 devices each."""
    docs = data.documents(data.corpus_tokens(50_000))
    short = [d for d in docs if len(d) <= CAPACITY + 1][:28]
    long = [d[:n] for d, n in zip((d for d in docs if len(d) > 4 * CAPACITY), (4 * CAPACITY + 1, 3 * CAPACITY + 7))]
    return short[:14] + long[:1] + short[14:] + long[1:]


def one_device_grads(params, sequences):
    """The mean loss over every real token, each document alone in its row, on one device."""
    n, real = max(len(s) for s in sequences) - 1, sum(len(s) - 1 for s in sequences)
    batch = {k: np.zeros((len(sequences), n), np.int32) for k in ("inputs", "targets", "positions", "segments")}
    batch["weights"] = np.zeros((len(sequences), n), np.float32)
    for r, s in enumerate(sequences):
        m = len(s) - 1
        batch["inputs"][r, :m], batch["targets"][r, :m], batch["positions"][r, :m] = s[:-1], s[1:], np.arange(m)
        batch["segments"][r, :m], batch["weights"][r, :m] = 1, len(sequences) * n / real
    with jax.default_device(jax.devices()[0]):
        graphdef, state = nnx.split(model_fn(nnx.Rngs(0)))

        def loss(p):
            nnx.replace_by_pure_dict(state, p)
            return llama.loss_fn(nnx.merge(graphdef, state), batch)

        return jax.value_and_grad(loss)(jax.device_get(params))


def test_dcp_gradient_equals_one_device(sequences):
    trainer = dcp.DataCentricTrainer(model_fn, llama.loss_fn, TINY, TrainConfig(), capacity=CAPACITY, memory_budget=BUDGET)
    buckets = trainer.plan(sequences)
    assert [(b.context, b.length) for b in buckets] == [(1, CAPACITY), (4, 4 * CAPACITY)]  # short packed, long over 4
    state = trainer.init(seed=0)
    loss, grads = trainer.gradients(state.params, sequences)
    ref_loss, ref_grads = one_device_grads(state.params, sequences)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for got, want in zip(jax.tree.leaves(jax.device_get(grads)), jax.tree.leaves(ref_grads)):
        assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))
    # a step reuses the programs: one compiled program per (context degree, call shape)
    compiled = trainer.compiles
    state, metrics = trainer.step(state, sequences)
    assert {key[:2] for key in trainer._programs} == {(1, "none"), (4, "none")}
    assert trainer.compiles == compiled == len(trainer._programs)
    assert np.isfinite(float(metrics["grad_norm"]))


def test_after_compiling_ahead_no_step_but_the_first_compiles(sequences):
    # room for one row per call: every call shape of batches of 10 of these documents (contexts
    # 1, 2, 4 and 8: a long document's work may be spread wider than its length needs) is compiled
    # before the first step; the first step still compiles the update, and after it nothing
    # compiles, whatever the batch's lengths
    budget = 1.5 * CAPACITY * dcp.bytes_per_token(TINY, "none")
    trainer = dcp.DataCentricTrainer(model_fn, llama.loss_fn, TINY, TrainConfig(), capacity=CAPACITY, memory_budget=budget)
    state = trainer.init(seed=0)
    # the first holds a long document and short ones (one row over all 8 devices), the second
    # only short ones (spread by their work over groups of 2): a shape the first step never ran
    first, second = sequences[5:15], sequences[15:25]
    assert trainer.compile_ahead(state.params, 10) == trainer.compiles == 4
    state, _ = trainer.step(state, first)
    compiles = []
    listener = lambda event, seconds, **_: compiles.append(event) if event == BACKEND_COMPILE_EVENT else None  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        state, metrics = trainer.step(state, second)
        jax.block_until_ready(metrics["loss"])
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == [] and trainer.compiles == 4
    assert [b.context for b in trainer.plan(first)] == [8] and [b.context for b in trainer.plan(second)] == [2]
    # each program waited for here (XLA:CPU): each step's time in each bucket, for the report
    assert sorted(trainer.bucket_seconds) == [2, 8] and all(len(t) == 1 and min(t) > 0 for t in trainer.bucket_seconds.values())


def test_dcp_balances_work_better_than_static_context_parallelism(sequences):
    lengths = [len(s) for s in sequences]
    ratios = dcp.imbalance(lengths, 8, CAPACITY, TINY, BUDGET, static_context=4)
    # measured: dcp 1.23, static context=4 1.37, packing 2.01 (max / mean useful FLOPs per device;
    # the two long documents, of 129 and 103 tokens, each over 4 devices, set the floor here)
    assert ratios["dcp"] < ratios["static context=4"] < ratios["packing"], ratios


def test_dcp_chooses_remat_and_accumulation_per_bucket():
    lengths = [20] * 40 + [120]
    # room for 2 rows of 32 positions without remat: the short bucket takes 2 rows per call
    budget = 2.5 * CAPACITY * dcp.bytes_per_token(TINY, "none")
    buckets = dcp.plan(lengths, 8, CAPACITY, TINY, budget)
    # each group's 5 short rows run as calls of 2, 2 and 1 rows (powers of two, none padded up)
    assert [(b.context, b.remat, b.call_rows) for b in buckets] == [(1, "none", (2, 2, 1)), (4, "none", (1,))]
    # every sequence once, no row over its positions; the second group of the context-4 bucket
    # runs 6 short documents joined (114 of 128 positions) rather than an empty row
    rows = [row for b in buckets for g in b.rows for row in g]
    assert sorted(i for row in rows for i in row) == list(range(41))
    assert all(sum(lengths[i] - 1 for i in row) <= b.length for b in buckets for g in b.rows for row in g)
    assert sorted(len(row) for g in buckets[1].rows for row in g) == [1, 6]
    assert sum(not row for row in rows) == 8 * 5 - (40 - 6)  # only the context-1 groups pad
    # not even one row fits without remat: recomputed
    tight = 0.5 * CAPACITY * dcp.bytes_per_token(TINY, "none")
    assert {b.remat for b in dcp.plan(lengths, 8, CAPACITY, TINY, tight)} == {"full"}
    with pytest.raises(JaxparError, match=r"a sequence of 300 tokens does not fit on 8 devices of 32 positions"):
        dcp.plan([300], 8, CAPACITY, TINY, budget)
