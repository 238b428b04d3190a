"""The layouts the planner considers, and the cheap refusals that keep their number small.

A ``Candidate`` is a point of the search: the degree of each searched mesh axis, the micro-batches,
the remat policy and the FSDP policy (ZeRO stage, regather). ``candidates`` lists them with what
can be decided without pricing pruned first:

- divisibility: degrees multiply to the chips; the batch splits over the batch axes and the
  micro-batches; heads, experts and layers split over tensor, expert and stage (the layout's own
  checks follow, on a layout built over stand-in devices);
- symmetry and dominance: an option that changes nothing is not listed twice (ZeRO stages and
  regather only where fsdp > 1; expert only for a mixture of experts; micro-batches above 1 only
  for a pipeline, or where the activations need them; context only for sequences long enough to
  split); tensor, context and expert parallelism stay inside a node (a layout that sends them over
  the slow links is dominated by one that sends data there instead);
- memory is checked before any time is priced (``cost.memory`` first).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from jaxpar.mesh import divisors

SEARCHED_AXES = ("stage", "data", "fsdp", "expert", "context", "tensor")  # outermost first, as the mesh
INNER_AXES = ("expert", "context", "tensor")  # activation traffic on every layer: kept on fast links
REMAT_POLICIES = ("none", "dots", "full")
ZERO_STAGES = (1, 2, 3)
MIN_CONTEXT_CHUNK = 1024  # positions per device below which splitting a sequence costs more than it saves
MAX_MICROBATCHES = 32


@dataclasses.dataclass(frozen=True, order=True)
class Candidate:
    degrees: tuple[int, ...]  # one per SEARCHED_AXES
    microbatches: int = 1
    remat: str = "full"
    zero: int = 3
    regather: bool = False

    def degree(self, axis: str) -> int:
        return self.degrees[SEARCHED_AXES.index(axis)]

    @property
    def strategy_text(self) -> str:
        """The candidate as ``--strategy`` takes it (its FSDP policy only where fsdp > 1)."""
        named = [f"{a}={d}" for a, d in zip(SEARCHED_AXES, self.degrees) if d > 1] or ["data=1"]
        if self.degree("fsdp") > 1:
            named += [f"zero={self.zero}"] + ([f"regather={'on' if self.regather else 'off'}"] if self.zero == 3 else [])
        return ",".join(named)

    def describe(self) -> str:
        return f"{self.strategy_text} microbatches={self.microbatches} remat={self.remat}"


def factorizations(n: int, parts: int):
    """Every tuple of ``parts`` positive integers whose product is ``n``."""
    if parts == 1:
        yield (n,)
        return
    for d in divisors(n):
        for rest in factorizations(n // d, parts - 1):
            yield (d, *rest)


def degree_choices(cfg, chips: int, chips_per_node: int, batch: int, seq_len: int):
    """Degrees for ``cfg`` on ``chips``: divisibility and dominance pruned (the module doc). On
    several device groups every choice is listed: one whose outermost axis (stage or data) spans
    them may split the work unevenly (``hetero.py``), the others run an equal share on every chip."""
    experts = getattr(cfg, "experts", None)
    for degrees in factorizations(chips, len(SEARCHED_AXES)):
        d = dict(zip(SEARCHED_AXES, degrees))
        if math.prod(d[a] for a in INNER_AXES) > chips_per_node:
            continue  # activation traffic over the slow links: dominated by data or stage there
        if d["expert"] > 1 and (not experts or experts % d["expert"]):
            continue
        if cfg.heads % d["tensor"] or cfg.mlp % d["tensor"] or cfg.layers % d["stage"]:
            continue
        if d["context"] > 1 and (seq_len % d["context"] or seq_len // d["context"] < MIN_CONTEXT_CHUNK):
            continue
        if batch % (d["data"] * d["fsdp"] * d["expert"]):
            continue
        yield degrees


def options_for(degrees: tuple[int, ...], batch: int):
    """(micro-batches, remat, ZeRO stage, regather) for these degrees, symmetric options once."""
    d = dict(zip(SEARCHED_AXES, degrees))
    rows = batch // (d["data"] * d["fsdp"] * d["expert"])  # per device and step
    counts = [m for m in divisors(rows) if m <= MAX_MICROBATCHES]
    if d["stage"] > 1:
        counts = [m for m in counts if m >= d["stage"]]  # a pipeline needs one in flight per stage
    fsdp_policies = [(z, r) for z in ZERO_STAGES for r in ((False, True) if z == 3 else (False,))] if d["fsdp"] > 1 else [(3, False)]
    for m, remat, (zero, regather) in itertools.product(counts, REMAT_POLICIES, fsdp_policies):
        yield Candidate(degrees, m, remat, zero, regather)
