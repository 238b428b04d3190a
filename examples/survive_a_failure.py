"""A 2-process job loses a process, restarts from its last checkpoint, and then continues on 4
devices in one process under another layout.

    python examples/survive_a_failure.py [WORKDIR]      # about 3 minutes on 2 CPU cores

1. `jaxpar launch --processes 2 --max-restarts 1 -- jaxpar train --strategy fsdp=8 ...` runs the
   tiny Llama as 2 jax.distributed processes of 4 simulated devices each, saving every 10 steps.
2. At step 15 this script SIGKILLs process 1. The launcher names it, stops process 0 and starts
   the job again; it resumes from checkpoint 10 and finishes step 30.
3. `jaxpar train --topology cpu-4 --strategy data=2,tensor=2 --resume` reads checkpoint 30 into a
   tensor-parallel layout on 4 devices and trains on to step 40.
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

TRAIN = ["jaxpar", "train", "--batch-size", "8", "--seq-len", "64", "--checkpoint-every", "10"]


def main(workdir: str):
    ckpt, status = os.path.join(workdir, "ckpt"), os.path.join(workdir, "status")
    job = subprocess.Popen(
        ["jaxpar", "launch", "--processes", "2", "--max-restarts", "1", "--status-dir", status, "--",
         *TRAIN, "--strategy", "fsdp=8", "--steps", "30", "--checkpoint-dir", ckpt]
    )
    report = os.path.join(status, "process-1.json")
    while True:  # watch process 1's progress reports
        time.sleep(0.05)
        try:
            with open(report) as f:
                progress = json.load(f)
        except (OSError, ValueError):
            continue
        if progress["step"] >= 15:
            print(f"\n*** killing process 1 (pid {progress['pid']}) at step {progress['step']} ***\n", flush=True)
            os.kill(progress["pid"], signal.SIGKILL)
            break
    if job.wait() != 0:
        sys.exit("the job did not recover")
    print("\n*** continuing on 4 devices, one process, data=2,tensor=2 ***\n", flush=True)
    subprocess.run([*TRAIN, "--topology", "cpu-4", "--strategy", "data=2,tensor=2", "--steps", "40",
                    "--checkpoint-dir", ckpt, "--resume"], check=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="jaxpar-example-"))
