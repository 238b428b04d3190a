"""Generation from checkpoints of `jaxpar train`: every README block that serves (the blocks
tests/test_readme.py leaves here) runs as printed; `generate_from_checkpoint` and `jaxpar generate`
under layouts against one device; bad directories, files and options refused in one line before any
array is read, or warned in one line.

The README's commands run in the order printed, in a fresh directory (so that `runs/main` written by
one is read by the next), in this process (`jaxpar.cli.main`, on the suite's 8 simulated devices),
except a `generate` with `--strategy` and no `--topology`, which runs as its own process so that it
chooses its devices as on a user's machine. Changes to them: `train` at test size (test_readme's
``small``) and `--json` added to each `generate` that has none, to compare tokens. Every other test
reuses the checkpoints they wrote (tiny models after a step or two: a test needs weights, not text).
"""
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
import warnings

import jax
import numpy as np
import pytest
from flax import nnx
from readme_commands import ROOT, bash_blocks, block_commands
from test_readme import _serving, small

from jaxpar import affinity, cli
from jaxpar.errors import JaxparError
from jaxpar.models import llama
from jaxpar.parallel import build_layout, parse_strategy
from jaxpar.serve import bd3lm as sampling
from jaxpar.serve import common
from jaxpar.serve import llama as serving
from jaxpar.serve.llama import Decoder
from jaxpar.train import checkpoint as checkpoint_lib

COMMANDS = [(text, argv) for _, block in bash_blocks(ROOT / "README.md") if _serving(block) for text, argv in block_commands(block)]


def _warnings_in(stderr: str) -> list[str]:
    return [line.split(": warning: ", 1)[1] for line in stderr.splitlines() if ": warning: " in line]


def _run_in_process(argv: list[str]) -> dict:
    out, err = io.StringIO(), io.StringIO()

    def show(message, category, filename, lineno, file=None, line=None):  # as a Python process shows a warning
        err.write(warnings.formatwarning(message, category, filename, lineno, line))

    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        try:
            status = cli.main(argv[1:])
        except SystemExit as exit:  # argparse
            status = exit.code
    return {"status": status, "out": out.getvalue(), "err": err.getvalue(), "warnings": _warnings_in(err.getvalue())}


def _run_as_a_process(argv: list[str]) -> dict:
    """``argv`` started as `jaxpar` is by a user: XLA is not told a device count."""
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f)
    env = dict(os.environ, XLA_FLAGS=flags, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    return {"status": done.returncode, "out": done.stdout, "err": done.stderr, "warnings": _warnings_in(done.stderr)}


def _run(argv: list[str], n: int) -> dict:
    if ">" in argv:  # `printf ... > prompts.txt`
        cut = argv.index(">")
        with open(argv[cut + 1], "w") as f:
            return {"status": subprocess.run(argv[:cut], stdout=f).returncode, "out": "", "err": "", "warnings": []}
    argv = small(argv)
    if argv[1] == "generate" and "--json" not in argv:
        argv = [*argv, "--json", f"generated-{n}.json"]
    if argv[1] == "generate" and "--strategy" in argv and "--topology" not in argv:
        result = _run_as_a_process(argv)
    else:
        result = _run_in_process(argv)
    if "--json" in argv and os.path.exists(argv[argv.index("--json") + 1]):
        result["json"] = json.loads(open(argv[argv.index("--json") + 1]).read())
    return result


@pytest.fixture(scope="module")
def readme(tmp_path_factory):
    """(the directory they ran in, {command text: its status, outputs, warnings, seconds, json}) for
    each command of the serving blocks, in order."""
    work, ran, before = tmp_path_factory.mktemp("serving"), {}, os.getcwd()
    os.chdir(work)
    try:
        for n, (text, argv) in enumerate(COMMANDS):
            began = time.perf_counter()
            ran[text] = dict(_run(argv, n), seconds=round(time.perf_counter() - began, 1))
            print(f"{ran[text]['seconds']:6.1f} s  {text}")
    finally:
        os.chdir(before)
    return work, ran


def test_the_readme_has_the_serving_commands():
    verbs = [argv[1] for _, argv in COMMANDS if argv[0] == "jaxpar"]
    assert verbs.count("generate") >= 7 and verbs.count("affinity") == 1 and verbs.count("train") == 4, COMMANDS


@pytest.mark.parametrize("text", [text for text, _ in COMMANDS])
def test_a_serving_command_runs_as_printed(readme, text):
    result = readme[1][text]
    assert result["status"] == 0, f"{text} exited {result['status']}:\n{result['err'][-3000:]}"
    if " generate " in f" {text} ":
        for prompt in result["json"].get("prompts", [result["json"]]):
            assert prompt["text"].startswith(_prompt_of(prompt)) and prompt["text"] in result["out"]


def _prompt_of(prompt: dict) -> str:
    """The prompt of one output of --json: its first prompt_tokens bytes, as text."""
    return bytes(prompt["tokens"][:prompt["prompt_tokens"]]).decode()


def _generated(readme, *words):
    """The result of the one serving `generate` whose text holds every one of ``words``."""
    (found,) = [r for text, r in readme[1].items() if " generate " in f" {text} " and all(w in text for w in words)]
    return found


def test_the_block_diffusion_sampler_under_tensor_2_gives_one_devices_tokens(readme):
    (one,) = [r for text, r in readme[1].items() if " generate " in f" {text} " and "runs/bd3lm" in text and "--strategy" not in text]
    split = _generated(readme, "runs/bd3lm", "tensor=2")
    assert split["json"]["tokens"] == one["json"]["tokens"] and split["json"]["prompt_tokens"] == 4
    assert len(one["json"]["tokens"]) == 64  # 4 whole blocks of 16, the prompt opening the first


def test_three_prompts_under_data_2_are_padded_and_the_padding_dropped(readme):
    batched = _generated(readme, "prompts.txt")
    prompts = (readme[0] / "prompts.txt").read_text().splitlines()
    assert len(prompts) == 3 and [_prompt_of(p) for p in batched["json"]["prompts"]] == prompts
    assert all(len(p["tokens"]) == p["prompt_tokens"] + 64 for p in batched["json"]["prompts"])
    assert "3 x 64 new tokens" in batched["err"]


def test_delayed_tp_serves_its_checkpoint_without_a_warning_and_a_tp_one_with_one(readme):
    assert _generated(readme, "runs/dtp")["warnings"] == []
    (warned,) = _generated(readme, "--permutation")["warnings"]
    assert "trained under 'fsdp=4,tensor=2' is served with delay=1" in warned  # the README's own example: said once


# --- from a checkpoint, under layouts, against one device -------------------------------------------


@pytest.fixture(scope="module")
def work(readme):
    """The README's directory, with an empty directory, an empty prompts file, a permutation for
    tensor=2, and the step of its checkpoints."""
    w = readme[0]
    (w / "empty").mkdir()
    (w / "empty.txt").write_text("\n  \n")
    made = _run_in_process(["jaxpar", "affinity", "--checkpoint-dir", str(w / "runs/main"), "--tensor", "2", "--out", str(w / "perm2.json")])
    assert made["status"] == 0 and "affinity" in made["out"] and "random" in made["out"] and "identity" in made["out"]
    (step,) = [int(name) for name in os.listdir(w / "runs/main") if name.isdigit()]
    return w, step


def test_a_llama_from_a_checkpoint(work):
    main, step = str(work[0] / "runs/main"), work[1]
    outs, decoded = serving.generate_from_checkpoint(main, ["The ", "A b"], 8)
    model, meta = common.restore_model(main, "llama")
    alone = Decoder(model, vocab=256).generate([common.encode_text("The ")], 8).tokens[0]
    assert [(o.model, o.step, o.prompt_tokens) for o in outs] == [("tiny", step, 4), ("tiny", step, 3)]
    np.testing.assert_array_equal(outs[0].tokens, alone)
    assert outs[0].text.startswith("The ") and outs[0].continuation == common.decode_tokens(outs[0].tokens[4:])
    assert all(o.tokens.max() < 256 for o in outs) and len(decoded.step_seconds) == 8
    with pytest.raises(JaxparError, match=r"make 129 tokens, more than 128 \(the run's --seq-len\)"):
        serving.generate_from_checkpoint(main, ["The "], 125)
    with pytest.raises(JaxparError, match=r"holds 'tiny', a Llama; this generates from block diffusion models"):
        common.restore_model(main, "bd3lm")


def test_jaxpar_generate_pads_three_prompts_under_data_2_and_gives_one_devices_tokens(work, tmp_path, capsys):
    (tmp_path / "prompts.txt").write_text("The \nA b\ndef \n")
    argv = ["generate", "--checkpoint-dir", str(work[0] / "runs/main"), "--prompts-file", str(tmp_path / "prompts.txt"),
            "--max-new-tokens", "8", "--strategy", "data=2,tensor=2", "--topology", "cpu-4", "--json", str(tmp_path / "out.json")]
    assert cli.main(argv) == cli.EXIT_OK, capsys.readouterr().err
    printed = capsys.readouterr()
    expected, _ = serving.generate_from_checkpoint(str(work[0] / "runs/main"), ["The ", "A b", "def "], 8)  # one device
    assert printed.out.startswith(expected[0].text) and "3 x 8 new tokens" in printed.err
    written = json.loads((tmp_path / "out.json").read_text())
    assert [p["tokens"] for p in written["prompts"]] == [[int(t) for t in o.tokens] for o in expected]
    assert len(written["step_seconds"]) == 8 and written["tokens_per_second"] > 0
    assert cli.main([*argv[:3], "--prompt", "The ", "--new-blocks", "2"]) == cli.EXIT_BAD_INPUT
    assert "--new-blocks is for block diffusion models" in capsys.readouterr().err


def test_jaxpar_affinity_writes_a_permutation_that_generate_applies_under_delay(work, tmp_path, capsys):
    main, perm = str(work[0] / "runs/main"), str(work[0] / "perm2.json")
    argv = ["generate", "--checkpoint-dir", main, "--prompt", "The ", "--max-new-tokens", "6", "--strategy",
            "data=2,tensor=2,delay=1", "--topology", "cpu-4", "--permutation", perm, "--json", str(tmp_path / "out.json")]
    with pytest.warns(UserWarning, match="served with delay=1"):  # trained as TP
        assert cli.main(argv) == cli.EXIT_OK, capsys.readouterr().err
    # the same as the decoder on the weights permuted by hand, under the same layout
    model, meta = common.restore_model(main, "llama")
    affinity.permute_model(model, affinity.load(perm, meta["model"], model.cfg))
    layout = build_layout(parse_strategy("data=2,tensor=2,delay=1", 4), jax.devices()[:4])
    expected = Decoder(model, layout=layout, vocab=256).generate([common.encode_text("The ")], 6).tokens[0]
    assert json.loads((tmp_path / "out.json").read_text())["prompts"][0]["tokens"] == [int(t) for t in expected]
    capsys.readouterr()
    # a permutation made for another model is refused before any weight is read
    other = llama.CONFIGS["llama-1b"]
    made = affinity.Permutation(2, np.tile(np.arange(other.kv_heads), (other.layers, 1)), np.tile(np.arange(other.mlp), (other.layers, 1)))
    affinity.save(made, str(tmp_path / "other.json"), "llama-1b", other)
    assert cli.main([*argv[:-2], "--permutation", str(tmp_path / "other.json")]) == cli.EXIT_BAD_INPUT
    assert "was made for model 'llama-1b', whose shape differs from that of 'tiny'" in capsys.readouterr().err


def test_a_block_diffusion_model_from_a_checkpoint(work, tmp_path, capsys):
    bd, step = str(work[0] / "runs/bd3lm"), work[1]
    out = sampling.generate_from_checkpoint(bd, "The ", 2, denoise_steps=8)
    assert (out.model, out.step, out.prompt_tokens) == ("bd3lm-tiny", step, 4)
    assert out.tokens.shape == (32,) and out.tokens.max() < 256  # two whole blocks of bytes, the prompt's 4 first
    assert bytes(out.tokens[:4].astype(np.uint8)) == b"The " and out.text == sampling.decode_tokens(out.tokens)
    assert out.continuation == sampling.decode_tokens(out.tokens[4:])
    with pytest.raises(JaxparError, match=r"make 144 tokens \(whole blocks of 16: the prompt's last 4 open the first new block\), "
                                          r"more than max_length=128"):
        sampling.generate_from_checkpoint(bd, "The ", 9)  # past the run's --seq-len
    # only the parameters, read straight into the layout's shardings: the weights one device reads
    split, meta = common.restore_model(bd, "bd3lm", layout=build_layout(parse_strategy("tensor=2", 2), jax.devices()[:2]))
    one, _ = common.restore_model(bd, "bd3lm")
    wq = nnx.state(split)["layers"]["wq"].get_value()
    assert wq.sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor") and len(wq.sharding.device_set) == 2
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(nnx.to_pure_dict(nnx.state(split))),
                 jax.device_get(nnx.to_pure_dict(nnx.state(one))))
    # the command prints the same (the block size read from the checkpoint)
    assert cli.main(["generate", "--checkpoint-dir", bd, "--prompt", "The ", "--new-blocks", "2", "--denoise-steps", "8",
                     "--json", str(tmp_path / "out.json")]) == cli.EXIT_OK
    printed = capsys.readouterr()
    assert printed.out.startswith(out.text) and "28 new tokens" in printed.err
    assert json.loads((tmp_path / "out.json").read_text())["tokens"] == [int(t) for t in out.tokens]


# --- refusals and warnings -------------------------------------------------------------------------

REFUSED = [  # (case, argv after `jaxpar`, a line of the refusal); {w}: the directory the README ran in, {step} its checkpoint
    ("empty directory", "generate --checkpoint-dir {w}/empty --prompt The", "'{w}/empty' holds no checkpoint; train into it first"),
    ("empty directory, affinity", "affinity --checkpoint-dir {w}/empty --tensor 2 --out {w}/p.json", "holds no checkpoint; train into"),
    ("a file", "generate --checkpoint-dir {w}/prompts.txt --prompt The", "'{w}/prompts.txt' is a file, not a checkpoint directory"),
    ("a file, affinity", "affinity --checkpoint-dir {w}/prompts.txt --tensor 2 --out {w}/p.json", "is a file, not a checkpoint dir"),
    ("no directory", "generate --checkpoint-dir {w}/nowhere --prompt The", "'{w}/nowhere' does not exist; point it at a directory"),
    ("no checkpoint N", "generate --checkpoint-dir {w}/runs/main --prompt The --step 7",
     "--step 7: '{w}/runs/main' holds no checkpoint 7; it holds {step}: choose one of those"),
    ("empty prompts file", "generate --checkpoint-dir {w}/runs/main --prompts-file {w}/empty.txt",
     "--prompts-file '{w}/empty.txt' has no non-empty line: write one prompt a line"),
    ("no prompt", "generate --checkpoint-dir {w}/runs/main", "give --prompt TEXT or --prompts-file PATH"),
    ("denoise steps 0", "generate --checkpoint-dir {w}/runs/bd3lm --denoise-steps 0", "must be an int from 1 to block_size=16"),
    ("top-p at temperature 0", "generate --checkpoint-dir {w}/runs/main --prompt The --top-p 0.5",
     "top_p=0.5 does nothing at temperature=0"),
    ("context", "generate --checkpoint-dir {w}/runs/main --prompt The --strategy context=2",
     "context=2 cannot serve: a Llama decodes one token a step, which cannot be split over devices; use tensor"),
    ("stage", "generate --checkpoint-dir {w}/runs/bd3lm --strategy stage=2,tensor=2",
     "stage=2 cannot serve: it splits no weight of the model and not the rows"),
    ("permutation of another degree", "generate --checkpoint-dir {w}/runs/main --prompt The --topology cpu-8 --strategy "
     "data=2,tensor=4,delay=1 --permutation {w}/perm2.json", "was made for tensor=2 (`jaxpar affinity --tensor 2`) but this "
     "layout splits the heads over tensor=4"),
    ("devices without a layout", "generate --checkpoint-dir {w}/runs/main --prompt The --topology cpu-8",
     "--topology cpu-8 has 8 devices but without --strategy generation runs on one"),
    ("permutation without delay", "generate --checkpoint-dir {w}/runs/main --prompt The --strategy tensor=4 "
     "--permutation {w}/runs/main/perm.json", "served without delay=1 every placement computes the same function"),
]


@pytest.mark.parametrize("case, argv, line", REFUSED, ids=[c for c, _, _ in REFUSED])
def test_refused_in_one_line_before_any_array_is_read(work, monkeypatch, case, argv, line):
    def read(*args, **kwargs):
        raise AssertionError("a checkpoint's arrays were read before the refusal")

    monkeypatch.setattr(checkpoint_lib, "state_checksums", read)
    w, step = work
    result = _run_in_process(["jaxpar", *argv.format(w=w).split()])
    assert result["status"] == cli.EXIT_BAD_INPUT and result["out"] == ""
    assert result["err"].count("\n") == 1 and result["err"].startswith(f"jaxpar {argv.split()[0]}: ")
    assert line.format(w=w, step=step) in result["err"], result["err"]


def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_that_verifies(work):
    """A newer checkpoint whose arrays cannot be read (the README's copied as the next step, its
    array files cut short): generate says so in one line and gives the older one's tokens; --step
    of the damaged one is refused."""
    w, step = work
    runs = w / "damaged"
    shutil.copytree(w / "runs/main", runs, ignore=shutil.ignore_patterns("perm.json", checkpoint_lib.LOCK_NAME))
    shutil.copytree(runs / str(step), runs / str(step + 1))
    for data in (runs / str(step + 1) / "state").rglob("d/*"):
        os.truncate(data, 100)
    argv = ["jaxpar", "generate", "--checkpoint-dir", str(runs), "--prompt", "The ", "--max-new-tokens", "8", "--json"]
    fallen = _run_in_process([*argv, str(w / "fallen.json")])
    assert fallen["status"] == 0 and fallen["warnings"] == [
        f"checkpoint {step + 1} is damaged (its parameters cannot be read): read checkpoint {step} instead, the newest that "
        f"verifies (--step N chooses one; `jaxpar checkpoints {runs}` lists them)"]
    assert fallen["err"].startswith(f"jaxpar generate: warning: checkpoint {step + 1} is damaged")  # one line, no source line
    chosen = _run_in_process([*argv, str(w / "chosen.json"), "--step", str(step)])
    assert chosen["status"] == 0 and chosen["warnings"] == []
    assert json.loads((w / "fallen.json").read_text())["prompts"] == json.loads((w / "chosen.json").read_text())["prompts"]
    refused = _run_in_process([*argv, str(w / "x.json"), "--step", str(step + 1)])
    assert refused["status"] == cli.EXIT_BAD_INPUT and f"checkpoint {step + 1}: its parameters cannot be read" in refused["err"]
    assert refused["err"].rstrip().endswith(f"choose another with --step ({step})")


def test_a_delayed_checkpoint_served_as_plain_tp_warns_in_one_line(work):
    argv = ["jaxpar", "generate", "--checkpoint-dir", str(work[0] / "runs/dtp"), "--prompt", "The ", "--max-new-tokens", "2",
            "--topology", "cpu-4", "--strategy", "tensor=4"]
    result = _run_in_process(argv)
    assert result["status"] == 0 and len(result["warnings"]) == 1
    assert "trained under 'data=2,tensor=4,delay=1' is served without delay=1: delayed TP computes a different function" in \
        result["warnings"][0]
