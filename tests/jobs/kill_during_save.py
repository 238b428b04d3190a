"""Test job: run ``jaxpar`` with the given arguments and SIGKILL it at the moment orbax would
commit checkpoint STEP (all its files written, the final rename not yet done). Usage:
    kill_during_save.py STEP JAXPAR_ARGS...
"""

import os
import signal
import sys

from orbax.checkpoint._src.path import async_path

from jaxpar import cli

step = sys.argv[1]
commit = async_path.rename


async def rename_or_die(src, dst, *args, **kwargs):
    if os.path.basename(str(dst)) == step:
        os.kill(os.getpid(), signal.SIGKILL)
    return await commit(src, dst, *args, **kwargs)


async_path.rename = rename_or_die
sys.exit(cli.main(sys.argv[2:]))
