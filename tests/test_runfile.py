"""Run files (``jaxpar train --config``): a run file and the same options as flags parse to the
same run, flags override the file, an unknown key is refused with the nearest option, and the
record a run keeps (in its checkpoints and metrics) repeats it bitwise."""
import json

import jax
import pytest

from jaxpar import cli, runfile
from jaxpar.train.checkpoint import load_arrays

FLAGS = ["--strategy", "data=8", "--steps", "3", "--batch-size", "8", "--seq-len", "16", "--packing", "on", "--seed", "5"]


def parsed(argv):
    options = cli._command_options("train")
    args = vars(cli._parser("train").parse_args(runfile.with_config(argv, options, cli._checkpoint_record)))
    args.pop("config")
    return args


def test_a_run_file_and_the_same_flags_are_the_same_run(tmp_path):
    path = tmp_path / "run.toml"
    # keys as the options are named, dashes or underscores; an on/off option as true/false
    path.write_text('strategy = "data=8"\nsteps = 3\nbatch_size = 8\n"seq-len" = 16\npacking = true\nseed = 5\n')
    assert parsed(["train", "--config", str(path)]) == parsed(["train", *FLAGS])
    # flags on the command line override the file, wherever they stand
    assert parsed(["train", "--seq-len", "32", f"--config={path}"])["seq_len"] == 32
    assert parsed(["train", "--config", str(path), "--seq-len", "32"]) == parsed(["train", *FLAGS, "--seq-len", "32"])


@pytest.mark.parametrize("text, message", [
    ("batch_sise = 8\n", "'batch_sise' is not an option of this command; did you mean 'batch-size'?"),
    ("steps = [1, 2]\n", "is not one value"),
    ("steps = \n", "is not a run file"),
])
def test_a_bad_run_file_is_refused_in_words(tmp_path, capsys, text, message):
    path = tmp_path / "run.toml"
    path.write_text(text)
    assert cli.main(["train", "--config", str(path)]) == 2
    assert message in capsys.readouterr().err


def test_the_recorded_run_repeats_bitwise(tmp_path, capsys):
    first, again = tmp_path / "first", tmp_path / "again"
    assert cli.main(["train", *FLAGS, "--checkpoint-dir", str(first), "--metrics-json", str(tmp_path / "first.json")]) == 0
    record = load_arrays(str(first))[1]["run"]  # in every checkpoint's record
    assert record["seed"] == 5 and record["packing"] == "on" and record["topology"] == "cpu-8"
    assert record["recorded"]["jax"] == jax.__version__  # the versions it ran with, in [recorded]
    # the record repeats the run (into another directory), from the checkpoint directory or from
    # the metrics file; written as a run file, it reads back as the same options
    assert cli.main(["train", "--config", str(first), "--checkpoint-dir", str(again),
                     "--metrics-json", str(tmp_path / "again.json")]) == 0
    losses = [json.loads((tmp_path / f"{name}.json").read_text())["losses"] for name in ("first", "again")]
    assert losses[0] == losses[1] and len(losses[0]) == 3
    assert parsed(["train", "--config", str(tmp_path / "again.json")])["checkpoint_dir"] == str(again)
    options = {key: value for key, value in record.items() if key != "recorded"}
    (tmp_path / "run.toml").write_text(runfile.record_text(options, record["recorded"]))
    assert parsed(["train", "--config", str(tmp_path / "run.toml")]) == parsed(["train", "--config", str(first)])
