"""Training over slow links. Subspace pipeline boundaries (``subspace=k``): the boundary's code is
exact, the pipelined model equals the same model on one device, ``subspace=d`` is the dense model,
the stages send k values a position each way on the compiled HLO, and bad input is refused in
words. Stage links slowed for real (``--stage-link-latency-ms``): each sending tick waits, and
nothing else changes.

The model is written here as a plain Flax user writes one (nnx.Embed, nnx.Linear, nnx.RMSNorm,
nnx.vmap / nnx.scan over stacked blocks, an optax loss); its one jaxpar call marks the writes to
its residual stream (``jaxpar.nn.residual_add``)."""
import dataclasses
import functools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxpar.errors import LayoutError, NonFiniteStep, SpecError
from jaxpar.nn import residual_add
from jaxpar.parallel import build_layout, parse_strategy
from jaxpar.parallel import subspace
from jaxpar.parallel.subspace import codec
from jaxpar.report import Measured
from jaxpar.train.check import one_device
from jaxpar.train.step import TrainConfig, Trainer

VOCAB, WIDTH, K, STEPS = 64, 32, 8, 3
STREAM = ("batch", "length", "embed")
init = nnx.initializers.normal(0.05)
part = nnx.with_partitioning


class Block(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.RMSNorm(WIDTH, scale_init=part(nnx.initializers.ones, ("embed",)), rngs=rngs)
        self.up = nnx.Linear(WIDTH, 64, kernel_init=part(init, ("embed", "mlp")), use_bias=False, rngs=rngs)
        self.down = nnx.Linear(64, WIDTH, kernel_init=part(init, ("mlp", "embed")), use_bias=False, rngs=rngs)

    def __call__(self, x, marked=True):
        y = self.down(jax.nn.gelu(self.up(self.norm(x))))
        if marked == "partly":  # one write marked, a second (a tenth of it) added with a plain +
            return residual_add(x, y, (), STREAM)[0] + 0.1 * y
        return residual_add(x, y, (), STREAM)[0] if marked else x + y


class Model(nnx.Module):
    def __init__(self, marked=True, *, rngs):
        self.marked = marked
        self.embed = nnx.Embed(VOCAB, WIDTH, embedding_init=part(nnx.initializers.normal(1.0), ("vocab", "embed")), rngs=rngs)

        @nnx.split_rngs(splits=2)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make(rngs):
            return Block(rngs)

        self.blocks = make(rngs)
        self.norm = nnx.RMSNorm(WIDTH, scale_init=part(nnx.initializers.ones, ("embed",)), rngs=rngs)

    def __call__(self, tokens):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def run(x, block):
            return block(x, self.marked)

        return self.embed.attend(self.norm(run(self.embed(tokens), self.blocks)))


def loss_fn(model, tokens):
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


CFG = TrainConfig(learning_rate=1e-2, warmup_steps=1, total_steps=STEPS, microbatches=2, donate=False)
BATCHES = np.asarray(jax.random.randint(jax.random.key(1), (STEPS, 8, 9), 0, VOCAB))


def trainer_of(strategy, marked=True, layout=None, **options):
    layout = layout or build_layout(parse_strategy(strategy, 8))
    cfg = dataclasses.replace(CFG, **options)
    # (SGD with momentum: a weight moves by its gradients alone, where Adam would turn a rounding
    # difference of a gradient near zero into a whole step)
    return Trainer(layout, lambda rngs: Model(marked, rngs=rngs), loss_fn, cfg, optimizer=optax.sgd(0.3, momentum=0.9))


@functools.cache
def trained(strategy, on_one_device=False, **options):
    """(losses of STEPS steps, the weights after them, the compiled step's HLO text, each step's
    seconds, the trainer)."""
    trainer = trainer_of(strategy, **options)
    if on_one_device:
        trainer = trainer_of(strategy, layout=one_device(trainer.layout), **options)
    state = trainer.init(0)
    example = trainer.put_batch(BATCHES[0])
    step = trainer.jit_step(example).lower(state, example).compile()
    losses, seconds = [], []
    for batch in BATCHES:
        batch = trainer.put_batch(batch)
        began = time.perf_counter()
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))  # (waits for the step)
        seconds.append(time.perf_counter() - began)
    return np.array(losses), jax.device_get(state.params), step.as_text(), seconds, trainer


def test_the_boundary_code_gives_the_stream_back():
    """decode(encode(x)) = x for a stream whose writes lie in the subspace: to float32 rounding,
    and to the bf16 rounding of the coordinates when they travel in bf16."""
    keys = jax.random.split(jax.random.key(0), 2)
    x0 = jax.random.normal(keys[0], (4, 16, 256))
    x = x0 + codec.project(jax.random.normal(keys[1], (4, 16, 256)), 160)
    c = codec.encode(x, x0, 160)
    assert c.shape == (4, 16, 160)
    np.testing.assert_allclose(codec.decode(c, x0, 160), x, atol=2e-5)
    in_bf16 = codec.decode(c.astype(jnp.bfloat16).astype(jnp.float32), x0, 160)
    assert float(jnp.max(jnp.abs(in_bf16 - x))) <= 2**-8 * float(jnp.max(jnp.abs(c))) * 4
    u = codec.basis(256, 160)
    np.testing.assert_allclose(u.T @ u, np.eye(160), atol=1e-5)  # orthonormal, the same on every call
    assert codec.basis(256, 160) is u


def test_the_pipelined_subspace_model_equals_one_device():
    """Three SGD steps of stage=2,data=4,subspace=8 against the same layout's one-device twin (the
    writes projected alike, no pipeline): losses and weights to float32 rounding (fp32)."""
    losses, params = trained(f"stage=2,data=4,subspace={K}")[:2]
    want_losses, want = trained(f"stage=2,data=4,subspace={K}", on_one_device=True)[:2]
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, atol=2e-5, err_msg=jax.tree_util.keystr(path))
    dense = trained("stage=2,data=4")[0]
    assert abs(losses[-1] - dense[-1]) > 1e-3  # (the subspace is another function than the dense model)


def test_subspace_of_the_full_width_is_the_dense_model():
    losses, params = trained(f"stage=2,data=4,subspace={WIDTH}")[:2]
    dense, want = trained("stage=2,data=4")[:2]
    np.testing.assert_allclose(losses, dense, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, atol=2e-5)


def test_the_stages_send_k_values_a_position_each_way():
    """The pipeline's collective-permutes carry (rows, positions, k) against the dense pipeline's
    (rows, positions, d): k/d of the bytes, forward (the stream) and backward (its gradient)."""
    def permuted(text):
        shapes = set()
        for line in text.splitlines():
            if "collective-permute(" in line or "collective-permute-start(" in line:
                shapes |= set(re.findall(r"f32\[([\d,]+)\]", line.split("=", 1)[1].split("collective-permute")[0]))
        return shapes

    rows = 8 // 4 // CFG.microbatches  # a micro-batch's rows on one data device
    assert permuted(trained(f"stage=2,data=4,subspace={K}")[2]) == {f"{rows},8,{K}"}
    assert permuted(trained("stage=2,data=4")[2]) == {f"{rows},8,{WIDTH}"}
    # the report's section: the boundary bytes measured, k/d of the dense pipeline's
    layout = build_layout(parse_strategy(f"stage=2,data=4,subspace={K}", 8))
    section = subspace.report(layout, Measured(trained(f"stage=2,data=4,subspace={K}")[2], layout.mesh, {}, 8), None)
    dense = Measured(trained("stage=2,data=4")[2], layout.mesh, {}, 8).collectives
    sent = sum(c.bytes_per_step for c in dense if c.kind == "collective-permute" and "stage" in c.mesh_axes)
    assert section["boundary_bytes"] == sent * K / WIDTH > 0


def test_bad_input_is_refused_in_words():
    with pytest.raises(SpecError, match=r"subspace=8 .* has no pipeline; add stage=N"):
        parse_strategy("data=8,subspace=8", 8)
    with pytest.raises(SpecError, match=r"option subspace='x'"):
        parse_strategy("stage=2,data=4,subspace=x", 8)
    with pytest.raises(LayoutError, match=r"subspace=64 is above the model's width 32"):
        trainer_of("stage=2,data=4,subspace=64").init(0)
    with pytest.raises(LayoutError, match=r"never marks one with jaxpar.nn.residual_add"):
        trainer = trainer_of(f"stage=2,data=4,subspace={K}", marked=False)
        state = trainer.init(0)
        trainer.step(state, trainer.put_batch(BATCHES[0]))


def test_a_write_not_marked_stops_the_first_step_in_words():
    """A model that marks one of its writes and adds another with a plain +: the stage boundary
    would drop the second's part outside the subspace, which its one-device twin keeps. The step is
    made non-finite (not applied) and the message names the cause; the same model marked
    throughout trains in bfloat16 with every step finite (the check allows the stream's rounding)."""
    trainer = trainer_of(f"stage=2,data=4,subspace={K}", marked="partly")
    state = trainer.init(0)
    with pytest.raises(NonFiniteStep, match=r"Under subspace=8 a stage whose output leaves the subspace .* "
                                            r"jaxpar.nn.residual_add") as stopped:
        trainer.step(state, trainer.put_batch(BATCHES[0]))
    for a, b in zip(jax.tree.leaves(stopped.value.state.params), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(a, b)  # not applied
    trainer = trainer_of(f"stage=2,data=4,subspace={K}", compute_dtype="bfloat16")
    state = trainer.init(0)
    for batch in BATCHES:
        state, metrics = trainer.step(state, trainer.put_batch(batch))
        assert bool(metrics["finite"]), metrics


def test_slowed_stage_links_make_each_sending_tick_wait_and_change_nothing_else():
    """--stage-link-latency-ms 100: every tick of the schedule that sends between stages waits
    100 ms for real (the simulated devices' waits run at once), and the numbers are the same: the
    losses bitwise, the weights to float32 rounding (bitwise at XLA's default flags; under the
    suite's, XLA fuses the program around the waits otherwise: 7e-9 seen)."""
    losses, params, _, seconds, trainer = trained("stage=2,data=4", stage_link_latency_ms=100.0)
    want_losses, want, _, fast, _ = trained("stage=2,data=4")
    np.testing.assert_array_equal(losses, want_losses)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-7 * np.max(np.abs(b)))
    program = trainer.plan.program
    sending = int(np.sum((program.forward_send > 0) | (program.backward_send > 0)))
    # (a lower bound only: a loaded machine slows both runs, never the sleeps below their length)
    assert sending >= 2 and min(seconds) >= 0.1 * sending, (seconds, sending, fast)
    with pytest.raises(SpecError, match=r"--stage-link-latency-ms -1.0: give a speed or a latency of 0 or more"):
        trainer_of("stage=2,data=4", stage_link_latency_ms=-1.0).init(0)
