"""SIGINT and SIGTERM at any moment of `jaxpar train` (importing, setting up, compiling, stepping,
saving) end it with 130 / 143, never a crash, and leave nothing half-written: the checkpoint
directory holds complete, verified checkpoints only and the metrics file is absent or whole JSON.

The step's shapes are this file's own, so that the persistent compilation cache the suite shares
holds no program for them: the early moments fall in a real compile (where an exception used to
unwind Python while XLA compiled on a thread of its own: status 139)."""
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from jaxpar.train.checkpoint import LOCK_NAME, load_arrays

MOMENTS_S = (1, 3, 6, 10)  # after start: importing jax, setting up or compiling, compiling, stepping
STEPPING_FROM_S = 10  # from this moment on, the signal waits for the first step too (a cold compile may take longer)
STATUS = {"SIGINT": 130, "SIGTERM": 143}
STEPS = 1000  # never reached: every run is stopped
TRAIN = ["-m", "jaxpar.cli", "train", "--model", "tiny", "--strategy", "fsdp=8", "--steps", str(STEPS), "--batch-size", "8",
         "--seq-len", "48", "--checkpoint-every", "3", "--checkpoint-dir", "ck", "--metrics-json", "metrics.json"]
STOPPED_AT_A_STEP = re.compile(rf"jaxpar train: interrupted by (SIG\w+) after step (\d+) of {STEPS}; checkpoint \2 saved in .*; "
                               "resume with --resume")


def _signalled_pair(moment_s: float, root) -> list[tuple[str, object, int, str]]:
    """Start two runs, send one SIGINT and the other SIGTERM ``moment_s`` after its start (from
    ``STEPPING_FROM_S`` on, once its first step has started too): (signal, its run's directory, exit
    status, stderr) of each."""
    runs = []
    for name in STATUS:
        cwd = root / f"{name}-{moment_s}s"
        cwd.mkdir()
        env = dict(os.environ, JAXPAR_STATUS_DIR=str(cwd / "status"))  # where the run reports its steps (launch.report_progress)
        (cwd / "status").mkdir()
        with _as_a_terminal_starts_it():
            job = subprocess.Popen([sys.executable, *TRAIN], cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   text=True)
        runs.append((name, cwd, job, time.monotonic()))
    for name, cwd, job, started in runs:
        time.sleep(max(0.0, started + moment_s - time.monotonic()))
        while moment_s >= STEPPING_FROM_S and job.poll() is None and not os.listdir(cwd / "status"):
            time.sleep(0.05)
        job.send_signal(getattr(signal, name))
    return [(name, cwd, _wait(job), job.stderr.read()) for name, cwd, job, _ in runs]


@contextlib.contextmanager
def _as_a_terminal_starts_it():
    """While a run starts: SIGINT and SIGTERM at their default dispositions, which the run inherits,
    as a shell starts a foreground command (jaxpar keeps a signal its parent ignores ignored, the
    shell's convention for background jobs). Once, under the whole suite, a run started here trained
    on after a SIGINT at 1 s while its twin ended on SIGTERM, the asymmetry an ignored SIGINT
    inherited from the test process makes (not reproduced alone, 20 tries). Set here in the test
    process around the start, not in the child before exec: forking a JAX process to run Python in
    the child risks a deadlock."""
    previous = {sig: signal.signal(sig, signal.SIG_DFL) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def _wait(job, limit_s: float = 90) -> int | str:
    """The run's exit status, or "still running" (then killed) when it ignored its signal."""
    try:
        return job.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        job.kill()
        job.wait()
        return f"still running {limit_s:g} s after the signal"


def _check_outputs(name: str, cwd, err: str) -> str:
    """Assert that what the run left is whole; return where the signal found it."""
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    assert set(os.listdir(cwd)) <= {"ck", "metrics.json", "status"}, os.listdir(cwd)  # no temporary file left
    saved = sorted(int(n) for n in os.listdir(cwd / "ck") if n.isdigit()) if (cwd / "ck").exists() else []
    if (cwd / "ck").exists():  # no interrupted save, nothing else
        assert set(os.listdir(cwd / "ck")) == {LOCK_NAME, *map(str, saved)}, os.listdir(cwd / "ck")
    metrics = json.loads((cwd / "metrics.json").read_text()) if (cwd / "metrics.json").exists() else None
    stopped = STOPPED_AT_A_STEP.fullmatch(last)
    if stopped:  # in the training loop: the step finished, saved, reported
        step = int(stopped.group(2))
        assert stopped.group(1) == name and saved[-1] == step
        assert metrics["interrupted"] == name and metrics["last_step"] == step
        _, meta = load_arrays(str(cwd / "ck"))  # read whole and verified
        assert meta["step"] == step
        return f"step {step}"
    assert last == f"jaxpar train: {'interrupted by SIGINT' if name == 'SIGINT' else 'stopped by SIGTERM'}", err[-3000:]
    assert metrics is None or metrics["partial"] is True, metrics  # the report written at start, whole
    assert not saved or load_arrays(str(cwd / "ck"))[1]["step"] == saved[-1]
    return "before the loop"


@pytest.mark.slow
def test_signals_at_any_moment_end_with_130_or_143_and_nothing_half_written(tmp_path):
    began = time.perf_counter()
    found = []
    for moment in MOMENTS_S:  # two runs at a time; the earliest first, while no compile of these shapes is cached
        for name, cwd, status, err in _signalled_pair(moment, tmp_path):
            assert status == STATUS[name], f"{name} at {moment} s: exit status {status}\n{err[-3000:]}"
            found.append(f"{name} at {moment} s: {_check_outputs(name, cwd, err)}")
    print(f"{time.perf_counter() - began:.0f} s; " + "; ".join(found))


DCP = ["-m", "jaxpar.cli", "train", "--dcp", "on", "--steps", str(STEPS), "--batch-size", "2", "--seq-len", "32"]


@pytest.mark.slow
def test_signals_stop_a_dcp_run_at_a_step_boundary(tmp_path):
    """`--dcp on` runs its own loop: a signal there also ends the step in progress, then the run.
    One of the two reads a corpus of the user's (``--data``): 30 documents of 20 bytes each."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": f"document number {i:04d}"}) + "\n" for i in range(30)))
    own = {"SIGINT": [], "SIGTERM": ["--data", str(tmp_path / "docs.jsonl")]}
    runs = {name: subprocess.Popen([sys.executable, *DCP, *own[name]], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True) for name in STATUS}
    first = {}
    for name, job in runs.items():  # once the first step has been logged, mid-run
        first[name] = next((line for line in job.stdout if line.startswith(f"step 1/{STEPS}:")), None)
        assert first[name], job.stderr.read()[-3000:]
        job.send_signal(getattr(signal, name))
    for name, job in runs.items():
        status, out, err = _wait(job), job.stdout.read(), job.stderr.read()
        assert status == STATUS[name], f"{name}: exit status {status}\n{err[-3000:]}"
        stopped = re.fullmatch(rf"jaxpar train: interrupted by {name} after step (\d+) of {STEPS} \(--dcp on keeps no checkpoint\)",
                               err.strip().splitlines()[-1])
        assert stopped, err[-3000:]
        if own[name]:  # its batches are the user's documents (20 bytes: 20 tokens each)
            assert ", 2 documents of 20-20 tokens," in first[name], first[name]
        logged = [int(m) for m in re.findall(rf"^step (\d+)/{STEPS}:", out, flags=re.M)] or [1]
        assert int(stopped.group(1)) == max(logged)  # the last step logged is the one it stopped after
