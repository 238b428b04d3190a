"""Bad input is refused up front, in one line that names the value and the fix, with exit status 2,
by every command that takes it; signals, the launcher's clean-up and output files behave as the
README's "Exit statuses" says. No training step runs here: each test takes well under a second
(the interrupted and resumed job is in test_main_job.py)."""
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile

import jax
import pytest

from jaxpar import bench, cli, launch
from jaxpar.errors import JobFailed, SpecError
from jaxpar.parallel import parse_strategy
from jaxpar.topology import meshes_dir
from jaxpar import run as loop
from jaxpar.train.step import Trainer

BAD_INPUT = [
    # train: numbers
    ("train --learning-rate -1", "--learning-rate -1 "),
    ("train --learning-rate nan", "--learning-rate nan "),
    ("train --learning-rate inf", "--learning-rate inf "),
    ("train --learning-rate 0", "--learning-rate 0 "),
    ("train --clip-norm -1", "--clip-norm -1 "),
    ("train --clip-norm nan", "--clip-norm nan "),
    ("train --warmup-steps -5", "--warmup-steps -5 "),
    ("train --steps 0", "--steps 0 "),
    ("train --steps -3", "--steps -3 "),
    ("train --batch-size -8", "--batch-size -8 "),
    ("train --batch-size 0", "--batch-size 0 "),
    ("train --seq-len 0", "--seq-len 0 "),
    ("train --microbatches 0", "--microbatches 0 "),
    ("train --chunks 0", "--chunks 0 "),
    ("train --checkpoint-dir {tmp}/ckpt --checkpoint-every 0", "--checkpoint-every 0 "),
    ("train --checkpoint-dir {tmp}/ckpt --keep-checkpoints 0", "--keep-checkpoints 0 "),
    ("train --batch-size 6", "multiple of 4"),
    # train: strategies and the options that go with them
    ("train --strategy fsdp=2,fsdp=8", "axis 'fsdp' is given twice"),
    ("train --strategy fsdp=8,zero=1,zero=3", "option 'zero' is given twice"),
    ("train --strategy data=3", "multiplies to 3"),
    ("train --strategy context=8 --seq-len 36", "sequence length 36 does not split over context"),
    ("train --strategy context=8 --context-algorithm all-to-all", "cannot split 8 ways"),
    ("train --strategy stage=2,context=2,fsdp=2 --microbatches 2", "the ring's collective-permutes would run inside the pipeline"),
    ("train --dcp on --strategy data=8", "--dcp on chooses the layout, accumulation and recomputation of every step itself"),
    ("train --strategy expert=2,fsdp=4", "the expert axis is not supported by model tiny yet"),
    ("train --grad-sync-bits 4", "--grad-sync-bits 4.0 does nothing"),
    ("train --grad-sync-axes data", "--grad-sync-axes data does nothing"),
    ("train --schedule gpipe", "--schedule gpipe does nothing"),
    ("train --schedule 1f1b", "--schedule 1f1b does nothing"),  # the default, but given: the user meant something
    ("train --chunks 2", "--chunks 2 does nothing"),
    # train: options that would change nothing, and refusals that suggest what works (issue 27)
    ("train --strategy fsdp=8 --context-algorithm all-to-all", "context_algorithm=all-to-all (--context-algorithm) chooses how "
     "attention crosses a sequence split by context=N, but the strategy has no context axis"),
    ("train --strategy fsdp=8,context_algorithm=hybrid,a2a=2", "context_algorithm=hybrid (--context-algorithm) chooses"),
    ("train --strategy fsdp=4,context=2 --attention splash", "--attention splash does nothing under the context ring over context"),
    ("train --strategy fsdp=4,context=2 --attention cudnn", "--attention cudnn does nothing under the context ring over context"),
    ("train --attention cudnn", "--attention cudnn is a GPU kernel, but this mesh runs on CPU"),
    ("train --attention splash", "--attention splash is a TPU kernel, but this mesh runs on CPU"),
    ("train --seed -1", "--seed -1 must be a whole number from 0"),
    ("train --strategy stage=2,fsdp=4 --schedule interleaved-1f1b --chunks 0", "pass --chunks 2 or more"),
    ("train --strategy stage=2,fsdp=4 --schedule interleaved-1f1b --chunks 1", "pass --chunks 2 or more"),
    ("train --chunks 0", "--schedule interleaved-1f1b --chunks 2"),  # not --chunks 1, which is the default
    ("train --strategy block=4,context=3", "on 8 devices e.g. --strategy data=2,block=4,context=2 or data=2,block=4,context=4"),
    ("train --strategy fsdp=8,foo=bar", "'foo' in strategy 'fsdp=8,foo=bar' is not a mesh axis or an option; the axes are federation, stage,"),
    ("train --strategy data=8,param_shards=4", "the strategy has no fsdp axis (fsdp=1); use fsdp= a multiple of 4 above it, "
     "e.g. fsdp=8,param_shards=4"),
    ("train --strategy fsdp=8,param_shards=3", "over all of fsdp): one of 2, 4; or drop param_shards"),
    # train: model, hardware, fit
    ("train --model gpt5", "gpt5"),
    ("train --topology tpu-v9-1", "tpu-v9-1"),
    ("train --model llama2-70b --strategy fsdp=8", "llama2-70b (69.0B weights) needs"),
    ("train --strategy data=8 --topology {tmp}/small-hbm.toml", "tiny under data=8 keeps"),
    # train: where the outputs go
    ("train --metrics-json {tmp}/file/metrics.json", "{tmp}/file is a file, not a directory"),
    ("train --metrics-json {tmp}", "--metrics-json {tmp} is an existing directory"),
    ("train --metrics-json /proc/jaxpar/metrics.json", "--metrics-json /proc/jaxpar/metrics.json cannot be written"),
    ("train --checkpoint-dir {tmp}/file", "--checkpoint-dir {tmp}/file is an existing file"),
    ("train --resume", "--resume needs --checkpoint-dir"),
    # compile
    ("compile --model tiny --topology cpu-8 --seq-len 0", "--seq-len 0 "),
    ("compile --model tiny --topology cpu-8 --batch-size -8", "--batch-size -8 "),
    ("compile --model tiny --topology cpu-8 --strategy fsdp=2,fsdp=8", "axis 'fsdp' is given twice"),
    ("compile --model tiny --topology cpu-8 --strategy context=8 --seq-len 36", "sequence length 36 does not split"),
    ("compile --model llama2-70b --topology cpu-8 --strategy fsdp=8", "llama2-70b (69.0B weights) needs"),
    ("compile --model tiny --topology cpu-8 --json {tmp}", "--json {tmp} is an existing directory"),
    ("compile --model tiny --topology cpu-8 --strategy fsdp=8 --context-algorithm all-to-all", "but the strategy has no context axis"),
    ("compile --model tiny --topology cpu-8 --strategy fsdp=4,context=2 --attention blockwise --context-algorithm hybrid",
     "context_algorithm=hybrid with context=2 needs a2a=U"),
    ("compile --model tiny --topology cpu-8 --strategy fsdp=4,context=2 --attention cudnn",
     "--attention cudnn is a GPU kernel, but topology cpu-8 runs on CPU"),
    # a pod's kernel, refused in the pod's words before the TPU compiler is loaded
    ("compile --model tiny --topology v5p-8 --attention cudnn", "--attention cudnn is a GPU kernel, but topology v5p-8 runs on TPU: use splash on a TPU"),
    ("compile --model tiny --topology cpu-8 --strategy stage=2,fsdp=4 --schedule interleaved-1f1b --chunks 1", "pass --chunks 2 or more"),
    ("compile --model tiny --topology cpu-8 --chunks 2", "--chunks 2 does nothing"),
    ("compile --model tiny --topology cpu-8 --schedule gpipe", "--schedule gpipe does nothing"),
    ("compile --model tiny --topology cpu-8 --strategy block=4,context=3", "e.g. --strategy data=2,block=4,context=2"),
    ("compile --model tiny --topology cpu-8 --strategy fsdp=8,foo=bar", "'foo' in strategy 'fsdp=8,foo=bar' is not a mesh axis"),
    ("compile --model tiny --topology cpu-8 --strategy data=8,param_shards=4", "the strategy has no fsdp axis"),
    # check
    ("check --seed -1", "--seed -1 must be a whole number from 0"),
    ("check --strategy fsdp=8,foo=bar", "'foo' in strategy 'fsdp=8,foo=bar' is not a mesh axis"),
    ("check --strategy data=8,param_shards=4", "the strategy has no fsdp axis"),
    ("check --strategy fsdp=8,context_algorithm=ring", "but the strategy has no context axis"),
    ("check --tolerance -1", "--tolerance -1.0 must be a finite positive fraction"),
    ("check --tolerance nan", "--tolerance nan must be a finite positive fraction"),
    ("check --strategy data=2,tensor=4,delay=1", "delay=1 computes another function than one device"),
    ("generate --checkpoint-dir {tmp} --prompt \udcff\udcfe", "holds bytes that are not UTF-8 text"),  # as Python gets them
    # train --dcp on: the main job's checks, and the flags it would ignore
    ("train --dcp on --steps 0", "--steps 0 is too small"),
    ("train --dcp on --seq-len 0", "--seq-len 0 is too small"),
    ("train --dcp on --batch-size 0", "--batch-size 0 is too small"),
    ("train --dcp on --learning-rate -1", "--learning-rate -1 must be a finite positive number"),
    ("train --dcp on --microbatches 4", "drop --microbatches"),
    ("train --dcp on --grad-sync dynamiq", "drop --grad-sync"),
    ("train --dcp on --remat full", "drop --remat"),
    ("train --dcp on --model bd3lm-tiny", "--model bd3lm-tiny is not one"),
    # bench: every entry is checked before the first runs (run_training is forbidden below)
    ("bench --steps 0", "--steps 0 is too small: it must be at least 2"),
    ("bench --steps 1", "--steps 1 is too small: it must be at least 2"),
    ("bench --batch-size 0", "--batch-size 0 "),
    ("bench --seq-len 0", "--seq-len 0 "),
    ("bench --strategies ;", "--strategies ';': entry 1 of 2 is empty"),
    ("bench --strategies data=8;bogus=3", "'bogus'"),
    ("bench --strategies data=8;expert=2,fsdp=4", "the expert axis is not supported"),
    ("bench --strategies data=8;fsdp=8,context_algorithm=all-to-all", "but the strategy has no context axis"),
    ("bench --strategies data=8;fsdp=8,foo=bar", "'foo' in strategy 'fsdp=8,foo=bar' is not a mesh axis"),
    ("bench --strategies data=8;data=8,param_shards=4", "the strategy has no fsdp axis"),
    ("bench --json {tmp}/file/rows.json", "{tmp}/file is a file, not a directory"),
    # launch
    ("launch -- /nonexistent", "command '/nonexistent' was not found"),
    ("launch", "a command is needed after '--'"),
    ("launch --", "a command is needed after '--'"),
    ("launch --processes 0 -- true", "--processes 0 "),
]


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if anything is allocated, compiled, run or started."""
    def forbidden(*args, **kwargs):
        raise AssertionError("work started before the bad input was refused")

    for name in ("init", "init_programs", "jit_step"):
        monkeypatch.setattr(Trainer, name, forbidden)
    monkeypatch.setattr(bench, "run_training", forbidden)
    monkeypatch.setattr(launch, "_Attempt", forbidden)


@pytest.fixture
def places(tmp_path):
    """tmp_path with a plain file in it and a topology like cpu-8 whose chips hold only 4 MiB: the
    tiny model's state fits fully sharded (1.7 MB per chip) but not replicated (10 MB under data=8)."""
    (tmp_path / "file").write_text("not a directory")
    cpu8 = (meshes_dir() / "cpu-8.toml").read_text()
    (tmp_path / "small-hbm.toml").write_text(cpu8.replace('name = "cpu-8"', 'name = "small-hbm"').replace("hbm_gib = 16", "hbm_gib = 0.004"))
    return tmp_path


@pytest.mark.parametrize("command, culprit", BAD_INPUT, ids=[c for c, _ in BAD_INPUT])
def test_bad_input_is_refused_in_one_line_before_any_work(command, culprit, places, no_work, capsys):
    argv = [arg.format(tmp=places) for arg in command.split()]
    before = {id(a) for a in jax.live_arrays()}
    assert cli.main(argv) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"jaxpar {argv[0]}: "), err
    assert culprit.format(tmp=places) in err
    assert {id(a) for a in jax.live_arrays()} <= before  # no device memory touched


def test_an_option_is_declared_once_on_its_config_field(monkeypatch, capsys):
    """A field declared with ``flag`` on TrainConfig is an option of the commands it names, with its
    help, and the parsed value builds the config: a field added here reaches train and compile with
    no edit to the CLI. Nothing is compiled or run."""
    from jaxpar.flags import config_from_args, flag, given_flags
    from jaxpar.train import config

    @dataclasses.dataclass(frozen=True)
    class Probe(config.TrainConfig):
        probe_rate: float = flag(0.5, help="a probe's rate, declared by this test", commands=("train", "compile"))

    monkeypatch.setattr(config, "TrainConfig", Probe)  # where the CLI reads TrainConfig's options from
    for command, shown in (("train", True), ("compile", True), ("check", False)):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        usage = " ".join(capsys.readouterr().out.split())
        assert ("--probe-rate PROBE_RATE a probe's rate, declared by this test" in usage) == shown, usage
    args = cli._parser("train").parse_args(["train", "--probe-rate", "0.25", "--remat", "dots", "--schedule", "1f1b"])
    cfg = config_from_args(Probe, args, "train")
    assert (cfg.probe_rate, cfg.remat, cfg.schedule, cfg.learning_rate) == (0.25, "dots", "1f1b", 3e-3)  # a float, by its annotation
    assert given_flags(Probe, args, "train") == {"schedule": ("--schedule", "1f1b")}  # RunConfig.explicit: given on purpose
    assert config_from_args(Probe, cli._parser("compile").parse_args(["compile"]), "compile").remat == "full"  # a pod's default


def test_compile_exits_1_for_a_plan_that_does_not_fit_either_way(places, monkeypatch, capsys):
    """A plan that does not fit is a negative answer, not bad input: status 1 (as check's layout that
    differs) whether the report says DOES NOT FIT or XLA:TPU refuses to compile it. Nothing compiles here."""
    from jaxpar import aot

    report = {"memory_per_chip": {"fits": False, "peak": 3 * 2**20, "hbm": 2**20}}
    with monkeypatch.context() as patched:
        patched.setattr(aot, "compile_report", lambda *args, **kwargs: report)
        patched.setattr(aot, "format_report", lambda r: "memory per chip: DOES NOT FIT")
        argv = ["compile", "--model", "tiny", "--topology", "cpu-8", "--json", str(places / "plan.json")]
        assert cli.main(argv) == cli.EXIT_FAILED
    out, err = capsys.readouterr()
    assert "DOES NOT FIT" in out
    assert err == "jaxpar compile: the plan DOES NOT FIT: 3.0 MiB per chip, 1.0 MiB of HBM (the report above)\n"
    assert json.loads((places / "plan.json").read_text()) == report  # the report is written all the same

    def exhausted(self, batch):  # what XLA:TPU raises for a program larger than HBM
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 3.00M of 1.00M hbm.")

    monkeypatch.setattr(Trainer, "jit_step", exhausted)
    assert cli.main(["compile", "--model", "tiny", "--topology", "cpu-8", "--strategy", "fsdp=8"]) == cli.EXIT_FAILED
    err = capsys.readouterr().err
    assert err.startswith("jaxpar compile: tiny with batch 256 x 2048 under fsdp=8 does not fit on cpu-8: Ran out of memory")
    assert len(err.strip().splitlines()) == 1


def test_a_spec_needs_devices():
    with pytest.raises(SpecError, match="laid over 0 devices"):
        parse_strategy("fsdp=-1", 0)
    with pytest.raises(SpecError, match="laid over -2 devices"):
        parse_strategy("data=1", -2)


def test_stop_signals_stop_at_the_boundary_and_restore_the_handlers():
    """The handler the training loop installs, with a real SIGTERM sent to this process."""
    previous = signal.getsignal(signal.SIGTERM)
    with loop.StopSignals() as stop:
        assert signal.getsignal(signal.SIGTERM) == stop._caught
        os.kill(os.getpid(), signal.SIGTERM)  # delivered before os.kill returns; the handler runs next
        assert stop.name == "SIGTERM"
        assert signal.getsignal(signal.SIGTERM) == previous  # a second signal would act at once
    assert signal.getsignal(signal.SIGTERM) == previous
    with loop.StopSignals(active=False) as idle:  # several processes, or not the main thread
        assert signal.getsignal(signal.SIGTERM) == previous and idle.name is None
    assert cli.EXIT_ON_SIGNAL == {"SIGINT": 130, "SIGTERM": 143}


def _own_launch_dirs(root):
    return sorted(p for p in os.listdir(root) if p.startswith("jaxpar-launch-"))


@pytest.mark.parametrize(
    "script, status",
    [
        ("pass", cli.EXIT_OK),
        ("import sys; sys.exit(3)", cli.EXIT_FAILED),  # JobFailed: no restarts left
        ("import sys; sys.exit(2)", cli.EXIT_BAD_INPUT),  # the job refused its input: not restarted
        # the launcher itself is stopped: it stops the job (this sleeper) and cleans up on its way out
        ("import os, signal, time; os.kill(os.getppid(), signal.SIGTERM); time.sleep(60)", cli.EXIT_SIGTERM),
    ],
    ids=["done", "failed", "bad-input", "sigterm"],
)
def test_launcher_removes_its_status_directory_on_every_exit(script, status, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where launch makes its directory
    argv = ["launch", "--processes", "1", "--max-restarts", "1", "--", sys.executable, "-c", script]
    assert cli.main(argv) == status
    out, err = capsys.readouterr()
    assert "progress reports in " + str(tmp_path / "jaxpar-launch-") in out  # it did make one...
    assert _own_launch_dirs(tmp_path) == []  # ... and removed it
    assert ("restart 1 of 1" in out) == (status == cli.EXIT_FAILED)
    if status != cli.EXIT_OK:
        assert len(err.strip().splitlines()) == 1, err
    if status == cli.EXIT_BAD_INPUT:
        assert "exited with status 2: the command refused its input" in err


def test_metrics_file_honours_the_umask(tmp_path):
    path = tmp_path / "runs" / "metrics.json"
    old = os.umask(0o027)
    try:
        loop.write_json_atomically(str(path), {"losses": [1.0]})
    finally:
        os.umask(old)
    assert json.loads(path.read_text()) == {"losses": [1.0]}
    assert path.stat().st_mode & 0o777 == 0o640  # what open() gives any new file, not mkstemp's 0600
    assert os.listdir(path.parent) == ["metrics.json"]


def test_a_full_disk_is_one_message_and_leaves_nothing_behind(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)]).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        with open(disk / "filler", "wb", buffering=0) as filler, contextlib.suppress(OSError):
            while True:  # until the disk is full
                filler.write(bytes(4096))
        path = disk / "metrics.json"
        with pytest.raises(JobFailed) as failed:
            loop.write_json_atomically(str(path), {"losses": [1.0] * 1000})
        assert str(failed.value) == f"could not write {path} (No space left on device); free some space there or choose another path"
        assert os.listdir(disk) == ["filler"]  # no half-written file, no temporary
    finally:
        subprocess.run(["umount", str(disk)])
