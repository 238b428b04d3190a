"""Block parallelism (parallel/block.py, collectives/block_parallel.py): a block diffusion model's
noisy blocks split over devices in dual-end pairs, the clean half computed on every device.

Every layout trains like one device: the oracle and the comparison are test_equivalence's (3 steps,
SGD with momentum, gradient clipping; losses, first-step gradients and final weights within
|a - b| <= 1e-5 + 1e-4 |b| in float32; measured differences ~1e-6). Plain context parallelism of
the same model (the baseline BP is measured against) is held to the same oracle. Traffic is read
from the compiled HLO; attention work is counted from the mask each device evaluates.
"""
import dataclasses

import jax
import numpy as np
import pytest

from jaxpar import attention as A
from jaxpar.analysis import hlo
from jaxpar.collectives import block_parallel
from jaxpar.errors import JaxparError, LayoutError, SpecError
from jaxpar.models import bd3lm, llama
from jaxpar.parallel import build_layout, parse_strategy
from jaxpar.train import data
from jaxpar.train.loop import check_model_axes
from jaxpar.train.step import Trainer
from tests.test_equivalence import CFG, OPTIMIZER, STEPS, assert_same, oracle, sharded

MODEL = dataclasses.replace(bd3lm.CONFIGS["bd3lm-tiny"], layers=2)
ROWS, LENGTH, BLOCK_SIZE = 16, 64, 4  # 16 blocks per row: block=8 gives each device one pair


def diffusion_model(rngs):
    return bd3lm.BD3LM(MODEL, rngs=rngs)


def diffusion_loss(model, batch):
    return bd3lm.loss_fn(model, batch, BLOCK_SIZE)


@pytest.fixture(scope="module")
def host_batches():
    tokens = data.corpus_tokens(20_000)
    return [bd3lm.corrupt(data.batch_at(tokens, step, ROWS, LENGTH, seed=0)[:, :LENGTH], BLOCK_SIZE, (0, step), mask_id=MODEL.mask_id)
            for step in range(STEPS)]


@pytest.fixture(scope="module")
def one_device(host_batches):
    return oracle(diffusion_model, diffusion_loss, host_batches)


@pytest.mark.parametrize("strategy", ["block=2,data=4", "block=4,fsdp=2", "block=8", "block=2,tensor=2,fsdp=2",
                                      "context=4,fsdp=2"])  # the last: context parallelism, the baseline
def test_layout_trains_like_one_device(strategy, host_batches, one_device):
    assert_same(sharded(strategy, diffusion_model, diffusion_loss, host_batches), one_device)


def test_devices_own_dual_end_pairs_and_do_the_same_attention_work():
    owned = block_parallel.owned_blocks(16, 4)
    assert owned.tolist() == [[0, 4, 11, 15], [1, 5, 10, 14], [2, 6, 9, 13], [3, 7, 8, 12]]
    assert sorted(owned.ravel().tolist()) == list(range(16))  # each noisy block on one device
    # the query-key pairs each device's share allows under the three-part mask, counted token by token
    places = block_parallel.held_places(LENGTH, BLOCK_SIZE, 8)
    mask = bd3lm.block_diffusion_mask(LENGTH, BLOCK_SIZE)
    work = [int(np.asarray(mask.at(p).dense(len(p), len(p))).sum()) for p in places]
    assert len(set(work)) == 1, work
    # and together they compute every noisy query's attention of the whole mask once
    whole = np.asarray(mask.dense(2 * LENGTH, 2 * LENGTH))[0]
    noisy = sum(int(np.asarray(mask.at(p).dense(len(p), len(p)))[0, : LENGTH // 8].sum()) for p in places)
    assert noisy == int(whole[:LENGTH].sum())


def test_only_the_gradient_all_reduce_crosses_the_block_axis():
    # the clean keys and values are computed where they are read: no collective carries keys or
    # values, and over `block` only the weights' gradients (summed with data's) travel
    trainer = Trainer(build_layout(parse_strategy("block=4,data=2", 8)), diffusion_model, diffusion_loss, CFG, optimizer=OPTIMIZER)
    example = trainer.abstract_batch(ROWS, LENGTH, diffusion=True)
    text = trainer.jit_step(example).lower(trainer.abstract_state(), example).compile().as_text()
    cols = hlo.collectives(text, trainer.layout.mesh)
    assert {c.kind for c in cols} == {"all-reduce"}, sorted({(c.kind, c.mesh_axes) for c in cols})
    gradients = [c for c in cols if c.operand_bytes > 8]  # the loss and the norm are scalars
    assert {c.mesh_axes for c in gradients} == {("data", "block")}
    # every weight's gradient once, float32 (XLA may fold the scalar loss into the same tuple)
    assert 0 <= sum(c.operand_bytes * c.executions for c in gradients) - MODEL.num_params() * 4 <= 8


def test_bad_block_degrees_and_models_are_refused_with_the_valid_values():
    with pytest.raises(LayoutError, match=r"block=3 cannot split 16 diffusion blocks .* multiple of 2 x 3 = 6.* one of 1, 2, 4, 8"):
        block_parallel.check_degree(16, 3)
    with pytest.raises(LayoutError, match=r"block=4 cannot split 4 diffusion blocks.*\(more devices than pairs\).* one of 1, 2"):
        block_parallel.check_degree(4, 4)
    with pytest.raises(JaxparError, match=r"block axis is not supported by model tiny.*bd3lm-tiny.*e.g. --strategy data=8"):
        check_model_axes(parse_strategy("block=2,data=4", 8), "tiny")
    check_model_axes(parse_strategy("block=2,data=4", 8), "bd3lm-tiny")
    with pytest.raises(SpecError, match=r"block=2 with stage=2"):
        parse_strategy("block=2,stage=2,data=2", 8)

    # a model whose loss never takes its share: every device would compute the whole objective
    trainer = Trainer(build_layout(parse_strategy("block=2,data=4", 8)), lambda rngs: llama.Llama(llama.CONFIGS["tiny"], rngs=rngs),
                      llama.loss_fn, CFG)
    tokens = trainer.put_batch(np.zeros((8, 17), np.int32))
    with pytest.raises(LayoutError, match=r"never takes this device's share .* drop block="):
        jax.jit(trainer.grad_fn()).lower(trainer.abstract_state().params, tokens)


def test_attention_at_given_places_equals_the_whole_sequence():
    # the op evaluates any mask at a device's token places: a permuted sequence gives the permuted result
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(2, 32, heads, 8)).astype(np.float32) for heads in (4, 2, 2))
    order = rng.permutation(32)
    for mask in (bd3lm.block_diffusion_mask(16, 4), A.CAUSAL, A.Mask(causal=True, window=(5, 0))):
        whole = A.attention(q, k, v, mask, implementation="naive")
        for implementation in ("naive", "blockwise"):
            held = A.attention(q[:, order], k[:, order], v[:, order], mask.at(order), implementation=implementation, block_q=8, block_kv=8)
            np.testing.assert_allclose(held, np.asarray(whole)[:, order], atol=1e-5)
    with pytest.raises(JaxparError, match=r"splash.*cannot evaluate a mask at given token places.*use 'blockwise'"):
        A.choose_implementation("splash", A.CAUSAL.at(order))
