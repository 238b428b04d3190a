"""A roofline estimate of step time and MFU from a topology's FLOP/s and link bandwidths.

The collective cost model of the public "How to Scale Your Model" book, on bidirectional rings:
moving the bytes one device sends (``hlo.Collective.bytes_per_step``: all-gather and reduce-scatter
V(n-1)/n, all-reduce twice that) takes bytes / (2 x per-link bandwidth) over ICI, since a ring
sends both ways at once; an all-to-all costs a quarter of that; over DCN each chip has its own
(unidirectional) share of the data-centre network. Compute takes analytic model FLOPs / (chips x
peak), times the work rematerialisation adds (``RECOMPUTE``: a full recompute of the forward pass
is 2 of every 6 FLOPs per weight again, so 8/6; MFU still counts model FLOPs only). The estimate
assumes communication overlaps compute (step = max of the two) and also gives the serial sum as the
pessimistic bound. It is a bound: kernels below peak, bubbles and host overhead are not in it.
"""

from __future__ import annotations

import dataclasses

from jaxpar.topology import Topology

_ALL_TO_ALL_FACTOR = 0.25
# hardware FLOPs / model FLOPs by remat policy (dots keeps matmul outputs: only cheap ops rerun)
RECOMPUTE = {"none": 1.0, "dots": 1.0, "full": 8 / 6}


def collective_seconds(kind: str, bytes_sent: float, crosses_dcn: bool, topology: Topology) -> float:
    """Seconds for one device to send ``bytes_sent`` in a collective of ``kind``."""
    bandwidth = topology.dcn_bandwidth if crosses_dcn else 2 * topology.ici_bandwidth
    seconds = bytes_sent / bandwidth
    return seconds * _ALL_TO_ALL_FACTOR if kind == "all-to-all" else seconds


@dataclasses.dataclass(frozen=True)
class Estimate:
    compute_s: float
    ici_s: float
    dcn_s: float
    model_flops: float
    chips: int
    peak_flops: float

    @property
    def comm_s(self) -> float:
        return self.ici_s + self.dcn_s

    @property
    def step_s(self) -> float:
        """Step time with communication overlapped with compute."""
        return max(self.compute_s, self.comm_s)

    @property
    def serial_step_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.chips * self.peak_flops * self.step_s)

    def as_dict(self) -> dict:
        fields = dataclasses.asdict(self)
        return fields | {"comm_s": self.comm_s, "step_s": self.step_s, "serial_step_s": self.serial_step_s, "mfu": self.mfu}


def estimate(model_flops: float, traffic: list[tuple[str, float, bool]], topology: Topology, chips: int, recompute: float = 1.0) -> Estimate:
    """``traffic``: (kind, bytes one device sends per step, crosses DCN) rows, e.g. from a compiled
    step's collectives or from an analytic optimum; ``recompute``: hardware / model FLOPs."""
    ici = sum(collective_seconds(k, b, False, topology) for k, b, dcn in traffic if not dcn)
    dcn = sum(collective_seconds(k, b, True, topology) for k, b, dcn in traffic if dcn)
    compute = recompute * model_flops / (chips * topology.peak_bf16_flops)
    return Estimate(compute, ici, dcn, model_flops, chips, topology.peak_bf16_flops)
