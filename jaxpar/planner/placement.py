"""HeterMoE placement (arXiv 2504.03871): on a cluster of two chip kinds, a mixture of experts runs
the attention side of every layer (attention, norms, embeddings, logits) on one group and its
routers and experts on the other, micro-batches alternating so that both groups compute at once
("zebra" parallelism). A plan only: jaxpar has no runtime for it.

Cost model, per step (``Stages``): three resources work in a pipeline whose unit is one micro-batch
through one layer in one pass (forward, backward, and the forward again under remat: a "hop"):

- the attention group: the roofline (``roofline.estimate_step``) of the model without its MLP, on
  the group's chips at their FLOP/s, the batch split over them (ZeRO-3 within the group: its weight
  gathers and reductions hide behind the pipeline unless they outlast it);
- the experts group: the roofline of the whole model less that of the model without its MLP on the
  same chips (the router's and experts' matmuls, active per token, and the SwiGLU's HBM work),
  each chip holding ``experts / chips`` whole experts, plus the exchange of the token copies to
  those chips inside the group (an all-to-all, as expert parallelism's ``wire_bytes`` counts it);
- the link between the groups, each direction: the tokens' activations to the experts and back on
  every hop (the backward pass sends their gradients the other way), at ``group_bandwidth`` per
  chip pair, plus a DCN latency per message.

In the steady state the slowest resource works without pause; the first and last micro-batches
fill and drain the pipeline (``Stages.step_s``). The optimizer steps follow (the groups' in
parallel). Memory per device: each group's own weights, gradients and Adam state (ZeRO-3 over the
group), the compute copy of its weights, and the activations of every micro-batch (all are in
flight before the first backward hop), one hop's working set and, on the attention group, the logits.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxpar.analysis import roofline
from jaxpar.errors import size_text
from jaxpar.mesh import divisors
from jaxpar.planner import cost, space
from jaxpar.planner.hetero import Split, group_views
from jaxpar.planner.pricing import Priced, Problem

SAVED_BY = {"none": "kept_by_none", "dots": "matmul_outputs", "full": "input"}  # as cost.memory reads them
STATE_BYTES = {"parameters": 4, "gradients": 4, "optimizer": 8}  # float32 weights, gradients, two Adam moments


@dataclasses.dataclass(frozen=True, order=True)
class Placement(space.Candidate):
    """A candidate of the placement: its degrees are those of a layout jaxpar can run on the same
    chips (the experts split over as many chips as the experts group, FSDP across the rest), which
    ``--compile`` compiles in its place."""

    attention_group: str = ""
    experts_group: str = ""

    def describe(self) -> str:
        return f"HeterMoE placement microbatches={self.microbatches} remat={self.remat}"


@dataclasses.dataclass(frozen=True)
class Stages:
    """Each resource's busy seconds per step (all micro-batches, all hops) and the pipeline's step."""

    attention_s: float  # the attention group's work
    experts_s: float  # the experts group's work
    link_s: float  # each direction of the link between the groups
    hops: int  # per micro-batch: layers x passes
    microbatches: int
    weights_comm_s: float  # the attention group's weight gathers and reductions (overlapped)
    tail_s: float  # after the last hop: the optimizer steps

    @property
    def pipeline_s(self) -> float:
        """The bottleneck busy from its first micro-batch to its last, plus the fill before and the
        drain after it; or, with too few micro-batches to keep it busy, the last micro-batch's own
        path (every hop's full cycle: attention, out, experts, back)."""
        units = self.hops * self.microbatches
        attention, link, experts = self.attention_s / units, self.link_s / units, self.experts_s / units
        cycle, top = attention + 2 * link + experts, max(attention, link, experts)
        return max(units * top + cycle - top, self.hops * cycle + (self.microbatches - 1) * top)

    @property
    def bottleneck_s(self) -> float:
        return max(self.attention_s, self.experts_s, self.link_s)

    @property
    def step_s(self) -> float:
        return max(self.pipeline_s, self.weights_comm_s) + self.tail_s


def refusal(problem: Problem) -> str | None:
    """Why the placement is not offered for this problem (None: it is)."""
    t, cfg = problem.topology, problem.cfg
    if not getattr(cfg, "experts", None):
        return "a dense model has no experts to place on another group"
    if not t.is_heterogeneous:
        return "one kind of chip: no group is faster at attention than another"
    if len(t.device_groups) != 2:
        return f"{len(t.device_groups)} device groups: the placement pairs an attention group with an experts group"
    return None


def assignments(problem: Problem):
    """(attention group index, experts group index) pairs whose experts split evenly (both roles tried)."""
    groups = problem.topology.device_groups
    for a, b in ((0, 1), (1, 0)):
        if problem.cfg.experts % groups[b].num_chips == 0:
            yield a, b


def placements(problem: Problem):
    """Every placement of the problem: both role assignments, micro-batches that split the batch
    over the attention group, each remat policy."""
    groups, chips = problem.topology.device_groups, problem.topology.num_chips
    for a, b in assignments(problem):
        n_a, n_b = groups[a].num_chips, groups[b].num_chips
        counts = [m for m in divisors(problem.batch) if m <= space.MAX_MICROBATCHES and problem.batch % (m * n_a) == 0]
        degrees = (1, 1, chips // n_b, n_b, 1, 1)
        for m in counts:
            for remat in space.REMAT_POLICIES:
                if problem.only_remat in (None, remat) and problem.only_microbatches in (None, m):
                    yield Placement(degrees, m, remat, attention_group=groups[a].name, experts_group=groups[b].name)


def stages(problem: Problem, placement: Placement) -> tuple[Stages, float]:
    """(Stages, model FLOPs per step) of ``placement``."""
    cfg, m, remat = problem.cfg, placement.microbatches, placement.remat
    (a, view_a, n_a), (b, view_b, n_b) = _roles(problem, placement)
    cb = jnp.dtype(problem.compute_dtype).itemsize
    passes = 2 + (remat != "none")  # forward, backward, and the forward again under remat
    hops = cfg.layers * passes
    rows, tokens = problem.batch // m, problem.batch * problem.seq_len  # per micro-batch, per step
    attention_side = cfg.without_mlp()
    state_a, state_b = _state(problem, attention_side, n_a, n_b)
    estimate = lambda c, view, chips, state, traffic, split: roofline.estimate_step(  # noqa: E731
        c, rows, problem.seq_len, traffic, view, chips, state_bytes=state, batch_axes=(), tensor=split,
        recompute=roofline.RECOMPUTE[remat], attention=problem.attention, compute_dtype=problem.compute_dtype)
    on_a = estimate(attention_side, view_a, n_a, state_a, [], 1)
    # the token copies reach their experts' chips inside the group: out and back on every hop
    exchange = hops * 2 * (n_b - 1) / n_b * rows * problem.seq_len / n_b * cfg.top_k * cfg.embed * cb
    # tensor=n_b: each chip reads its own experts' weights, not all of them
    whole_b = estimate(cfg, view_b, n_b, state_b, [("all-to-all", "expert", exchange, False)], n_b)
    attention_on_b = estimate(attention_side, view_b, n_b, {k: 0.0 for k in state_b}, [], n_b)
    optimizer_a, optimizer_b = on_a.hbm_by_part_s["optimizer"], whole_b.hbm_by_part_s["optimizer"]
    experts_mb = whole_b.compute_s - optimizer_b - attention_on_b.compute_s + whole_b.activation_comm_s
    link_view = min(view_a, view_b, key=lambda v: v.dcn_bandwidth)
    sent = hops * tokens * cfg.embed * cb / min(n_a, n_b)  # each direction, per chip pair
    link_s = roofline.collective_seconds("collective-permute", sent, True, link_view) + cost.ALPHA_S["dcn"] * hops * m
    weights = attention_side.num_params() * (n_a - 1) / n_a
    gathers = roofline.collective_seconds("all-gather", weights * cb * (passes - 1), False, view_a)
    reduction = roofline.collective_seconds("reduce-scatter", weights * 4, False, view_a)
    result = Stages(m * (on_a.compute_s - optimizer_a), m * experts_mb, link_s, hops, m, gathers + reduction,
                    max(optimizer_a, optimizer_b))
    return result, m * (on_a.model_flops + whole_b.model_flops - attention_on_b.model_flops)


def _roles(problem: Problem, placement: Placement):
    """((index, view, chips) of the attention group, the same of the experts group)."""
    groups, views = problem.topology.device_groups, group_views(problem.topology)
    index = {g.name: i for i, g in enumerate(groups)}
    return tuple((index[name], views[index[name]], groups[index[name]].num_chips)
                 for name in (placement.attention_group, placement.experts_group))


def _state(problem: Problem, attention_side, n_a: int, n_b: int) -> tuple[dict, dict]:
    """Each group's ZeRO-3 state per chip, as the roofline reads it (weights, gradients, moments)."""
    on_a = attention_side.num_params()
    on_b = problem.cfg.num_params() - on_a
    table = lambda w, n: {"parameters": STATE_BYTES["parameters"] * w / n,  # noqa: E731
                          "gradient_accumulation": STATE_BYTES["gradients"] * w / n, "optimizer": STATE_BYTES["optimizer"] * w / n}
    return table(on_a, n_a), table(on_b, n_b)


def memory(problem: Problem, placement: Placement) -> tuple[dict, dict]:
    """Bytes per device by part on the attention group and on the experts group."""
    cfg, m = problem.cfg, placement.microbatches
    (_, _, n_a), (_, _, n_b) = _roles(problem, placement)
    attention_side = cfg.without_mlp()
    state_a, state_b = _state(problem, attention_side, n_a, n_b)
    routed = cfg.layers * 3 * cfg.embed * cfg.mlp * cfg.experts  # split over the group; the rest replicated for compute
    parts = []
    for state, n, role, replicated, logits in (
            (state_a, n_a, "attention", attention_side.num_params(), cost.LOGIT_COPIES * cfg.vocab_size * 4),
            (state_b, n_b, "experts", cfg.num_params() - attention_side.num_params() - routed, 0.0)):
        tokens = problem.batch * problem.seq_len / n  # every micro-batch is in flight before the first backward hop
        saved = _activations(problem, SAVED_BY[placement.remat], role, tokens)
        working = _activations(problem, "all", role, tokens / m)
        parts.append({
            "parameters": state["parameters"], "optimizer": state["optimizer"],
            "gradients": state["gradient_accumulation"] * (2 if m > 1 else 1),  # and an accumulator across micro-batches
            "gathered_weights": replicated * jnp.dtype(problem.compute_dtype).itemsize,
            "activations": cfg.layers * saved + working,
            "logits": logits * tokens / m,
        })
    return parts[0], parts[1]


def _activations(problem: Problem, part: str, role: str, tokens: float) -> float:
    """``part`` (a key of ``cost.layer_activation_bytes``) of one layer of ``role`` for ``tokens``
    tokens: the attention side's, or the MoE part's plus the input the experts group received."""
    cb = jnp.dtype(problem.compute_dtype).itemsize
    attention = cost.layer_activation_bytes(problem.cfg.without_mlp(), tokens, 1, cb)
    if role == "attention":
        return attention[part]
    whole = cost.layer_activation_bytes(problem.cfg, tokens, 1, cb)
    return whole[part] - attention[part] + attention["input"]


def price(problem: Problem, placement: Placement) -> Priced:
    """``placement`` priced: the step of its pipeline, the fuller group's memory (against that
    group's HBM), the traffic per device of the busier link end."""
    timed, flops = stages(problem, placement)
    (a, _, n_a), (b, _, n_b) = _roles(problem, placement)
    groups = problem.topology.device_groups
    mem_a, mem_b = memory(problem, placement)
    fuller = max(((mem_a, groups[a]), (mem_b, groups[b])), key=lambda mg: sum(mg[0].values()) / mg[1].hbm_bytes)
    cb = jnp.dtype(problem.compute_dtype).itemsize
    passes = 2 + (placement.remat != "none")
    crossing = 2 * passes * problem.cfg.layers * problem.batch * problem.seq_len * problem.cfg.embed * cb / min(n_a, n_b)
    traffic = {("send and receive", "between groups"): crossing}
    peak = sum(g.peak_bf16_flops * g.num_chips for g in groups)
    bubble = timed.pipeline_s - timed.bottleneck_s
    split = Split("modules", (n_a, n_b), (placement.attention_group, placement.experts_group))
    return Priced(placement, timed.step_s, timed.bottleneck_s, timed.tail_s, timed.weights_comm_s, bubble,
                  fuller[0], fuller[1].hbm_bytes, traffic, flops / (peak * timed.step_s), split,
                  ((placement.attention_group, timed.attention_s, sum(mem_a.values())),
                   (placement.experts_group, timed.experts_s, sum(mem_b.values()))))


def best(problem: Problem) -> dict:
    """For each role assignment (keyed by the attention group's name), its best placement: the
    fastest that fits, else the lightest (to say by how much it does not)."""
    by_assignment: dict = {}
    for placement in placements(problem):
        priced = price(problem, placement)
        key = lambda r: r.rank_key if r.fits else (True, r.memory_bytes / r.hbm_bytes)  # noqa: E731
        current = by_assignment.get(placement.attention_group)
        if current is None or key(priced) < key(current):
            by_assignment[placement.attention_group] = priced
    return by_assignment


def why(problem: Problem, placed: Priced, rival: Priced | None) -> str:
    """One line: why ``placed`` wins against ``rival`` (the best other plan) or loses to it."""
    groups = {g.name: g for g in problem.topology.device_groups}
    if not placed.fits:
        name, _, used = max(placed.groups, key=lambda g: g[2] / groups[g[0]].hbm_bytes)
        fastest = min((price(problem, c) for c in placements(problem) if c.attention_group == placed.candidate.attention_group),
                      key=lambda r: r.step_s)
        return (f"does not fit: {size_text(used)} per device on {name} of its {size_text(groups[name].hbm_bytes)} "
                f"({size_text(placed.memory['parameters'] + placed.memory['optimizer'] + placed.memory['gradients'])} "
                f"of it its weights, gradients and Adam state); with the memory, {fastest.candidate.describe()} "
                f"would take {fastest.step_s:.4f} s")
    timed, _ = stages(problem, placed.candidate)
    (attention, t_a, _), (experts, t_b, _) = placed.groups
    busiest = max((timed.link_s, f"the link between the groups ({problem.topology.group_bandwidth / 1e9:.0f} GB/s per chip): "
                                 f"{_time(timed.link_s)} of activations each way"),
                  (t_a, f"the attention on {attention}: {_time(t_a)}"), (t_b, f"the experts on {experts}: {_time(t_b)}"))[1]
    overlap = (f"attention {_time(t_a)} on {attention}, experts {_time(t_b)} on {experts}, link {_time(timed.link_s)} each way, "
               f"fill and drain {_time(placed.bubble_s)}")
    if rival is None:
        return f"no other plan fits; bound by {busiest} ({overlap})"
    if placed.step_s <= rival.step_s:
        return f"wins by {rival.step_s / placed.step_s:.2f}x: the groups work at once, bound by {busiest} ({overlap})"
    return f"loses by {placed.step_s / rival.step_s:.2f}x: bound by {busiest} ({overlap})"


def _time(seconds: float) -> str:
    return f"{seconds:.3f} s" if seconds >= 1 else f"{1e3 * seconds:.2f} ms"
