"""Decoupled learners (``jaxpar launch --learners M --quorum K``, ``jaxpar/decoupled.py``): M learner
processes and a syncer around the launcher's key-value store. With K = M, delayed merges and a
learner killed mid-round, the job finishes, the learner restarted from the newest merged model (and
its own optimizer state) catches up, and the merged model equals the synchronous federated run's
bitwise; every merge is a token-weighted mean of verified learner checkpoints. A slow learner's late
reports are dropped end to end. The syncer's quorum and grace window, and the dropping of late
reports, also on a store whose reports arrive when the test says."""
import dataclasses
import json
import time

import numpy as np
import pytest

from jaxpar import cli, decoupled, federate, launch
from jaxpar.errors import JaxparError
from jaxpar.run import RunConfig
from jaxpar.topology import load_topology
from jaxpar.train.checkpoint import CheckpointConfig, load_arrays

# the tiny Llama's 4 layers merge 2 at a time, in turn, every 2 steps; each merge reaches the copies a step late
STRATEGY = "federation=2,fsdp=4,local_steps=4,fragments=2,merge_delay=1"
TRAIN = ["jaxpar", "train", "--strategy", STRATEGY, "--steps", "6", "--batch-size", "8",
         "--seq-len", "32", "--keep-checkpoints", "10"]


@pytest.mark.slow  # three processes start JAX and compile: about 50 s
@pytest.mark.multiprocess
def test_a_killed_learner_catches_up_and_the_merges_equal_the_synchronous_run(tmp_path, capsys):
    argv = ["launch", "--learners", "2", "--max-restarts", "1", "--inject-faults", "kill=1@3", "--",
            *TRAIN, "--checkpoint-dir", str(tmp_path / "d"), "--metrics-json", str(tmp_path / "d.json")]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "learner 1: killed at step 3" in out and "learner 1 (pid" in out and "restarting it (restart 1 of 1)" in out
    assert "learner 1: restarted from its checkpoint of round 0" in out  # (rounds end at steps 2, 4 and 6)
    report = json.loads((tmp_path / "d.json").read_text())
    assert [m["included"] for m in report["merges"]] == [[0, 1]] * 3 and report["dropped"] == []
    assert report["useful_tokens"] == report["tokens_planned"] == 6 * 8 * 32

    run = RunConfig(model="tiny", strategy=STRATEGY, steps=6, batch_size=8, seq_len=32)
    federate.train(run, load_topology("cpu-8"), progress=None, checkpoint=CheckpointConfig(str(tmp_path / "s"), every=6))
    synchronous, _ = load_arrays(str(tmp_path / "s"))
    previous, _ = load_arrays(str(tmp_path / "d" / "merged"), 0)
    for step in (2, 4, 6):  # each merge: its fragment the mean of the learners' verified checkpoints, the rest as it was
        merged, _ = load_arrays(str(tmp_path / "d" / "merged"), step)
        copies = [load_arrays(str(tmp_path / "d" / f"learner-{i}"), step)[0] for i in range(2)]
        layers = {2: slice(0, 2), 4: slice(2, 4), 6: slice(None)}[step]  # fragment 0 holds the weights outside the layers
        for path, value in merged.items():
            mean = 0.5 * copies[0][path] + 0.5 * copies[1][path]
            if "layers" in path:
                np.testing.assert_array_equal(value[layers], mean[layers])
                outside = np.ones(4, bool)
                outside[layers] = False
                np.testing.assert_array_equal(value[outside], previous[path][outside])
            else:
                np.testing.assert_array_equal(value, previous[path] if step == 4 else mean)
        previous = merged
    for path, value in merged.items():  # the delayed merges mixed into the copies as the one-process run mixes them
        np.testing.assert_array_equal(value, synchronous[f"anchor/{path.split('/', 1)[1]}"][0])


@pytest.mark.slow  # three processes start JAX and compile; learner 0 sleeps 1 s a step, learner 1 3 s: about 20 s
@pytest.mark.multiprocess
def test_a_slow_learners_late_reports_are_dropped_and_it_goes_on_from_the_newest_merge(tmp_path, capsys):
    argv = ["launch", "--learners", "2", "--quorum", "1", "--grace", "0", "--inject-faults", "slow=0:1,slow=1:3", "--",
            "jaxpar", "train", "--strategy", "federation=2,fsdp=4,local_steps=1", "--steps", "4", "--batch-size", "8",
            "--seq-len", "32", "--keep-checkpoints", "10",
            "--checkpoint-dir", str(tmp_path / "d"), "--metrics-json", str(tmp_path / "d.json")]
    assert cli.main(argv) == 0  # the slow learner too ends when the last merge is announced
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "d.json").read_text())
    assert [m["included"] for m in report["merges"]] == [[0]] * 4  # each merged at the quorum, without the slow one
    assert report["dropped"] and [0, 1] in report["dropped"] and {learner for _, learner in report["dropped"]} == {1}
    assert "dropped late reports [[0, 1]]" in out
    assert "learner 1: its report of round 0 was not merged: goes on from the merged model at step" in out
    for step in range(1, 5):  # a merge of one report is that learner's verified checkpoint
        merged, _ = load_arrays(str(tmp_path / "d" / "merged"), step)
        fast, _ = load_arrays(str(tmp_path / "d" / "learner-0"), step)
        for path, value in merged.items():
            np.testing.assert_array_equal(value, fast[path])
    assert report["useful_tokens"] == 4 * 4 * 32  # the fast learner's half of every batch


class Store:
    """The syncer's view of the key-value store, with reports that arrive at the times given."""

    def __init__(self, arrivals: dict):
        self.arrivals, self.start = arrivals, time.time()  # {(round, learner): seconds after start}

    def reports(self, round_: int) -> dict:
        now = time.time() - self.start
        return {learner: {"tokens": 10, "step": 2} for (r, learner), at in self.arrivals.items() if r == round_ and at <= now}

    def all_reports(self) -> set:
        return {key for key, at in self.arrivals.items() if at <= time.time() - self.start}


def test_a_merge_waits_for_the_quorum_then_the_grace_window_and_late_reports_are_dropped():
    store = Store({(0, 0): 0.0, (0, 1): 0.3, (0, 2): 5.0})
    assert set(decoupled._gather(store, 0, learners=3, quorum=2, grace=0.0)) == {0, 1}  # at the quorum, nobody more
    store.start = time.time()
    assert set(decoupled._gather(store, 0, learners=3, quorum=1, grace=0.5)) == {0, 1}  # the grace window lets 1 in
    store.start = time.time() - 10
    assert set(decoupled._gather(store, 0, learners=3, quorum=3, grace=0.0)) == {0, 1, 2}
    history = {"merges": [{"round": 1, "record": {"included": [0, 1], "dropped": []}}]}
    assert decoupled._late(store, 1, history) == [[0, 2]]  # round 0's report of learner 2 came after its merge
    history["merges"].append({"round": 2, "record": {"included": [0, 1, 2], "dropped": [[0, 2]]}})
    assert decoupled._late(store, 2, history) == []  # recorded once
    store.arrivals[1, 2] = 0.0  # rounds behind: merged three times without it meanwhile
    history["merges"] = [{"round": r, "record": {"included": [0, 1], "dropped": []}} for r in (1, 2, 3, 4)]
    assert decoupled._late(store, 4, history) == [[0, 2], [1, 2]]


@pytest.mark.parametrize("argv, message", [
    (["--learners", "2", "--quorum", "3"], "--quorum 3 must be between 1 and the 2 learners"),
    (["--learners", "2", "--inject-faults", "kill=1"], "--inject-faults 'kill=1': write kill=LEARNER@STEP"),
    (["--learners", "2", "--inject-faults", "slow=2:1"], "names learner 2, but the learners are 0 to 1"),
    (["--quorum", "1"], "--quorum, --grace and --inject-faults are for decoupled learners"),
])
def test_bad_launch_options_are_refused_in_words_before_any_process_starts(argv, message, capsys):
    assert cli.main(["launch", *argv, "--", *TRAIN]) == cli.EXIT_BAD_INPUT
    assert message in capsys.readouterr().err


def test_a_learner_refuses_a_run_that_is_not_its_federation(monkeypatch):
    monkeypatch.setenv(launch.ENV_LEARNERS, "4")
    run = RunConfig(model="tiny", strategy="federation=2,fsdp=4", steps=4, batch_size=8)
    with pytest.raises(JaxparError, match="--learners 4 runs federation=4, but --strategy federation=2,fsdp=4 has federation=2"):
        decoupled.job_of(run, load_topology("cpu-8"), CheckpointConfig("x"))
    with pytest.raises(JaxparError, match="give --checkpoint-dir"):
        decoupled.job_of(run, load_topology("cpu-8"), None)


def test_a_new_job_refuses_old_merges_and_a_restart_refuses_another_jobs_checkpoints(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(launch.ENV_LEARNERS, "2")
    monkeypatch.setenv(launch.ENV_ROLE, "syncer")
    (tmp_path / "merged" / "0").mkdir(parents=True)
    run = RunConfig(model="tiny", strategy="federation=2,fsdp=4", steps=4, batch_size=8)
    with pytest.raises(JaxparError, match="merged already holds merges; pass --resume"):
        decoupled.job_of(run, load_topology("cpu-8"), CheckpointConfig(str(tmp_path)))
    job = decoupled.job_of(run, load_topology("cpu-8"), CheckpointConfig(str(tmp_path)), resume="auto")
    check = decoupled._same_job(job, "DIR")
    check({"job": dict(job.identity)})
    with pytest.raises(JaxparError, match="checkpoint in DIR is of .*'steps': 8.*, not of this job"):
        check({"job": dict(job.identity, steps=8)})
    assert cli.main([*TRAIN[1:], "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "2"]) == cli.EXIT_BAD_INPUT
    assert "--checkpoint-every 2: decoupled learners and their syncer save at every round's end" in capsys.readouterr().err


def test_the_last_merge_leaves_out_the_fragments_whose_delayed_merge_has_not_reached_the_copies(monkeypatch):
    monkeypatch.setenv(launch.ENV_LEARNERS, "2")  # fragment 0 merges at step 3, fragment 1 at 6, reaching the copies 2 steps on
    run = RunConfig(model="tiny", strategy="federation=2,fsdp=4,local_steps=6,fragments=2,merge_delay=2", steps=7, batch_size=8)
    job = decoupled.job_of(run, load_topology("cpu-8"), CheckpointConfig("x"))
    assert job.ends == ((3, 0), (6, 1), (7, None))
    assert [job.merged_fragments(r) for r in range(3)] == [(0,), (1,), (0,)]  # as FederatedTrainer.merge_all at the end
    assert decoupled.job_of(dataclasses.replace(run, steps=9), load_topology("cpu-8"), CheckpointConfig("x")).merged_fragments(2) == (0, 1)
