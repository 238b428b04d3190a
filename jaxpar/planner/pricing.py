"""A candidate priced on a topology: the fixed problem, the priced result and its ranking, and the
pricer that caches what depends only on a candidate's degrees."""

from __future__ import annotations

import dataclasses
import functools

from jaxpar.analysis import memory as memory_lib
from jaxpar.errors import JaxparError, LayoutError, SpecError
from jaxpar.parallel import check_model, parse_strategy
from jaxpar.parallel.stage import schedules
from jaxpar.planner import cost, space
from jaxpar.planner.model import ModelShapes, PlannedStep, check_divides, planned_layout
from jaxpar.train.config import TrainConfig

REMAT_RANK = {r: i for i, r in enumerate(space.REMAT_POLICIES)}


@dataclasses.dataclass(frozen=True)
class Problem:
    cfg: object  # the model's config
    topology: object
    batch: int  # sequences per step
    seq_len: int  # tokens the model reads per sequence (a block diffusion model: both halves)
    compute_dtype: str = "bfloat16"
    grad_reduce_dtype: str = "float32"
    attention: str = "auto"
    schedule: str = "1f1b"
    only_remat: str | None = None  # fix the remat policy (None: search it)
    only_microbatches: int | None = None  # fix the micro-batches (None: search them)

    @functools.cached_property
    def shapes(self) -> ModelShapes:
        return ModelShapes.of(self.cfg)


@dataclasses.dataclass(frozen=True)
class Priced:
    """A candidate's predicted step, memory and traffic (per device; the slowest group's step and
    the fullest group's memory where groups differ)."""

    candidate: space.Candidate
    step_s: float
    compute_s: float
    exposed_comm_s: float
    overlapped_comm_s: float
    bubble_s: float
    memory: dict  # bytes per device by part (the fullest device)
    hbm_bytes: float  # of that device
    traffic: dict  # (kind, axis) -> bytes per device per step
    mfu: float
    split: object = None  # hetero.Split, where the plan divides work unevenly across groups
    groups: tuple = ()  # (group name, its step seconds, its memory bytes) for each group

    @property
    def memory_bytes(self) -> float:
        return sum(self.memory.values())

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.hbm_bytes

    @property
    def traffic_bytes(self) -> float:
        return sum(self.traffic.values())

    @property
    def rank_key(self) -> tuple:
        """Best first: fits, then faster, then less communication, then the simpler plan (fewer
        micro-batches, less recomputation), then less memory, then the candidate's own order."""
        c = self.candidate
        return (not self.fits, round(self.step_s, 9), round(self.traffic_bytes), c.microbatches, REMAT_RANK[c.remat],
                round(self.memory_bytes), c)


class Pricer:
    """Prices candidates of one Problem, caching what depends only on the degrees."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self._layouts: dict = {}

    def step(self, candidate: space.Candidate):
        """(strategy, PlannedStep) of ``candidate``; LayoutError/SpecError where it cannot hold the model."""
        p = self.problem
        key = (candidate.degrees, candidate.zero, candidate.regather)
        if key not in self._layouts:
            try:
                strategy = parse_strategy(candidate.strategy_text, p.topology.num_chips)
                check_model(strategy, p.cfg, p.seq_len)
                layout = planned_layout(strategy, p.topology.platform, p.topology.num_slices)
                check_divides(layout, PlannedStep(layout, TrainConfig(), p.shapes, False))
                self._layouts[key] = (strategy, layout)
            except (LayoutError, SpecError) as err:
                self._layouts[key] = err
        found = self._layouts[key]
        if isinstance(found, JaxparError):
            raise found
        strategy, layout = found
        stages = candidate.degree("stage")
        schedule = schedules.make(p.schedule, stages, candidate.microbatches) if stages > 1 else None
        cfg = TrainConfig(compute_dtype=p.compute_dtype, grad_reduce_dtype=p.grad_reduce_dtype, remat=candidate.remat,
                          microbatches=candidate.microbatches, schedule=p.schedule)
        return strategy, PlannedStep(layout, cfg, p.shapes, candidate.regather, schedule)

    def memory(self, candidate: space.Candidate) -> dict:
        _, step = self.step(candidate)
        p = self.problem
        rows = p.batch // step.layout.batch_shards
        return cost.memory(step, p.cfg, rows, p.seq_len, p.compute_dtype)

    def price(self, candidate: space.Candidate, memory: dict | None = None) -> Priced:
        """``candidate`` on a one-kind topology (``hetero.price`` prices one across groups)."""
        p = self.problem
        strategy, step = self.step(candidate)
        memory = memory if memory is not None else self.memory(candidate)
        traffic = cost.summed_traffic(step, strategy, p.batch, p.seq_len, p.cfg)
        t = cost.group_time(p.cfg, p.batch, p.seq_len, traffic, p.topology, p.topology.num_chips, layout=step.layout,
                            state=memory_lib.zero_table(step), remat=candidate.remat,
                            microbatches=candidate.microbatches, attention=p.attention, compute_dtype=p.compute_dtype,
                            schedule=step.plan.schedule)
        return Priced(candidate, t.step_s, t.compute_s, t.exposed_comm_s, t.overlapped_comm_s, t.bubble_s, memory,
                      p.topology.hbm_bytes, traffic, t.model_flops / (t.peak_flops * t.step_s))


def candidates(problem: Problem):
    """Every candidate ``space.py`` lists for the problem (divisibility and symmetry pruned)."""
    t = problem.topology
    for degrees in space.degree_choices(problem.cfg, t.num_chips, t.chips_per_slice, problem.batch, problem.seq_len):
        for c in space.options_for(degrees, problem.batch):
            if problem.only_remat in (None, c.remat) and problem.only_microbatches in (None, c.microbatches):
                yield c


