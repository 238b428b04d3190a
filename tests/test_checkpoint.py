"""Checkpoints: saved under one layout, restored bit for bit under others; resumed runs equal
uninterrupted ones; bad input is refused before any device memory is touched; an interrupted
save is never picked up."""
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import cli
from jaxpar import run as loop

from jaxpar.errors import JaxparError
from jaxpar.models import llama
from jaxpar.topology import load_topology
from jaxpar.train.checkpoint import (
    LOCK_NAME, CheckpointConfig, CheckpointLocked, Checkpointer, CheckpointWriteFailed, block_checksums, flat_arrays,
    list_checkpoints, load_arrays,
)
from jaxpar.run import RunConfig, build_trainer, run_training
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


class _Lines:
    """A progress stream that keeps the lines a run prints."""

    def __init__(self, lines):
        self.lines = lines

    def write(self, text):
        self.lines.extend(filter(None, text.splitlines()))

    def flush(self):
        pass


def damage(step_dir, how):
    """Damage a checkpoint on disk the ways disks and people do."""
    arrays = sorted(step_dir.glob("state/ocdbt.process_*/d/*"), key=lambda p: p.stat().st_size)
    largest, meta = arrays[-1], step_dir / "meta" / "metadata"
    if how in ("invert", "bit"):
        # the bytes of the largest array changed where the store cannot see it (its files are
        # compressed, and damage to them is mostly refused as unreadable, the "truncate" case):
        # the arrays written again as they are, one of them altered; jaxpar's checksums remain
        reader = ocp.PyTreeCheckpointer()
        state_dir = (step_dir / "state").resolve()
        as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), reader.metadata(state_dir).item_metadata.tree)
        tree = reader.restore(state_dir, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
        leaves, treedef = jax.tree.flatten(tree)
        target = max(range(len(leaves)), key=lambda i: leaves[i].size)
        data = leaves[target].copy().view(np.uint8).reshape(-1)
        middle = data.size // 2
        data[middle:middle + (64 if how == "invert" else 1)] ^= 0xFF if how == "invert" else 0x08
        leaves[target] = data.view(leaves[target].dtype).reshape(leaves[target].shape)
        shutil.rmtree(state_dir)
        reader.save(state_dir, jax.tree.unflatten(treedef, leaves))
    elif how == "truncate":
        os.truncate(largest, largest.stat().st_size // 2)
    elif how == "delete-meta":
        meta.unlink()
    elif how == "cut-meta":
        os.truncate(meta, meta.stat().st_size // 2)
    else:
        raise ValueError(how)


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


def test_four_device_checkpoint_restores_on_eight(tmp_path):
    # a state laid out on 4 devices, saved as a run saves it (no step needed: the layout is the point)
    directory = tmp_path / "four"
    four, _, _ = build_trainer(dataclasses.replace(RUN, strategy="fsdp=2,tensor=2"), load_topology("cpu-4"))
    ckpt = Checkpointer(CheckpointConfig(str(directory)))
    ckpt.save(1, four.init(seed=1), {"devices": four.layout.mesh.size})
    ckpt.close()
    expected, meta = load_arrays(str(directory))
    assert meta["devices"] == 4
    trainer, _, _ = build_trainer(RUN, load_topology("cpu-8"))
    state, _ = Checkpointer.existing(CheckpointConfig(str(directory))).restore(trainer.abstract_state())
    for path, array in flat_arrays(state).items():
        assert len(array.sharding.device_set) == 8
        np.testing.assert_array_equal(np.asarray(array), expected[path], err_msg=path)


def test_resume_past_a_damaged_checkpoint_equals_uninterrupted(saved, tmp_path):
    """64 bytes inverted in the latest checkpoint: --resume names it, continues from the previous
    one and ends bitwise where the uninterrupted run ended."""
    directory, report = saved
    expected, _ = load_arrays(str(directory))
    copy = tmp_path / "resume"
    shutil.copytree(directory, copy)
    damage(copy / "4", "invert")
    messages = []
    resumed = run_training(RUN, load_topology("cpu-8"), progress=_Lines(messages), checkpoint=CheckpointConfig(str(copy), every=2), resume="required")
    assert any("checkpoint 4: array " in m and "fails its checksum" in m for m in messages), messages
    assert resumed["start_step"] == 2 and resumed["losses"] == report["losses"]  # the job's every step, the first two from the checkpoint
    assert sorted(os.listdir(copy)) == ["2", "4", "4.damaged", LOCK_NAME]  # the damaged copy is kept, aside
    got, _ = load_arrays(str(copy))
    for path in expected:
        np.testing.assert_array_equal(got[path], expected[path], err_msg=path)


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
    assert sorted(os.listdir(target)) == ["2", "4.orbax-checkpoint-tmp", LOCK_NAME]
    assert Checkpointer(CheckpointConfig(str(target)), create=False, writer=False).latest_step() == 2  # a reader: no lock
    resumed = _cli("-m", "jaxpar.cli", *CLI_RUN, "--checkpoint-dir", str(target), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from checkpoint 2" in resumed.stderr
    assert sorted(os.listdir(target)) == ["2", "4", LOCK_NAME]  # the interrupted save's leftovers are gone
    a, _ = load_arrays(str(directory))
    b, _ = load_arrays(str(target))
    for path in a:
        np.testing.assert_array_equal(a[path], b[path], err_msg=path)


@pytest.fixture(scope="module")
def tiny_trainer():
    trainer, _, _ = build_trainer(RUN, load_topology("cpu-8"))
    return trainer


# a failed read of a damaged checkpoint leaves orbax's per-shard read coroutines to the garbage
# collector, which reports each one (when it runs during the test) as an unraisable exception
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize(
    "how, reason",
    [("invert", "fails its checksum"), ("bit", "fails its checksum"), ("truncate", "arrays cannot be read"),
     ("delete-meta", "metadata cannot be read"), ("cut-meta", "metadata cannot be read")],
)
def test_damaged_latest_is_named_set_aside_and_the_previous_restored(saved, tiny_trainer, tmp_path, how, reason):
    directory, _ = saved
    copy = tmp_path / "run"
    shutil.copytree(directory, copy)
    previous, _ = load_arrays(str(directory), step=2)
    damage(copy / "4", how)
    messages = []
    ckpt = Checkpointer.existing(CheckpointConfig(str(copy)), writer=True)
    state, meta = ckpt.restore_newest_verified(tiny_trainer.abstract_state(), messages.append)
    ckpt.close()
    assert meta["step"] == 2
    assert messages[0].startswith("checkpoint 4: ") and reason in messages[0], messages
    if how in ("invert", "bit"):  # names the array and shard, e.g. "array opt_state/0/nu/layers/w_gate shard 4"
        assert re.search(r"array (params|opt_state)/\S+ shard \d+ fails", messages[0]), messages[0]
    for path, array in flat_arrays(state).items():
        np.testing.assert_array_equal(np.asarray(array), previous[path], err_msg=path)
    assert sorted(os.listdir(copy)) == ["2", "4.damaged", LOCK_NAME]


def test_every_checkpoint_damaged_is_refused_in_words(saved, tmp_path, capsys):
    directory, _ = saved
    copy = tmp_path / "run"
    shutil.copytree(directory, copy)
    damage(copy / "2", "bit")
    damage(copy / "4", "cut-meta")
    code = cli.main([*CLI_RUN, "--checkpoint-dir", str(copy), "--resume"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "no checkpoint in" in err and "checkpoint 2: array" in err and "checkpoint 4: its metadata" in err
    assert "Traceback" not in err
    assert sorted(os.listdir(copy)) == ["2", "4", LOCK_NAME]  # nothing moved or deleted when nothing passes


def _small_state(value):
    mesh = jax.make_mesh((8,), ("x",))
    w = jax.random.normal(jax.random.key(value), (256, 256))
    return {"w": jax.device_put(w, NamedSharding(mesh, P("x"))), "step": jax.device_put(jnp.int32(value), NamedSharding(mesh, P()))}


def test_keep_last_n_never_deletes_the_last_verified_checkpoint(tmp_path):
    ckpt = Checkpointer(CheckpointConfig(str(tmp_path / "run"), keep=1))
    ckpt.save(1, _small_state(1), {})
    ckpt.wait()
    ckpt.restore(ckpt._abstract, 1)  # read back: verified
    ckpt.save(2, _small_state(2), {})
    ckpt.manager.wait_until_finished()  # written, not yet pruned
    damage(tmp_path / "run" / "2", "bit")
    ckpt.wait()  # keep=1 would delete 1, but 2 fails when read back
    assert ckpt.steps() == [1, 2] and ckpt.verified == {1}
    ckpt.save(3, _small_state(3), {})
    ckpt.wait()  # 3 reads back intact: now 1 and 2 may go
    assert ckpt.steps() == [3] and ckpt.verified == {1, 3}
    ckpt.close()


def test_checksums_are_the_same_under_every_layout_and_see_one_bit(tmp_path):
    x = jax.random.normal(jax.random.key(0), (8, 12, 16))
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    grid = (2, 4, 1)
    layouts = [P(), P("a", "b"), P("b", None, "a"), P(None, None, ("a", "b"))]
    sums = [np.asarray(jax.jit(block_checksums, static_argnums=1)(jax.device_put(x, NamedSharding(mesh, spec)), grid)) for spec in layouts]
    for other in sums[1:]:
        np.testing.assert_array_equal(other, sums[0])
    bits = np.asarray(x).view(np.uint32).copy()
    for index in [(0, 0, 0), (7, 11, 15), (3, 5, 9)]:
        for bit in (0, 17, 31):
            flipped = bits.copy()
            flipped[index] ^= np.uint32(1 << bit)
            changed = np.asarray(block_checksums(jnp.asarray(flipped.view(np.float32)), grid))
            block = (index[0] // 4) * 4 + index[1] // 3
            assert (changed[block] != sums[0][block]).all(), (index, bit)  # both sums of that block change
            assert (np.delete(changed, block, 0) == np.delete(sums[0], block, 0)).all()  # and no other


def _mount_tmpfs(path, size):
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]).returncode:
        pytest.skip("mounting a small tmpfs needs root")


@pytest.mark.parametrize("found", ["before writing", "while writing"])
def test_a_full_disk_is_one_message_and_the_previous_checkpoint_stays_usable(tmp_path, monkeypatch, found, capfd):
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "600k")  # room for two checkpoints of _small_state (256 KiB of arrays each), not three
    try:
        if found == "while writing":  # let orbax find it in its background threads
            monkeypatch.setattr(Checkpointer, "_check_space", lambda *args: None)
        ckpt = Checkpointer(CheckpointConfig(str(disk / "run"), keep=3))
        try:
            ckpt.save(1, _small_state(1), {})
            ckpt.wait()
            with pytest.raises(CheckpointWriteFailed, match=r"checkpoint \d could not be written .*: the disk is full.*; checkpoint \d is intact") as err:
                for step in (2, 3, 4):
                    ckpt.save(step, _small_state(step), {})
                    ckpt.wait()
        finally:
            ckpt.close()
        assert "\n" not in str(err.value)
        assert "Traceback" not in capfd.readouterr().err
        rows = list_checkpoints(str(disk / "run"))
        intact = re.search(r"checkpoint (\d) is intact", str(err.value)).group(1)
        complete = [r for r in rows if r["name"].isdigit()]
        assert complete[-1]["name"] == intact and all(r["status"] == "verified" for r in complete), rows
    finally:
        subprocess.run(["umount", str(disk)])


def test_a_second_writer_is_refused_at_once_and_a_dead_writers_lock_is_not(tmp_path):
    directory = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from jaxpar.train.checkpoint import *; "
         f"c = Checkpointer(CheckpointConfig({str(directory)!r})); print('locked', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ, XLA_FLAGS=""),
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        began = time.perf_counter()
        with pytest.raises(CheckpointLocked, match=f"in use by pid {holder.pid} on host ") as err:
            Checkpointer(CheckpointConfig(str(directory)))
        assert time.perf_counter() - began < 1 and "choose another --checkpoint-dir" in str(err.value)
        code = cli.main([*CLI_RUN, "--checkpoint-dir", str(directory)])
        assert code == 2 and os.listdir(directory) == [LOCK_NAME]  # refused before anything was written
    finally:
        holder.kill()
        holder.wait()
    Checkpointer(CheckpointConfig(str(directory))).close()  # the kernel dropped the killed holder's lock


def test_checkpoints_command_lists_each_with_its_layout_and_verdict(saved, tmp_path, capsys):
    directory, _ = saved
    copy = tmp_path / "run"
    shutil.copytree(directory, copy)
    assert cli.main(["checkpoints", str(copy)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\n  2 +tiny +fsdp=8 +8  verified\n  4 +tiny +fsdp=8 +8  verified", out), out
    damage(copy / "4", "bit")
    (copy / "6.orbax-checkpoint-tmp").mkdir()
    assert cli.main(["checkpoints", str(copy)]) == 1
    out = capsys.readouterr().out
    assert re.search(r"\n  4 .*damaged: array \S+ shard \d+ fails its checksum", out), out
    assert "6.orbax-checkpoint-tmp" in out and "interrupted save" in out


def _listing(directory):
    return sorted(os.listdir(directory))


@pytest.mark.slow
def test_two_resumes_started_together_one_trains_and_the_other_is_refused_naming_it(saved, tmp_path):
    """The issue's loop: two `--resume` runs on one directory, started together, with other seeds."""
    directory, _ = saved
    target = tmp_path / "run"
    shutil.copytree(directory, target)
    argv = [*CLI_RUN[:4], "8", *CLI_RUN[5:-1], "1", "--keep-checkpoints", "20", "--checkpoint-dir", str(target), "--resume"]
    began = time.perf_counter()
    jobs = {seed: subprocess.Popen([sys.executable, "-m", "jaxpar.cli", *argv, "--seed", str(seed)], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True) for seed in (1, 2)}
    ended = {}
    while len(ended) < 2:
        for seed, job in jobs.items():
            if seed not in ended and job.poll() is not None:
                ended[seed] = (job.returncode, job.stderr.read(), time.perf_counter() - began)
        time.sleep(0.05)
    (loser, (code, err, seconds)), (winner, (won, won_err, _)) = ended.items()  # in the order they ended
    assert code == 2 and won == 0, (ended, won_err[-2000:])
    assert re.fullmatch(f"jaxpar train: checkpoint directory {re.escape(str(target))} is in use by pid {jobs[winner].pid} on host .*"
                        "choose another --checkpoint-dir\n", err), err
    print(f"refused after {seconds:.1f} s")
    assert _listing(target) == ["2", "4", "5", "6", "7", "8", LOCK_NAME]  # no stray *.orbax-checkpoint-tmp
    reader = Checkpointer(CheckpointConfig(str(target)), create=False, writer=False)
    assert {reader.read_meta(step)["data"]["seed"] for step in (5, 6, 7, 8)} == {winner}  # one run's checkpoints only
    reader.close()


@pytest.mark.parametrize("steps", ["4", "3"])  # at the checkpoint's step, below it
def test_a_resume_with_nothing_to_do_says_so_and_deletes_nothing(saved, tmp_path, capsys, steps):
    directory, _ = saved
    copy = tmp_path / "run"
    shutil.copytree(directory, copy)
    listing = _listing(copy)
    argv = [*CLI_RUN[:4], steps, *CLI_RUN[5:], "--checkpoint-dir", str(copy), "--resume", "--keep-checkpoints", "1"]
    assert cli.main(argv) == cli.EXIT_OK
    err = capsys.readouterr().err
    assert err == (f"jaxpar train: nothing to do: checkpoint 4 in {copy} is at step 4, and --steps {steps} asks for no more; "
                   "nothing was trained or deleted: pass --steps above 4 to train on\n")
    assert _listing(copy) == listing  # keep 1 would have deleted checkpoint 2


def _saved_as(directory, model, strategy, **fields):
    """A checkpoint whose meta says it was trained as ``model`` under ``strategy`` (its arrays are
    no model's: what is refused here is refused before any array is read)."""
    ckpt = Checkpointer(CheckpointConfig(str(directory)))
    ckpt.save(4, _small_state(4), {"model": model, "strategy": strategy, "devices": 8, "processes": 1,
                                   "data": {"seed": 0, "batch_size": 8, "seq_len": 32, "next_step": 4}, **fields})
    ckpt.close()


@pytest.mark.parametrize(
    "model, saved, given, message",
    [
        ("bd3lm-tiny", {"block_size": 16, "window": None}, ["--block-size", "8"],
         "was trained with --block-size 16, and this run has --block-size 8: .*; pass --block-size 16 to resume it"),
        ("bd3lm-tiny", {"block_size": 8, "window": None}, [],
         "was trained with --block-size 8, and this run has --block-size 16 \\(the default\\)"),
        ("bd3lm-tiny", {"block_size": 16, "window": None}, ["--window", "32"],
         "was trained with no --window \\(the whole prefix\\), and this run has --window 32: .*; drop --window to resume it"),
        ("bd3lm-tiny", {"block_size": 16, "window": 32}, ["--window", "16"],
         "was trained with --window 32, and this run has --window 16: .*; pass --window 32 to resume it"),
        ("tiny", {"strategy": "data=2,tensor=4,delay=1"}, ["--strategy", "data=2,tensor=4"],
         "was trained under data=2,tensor=4,delay=1 \\(delay=1 over tensor=4\\), and this run's strategy data=2,tensor=4 has no "
         "delay=1: .*; resume with tensor=4,delay=1 in --strategy"),
        ("tiny", {"strategy": "fsdp=4,tensor=2"}, ["--strategy", "fsdp=4,tensor=2,delay=1"],
         "was trained under fsdp=4,tensor=2 \\(no delay=1\\), and this run's strategy fsdp=4,tensor=2,delay=1 has delay=1 over "
         "tensor=2: .*; drop delay=1 from --strategy to resume it"),
        ("tiny", {"strategy": "data=2,tensor=4,delay=1"}, ["--strategy", "fsdp=4,tensor=2,delay=1"],
         "was trained under data=2,tensor=4,delay=1 \\(delay=1 over tensor=4\\), and this run's strategy fsdp=4,tensor=2,delay=1 "
         "has delay=1 over tensor=2: .*; resume with tensor=4,delay=1 in --strategy"),
        ("bd3lm-tiny", {"strategy": "fsdp=8"}, ["--model", "tiny"],
         "holds model bd3lm-tiny, and this run is --model tiny: pass --model bd3lm-tiny to resume it"),
    ],
    ids=["block-size", "block-size-default", "new-window", "other-window", "delay-to-tp", "tp-to-delay", "delay-degree", "model"],
)
def test_resuming_as_another_function_is_refused_before_any_array_is_read(tmp_path, capsys, model, saved, given, message):
    """Same arrays, another function: a BD3-LM's blocks or window, delayed TP on, off or over another degree."""
    directory = tmp_path / "run"
    _saved_as(directory, model, **{"strategy": "fsdp=8", **saved})
    listing, before = _listing(directory), _live_ids()
    argv = [*CLI_RUN, "--model", model, "--checkpoint-dir", str(directory), "--resume", *given]
    began = time.perf_counter()
    assert cli.main(argv) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert re.fullmatch(f"jaxpar train: checkpoint 4 in {re.escape(str(directory))} {message}.*, or choose another --checkpoint-dir to train afresh\n",
                        err), err
    assert _live_ids() <= before and _listing(directory) == listing and time.perf_counter() - began < 20


def _fill(disk):
    """Fill a file system to the last byte."""
    with open(disk / "filler", "ab", buffering=0) as f:
        for size in (1 << 16, 1 << 12, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                pass


def test_a_checkpoint_disk_that_cannot_hold_one_checkpoint_is_refused_at_start(tmp_path):
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "1m")  # a checkpoint of the tiny Llama's state takes about 10 MiB
    try:
        before = _live_ids()
        with pytest.raises(JaxparError, match=r"cannot hold one checkpoint of this run \(9\.8 MiB to write, 1\.0 MiB free\); "
                                              "free space there or choose another --checkpoint-dir"):
            run_training(RUN, load_topology("cpu-8"), progress=None, checkpoint=CheckpointConfig(str(disk / "run")))
        assert _live_ids() <= before and _listing(disk / "run") == [LOCK_NAME]
        Checkpointer(CheckpointConfig(str(disk / "run"))).close()  # the refused run let the lock go
    finally:
        subprocess.run(["umount", str(disk)])


def test_metrics_on_a_full_disk_are_refused_at_start_and_a_late_failure_keeps_the_partial_report(tmp_path, monkeypatch, capsys):
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "64k")
    metrics = disk / "metrics.json"
    argv = [*CLI_RUN[:-2], "--metrics-json", str(metrics)]  # no checkpoints
    try:
        _fill(disk)
        before = _live_ids()
        assert cli.main(argv) == cli.EXIT_BAD_INPUT  # found before any work
        err = capsys.readouterr().err
        assert err == (f"jaxpar train: --metrics-json {metrics}: the disk has 0 KiB free, and the output needs about 8 KiB; "
                       "free some space there or choose another path\n")
        assert _live_ids() <= before and _listing(disk) == ["filler"]
        (disk / "filler").unlink()
        # the disk fills up during the run: the partial report written at start stays, whole
        real = loop.run_training
        monkeypatch.setattr(loop, "run_training", lambda *args, on_start, **kw: real(*args, on_start=lambda: (on_start(), _fill(disk)), **kw))
        assert cli.main(argv) == cli.EXIT_FAILED
        assert capsys.readouterr().err.splitlines()[-1] == (f"jaxpar train: could not write {metrics} (No space left on device); "
                                                           "free some space there or choose another path")
        partial = json.loads(metrics.read_text())
        assert partial["partial"] is True and partial["steps"] == 4 and partial["strategy"] == "fsdp=8"
        assert _listing(disk) == ["filler", "metrics.json"]  # no temporary file left behind
    finally:
        subprocess.run(["umount", str(disk)])


def test_a_save_that_fails_for_another_reason_than_space_says_so(tmp_path):
    directory = tmp_path / "run"
    ckpt = Checkpointer(CheckpointConfig(str(directory), async_save=False))
    shutil.rmtree(directory)  # replaced under the run by a file, e.g. by another program
    directory.write_text("")
    with pytest.raises(CheckpointWriteFailed) as err:
        ckpt.save(1, _small_state(1), {})
    ckpt.close()
    assert "free space" not in str(err.value) and "check that nothing else writes to or deletes from it" in str(err.value), err.value
