"""Cloud TPU generations and their slices, by Google's names: ``v5p-64``, ``v5e-16``, ``2xv5p-64``.

The one table of per-chip figures for TPUs. Units are the vendors' (GB/s, GiB, TFLOP/s), as in the
TOML files of ``meshes/``; ``jaxpar.topology.tpu_slice`` turns a name into a ``Topology``.
The shipped ``tpu-*.toml`` files carry the same figures; tests/test_topology.py checks that they agree.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from jaxpar.errors import TopologyError


@dataclass(frozen=True)
class TpuGeneration:
    name: str  # as in slice names and in get_topology_desc's "<name>:<AxBxC>"
    tensorcores_per_chip: int  # Google's slice names count TensorCores: v5p-64 = 32 chips
    torus_dims: int  # 3 (v4, v5p: cubes joined by optical switches) or 2 (v5e, v6e)
    peak_bf16_tflops: float
    hbm_gib: float
    hbm_bandwidth_gbps: float
    ici_links_per_chip: int
    ici_bandwidth_gbps: float  # per link, one direction
    dcn_bandwidth_gbps: float  # per chip, one direction
    shapes: tuple[tuple[int, ...], ...]  # the slices' chip grids, smallest first

    @property
    def slices(self) -> dict[str, tuple[int, ...]]:
        """Slice name -> chip grid, smallest first: ``{"v5p-8": (2, 2, 1), ...}``."""
        return {f"{self.name}-{math.prod(s) * self.tensorcores_per_chip}": s for s in self.shapes}


# Google's published slice shapes (cloud.google.com/tpu/docs/v4, /v5p, /v5e, /v6e), each accepted by
# get_topology_desc from its "<generation>:<AxBxC>" string alone. Single-chip 1x1 slices are left out:
# libtpu describes them only when also given chips_per_host_bounds=(1, 1, 1).
# 32 chips is 4x4x2 here; Google writes that slice 2x4x4, and libtpu accepts both.
_CUBE_SHAPES = (
    (2, 2, 1), (2, 2, 2), (2, 2, 4), (4, 4, 2), (4, 4, 4), (4, 4, 8), (4, 8, 8), (8, 8, 8),
    (8, 8, 16), (8, 16, 16), (16, 16, 16),
)
_GRID_SHAPES = ((2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16), (16, 16))  # 16x16 is a whole pod

GENERATIONS: dict[str, TpuGeneration] = {g.name: g for g in (
    TpuGeneration(
        "v4", tensorcores_per_chip=2, torus_dims=3,
        # Google Cloud TPU v4 documentation (cloud.google.com/tpu/docs/v4): 275 TFLOP/s bf16 per
        # chip, HBM2 32 GiB at 1200 GBps, 3D mesh/torus, 4096 chips (16x16x16) per pod.
        peak_bf16_tflops=275.0, hbm_gib=32, hbm_bandwidth_gbps=1200.0,
        # Jouppi et al., "TPU v4: An Optically Reconfigurable Supercomputer..." (ISCA 2023), as
        # summarised at glennklockwood.com/garden/processors/TPUv4: 6 ICI links per chip (3D torus),
        # 400 Gbps in each direction per link = 50 GB/s per link per direction.
        ici_links_per_chip=6, ici_bandwidth_gbps=50.0,
        # NOMINAL: Google's v4 page gives no per-chip DCN figure; 6.25 GB/s is v5p's 50 Gbps.
        dcn_bandwidth_gbps=6.25,
        shapes=_CUBE_SHAPES,
    ),
    TpuGeneration(
        "v5e", tensorcores_per_chip=1, torus_dims=2,
        # Google Cloud TPU v5e documentation (cloud.google.com/tpu/docs/v5e): 197 TFLOP/s bf16 per
        # chip, HBM2 16 GB at 819 GBps (listed as 16 GB; recorded here as 16 GiB), 400 GBps
        # bidirectional ICI per chip, 4 ICI ports per chip, 2D torus, 8 chips and 2 x 100 Gbps
        # NICs per host.
        peak_bf16_tflops=197.0, hbm_gib=16, hbm_bandwidth_gbps=819.0,
        # 400 GB/s bidirectional per chip over 4 ports = 50 GB/s per link per direction.
        ici_links_per_chip=4, ici_bandwidth_gbps=50.0,
        # 2 x 100 Gbps per 8-chip host = 25 Gbps per chip = 3.125 GB/s (= 6.4 Tbps per 256-chip pod).
        dcn_bandwidth_gbps=3.125,
        shapes=_GRID_SHAPES,
    ),
    TpuGeneration(
        "v5p", tensorcores_per_chip=2, torus_dims=3,
        # Google Cloud TPU v5p documentation (cloud.google.com/tpu/docs/v5p): 459 TFLOP/s bf16 per
        # chip, 95 GiB HBM at 2765 GBps, 1200 GBps bidirectional ICI per chip, 3D torus, 50 Gbps DCN
        # per chip; the largest slice is 16x16x24 (6144 chips).
        peak_bf16_tflops=459.0, hbm_gib=95, hbm_bandwidth_gbps=2765.0,
        # 1200 GB/s bidirectional per chip over 6 torus links = 100 GB/s per link per direction
        # (the same page's older table: "Interchip Interconnect BW 4800 Gbps" = 600 GB/s per direction).
        ici_links_per_chip=6, ici_bandwidth_gbps=100.0,
        # 50 Gbps per chip = 6.25 GB/s.
        dcn_bandwidth_gbps=6.25,
        shapes=_CUBE_SHAPES + ((16, 16, 24),),
    ),
    TpuGeneration(
        "v6e", tensorcores_per_chip=1, torus_dims=2,
        # Google Cloud TPU v6e (Trillium) documentation (cloud.google.com/tpu/docs/v6e): 918 TFLOP/s
        # bf16 per chip, HBM 32 GB at 1640 GBps (listed as 32 GB; recorded here as 32 GiB), 800 GBps
        # bidirectional ICI per chip, 4 ICI ports per chip, 2D torus, 8 chips and 4 x 200 Gbps NICs
        # per host.
        peak_bf16_tflops=918.0, hbm_gib=32, hbm_bandwidth_gbps=1640.0,
        # 800 GB/s bidirectional per chip over 4 ports = 100 GB/s per link per direction.
        ici_links_per_chip=4, ici_bandwidth_gbps=100.0,
        # 4 x 200 Gbps per 8-chip host = 100 Gbps per chip = 12.5 GB/s.
        dcn_bandwidth_gbps=12.5,
        shapes=_GRID_SHAPES,
    ),
)}

# "[<slices>x]<generation>-<size>"; the generation part is loose so that "v3-8" or "v7x-8" are
# recognised as slice names and told which generations exist, not sent to the file lookup.
_SLICE_NAME = re.compile(r"(?:(\d+)x)?(v\d+[a-z]*)-(\d+)")


def parse_slice_name(name: str) -> tuple[TpuGeneration, tuple[int, ...], int] | None:
    """``(generation, chip grid of one slice, number of slices)`` for a TPU slice name; None when
    ``name`` is not shaped like one. Raises TopologyError naming the valid choices when it is shaped
    like one but names no generation or size in the table."""
    match = _SLICE_NAME.fullmatch(name)
    if match is None:
        return None
    count, generation, size = match.groups()
    if generation not in GENERATIONS:
        raise TopologyError(
            f"unknown TPU generation {generation!r} in {name!r}; jaxpar knows {', '.join(GENERATIONS)} "
            f"(e.g. v5p-64, v5e-16, 2xv5p-64). For other hardware write a topology file "
            f"(schema in meshes/README.md)."
        )
    g = GENERATIONS[generation]
    one_slice = f"{generation}-{size}"
    if one_slice not in g.slices:
        counts = "chips" if g.tensorcores_per_chip == 1 else f"TensorCores ({g.tensorcores_per_chip} per chip)"
        raise TopologyError(
            f"{name!r} is not a {generation} slice: {generation} names count {counts}. "
            f"{generation} slices: {', '.join(g.slices)}. Pick one of these, or write a topology file "
            f"for another shape (schema in meshes/README.md)."
        )
    num_slices = int(count) if count else 1
    if num_slices < 1:
        raise TopologyError(f"{name!r} asks for {num_slices} slices; write at least 1, e.g. 2x{one_slice}")
    return g, g.slices[one_slice], num_slices
