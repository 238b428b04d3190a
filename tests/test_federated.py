"""Federated sharded data parallelism (``federation=G``, ``train/federated.py``) on a plain Flax model:
federation=1 is the inner strategy bitwise; FL+HSDP with inner SGD, one local step and averaging
is HSDP with SGD; FL+FSDP with inner AdamW and DiLoCo's outer Nesterov equals a one-device
simulation of the algorithm written here for 3 outer steps; a group's step runs on its own devices
only, and a merge's one collective is the all-reduce of each device's shard over ``federation``,
2 (Psi / n) (G - 1) / G bytes; bad options are refused in words."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from conftest import trimmed_copy

from jaxpar import cli
from jaxpar.analysis import hlo
from jaxpar.errors import JaxparError
from jaxpar.models import llama
from jaxpar.parallel import build_layout, parse_strategy
from jaxpar.run import RunConfig, run_training
from jaxpar.topology import load_topology
from jaxpar.train.checkpoint import CheckpointConfig, load_arrays
from jaxpar.train.federated import FederatedTrainer
from jaxpar.train.step import TrainConfig, Trainer
from tests.test_delayed_tp import PlainMlp as MLP  # a plain Flax MLP: nnx.Linear up, GELU, down

BATCH, STEPS = 16, 6
CFG = TrainConfig(clip_norm=0.0)  # a group's norm is not the global batch's: compared without clipping


def loss_fn(model, batch):
    return jnp.mean((model(batch[:, :16]) - jnp.sin(batch[:, 16:])) ** 2)


def by_hand(params, batch):
    """The same loss on a pure dict of weights, on one device (the simulation's)."""
    out = jax.nn.gelu(batch[:, :16] @ params["up"]["kernel"]) @ params["down"]["kernel"]
    return jnp.mean((out - jnp.sin(batch[:, 16:])) ** 2)


BATCHES = [np.random.default_rng(i).standard_normal((BATCH, 32)).astype(np.float32) for i in range(STEPS)]


def federated(text: str, optimizer, **options):
    strategy = parse_strategy(text, 8)
    strategy = dataclasses.replace(strategy, options=dict(strategy.options, **options))
    return FederatedTrainer(build_layout(strategy), strategy, MLP, loss_fn, CFG, optimizer)


def train(trainer, steps=STEPS, drifts=None):
    states, losses = trainer.init(0), []
    for batch in BATCHES[:steps]:
        states, metrics = trainer.step(states, trainer.put_process_batch(BATCH, lambda a, b, batch=batch: batch[a:b]))
        losses.append(metrics["loss"])
        if metrics["drift"] is not None and drifts is not None:
            drifts.append(metrics["drift"])
    return states, losses


def host(params):
    return jax.tree.map(np.asarray, params)


def test_one_group_is_the_inner_strategy_bitwise():
    states, losses = train(federated("federation=1,fsdp=8", optax.adamw(1e-2), local_steps=2))  # merges with itself 3 times
    plain = Trainer(build_layout(parse_strategy("fsdp=8", 8)), MLP, loss_fn, CFG, optax.adamw(1e-2))
    state, expected = plain.init(0), []
    for batch in BATCHES:
        state, metrics = plain.step(state, plain.put_batch(batch))
        expected.append(float(metrics["loss"]))
    assert losses == expected
    jax.tree.map(np.testing.assert_array_equal, host(states[0].train.params), host(state.params))


def test_fl_hsdp_with_sgd_and_one_local_step_is_hsdp():
    states, losses = train(federated("federation=2,data=2,fsdp=2", optax.sgd(5e-2), local_steps=1))
    hsdp = Trainer(build_layout(parse_strategy("data=4,fsdp=2", 8)), MLP, loss_fn, CFG, optax.sgd(5e-2))
    state, expected = hsdp.init(0), []
    for batch in BATCHES:
        state, metrics = hsdp.step(state, hsdp.put_batch(batch))
        expected.append(float(metrics["loss"]))
    # fp32: the mean of the groups' updated weights against the update by the mean gradient
    np.testing.assert_allclose(losses, expected, rtol=1e-6)
    jax.tree.map(np.testing.assert_array_equal, host(states[0].train.params), host(states[1].train.params))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), host(states[0].train.params), host(state.params))


def simulate_diloco(params, groups: int, local_steps: int, steps: int, drifts: list):
    """DiLoCo on one device: each group's copy takes ``local_steps`` AdamW steps on its rows, then
    the model as of the last merge is stepped by outer Nesterov SGD on the mean of (it minus each
    copy); ``drifts`` gets each merge's norms of (it minus each copy)."""
    inner, outer = optax.adamw(1e-2), optax.sgd(0.7, momentum=0.9, nesterov=True)
    anchor, outer_state = params, outer.init(params)
    copies = [params] * groups
    inner_states = [inner.init(params) for _ in range(groups)]
    share = BATCH // groups
    for step in range(steps):
        for g in range(groups):
            grads = jax.grad(by_hand)(copies[g], BATCHES[step][g * share:(g + 1) * share])
            updates, inner_states[g] = inner.update(grads, inner_states[g], copies[g])
            copies[g] = optax.apply_updates(copies[g], updates)
        if (step + 1) % local_steps == 0:
            drifts.append([float(optax.tree.norm(jax.tree.map(lambda a, c: a - c, anchor, copy))) for copy in copies])
            delta = jax.tree.map(lambda a, *c: a - sum(c) / groups, anchor, *copies)
            updates, outer_state = outer.update(delta, outer_state, anchor)
            anchor = optax.apply_updates(anchor, updates)
            copies = [anchor] * groups
    return anchor


def test_fl_fsdp_with_outer_nesterov_equals_a_simulation_of_diloco():
    trainer = federated("federation=2,fsdp=4,local_steps=2,outer=nesterov", optax.adamw(1e-2))
    initial = host(trainer.init(0)[0].train.params)
    drifts, simulated = [], []
    states, _ = train(trainer, drifts=drifts)  # 3 outer steps of 2 local steps
    expected = simulate_diloco(initial, 2, 2, STEPS, simulated)
    np.testing.assert_allclose(drifts, simulated, rtol=1e-4)
    assert len(drifts) == 3 and min(min(d) for d in drifts) > 0
    for state in states:
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), host(state.train.params), host(expected))
        jax.tree.map(np.testing.assert_array_equal, host(state.anchor), host(state.train.params))


@pytest.mark.parametrize("text", ["federation=2,fsdp=4", "federation=2,data=2,fsdp=2"])
def test_groups_run_on_their_own_devices_and_a_merge_sends_each_devices_share_once(text):
    """FL+FSDP: each device all-reduces its shard over ``federation``. FL+HSDP: the two ``data``
    replicas of a shard each send half of it, then gather the halves inside the group; either
    way 2 (Psi / n) (G - 1) / G bytes cross the groups for groups of n = 4 devices."""
    trainer = federated(text, optax.adamw(1e-2))
    states = trainer.init(0)
    batches = trainer.put_process_batch(BATCH, lambda a, b: BATCHES[0][a:b])
    own = [set(group.layout.mesh.devices.flat) for group in trainer.groups]
    assert not own[0] & own[1]
    for group, state, batch, devices in zip(trainer.groups, states, batches, own):
        compiled = group.jit_step(batch).lower(state.train, batch).compile()
        assert {d for s in jax.tree.leaves(compiled.input_shardings) for d in s.device_set} == devices
    from jaxpar.train.federated import _mergeable, _stack

    stacked = _stack(trainer.layout.mesh, [_mergeable(state, trainer.options) for state in states])
    program = jax.jit(trainer.merge_fn()).lower(stacked, np.uint32(0)).compile().as_text()  # (the drift: G scalars)
    found = hlo.collectives(program, trainer.layout.mesh)
    weights = [c for c in found if c.operand_bytes > 2 * 4]  # the rest: each group's drift, G floats
    psi = sum(leaf.nbytes for leaf in jax.tree.leaves(states[0].train.params))  # float32
    across = [c for c in weights if "federation" in c.mesh_axes]
    assert across and {(c.kind, c.mesh_axes) for c in across} == {("all-reduce", ("federation",))}
    assert sum(c.bytes_per_execution * c.executions for c in across) == pytest.approx(2 * (psi / 4) * (2 - 1) / 2)
    inside = {(c.kind, c.mesh_axes) for c in weights if c not in across}
    assert inside == (set() if "data" not in text else {("all-gather", ("data",))})
    assert len(found) - len(weights) <= 1


def test_grad_sync_compresses_the_merge_only_and_every_group_gets_the_same_bits():
    """``grad_sync=dynamiq`` in a federated run: the merge's mean change goes through the compressed
    all-reduce over ``federation`` (no float32 all-reduce of weights across the groups, and about
    5.5/32 of its bytes on the wire), the groups' own reductions stay exact, every group ends with
    the same bits, and the model is the exact merge's within dynamiq's error."""
    exact = federated("federation=2,fsdp=4,local_steps=2", optax.adamw(1e-2))
    cfg = dataclasses.replace(CFG, grad_sync="dynamiq", grad_sync_min_size=64)
    strategy = parse_strategy("federation=2,fsdp=4,local_steps=2", 8)
    squeezed = FederatedTrainer(build_layout(strategy), strategy, MLP, loss_fn, cfg, optax.adamw(1e-2))
    assert squeezed.merge_sync.axes == ("federation",) and all(g.plan.grad_sync is None for g in squeezed.groups)
    (a, _), (b, _) = train(exact, steps=4), train(squeezed, steps=4)
    jax.tree.map(np.testing.assert_array_equal, host(b[0].train.params), host(b[1].train.params))
    for x, y in zip(jax.tree.leaves(host(a[0].train.params)), jax.tree.leaves(host(b[0].train.params))):
        assert 0 < np.abs(x - y).max() < 1e-2 * np.abs(x).max()
    from jaxpar.train.federated import _mergeable, _stack

    stacked = _stack(squeezed.layout.mesh, [_mergeable(state, squeezed.options) for state in b])
    found = hlo.collectives(jax.jit(squeezed.merge_fn()).lower(stacked, np.uint32(0)).compile().as_text(), squeezed.layout.mesh)
    assert not [c for c in found if c.kind == "all-reduce" and c.operand_bytes > 2 * 4]
    wire = sum(c.bytes_per_execution * c.executions for c in found if c.mesh_axes == ("federation",))
    psi = sum(leaf.nbytes for leaf in jax.tree.leaves(b[0].train.params))
    assert 0.1 < wire / (2 * (psi / 4) * (2 - 1) / 2) < 0.25


@pytest.mark.parametrize("text, message", [
    ("federation=2,fsdp=4,local_steps=0", "local_steps='0'.*1 or more"),
    ("federation=2,fsdp=4,outer=adam", "outer='adam'.*avg, sgd, nesterov"),
    ("federation=2,fsdp=4,outer_momentum=1", "momentum of 1 or more"),
    ("fsdp=8,local_steps=4", "add federation=G"),
    ("federation=2,fsdp=4,local_steps=4,fragments=2,merge_delay=2", "merge_delay=2: a fragment's merge must be applied"),
    ("federation=2,fsdp=4,merge_mix=0.3", "add merge_delay=D or drop merge_mix"),
])
def test_bad_options_are_refused_in_words(text, message):
    with pytest.raises(JaxparError, match=message):
        parse_strategy(text, 8)


def test_groups_that_would_straddle_slices_are_refused_in_words():
    from jaxpar.parallel import federation

    federation.check_slices(parse_strategy("federation=6,fsdp=16", 96), 3)  # two groups a slice
    federation.check_slices(parse_strategy("federation=3,data=2,fsdp=16", 96), 6)  # a group on two slices
    with pytest.raises(JaxparError, match="federation=2 on 3 slices would cut groups across the slow links"):
        federation.check_slices(parse_strategy("federation=2,fsdp=48", 96), 3)


def test_the_one_program_step_refuses_federation():
    with pytest.raises(JaxparError, match="jaxpar train runs it, and jaxpar.train.federated.FederatedTrainer"):
        Trainer(build_layout(parse_strategy("federation=2,fsdp=4", 8)), MLP, loss_fn, CFG)


def test_jaxpar_train_runs_the_groups_reports_the_merges_and_resumes_bitwise(tmp_path, capsys):
    """``jaxpar train`` of the main job's Llama under FL+FSDP with DiLoCo's outer step: the first
    step's loss is HSDP's on the same global batch (each group read its own rows of it), a merge
    every 2 steps with each group's drift, the bytes across the groups per step one merge's over H
    against HSDP's every step, the held-out loss every 2 steps and at the end, in the report and in
    TensorBoard. Its checkpoints hold every group's copy, inner optimizer state, anchor and outer
    momentum (stacked over ``federation``, verified on the way back): resumed from step 3, between
    two merges, the run ends where the uninterrupted one did, bitwise. ``--init-from`` starts every
    group from a checkpoint's weights."""
    topology = load_topology("cpu-8")
    hsdp = run_training(RunConfig(model="tiny", strategy="data=2,fsdp=4", steps=2, batch_size=8, seq_len=32), topology,
                        progress=None, checkpoint=CheckpointConfig(str(tmp_path / "h")))  # (2: the first step's rate is 0)
    argv = ["train", "--strategy", "federation=2,fsdp=4,local_steps=2,outer=nesterov", "--steps", "5", "--batch-size", "8",
            "--seq-len", "32", "--checkpoint-every", "3"]
    assert cli.main([*argv, "--checkpoint-dir", str(tmp_path / "a"), "--metrics-json", str(tmp_path / "a.json"), "--init-from",
                     str(tmp_path / "h"), "--eval-every", "2", "--tensorboard", str(tmp_path / "board")]) == 0
    out = capsys.readouterr().out
    assert "2 groups of 4 devices (fsdp=4 each), merging every 2 steps (nesterov)" in out and "merge at step 4: drift" in out
    report = json.loads((tmp_path / "a.json").read_text())
    # from HSDP's checkpoint: the first loss is HSDP's from the same weights on the same global batch
    first = run_training(RunConfig(model="tiny", strategy="data=2,fsdp=4", steps=1, batch_size=8, seq_len=32,
                                   init_from=str(tmp_path / "h")), topology, progress=None)
    assert report["losses"][0] == pytest.approx(first["losses"][0], rel=1e-6) and first["losses"][0] != hsdp["losses"][0]
    assert [m["step"] for m in report["merges"]] == [2, 4, 5] and all(d > 0 for m in report["merges"] for d in m["drift"])
    merge = 2 * (llama.CONFIGS["tiny"].num_params() * 4 / 4) * (2 - 1) / 2  # float32 weights over fsdp=4
    assert report["inter_group_bytes_per_step"] == {"federated": merge / 2, "hsdp": merge}
    assert np.isfinite(report["held_out_loss"]) and report["losses"][-1] < report["losses"][0]
    assert [step for step, _ in report["held_out_losses"]] == [2, 4, 5]
    assert report["held_out_losses"][-1][1] == pytest.approx(report["held_out_loss"], rel=1e-6)  # the merged model's
    board = EventAccumulator(str(tmp_path / "board"))
    board.Reload()
    assert [[e.step, pytest.approx(e.value, rel=1e-6)] for e in board.Scalars("eval/held_out_loss")] == report["held_out_losses"]
    assert [e.step for e in board.Scalars("federation/drift_group1")] == [2, 4, 5]
    trimmed_copy(tmp_path / "a", tmp_path / "b", 3)  # as if stopped after step 3
    assert cli.main([*argv, "--checkpoint-dir", str(tmp_path / "b"), "--metrics-json", str(tmp_path / "b.json"), "--resume"]) == 0
    resumed = json.loads((tmp_path / "b.json").read_text())
    assert resumed["start_step"] == 3 and resumed["losses"] == report["losses"] and resumed["held_out_loss"] == report["held_out_loss"]
    a, _ = load_arrays(str(tmp_path / "a"))
    b, _ = load_arrays(str(tmp_path / "b"))
    assert set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("extra, message", [
    (["--batch-size", "7"], "--batch-size 7 does not split over federation=2 groups"),
    (["--init-from", "/nonexistent"], "/nonexistent"),
])
def test_jaxpar_train_refuses_what_a_federated_run_does_not_do_before_any_work(extra, message, capsys):
    assert cli.main(["train", "--strategy", "federation=2,fsdp=4", "--steps", "2", *extra]) == cli.EXIT_BAD_INPUT
    assert message in capsys.readouterr().err



class StackedMLP(nnx.Module):
    """Four residual layers whose weights are one array stacked over "layers" (as nnx.scan leaves
    them), then a plain Flax output layer."""

    def __init__(self, rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("layers", "embed", "mlp"))
        self.w = nnx.Param(init(rngs.params(), (4, 16, 16)))
        self.out = nnx.Linear(16, 16, kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("mlp", "embed")),
                              use_bias=False, rngs=rngs)

    def __call__(self, x):
        for layer in range(4):
            x = x + jax.nn.gelu(x @ self.w[layer])
        return self.out(x)


def stacked_by_hand(params, batch):
    x = batch[:, :16]
    for layer in range(4):
        x = x + jax.nn.gelu(x @ params["w"][layer])
    return jnp.mean((x @ params["out"]["kernel"] - jnp.sin(batch[:, 16:])) ** 2)


def simulate_streaming(params, groups: int, local_steps: int, fragments: int, batches: list, delay: int = 0, keep: float = 0.5):
    """Streaming DiLoCo on one device: fragment f (layers [f L/F, (f + 1) L/F), and in fragment 0
    the output layer) takes DiLoCo's outer Nesterov step on its own at steps (f + 1) H / F of
    every H; the rest of each copy trains on. With ``delay`` D the merged fragment reaches the
    copies D steps later, each copy's fragment then ``keep`` of itself plus the rest of it."""
    inner, outer = optax.adamw(1e-2), optax.sgd(0.7, momentum=0.9, nesterov=True)
    params = jax.tree.map(jnp.asarray, params)
    anchor, momentum = params, outer.init(params)
    copies, states = [params] * groups, [inner.init(params) for _ in range(groups)]
    share, size = BATCH // groups, 4 // fragments
    due = lambda step, f: step % local_steps == (f + 1) * local_steps // fragments % local_steps  # noqa: E731
    for step, batch in enumerate(batches):
        for g in range(groups):
            grads = jax.grad(stacked_by_hand)(copies[g], batch[g * share:(g + 1) * share])
            updates, states[g] = inner.update(grads, states[g], copies[g])
            copies[g] = optax.apply_updates(copies[g], updates)
        for f in range(fragments):
            rows = slice(f * size, (f + 1) * size)
            mine = lambda tree: {"w": tree["w"][rows], "out": tree["out"] if f == 0 else {"kernel": tree["out"]["kernel"][:0]}}  # noqa: E731
            if delay and step + 1 > delay and due(step + 1 - delay, f):  # the merge of D steps ago arrives
                mixed = [jax.tree.map(lambda c, a: keep * c + (1 - keep) * a, mine(c), mine(anchor)) for c in copies]
                copies = [put_part(c, m, rows, f) for c, m in zip(copies, mixed)]
            if not due(step + 1, f):
                continue
            delta = jax.tree.map(lambda a, *c: a - sum(c) / groups, mine(anchor), *[mine(c) for c in copies])
            trace = mine(momentum[0].trace)
            updates, (moved, _) = outer.update(delta, (optax.TraceState(trace=trace), optax.EmptyState()), mine(anchor))
            new = optax.apply_updates(mine(anchor), updates)
            anchor = put_part(anchor, new, rows, f)
            momentum = (optax.TraceState(trace=put_part(momentum[0].trace, moved.trace, rows, f)), momentum[1])
            copies = copies if delay else [put_part(c, new, rows, f) for c in copies]
    return copies


def put_part(tree, part, rows, f):
    return {"w": tree["w"].at[rows].set(part["w"]), "out": part["out"] if f == 0 else tree["out"]}


@pytest.mark.parametrize("delay", [0, 1])
def test_fragments_merge_in_turn_as_a_simulation_of_streaming_diloco(delay):
    """Fragments merged in turn; with merge_delay=1, each merge reaches the copies a step later,
    mixed half and half with what they trained meanwhile."""
    options = f",merge_delay={delay}" if delay else ""
    strategy = parse_strategy("federation=2,fsdp=4,local_steps=4,fragments=2,outer=nesterov" + options, 8)
    trainer = FederatedTrainer(build_layout(strategy), strategy, StackedMLP, loss_fn, CFG, optax.adamw(1e-2))
    initial = host(trainer.init(0)[0].train.params)
    states, merged, batches = trainer.init(0), [], BATCHES + BATCHES[:2]
    for batch in batches:  # 8 steps: each fragment merges twice
        states, metrics = trainer.step(states, trainer.put_process_batch(BATCH, lambda a, b, batch=batch: batch[a:b]))
        merged.append(metrics["fragment"])
    assert merged == [None, 0, None, 1, None, 0, None, 1]
    expected = simulate_streaming(initial, 2, 4, 2, batches, delay=delay)
    for state, copy in zip(states, expected):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), host(state.train.params), host(copy))
    if delay:
        return
    with pytest.raises(JaxparError, match="fragments=3 must divide the model's 4 layers and local_steps=4"):
        strategy = parse_strategy("federation=2,fsdp=4,local_steps=4,fragments=3", 8)
        FederatedTrainer(build_layout(strategy), strategy, StackedMLP, loss_fn, CFG)
    with pytest.raises(JaxparError, match="this model stacks none"):
        strategy = parse_strategy("federation=2,fsdp=4,fragments=2", 8)
        FederatedTrainer(build_layout(strategy), strategy, MLP, loss_fn, CFG)
