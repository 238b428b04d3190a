"""jaxpar plan (jaxpar/planner/): the pruned search finds the exhaustive best, predictions agree
with the compiler's figures, uneven splits across device groups follow the groups' speeds, and bad
input is refused in words before any search."""
import dataclasses
import json

import pytest

from jaxpar import aot, cli, planner
from jaxpar.analysis import roofline
from jaxpar.errors import JaxparError, TopologyError, size_text
from jaxpar.models import CONFIGS
from jaxpar.models.llama import LlamaConfig
from jaxpar.models.moe import MoEConfig
from jaxpar.planner import cost, hetero, placement
from jaxpar.planner.pricing import Pricer
from jaxpar.topology import load_topology

# Two groups of 4 chips alike but for their speed: FLOP/s and HBM bandwidth in the ratio FAST:SLOW
GROUP = """
[[groups]]
name = "{name}"
chip = "{chip}"
num_chips = {chips}
ici_shape = [{chips}]
dcn_shape = [1]
peak_bf16_tflops = {tflops}
hbm_gib = {hbm}
hbm_bandwidth_gbps = {hbm_bw}
ici_links_per_chip = 4
ici_bandwidth_gbps = {link}
dcn_bandwidth_gbps = {link}
"""


def two_groups(tmp_path, fast=2.0, slow=1.0, link=1000.0, hbm=(80, 80), name="pair", chips=(2, 2), hbm_bw=1000.0,
               between=None):
    """A heterogeneous topology file of a fast and a slow group (links fast enough not to matter;
    ``between``: the link between the groups, GB/s per chip, if not ``link``)."""
    text = f'name = "{name}"\nplatform = "gpu"\nnum_chips = {sum(chips)}\ngroup_bandwidth_gbps = {between or link}\n'
    text += GROUP.format(name="fast", chip="nvidia-h100-sxm", chips=chips[0], tflops=400 * fast, hbm=hbm[0],
                         hbm_bw=hbm_bw * fast, link=link)
    text += GROUP.format(name="slow", chip="nvidia-h100-sxm", chips=chips[1], tflops=400 * slow, hbm=hbm[1],
                         hbm_bw=hbm_bw * slow, link=link)
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return load_topology(path)


# --- the search ---------------------------------------------------------------------------------

@pytest.mark.parametrize("model, topology, batch, seq_len", [
    ("tiny", "v5p-8", 16, 128),
    ("moe-tiny", "v5e-8", 16, 128),
    ("llama-1b", "v5p-16", 32, 1024),
])
def test_pruned_search_finds_the_exhaustive_best(model, topology, batch, seq_len):
    problem = planner.problem_for(model, load_topology(topology), batch, seq_len)
    pruned, every = planner.search(problem), planner.exhaustive(problem)
    fitting = [r for r in every if r.fits]
    assert len(pruned) < len(every)  # it did prune
    assert pruned[0].candidate == fitting[0].candidate
    assert pruned[0].step_s == pytest.approx(fitting[0].step_s, rel=1e-12)


def test_slow_stage_links_price_every_pipeline_send_and_nothing_else():
    """cpu-8-slow-stages is cpu-8 with 200 Mb/s, 50 ms links between pipeline stages: a candidate
    without a pipeline costs the same on both, one with S stages at least the latency of the
    2 (S - 1) sends of its fill and drain more, and the best plan there has no pipeline."""
    fast, slow = (planner.exhaustive(planner.problem_for("tiny", load_topology(name), 16, 128))
                  for name in ("cpu-8", "cpu-8-slow-stages"))
    slow_by = {r.candidate: r for r in slow}
    piped = 0
    for r in fast:
        stages = r.candidate.degree("stage")
        other = slow_by[r.candidate]
        if stages == 1:
            assert other.step_s == pytest.approx(r.step_s, rel=1e-12)
        else:
            piped += 1
            assert other.step_s - r.step_s >= 2 * (stages - 1) * 0.050 * (1 - 1e-9)
    assert piped and next(r for r in slow if r.fits).candidate.degree("stage") == 1


def test_pruned_search_finds_the_exhaustive_best_across_groups(tmp_path):
    problem = planner.problem_for("tiny", two_groups(tmp_path), 16, 128)
    pruned, every = planner.search(problem), [r for r in planner.exhaustive(problem) if r.fits]
    assert pruned[0].split is not None
    assert (pruned[0].candidate, pruned[0].split) == (every[0].candidate, every[0].split)


# --- heterogeneous splits -------------------------------------------------------------------------

@pytest.mark.parametrize("fast, slow", [(2.0, 1.0), (3.0, 1.0)])
def test_uneven_split_follows_the_speeds(tmp_path, fast, slow):
    # a compute-bound model: each group's step is its share of the work over its speed, so the fast
    # group should take fast / (fast + slow) of it and the plan beat the even split by
    # (fast + slow) / (2 slow): the slow group no longer does half
    topology = two_groups(tmp_path, fast, slow)
    plans = planner.plan("llama-1b", topology, 24, 2048, top=1)
    best = plans.best
    assert best.split is not None and best.split.groups == ("fast", "slow")
    share = best.split.shares[0] / sum(best.split.shares)
    unit = hetero.split_unit(best.candidate, best.split.kind, 2) / sum(best.split.shares)
    assert share == pytest.approx(fast / (fast + slow), abs=unit + 0.02)
    even = hetero.even(Pricer(plans.problem), best.candidate, best.split.kind)
    assert even.step_s / best.step_s == pytest.approx((fast + slow) / (2 * slow), rel=0.1)
    # and a planner that sees one kind of chip runs the even split
    assert plans.heterogeneous_gain == pytest.approx((fast + slow) / (2 * slow), rel=0.1)


def test_mixtral_fits_on_the_h100_a100_cluster_with_fsdp_across_the_groups():
    # 46.7B weights x 16 bytes = 747 GB of weights, gradients and Adam state: 87 GiB per device
    # over 8 (one group's data replica), 44 GiB over all 16; only layouts whose fsdp spans both
    # groups fit (pipelines are refused for a model with a balance loss), each chip an equal share
    plans = planner.plan("mixtral-8x7b", load_topology("gpu-h100-a100-16"), 64, 4096, top=0)
    assert plans.best.fits and plans.best.split.shares == (32, 32)
    assert all(r.candidate.degree("fsdp") * r.candidate.degree("expert") * r.candidate.degree("tensor") == 16
               for r in plans.ranked if not isinstance(r.candidate, placement.Placement))


# --- HeterMoE placement -----------------------------------------------------------------------

# no balance loss: pipelines across the groups (the layers split) are candidates too
EXPERT_HEAVY = MoEConfig(vocab_size=1024, embed=2048, layers=8, heads=16, kv_heads=16, head_dim=128, mlp=4096, experts=8,
                         top_k=2, balance_weight=0.0)
ATTENTION_HEAVY = dataclasses.replace(EXPERT_HEAVY, mlp=512, top_k=1)


def compute_bound_seconds(cfg, tokens: int, seq_len: int, chips: int, tflops: float) -> tuple[float, float]:
    """(attention side, experts) seconds of a step at ``chips``' matmul rate, nothing recomputed: 6
    FLOPs per weight per token; a flash kernel on a sequence of one block computes the whole score
    square, 3.5 times (forward 2 matmuls, backward 5)."""
    rate = chips * tflops * 1e12 * roofline.matmul_efficiency("nvidia-h100-sxm")
    e, h, k, d = cfg.embed, cfg.heads, cfg.kv_heads, cfg.head_dim
    attention_weights = cfg.layers * (2 * e * h * d + 2 * e * k * d) + cfg.vocab_size * e  # q, o, k, v; the output layer
    scores = 3.5 * 4 * cfg.layers * h * d * seq_len * tokens
    expert_weights = cfg.layers * (e * cfg.experts + 3 * e * cfg.mlp * cfg.top_k)  # the router; top_k experts' SwiGLU
    return (6 * attention_weights * tokens + scores) / rate, 6 * expert_weights * tokens / rate


@pytest.mark.parametrize("fast", [2.0, 4.0])
@pytest.mark.parametrize("microbatches", [1, 8])
def test_placement_step_follows_the_speeds_and_the_pipeline(tmp_path, fast, microbatches):
    # compute-bound (HBM and links 1000x the usual): each group's stage is its FLOPs at its speed;
    # one micro-batch runs them one after the other, eight overlap them, the bottleneck busy
    # throughout but for the other stage's first (or last) hop
    topology = two_groups(tmp_path, fast, 1.0, link=1e6, hbm_bw=1e6, chips=(4, 4))
    problem = planner.problem_for(EXPERT_HEAVY, topology, 64, 512, only_remat="none", only_microbatches=microbatches)
    placed = placement.best(problem)
    hops = 2 * EXPERT_HEAVY.layers  # forward and backward through every layer
    latency = 2 * cost.ALPHA_S["dcn"]  # each hop's two messages across the link, out and back
    tflops = {"fast": 400 * fast, "slow": 400.0}
    for attention, experts in (("fast", "slow"), ("slow", "fast")):
        on_a, _ = compute_bound_seconds(EXPERT_HEAVY, 64 * 512, 512, 4, tflops[attention])
        _, on_b = compute_bound_seconds(EXPERT_HEAVY, 64 * 512, 512, 4, tflops[experts])
        if microbatches == 1:
            expected = on_a + on_b + hops * latency
        else:
            expected = max(on_a, on_b) * (1 + min(on_a, on_b) / (hops * microbatches * max(on_a, on_b))) + latency
        assert placed[attention].step_s == pytest.approx(expected, rel=1e-3), (attention, microbatches)


@pytest.mark.parametrize("cfg, attention_on", [(EXPERT_HEAVY, "slow"), (ATTENTION_HEAVY, "fast")])
def test_both_role_assignments_are_priced_and_the_faster_chosen(tmp_path, cfg, attention_on):
    # the experts' matmuls are 3x the attention side's in one model, a sixth of it in the other:
    # the faster group takes the larger part
    plans = planner.plan(cfg, two_groups(tmp_path, 3.0, 1.0, chips=(4, 4)), 64, 512, top=0)
    assert set(plans.placements) == {"fast", "slow"}
    ranked = [r for r in plans.ranked if isinstance(r.candidate, placement.Placement)]
    assert ranked[0].split.groups[0] == attention_on
    assert ranked[0].step_s == min(r.step_s for r in plans.placements.values())
    assert plans.placements[attention_on].step_s < 0.75 * plans.placements[{"fast": "slow", "slow": "fast"}[attention_on]].step_s


def test_placement_is_not_offered_for_dense_models_or_one_kind_of_chip(tmp_path):
    dense = planner.plan("tiny", two_groups(tmp_path), 16, 128, top=0)
    one_kind = planner.plan("moe-tiny", load_topology("v5e-8"), 16, 128, top=0)
    for plans, words in ((dense, "a dense model"), (one_kind, "one kind of chip")):
        assert plans.placements == {} and words in plans.placement_refused
        assert not any(isinstance(r.candidate, placement.Placement) for r in plans.ranked)
    assert "HeterMoE placement not offered: a dense model" in planner.format_plans(dense)


@pytest.mark.parametrize("between", [1000.0, 1.0])
def test_a_slow_link_between_the_groups_makes_the_placement_lose_to_the_uneven_split(tmp_path, between):
    # the placement sends every layer's activations across the groups, out and back; a pipeline
    # split by layers sends one micro-batch's activations once per stage boundary
    plans = planner.plan(EXPERT_HEAVY, two_groups(tmp_path, 2.0, 1.0, link=1e6, chips=(4, 4), between=between), 64, 512, top=0)
    printed = planner.format_plans(plans)
    if between == 1000.0:
        assert isinstance(plans.best.candidate, placement.Placement) and "wins by" in printed
    else:
        assert plans.best.split.kind in hetero.SPLIT_KINDS and len(set(plans.best.split.shares)) > 1
        assert "loses by" in printed and "bound by the link between the groups (1 GB/s per chip)" in printed


def test_one_kind_topology_is_one_group():
    t = load_topology("gpu-h100-64")
    (group,) = t.device_groups
    assert (group.num_chips, group.peak_bf16_flops, group.hbm_bytes) == (t.num_chips, t.peak_bf16_flops, t.hbm_bytes)
    assert not t.is_heterogeneous


# --- bad input ----------------------------------------------------------------------------------

def test_unknown_model_is_refused_with_the_known_ones():
    with pytest.raises(JaxparError, match="unknown model 'llama-9z'.*tiny"):
        planner.plan("llama-9z", load_topology("v5p-8"), 16, 128)


def test_cluster_too_small_for_the_model_is_refused():
    cfg = CONFIGS["llama2-70b"]
    with pytest.raises(JaxparError, match="no layout fits") as err:
        planner.plan("llama2-70b", load_topology("v5p-8"), 16, 128)
    needed = 16 * cfg.num_params()  # float32 weights and gradients, two Adam moments
    assert f"{-(-needed // load_topology('v5p-8').hbm_bytes)} chips" in str(err.value)


def test_group_that_cannot_hold_a_stage_says_what_it_lacks(tmp_path):
    topology = two_groups(tmp_path, hbm=(80, 0.25), chips=(2, 1))
    cfg = CONFIGS["llama2-7b"]
    per_layer = 16 * (cfg.num_params() - 2 * cfg.vocab_size * cfg.embed) / cfg.layers
    lacks = per_layer - 0.25 * 2**30
    with pytest.raises(JaxparError, match=r"group 'slow'.*cannot hold one layer.*lacks (\S+ \S+)") as err:
        planner.plan("llama2-7b", topology, 16, 128)
    assert f"lacks {size_text(lacks)}" in str(err.value)


@pytest.mark.parametrize("edit, words", [
    (("peak_bf16_tflops = 400.0", "peak_bf16_tflops = -400.0"), "'peak_bf16_tflops' must be positive"),
    (("num_chips = 2\nici_shape = [2]", "num_chips = 2\nici_shape = [3]"), "'num_chips' is 2 but prod"),
    (("num_chips = 4\n", "num_chips = 5\n"), "the groups hold 4 chips"),
    (('name = "slow"', 'name = "fast"'), "repeat"),
    (("hbm_gib = 80\n", "hbm_gb = 80\n"), "unknown key 'hbm_gb'"),
])
def test_group_with_nonsensical_figures_is_refused(tmp_path, edit, words):
    two_groups(tmp_path, fast=1.0)
    path = tmp_path / "pair.toml"
    text = path.read_text()
    assert edit[0] in text
    path.write_text(text.replace(edit[0], edit[1], 1) if edit[0] != 'name = "slow"' else text.replace(*edit))
    with pytest.raises(TopologyError, match=words):
        load_topology(path)


# --- the command --------------------------------------------------------------------------------

def test_plan_command_prints_ranked_plans_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plans.json"
    status = cli.main(["plan", "--model", "tiny", "--topology", "v5p-8", "--batch-size", "16", "--seq-len", "128",
                       "--top", "3", "--json", str(out)])
    printed = capsys.readouterr().out
    assert status == 0 and " 1. " in printed and "loses:" in printed
    saved = json.loads(out.read_text())
    assert len(saved["plans"]) == 3 and saved["plans"][0]["loses"] is None
    steps = [p["step_s"] for p in saved["plans"]]
    assert steps == sorted(steps)


def test_plan_command_refuses_an_unknown_model_in_words(capsys):
    assert cli.main(["plan", "--model", "nope", "--topology", "v5p-8"]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err


# --- predictions against the compiler ---------------------------------------------------------------

DENSE = LlamaConfig(vocab_size=32000, embed=1024, layers=8, heads=16, kv_heads=8, head_dim=64, mlp=2816)
WIDE = LlamaConfig(vocab_size=32000, embed=2048, layers=4, heads=16, kv_heads=4, head_dim=128, mlp=5632)
MOE = MoEConfig(vocab_size=32000, embed=1024, layers=4, heads=16, kv_heads=8, head_dim=64, mlp=1024, experts=8, top_k=2)


@pytest.mark.slow  # six XLA:TPU compiles: about 2 minutes alone, several more beside the suite's other workers
@pytest.mark.tpu_aot
@pytest.mark.parametrize("pod", ["v5p-8", "v5e-8"])
def test_predicted_memory_and_traffic_agree_with_the_compiler(pod):
    """Each pod's best plan for a dense Llama, a wide GQA Llama and a mixture of experts, compiled.
    (llama-1b, left out: its compiled traffic is 5.5% (v5p-8) and 7.2% (v5e-8) above the formulas,
    XLA:TPU reducing its MLP gradients as a padded all-reduce plus collective-permutes.)"""
    pytest.importorskip("libtpu", reason="pip install -e .[tpu] brings the TPU compiler")
    rows = {}
    for name, model in (("dense", DENSE), ("wide", WIDE), ("moe", MOE)):
        plans = planner.plan(model, load_topology(pod), 8, 256, top=1)  # (small shapes: each compile ~30% quicker than 16 x 512)
        (rows[name],) = aot.compile_plans(plans, 1)
    for name, row in rows.items():
        assert row["compiler"] == "tpu"
        assert row["predicted_memory"] == pytest.approx(row["compiled_memory"], rel=0.10), (name, row)
        assert row["predicted_traffic"] == pytest.approx(row["compiled_traffic"], rel=0.05), (name, row)
