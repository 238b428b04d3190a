"""MPMD pipeline: stages on their own devices with their own layouts, joined by cross-mesh resharding.

Oracle: the same model on one device without a pipeline (fp32), as in test_pipeline.py. Traffic
between stages is checked against the reshard plans' byte counts, which test_reshard.py checks
against the compiled HLO.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxpar.errors import LayoutError
from jaxpar.models import llama
from jaxpar.nn import residual_add
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


# --- a pipeline of different modules: a vision encoder and a language model --------------------
# written as a plain Flax user writes them; the LM's one jaxpar call marks its two writes to the
# residual stream (their sums over tensor: the MLP's hidden units and the heads are split there)

PATCHES, PATCH_DIM, ENC, DEC, HEADS, VOCAB, TEXT = 4, 12, 24, 32, 4, 40, 8
STREAM = ("batch", None, "embed")  # (positions not split: the image's and the text's together)
_init = nnx.initializers.normal(0.1)
_part = nnx.with_partitioning


class VisionEncoder(nnx.Module):
    def __init__(self, rngs):
        self.patch = nnx.Linear(PATCH_DIM, ENC, kernel_init=_part(_init, (None, "embed")), rngs=rngs)
        self.up = nnx.Linear(ENC, 2 * ENC, kernel_init=_part(_init, ("embed", "mlp")), rngs=rngs)
        self.down = nnx.Linear(2 * ENC, ENC, kernel_init=_part(_init, ("mlp", "embed")), rngs=rngs)
        self.norm = nnx.LayerNorm(ENC, scale_init=_part(nnx.initializers.ones, ("embed",)),
                                  bias_init=_part(nnx.initializers.zeros, ("embed",)), rngs=rngs)

    def __call__(self, patches):
        x = self.patch(patches)
        return self.norm(x + self.down(jax.nn.gelu(self.up(x))))


class CaptionLM(nnx.Module):
    def __init__(self, rngs):
        self.bridge = nnx.Linear(ENC, DEC, kernel_init=_part(_init, (None, "embed")), rngs=rngs)
        # (whole on every device: nnx.Embed's own lookup reads the table whole; jaxpar.nn.embed_lookup
        # reads one split by vocab)
        self.embed = nnx.Embed(VOCAB, DEC, embedding_init=_part(_init, (None, "embed")), rngs=rngs)
        self.q, self.k, self.v = (nnx.Linear(DEC, DEC, kernel_init=_part(_init, ("embed", "heads")), use_bias=False, rngs=rngs)
                                  for _ in range(3))
        self.out = nnx.Linear(DEC, DEC, kernel_init=_part(_init, ("heads", "embed")), use_bias=False, rngs=rngs)
        self.up = nnx.Linear(DEC, 2 * DEC, kernel_init=_part(_init, ("embed", "mlp")),
                             bias_init=_part(nnx.initializers.zeros, ("mlp",)), rngs=rngs)
        self.down = nnx.Linear(2 * DEC, DEC, kernel_init=_part(_init, ("mlp", "embed")), use_bias=False, rngs=rngs)
        self.norm = nnx.RMSNorm(DEC, scale_init=_part(nnx.initializers.ones, ("embed",)), rngs=rngs)
        self.head = nnx.Linear(DEC, VOCAB, kernel_init=_part(_init, ("embed", None)), rngs=rngs)

    def __call__(self, image, tokens):
        x = jnp.concatenate([self.bridge(image), self.embed(tokens)], axis=1)
        rows, length, _ = x.shape
        # heads split over tensor: each device holds some of them (the columns of q, k and v alike)
        q, k, v = (f(x).reshape(rows, length, -1, DEC // HEADS) for f in (self.q, self.k, self.v))
        mixed = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(rows, length, -1)
        x = residual_add(x, self.out(mixed), ("heads",), STREAM)[0]
        x = residual_add(x, self.down(jax.nn.gelu(self.up(x))), ("mlp",), STREAM)[0]
        return self.head(self.norm(x))[:, PATCHES:]


def encode(encoder, x, batch):
    return encoder(batch["patches"])


def caption_loss(lm, image, batch):
    logits = lm(image, batch["text"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["text"][:, 1:]).mean()


def caption_batch(m, rows=4, seed=3):
    keys = jax.random.split(jax.random.key(seed))
    return {"patches": np.asarray(jax.random.normal(keys[0], (m, rows, PATCHES, PATCH_DIM))),
            "text": np.asarray(jax.random.randint(keys[1], (m, rows, TEXT + 1), 0, VOCAB))}


def test_a_pipeline_of_two_modules_with_their_own_layouts_equals_one_device():
    """A vision encoder under data=4 (devices 0-3) and a captioning LM under data=2,tensor=2 (4-7),
    1F1B over 4 micro-batches: loss, gradients, an AdamW step and the next gradients equal the
    composed model on one device; the encoder's output crosses once a micro-batch each way, resharded between layouts."""
    m = 4
    with nnx.use_eager_sharding(False):  # (the names are for jaxpar's layouts)
        encoder, lm = VisionEncoder(nnx.Rngs(0)), CaptionLM(nnx.Rngs(1))
    stages = [mpmd.ModuleStage(encoder, encode, sends=STREAM), mpmd.ModuleStage(lm, caption_loss)]
    pipe = mpmd.ModulePipeline(stages, mpmd.stage_layouts(["data=4", "data=2,tensor=2"]), sc.one_f_one_b(2, m))
    params = [nnx.to_pure_dict(nnx.state(encoder)), nnx.to_pure_dict(nnx.state(lm))]

    def with_weights(module, weights):
        graphdef, state = nnx.split(module)
        state = jax.tree.map(lambda v: v, state)  # (a copy to fill)
        nnx.replace_by_pure_dict(state, weights)
        return nnx.merge(graphdef, state)

    def one_device(params, batch):
        def loss(p, mb):
            return caption_loss(with_weights(lm, p[1]), encode(with_weights(encoder, p[0]), (), mb), mb)
        return jax.value_and_grad(lambda p: jnp.mean(jnp.stack([loss(p, jax.tree.map(lambda x: x[i], batch))
                                                               for i in range(m)])))(params)

    weights = pipe.place(params)
    loss, grads = pipe.value_and_grad(weights, caption_batch(m))
    expected_loss, expected_grads = one_device(params, caption_batch(m))
    assert_close(loss, expected_loss, "loss")
    assert_close(pipe.stage_weights(grads), expected_grads, "grads")
    weights, _ = pipe.apply_gradients(ADAMW, weights, grads, pipe.init_optimizer(ADAMW, weights))
    params = adamw_step(params, expected_grads)
    # (AdamW's first step is lr g / (|g| + eps): the rounding of a gradient entry near eps shows)
    assert_close(pipe.stage_weights(weights), params, "AdamW step", of_largest=1e-4)
    # the second step's, at the updated weights
    loss, grads = pipe.value_and_grad(weights, caption_batch(m, seed=4))
    expected_loss, expected_grads = one_device(params, caption_batch(m, seed=4))
    assert_close(loss, expected_loss, "second loss")
    assert_close(pipe.stage_weights(grads), expected_grads, "second grads")
    assert pipe.traffic.forward_bytes == pipe.traffic.backward_bytes == m * 4 * PATCHES * ENC * 4
    with pytest.raises(sc.ScheduleError, match=r"one module a stage; use gpipe"):
        mpmd.ModulePipeline(stages, mpmd.stage_layouts(["data=4", "data=2,tensor=2"]), sc.make("interleaved-1f1b", 2, 4, 2))
    # a plain nnx.Embed over a table split by vocab reads its own rows only: refused in words
    with nnx.use_eager_sharding(False):
        split_table = CaptionLM(nnx.Rngs(1))
        split_table.embed = nnx.Embed(VOCAB, DEC, embedding_init=_part(_init, ("vocab", "embed")), rngs=nnx.Rngs(2))
    wrong = mpmd.ModulePipeline([stages[0], mpmd.ModuleStage(split_table, caption_loss)],
                                mpmd.stage_layouts(["data=4", "data=2,tensor=2"]), sc.one_f_one_b(2, m))
    with pytest.raises(LayoutError, match=r"stage 1's loss differs across mesh axis tensor .* jaxpar.nn.embed_lookup"):
        wrong.value_and_grad(wrong.place([params[0], nnx.to_pure_dict(nnx.state(split_table))]), caption_batch(m))
    with pytest.raises(LayoutError, match=r"stage 0 sends its output to stage 1 but names no layout"):
        mpmd.ModulePipeline([mpmd.ModuleStage(encoder, encode), stages[1]], mpmd.stage_layouts(["data=4", "data=4"]),
                            sc.one_f_one_b(2, m))
