"""Golden sharding files (tests/golden/): llama3-8b on a v5p-256 slice under FSDP and FSDP+TP, and
HSDP over two slices. A change that moves any weight or input to another sharding fails here;
after an intended change, rewrite them with `python -m jaxpar.analysis.golden tests/golden`."""
import json
import pathlib

import pytest

from jaxpar.analysis import golden

FOLDER = pathlib.Path(__file__).parent / "golden"


@pytest.mark.tpu_aot
@pytest.mark.parametrize("case", golden.CASES, ids=[c[0] for c in golden.CASES])
def test_shardings_match_the_golden_file(case):
    pytest.importorskip("libtpu", reason="pip install -e .[tpu] brings the TPU compiler")
    stem, model, topology, strategy = case
    expected = json.loads((FOLDER / f"{stem}.json").read_text())
    actual = golden.sharding_table(model, topology, strategy)
    moved = [w for w in expected["weights"] if expected["weights"][w] != actual["weights"].get(w)]
    assert not moved, f"{stem}: these weights changed layout: {moved}"
    assert actual == expected


def test_golden_files_cover_every_weight_of_the_model():
    # independent of libtpu: the files list each llama3-8b weight once, with a name per dim
    from jaxpar.models import llama
    from jaxpar.train.step import abstract_model

    _, state = abstract_model(lambda r: llama.Llama(llama.CONFIGS["llama3-8b"], rngs=r))
    from flax import nnx

    shapes = {"/".join(map(str, p)): list(v.get_value().shape) for p, v in nnx.to_flat_state(state)}
    for stem, *_ in golden.CASES:
        weights = json.loads((FOLDER / f"{stem}.json").read_text())["weights"]
        assert {w: e["shape"] for w, e in weights.items()} == shapes
        assert all(len(e["logical"]) == len(e["shape"]) for e in weights.values())
