"""Expert parallelism (parallel/expert/): the MoE family's tokens exchanged over the expert axis.

Every layout trains like one device: the oracle and the comparison are test_equivalence's (3
steps, SGD with momentum, losses, first-step gradients and final weights within |a - b| <= 1e-5 +
1e-4 |b| in float32), dropless and with a capacity factor (the oracle drops the same copies: the
capacity is per row, earlier tokens first).
"""
import dataclasses

import pytest

from jaxpar.models import moe
from tests.test_equivalence import assert_same, batches, oracle, sharded, tokens  # noqa: F401 (tokens: a fixture)

TINY = moe.CONFIGS["moe-tiny"]
CAPPED = dataclasses.replace(TINY, capacity_factor=1.0)


def tiny_moe(rngs):
    return moe.MoE(TINY, rngs=rngs)


def capped_moe(rngs):
    return moe.MoE(CAPPED, rngs=rngs)


MODELS = {"dropless": tiny_moe, "capacity": capped_moe}


@pytest.fixture(scope="module")
def moe_oracles(tokens):  # noqa: F811
    return {name: oracle(fn, moe.loss_fn, batches(tokens)) for name, fn in MODELS.items()}


LAYOUTS = ["expert=8", "expert=4,fsdp=2", "expert=2,tensor=2,fsdp=2", "expert=2,context=2,fsdp=2"]


@pytest.mark.parametrize("routing", list(MODELS))
@pytest.mark.parametrize("strategy", LAYOUTS)
def test_expert_layout_matches_one_device(strategy, routing, tokens, moe_oracles):  # noqa: F811
    assert_same(sharded(strategy, MODELS[routing], moe.loss_fn, batches(tokens)), moe_oracles[routing])
