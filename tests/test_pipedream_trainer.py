"""PipeDream inside the Trainer (``--schedule pipedream``): a plain Flax model (test_any_model's,
its layers stacked by nnx.vmap and run by nnx.scan, an optax loss) under stage=2,data=2 trains
as the single-device simulation of the same never-flushed stream (``pipeline.simulate_pipedream``,
PipeDream from its definition), and a checkpoint taken between steps holds the micro-batches in
flight: the step after a restore is the step that would have followed, bitwise."""
import dataclasses

import jax
import numpy as np
import optax
import pytest

from jaxpar.errors import JaxparError, LayoutError
from jaxpar.parallel import build_layout, parse_strategy
from jaxpar.parallel.stage import pipeline as pl
from jaxpar.parallel.stage.schedules import ScheduleError
from jaxpar.run import RunConfig, check_same_function
from jaxpar.train.checkpoint import CheckpointConfig, Checkpointer
from jaxpar.train.state import abstract_model
from jaxpar.train.step import TrainConfig, Trainer
from tests.test_any_model import ALIASES, UserModel, user_loss
from tests.test_pipeline import assert_close

STAGES, DATA, M, STEPS, ROWS = 2, 2, 4, 3, 16
OPTIMIZER = optax.sgd(0.1, momentum=0.9)  # (not Adam: its steps do not change with the gradient's scale)
CLIP = 0.5


def model_fn(rngs):
    return UserModel(rngs=rngs, stacked=True, out_sharding=False, tied=False, layers=4)


def trainer_for(strategy: str, batch, n: int = STAGES * DATA, **options) -> Trainer:
    layout = build_layout(parse_strategy(strategy, n), jax.devices()[:n], aliases=ALIASES)
    cfg = TrainConfig(schedule="pipedream", microbatches=M, clip_norm=CLIP, donate=False, **options)
    return Trainer(layout, model_fn, user_loss, cfg, optimizer=OPTIMIZER, batch=batch)


def simulate(start, tokens, applied):
    """The oracle: the stream on one device, cut where each stage has made ``applied`` updates.
    Global micro-batch i is every data shard's i-th block of rows (each device splits its rows)."""
    graphdef, abstract = abstract_model(model_fn)
    split = pl.split_at_layer_scan(user_loss, graphdef, abstract)
    stacked, edge = split.split(start)
    rows = ROWS // DATA // M
    stream = np.concatenate([t.reshape(DATA, M, rows, -1).transpose(1, 0, 2, 3).reshape(M, DATA * rows, -1) for t in tokens])
    chunk, example = jax.tree.map(lambda x: x[:1], stacked), stream[0]  # (traced for shapes only)
    return stream, pl.simulate_pipedream(
        lambda c, x: split.pieces.stage(edge, c, x, example), stacked, stream, STAGES,
        first_fn=lambda e, mb: split.pieces.first(e, chunk, mb), last_fn=lambda e, x, mb: split.pieces.last(e, chunk, x, mb),
        edge_params=edge, optimizer=optax.chain(optax.clip_by_global_norm(CLIP), OPTIMIZER), applied=applied)


def test_trainer_pipedream_equals_its_simulation_and_resumes_from_a_checkpoint_bitwise(tmp_path):
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (STEPS, ROWS, 17), 0, 64))
    trainer = trainer_for(f"stage={STAGES},data={DATA}", tokens[0])
    state = trainer.init(0)
    start, losses = jax.device_get(state.params), []
    ckpt = Checkpointer(CheckpointConfig(str(tmp_path)))
    for step, batch in enumerate(tokens):
        if step == STEPS - 1:  # the pipeline is full here: micro-batches in flight, weights stashed
            ckpt.save(step, state, {"devices": trainer.layout.mesh.size})
            ckpt.wait()
        state, metrics = trainer.step(state, trainer.put_batch(batch))
        losses.append(float(metrics["loss"]))
    done = [int(n) for n in jax.device_get(state.stream["updates"])]
    _, (want_losses, want_stacked, want_edges, _) = simulate(start, tokens, done)
    # a step's loss: the mean of the micro-batches the last stage ran forward in it (here 4w..4w+3)
    assert len(want_losses) >= M * (STEPS - 1)
    np.testing.assert_allclose(losses[:-1], np.asarray(want_losses[:M * (STEPS - 1)]).reshape(-1, M).mean(1), rtol=1e-5)
    stacked, edge = trainer.plan.pipeline.split(jax.device_get(state.params))
    assert_close(stacked, want_stacked, "each stage's layers")
    # the weights the state shows: the embedding as the first stage trained it, norm and head the last
    assert_close(edge["embed"], jax.tree.map(lambda e: e[0], want_edges["embed"]), "embedding")
    for name in ("norm", "head"):
        assert_close(edge[name], jax.tree.map(lambda e: e[-1], want_edges[name]), name)
    # staleness as measured in the stream: stage s trains at weights S - s - 1 updates old
    assert trainer.pipedream.report(state)["staleness"] == [STAGES - 1 - s for s in range(STAGES)]
    # the checkpoint holds the stream: restored, the last step is the same step, bit for bit
    restored, _ = Checkpointer.existing(CheckpointConfig(str(tmp_path))).restore(trainer.abstract_state(), STEPS - 1)
    again, metrics = trainer.step(restored, trainer.put_batch(tokens[-1]))
    assert float(metrics["loss"]) == losses[-1]
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # and the held-out loss is the model's loss at the weights the state shows (1F1B's mean of
    # equal micro-batches' means: the batch's mean)
    held_out = float(trainer.jit_loss(tokens[0])(state.params, trainer.put_batch(tokens[0])))
    np.testing.assert_allclose(held_out, float(user_loss(trainer.merge(jax.device_get(state.params)), tokens[0])), rtol=1e-5)


def test_trainer_pipedream_refuses_what_it_does_not_run():
    batch = np.zeros((ROWS, 17), np.int32)
    with pytest.raises(LayoutError, match=r"splits weights over fsdp; combine stage=N with data=M only"):
        trainer_for("stage=2,fsdp=2", batch)
    with pytest.raises(LayoutError, match=r"splits weights over tensor"):
        trainer_for("stage=2,tensor=2", batch)
    with pytest.raises(LayoutError, match=r"build the Trainer with batch="):
        trainer_for("stage=2,data=2", None)
    with pytest.raises(ScheduleError, match=r"pipedream with 2 micro-batches on 4 stages"):
        layout = build_layout(parse_strategy("stage=4", 4), jax.devices()[:4], aliases=ALIASES)
        Trainer(layout, model_fn, user_loss, TrainConfig(schedule="pipedream", microbatches=2), batch=batch)


def test_a_checkpoint_is_resumed_under_the_kind_of_schedule_it_was_saved_with():
    """From the checkpoint's meta, before any array is read: PipeDream's state (its pipeline in
    flight, each stage's optimizer state) against a synchronous schedule's, both ways, with the fix."""
    saved = {"step": 6, "model": "tiny", "strategy": "stage=2,data=4", "devices": 8,
             "arrays": {"params/embed": [[64, 32], "float32"], "stream/edge/embed": [[2, 64, 32], "float32"]}}
    synchronous = RunConfig(model="tiny", strategy="stage=2,data=4", train=TrainConfig(schedule="1f1b", microbatches=4))
    with pytest.raises(JaxparError, match=r"saved under --schedule pipedream.*resume it with --schedule pipedream, "
                                          r"start another --checkpoint-dir from its weights with --init-from runs/x"):
        check_same_function(synchronous, None, None, "runs/x", saved)
    flushed = dict(saved, arrays={"params/embed": [[64, 32], "float32"], "opt_state/0/mu/embed": [[64, 32], "float32"]})
    streaming = dataclasses.replace(synchronous, train=TrainConfig(schedule="pipedream", microbatches=4))
    with pytest.raises(JaxparError, match=r"saved without --schedule pipedream.*resume it without --schedule pipedream"):
        check_same_function(streaming, None, None, "runs/x", flushed)
