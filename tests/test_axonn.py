"""AxoNN's 4D tensor parallelism (parallel/axonn.py): ``embed`` over tp_x, heads/mlp/vocab over tp_y,
Z = fsdp, on the GSPMD path.

Every factorisation trains like one device: test_equivalence's oracle and comparison (3 steps, SGD
with momentum; losses, first-step gradients and final weights within |a - b| <= 1e-5 + 1e-4 |b| in
float32). Traffic is read from the compiled step (the program the equivalence run executed) and
compared with ``axonn.layer_traffic`` per layer and ``axonn.traffic`` per step, within 2%.
"""
import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jaxpar.analysis import hlo
from jaxpar.analysis.traffic import SCALAR_BYTES, traffic_context
from jaxpar.errors import LayoutError, SpecError
from jaxpar.models import llama
from jaxpar.parallel import axonn, build_layout, parse_strategy
from jaxpar.train.step import Trainer
from tests.test_equivalence import (BATCH, CFG, OPTIMIZER, SEQ, assert_same, batches, llama_model, oracle,  # noqa: F401
                                    regression_batches, sharded, tokens)  # (tokens: a fixture)

TINY = llama.CONFIGS["tiny"]
GRID_AXES = ("tp_x", "tp_y")
FACTORISATIONS = [
    "data=2,tp_x=2,tp_y=2",  # AxoNN x plain data parallelism (G_data = 2)
    "tp_x=2,tp_y=4",  # the whole machine one 2 x 4 grid (tp_y = the 4 key/value heads)
    "tp_x=2,tp_y=2,fsdp=2",  # Z = fsdp: weights stored split over it, gathered per layer, batch split over it
]


@pytest.fixture(scope="module")
def llama_oracle(tokens):  # noqa: F811
    return oracle(llama_model, llama.loss_fn, batches(tokens))


@pytest.fixture(scope="module")
def trained(tokens):  # noqa: F811
    """strategy -> (trainer, its training from the oracle's weights), each layout trained once."""
    done = {}

    def train(strategy):
        if strategy not in done:
            trainer = Trainer(build_layout(parse_strategy(strategy, 8)), llama_model, llama.loss_fn, CFG, optimizer=OPTIMIZER)
            done[strategy] = trainer, sharded(trainer, llama_model, llama.loss_fn, batches(tokens))
        return done[strategy]

    return train


def compiled_collectives(trainer, host_batch):
    """The collectives of the step ``trainer`` ran (the same program: jax's compilation cache)."""
    batch = trainer.put_batch(host_batch)
    text = trainer._step.lower(trainer.abstract_state(), batch).compile().as_text()
    return [c for c in hlo.collectives(text, trainer.layout.mesh) if c.operand_bytes > SCALAR_BYTES]


@pytest.mark.parametrize("strategy", FACTORISATIONS)
def test_axonn_layout_trains_like_one_device(strategy, trained, llama_oracle):
    trainer, ours = trained(strategy)
    assert trainer.plan.path == "gspmd" and "tp_x" in trainer.plan.path_reason
    assert_same(ours, llama_oracle)


@pytest.mark.parametrize("strategy", FACTORISATIONS)
def test_grid_traffic_per_layer_equals_the_formula(strategy, trained, tokens):  # noqa: F811
    # Per layer = the collectives inside the layer scan (forward and backward: they run once per
    # layer, executions == layers), their bytes per step divided by the layers. Over tp_x and tp_y
    # they are all all-reduces of activations (no weight is gathered over the grid: AxoNN's scheme).
    trainer, _ = trained(strategy)
    cols = compiled_collectives(trainer, batches(tokens)[0])
    on_grid = [c for c in cols if set(c.mesh_axes) & set(GRID_AXES)]
    in_layers = [c for c in on_grid if c.executions == TINY.layers]
    assert {(c.kind, c.mesh_axes) for c in in_layers} == {("all-reduce", ("tp_x",)), ("all-reduce", ("tp_y",))}
    ctx = traffic_context(trainer, (BATCH, SEQ), TINY)
    per_layer, per_step = axonn.layer_traffic(ctx), axonn.traffic(parse_strategy(strategy, 8), ctx)
    for axis in GRID_AXES:
        measured = sum(c.bytes_per_step for c in in_layers if c.mesh_axes == (axis,)) / TINY.layers
        assert measured == pytest.approx(per_layer[("all-reduce", axis)], rel=0.02), axis
        # the whole step's all-reduces too (the layers plus the embedding, head, final norm and loss)
        step = sum(c.bytes_per_step for c in on_grid if c.kind == "all-reduce" and c.mesh_axes == (axis,))
        assert step == pytest.approx(per_step[("all-reduce", axis)], rel=0.02), axis
    # what else touches the grid: under fsdp, the token ids and one scalar-sized permute (<= 1 KiB each)
    assert all(c.bytes_per_step <= 1024 for c in on_grid if c.kind != "all-reduce" or len(c.mesh_axes) > 1)


def test_formula_figures_for_the_tiny_llama():
    # data=2,tp_x=2,tp_y=2: T = 8 rows x 32 = 256 tokens per device, float32, X = Y = 2 (ring: 2B(n-1)/n = B)
    ctx = dataclasses.make_dataclass("Ctx", ["mesh", "model", "batch", "batch_shards", "held_length", "compute_bytes"])(
        {"tp_x": 2, "tp_y": 2}, TINY, BATCH, 2, SEQ, 4)
    t = 256
    over_x = t * 4 * (64 + 2 * 32 + 2 * 192) + t * 4 * (64 + 192) + 4 * t * 4  # QKV, up/gate; WO, down grads; norms
    over_y = t * 4 * 64 * (2 + 3 + 2)  # WO, down; Q, K, V, gate, up grads
    assert axonn.layer_traffic(ctx) == {("all-reduce", "tp_x"): over_x, ("all-reduce", "tp_y"): over_y}


# --- a model written as a Flax user would write it -------------------------------------------


class PlainMLP(nnx.Module):
    """Two nnx.Linear layers with logical names and an optax loss: no jaxpar import."""

    def __init__(self, rngs):
        kernel = lambda names: nnx.with_partitioning(nnx.initializers.lecun_normal(), names)  # noqa: E731
        bias = lambda names: nnx.with_partitioning(nnx.initializers.zeros_init(), names)  # noqa: E731
        self.up = nnx.Linear(16, 64, kernel_init=kernel(("embed", "mlp")), bias_init=bias(("mlp",)), rngs=rngs)
        self.down = nnx.Linear(64, 16, kernel_init=kernel(("mlp", "embed")), bias_init=bias(("embed",)), rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


def plain_loss(model, batch):
    return optax.l2_loss(model(batch[:, :16]), batch[:, 16:]).mean()


def test_plain_flax_model_under_axonn_trains_like_one_device():
    trainer = Trainer(build_layout(parse_strategy("data=2,tp_x=2,tp_y=2", 8)), PlainMLP, plain_loss, CFG, optimizer=OPTIMIZER)
    assert_same(sharded(trainer, PlainMLP, plain_loss, regression_batches()), oracle(PlainMLP, plain_loss, regression_batches()))
    assert trainer.plan.path == "gspmd"
    # the up kernel is stored (embed over tp_x, mlp over tp_y), as computed
    assert trainer.param_specs["up"]["kernel"] == jax.sharding.PartitionSpec("tp_x", "tp_y")
    # AxoNN's all-reduces, 8 rows a device: up's output (mlp/Y = 32 wide) over X, down's (embed/X = 8)
    # over Y, the hidden activation's gradient over X; no weight is gathered. (XLA lays the input
    # batch's columns out like embed, so slicing features from targets moves 8 x 8 floats over X.)
    cols = [c for c in compiled_collectives(trainer, regression_batches()[0]) if set(c.mesh_axes) & set(GRID_AXES)]
    assert sorted((c.mesh_axes, c.operand_bytes) for c in cols if c.kind == "all-reduce") == [
        (("tp_x",), 8 * 32 * 4), (("tp_x",), 8 * 32 * 4), (("tp_y",), 8 * 8 * 4)]
    assert all(c.kind == "collective-permute" and c.operand_bytes == 8 * 8 * 4 for c in cols if c.kind != "all-reduce")


# --- what the grid refuses, and what it allows -------------------------------------------------


@pytest.mark.parametrize("strategy, words", [
    ("tp_x=2,tp_y=2,tensor=2", r"tensor=2.*pick one tensor parallelism"),
    ("tp_x=2,tp_y=2,fsdp=2,sp=on", r"sp=on is sequence parallelism.*drop sp="),
    ("tp_x=2,tp_y=4,delay=1", r"delay=1 is delayed tensor parallelism.*drop delay="),
    ("tp_x=2,tp_y=2,fsdp=2,tp_overlap=on", r"tp_overlap=on is collective matmul.*drop tp_overlap="),
    ("stage=2,tp_x=2,tp_y=2", r"stage=2.*tp_x=2.*GSPMD.*drop stage="),
])
def test_bad_grids_are_refused_in_words(strategy, words):
    with pytest.raises(SpecError, match=words):
        parse_strategy(strategy, 8)


def test_manual_path_is_refused_for_a_split_model_width():
    cfg = dataclasses.replace(CFG, path="manual")
    with pytest.raises(LayoutError, match=r"path='manual'.*embed.*tp_x.*GSPMD.*path='auto'"):  # in the plan, before any trace
        Trainer(build_layout(parse_strategy("data=2,tp_x=2,tp_y=2", 8)), PlainMLP, plain_loss, cfg)


def test_a_split_model_width_alone_takes_the_gspmd_path():
    # tp_x without tp_y splits only embed; the Llama calls jaxpar, yet XLA's partitioner must run it
    trainer = Trainer(build_layout(parse_strategy("tp_x=2,fsdp=4", 8)), llama_model, llama.loss_fn, CFG)
    batch = jax.ShapeDtypeStruct((16, SEQ + 1), np.int32)
    assert trainer.choose_path(trainer.abstract_state().params, batch) == "gspmd"
    assert "tp_x" in trainer.plan.path_reason
