"""One training step of a block diffusion model (``models/bd3lm.py``) under context parallelism (CP),
block parallelism (BP) and both (CSBP), estimated per device with its exposed communication.

The layout is ``data=D`` times one of ``context=C`` (CP), ``block=P`` (BP) or ``block=P,context=C``
(CSBP, P a multiple of C): D sequences per step, each [x_t ; x_0] (2L places) over the P or C
devices of its group. Per layer and device:

- tokens held: CP 2L/C; BP L/P noisy plus the clean prefix (``blocks.clean_prefix``); CSBP L/P
  noisy plus L/P clean (a ring rank's share split over its P/C devices).
- query-key pairs the busiest device's kernel computes, per head, by ``kernel``: ``"ideal"`` the
  pairs the mask allows (a kernel that skips every masked block of the model's block size);
  ``"jaxpar"`` what jaxpar's kernels compute: CP's ring every pair of chunks the three-part mask
  leaves an allowed entry in, whole (``split_attention.rank_work``), BP and CSBP every held query
  against every key it receives (the mask is evaluated at traced places, so no block is skipped).
- compute: 6 FLOPs per layer weight and token held, 8 with the forward rerun (remat saves each
  layer's input, and its attention's output and log-sum-exp, so the ring runs once each way), and
  the attention's 4 FLOPs per pair and head dimension, 4.5 times (forward, flash backward 2.5,
  rerun 1), at the chip's matmul efficiency (``roofline.matmul_efficiency``); the logits of the
  noisy tokens held on top.
- K/V sent (bf16 K and V, gradients at ``grad_bytes``): a ring of C hops of one chunk (CP: 2L/C
  places, CSBP: the clean L/C), R-1 forward, R-1 backward with the gradients riding along, and
  the gradients' last hop home; CSBP with P > C also all-gathers a rank's pieces among its P/C
  devices and reduce-scatters their gradients; ``clean_kv=fetch`` (a sliding window) no ring:
  a device holds its rank's whole share and fetches the W clean tokens before each of its two
  chunks in one all-to-all, their gradients sent back in another.
- exposed (``overlap.ring_exposed``): each hop beyond the ring step's attention it hides under,
  the gradients' hop home, the pieces' gather and scatter and the fetch whole; the weights, split over every
  device (ZeRO-3, 16 bytes each in the state), gathered in bf16 for the forward and again for the
  backward and reduced in float32: the first gather and the last reduction of a layer, plus what a
  layer's transfer takes beyond the layer's compute. A collective whose devices span nodes (or
  slices) runs at DCN's bandwidth, otherwise at the node's (``roofline.link_bandwidth``).

Memory: the state split over every device, each layer's bf16 input kept for the backward pass
and one layer's working set (its input, q/k/v/out and the MLP's three activations, bf16; the
attention flash-like, linear in the tokens). Not modelled: the attention kernel's efficiency below
the matmuls', launch and synchronisation latency, a ring's links shared with other traffic.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxpar.analysis import roofline
from jaxpar.analysis.overlap import kv_ring_exposed
from jaxpar.models import bd3lm
from jaxpar.parallel import parse_strategy
from jaxpar.parallel.block import blocks
from jaxpar.parallel.context.split_attention import rank_work, sequence_order
from jaxpar.topology import Topology

KERNELS = ("ideal", "jaxpar")
ATTENTION_PASSES = 4.5  # forward, a flash backward (2.5: it recomputes the scores), the rerun forward
MATMUL_PASSES = 8  # FLOPs per weight and token: forward 2, backward 4, the rerun forward 2


@dataclasses.dataclass(frozen=True)
class BlockDiffusionStep:
    """Per device: one sequence's places held, the busiest device's pairs per head and layer, the
    K/V bytes sent per layer, and the step's seconds (see the module doc)."""

    strategy: str
    kernel: str
    layers: int
    tokens_held: int
    pairs: int
    kv_bytes: float
    compute_s: float
    exposed_s: dict[str, float]
    memory_bytes: float

    @property
    def step_s(self) -> float:
        return self.compute_s + sum(self.exposed_s.values())

    @property
    def kv_bytes_per_step(self) -> float:
        return self.layers * self.kv_bytes


@dataclasses.dataclass(frozen=True)
class _Degrees:
    data: int
    ranks: int  # block degree (1: CP)
    ring: int  # context degree (1: BP)
    fetch: bool  # clean_kv=fetch: a window's clean keys fetched in one all-to-all, no ring

    @property
    def group(self) -> int:
        return max(self.ranks, self.ring)


def estimate(cfg: bd3lm.BD3LMConfig, length: int, topology: Topology, strategy: str, kernel: str = "ideal",
             grad_bytes: int = 4) -> BlockDiffusionStep:
    """The step of ``length``-token sequences (one per data rank) under ``strategy`` on all of
    ``topology``'s chips; ``kernel`` and ``grad_bytes`` (the K/V gradients' bytes on the ring) as in
    the module doc."""
    d = _degrees(strategy, topology.num_chips, kernel)
    held = _held(cfg, length, d)
    pairs = _pairs(cfg, length, d, kernel)
    rate = topology.peak_bf16_flops * roofline.matmul_efficiency(topology.chip)
    attention_forward = 4 * pairs * cfg.heads * cfg.head_dim / rate
    layer_s = MATMUL_PASSES * held * _layer_weights(cfg) / rate + ATTENTION_PASSES * attention_forward
    noisy = length // d.group  # the noisy tokens a device holds, whose logits it computes
    logits_s = MATMUL_PASSES * noisy * cfg.embed * cfg.vocab_size / rate
    kv_bytes, ring_s, share_s = _ring(cfg, length, d, topology, attention_forward, grad_bytes)
    exposed = {"ring": cfg.layers * ring_s, "share": cfg.layers * share_s,
               "weights": _weights_exposed(cfg, topology, layer_s)}
    working = held * (2 * cfg.embed + (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim + 3 * cfg.mlp) * 2
    memory = 16 * cfg.num_params() / topology.num_chips + cfg.layers * held * cfg.embed * 2 + working
    return BlockDiffusionStep(strategy=strategy, kernel=kernel, layers=cfg.layers, tokens_held=held, pairs=int(pairs),
                              kv_bytes=kv_bytes, compute_s=cfg.layers * layer_s + logits_s, exposed_s=exposed,
                              memory_bytes=memory)


def _degrees(strategy: str, chips: int, kernel: str) -> _Degrees:
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}: one of {', '.join(KERNELS)}")
    parsed = parse_strategy(strategy, chips)
    d = _Degrees(parsed.degrees["data"], parsed.written_degrees["block"], parsed.degrees["context"],
                 parsed.options["clean_kv"] == "fetch")
    if d.data * d.group != chips or (d.ranks > 1 and d.ranks % d.ring):
        raise ValueError(f"{strategy!r} on {chips} chips: the estimate takes data=D with context=C, block=P or "
                         f"block=P,context=C (P a multiple of C), D x max(P, C) = {chips}")
    return d


def _held(cfg, length: int, d: _Degrees) -> int:
    if d.ranks == 1:
        return 2 * length // d.ring
    clean = blocks.clean_prefix(length, cfg.block_size) if d.ring == 1 else length // (d.ring if d.fetch else d.ranks)
    return length // d.ranks + clean


def _pairs(cfg, length: int, d: _Degrees, kernel: str) -> int:
    if kernel == "ideal":
        return int(device_pairs(length, cfg.block_size, cfg.window, d.ranks, d.ring, d.fetch).max())
    if d.ranks == 1:
        # the ring's chunk pairs, at a length with 8 mask blocks a chunk: which pairs the three-part
        # mask empties is the same at any length with 2 or more (a window scaled with the length)
        small = min(length, 8 * d.ring * cfg.block_size)
        window = None if cfg.window is None else max(cfg.block_size, cfg.window * small // length // cfg.block_size * cfg.block_size)
        return int(rank_work(bd3lm.block_diffusion_mask(small, cfg.block_size, window), 2 * small, d.ring).max() * (length / small) ** 2)
    held = _held(cfg, length, d)
    if d.fetch:  # its own keys and the window before each of its two chunks
        return held * (held + 2 * cfg.window)
    clean = blocks.clean_prefix(length, cfg.block_size) if d.ring == 1 else length
    return held * (length // d.ranks + clean)


def device_pairs(length: int, block_size: int, window: int | None, ranks: int, ring: int, fetch: bool = False) -> np.ndarray:
    """(devices of a group,) the query-key pairs the mask allows each device's share of one
    sequence, per head and layer: BP and CSBP from their shares (``blocks.attention_work``), CP
    (``ranks`` 1) from the zigzag order of the whole [x_t ; x_0] over the ring."""
    if ranks > 1:
        return blocks.attention_work(length, block_size, ranks, ring, window, fetch)
    places = sequence_order(2 * length, ring).reshape(ring, -1)
    return blocks.keys_read(places, length, block_size, window).sum(axis=1)


def _layer_weights(cfg) -> int:
    return (2 * cfg.embed * cfg.heads * cfg.head_dim + 2 * cfg.embed * cfg.kv_heads * cfg.head_dim
            + 3 * cfg.embed * cfg.mlp)


def _crosses(topology: Topology, devices: int) -> bool:
    """Whether ``devices`` consecutive chips span more than one node or slice."""
    return devices > topology.chips_per_slice


def _ring(cfg, length: int, d: _Degrees, topology: Topology, attention_forward: float, grad_bytes: int):
    """(K/V bytes sent, exposed ring seconds, exposed seconds of the share's gather or fetch), per layer."""
    if d.ring == 1:
        return 0.0, 0.0, 0.0
    per_token = 2 * cfg.kv_heads * cfg.head_dim * 2  # K and V, bf16
    if d.fetch:  # the window before each of a device's two chunks, its gradients sent back: all before or after the attention
        sent = 2 * cfg.window * per_token * (1 + grad_bytes / 2)
        return sent, 0.0, sent / roofline.link_bandwidth(topology, _crosses(topology, d.ring))
    chunk = (2 * length if d.ranks == 1 else length) // d.ring * per_token
    grads = chunk * grad_bytes / 2
    link = roofline.link_bandwidth(topology, _crosses(topology, d.ring))
    exposed = kv_ring_exposed(chunk, grads, link, attention_forward / d.ring, d.ring)
    sent = 2 * (d.ring - 1) * chunk + d.ring * grads
    pieces = 0.0
    if d.ranks > d.ring:  # a rank's share gathered among its P/C devices, the gradients scattered back
        g = d.ranks // d.ring
        share = (g - 1) / g * chunk
        sent += share + share * grad_bytes / 2
        pieces = (share + share * grad_bytes / 2) / roofline.link_bandwidth(topology, _crosses(topology, d.group))
    return sent, exposed, pieces


def _weights_exposed(cfg, topology: Topology, layer_s: float) -> float:
    """ZeRO-3 over every chip: per layer two bf16 gathers and a float32 reduce-scatter of its weights."""
    n = topology.num_chips
    share = (n - 1) / n * _layer_weights(cfg)
    link = roofline.link_bandwidth(topology, _crosses(topology, n))
    gather, reduce = 2 * share / link, 4 * share / link
    return gather + reduce + cfg.layers * max(0.0, 2 * gather + reduce - layer_s)
