"""Golden sharding files (tests/golden/): the logical names and the sharding of every weight and
input of llama3-8b on a v5p-256 slice under FSDP and FSDP+TP, and HSDP over two slices. A change to
a rule, a strategy or the model that moves any weight or input to another sharding fails here; after
an intended change, rewrite them with `python tests/test_golden.py` (needs libtpu)."""
import json
import pathlib
import sys

import pytest

FOLDER = pathlib.Path(__file__).parent / "golden"

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
    from jaxpar.models import llama, model_config
    from jaxpar.parallel import build_layout, parse_strategy
    from jaxpar.topology import load_topology
    from jaxpar.train.step import TrainConfig, Trainer

    topology = load_topology(topology_name)
    devices = aot.tpu_devices(topology)
    strategy = parse_strategy(strategy_text, len(devices))
    layout = build_layout(strategy, devices, num_slices=topology.num_slices)
    cfg = model_config(model)
    trainer = Trainer(layout, lambda rngs: llama.Llama(cfg, rngs=rngs), llama.loss_fn, TrainConfig(compute_dtype="bfloat16", remat="full"))
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


@pytest.mark.tpu_aot
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_shardings_match_the_golden_file(case):
    pytest.importorskip("libtpu", reason="pip install -e .[tpu] brings the TPU compiler")
    stem, model, topology, strategy = case
    expected = json.loads((FOLDER / f"{stem}.json").read_text())
    actual = sharding_table(model, topology, strategy)
    moved = [w for w in expected["weights"] if expected["weights"][w] != actual["weights"].get(w)]
    assert not moved, f"{stem}: these weights changed layout: {moved}"
    assert actual == expected


def test_golden_files_cover_every_weight_of_the_model():
    # independent of libtpu: the files list each llama3-8b weight once, with a name per dim
    from jaxpar.models import llama
    from jaxpar.train.state import abstract_model

    _, state = abstract_model(lambda r: llama.Llama(llama.CONFIGS["llama3-8b"], rngs=r))
    from flax import nnx

    shapes = {"/".join(map(str, p)): list(v.get_value().shape) for p, v in nnx.to_flat_state(state)}
    for stem, *_ in CASES:
        weights = json.loads((FOLDER / f"{stem}.json").read_text())["weights"]
        assert {w: e["shape"] for w, e in weights.items()} == shapes
        assert all(len(e["logical"]) == len(e["shape"]) for e in weights.values())


def write(folder: pathlib.Path):
    for stem, model, topology, strategy in CASES:
        path = folder / f"{stem}.json"
        path.write_text(json.dumps(sharding_table(model, topology, strategy), indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    write(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else FOLDER)
