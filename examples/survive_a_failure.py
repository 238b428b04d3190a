"""A 2-process job loses a process, restarts from its last checkpoint, and then continues on 4
devices in one process under another layout.

    python examples/survive_a_failure.py [WORKDIR] [--steps 30] [--checkpoint-every 10] [--kill-at 15]
                                         [--more-steps 10] [--batch-size 8] [--seq-len 64]
                                         # about 3 minutes on 2 CPU cores

1. `jaxpar launch --processes 2 --max-restarts 1 -- jaxpar train --strategy fsdp=8 ...` runs the
   tiny Llama as 2 jax.distributed processes of 4 simulated devices each, saving every 10 steps.
2. At step 15, once checkpoint 10 is complete, this script SIGKILLs process 1. The launcher names
   it, stops process 0 and starts the job again; it resumes from checkpoint 10 and finishes step 30.
3. `jaxpar train --topology cpu-4 --strategy data=2,tensor=2 --resume` reads checkpoint 30 into a
   tensor-parallel layout on 4 devices and trains on to step 40.

Exits with an error if the job does not recover, if the restart starts from scratch instead of a
checkpoint, or if the last run does not continue from the job's last checkpoint.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

# the jaxpar command of this Python, so that the example runs without the venv on PATH
JAXPAR = [sys.executable, "-m", "jaxpar.cli"]


def wait_and_kill(status: str, ckpt: str, kill_at: int, checkpoint: int, job: subprocess.Popen):
    """SIGKILL process 1 once it has reached step ``kill_at`` and checkpoint ``checkpoint`` is
    complete (orbax renames a checkpoint's directory to its step when the save is done)."""
    report = os.path.join(status, "process-1.json")
    while job.poll() is None:  # watch process 1's progress reports
        time.sleep(0.05)
        try:
            with open(report) as f:
                progress = json.load(f)
        except (OSError, ValueError):
            continue
        if progress["step"] >= kill_at and os.path.isdir(os.path.join(ckpt, str(checkpoint))):
            print(f"\n*** killing process 1 (pid {progress['pid']}) at step {progress['step']} ***\n", flush=True)
            try:
                os.kill(progress["pid"], signal.SIGKILL)
                return
            except ProcessLookupError:  # it has just finished
                break
    sys.exit(f"the job ended (status {job.wait()}) before process 1 could be killed; use more --steps")


def start_step(metrics_json: str) -> int:
    """The step a run of `jaxpar train` began at: 0 if it started afresh, else its checkpoint's."""
    with open(metrics_json) as f:
        return json.load(f)["start_step"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", nargs="?", help="for checkpoints and reports (default: a new temporary directory)")
    parser.add_argument("--steps", type=int, default=30, help="of the 2-process job")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--kill-at", type=int, default=15, help="the step process 1 is killed at")
    parser.add_argument("--more-steps", type=int, default=10, help="trained on 4 devices after the job")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()
    if not args.checkpoint_every <= args.kill_at < args.steps:
        parser.error("the kill must come after the first checkpoint and before the last step")
    workdir = args.workdir or tempfile.mkdtemp(prefix="jaxpar-example-")
    ckpt, status = os.path.join(workdir, "ckpt"), os.path.join(workdir, "status")
    job_metrics, last_metrics = os.path.join(workdir, "job.json"), os.path.join(workdir, "last.json")
    train = [*JAXPAR, "train", "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
             "--checkpoint-every", str(args.checkpoint_every), "--checkpoint-dir", ckpt]

    job = subprocess.Popen([*JAXPAR, "launch", "--processes", "2", "--max-restarts", "1", "--status-dir", status, "--",
                            *train, "--strategy", "fsdp=8", "--steps", str(args.steps), "--metrics-json", job_metrics])
    wait_and_kill(status, ckpt, args.kill_at, args.kill_at // args.checkpoint_every * args.checkpoint_every, job)
    if job.wait() != 0:
        sys.exit("the job did not recover")
    resumed = start_step(job_metrics)  # written by the attempt that finished
    if resumed == 0:
        sys.exit("the restarted job trained from scratch instead of resuming from a checkpoint")

    print("\n*** continuing on 4 devices, one process, data=2,tensor=2 ***\n", flush=True)
    subprocess.run([*train, "--topology", "cpu-4", "--strategy", "data=2,tensor=2", "--resume",
                    "--steps", str(args.steps + args.more_steps), "--metrics-json", last_metrics], check=True)
    continued = start_step(last_metrics)
    if continued != args.steps:
        sys.exit(f"the last run started at step {continued}, not at the job's last checkpoint {args.steps}")
    print(f"\nthe job restarted from checkpoint {resumed} after the kill; the last run continued from "
          f"checkpoint {continued} under data=2,tensor=2 to step {args.steps + args.more_steps}")


if __name__ == "__main__":
    main()
