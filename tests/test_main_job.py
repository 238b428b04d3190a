"""The main job: the loss falls clearly on the shipped corpus, and the CLI reports and fails well."""
import json

import pytest

from jaxpar import cli
from jaxpar.topology import load_topology
from jaxpar.train.loop import RunConfig, run_training


@pytest.fixture(scope="module")
def report():
    run = RunConfig(model="tiny", strategy="fsdp=4,tensor=2", steps=80, batch_size=16, seq_len=64, seed=0)
    return run_training(run, load_topology("cpu-8"), progress=None)


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


@pytest.mark.slow
def test_cli_writes_metrics_json(tmp_path, capsys):
    path = tmp_path / "out" / "metrics.json"
    code = cli.main(["train", "--steps", "3", "--batch-size", "8", "--seq-len", "16", "--strategy", "data=2,fsdp=4", "--metrics-json", str(path)])
    assert code == 0
    saved = json.loads(path.read_text())
    assert len(saved["losses"]) == 3 and saved["strategy"] == "data=2,fsdp=4"
    assert not [p for p in path.parent.iterdir() if p.name != "metrics.json"]  # no temporary left behind
    assert "collectives per step" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, culprit",
    [
        (["--topology", "tpu-v9-1"], "tpu-v9-1"),
        (["--strategy", "data=3"], "multiplies to 3"),
        (["--model", "gpt5"], "gpt5"),
        (["--strategy", "tensor=8"], "kv_heads"),
        (["--batch-size", "6"], "multiple of 4"),
    ],
)
def test_cli_bad_input_exits_with_the_culprit(args, culprit, capsys):
    assert cli.main(["train", "--steps", "1", *args]) == 2
    assert culprit in capsys.readouterr().err
