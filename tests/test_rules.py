"""Rules and layouts: the mappings each strategy gives, and the errors for bad input."""
import dataclasses
import gc
import jax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar.errors import LayoutError, SpecError
from jaxpar.models import llama
from jaxpar.parallel import build_layout, parse_strategy
from jaxpar.train.step import Trainer

TINY = llama.CONFIGS["tiny"]


def layout(text, **kw):
    return build_layout(parse_strategy(text, 8), **kw)


def test_fsdp_stores_more_sharded_than_it_computes():
    lay = layout("fsdp=4,tensor=2")
    names = ("embed", "mlp")
    assert lay.spec(names, "param") == P("fsdp", "tensor")
    assert lay.spec(names, "compute") == P(None, "tensor")
    assert lay.spec(("batch", "length", "embed")) == P("fsdp")


@pytest.mark.parametrize(
    "text, param, grad, optimizer",
    [
        ("fsdp=8,zero=1", P(), P(), P("fsdp")),
        ("fsdp=8,zero=2", P(), P("fsdp"), P("fsdp")),
        ("fsdp=8,zero=3", P("fsdp"), P("fsdp"), P("fsdp")),
        ("data=8", P(), P(), P()),
        ("data=2,fsdp=4", P("fsdp"), P("fsdp"), P("fsdp")),
    ],
)
def test_zero_stages_shard_what_the_table_says(text, param, grad, optimizer):
    lay = layout(text)
    assert (lay.spec(("embed",), "param"), lay.spec(("embed",), "grad"), lay.spec(("embed",), "optimizer")) == (param, grad, optimizer)


def test_sequence_parallel_shards_the_residual_stream_only():
    lay = layout("data=2,tensor=4,sp=on")
    assert lay.spec(("batch", "residual_length", "embed")) == P("data", "tensor")
    assert lay.spec(("batch", "length", "embed")) == P("data")


@pytest.mark.parametrize(
    "text, error, culprit",
    [
        ("tensor=2,sp=on,data=3", SpecError, "multiplies to 6"),
        ("data=8,zero=1", SpecError, "fsdp=1"),
        ("fsdp=8,sp=on", SpecError, "tensor=1"),
        ("fsdp=8,zero=4", SpecError, "zero=.4.: not a ZeRO stage"),
        ("fsdp=8,regather=maybe", SpecError, "on or off"),
        ("fsdp=8,param_shards=3", SpecError, "param_shards=3 must divide fsdp=8"),
        ("fsdp=8,param_shards=8", SpecError, "strictly between 1 and 8"),
        ("fsdp_group=2,fsdp=4", SpecError, "write fsdp=N,param_shards=P"),
        ("fsdp=8,zero=1,param_shards=4", SpecError, "hierarchical ZeRO is ZeRO-3"),
    ],
)
def test_bad_strategies(text, error, culprit):
    with pytest.raises(error, match=culprit):
        parse_strategy(text, 8)


def _no_new_arrays(fn):
    """Run fn (which must raise) and check that no device memory was allocated. (Garbage that an
    earlier test left is collected first: a collection during fn would free arrays fn never made.)"""
    gc.collect()
    before = len(jax.live_arrays())
    with pytest.raises(LayoutError) as info:
        fn()
    gc.collect()
    assert len(jax.live_arrays()) == before
    return str(info.value)


def test_indivisible_dim_names_weight_dim_and_axes():
    # tensor=8 cannot split an MLP 100 wide (4 key/value heads it keeps whole instead: GQA)
    narrow = dataclasses.replace(TINY, mlp=100)
    msg = _no_new_arrays(lambda: Trainer(layout("tensor=8"), lambda r: llama.Llama(narrow, rngs=r), llama.loss_fn))
    assert "layers/w_down" in msg and "'mlp'" in msg and "size 100" in msg and "('tensor',)" in msg


def test_two_rules_on_one_mesh_axis_is_an_error():
    lay = layout("fsdp=4,tensor=2", extra_rules={"embed": ("tensor",)})
    msg = _no_new_arrays(lambda: Trainer(lay, lambda r: llama.Llama(TINY, rngs=r), llama.loss_fn))
    assert "'embed'" in msg and "'tensor'" in msg and "both map" in msg


class UnknownName(nnx.Module):
    def __init__(self, rngs):
        init = nnx.with_partitioning(nnx.initializers.ones, ("embed", "widgets"))
        self.w = nnx.Param(init(rngs.params(), (8, 8)))

    def __call__(self, x):
        return x @ self.w[...]


def test_logical_name_without_rule_is_an_error():
    msg = _no_new_arrays(lambda: Trainer(layout("fsdp=8"), UnknownName, lambda m, b: (m(b) ** 2).mean()))
    assert "'widgets'" in msg and "weight w" in msg and "add a rule" in msg
