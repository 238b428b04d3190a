"""MPMD pipeline: stages on their own devices with their own layouts, joined by cross-mesh resharding.

Oracle: the same model on one device without a pipeline (fp32), as in test_pipeline.py. Traffic
between stages is checked against the reshard plans' byte counts, which test_reshard.py checks
against the compiled HLO.
"""
import dataclasses

import jax
import numpy as np
import optax
import pytest

from jaxpar.errors import LayoutError
from jaxpar.models import llama
from jaxpar.parallel import build_layout, parse_strategy
from jaxpar.parallel.stage import mpmd
from jaxpar.parallel.stage import pipeline as pl
from jaxpar.parallel.stage import schedules as sc
from jaxpar.rules import use_layout
from tests.test_pipeline import (BATCH, WIDTH, adamw_step, assert_close, llama_oracle, mlp_batch, mlp_first,  # noqa: F401 (tiny_llama: a fixture)
                                 mlp_last, mlp_oracle, mlp_params, mlp_stage, tiny_llama)

MLP_NAMES = ({"w": ("layers", None, None), "b": ("layers", None)}, {"w_in": (None, None), "w_out": (None, None)})
ADAMW = optax.adamw(1e-2, eps=1e-4, weight_decay=0.1)  # as adamw_step in test_pipeline.py


def _pipeline(model, specs, name, m, chunks=1, **kwargs):
    return mpmd.MPMDPipeline(model, mpmd.stage_layouts(specs), sc.make(name, len(specs), m, chunks), **kwargs)


@pytest.mark.parametrize("name, specs, m, chunks", [
    pytest.param("gpipe", ["data=2", "data=4"], 4, 1, marks=pytest.mark.slow),
    pytest.param("1f1b", ["data=2"] * 4, 8, 1, marks=pytest.mark.slow),
    ("eager-1f1b", ["data=4", "data=2", "data=1", "data=1"], 8, 1),
    ("interleaved-1f1b", ["data=2", "data=2"], 4, 2),
])
def test_mlp_schedules_match_one_device(name, specs, m, chunks):
    """Every synchronous schedule on stages of different data-parallel degrees."""
    stacked, edge = mlp_params()
    batch = np.asarray(mlp_batch(m)[0]), np.asarray(mlp_batch(m)[1])
    devices = sum(mpmd._devices_of(s) for s in specs)
    layouts = mpmd.stage_layouts(specs, jax.devices()[:devices])
    pipe = mpmd.MPMDPipeline(pl.PipelineModel(mlp_first, mlp_stage, mlp_last), layouts, sc.make(name, len(specs), m, chunks),
                             names=MLP_NAMES, activation_names=("batch", None))
    loss, grads = pipe.value_and_grad(pipe.place(stacked, edge), batch)
    expected_loss, expected_grads = mlp_oracle(stacked, edge, batch)
    assert_close(loss, expected_loss, "loss")
    assert_close(pipe.to_layer_order(grads), expected_grads, "grads")
    # every activation and its gradient crossed once per micro-batch and boundary
    boundaries = len(specs) * chunks - 1
    assert pipe.traffic.transfers == 2 * m * boundaries
    assert pipe.traffic.forward_bytes == pipe.traffic.backward_bytes == m * boundaries * BATCH * WIDTH * 4


@pytest.fixture(scope="module")
def tiny_llama_pieces(tiny_llama):
    # the Llama's loss cut at its layer scan, as Trainer does (the middle stages hold no edge weights)
    cfg, graphdef, abstract, params = tiny_llama
    return cfg, graphdef, params, pl.split_at_layer_scan(llama.loss_fn, graphdef, abstract)


LLAMA_CASES = [
    # TP, DP and FSDP stages side by side; (the other schedules: the MLP cases above; interleaved
    # chunks: those and the SPMD pipeline's Llama tests; 1F1B over tensor=4 | data=2,tensor=2:
    # examples/mpmd_pipeline.py, run by test_examples)
    pytest.param("eager-1f1b", ["tensor=2", "data=2", "fsdp=2", "tensor=2"], 4, 1, id="eager-4-stages"),
]


@pytest.mark.parametrize("name, specs, m, chunks", LLAMA_CASES)
def test_llama_matches_one_device(tiny_llama_pieces, name, specs, m, chunks):
    """Tiny Llama with a layout per stage: loss, gradients and one AdamW step equal one device's;
    the edge weights' two copies (embedding on the first stage, head on the last) stay equal."""
    cfg, graphdef, params, split = tiny_llama_pieces
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (m, 4, 17), 0, cfg.vocab_size))
    pipe = _pipeline(split.pieces, specs, name, m, chunks, names=split.names, activation_names=llama.RESIDUAL)
    weights = pipe.place(*split.split(params))
    loss, grads = pipe.value_and_grad(weights, tokens)
    expected_loss, expected_grads = llama_oracle(graphdef, params, tokens)
    assert_close(loss, expected_loss, "loss")
    assert_close(split.merge(*pipe.to_layer_order(grads)), expected_grads, "grads")
    activation = 4 * 16 * cfg.embed * 4  # one micro-batch's residual stream, float32, crosses once
    assert pipe.traffic.forward_bytes == m * (len(specs) * chunks - 1) * activation

    updated, _ = pipe.apply_gradients(ADAMW, weights, grads, pipe.init_optimizer(ADAMW, weights))
    assert_close(split.merge(*pipe.to_layer_order(updated)), adamw_step(params, expected_grads), "AdamW step")
    first, last = (jax.tree.map(np.asarray, updated.edge[s]) for s in pipe.edge_holders)
    assert all(np.array_equal(first[key], last[key]) for key in first), "the edge weight copies drifted apart"


def test_llama_with_subspace_boundaries_matches_one_device(tiny_llama_pieces):
    """subspace=16 over tensor=4 | data=2,tensor=2: the stages send 16 of the Llama's 128 values a position,
    every stage rebuilds the stream from its own copy of the edge weights, and loss and gradients
    equal the same model on one device (its writes projected alike: ``Layout.settings``)."""
    cfg, graphdef, params, split = tiny_llama_pieces
    m, k = 2, 16
    tokens = np.asarray(jax.random.randint(jax.random.key(2), (m, 4, 17), 0, cfg.vocab_size))
    pipe = _pipeline(split.pieces, ["tensor=4", "data=2,tensor=2"], "1f1b", m, names=split.names,
                     activation_names=llama.RESIDUAL, subspace=k)
    weights = pipe.place(*split.split(params))
    loss, grads = pipe.value_and_grad(weights, tokens)
    one = build_layout(parse_strategy("data=1", 1), jax.devices()[:1])
    with use_layout(dataclasses.replace(one, settings={"subspace": k})):
        expected_loss, expected_grads = llama_oracle(graphdef, params, tokens)
    assert_close(loss, expected_loss, "loss")
    assert_close(split.merge(*pipe.to_layer_order(grads)), expected_grads, "grads")
    assert abs(float(loss) - float(llama_oracle(graphdef, params, tokens)[0])) > 1e-4  # (not the dense model)
    assert pipe.traffic.forward_bytes == m * 4 * 16 * k * 4  # one micro-batch's coordinates, float32, once
    assert pipe.edge_holders == [0, 1]
    first, second = (jax.tree.map(np.asarray, grads.edge[s]) for s in pipe.edge_holders)
    assert all(np.array_equal(first[key], second[key]) for key in first)


@pytest.mark.parametrize("broadcast", [True, False])
def test_broadcast_sends_each_activation_once_per_stage(broadcast):
    """tensor=4 -> data=2,tensor=2 (the MLP computes the same on every tensor rank): the receiving
    stage keeps 2 copies of each batch half and the sending stage 4 of the whole gradient.
    Broadcast delivery sends every element across once; naive per-receiver sends 2x (forward) and
    4x (backward) as much. The result is the same either way."""
    m = 4
    stacked, edge = mlp_params()
    batch = np.asarray(mlp_batch(m)[0]), np.asarray(mlp_batch(m)[1])
    pipe = _pipeline(pl.PipelineModel(mlp_first, mlp_stage, mlp_last), ["tensor=4", "data=2,tensor=2"], "1f1b", m,
                     names=MLP_NAMES, activation_names=("batch", None), broadcast=broadcast)
    loss, grads = pipe.value_and_grad(pipe.place(stacked, edge), batch)
    expected_loss, expected_grads = mlp_oracle(stacked, edge, batch)
    assert_close(loss, expected_loss, "loss")
    assert_close(pipe.to_layer_order(grads), expected_grads, "grads")
    activation = BATCH * WIDTH * 4
    assert pipe.traffic.naive_bytes == m * activation * (2 + 4)
    if broadcast:
        assert pipe.traffic.forward_bytes == pipe.traffic.backward_bytes == m * activation
    else:
        assert (pipe.traffic.forward_bytes, pipe.traffic.backward_bytes) == (2 * m * activation, 4 * m * activation)


def test_bad_stage_layouts_are_refused_in_words():
    model = pl.PipelineModel(mlp_first, mlp_stage, mlp_last)
    devices = jax.devices()
    overlapping = [build_layout(parse_strategy("data=4", 4), devices[:4]), build_layout(parse_strategy("data=4", 4), devices[2:6])]
    with pytest.raises(LayoutError, match=r"stages 0 and 1 share devices \[2, 3\]: an MPMD pipeline runs its stages "
                                          r"at the same time.*split the devices"):
        mpmd.MPMDPipeline(model, overlapping, sc.one_f_one_b(2, 4), names=MLP_NAMES, activation_names=("batch", None))
    with pytest.raises(LayoutError, match=r"need 4 \+ 2 = 6 devices, but 8 were given"):
        mpmd.stage_layouts(["tensor=4", "data=2"])
    with pytest.raises(LayoutError, match=r"'data=-1': give every axis a positive degree"):
        mpmd.stage_layouts(["tensor=4", "data=-1"])
    with pytest.raises(LayoutError, match="stage 0's layout has stage=2"):
        mpmd.check_disjoint([build_layout(parse_strategy("stage=2,data=2", 4), devices[:4])])
    layouts = mpmd.stage_layouts(["data=4", "data=4"])
    with pytest.raises(sc.ScheduleError, match="is for 4 stages but 2 stage layouts were given"):
        mpmd.MPMDPipeline(model, layouts, sc.one_f_one_b(4, 4), names=MLP_NAMES, activation_names=("batch", None))
    with pytest.raises(sc.ScheduleError, match="run it with pipeline.pipedream_train"):
        mpmd.MPMDPipeline(model, layouts, sc.pipedream(2, 4), names=MLP_NAMES, activation_names=("batch", None))
    pipe = mpmd.MPMDPipeline(model, layouts, sc.gpipe(2, 4), names=MLP_NAMES, activation_names=("batch", None))
    stacked, edge = mlp_params()
    with pytest.raises(sc.ScheduleError, match=r"8 layers cannot be split over 3 stages"):
        mpmd.MPMDPipeline(model, mpmd.stage_layouts(["data=2", "data=2", "data=4"]), sc.gpipe(3, 3), names=MLP_NAMES,
                          activation_names=("batch", None)).place(stacked, edge)
    with pytest.raises(sc.ScheduleError, match=r"split into the schedule's 4 micro-batches"):
        pipe.value_and_grad(pipe.place(stacked, edge), mlp_batch(8))
