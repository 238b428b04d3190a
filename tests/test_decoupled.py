"""Decoupled learners (``jaxpar launch --learners M --quorum K``, ``jaxpar/decoupled.py``): M learner
processes and a syncer around the launcher's key-value store. With K = M and a learner killed
mid-round, the job finishes, the learner restarted from the newest merged model (and its own
optimizer state) catches up, and the merged model equals the synchronous federated run's bitwise;
every merge is a token-weighted mean of verified learner checkpoints. The syncer's quorum and grace
window, and the dropping of late reports, on a store whose reports arrive when the test says."""
import json
import time

import numpy as np
import pytest

from jaxpar import cli, decoupled, federate, launch
from jaxpar.errors import JaxparError
from jaxpar.run import RunConfig
from jaxpar.topology import load_topology
from jaxpar.train.checkpoint import CheckpointConfig, load_arrays

STRATEGY = "federation=2,fsdp=4,local_steps=2,fragments=2"  # the tiny Llama's 4 layers merge 2 at a time, in turn
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
    assert "learner 1: restarted from its checkpoint of round 2" in out  # (step 3: rounds end at every step)
    report = json.loads((tmp_path / "d.json").read_text())
    assert [m["included"] for m in report["merges"]] == [[0, 1]] * 6 and report["dropped"] == []
    assert report["useful_tokens"] == report["tokens_planned"] == 6 * 8 * 32

    run = RunConfig(model="tiny", strategy=STRATEGY, steps=6, batch_size=8, seq_len=32)
    federate.train(run, load_topology("cpu-8"), progress=None, checkpoint=CheckpointConfig(str(tmp_path / "s"), every=6))
    synchronous, _ = load_arrays(str(tmp_path / "s"))
    previous, _ = load_arrays(str(tmp_path / "d" / "merged"), 0)
    for step in range(1, 7):  # each merge: its fragment the mean of the learners' verified checkpoints, the rest as it was
        merged, _ = load_arrays(str(tmp_path / "d" / "merged"), step)
        copies = [load_arrays(str(tmp_path / "d" / f"learner-{i}"), step)[0] for i in range(2)]
        layers = slice(None) if step == 6 else slice(0, 2) if step % 2 else slice(2, 4)  # fragment 0 at odd steps
        for path, value in merged.items():
            mean = 0.5 * copies[0][path] + 0.5 * copies[1][path]
            if "layers" in path:
                np.testing.assert_array_equal(value[layers], mean[layers])
                outside = np.ones(4, bool)
                outside[layers] = False
                np.testing.assert_array_equal(value[outside], previous[path][outside])
            else:
                np.testing.assert_array_equal(value, mean if step % 2 or step == 6 else previous[path])
        previous = merged
    for path, value in merged.items():
        np.testing.assert_array_equal(value, synchronous[f"anchor/{path.split('/', 1)[1]}"][0])


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
