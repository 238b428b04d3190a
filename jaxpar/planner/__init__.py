"""``jaxpar plan``: an automatic, heterogeneity-aware layout planner.

It searches the degrees of ``stage``, ``data``, ``fsdp``, ``expert``, ``context`` and ``tensor``,
the micro-batches, the remat policy and the FSDP policy (ZeRO stage, regather) for a model on a
topology, and on a heterogeneous topology each group's share of the batch or of the layers, under
an analytic cost model (``cost.py``: the strategies' own traffic formulas on the candidate's layout,
the ZeRO table and the activations for memory, the roofline per chip kind for time, an alpha-beta
price per link tier). ``space.py`` lists the candidates, ``search.py`` prunes and ranks them,
``hetero.py`` splits work across groups. Nothing is compiled: ``jaxpar plan --compile N`` (in
``jaxpar.aot``) compiles the best plans and sets the predictions against the compiler's figures.
"""

from __future__ import annotations

import dataclasses
import time

from jaxpar.errors import JaxparError, size_text
from jaxpar.models import family_of
from jaxpar.planner import hetero, placement, space
from jaxpar.planner.model import model_config
from jaxpar.planner.pricing import Priced, Pricer, Problem, candidates
from jaxpar.planner.search import exhaustive, search

__all__ = ["Plans", "Priced", "Problem", "candidates", "exhaustive", "plan", "problem_for", "placement", "search", "space", "why_it_loses"]


@dataclasses.dataclass(frozen=True)
class Plans:
    problem: Problem
    seq_len: int  # as asked (the problem's is what the model reads: a block diffusion model reads it twice)
    ranked: list  # Priced, best first (fitting plans only)
    seconds: float  # the search's wall time
    priced: int  # candidates priced
    one_kind: Priced | None = None  # heterogeneous only: the best plan of a planner that sees one kind of chip, priced truly
    placements: dict = dataclasses.field(default_factory=dict)  # HeterMoE: attention group's name -> its best placement
    placement_refused: str | None = None  # why no HeterMoE placement is offered

    @property
    def best(self) -> Priced:
        return self.ranked[0]

    @property
    def heterogeneous_gain(self) -> float | None:
        """How much faster the best plan is than ``one_kind`` (None on a one-kind topology)."""
        return None if self.one_kind is None else self.one_kind.step_s / self.best.step_s


def problem_for(model, topology, batch_size: int, seq_len: int, **options) -> Problem:
    """The problem, every input refused in words before any search (unknown model, a cluster too
    small for the model at any layout, a group that cannot hold any stage)."""
    if batch_size < 1 or seq_len < 1:
        raise JaxparError(f"--batch-size {batch_size} and --seq-len {seq_len} must both be at least 1")
    cfg = model_config(model)
    name = model if isinstance(model, str) else type(cfg).__name__
    state = 16 * cfg.num_params()  # float32 weights, gradients and two Adam moments
    room = sum(g.hbm_bytes * g.num_chips for g in topology.device_groups)
    if state > room:
        raise JaxparError(
            f"{name} ({cfg.num_params() / 1e9:.2f}B weights) needs {size_text(state)} for its weights, gradients and Adam "
            f"state even split over every chip, and {topology.name} has {size_text(room)} of HBM in all: no layout fits; "
            f"use a topology with at least {-(-state // min(g.hbm_bytes for g in topology.device_groups))} chips of this kind")
    if topology.is_heterogeneous:
        _check_groups_hold_a_stage(cfg, name, topology)
    return Problem(cfg, topology, batch_size, family_of(cfg).reads(seq_len), **options)


def _check_groups_hold_a_stage(cfg, name: str, topology) -> None:
    """Every group must hold at least one layer's state (as a pipeline stage, sharded over its chips)."""
    per_layer = 16 * (cfg.num_params() - cfg.vocab_size * cfg.embed * 2) / cfg.layers
    for g in topology.device_groups:
        room = g.hbm_bytes * g.num_chips
        if per_layer > room:
            raise JaxparError(
                f"group {g.name!r} of {topology.name} ({g.num_chips} x {g.chip}, {size_text(room)} of HBM) cannot hold one "
                f"layer of {name} ({size_text(per_layer)} of weights, gradients and Adam state): it lacks "
                f"{size_text(per_layer - room)}; give it more chips or leave it out of the topology")


def plan(model, topology, batch_size: int, seq_len: int, *, top: int = 5, exhaustive_search: bool = False, **options) -> Plans:
    """The best ``top`` plans for ``model`` on ``topology`` (``Plans.ranked``), best first."""
    problem = problem_for(model, topology, batch_size, seq_len, **options)
    start = time.perf_counter()
    pricer = Pricer(problem)
    ranked = (exhaustive if exhaustive_search else search)(problem, pricer)
    refused = placement.refusal(problem)
    placements = {} if refused else placement.best(problem)
    ranked = sorted([r for r in ranked if r.fits] + [r for r in placements.values() if r.fits], key=lambda r: r.rank_key)
    if not ranked:
        raise JaxparError(
            f"no layout of {model if isinstance(model, str) else 'the model'} with batch {batch_size} x {seq_len} fits on "
            f"{topology.name}: every candidate needs more than a chip's {size_text(topology.hbm_bytes)}; use a smaller "
            f"--batch-size or --seq-len, or more chips")
    one_kind = _one_kind_plan(problem) if topology.is_heterogeneous else None
    return Plans(problem, seq_len, ranked[:top] if top else ranked, time.perf_counter() - start, len(ranked), one_kind,
                 placements, refused)


def _one_kind_plan(problem: Problem) -> Priced | None:
    """What a planner that sees one kind of chip (the cluster's one-kind view) would choose, with
    every group doing an equal share, priced on the real groups."""
    view = dataclasses.replace(problem.topology, groups=())
    blind = search(dataclasses.replace(problem, topology=view))
    pricer = Pricer(problem)
    for choice in blind:
        kinds = hetero.kinds_for(choice.candidate, len(problem.topology.device_groups)) or ["batch"]  # spans none: even
        priced = [hetero.even(pricer, choice.candidate, kind) for kind in kinds]
        if priced:
            return min(priced, key=lambda r: r.rank_key)
    return None


def why_it_loses(plan: Priced, best: Priced) -> str:
    """One line: what makes ``plan`` slower than ``best``, the largest of the differences."""
    if not plan.fits:
        return f"does not fit: {size_text(plan.memory_bytes)} per device of {size_text(plan.hbm_bytes)}"
    spare = lambda r: max(0.0, r.overlapped_comm_s - r.compute_s - r.bubble_s)  # noqa: E731
    terms = {
        "more compute (recomputation or replicated work)": plan.compute_s - best.compute_s,
        "more exposed communication": plan.exposed_comm_s - best.exposed_comm_s,
        "a larger pipeline bubble": plan.bubble_s - best.bubble_s,
        "communication that outlasts the compute it hides behind": spare(plan) - spare(best),
    }
    what, seconds = max(terms.items(), key=lambda kv: kv[1])
    if seconds <= 0:
        return "ties with the best plan; ranked after it for more traffic, micro-batches, recomputation or memory"
    return f"{what}: +{1e3 * seconds:.1f} ms"



def format_plans(plans: Plans, compiled: list[dict] | None = None) -> str:
    """The table ``jaxpar plan`` prints: the ranked plans, why each loses to the best, the search's
    cost, the gain over a one-kind plan, and (``compiled``) predicted against compiled figures."""
    p, best = plans.problem, plans.best
    gib = lambda b: f"{b / 2**30:6.2f} GiB"  # noqa: E731
    lines = [f"{_model_name(p.cfg)} on {p.topology.name} ({p.topology.num_chips} chips), batch {p.batch} x {plans.seq_len}: "
             f"{plans.priced} plans fit, searched in {plans.seconds:.1f} s", ""]
    for i, r in enumerate(plans.ranked, 1):
        where = f"  [{r.split.describe()}]" if r.split else ""
        lines.append(f"{i:2d}. {r.candidate.describe()}{where}")
        lines.append(f"    step {r.step_s:8.4f} s  MFU {100 * r.mfu:5.1f}%  memory {gib(r.memory_bytes)} of {gib(r.hbm_bytes)}  "
                     f"traffic {gib(r.traffic_bytes)} per device")
        if r is not best:
            lines.append(f"    loses: {why_it_loses(r, best)}")
    if plans.one_kind is not None:
        lines += ["", f"a planner that sees one kind of chip would run {plans.one_kind.candidate.describe()} "
                      f"[{plans.one_kind.split.describe()}]: {plans.one_kind.step_s:.4f} s; the heterogeneity-aware plan is "
                      f"{plans.heterogeneous_gain:.2f}x faster"]
    if p.topology.is_heterogeneous:
        lines += _placement_lines(plans)
    for row in compiled or []:
        lines += ["", f"compiled ({row['compiler']}): {row['plan']}" + (f"  ({row['note']})" if row["note"] else ""),
                  f"  memory  predicted {gib(row['predicted_memory'])}  compiled {gib(row['compiled_memory'])}  "
                  f"({_ratio(row['predicted_memory'], row['compiled_memory'])})",
                  f"  traffic predicted {gib(row['predicted_traffic'])}  compiled {gib(row['compiled_traffic'])}  "
                  f"({_ratio(row['predicted_traffic'], row['compiled_traffic'])})"]
    return "\n".join(lines)


def _placement_lines(plans: Plans) -> list[str]:
    """The HeterMoE placements, each role assignment's best, and why each wins or loses against
    the best other plan (or why none is offered)."""
    if plans.placement_refused:
        return ["", f"HeterMoE placement not offered: {plans.placement_refused}"]
    if not plans.placements:
        return ["", "HeterMoE placement not offered: no group's chips divide the experts evenly"]
    rival = next((r for r in plans.ranked if not isinstance(r.candidate, placement.Placement)), None)
    lines = ["", "HeterMoE placement (a plan only: jaxpar has no runtime for it), each role assignment's best:"]
    for placed in sorted(plans.placements.values(), key=lambda r: r.rank_key):
        lines.append(f"  {placed.split.describe()}, microbatches={placed.candidate.microbatches} remat={placed.candidate.remat}: "
                     f"step {placed.step_s:.4f} s, {placed.memory_bytes / 2**30:.2f} GiB of {placed.hbm_bytes / 2**30:.2f} GiB "
                     f"on the fuller group")
        lines.append(f"    {placement.why(plans.problem, placed, rival)}")
    return lines


def _ratio(predicted: float, compiled: float) -> str:
    return f"{100 * (predicted / compiled - 1):+.1f}%" if compiled else "nothing compiled to compare"


def _model_name(cfg) -> str:
    from jaxpar.models import CONFIGS

    return next((name for name, c in CONFIGS.items() if c == cfg), type(cfg).__name__)


def as_json(plans: Plans, compiled: list[dict] | None = None) -> dict:
    """What ``--json`` writes: every ranked plan's figures (and the compiled comparison)."""
    rows = [{"strategy": r.candidate.strategy_text, "microbatches": r.candidate.microbatches, "remat": r.candidate.remat,
             "split": r.split.describe() if r.split else None, "step_s": r.step_s, "mfu": r.mfu, "fits": r.fits,
             "memory_bytes": r.memory, "hbm_bytes": r.hbm_bytes,
             "traffic_bytes": {f"{k} over {a}": b for (k, a), b in r.traffic.items()},
             "loses": None if r is plans.best else why_it_loses(r, plans.best)} for r in plans.ranked]
    return {"model": _model_name(plans.problem.cfg), "topology": plans.problem.topology.name, "batch_size": plans.problem.batch,
            "seq_len": plans.seq_len, "search_seconds": plans.seconds, "plans": rows,
            "one_kind_step_s": plans.one_kind.step_s if plans.one_kind else None,
            "heterogeneous_gain": plans.heterogeneous_gain, "compiled": compiled or [],
            "hetermoe": {r.split.describe(): {"microbatches": r.candidate.microbatches, "remat": r.candidate.remat,
                                              "step_s": r.step_s, "fits": r.fits, "memory_bytes": r.memory}
                         for r in plans.placements.values()},
            "hetermoe_refused": plans.placement_refused}
