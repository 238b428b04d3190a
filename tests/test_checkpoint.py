"""Checkpoints: saved under one layout, restored bit for bit under others; resumed runs equal
uninterrupted ones; bad input is refused before any device memory is touched; an interrupted
save is never picked up."""
import dataclasses
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxpar.errors import JaxparError
from jaxpar.models import llama
from jaxpar.topology import load_topology
from jaxpar.train.checkpoint import CheckpointConfig, Checkpointer, flat_arrays, load_arrays
from jaxpar.train.loop import RunConfig, build_trainer, run_training
from jaxpar.train.step import Trainer

RUN = RunConfig(model="tiny", strategy="fsdp=8", steps=4, batch_size=8, seq_len=32, seed=0)
CLI_RUN = ["train", "--strategy", "fsdp=8", "--steps", "4", "--batch-size", "8", "--seq-len", "32", "--checkpoint-every", "2"]
JOBS = os.path.join(os.path.dirname(__file__), "jobs")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 4-step fsdp=8 run that checkpointed at steps 2 and 4."""
    directory = tmp_path_factory.mktemp("ckpt") / "run"
    report = run_training(RUN, load_topology("cpu-8"), progress=None, checkpoint=CheckpointConfig(str(directory), every=2, keep=2))
    return directory, report


def _live_ids():
    return {id(a) for a in jax.live_arrays()}


@pytest.mark.slow
def test_saves_every_k_steps_and_the_last(saved, tmp_path):
    directory, report = saved
    assert report["checkpoints"]["steps"] == [2, 4]
    arrays, meta = load_arrays(str(directory))
    assert meta["step"] == 4 and meta["strategy"] == "fsdp=8" and meta["processes"] == 1
    assert meta["data"] == {"seed": 0, "batch_size": 8, "seq_len": 32, "next_step": 4}
    assert int(arrays["step"]) == 4 and set(meta["arrays"]) == set(arrays)
    # keep-last-N: a third save drops the oldest only once the new one is complete
    run = dataclasses.replace(RUN, steps=6)
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy)
    report = run_training(run, load_topology("cpu-8"), progress=None, checkpoint=CheckpointConfig(str(copy), every=2, keep=2), resume="required")
    assert report["start_step"] == 4 and report["checkpoints"]["steps"] == [4, 6]


@pytest.mark.parametrize(
    "strategy, topology",
    [("data=2,tensor=4", "cpu-8"), ("fsdp=4", "cpu-4"), ("data=2,fsdp=2,zero=1", "cpu-4"), ("fsdp=2,tensor=4,sp=on", "cpu-8")],
)
def test_restores_bit_for_bit_under_another_layout(saved, strategy, topology):
    directory, _ = saved
    expected, _ = load_arrays(str(directory))
    trainer, _, _ = build_trainer(dataclasses.replace(RUN, strategy=strategy), load_topology(topology))
    state, meta = Checkpointer.existing(CheckpointConfig(str(directory))).restore(trainer.abstract_state())
    restored = flat_arrays(state)
    shardings = flat_arrays(trainer.state_shardings)
    assert set(restored) == set(expected)
    for path, array in restored.items():
        assert array.sharding == shardings[path], path  # laid out as the new layout says
        np.testing.assert_array_equal(np.asarray(array), expected[path], err_msg=path)
    assert meta["step"] == 4


@pytest.mark.slow
def test_four_device_checkpoint_restores_on_eight(tmp_path):
    directory = tmp_path / "four"
    run = dataclasses.replace(RUN, strategy="fsdp=2,tensor=2", steps=1)
    run_training(run, load_topology("cpu-4"), progress=None, checkpoint=CheckpointConfig(str(directory)))
    expected, meta = load_arrays(str(directory))
    assert meta["devices"] == 4
    trainer, _, _ = build_trainer(RUN, load_topology("cpu-8"))
    state, _ = Checkpointer.existing(CheckpointConfig(str(directory))).restore(trainer.abstract_state())
    for path, array in flat_arrays(state).items():
        assert len(array.sharding.device_set) == 8
        np.testing.assert_array_equal(np.asarray(array), expected[path], err_msg=path)


def test_resumed_run_equals_uninterrupted(saved, tmp_path):
    directory, report = saved
    copy = tmp_path / "resume"
    shutil.copytree(directory, copy)
    shutil.rmtree(copy / "4")  # as if the job died after step 2's checkpoint
    resumed = run_training(RUN, load_topology("cpu-8"), progress=None, checkpoint=CheckpointConfig(str(copy), every=2), resume="required")
    assert resumed["start_step"] == 2 and resumed["losses"] == report["losses"][2:]
    a, _ = load_arrays(str(directory))
    b, _ = load_arrays(str(copy))
    for path in a:
        np.testing.assert_array_equal(a[path], b[path], err_msg=path)


def test_checkpoint_of_another_model_names_the_arrays(saved):
    directory, _ = saved
    wider = dataclasses.replace(llama.CONFIGS["tiny"], mlp=llama.CONFIGS["tiny"].mlp * 2, layers=llama.CONFIGS["tiny"].layers + 1)
    trainer, _, _ = build_trainer(RUN, load_topology("cpu-8"))
    other = Trainer(trainer.layout, lambda rngs: llama.Llama(wider, rngs=rngs), llama.loss_fn)
    before = _live_ids()
    with pytest.raises(JaxparError) as err:
        Checkpointer.existing(CheckpointConfig(str(directory))).restore(other.abstract_state())
    message = str(err.value)
    assert "params/layers/w_up: checkpoint float32[4, 128, 384], model float32[5, 128, 768]" in message
    assert "27 arrays differ" in message
    assert _live_ids() <= before  # refused before any array was read


def test_missing_checkpoint_directory_is_refused_before_device_memory(tmp_path):
    missing = tmp_path / "nowhere"
    before = _live_ids()
    with pytest.raises(JaxparError, match="does not exist") as err:
        run_training(RUN, load_topology("cpu-8"), progress=None, checkpoint=CheckpointConfig(str(missing)), resume="required")
    assert str(missing) in str(err.value)
    assert _live_ids() <= before and not missing.exists()


def test_existing_checkpoints_are_never_overwritten(saved):
    directory, _ = saved
    listing = sorted(os.listdir(directory))
    before = _live_ids()
    with pytest.raises(JaxparError, match="already holds checkpoints"):
        run_training(RUN, load_topology("cpu-8"), progress=None, checkpoint=CheckpointConfig(str(directory), every=2))
    assert sorted(os.listdir(directory)) == listing and _live_ids() <= before


def _cli(*args, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow
def test_job_killed_during_a_save_resumes_from_the_previous_checkpoint(saved, tmp_path):
    directory, _ = saved
    target = tmp_path / "run"
    # SIGKILL the job at the moment checkpoint 4 would be committed (its files are written)
    killed = _cli(os.path.join(JOBS, "kill_during_save.py"), "4", *CLI_RUN, "--checkpoint-dir", str(target))
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert sorted(os.listdir(target)) == ["2", "4.orbax-checkpoint-tmp"]
    assert Checkpointer(CheckpointConfig(str(target)), create=False).latest_step() == 2
    resumed = _cli("-m", "jaxpar.cli", *CLI_RUN, "--checkpoint-dir", str(target), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from checkpoint 2" in resumed.stderr
    assert sorted(os.listdir(target)) == ["2", "4"]  # the interrupted save's leftovers are gone
    a, _ = load_arrays(str(directory))
    b, _ = load_arrays(str(target))
    for path in a:
        np.testing.assert_array_equal(a[path], b[path], err_msg=path)
