"""Goodput under faults: the main job as 4 decoupled learners against synchronous HSDP, one
process killed and another slowed in each.

    python examples/decoupled_learners.py [WORKDIR] [--steps 24] [--local-steps 4] [--kill-at 6]
                                          [--slow 0.5] [--quorum 3] [--grace 2] [--batch-size 8]
                                          [--seq-len 64] [--baseline]  # about 4 minutes on 2 CPU cores

1. `jaxpar launch --learners 4 --quorum 3 --grace 2 --max-restarts 1 -- jaxpar train --strategy
   "federation=4,fsdp=2,local_steps=4" ...`: 4 learner processes of 2 simulated devices each and a
   syncer that merges a round once 3 have reported and the grace window has passed.
2. `jaxpar launch --processes 4 --max-restarts 1 -- jaxpar train --strategy "data=4,fsdp=2"
   --checkpoint-every 4 ...`: the same model, devices and global batches as one synchronous job.

In each, this script SIGKILLs the second process (learner 1, or process 1) once it reaches step
``--kill-at``, and slows the third (learner 2, or process 2) for the whole run: it is stopped
(SIGSTOP) for ``--slow`` of every second, as a straggler shares its host. The launcher restarts a
killed process: the learner from the newest merged model, the synchronous job whole from its last
checkpoint. Goodput is the tokens that reach the final model per second of the job's wall time
(a dropped report's tokens do not count); each run's held-out loss is its report's. ``--baseline``
runs both again without faults and gives each goodput as a share of its own fault-free one. Exits
with an error if either job fails or if the decoupled learners' goodput is not the higher.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

# the jaxpar command of this Python, so that the example runs without the venv on PATH
JAXPAR = [sys.executable, "-m", "jaxpar.cli"]


def progress(status: str, task: int) -> dict | None:
    try:
        with open(os.path.join(status, f"process-{task}.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def signal_quietly(pid: int, sig):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:  # it has just ended or been restarted
        pass


def faults(status: str, victim: int, straggler: int, kill_at: int, slow: float, job: subprocess.Popen):
    """Kill process ``victim`` once at step ``kill_at``; keep ``straggler`` stopped ``slow`` of
    every second; both found by their progress reports in ``status`` (a restart's new pid too)."""
    killed = False
    while job.poll() is None:
        mine = progress(status, victim)
        if not killed and mine and mine["step"] >= kill_at:
            print(f"\n*** killing task {victim} (pid {mine['pid']}) at step {mine['step']} ***\n", flush=True)
            signal_quietly(mine["pid"], signal.SIGKILL)
            killed = True
        slowed = progress(status, straggler)
        if slowed and slow:
            signal_quietly(slowed["pid"], signal.SIGSTOP)
            time.sleep(slow)
            signal_quietly(slowed["pid"], signal.SIGCONT)
        time.sleep(1.0 - slow if slow else 0.05)
    if not killed:
        sys.exit(f"the job ended before task {victim} reached step {kill_at}; use more --steps")


def run(name: str, launch: list, train: list, status: str, victim: int, straggler: int, args, faulty: bool) -> float:
    """Launch one job, with its faults if ``faulty``; its wall time in seconds."""
    print(f"\n*** {name}{'' if faulty else ', no faults'} ***\n", flush=True)
    began = time.perf_counter()
    job = subprocess.Popen([*JAXPAR, "launch", *launch, "--max-restarts", "1", "--status-dir", status, "--", *train])
    watcher = threading.Thread(target=faults, args=(status, victim, straggler, args.kill_at, args.slow, job))
    if faulty:
        watcher.start()
    code = job.wait()
    if faulty:
        watcher.join()
    if code != 0:
        sys.exit(f"{name} failed (status {code})")
    return time.perf_counter() - began


def both(args, workdir: str, faulty: bool) -> dict:
    """{name: (tokens in the final model, seconds, its report)} of the decoupled and the synchronous job."""
    where = os.path.join(workdir, "faults" if faulty else "clean")
    common = [*JAXPAR, "train", "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len)]
    learners = ["--learners", "4", "--quorum", str(args.quorum), "--grace", str(args.grace)]
    decoupled = [*common, "--strategy", f"federation=4,fsdp=2,local_steps={args.local_steps}",
                 "--checkpoint-dir", os.path.join(where, "decoupled"), "--metrics-json", os.path.join(where, "decoupled.json")]
    seconds = {"decoupled": run("4 decoupled learners", learners, decoupled, os.path.join(where, "s1"), 2, 3, args, faulty)}
    synchronous = [*common, "--strategy", "data=4,fsdp=2", "--checkpoint-every", str(args.local_steps),
                   "--checkpoint-dir", os.path.join(where, "synchronous"), "--metrics-json", os.path.join(where, "synchronous.json")]
    seconds["synchronous"] = run("synchronous HSDP", ["--processes", "4"], synchronous, os.path.join(where, "s2"), 1, 2, args, faulty)
    reports = {name: json.load(open(os.path.join(where, f"{name}.json"))) for name in seconds}
    tokens = {"decoupled": reports["decoupled"]["useful_tokens"], "synchronous": args.steps * args.batch_size * args.seq_len}
    return {name: (tokens[name], seconds[name], reports[name]) for name in seconds}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", nargs="?", help="for checkpoints and reports (default: a new temporary directory)")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--local-steps", type=int, default=4, help="between merges (and the synchronous job's checkpoints)")
    parser.add_argument("--kill-at", type=int, default=6)
    parser.add_argument("--slow", type=float, default=0.5, help="of every second the straggler is stopped")
    parser.add_argument("--quorum", type=int, default=3)
    parser.add_argument("--grace", type=float, default=2.0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--baseline", action="store_true", help="also run both without faults: goodput as a share of that")
    args = parser.parse_args()
    if not 0 <= args.slow < 1 or not 0 < args.kill_at < args.steps:
        parser.error("--slow must be in [0, 1) and --kill-at between 0 and --steps")
    workdir = args.workdir or tempfile.mkdtemp(prefix="jaxpar-example-")
    runs = {True: both(args, workdir, True)}
    if args.baseline:
        runs[False] = both(args, workdir, False)
    print()
    goodput = {}
    for faulty, jobs in runs.items():
        for name, (tokens, seconds, report) in jobs.items():
            goodput[name, faulty] = tokens / seconds
            print(f"{name:>11}, {'with' if faulty else 'without'} faults: {tokens:,} tokens in the final model in {seconds:.1f} s: "
                  f"goodput {goodput[name, faulty]:,.0f} tokens/s; held-out loss {report['held_out_loss']:.4f}")
    for name in runs[True] if args.baseline else ():
        print(f"{name:>11}: goodput under the faults {goodput[name, True] / goodput[name, False]:.0%} of its own without them")
    dropped = runs[True]["decoupled"][2]["dropped"]
    print(f"the decoupled learners dropped {len(dropped)} late reports ([round, learner]: {dropped}); under the faults "
          f"their goodput is {goodput['decoupled', True] / goodput['synchronous', True]:.2f}x the synchronous job's")
    if goodput["decoupled", True] <= goodput["synchronous", True]:
        sys.exit("the decoupled learners' goodput is not above the synchronous job's")


if __name__ == "__main__":
    main()
