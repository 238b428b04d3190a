"""The main job: the loss falls clearly on the shipped corpus, the CLI reports well, and a job
stopped by Ctrl-C resumes to the same losses as one never stopped. (Bad input: test_cli_input.py.)"""
import json
import os
import signal
import subprocess
import sys

import pytest

from jaxpar import cli
from jaxpar.report import step_report
from jaxpar.serve.llama import generate_from_checkpoint
from jaxpar.train.checkpoint import CheckpointConfig
from jaxpar.topology import load_topology
from jaxpar.run import RunConfig, run_training


RUN = RunConfig(model="tiny", strategy="fsdp=4,tensor=2", steps=80, batch_size=16, seq_len=64, seed=0)
TRAIN = ["train", "--strategy", "fsdp=4,tensor=2", "--steps", "80", "--batch-size", "16", "--seq-len", "64", "--seed", "0"]


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("main") / "run")


@pytest.fixture(scope="module")
def report(checkpoint_dir):
    return run_training(RUN, load_topology("cpu-8"), progress=None, analyze=step_report,
                        checkpoint=CheckpointConfig(checkpoint_dir, every=RUN.steps))


def test_loss_falls_clearly(report):
    # bound: byte-level loss starts near ln(256) = 5.5; after 80 steps the mean of the last 10
    # steps must be at least 2 nats lower, and the held-out loss below 3.5 nats
    losses = report["losses"]
    assert losses[0] > 5.0
    assert sum(losses[-10:]) / 10 < losses[0] - 2.0
    assert report["held_out_loss"] < 3.5


def test_report_measures_against_the_formulas(report):
    memory = report["memory"]
    for kind, expected in memory["zero_table_bytes_per_device"].items():
        assert memory["measured_bytes_per_device"][kind] == pytest.approx(expected, rel=0.02)
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        assert report["communication"][kind]["ratio"] == pytest.approx(1.0, abs=0.02)
    assert len(report["step_times_s"]) == report["steps"] == 80
    assert report["tokens_per_s"] > 0
    # Megatron TP: each forward sublayer's all-reduce is waited on by the next (delayed TP: none is)
    assert report["tensor"] == {"delayed": False, "axes": ["tensor"], "all_reduces_per_layer": 2, "blocking_per_layer": 2}


def test_the_checkpoint_continues_text_of_the_corpus_kind(report, checkpoint_dir):
    # the corpus is English prose and Python (train/data.py): after 80 steps greedy decoding already
    # writes printable ASCII with spaces between words, not arbitrary bytes
    outs, _ = generate_from_checkpoint(checkpoint_dir, ["The ", "def "], 48)
    for out in outs:
        text = out.continuation
        printable = sum(c.isascii() and (c.isprintable() or c in "\n\t") for c in text)
        assert printable >= 0.95 * len(text) and " " in text, repr(text)
        assert sum(c.isalpha() for c in text) >= 0.5 * len(text), repr(text)  # letters, as the corpus's words


# `jaxpar train` that waits after step N until its stdin gets a line: the test signals it there, so
# that the step it stops at is known (the signal itself is a real one, from another process)
PAUSE_AFTER = """
import sys
import jaxpar.run as loop
from jaxpar import cli

report = loop.report_progress


def pause_after(phase, step, **kwargs):
    report(phase, step, **kwargs)
    if phase == "done" and step == {step}:
        print("paused after step {step}", file=sys.stderr, flush=True)
        sys.stdin.readline()


loop.report_progress = pause_after
sys.exit(cli.main(sys.argv[1:]))
"""


def test_ctrl_c_stops_at_a_step_saves_and_the_resumed_job_equals_an_uninterrupted_one(report, tmp_path, capsys):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.json"
    argv = [*TRAIN, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "100", "--metrics-json", str(metrics)]
    job = subprocess.Popen([sys.executable, "-c", PAUSE_AFTER.format(step=5), *argv],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in job.stderr:
        lines.append(line)
        if line.startswith("paused after step 5"):
            break
    assert lines and lines[-1].startswith("paused"), "".join(lines)[-3000:]
    job.send_signal(signal.SIGINT)  # Ctrl-C once step 5 is done
    out, err = job.communicate("go on\n", timeout=300)
    assert job.returncode == cli.EXIT_SIGINT, err[-3000:]
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"jaxpar train: interrupted by SIGINT after step 5 of 80; checkpoint 5 saved in {ckpt}; resume with --resume"
    )
    assert "5" in os.listdir(ckpt)  # the final checkpoint (the periodic ones come every 100 steps)
    stopped = json.loads(metrics.read_text())
    assert stopped["interrupted"] == "SIGINT" and stopped["last_step"] == 5
    assert stopped["losses"] == report["losses"][:5]  # the steps so far, as an uninterrupted run has them

    assert cli.main([*argv, "--resume"]) == cli.EXIT_OK
    assert "resumed after step 5" in capsys.readouterr().out
    resumed = json.loads(metrics.read_text())
    assert resumed["start_step"] == 5 and resumed["first_loss_step"] == 1 and resumed["interrupted"] is None
    # every step of the job, the first 5 from the checkpoint; equal bit for bit (fp32 on CPU)
    assert resumed["losses"] == report["losses"] and len(resumed["step_times_s"]) == 80
    assert resumed["held_out_loss"] == report["held_out_loss"]  # so the final parameters are the same
