"""Block parallelism (parallel/block.py, collectives/block_parallel.py): a block diffusion model's
noisy blocks split over devices in dual-end pairs, the clean half computed on every device (BP) or
split over a context ring whose keys and values travel while the noisy ones stay (CSBP), or, for a
model with a sliding window, fetched in one all-to-all where a block reads it (clean_kv=fetch).

Every layout trains like one device: the oracle and the comparison are test_equivalence's (3 steps,
SGD with momentum, gradient clipping; losses, first-step gradients and final weights within
|a - b| <= 1e-5 + 1e-4 |b| in float32; measured differences ~1e-6). Plain context parallelism of
the same model (the baseline BP is measured against) is held to the same oracle. Traffic is read
from the compiled HLO; attention work is counted from the mask each device evaluates.
"""
import dataclasses
import functools

import jax
import numpy as np
import pytest

from jaxpar import attention as A
from jaxpar.analysis import hlo
from jaxpar.parallel.block import blocks as block_parallel
from jaxpar.errors import JaxparError, LayoutError, SpecError
from jaxpar.models import bd3lm, llama
from jaxpar.parallel import build_layout, check_model, parse_strategy
from jaxpar.train import data
from jaxpar.models import model_config
from jaxpar.run import check_model_axes
from jaxpar.train.step import Trainer
from jaxpar.report import step_report
from jaxpar.parallel.block import summary as block_summary
from tests.test_equivalence import CFG, OPTIMIZER, STEPS, assert_same, oracle, sharded

ROWS, LENGTH, BLOCK_SIZE = 16, 64, 4  # 16 blocks per row: block=8 gives each device one pair
MODEL = dataclasses.replace(bd3lm.CONFIGS["bd3lm-tiny"], layers=2, block_size=BLOCK_SIZE)
WINDOWED = dataclasses.replace(MODEL, window=2 * BLOCK_SIZE)  # each block reads the 2 clean blocks before it


def diffusion_model(rngs):
    return bd3lm.BD3LM(MODEL, rngs=rngs)


def windowed_model(rngs):
    return bd3lm.BD3LM(WINDOWED, rngs=rngs)


@functools.cache
def host_batches():
    tokens = data.corpus_tokens(20_000)
    return [bd3lm.corrupt(data.batch_at(tokens, step, ROWS, LENGTH, seed=0)[:, :LENGTH], BLOCK_SIZE, (0, step), mask_id=MODEL.mask_id)
            for step in range(STEPS)]


@functools.cache
def one_device(model_fn):
    return oracle(model_fn, bd3lm.loss_fn, host_batches())


@functools.cache
def trained(strategy, model_fn=diffusion_model):
    """(the layout's Trainer, its 3 steps' losses, first gradients, final weights): shared by the
    tests that read the program that ran."""
    trainer = Trainer(build_layout(parse_strategy(strategy, 8)), model_fn, bd3lm.loss_fn, CFG, optimizer=OPTIMIZER)
    return trainer, sharded(trainer, model_fn, bd3lm.loss_fn, host_batches())


def compiled_collectives(trainer):
    example = trainer.abstract_batch(ROWS, LENGTH, fields=bd3lm.FAMILY.batch_fields(LENGTH))
    step = trainer._step or trainer.jit_step(example)  # the program that ran, or compiled here
    return hlo.collectives(step.lower(trainer.abstract_state(), example).compile().as_text(), trainer.layout.mesh)


@pytest.mark.parametrize("strategy, model_fn", [
    *[(s, diffusion_model) for s in ("block=2,data=4", "block=4,data=2", "block=8")],  # BP
    *[(s, diffusion_model) for s in ("block=4,context=4,data=2", "block=8,context=8")],  # matched CSBP
    *[(s, diffusion_model) for s in ("block=4,context=2,data=2", "block=8,context=4", "block=2,context=2,fsdp=2,tensor=2")],  # CSBP, P > C
    ("block=8,context=4,clean_kv=fetch", windowed_model),  # CSBP under a sliding window, fetched in one all-to-all
    ("context=4,fsdp=2", diffusion_model),  # context parallelism, the baseline
], ids=lambda x: x if isinstance(x, str) else x.__name__)
def test_layout_trains_like_one_device(strategy, model_fn):
    assert_same(trained(strategy, model_fn)[1], one_device(model_fn))


def test_devices_own_dual_end_pairs():
    owned = block_parallel.owned_blocks(16, 4)
    assert owned.tolist() == [[0, 4, 11, 15], [1, 5, 10, 14], [2, 6, 9, 13], [3, 7, 8, 12]]
    assert sorted(owned.ravel().tolist()) == list(range(16))  # each noisy block on one device


@pytest.mark.parametrize("ranks, ring", [(8, 1), (4, 1), (8, 4), (4, 2), (8, 2)])
def test_every_device_does_the_same_attention_work(ranks, ring):
    # the query-key pairs each device's queries may attend to under the three-part mask, counted
    # token by token against every key of [x_t ; x_0]: equal within one block's pairs (here exactly)
    mask = bd3lm.block_diffusion_mask(LENGTH, BLOCK_SIZE)
    every_key = np.arange(2 * LENGTH)
    places = block_parallel.held_places(LENGTH, BLOCK_SIZE, ranks, ring)
    work = np.array([int(np.asarray(mask.at(p, every_key).dense(len(p), 2 * LENGTH)).sum()) for p in places])
    assert work.max() - work.min() <= BLOCK_SIZE * BLOCK_SIZE, work
    np.testing.assert_array_equal(block_parallel.attention_work(LENGTH, BLOCK_SIZE, ranks, ring), work)  # the report's count
    # together the devices ask every noisy query's attention of the whole mask once, and the clean
    # queries': on a ring once (a rank's P / C devices each hold a piece of its share), without one
    # on every device, up to the last clean block, which no noisy block reads
    whole = np.asarray(mask.dense(2 * LENGTH, 2 * LENGTH))[0]
    clean = whole[LENGTH:].sum() if ring > 1 else ranks * whole[LENGTH:2 * LENGTH - BLOCK_SIZE].sum()
    assert work.sum() == whole[:LENGTH].sum() + clean


def test_only_the_gradient_all_reduce_crosses_the_block_axis():
    # the clean keys and values are computed where they are read: no collective carries keys or
    # values, and over `block` only the weights' gradients (summed with data's) travel
    cols = compiled_collectives(trained("block=4,data=2")[0])
    assert {c.kind for c in cols} == {"all-reduce"}, sorted({(c.kind, c.mesh_axes) for c in cols})
    gradients = [c for c in cols if c.operand_bytes > 8]  # the loss and the norm are scalars
    assert {c.mesh_axes for c in gradients} == {("data", "block")}
    # every weight's gradient once, float32 (XLA may fold the scalar loss into the same tuple)
    assert 0 <= sum(c.operand_bytes * c.executions for c in gradients) - MODEL.num_params() * 4 <= 8


def ring_permutes(cols):
    return [c for c in cols if c.kind == "collective-permute"]


def clean_ring_bytes_per_layer(ring: int, travelling: int) -> float:
    """The ring's formula for ``travelling`` tokens of every row split over ``ring`` ranks, float32
    K/V: forward (C-1)/C of the K/V, backward the same again plus the float32 K/V gradients, C hops
    of 1/C (the last one home)."""
    kv = 2 * ROWS * travelling * MODEL.kv_heads * MODEL.head_dim * 4
    return 2 * (ring - 1) / ring * kv + kv


@pytest.mark.parametrize("ranks, ring", [(4, 4), (8, 8), (8, 4), (8, 2)])
def test_each_device_holds_2l_over_p_tokens_and_each_clean_token_is_computed_once(ranks, ring):
    # CSBP: every device holds its N/P noisy blocks and L/P clean tokens; across the P devices each
    # noisy and each clean place is held once (with P > C a ring rank's share is split over its P/C
    # devices, not recomputed on each), and a rank's pieces put side by side are its ring share
    places = block_parallel.held_places(LENGTH, BLOCK_SIZE, ranks, ring)
    assert places.shape == (ranks, 2 * LENGTH // ranks)
    assert sorted(places.ravel().tolist()) == list(range(2 * LENGTH))
    share = block_parallel.clean_places(LENGTH, ring, ranks // ring)
    for rank in range(ring):
        np.testing.assert_array_equal(places[rank::ring, LENGTH // ranks:].ravel(), share[rank])
    # pure BP: the clean half up to the last block, which no noisy block reads, on every device
    pure = block_parallel.held_places(LENGTH, BLOCK_SIZE, ranks)
    np.testing.assert_array_equal(pure[:, LENGTH // ranks:], np.broadcast_to(np.arange(LENGTH, 2 * LENGTH - BLOCK_SIZE), (ranks, LENGTH - BLOCK_SIZE)))


def test_matched_csbp_sends_only_clean_keys_and_values_half_of_context_parallelism():
    # block=8,context=8: every collective-permute moves one ring rank's clean K or V (or their
    # gradients), L / P positions, over `context` only; the noisy blocks' K/V never travel (no other
    # collective but the gradient all-reduce); per layer the clean ring's formula, and against
    # context=8 of the same model and batch ([x_t ; x_0] over the ring) at most 0.55x the bytes
    ranks = 8
    cols = compiled_collectives(trained(f"block={ranks},context={ranks}")[0])
    assert {c.kind for c in cols} == {"collective-permute", "all-reduce"}
    permutes = ring_permutes(cols)
    assert {c.mesh_axes for c in permutes} == {("context",)}
    assert {c.operand_bytes for c in permutes} == {ROWS * LENGTH // ranks * MODEL.kv_heads * MODEL.head_dim * 4}
    csbp = sum(c.bytes_per_step for c in permutes)
    assert csbp == pytest.approx(MODEL.layers * clean_ring_bytes_per_layer(ranks, LENGTH), rel=1e-9)
    cp = Trainer(build_layout(parse_strategy(f"context={ranks}", 8)), diffusion_model, bd3lm.loss_fn, CFG, optimizer=OPTIMIZER)
    cp_bytes = sum(c.bytes_per_step for c in ring_permutes(compiled_collectives(cp)))
    assert cp_bytes == pytest.approx(MODEL.layers * clean_ring_bytes_per_layer(ranks, 2 * LENGTH), rel=1e-9)
    assert csbp <= 0.55 * cp_bytes, (csbp, cp_bytes)


def test_with_more_devices_than_ring_ranks_the_pieces_are_gathered_not_recomputed():
    # block=8,context=4: the ring carries each rank's clean share (L / C positions) as under
    # matched CSBP; a rank's 2 devices first all-gather their pieces' K/V over `block` (again under
    # remat) and reduce-scatter the gradients back: (G-1)/G of the share's K and V, G = P / C
    ranks, ring = 8, 4
    trainer = trained(f"block={ranks},context={ring}")[0]
    cols = compiled_collectives(trainer)
    permutes = ring_permutes(cols)
    assert {c.mesh_axes for c in permutes} == {("context",)}
    assert {c.operand_bytes for c in permutes} == {ROWS * LENGTH // ring * MODEL.kv_heads * MODEL.head_dim * 4}
    assert sum(c.bytes_per_step for c in permutes) == pytest.approx(MODEL.layers * clean_ring_bytes_per_layer(ring, LENGTH), rel=1e-9)
    pieces = {kind: [c for c in cols if c.kind == kind] for kind in ("all-gather", "reduce-scatter")}
    assert {c.mesh_axes for kind in pieces for c in pieces[kind]} == {("block",)}
    group = ranks // ring
    moved = MODEL.layers * (group - 1) / group * 2 * ROWS * LENGTH // ring * MODEL.kv_heads * MODEL.head_dim * 4
    forwards = 1 + (trainer.cfg.remat != "none")
    assert sum(c.bytes_per_step for c in pieces["all-gather"]) == pytest.approx(forwards * moved, rel=1e-9)
    assert sum(c.bytes_per_step for c in pieces["reduce-scatter"]) == pytest.approx(moved, rel=1e-9)
    assert {c.kind for c in cols} == {"collective-permute", "all-gather", "reduce-scatter", "all-reduce"}


def test_the_report_gives_tokens_per_device_clean_kv_against_context_parallelism_and_work():
    # the strategy's section of `jaxpar train`'s report, on the program that ran (block=8,context=4)
    ranks, ring = 8, 4
    strategy = f"block={ranks},context={ring}"
    trainer = trained(strategy)[0]
    example = trainer.abstract_batch(ROWS, LENGTH, fields=bd3lm.FAMILY.batch_fields(LENGTH))
    compiled = trainer._step.lower(trainer.abstract_state(), example).compile()
    bp = step_report(trainer, compiled, parse_strategy(strategy, 8), MODEL, (ROWS, 2 * LENGTH))["block"]
    assert bp["tokens_per_device"] == 2 * LENGTH // ranks
    kv = bp["clean_kv_per_layer"]
    assert kv["measured_bytes"] == pytest.approx(clean_ring_bytes_per_layer(ring, LENGTH), rel=1e-9) == kv["formula_bytes"]
    assert kv["context_parallel_bytes"] == pytest.approx(clean_ring_bytes_per_layer(ranks, 2 * LENGTH), rel=1e-9)
    assert bp["imbalance"] == pytest.approx(max(bp["attention_work_per_device"]) / np.mean(bp["attention_work_per_device"]))
    assert bp["imbalance"] < 1.05
    assert bp["other_bytes_over_block_axes"] == 0  # the pieces' gathers are clean K/V, counted apart
    forwards = 1 + (trainer.cfg.remat != "none")  # the all-gathers (again under remat), the reduce-scatter
    assert bp["clean_pieces_bytes_per_layer"] == pytest.approx(
        (forwards + 1) * (ranks // ring - 1) / (ranks // ring) * 2 * ROWS * LENGTH // ring * MODEL.kv_heads * MODEL.head_dim * 4, rel=1e-9)
    assert "context=8 would send" in "\n".join(block_summary(bp))


def test_a_sliding_window_fetches_only_the_clean_tokens_its_blocks_read():
    # a device owns noisy blocks inside its own clean chunks; the plan: it receives exactly the
    # clean tokens its queries may see under the window and it does not hold (read off the whole
    # mask), never a noisy one
    ranks, ring = 8, 4
    mask = bd3lm.block_diffusion_mask(LENGTH, BLOCK_SIZE, WINDOWED.window)
    send, received = block_parallel.fetch_plan(mask.blocks.allowed.clean_reads, LENGTH, BLOCK_SIZE, ranks, ring)
    whole = np.asarray(mask.dense(2 * LENGTH, 2 * LENGTH))[0]
    places = block_parallel.held_places(LENGTH, BLOCK_SIZE, ranks, ring, fetch=True)
    assert sorted(places[:, : LENGTH // ranks].ravel().tolist()) == list(range(LENGTH))  # each noisy token on one device
    for device in range(ranks):
        seen = set(np.nonzero(whole[places[device]].any(0))[0].tolist()) - set(places[device].tolist())
        got = received[device][received[device] >= 0]
        assert sorted(got.tolist()) == sorted(seen) and (got >= LENGTH).all(), device
    # every block reads W / B + 1 blocks of keys but those of the first window: the devices' work
    # differs by at most what the first window's blocks (noisy and clean) do not read
    work = np.array([int(whole[p].sum()) for p in places])
    np.testing.assert_array_equal(block_parallel.attention_work(LENGTH, BLOCK_SIZE, ranks, ring, WINDOWED.window, fetch=True), work)
    w = WINDOWED.window // BLOCK_SIZE
    assert work.max() - work.min() <= 2 * BLOCK_SIZE**2 * w * (w + 1) // 2, work
    # the program: one all-to-all over context per layer forward and one backward, each device
    # sending (C-1) slots of S tokens' keys and values; nothing else but the gradient all-reduce
    cols = compiled_collectives(trained(f"block={ranks},context={ring},clean_kv=fetch", windowed_model)[0])
    assert {(c.kind, c.mesh_axes) for c in cols if c.kind != "all-reduce"} == {("all-to-all", ("context",))}
    fetches = [c for c in cols if c.kind == "all-to-all"]
    assert sum(c.executions for c in fetches) == 2 * MODEL.layers
    slot = send.shape[2]
    pair = ROWS * slot * MODEL.kv_heads * MODEL.head_dim * 2 * 4  # K and V of a slot, float32
    assert sum(c.bytes_per_step for c in fetches) == pytest.approx(MODEL.layers * 2 * (ring - 1) * pair, rel=1e-9)
    assert slot < LENGTH // ring  # less than the ring would carry: a window of 2 blocks, not the whole clean half


def test_bad_block_degrees_and_models_are_refused_with_the_valid_values():
    with pytest.raises(LayoutError, match=r"block=3 cannot split 16 diffusion blocks .* multiple of 2 x 3 = 6.* one of 1, 2, 4, 8"):
        block_parallel.check_degree(16, 3)
    with pytest.raises(LayoutError, match=r"block=4 cannot split 4 diffusion blocks.*\(more devices than pairs\).* one of 1, 2"):
        block_parallel.check_degree(4, 4)
    with pytest.raises(JaxparError, match=r"block axis is not supported by model tiny.*bd3lm-tiny.*e.g. --strategy data=8"):
        check_model_axes(parse_strategy("block=2,data=4", 8), model_config("tiny"), "tiny")
    check_model_axes(parse_strategy("block=2,data=4", 8), model_config("bd3lm-tiny"), "bd3lm-tiny")
    # CSBP with P = C leaves a mesh block axis of 1: the written P is what is refused
    with pytest.raises(JaxparError, match=r"block axis is not supported by model tiny.*drop block=2"):
        check_model_axes(parse_strategy("block=2,context=2,data=2", 4), model_config("tiny"), "tiny")
    with pytest.raises(SpecError, match=r"block=2 with stage=2"):
        parse_strategy("block=2,stage=2,data=2", 8)
    with pytest.raises(SpecError, match=r"block=6 with context=4: the BP degree .* multiple of the context degree.*on 24 devices "
                                        r"e.g. --strategy data=6,block=4,context=4 or data=3,block=8,context=4"):  # that fill them
        parse_strategy("block=6,context=4", 24)
    with pytest.raises(SpecError, match=r"CSBP.*context_algorithm=ring, not all-to-all"):
        parse_strategy("block=4,context=2,context_algorithm=all-to-all,data=2", 8)
    assert str(parse_strategy("block=4,context=2,data=2", 8)) == "data=2,block=4,context=2"  # P = 4 devices own noisy blocks
    with pytest.raises(LayoutError, match=r"context=4 splits the clean half of 36 tokens into 2 x 4 zigzag chunks.* e.g. 40"):
        block_parallel.clean_places(36, 4)
    # a run is checked before anything is placed, with P counting every device that owns blocks
    csbp = parse_strategy("block=8,context=2", 8)  # the mesh's block axis is 4
    with pytest.raises(LayoutError, match=r"block=8 cannot split 4 diffusion blocks"):
        check_model(csbp, MODEL, 4 * BLOCK_SIZE)
    assert parse_strategy("block=2,context=2,data=4", 8).written_degrees["block"] == 2  # CSBP though the mesh's block axis is 1
    check_model(csbp, MODEL, LENGTH)
    with pytest.raises(SpecError, match=r"clean_kv= says how .* drop clean_kv or add block= and context="):
        parse_strategy("block=8,clean_kv=fetch", 8)
    with pytest.raises(SpecError, match=r"clean_kv='all': choose ring .* or fetch"):
        parse_strategy("block=4,context=2,clean_kv=all,data=2", 8)

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
