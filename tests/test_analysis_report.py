"""Communication and memory of each strategy, measured on the compiled step, against the analytic
optimum and the ZeRO table (both within 2%); no collective kind the strategy does not call for."""
import functools
import re

import numpy as np
import pytest

from jaxpar.analysis import hlo, memory, traffic
from jaxpar.models import llama
from jaxpar.parallel import build_layout, parse_strategy
from jaxpar.train.step import TrainConfig, Trainer

TINY = llama.CONFIGS["tiny"]
BATCH, SEQ = 16, 32


@functools.cache  # the traffic and the memory tests read the same compiled step
def compiled(strategy_text, cfg=TrainConfig(), model_cfg=TINY):
    strategy = parse_strategy(strategy_text, 8)
    trainer = Trainer(build_layout(strategy), lambda r: llama.Llama(model_cfg, rngs=r), llama.loss_fn, cfg)
    batch = trainer.abstract_batch(BATCH, SEQ)
    step = trainer.jit_step(batch).lower(trainer.abstract_state(), batch).compile()
    return strategy, trainer, step


COMMUNICATION = {
    # strategy: the collective kinds it must use (anything else is a failure)
    "data=8": {"all-reduce"},
    # ZeRO-3: the embedding table is never gathered, its looked-up rows travel (all-to-all)
    "fsdp=8": {"all-gather", "reduce-scatter", "all-to-all"},
    "fsdp=8,regather=on": {"all-gather", "reduce-scatter", "all-to-all"},
    "fsdp=8,zero=1": {"all-gather", "reduce-scatter"},
    "fsdp=8,zero=2": {"all-gather", "reduce-scatter"},
    "data=2,fsdp=4": {"all-gather", "reduce-scatter", "all-reduce", "all-to-all"},
    "data=2,tensor=4": {"all-reduce"},
    "data=2,tensor=4,sp=on": {"all-gather", "reduce-scatter", "all-reduce"},
    "data=2,fsdp=2,tensor=2": {"all-gather", "reduce-scatter", "all-reduce", "all-to-all"},
    "tensor=8": {"all-reduce"},  # 4 key/value heads kept whole: their gradients all-reduced too
}


QUICK = ("data=8", "fsdp=8", "data=2,fsdp=4", "data=2,tensor=4,sp=on", "data=2,fsdp=2,tensor=2")


@pytest.mark.parametrize("strategy_text", [s if s in QUICK else pytest.param(s, marks=pytest.mark.slow) for s in COMMUNICATION])
def test_collective_bytes_match_the_analytic_optimum(strategy_text):
    strategy, trainer, step = compiled(strategy_text)
    report = traffic.compare(step.as_text(), trainer, strategy, (BATCH, SEQ), TINY)
    kinds = {k for k, row in report.items() if k not in ("by_axes", "scalar all-reduce") and row["measured_bytes"] > 0}
    assert kinds == COMMUNICATION[strategy_text], report
    for kind in kinds:
        assert report[kind]["ratio"] == pytest.approx(1.0, abs=0.02), (kind, report[kind])
    # the only other traffic: a few scalars (loss, gradient norm)
    assert report["scalar all-reduce"]["measured_bytes"] < 64


def fsdp_table_traffic(n, batch_shards=8):
    """Bytes per device over fsdp=n for the embedding table (float32 on CPU): the group's token ids
    gathered (int32), the looked-up rows and their gradients in one all-to-all each way."""
    tokens = BATCH // batch_shards * SEQ
    return {"all-gather": tokens * n * 4 * (n - 1) / n, "all-to-all": 2 * tokens * TINY.embed * 4 * (n - 1) / n}


@pytest.mark.slow
def test_fsdp_traffic_is_2_or_3_parameter_passes():
    # independent of the model's structure: Psi_b = weights x 4 bytes but the embedding table's
    # (its rows travel instead), N = 8
    table = fsdp_table_traffic(8)
    psi_bytes = (TINY.num_params() - TINY.vocab_size * TINY.embed) * 4
    _, trainer, keep = compiled("fsdp=8")
    sent = traffic.hlo.summarize(traffic.hlo.collectives(keep.as_text(), trainer.layout.mesh))
    two = sent["all-gather"]["bytes_per_device"] + sent["reduce-scatter"]["bytes_per_device"]
    assert two == pytest.approx(2 * psi_bytes * 7 / 8 + table["all-gather"], rel=0.02)
    assert sent["all-to-all"]["bytes_per_device"] == pytest.approx(table["all-to-all"], rel=0.02)
    _, trainer, again = compiled("fsdp=8,regather=on")
    sent = traffic.hlo.summarize(traffic.hlo.collectives(again.as_text(), trainer.layout.mesh))
    layers_bytes = (TINY.num_params() - 2 * TINY.vocab_size * TINY.embed - TINY.embed) * 4  # gathered twice
    three = sent["all-gather"]["bytes_per_device"] + sent["reduce-scatter"]["bytes_per_device"]
    assert three == pytest.approx((2 * psi_bytes + layers_bytes) * 7 / 8 + table["all-gather"], rel=0.02)


def test_bf16_compute_gathers_in_bf16_and_reduces_in_fp32():
    cfg = TrainConfig(compute_dtype="bfloat16", grad_reduce_dtype="float32")
    strategy = parse_strategy("fsdp=8", 8)
    trainer = Trainer(build_layout(strategy), lambda r: llama.Llama(TINY, rngs=r), llama.loss_fn, cfg)
    batch = trainer.abstract_batch(BATCH, SEQ)
    lowered = trainer.jit_step(batch).lower(trainer.abstract_state(), batch)
    # the program jaxpar emits: weights gathered in bf16, gradients reduced in f32 (the token ids
    # the embedding looks up are gathered as int32, and its rows travel in bf16)
    text = lowered.as_text()
    gathers = set(re.findall(r'"stablehlo.all_gather".*-> tensor<[0-9x]*x(\w+)>', text))
    scatters = set(re.findall(r'"stablehlo.reduce_scatter".*\n(?:.*\n)*?.*-> tensor<[0-9x]*x(\w+)>', text))
    rows = set(re.findall(r'"stablehlo.all_to_all".*-> tensor<[0-9x]*x(\w+)>', text))
    assert gathers == {"bf16", "i32"} and scatters == {"f32"} and rows == {"bf16"}
    # XLA's CPU backend widens bf16 collectives to f32; the optimum for a CPU compile says so
    step = lowered.compile()
    report = traffic.compare(step.as_text(), trainer, strategy, (BATCH, SEQ), TINY)
    assert report["all-gather"]["ratio"] == pytest.approx(1.0, abs=0.02)


@pytest.mark.parametrize("strategy_text", [pytest.param("data=8", marks=pytest.mark.slow),
                                           pytest.param("fsdp=8,zero=1", marks=pytest.mark.slow),
                                           pytest.param("fsdp=8,zero=2", marks=pytest.mark.slow), "fsdp=8",
                                           "data=2,fsdp=4"])  # fsdp=4,tensor=2: the main job's report (test_main_job)
def test_memory_follows_the_zero_table(strategy_text):
    # two micro-batches, so the step really carries a gradient accumulation buffer
    strategy, trainer, step = compiled(strategy_text, TrainConfig(microbatches=2))
    measured = memory.measured_memory(trainer, step)
    table = memory.zero_table(trainer)
    for kind in ("parameters", "gradient_accumulation", "optimizer"):
        assert measured[kind] == pytest.approx(table[kind], rel=0.02), (kind, measured[kind], table[kind])


def test_zero_table_bytes_per_parameter():
    # Psi = all weights; fsdp = 8: the stages divide parameters (3), gradients (2), optimizer (1) by 8
    psi = TINY.num_params()
    strategy, trainer, _ = compiled("fsdp=8,zero=2")
    table = memory.zero_table(trainer)
    assert table == pytest.approx({"parameters": 4 * psi, "gradient_accumulation": 4 * psi / 8, "optimizer": 8 * psi / 8})


def test_pipeline_memory_and_stage_traffic():
    """stage=2: each stage stores half the layers (the ZeRO table divides them by stage); over
    stage, the one boundary carries each micro-batch's activation forward and its gradient back
    (per device the mean over the two stages), and the executor sends just that: only on the ticks
    and from the stages that carry one; the edge weights' gradients are summed over stage once."""
    m = 4
    strategy, trainer, step = compiled("stage=2,fsdp=2,tensor=2", TrainConfig(microbatches=m, schedule="1f1b"))
    measured = memory.measured_memory(trainer, step)
    table = memory.zero_table(trainer)
    for kind in ("parameters", "gradient_accumulation", "optimizer"):
        assert measured[kind] == pytest.approx(table[kind], rel=0.02), (kind, measured[kind], table[kind])
    report = traffic.compare(step.as_text(), trainer, strategy, (BATCH, SEQ), TINY)
    activation = BATCH // (m * 2) * SEQ * TINY.embed * 4  # a micro-batch's rows on one device, float32
    assert report["collective-permute"]["optimal_bytes"] == 2 * m * activation / 2
    assert report["by_axes"]["collective-permute over stage"]["bytes_per_device"] == pytest.approx(2 * m * activation / 2, rel=1e-9)
    # embedding and head split over tensor, all three edge weights stored split over fsdp (ZeRO-3)
    edge = (2 * TINY.vocab_size * TINY.embed / 2 + TINY.embed) / 2
    assert report["by_axes"]["all-reduce over stage"]["bytes_per_device"] == pytest.approx(edge * 4, rel=0.02)
    assert "upper bound" in report["note"]


def test_hierarchical_zero_gathers_inside_groups_and_splits_the_rest_over_all():
    """fsdp=8,param_shards=4: weights stored over groups of 4 neighbouring devices (fsdp=4),
    gradients and Adam moments over all 8 (fsdp_group=2 x fsdp=4). Formula (Psi weights, k
    micro-batches, float32): over fsdp, k gathers and k reduce-scatters of Psi*(3/4)*4 bytes;
    over fsdp_group, k reduce-scatters of the group's shard (Psi/4)*(1/2)*4 bytes and one gather
    of the updated weights, (Psi/4)*(1/2)*4 bytes; memory 4*Psi/4, 4*Psi/8 and 8*Psi/8 bytes.
    (k = 1: with k > 1 XLA hoists some loop-invariant gathers out of the micro-batch loop, as it
    does for plain FSDP.)"""
    k, psi = 1, TINY.num_params()
    strategy, trainer, step = compiled("fsdp=8,param_shards=4", TrainConfig(microbatches=k))
    measured = memory.measured_memory(trainer, step)
    expected = {"parameters": 4 * psi / 4, "gradient_accumulation": 4 * psi / 8, "optimizer": 8 * psi / 8}
    assert memory.zero_table(trainer) == pytest.approx(expected)
    for kind, value in expected.items():
        assert measured[kind] == pytest.approx(value, rel=0.02), kind
    cols = [c for c in hlo.collectives(step.as_text(), trainer.layout.mesh) if c.operand_bytes > traffic.SCALAR_BYTES]
    by_axes = {key: row["bytes_per_device"] for key, row in hlo.by_axes(cols).items()}
    shard = psi / 4 * (1 / 2) * 4
    gathered, table = psi - TINY.vocab_size * TINY.embed, fsdp_table_traffic(4)  # the table's rows travel instead
    formula = {("all-gather", ("fsdp",)): k * gathered * 3 / 4 * 4 + table["all-gather"],
               ("reduce-scatter", ("fsdp",)): k * gathered * 3 / 4 * 4, ("all-to-all", ("fsdp",)): table["all-to-all"],
               ("reduce-scatter", ("fsdp_group",)): k * shard, ("all-gather", ("fsdp_group",)): shard}
    assert set(by_axes) == set(formula), by_axes
    for key, value in formula.items():
        assert by_axes[key] == pytest.approx(value, rel=0.02), key
    optimum = traffic.optimal_traffic_by_axis(trainer, strategy, (BATCH, SEQ), TINY)
    assert optimum == pytest.approx({(kind, axes[0]): v for (kind, axes), v in formula.items()})
    # the weight gathers run inside groups of 4 neighbouring devices: replica groups {0..3}, {4..7}
    gathers = [c for c in cols if c.kind == "all-gather" and c.mesh_axes == ("fsdp",)]
    assert gathers and all(c.group_size == 4 for c in gathers)
    mesh = trainer.layout.mesh
    groups = np.vectorize(lambda d: d.id)(mesh.devices).reshape(mesh.shape["fsdp_group"], mesh.shape["fsdp"])
    assert groups.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
