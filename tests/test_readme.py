"""Every shell command of README.md and BUILD.md runs as printed (at small sizes), or is named here
with the reason it does not run on this machine, or is run by tests/test_generate_cli.py (the
serving blocks). A new command that none of these covers fails ``test_every_command_is_covered``.

The commands run in one process (``tests/readme_commands.py``: ``jaxpar.cli.main`` for each, in
the README's order, in a fresh directory, so that ``runs/ckpt`` written by one is resumed by the
next), with 8 simulated devices and the suite's compilation cache. ``small`` is the only change
made to them: fewer steps, a smaller batch and shorter sequences where the printed ones would take
long, and the tiny model for the pod plan (test_compile.py plans llama2-7b itself). A `train` for
a GPU or TPU topology runs as printed, to the refusal this machine gives (``REFUSED_HERE``).
"""
import json
import os
import subprocess
import sys

import pytest
from readme_commands import ROOT, bash_blocks, block_commands

DOCS = ("README.md", "BUILD.md")

# commands not run here, by how they begin, with the reason
NOT_RUN = {
    "python3 -m venv": "makes the environment this suite runs in",
    ". .venv/bin/activate": "the environment this suite runs in",
    "pip install": "installs packages from the network; the suite runs on the installed tree",
    "python -m pytest": "this suite",
    "srun ": "a SLURM job on 8 GPU nodes",
    "gcloud ": "a Cloud TPU slice of 32 hosts",
    "jaxpar verify --model net.onnx ": "reads a user's network and properties; tests/test_verify_files.py runs jaxpar "
                                       "verify as printed on an ONNX file and properties it writes",
}
# commands that run and end with another status than 0 on this machine: (status, a line of the output)
REFUSED_HERE = {
    "jaxpar train --topology gpu-h100-8 ": (2, "is a gpu topology but JAX sees cpu devices"),
    "jaxpar train --topology gpu-h100-64 ": (2, "is a gpu topology but JAX sees cpu devices"),
    "jaxpar train --topology tpu-v5p-256 ": (2, "is a tpu topology but JAX sees cpu devices"),
}
SERVING = "tests/test_generate_cli.py"  # runs every block that holds a `jaxpar generate` or `jaxpar affinity`


def _serving(block: str) -> bool:
    return "jaxpar generate " in block or "jaxpar affinity " in block


def _set(argv: list[str], flag: str, value) -> list[str]:
    if flag in argv:
        argv = list(argv)
        argv[argv.index(flag) + 1] = str(value)
        return argv
    return [*argv, flag, str(value)]


def _get(argv: list[str], flag: str, default=None):
    return argv[argv.index(flag) + 1] if flag in argv else default


def small(argv: list[str]) -> list[str]:
    """The command at test size: ``train`` runs 1 step per 300 printed (1 when none is printed) on
    a batch of 8 rows (the printed one where micro-batches split it) of at most 128 positions
    (every printed layout divides them); ``compile`` plans the tiny model at 512 positions on the
    printed pod; ``bench`` runs 2 steps (its least) of each strategy on 8 rows. Paths stay as
    printed: the runner works in a fresh directory."""
    if argv[:2] == ["jaxpar", "launch"]:
        cut = argv.index("--")
        return [*argv[:cut + 1], *small(argv[cut + 1:])]
    if argv[:2] == ["jaxpar", "train"]:
        argv = _set(argv, "--steps", max(1, int(_get(argv, "--steps", 300)) // 300))
        if "--microbatches" not in argv:
            argv = _set(argv, "--batch-size", min(8, int(_get(argv, "--batch-size", 16))))
        return _set(argv, "--seq-len", min(128, int(_get(argv, "--seq-len", 128))))
    if argv[:2] == ["jaxpar", "compile"]:
        model = _get(argv, "--model")
        argv = _set(argv, "--model", {"llama2-7b": "tiny", "bd3lm-8b": "bd3lm-tiny"}.get(model, model))
        return _set(argv, "--seq-len", min(512, int(_get(argv, "--seq-len", 2048))))
    if argv[:2] == ["jaxpar", "bench"]:
        return _set(_set(argv, "--steps", 2), "--batch-size", 8)
    return argv


def _classify():
    """The commands of both files: (to run, in order and once each; not run, with the reason;
    run by the serving test; covered by nothing)."""
    runs, not_run, serving, uncovered = [], [], [], []
    for doc in DOCS:
        for _, block in bash_blocks(ROOT / doc):
            for text, argv in block_commands(block):
                reason = next((why for start, why in NOT_RUN.items() if text.startswith(start)), None)
                if reason:
                    not_run.append((doc, text, reason))
                elif _serving(block):
                    serving.append((doc, text))
                elif argv[0] == "jaxpar":
                    if text not in [t for _, t, _ in runs]:
                        runs.append((doc, text, argv))
                else:
                    uncovered.append((doc, text))
    return runs, not_run, serving, uncovered


RUNS, NOT_RUN_HERE, SERVING_COMMANDS, UNCOVERED = _classify()


def test_every_command_is_covered():
    assert not UNCOVERED, f"shell commands that no test runs; run them here or name why not in NOT_RUN: {UNCOVERED}"
    assert len(RUNS) >= 15 and len(SERVING_COMMANDS) >= 8, (RUNS, SERVING_COMMANDS)  # the parse found the blocks
    assert (ROOT / SERVING).is_file(), f"{SERVING_COMMANDS} are left to {SERVING}, which is missing"


def _expected(text: str):
    return next((want for start, want in REFUSED_HERE.items() if text.startswith(start)), (0, None))


# files the commands write, by how the command begins
WRITES = {
    "jaxpar train --model tiny --topology cpu-8 ": ["runs/metrics.json"],
    "jaxpar train --steps 600 --checkpoint-dir runs/ckpt --resume": ["runs/ckpt/2"],
    "jaxpar bench ": ["runs/bench.json"],
    "jaxpar compile ": ["runs/hlo/step.hlo.txt"],
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """(the directory they ran in, {command text: {argv, status, seconds, cpu_seconds, output}},
    the runner's stderr) of the commands of RUNS, at test size, in order."""
    work = tmp_path_factory.mktemp("readme")
    # a command refused on this machine runs as printed: it stops before any work
    (work / "commands.json").write_text(json.dumps([argv if _expected(text)[0] else small(argv) for _, text, argv in RUNS]))
    # `jaxpar launch -- jaxpar train ...` starts `jaxpar` by name: this interpreter's
    env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "readme_commands.py"), "commands.json", "results.json"], cwd=work,
                          env=env, capture_output=True, text=True, timeout=1200)
    ran = json.loads((work / "results.json").read_text()) if (work / "results.json").exists() else []
    return work, {text: result for (_, text, _), result in zip(RUNS, ran)}, done.stderr


@pytest.mark.slow  # about 165 s of CPU for all of them (the fixture), most of it compiling
@pytest.mark.parametrize("text", [text for _, text, _ in RUNS])
def test_command_runs_as_printed(results, text):
    work, ran, stderr = results
    assert text in ran, f"the runner stopped before {text}:\n{stderr[-3000:]}"
    result = ran[text]
    status, line = _expected(text)
    assert result["status"] == status, f"{text}\nat test size: {' '.join(result['argv'])}\nexited {result['status']}, " \
                                       f"not {status}:\n{result['output'][-4000:]}"
    if line:
        assert line in result["output"], result["output"][-2000:]
    for path in next((paths for start, paths in WRITES.items() if text.startswith(start)), []):
        assert (work / path).exists(), f"{text} did not write {path}"
