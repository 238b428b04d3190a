"""Golden sharding files: the logical names and the sharding of every weight and input of a
model under a layout on a pod, written once and compared on every test run, so that a change to a
rule, a strategy or the model that moves a tensor fails loudly instead of silently.

    python -m jaxpar.analysis.golden tests/golden     # rewrite them after an intended change
"""

from __future__ import annotations

import json
import pathlib
import sys


# (file stem, model, topology, strategy): llama3-8b on a v5p-256 slice and on two of them
CASES = (
    ("llama3-8b_tpu-v5p-256_fsdp", "llama3-8b", "tpu-v5p-256", "fsdp=-1"),
    ("llama3-8b_tpu-v5p-256_fsdp-tp", "llama3-8b", "tpu-v5p-256", "fsdp=-1,tensor=4"),
    ("llama3-8b_tpu-v5p-256x2_hsdp", "llama3-8b", "tpu-v5p-256x2", "data=2,fsdp=-1"),
)
BATCH, SEQ = 256, 2048


def sharding_table(model: str, topology_name: str, strategy_text: str) -> dict:
    """Lower the training step for the pod (TPU compile-only devices) and list its shardings."""
    from jaxpar import aot
    from jaxpar.models import llama
    from jaxpar.parallel import build_layout, parse_strategy
    from jaxpar.topology import load_topology
    from jaxpar.train.loop import model_config
    from jaxpar.train.step import TrainConfig, Trainer

    topology = load_topology(topology_name)
    devices = aot.tpu_devices(topology)
    strategy = parse_strategy(strategy_text, len(devices))
    layout = build_layout(strategy, devices, num_slices=topology.num_slices)
    cfg = model_config(model, "full")
    trainer = Trainer(layout, lambda rngs: llama.Llama(cfg, rngs=rngs), llama.loss_fn, TrainConfig(compute_dtype="bfloat16"))
    batch = trainer.abstract_batch(BATCH, SEQ)
    trainer.jit_step(batch).lower(trainer.abstract_state(), batch)  # the step must lower with them
    weights = {}
    for path, names in sorted(trainer.names.items()):
        weights["/".join(map(str, path))] = {
            "shape": list(trainer.abstract_leaf(path).shape),
            "logical": list(names),
            "stored": str(layout.spec(names, "param")),
            "optimizer": str(layout.spec(names, "optimizer")),
            "compute": str(layout.spec(tuple(None if n == "layers" else n for n in names), "compute")),
        }
    return {
        "model": model,
        "topology": topology_name,
        "strategy": str(strategy),
        "mesh": dict(layout.mesh.shape),
        "inputs": {"tokens": {"shape": list(batch.shape), "logical": ["batch", None], "sharding": str(batch.sharding.spec)}},
        "weights": weights,
    }


def write(folder: str):
    for stem, model, topology, strategy in CASES:
        path = pathlib.Path(folder) / f"{stem}.json"
        path.write_text(json.dumps(sharding_table(model, topology, strategy), indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    write(sys.argv[1] if len(sys.argv) > 1 else "tests/golden")
