"""Multi-host on one machine: jobs of 2 jax.distributed processes (4 simulated CPU devices each,
gloo collectives) started by ``jaxpar launch``, against the same job in this one process."""
import dataclasses
import json
import os
import pickle
import re
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxpar import cli, corpus, launch
from jaxpar.errors import JaxparError
from jaxpar.topology import load_topology
from jaxpar.train.checkpoint import CheckpointConfig, Checkpointer, flat_arrays, load_arrays
from jaxpar.train.placement import BatchPlacement
from jaxpar.run import RunConfig, build_trainer, open_data, run_training
from conftest import trimmed_copy
from tests.jobs.record_rows import recording
from tests.test_corpus import assert_each_prediction_once_an_epoch, text_of

pytestmark = pytest.mark.multiprocess

STEPS = 6
RUN = RunConfig(model="tiny", strategy="fsdp=8", steps=STEPS, batch_size=8, seq_len=32, seed=0)
TRAIN = ["jaxpar", "train", "--strategy", "fsdp=8", "--steps", str(STEPS), "--batch-size", "8", "--seq-len", "32", "--checkpoint-every", "2"]
JOBS = os.path.join(os.path.dirname(__file__), "jobs")
EXAMPLES = os.path.join(os.path.dirname(__file__), os.pardir, "examples")


class Job:
    """``jaxpar launch`` (or ``argv``, a script that runs it) in a subprocess, its output lines
    timestamped as they arrive."""

    def __init__(self, launch_args, command, status_dir, argv=None):
        self.status_dir = str(status_dir)
        argv = argv or [sys.executable, "-m", "jaxpar.cli", "launch", "--status-dir", self.status_dir, *launch_args, "--", *command]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.time(), line))

    def wait(self, timeout=600):
        code = self.proc.wait(timeout=timeout)
        self.reader.join(timeout=10)
        return code

    def output(self):
        return "".join(line for _, line in self.lines)

    def first(self, text):
        return next(t for t, line in self.lines if text in line)

    def progress(self, rank):
        return launch.read_progress(self.status_dir, rank)

    def wait_for_step(self, rank, step, timeout=300):
        deadline = time.time() + timeout
        while time.time() < deadline:
            report = self.progress(rank)
            if report and report["step"] >= step:
                return report
            assert self.proc.poll() is None, self.output()[-3000:]
            time.sleep(0.02)
        raise AssertionError(f"process {rank} never reached step {step}:\n{self.output()[-3000:]}")


def _assert_bitwise_equal(dir_a, dir_b, step=None):
    a, meta_a = load_arrays(str(dir_a), step)
    b, meta_b = load_arrays(str(dir_b), step)
    assert meta_a["step"] == meta_b["step"] and set(a) == set(b)
    for path in a:
        np.testing.assert_array_equal(a[path], b[path], err_msg=path)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """The reference 2-process job: fsdp=8 over 2 x 4 devices, checkpoints at 2, 4 and 6."""
    root = tmp_path_factory.mktemp("two")
    job = Job(["--processes", "2", "--devices-per-process", "4"],
              TRAIN + ["--checkpoint-dir", str(root / "ckpt"), "--metrics-json", str(root / "metrics.json")], root / "status")
    assert job.wait() == 0, job.output()[-3000:]
    return root, json.loads((root / "metrics.json").read_text())


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    directory = tmp_path_factory.mktemp("one") / "ckpt"
    report = run_training(RUN, load_topology("cpu-8"), progress=None, checkpoint=CheckpointConfig(str(directory), every=2))
    return directory, report


@pytest.mark.slow
def test_two_processes_train_like_one(two_processes, one_process):
    (root, report), (one_dir, one) = two_processes, one_process
    assert report["processes"] == 2 and one["processes"] == 1 and report["mesh"]["fsdp"] == 8
    # fp32; only the order of the cross-process sums differs (gloo vs in-process): measured ~1e-7
    np.testing.assert_allclose(report["losses"], one["losses"], rtol=1e-5)
    assert report["held_out_loss"] == pytest.approx(one["held_out_loss"], rel=1e-5)
    a, _ = load_arrays(str(root / "ckpt"))
    b, _ = load_arrays(str(one_dir))
    for path in a:
        np.testing.assert_allclose(a[path], b[path], rtol=1e-4, atol=1e-6, err_msg=path)
    # the same collectives, at the optimum, whichever process count runs them
    for kind in ("all-gather", "reduce-scatter"):
        assert report["communication"][kind]["ratio"] == pytest.approx(1.0, abs=0.02)


@pytest.mark.slow
@pytest.mark.parametrize("strategy, topology", [("data=2,tensor=4", "cpu-8"), ("fsdp=4", "cpu-4")])
def test_two_process_checkpoint_restores_in_one_process(two_processes, strategy, topology):
    root, _ = two_processes
    expected, _ = load_arrays(str(root / "ckpt"))
    trainer, _, _ = build_trainer(RunConfig(strategy=strategy), load_topology(topology))
    state, meta = Checkpointer.existing(CheckpointConfig(str(root / "ckpt"))).restore(trainer.abstract_state())
    assert meta["processes"] == 2
    for path, array in flat_arrays(state).items():
        np.testing.assert_array_equal(np.asarray(array), expected[path], err_msg=path)


def test_one_process_checkpoint_restores_in_two_processes_under_tp(one_process, tmp_path):
    """1 process, fsdp=8 -> 2 processes, data=2,tensor=4: restored, saved again, compared."""
    source, _ = one_process
    job = Job(["--processes", "2", "--devices-per-process", "4"],
              [sys.executable, os.path.join(JOBS, "restore_and_save.py"), str(source), str(tmp_path / "out"), "data=2,tensor=4", "cpu-8"],
              tmp_path / "status")
    assert job.wait() == 0, job.output()[-3000:]
    _assert_bitwise_equal(source, tmp_path / "out")
    assert load_arrays(str(tmp_path / "out"))[1]["strategy"] == "data=2,tensor=4"


@pytest.mark.slow
def test_killed_process_is_noticed_and_the_job_restarts_to_the_same_parameters(two_processes, tmp_path):
    # examples/survive_a_failure.py at this file's sizes (so it runs here rather than in
    # test_examples): it SIGKILLs process 1 of the fsdp=8 job once checkpoint 2 is complete, checks
    # that the job resumes from a checkpoint, and trains on in one process under data=2,tensor=2
    root, _ = two_processes
    script = [sys.executable, os.path.join(EXAMPLES, "survive_a_failure.py"), str(tmp_path), "--steps", str(STEPS),
              "--checkpoint-every", "2", "--kill-at", "3", "--more-steps", "2", "--batch-size", "8", "--seq-len", "32"]
    job = Job(None, None, tmp_path / "status", argv=script)
    assert job.wait() == 0, job.output()[-3000:]
    out = job.output()
    victim = re.search(r"killing process 1 \(pid (\d+)\)", out).group(1)
    assert f"process 1 (pid {victim}) was killed by SIGKILL" in out
    noticed = job.first("was killed by SIGKILL") - job.first("*** killing process 1")
    print(f"launcher noticed the SIGKILL after {noticed:.2f} s")
    assert noticed < 10.0  # the launcher polls every 0.2 s; bound stated in launch.py and BUILD.md
    assert "restart 1 of 1" in out
    assert re.search(r"resuming from checkpoint [24] in", out)
    assert "the job restarted from checkpoint" in out  # the example's own check passed
    _assert_bitwise_equal(root / "ckpt", tmp_path / "ckpt", step=STEPS)  # the job's end, bitwise on CPU


@pytest.mark.slow
def test_hung_process_is_named_and_the_job_stopped(tmp_path):
    # process 1 hangs reading step 2's batch: between "done" of step 1 and "start" of step 2 no
    # checkpoint is saved (every 2 steps), so nothing but the hang can hold a process past 5 s
    job = Job(["--processes", "2", "--devices-per-process", "4", "--hang-timeout", "5"],
              [sys.executable, os.path.join(JOBS, "hang_in_data.py"), "2", *TRAIN[1:], "--checkpoint-dir", str(tmp_path / "ckpt")],
              tmp_path / "status")
    job.wait_for_step(0, 2)
    stuck_at = time.time()
    assert job.wait() == 1  # a failed job
    out = job.output()
    pid = job.progress(1)["pid"]
    assert f"process 1 (pid {pid}) looks hung (last reported done of step 1); the others wait for it" in out
    assert "no restarts left" in out
    noticed = job.first("looks hung") - stuck_at
    print(f"launcher named the hung process {noticed:.1f} s after the others blocked (--hang-timeout 5)")
    assert noticed < 5 + 10


def test_unreachable_coordinator_times_out_with_a_message():
    port = launch._free_port()  # nobody listens there
    started = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "jaxpar.cli", "train", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
         "--process-id", "1", "--init-timeout", "3"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert f"coordinator 127.0.0.1:{port} could not be reached within 3 s" in proc.stderr
    assert time.time() - started < 60


def test_launcher_names_a_failing_process_and_restarts(tmp_path, capsys):
    fail_once = (
        "import os, sys; flag = os.path.join(sys.argv[1], 'failed-once'); "
        "first = not os.path.exists(flag); "
        "os.environ['JAXPAR_PROCESS_ID'] == '1' and first and (open(flag, 'w').close(), sys.exit(3)); "
        "print('resume=' + os.environ.get('JAXPAR_RESUME', 'none'))"
    )
    code = cli.main(["launch", "--processes", "2", "--max-restarts", "1", "--status-dir", str(tmp_path / "s"), "--",
                     sys.executable, "-c", fail_once, str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "process 1 (pid" in out and "exited with status 3; stopping the job" in out
    assert "restart 1 of 1" in out and out.count("resume=auto") == 2
    keep = tmp_path / "t" / "notes.txt"  # a status directory's other files are never touched
    keep.parent.mkdir()
    keep.write_text("mine")
    with pytest.raises(JaxparError, match=r"process 0 \(pid \d+\) exited with status 4; no restarts left"):
        launch.launch([sys.executable, "-c", "import sys; sys.exit(4)"], launch.LaunchConfig(processes=1, status_dir=str(keep.parent)))
    assert keep.read_text() == "mine"


@pytest.mark.parametrize(
    "environ, cluster",
    [
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16"}, "slurm"),
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}, None),
        ({"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "4"}, "openmpi"),
        ({"TPU_WORKER_HOSTNAMES": "t-0,t-1,t-2,t-3"}, "tpu"),
        ({"TPU_WORKER_HOSTNAMES": "t-0"}, None),
        ({}, None),
    ],
)
def test_cluster_detection(environ, cluster):
    assert launch.detect_cluster(environ) == cluster


def test_explicit_process_flags_are_checked(capsys):
    assert cli.main(["train", "--coordinator", "127.0.0.1:1234", "--num-processes", "2"]) == 2
    assert "give all three or none" in capsys.readouterr().err
    assert cli.main(["train", "--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "2"]) == 2
    assert "process id 2 is not in [0, 2)" in capsys.readouterr().err
    assert cli.main(["train", "--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"]) == 2
    assert "is not host:port" in capsys.readouterr().err
    assert cli.main(["train", "--coordinator", "127.0.0.1:1234", "--num-processes", "3", "--process-id", "0"]) == 2
    assert "8 chips do not split evenly over 3 processes" in capsys.readouterr().err


@pytest.mark.slow
def test_a_two_process_job_on_your_data_reads_each_token_once_an_epoch_and_resumes_elsewhere_on_the_same_batches(tmp_path, monkeypatch):
    """``--data`` (text, JSON Lines and Parquet files written here) packed into rows: the 2
    processes of an fsdp=8 job read disjoint halves of every batch, together the batch one process
    reads, and every document's every prediction once an epoch. Resumed from its checkpoint 2 in one
    process under data=2,tensor=4, the run reads the same batches bitwise, and its losses equal
    the job's to 1e-5 (the same sums in another order); resumed again, from that run's checkpoint
    4 under the same layout, it repeats that run's losses bitwise."""
    files = tmp_path / "corpus"
    files.mkdir()
    (files / "notes.txt").write_text("\n\n".join(text_of(i) for i in range(100, 106)))
    (files / "records.jsonl").write_text("".join(json.dumps({"body": text_of(i)}) + "\n" for i in range(106, 118)))
    pq.write_table(pa.table({"body": [text_of(i) for i in range(118, 126)]}), files / "rows.parquet")
    (files / "held.txt").write_text("\n\n".join(text_of(i) for i in range(126, 136)))
    run = RunConfig(model="tiny", strategy="fsdp=8", batch_size=8, seq_len=64, seed=0, packing=True, data_field="body",
                    data=f"{files}/notes.txt,{files}/records.jsonl,{files}/rows.parquet", data_separator="\n\n",
                    eval_data=str(files / "held.txt"))
    train, _ = open_data(run, print)
    reader = corpus.PackedRows(train, run.seq_len, run.batch_size, run.seed)
    epoch = -(-len(reader.rows_of) // run.batch_size)
    run = dataclasses.replace(run, steps=epoch + 2)  # into the second epoch
    argv = ["train", "--strategy", run.strategy, "--steps", str(run.steps), "--batch-size", "8", "--seq-len", "64", "--data", run.data,
            "--data-field", "body", "--data-separator", "\n\n", "--eval-data", run.eval_data, "--packing", "on",
            "--checkpoint-every", "2", "--keep-checkpoints", "9",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--metrics-json", str(tmp_path / "metrics.json")]
    job = Job(["--processes", "2", "--devices-per-process", "4"], [sys.executable, os.path.join(JOBS, "record_rows.py"), str(tmp_path), *argv],
              tmp_path / "status")
    assert job.wait() == 0, job.output()[-3000:]
    losses = json.loads((tmp_path / "metrics.json").read_text())["losses"]
    read = [pickle.loads((tmp_path / f"rows-{p}.pkl").read_bytes()) for p in (0, 1)]
    assert len(read[0]) == len(read[1]) == run.steps + 1  # every step's batch, then the held-out one
    whole = []
    for step in range(run.steps):
        (mine, theirs) = ([(a, b) for a, b, _ in read[p][step]] for p in (0, 1))
        assert mine[0][0] == 0 and mine[-1][1] == theirs[0][0] and theirs[-1][1] == 8  # halves: none twice, none missed
        parts = [rows for p in (0, 1) for _, _, rows in read[p][step]]
        whole.append({key: np.concatenate([part[key] for part in parts]) for key in parts[0]})
        for key, value in reader.rows(step, 0, run.batch_size).items():
            np.testing.assert_array_equal(whole[-1][key], value, err_msg=f"step {step + 1} {key}")
    assert_each_prediction_once_an_epoch(whole[:epoch], reader, train)

    def resume(source, last_step, target):
        trimmed_copy(source, target, last_step)
        seen = []
        monkeypatch.setattr(BatchPlacement, "put_process", recording(seen))
        report = run_training(dataclasses.replace(run, strategy="data=2,tensor=4"), load_topology("cpu-8"), progress=None,
                              checkpoint=CheckpointConfig(str(target), every=2, keep=9), resume="required")
        monkeypatch.undo()
        return report, seen

    moved, seen = resume(tmp_path / "ckpt", 2, tmp_path / "moved")
    assert moved["start_step"] == 2 and moved["processes"] == 1 and len(seen) == run.steps - 2 + 1
    for step, parts in enumerate(seen[:-1], start=2):
        for key in whole[step]:
            np.testing.assert_array_equal(np.concatenate([rows[key] for _, _, rows in parts]), whole[step][key])
    np.testing.assert_allclose(moved["losses"], losses, rtol=1e-5)
    again, _ = resume(tmp_path / "moved", 4, tmp_path / "again")
    assert again["start_step"] == 4 and again["losses"][4:] == moved["losses"][4:]


def test_the_process_named_hung_is_the_one_furthest_behind(tmp_path):
    # the launcher's choice on the reports alone (no processes): step, then phase within the step
    # (a save comes after "done"), then, of equals, the one silent longest
    attempt = object.__new__(launch._Attempt)
    attempt.status_dir, attempt.started = str(tmp_path), 0.0
    attempt.procs = [types.SimpleNamespace(pid=100 + r) for r in range(3)]

    def named(*reports):
        for rank, (phase, step, at) in enumerate(reports):
            (tmp_path / f"process-{rank}.json").write_text(json.dumps({"phase": phase, "step": step, "pid": 100 + rank, "time": at}))
        return int(re.search(r"process (\d+) \(pid", attempt._describe_hang(5.0)).group(1))

    assert named(("start", 3, 9.0), ("saving", 2, 8.0), ("start", 3, 7.0)) == 1
    assert named(("saving", 2, 9.0), ("done", 2, 8.0), ("start", 3, 7.0)) == 1
    assert named(("done", 2, 9.0), ("done", 2, 8.0), ("done", 2, 8.5)) == 1
    assert named(("evaluating", 6, 9.0), ("done", 6, 9.5), ("saving", 6, 8.0)) == 1
