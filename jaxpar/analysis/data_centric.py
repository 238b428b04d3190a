"""A data-centric parallel step (``train/dcp.py``) against static context parallelism and packing,
estimated per device with the ring's exposed communication, for a batch of sequence lengths.

Every layout runs rows of packed sequences; a row of L positions split over c devices (c = 1: data
parallel) costs a device:

- compute: the row's FLOPs / c at the chip's matmul efficiency (``roofline.matmul_efficiency``):
  the matmuls of every position (padding too) and the causal query-key pairs inside each sequence
  (a kernel that skips the pairs across sequences);
- on a ring (c > 1), per layer, the exposed part of its K/V's hops (``overlap.ring_exposed``): a
  hop carries L/c positions' bf16 K and V whatever the sequences in them, and hides under one ring
  step's attention (the row's pairs / c^2); the backward's hops carry the K/V gradients too
  (``grad_bytes`` each) and one more takes them home. A short sequence in a long row has little
  attention to hide its hops under: that is what static context parallelism pays.

A device's step is the sum over the rows it runs; the step is the busiest device's. DCP deals rows
as ``dcp.plan`` does (each bucket its own degree, the most work to the least loaded group);
static context parallelism packs first fit into rows of the longest length, split c ways, dealt in
order as a data loader would; packing is static with c = 1 (it fits only if the longest sequence
fits one device's ``capacity``). Every layout runs one program over all devices, so every group
runs as many rows: a group short of rows runs empty ones (their matmuls cost what a full row's do). Not modelled: the final gradient reduction (the same for all),
launch latency, the programs' dispatch.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxpar.analysis import roofline
from jaxpar.analysis.overlap import kv_ring_exposed
from jaxpar.topology import Topology
from jaxpar.train import dcp


@dataclasses.dataclass(frozen=True)
class LayoutStep:
    """One layout's estimate: the busiest device's seconds, the mean device's, and the exposed
    ring seconds of the busiest device."""

    name: str
    step_s: float
    mean_s: float
    exposed_s: float
    fits: bool = True


def row_seconds(lengths, row_length: int, context: int, cfg, topology: Topology, grad_bytes: int = 4) -> tuple[float, float]:
    """(compute, exposed ring) seconds a device of a ``context``-way row of ``row_length``
    positions spends on the sequences of ``lengths`` packed in it."""
    rate = topology.peak_bf16_flops * roofline.matmul_efficiency(topology.chip)
    pairs = sum(n * (n - 1) / 2 for n in lengths)
    matmuls = cfg.flops_per_token(0) * row_length  # every position of the row, padding too
    compute = (matmuls + 3 * 4 * cfg.layers * cfg.heads * cfg.head_dim * pairs) / context / rate
    if context == 1:
        return compute, 0.0
    chunk = row_length / context * 2 * cfg.kv_heads * cfg.head_dim * 2
    grads = chunk * grad_bytes / 2
    link = roofline.link_bandwidth(topology, context > topology.chips_per_slice)
    step = 4 * cfg.heads * cfg.head_dim * pairs / context**2 / rate  # one ring step's forward attention, per layer
    return compute, cfg.layers * kv_ring_exposed(chunk, grads, link, step, context)


def compare(lengths, cfg, topology: Topology, capacity: int, static_context: int, memory_budget: float) -> list[LayoutStep]:
    """DCP, static context parallelism over ``static_context`` devices and packing, for one batch."""
    lengths = [int(n) for n in lengths]
    n = topology.num_chips
    dcp_rows = [(g, bucket.context, bucket.length, row) for bucket in dcp.plan(lengths, n, capacity, cfg, memory_budget)
                for g, rows in enumerate(bucket.rows) for row in rows]
    out = [_step("dcp", dcp_rows, lengths, cfg, topology)]
    longest = max(lengths) - 1
    for c, name in ((static_context, f"static context={static_context}"), (1, "packing")):
        row_length = math.ceil(longest / c) * c
        rows = dcp.first_fit(lengths, row_length)
        rows += [[]] * (-len(rows) % (n // c))  # every group runs as many rows (a static shape)
        dealt = [(k % (n // c), c, row_length, row) for k, row in enumerate(rows)]  # in order, as a data loader deals them
        out.append(dataclasses.replace(_step(name, dealt, lengths, cfg, topology), fits=row_length <= capacity * c))
    return out


def _step(name: str, rows, lengths, cfg, topology: Topology) -> LayoutStep:
    """The layout's step from its (data group, context, row length, sequence indices) rows."""
    time, exposed = np.zeros(topology.num_chips), np.zeros(topology.num_chips)
    for g, context, row_length, row in rows:
        compute, waits = row_seconds([lengths[i] for i in row], row_length, context, cfg, topology)
        time[g * context:(g + 1) * context] += compute + waits
        exposed[g * context:(g + 1) * context] += waits
    busiest = int(time.argmax())
    return LayoutStep(name, float(time[busiest]), float(time.mean()), float(exposed[busiest]))
