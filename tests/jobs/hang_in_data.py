"""Test job: ``jaxpar`` with the given arguments, where process 1 hangs while it reads the batch
of step STEP (as a process stuck on a file system would). Usage:
    hang_in_data.py STEP JAXPAR_ARGS...
"""

import os
import sys
import time

from jaxpar import cli
from jaxpar.train import data

hang_at = int(sys.argv[1])
read_rows = data.local_batch_at


def local_batch_at(tokens, step, *args):
    if step + 1 == hang_at and os.environ.get("JAXPAR_PROCESS_ID") == "1":
        time.sleep(3600)
    return read_rows(tokens, step, *args)


data.local_batch_at = local_batch_at
sys.exit(cli.main(sys.argv[2:]))
