"""Federated HSDP against HSDP on two pods: the step time the planner's cost model predicts, with
the slow links (DCN between TPU slices, InfiniBand between GPU nodes) counted.

    python benchmarks/federated_pods.py [--pods 2xv5p-256 gpu-h100-64] [--model llama3-8b] [--rows-per-chip 2]
                                       [--seq-len 4096] [--local-steps 1 8 32 128]

For each pod (``2xv5p-256``: two v5p-256 slices, 2 x 128 chips over DCN; ``gpu-h100-64``: 8 nodes
of 8 H100s over InfiniBand) and a global batch of --rows-per-chip sequences per chip:

- HSDP, ``data=S,fsdp=C`` (S slices or nodes of C chips): the planner prices the whole step
  (``Pricer.price``), the gradient shard's all-reduce over the slow links every step included;
- FL+HSDP, ``federation=G`` outermost over G groups of S / G slices each running ``data=S/G,fsdp=C``
  on 1 / G of the batch (FL+FSDP, as jaxpar names it, where a group is one slice, G = S), for every
  G > 1 that divides S: the planner prices one group's step on a topology of its own slices, and a
  merge every H steps (H = 1, 8, 32, 128) adds one all-reduce of each device's weight shard over
  ``federation``, 2 (Psi / C) (G - 1) / G bytes, priced at the slow link's bandwidth, amortized;
- for reference, FSDP over every chip (``fsdp=S*C``), the federated paper's sharded-DP baseline.

The planner counts everything over the slow links as exposed (``jaxpar.analysis.roofline``). The
"overlapped" columns hide the per-step slow-link collectives behind the compute instead, as the
fast links' weight reductions are (a bound in HSDP's favour); a merge is its own program, exposed
either way. Nothing is compiled: every figure is the cost model (jaxpar/planner/cost.py).
"""

from __future__ import annotations

import argparse
import dataclasses

from jaxpar.analysis.roofline import collective_seconds
from jaxpar.mesh import divisors
from jaxpar.planner import cost, space
from jaxpar.planner.model import model_config
from jaxpar.planner.pricing import Pricer, Problem
from jaxpar.topology import load_topology

PODS = ("2xv5p-256", "gpu-h100-64")
LOCAL_STEPS = (1, 8, 32, 128)
PAPER_SPEEDUP = 8.04  # FL+FSDP / FL+HSDP over sharded DP, Llama3.1-8B on 512 A100s


@dataclasses.dataclass(frozen=True)
class Row:
    pod: str
    layout: str
    local_steps: int | None  # None: not federated
    step_s: float  # the planner's: slow links exposed
    overlapped_s: float  # per-step slow-link collectives hidden behind compute
    slow_bytes: float  # per device per step, over the slow links
    slow_s: float  # those bytes' seconds at the slow link's bandwidth (merges amortized)
    tokens: int  # per step, all groups


def best_fitting(topology, cfg, batch: int, seq_len: int, degrees: dict):
    """(Priced, layout) of the fastest fitting remat / micro-batch / ZeRO choice of these degrees."""
    pricer = Pricer(Problem(cfg, topology, batch, seq_len))
    fixed = tuple(degrees.get(a, 1) for a in space.SEARCHED_AXES)
    priced = [r for c in space.options_for(fixed, batch) if (r := pricer.price(c)).fits]
    if not priced:
        raise SystemExit(f"no choice of {degrees} holds {batch} x {seq_len} on {topology.name}; lower --rows-per-chip")
    best = min(priced, key=lambda r: r.rank_key)
    return best, pricer.step(best.candidate)[1].layout


def slow_link(priced, layout, topology) -> tuple[float, float]:
    """(bytes, seconds) per device per step of the collectives over the slow links."""
    rows = [(kind, sent) for (kind, axis), sent in priced.traffic.items() if axis in layout.dcn_axes]
    return sum(sent for _, sent in rows), sum(collective_seconds(kind, sent, True, topology) for kind, sent in rows)


def step_times(priced, layout, topology) -> tuple[float, float, float, float]:
    """(exposed step, overlapped step, slow bytes, slow seconds): the planner's step, and the same
    step with the slow links' bandwidth term moved from the exposed part to the part hidden behind
    compute (their latency stays exposed)."""
    sent, seconds = slow_link(priced, layout, topology)
    busy = priced.compute_s + priced.bubble_s
    overlapped = max(busy, priced.overlapped_comm_s + seconds) + priced.exposed_comm_s - seconds
    return priced.step_s, overlapped, sent, seconds


def group_topology(topology, groups: int):
    """One federated group: the pod's chips and links, on ``1 / groups`` of its slices."""
    slices = topology.num_slices // groups
    return dataclasses.replace(topology, name=f"{topology.name}/{groups}", num_chips=slices * topology.chips_per_slice,
                               dcn_shape=(slices,))


def merge_cost(priced, topology, groups: int, replicas: int) -> tuple[float, float, float]:
    """(bytes, bandwidth seconds, latency seconds) per device of one merge, as jaxpar's runs it:
    each of the ``replicas`` devices of a group holding the same float32 weight shard (as the ZeRO
    table stores it; ``data`` inside the group) all-reduces its 1/replicas part over ``federation``,
    then the parts are all-gathered over ``data``, which here crosses the slow links too (a group
    of several slices or nodes); one message each (as the planner counts a ``data`` all-reduce)."""
    part = priced.memory["parameters"] / replicas
    reduce = 2 * part * (groups - 1) / groups
    gather = part * (replicas - 1)
    seconds = collective_seconds("all-reduce", reduce, True, topology) + collective_seconds("all-gather", gather, True, topology)
    return reduce + gather, seconds, cost.ALPHA_S["dcn"] * (1 + (replicas > 1))


def degrees_text(degrees: dict) -> str:
    return ",".join(f"{a}={d}" for a, d in degrees.items() if d > 1)


def pod_rows(pod: str, cfg, rows_per_chip: int, seq_len: int, local_steps) -> list[Row]:
    """HSDP, every FL+HSDP grouping of the pod's slices at every H, and flat FSDP."""
    topology = load_topology(pod)
    slices, chips = topology.num_slices, topology.chips_per_slice
    batch = rows_per_chip * topology.num_chips
    tokens = batch * seq_len
    rows = []
    hsdp = {"data": slices, "fsdp": chips}
    priced, layout = best_fitting(topology, cfg, batch, seq_len, hsdp)
    rows.append(Row(pod, f"HSDP {degrees_text(hsdp)}", None, *step_times(priced, layout, topology), tokens))
    for groups in (g for g in divisors(slices) if g > 1):
        inner = {"data": slices // groups, "fsdp": chips}
        group = group_topology(topology, groups)
        priced, layout = best_fitting(group, cfg, batch // groups, seq_len, inner)
        step, overlapped, inner_bytes, inner_s = step_times(priced, layout, group)
        merge_bytes, merge_s, merge_alpha = merge_cost(priced, topology, groups, inner["data"])
        # FL+FSDP where each group is one slice (jaxpar's name), FL+HSDP where a group spans several
        name = f"FL+{'HSDP' if inner['data'] > 1 else 'FSDP'} federation={groups},{degrees_text(inner)}"
        rows += [Row(pod, name, h, step + (merge_s + merge_alpha) / h, overlapped + (merge_s + merge_alpha) / h,
                     inner_bytes + merge_bytes / h, inner_s + merge_s / h, tokens) for h in local_steps]
    flat = {"fsdp": topology.num_chips}
    priced, layout = best_fitting(topology, cfg, batch, seq_len, flat)
    rows.append(Row(pod, f"FSDP {degrees_text(flat)} (sharded DP)", None, *step_times(priced, layout, topology), tokens))
    return rows


def print_table(rows: list[Row]) -> None:
    """One line per layout; speedups against the pod's HSDP row under the same overlap model."""
    print(f"{'pod':12s} {'layout':40s} {'H':>4s} {'step s':>8s} {'tokens/s':>10s} {'vs HSDP':>8s} "
          f"{'step s ovl':>10s} {'vs HSDP ovl':>11s} {'slow bytes/dev/step':>20s}")
    for row in rows:
        base = next(r for r in rows if r.pod == row.pod and r.layout.startswith("HSDP"))
        h = "-" if row.local_steps is None else str(row.local_steps)
        print(f"{row.pod:12s} {row.layout:40s} {h:>4s} {row.step_s:8.4f} {row.tokens / row.step_s:10,.0f} "
              f"{base.step_s / row.step_s:7.2f}x {row.overlapped_s:10.4f} {base.overlapped_s / row.overlapped_s:10.2f}x "
              f"{row.slow_bytes:20,.0f}")


def summary(rows: list[Row]) -> list[str]:
    """The best federated speedup on each pod, over HSDP and over flat FSDP, against the paper's,
    and the most any layout can gain over HSDP: its step without its slow-link seconds."""
    lines = []
    for pod in dict.fromkeys(r.pod for r in rows):
        mine = [r for r in rows if r.pod == pod]
        hsdp, flat = mine[0], mine[-1]
        best = min((r for r in mine if r.local_steps), key=lambda r: r.step_s)
        lines += [f"{pod}: best federated layout {best.layout}, H={best.local_steps}: {hsdp.step_s / best.step_s:.2f}x "
                  f"HSDP ({hsdp.overlapped_s / best.overlapped_s:.2f}x with HSDP's slow links overlapped), "
                  f"{flat.step_s / best.step_s:.2f}x flat FSDP; the paper: up to {PAPER_SPEEDUP}x over sharded DP",
                  f"  HSDP spends {hsdp.slow_s:.4f} s of its {hsdp.step_s:.4f} s step on the slow links "
                  f"({100 * hsdp.slow_s / hsdp.step_s:.1f}%): no merge schedule gains more than "
                  f"{hsdp.step_s / (hsdp.step_s - hsdp.slow_s):.2f}x over it; flat FSDP spends {flat.slow_s:.4f} s there"]
    return lines + [
        "The paper's 8.04x is over sharded DP across all its nodes, whose weight gathers and gradient reductions cross the",
        "inter-node network every step: the flat-FSDP column is that comparison. Against HSDP only one gradient shard",
        "crosses per step, so the gain is bounded by that share of the step (larger on slower links or smaller batches)."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", nargs="+", default=list(PODS), help="topologies of several slices or nodes (meshes/)")
    parser.add_argument("--model", default="llama3-8b", help="a name in jaxpar.models.CONFIGS (llama3-8b: Llama 3.1 8B's shapes)")
    parser.add_argument("--rows-per-chip", type=int, default=2, help="sequences per chip per step (global batch / chips)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--local-steps", type=int, nargs="+", default=list(LOCAL_STEPS), help="H: steps between merges")
    args = parser.parse_args()
    cfg = model_config(args.model)
    print(f"{args.model} ({cfg.num_params() / 1e9:.2f}B weights), {args.rows_per_chip} sequences of {args.seq_len} "
          f"tokens per chip per step; planner cost model, nothing compiled\n")
    rows = [row for pod in args.pods for row in pod_rows(pod, cfg, args.rows_per_chip, args.seq_len, args.local_steps)]
    print_table(rows)
    print()
    print("\n".join(summary(rows)))


if __name__ == "__main__":
    main()
