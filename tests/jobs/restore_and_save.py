"""Test job: restore a checkpoint under another layout (and process count) and save it again.

Run directly (one process) or under ``jaxpar launch`` (several). Usage:
    restore_and_save.py SOURCE_DIR DEST_DIR STRATEGY TOPOLOGY
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxpar import launch  # noqa: E402

launch.initialize()

from jaxpar.topology import load_topology  # noqa: E402
from jaxpar.train.checkpoint import CheckpointConfig, Checkpointer  # noqa: E402
from jaxpar.run import RunConfig, build_trainer  # noqa: E402

source, dest, strategy, topology = sys.argv[1:5]
trainer, _, _ = build_trainer(RunConfig(strategy=strategy), load_topology(topology))
state, meta = Checkpointer.existing(CheckpointConfig(source)).restore(trainer.abstract_state())
out = Checkpointer(CheckpointConfig(dest))
out.save(meta["step"], state, {k: v for k, v in meta.items() if k not in ("step", "arrays")} | {"strategy": strategy})
out.wait()
out.close()
