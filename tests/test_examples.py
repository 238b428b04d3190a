"""The README's "Your own model" code runs as printed, and every script in examples/ runs at small
sizes and checks its own claim: it exits non-zero when the claim fails."""
import pathlib
import re

import jax
import numpy as np
import pytest
from conftest import run_example
from jax.sharding import PartitionSpec as P

ROOT = pathlib.Path(__file__).resolve().parent.parent


def readme_code(heading: str) -> str:
    """The one python code block in the README section under ``heading``."""
    text = (ROOT / "README.md").read_text()
    section = text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    return code


def test_readme_own_model_runs_as_printed():
    namespace = {}
    exec(compile(readme_code("## Your own model"), "README.md", "exec"), namespace)
    state, metrics, trainer = namespace["state"], namespace["metrics"], namespace["trainer"]
    assert np.isfinite(float(metrics["loss"]))
    assert jax.tree.map(lambda x: x.sharding, state.params) == trainer.state_shardings.params
    # under fsdp=4,tensor=2 the bias is split over tensor, like its kernel's columns
    assert state.params["up"]["bias"].sharding.spec == P("tensor")
    assert state.params["up"]["kernel"].sharding.spec == P("fsdp", "tensor")


# script, small sizes, a line its check prints when the claim holds
EXAMPLES = [
    pytest.param("train_own_model.py", ["--steps", "2", "--batch-size", "8", "--layouts", "data=8", "fsdp=4,tensor=2"],
                 "largest relative difference from data=8", id="train_own_model"),
    pytest.param("own_moe.py", ["--steps", "2", "--batch-size", "8"], "largest relative difference from one device",
                 id="own_moe"),
    pytest.param("cross_mesh_reshard.py", [], "moved: values equal", id="cross_mesh_reshard"),
    pytest.param("verify_wide.py", ["--width", "256", "--layers", "4", "--budget-mib", "1.8"],
                 "fsdp=8 and tensor=4 bound the network one device cannot hold", id="verify_wide"),
    pytest.param("mpmd_pipeline.py", ["--steps", "2", "--microbatches", "2", "--rows", "4", "--seq-len", "16"],
                 "the loss fell from", id="mpmd_pipeline"),
    # (12 steps take the captions' loss below a guess without the image: 2.53 against 2.71)
    pytest.param("multimodal_pipeline.py", ["--steps", "12"], "below a guess without the image", id="multimodal_pipeline"),
    pytest.param("pipedream.py", ["--microbatches", "4", "--seq-len", "8"], "largest difference from the simulation",
                 id="pipedream"),
    # 20 steps take the loss from 6 to about 3.5: enough for a biased or too coarse compression to
    # leave exact sync's curve by more than the 1% the example allows (BENCHMARKS.md has 300 steps);
    # int8 is left out here (test_grad_sync checks it is the naive 8-bit quantizer)
    pytest.param("compressed_grad_sync.py", ["--steps", "20", "--batch-size", "8", "--seq-len", "32", "--warmup-steps", "5",
                                             "--syncs", "exact", "dynamiq"],
                 "dynamiq trains like exact sync", id="compressed_grad_sync"),
    pytest.param("serve_delayed_tp.py", ["--steps", "0", "--new-tokens", "4", "--tensor", "2"],
                 "checked: the placement leaves TP's function unchanged", id="serve_delayed_tp"),
]  # survive_a_failure.py runs in test_multihost, against its uninterrupted job; pod_plans.py in test_compile


@pytest.mark.parametrize("script, args, line", EXAMPLES)
def test_example_checks_its_claim(script, args, line):
    assert line in run_example(script, *args)


def test_own_data_example_checks_its_claim(tmp_path):
    """examples/own_data.py: a corpus in three formats, a BPE tokenizer trained on it, a run file;
    the held-out loss falls, and a plain Flax model fed by jaxpar.corpus trains under
    fsdp=4,tensor=2 as on one device."""
    out = run_example("own_data.py", "--dir", str(tmp_path / "run"), "--steps", "8", compile_bound=True)
    assert "held-out loss by step: 2:" in out and "fsdp=4,tensor=2 against one device" in out


def test_hf_weights_example_checks_its_claim(tmp_path):
    """examples/hf_weights.py: a trained Llama out to the Hugging Face layout in several files and
    back, bitwise; the fine-tune from it starts where the training left off."""
    out = run_example("hf_weights.py", "--dir", str(tmp_path / "run"), "--steps", "6", compile_bound=True)
    assert "weights bitwise equal to the trained ones" in out and "the fine-tune starts at" in out
