"""A roofline of one training step that can rank plans: step time and MFU from a topology's FLOP/s,
HBM bandwidth and link bandwidths, with every term visible.

``estimate_step`` prices one step per chip. The compute terms add up (a chip runs one kernel at a
time):

- ``matmul_s``: the weight matmuls, 6 FLOPs per weight per token times ``recompute`` (the forward
  work rematerialisation runs again), at peak x ``matmul_efficiency(chip)`` (``MATMUL_EFFICIENCY``:
  a table per chip generation, each number calibrated on a published run). Never faster than
  reading the (gathered) weights from HBM once per pass: a small per-chip batch is HBM-bound.
- ``attention_s``: the score and value matmuls at the kernel in use. A flash kernel (splash,
  cudnn, blockwise) skips the masked half of a causal score matrix, but computes diagonal blocks
  whole and recomputes the scores in its backward pass; the naive path computes all L x L.
- ``hbm_s``: the work that moves bytes rather than FLOPs, at the chip's HBM bandwidth, by part
  (``hbm_by_part_s``): ``norms``, ``elementwise`` (residual adds, SwiGLU, RoPE), ``attention`` (a
  flash kernel reads and writes q, k, v, o and their gradients, k and v once per query block; the
  naive path also writes and reads the L x L float32 scores several times), ``logits``
  (cross-entropy over the vocabulary) and ``optimizer`` (Adam reading and writing weights,
  gradients and moments: the ZeRO-table state of one chip).

Communication, at ``collective_seconds``' cost model, is split in two:

- exposed (adds to the step): the first weight gather (the top-level weights and the first layer's,
  before anything can run), the last gradient reduction (the same share, after the backward pass
  ends), activation collectives of tensor, sequence, context or expert axes (each waits for the
  matmul that produced its input, and the next matmul waits for it), and everything over DCN;
- overlapped: the rest (the other layers' gathers and reductions, ring-attention and pipeline
  permutes), hidden behind compute unless it takes longer.

``step_s = max(compute_s, overlapped_comm_s) + exposed_comm_s``.

MFU counts the FLOPs the model needs: its matmuls and the causal half of attention. Every kernel here runs at most at the matmul efficiency and does at least the
model's FLOPs times ``recompute``, so MFU <= efficiency / recompute (``ceiling_mfu``).
``mfu_full_attention`` counts the whole L x L instead, as ``LlamaConfig.flops_per_token`` and
the published MFU tables we compare with do. Not modelled: pipeline bubbles, host offloading,
input pipelines, launch overheads, contention between collectives sharing a link.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping, Sequence

import jax.numpy as jnp

from jaxpar.attention import DEFAULT_BLOCK
from jaxpar.models.llama import CONFIGS, LlamaConfig
from jaxpar.topology import Topology

_ALL_TO_ALL_FACTOR = 0.25
# hardware FLOPs / model FLOPs by remat policy (dots keeps matmul outputs: only cheap ops rerun)
RECOMPUTE = {"none": 1.0, "dots": 1.0, "full": 8 / 6}

# Fraction of peak a chip's bf16 matmuls sustain in a training step, keyed by the prefix of
# ``Topology.chip`` (or of a JAX device kind, spaces as dashes). Each measured figure is the value,
# to two decimals, that makes ``estimate_step`` reproduce one published MaxText run's MFU (with the
# run's shapes, batch, remat policy and FSDP traffic; tests/test_roofline.py recomputes them all).
# It absorbs what the model leaves out (kernels below peak, fusions, host offloading):
MATMUL_EFFICIENCY = {
    # MaxText's 22B config on v4-128 (PUBLISHED_RUNS): 56.7% MFU
    "tpu-v4": 0.79,
    # MaxText's Llama2-70B on v5e-256 (PUBLISHED_RUNS): 57% MFU
    "tpu-v5e": 0.71,
    "tpu-v5-lite": 0.71,  # the device kind JAX reports for a v5e
    # MaxText's Llama2-70B on 512 v5p chips (PUBLISHED_RUNS): 65.4% MFU; its 128B run with tensor
    # parallelism there is held out
    "tpu-v5p": 0.77,
    # MaxText's Llama2-70B on 256 v6e chips (PUBLISHED_RUNS): 43.8% MFU; the two Llama 3.1 runs on
    # v6e there are held out, a check of the model rather than of this number
    "tpu-v6e": 0.55,
    "tpu-v6-lite": 0.55,  # the device kind JAX reports for a v6e
    # MaxText's Llama2-7B on one A3 node of 8 H100s (PUBLISHED_RUNS): 492 TFLOP/s per chip
    "nvidia-h100": 0.51,
    # not measured: the H100's Hopper tensor cores (only HBM, modelled apart, differs)
    "nvidia-h200": 0.51,
    # the cpu topologies' FLOP/s are nominal already (meshes/cpu-*.toml): no discount on top
    "cpu": 1.0,
}

# Naive attention's float32 score matrix (jaxpar.attention._naive) goes through HBM this many times
# per training step: forward writes the scores, reads them for max and sum, writes and reads the
# probabilities (4); backward reads the probabilities, writes dP, reads dP and P to write dS, and
# reads dS for dQ and dK (7). A rerun forward pass adds 4 more.
NAIVE_SCORE_PASSES = 11
SCORE_BYTES = 4
FLASH_KERNELS = ("auto", "blockwise", "splash", "cudnn")  # auto is one of the other three
LOGIT_BYTES, LOGIT_PASSES = 4, 4  # float32 logits: written, read for log-sum-exp, gradient written and read


def collective_seconds(kind: str, bytes_sent: float, crosses_dcn: bool, topology: Topology) -> float:
    """Seconds for one device to send ``bytes_sent`` in a collective of ``kind``: bytes over
    ``link_bandwidth``, a quarter of that for an all-to-all on a torus (the cost model of the
    public "How to Scale Your Model" book; the nominal CPU topologies are priced as tori)."""
    seconds = bytes_sent / link_bandwidth(topology, crosses_dcn)
    return seconds * _ALL_TO_ALL_FACTOR if kind == "all-to-all" and topology.platform != "gpu" else seconds


def link_bandwidth(topology: Topology, crosses_dcn: bool) -> float:
    """Bytes/s one chip sends on a link tier. DCN (between slices or nodes): the chip's own
    unidirectional share of the data-centre network. A TPU torus: a bidirectional ring on one axis,
    both links of that axis at once (2 x per-link). A GPU node: every NVLink goes to the NVSwitch,
    so a chip sends to any peer on all of them (links x per-link, one direction); an all-to-all
    gains nothing over a ring there."""
    if crosses_dcn:
        return topology.dcn_bandwidth
    if topology.platform == "gpu":
        return topology.ici_links_per_chip * topology.ici_bandwidth
    return 2 * topology.ici_bandwidth


def matmul_efficiency(chip: str) -> float:
    """``MATMUL_EFFICIENCY`` of a chip; a chip not in the table gets the table's lowest figure."""
    name = chip.lower().replace(" ", "-")
    return next((e for prefix, e in MATMUL_EFFICIENCY.items() if name.startswith(prefix)), min(MATMUL_EFFICIENCY.values()))


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """Seconds per step on each chip, by term (see the module docstring)."""

    chips: int
    peak_flops: float  # per chip
    matmul_efficiency: float
    recompute: float
    model_flops: float  # per step, all chips: matmuls + causal attention
    full_attention_flops: float  # per step, all chips: matmuls + the whole L x L attention
    matmul_s: float
    attention_s: float
    hbm_by_part_s: dict[str, float]
    first_gather_s: float  # exposed: the weights gathered before anything runs
    last_reduction_s: float  # exposed: the gradients reduced after the backward pass
    activation_comm_s: float  # exposed: collectives on the critical path of the layers
    ici_s: float  # every collective over ICI, exposed or not
    dcn_s: float  # every collective over DCN, all exposed
    state_bytes: float  # weights, gradients and optimizer state per chip
    hbm_bytes: float  # HBM capacity per chip

    @property
    def hbm_s(self) -> float:
        return sum(self.hbm_by_part_s.values())

    @property
    def compute_s(self) -> float:
        return self.matmul_s + self.attention_s + self.hbm_s

    @property
    def comm_s(self) -> float:
        return self.ici_s + self.dcn_s

    @property
    def exposed_comm_s(self) -> float:
        return self.first_gather_s + self.last_reduction_s + self.activation_comm_s + self.dcn_s

    @property
    def overlapped_comm_s(self) -> float:
        return self.comm_s - self.exposed_comm_s

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.overlapped_comm_s) + self.exposed_comm_s

    @property
    def serial_step_s(self) -> float:
        """No overlap at all: the pessimistic bound."""
        return self.compute_s + self.comm_s

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.chips * self.peak_flops * self.step_s)

    @property
    def mfu_full_attention(self) -> float:
        return self.full_attention_flops / (self.chips * self.peak_flops * self.step_s)

    @property
    def ceiling_mfu(self) -> float:
        return self.matmul_efficiency / self.recompute

    @property
    def fits(self) -> bool:
        """Whether the state fits in HBM (activations are not counted: a compile measures those)."""
        return self.state_bytes <= self.hbm_bytes

    @property
    def rank_key(self) -> tuple:
        """Sort key, best plan first: a plan that does not fit ranks last; ties (equal steps) go to
        less communication, then to less state."""
        return (not self.fits, round(self.step_s, 9), self.comm_s, self.state_bytes)

    def as_dict(self) -> dict:
        derived = ("hbm_s", "compute_s", "comm_s", "exposed_comm_s", "overlapped_comm_s", "step_s", "serial_step_s",
                   "mfu", "mfu_full_attention", "ceiling_mfu", "fits")
        return dataclasses.asdict(self) | {name: getattr(self, name) for name in derived}


def estimate_step(
    cfg: LlamaConfig,
    batch: int,
    seq_len: int,
    traffic: Iterable[tuple[str, str | Sequence[str], float, bool]],
    topology: Topology,
    chips: int,
    *,
    state_bytes: Mapping[str, float],
    batch_axes: Collection[str],
    tensor: int = 1,
    recompute: float = 1.0,
    attention: str = "auto",
    compute_dtype: str = "bfloat16",
) -> StepEstimate:
    """The roofline of one training step of ``batch`` sequences of ``seq_len`` tokens on ``chips``.

    ``traffic``: (collective kind, mesh axes (a name or a tuple), bytes one chip sends per step,
    crosses DCN) rows, from a compiled step's collectives or from a layout's analytic optimum.
    ``state_bytes``: the ZeRO table of one chip (``memory.zero_table``: parameters,
    gradient_accumulation, optimizer). ``batch_axes``: the mesh axes the batch is split over
    (``Layout.batch_axes``): rows over only these carry weights and gradients, the others
    activations. ``tensor``: the tensor-parallel degree (the residual stream's norms and adds are
    replicated over it). ``recompute``: hardware / model matmul FLOPs (``RECOMPUTE[policy]``).
    ``attention``: the kernel (``TrainConfig.attention``)."""
    if recompute < 1:
        raise ValueError(f"recompute={recompute}: hardware FLOPs are at least the model's (1.0 when nothing reruns)")
    if attention not in (*FLASH_KERNELS, "naive"):
        raise ValueError(f"unknown attention kernel {attention!r}: one of {', '.join((*FLASH_KERNELS, 'naive'))}")
    flash = attention in FLASH_KERNELS
    efficiency = matmul_efficiency(topology.chip)
    rate = chips * topology.peak_bf16_flops * efficiency  # FLOP/s of all chips' matmuls
    tokens = batch * seq_len
    rerun = 3 * (recompute - 1)  # forward passes run again (6 FLOPs per weight: 2 forward, 4 backward)
    cb = jnp.dtype(compute_dtype).itemsize

    weights = _matmul_weights(cfg)
    # whole L x L forward (QK^T and PV) on every token; the model needs the causal half of it
    attention_forward = 4 * cfg.layers * cfg.heads * cfg.head_dim * seq_len * tokens
    model_flops = 6 * weights * tokens + 3 * attention_forward / 2
    if flash:
        # computed blocks of a causal matrix of L / block blocks a side: half, plus the diagonal;
        # the backward pass recomputes the scores (5 matmuls to the forward's 2)
        computed, passes = min(1.0, 0.5 + DEFAULT_BLOCK / (2 * seq_len)), 3.5
    else:
        computed, passes = 1.0, 3.0
    weight_reads = weights / tensor * cb * (3 + rerun) / topology.hbm_bandwidth  # forward, dX, dW, rerun
    matmul_s = max(recompute * 6 * weights * tokens / rate, weight_reads)
    attention_s = attention_forward * computed * (passes + rerun) / rate

    hbm = _hbm_bytes(cfg, tokens / chips, tensor, seq_len, rerun, flash, cb, state_bytes)

    edge = _edge_fraction(cfg)
    weight_axes = set(batch_axes)
    ici = dcn = first_gather = last_reduction = activation = 0.0
    for kind, axes, sent, crosses_dcn in traffic:
        seconds = collective_seconds(kind, sent, crosses_dcn, topology)
        if crosses_dcn:
            dcn += seconds
            continue
        ici += seconds
        if set((axes,) if isinstance(axes, str) else axes) <= weight_axes:
            # one layer's share (plus the top-level weights) of the weights' traffic; an upper bound
            # where the backward pass gathers again or micro-batches gather each time
            if kind == "all-gather":
                first_gather += edge * seconds
            else:
                last_reduction += edge * seconds
        elif kind != "collective-permute":  # ring attention and pipeline sends overlap by design
            activation += seconds

    return StepEstimate(
        chips=chips, peak_flops=topology.peak_bf16_flops, matmul_efficiency=efficiency, recompute=recompute,
        model_flops=model_flops, full_attention_flops=6 * weights * tokens + 3 * attention_forward,
        matmul_s=matmul_s, attention_s=attention_s,
        hbm_by_part_s={part: b / topology.hbm_bandwidth for part, b in hbm.items()},
        first_gather_s=first_gather, last_reduction_s=last_reduction, activation_comm_s=activation,
        ici_s=ici, dcn_s=dcn, state_bytes=sum(state_bytes.values()), hbm_bytes=topology.hbm_bytes,
    )


def _matmul_weights(cfg: LlamaConfig) -> int:
    """Weights that enter a token's matmuls (as ``LlamaConfig.flops_per_token`` counts them): the
    active ones (a mixture of experts: its top-k experts') but the embedding table's lookup and
    the norms."""
    lookup = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.embed
    return cfg.active_params() - lookup - (2 * cfg.layers + 1) * cfg.embed


def _edge_fraction(cfg: LlamaConfig) -> float:
    """The share of the weights gathered before the first layer runs (the top-level weights and the
    first layer's), which is also the share reduced after the last backward layer."""
    top_level = cfg.vocab_size * cfg.embed * (1 if cfg.tie_embeddings else 2) + cfg.embed
    per_layer = (cfg.num_params() - top_level) / cfg.layers
    return (top_level + per_layer) / cfg.num_params()


def _hbm_bytes(cfg: LlamaConfig, tokens_per_chip: float, tensor: int, seq_len: int, rerun: float, flash: bool,
               cb: int, state_bytes: Mapping[str, float]) -> dict[str, float]:
    """Bytes each chip moves through HBM per step for the work that is not a weight matmul, by part.

    Counted as unfused passes (each op reads its inputs and writes its output once per forward,
    backward and rerun forward pass): XLA fuses some of them, which the calibrated efficiency
    absorbs. Work over ``embed`` (norms, residual adds) is replicated over ``tensor``."""
    e, h, k, d, m, n = cfg.embed, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.active_mlp(), cfg.layers
    replicated = tokens_per_chip * tensor
    # K and V stream past every query block of a flash kernel (causal: half the blocks); Q, O and
    # their gradients pass once
    rereads = max(1.0, seq_len / (2 * DEFAULT_BLOCK)) if flash else 1.0
    qkvo = (2 * h + 2 * k * rereads) * (1 + rerun) + 4 * h + 4 * k * rereads
    scores = 0.0 if flash else h * seq_len * SCORE_BYTES * (NAIVE_SCORE_PASSES + 4 * rerun)
    return {
        # RMSNorm: read x, write y; backward: read x and dy, write dx
        "norms": (2 * n + 1) * replicated * e * cb * (5 + 2 * rerun),
        # residual adds (read 2, write 1, and the same for the gradient), SwiGLU (read gate and up,
        # write h; backward: read gate, up and dh, write both gradients), RoPE on q and k (read and
        # write, each way)
        "elementwise": n * (2 * replicated * e * (6 + 3 * rerun) + tokens_per_chip * m * (8 + 3 * rerun)
                            + tokens_per_chip * (h + k) * d * (4 + 2 * rerun)) * cb,
        "attention": n * tokens_per_chip * (d * cb * qkvo + scores),
        "logits": tokens_per_chip * cfg.vocab_size * LOGIT_BYTES * LOGIT_PASSES,
        # Adam: read weights, gradients and both moments; write weights and moments
        "optimizer": 2 * state_bytes["parameters"] + state_bytes["gradient_accumulation"] + 2 * state_bytes["optimizer"],
    }


@dataclasses.dataclass(frozen=True)
class PublishedRun:
    """A training run whose MFU its authors published, with what the roofline needs to price it."""

    model: str  # as the publication names it
    config: LlamaConfig
    topology: str  # a jaxpar topology file (meshes/)
    strategy: str  # as a jaxpar parallel spec
    batch_per_chip: int
    seq_len: int
    recompute: float  # hardware / model matmul FLOPs under the run's remat policy
    attention: str
    mfu: float  # as published: attention counted whole
    source: str
    calibrates: bool  # MATMUL_EFFICIENCY of its chip is fitted to it (else: held out, a check)


def _rerunning(cfg: LlamaConfig, *, out_proj: bool) -> float:
    """``recompute`` of a remat policy that runs the forward of the MLP's gate and up projections
    again (and, with ``out_proj``, attention's output projection)."""
    per_layer = 2 * cfg.embed * cfg.active_mlp() + (cfg.heads * cfg.head_dim * cfg.embed if out_proj else 0)
    return 1 + cfg.layers * per_layer / (3 * _matmul_weights(cfg))


_L2_70B, _L3_8B = CONFIGS["llama2-70b"], CONFIGS["llama3-8b"]
# Llama 3.1 70B: Llama 2 70B's shapes with Llama 3's vocabulary and RoPE base (Llama 3.1 8B is llama3-8b)
_L31_70B = dataclasses.replace(_L2_70B, vocab_size=128_256, rope_theta=500_000.0)
# MaxText's synthetic models (base.yml: SwiGLU, heads of 128, vocabulary 32000): 22B given as emb 6144,
# 24 heads, mlp 24576, 48 layers; 128B as global_parameter_scale=128 (4x emb, 8x heads and mlp, 4x layers)
_MAXTEXT_22B = LlamaConfig(vocab_size=32_000, embed=6144, layers=48, heads=24, kv_heads=24, head_dim=128, mlp=24_576)
_MAXTEXT_128B = LlamaConfig(vocab_size=32_000, embed=8192, layers=64, heads=128, kv_heads=128, head_dim=128, mlp=57_344)
_MAXTEXT_TIERING = "AI-Hypercomputer/maxtext docs/reference/models/tiering.md"

# MaxText's published runs: FSDP over all chips (ici_fsdp_parallelism=-1) but for one that adds
# tensor parallelism, flash attention, bf16 compute. Remat policies as recompute:
# save_dot_except_mlpwi and the "custom" ones that offload q, k, v (and the layer input, out_proj)
# to the host rerun the gate and up projections (custom without out_proj: the output projection
# too); qkv_proj_offloaded reruns all but q, k, v; full reruns the whole layer; minimal and
# minimal_with_context rerun no weight matmul.
PUBLISHED_RUNS = (
    PublishedRun("Llama2-70B", _L2_70B, "tpu-v5p-1024", "fsdp=-1", 4, 4096, _rerunning(_L2_70B, out_proj=False), "splash",
                 0.654, f"{_MAXTEXT_TIERING} (v5p Gold; benchmarks/maxtext_v5p_model_configs.py llama2_70b_v5p_128 at "
                 "92e59fdf: per_device_batch_size 4, save_dot_except_mlpwi)", calibrates=True),
    PublishedRun("MaxText 128B", _MAXTEXT_128B, "tpu-v5p-256", "fsdp=16,tensor=8", 1, 2048, RECOMPUTE["dots"], "splash", 0.6868,
                 "AI-Hypercomputer/maxtext src/maxtext/configs/tpu/v5p/README.md and 128b.sh (1x v5p-256: "
                 "ici_tensor_parallelism 8, per_device_batch_size 1, minimal remat)", calibrates=False),
    PublishedRun("Llama3.1-70B", _L31_70B, "tpu-v6e-256", "fsdp=-1", 5, 8192, _rerunning(_L31_70B, out_proj=True), "splash",
                 0.5033, f"{_MAXTEXT_TIERING} (Trillium Gold; benchmarks/maxtext_trillium_model_configs.py llama3_1_70b_8192 "
                 "at 92e59fdf: per_device_batch_size 5, custom remat offloading the layer input and q, k, v)", calibrates=False),
    PublishedRun("Llama3.1-8B", _L3_8B, "tpu-v6e-256", "fsdp=-1", 4, 8192, _rerunning(_L3_8B, out_proj=False), "splash",
                 0.4546, f"{_MAXTEXT_TIERING} (Trillium Gold; AI-Hypercomputer/tpu-recipes training/trillium/"
                 "Llama3.1-8B-MaxText/v6e-256: per_device_batch_size 4, custom remat offloading the layer input, q, k, v, out_proj)",
                 calibrates=False),
    PublishedRun("Llama2-70B", _L2_70B, "tpu-v6e-256", "fsdp=-1", 2, 4096, _rerunning(_L2_70B, out_proj=True), "splash",
                 0.438, f"{_MAXTEXT_TIERING} (Trillium Gold; AI-Hypercomputer/tpu-recipes training/trillium/Llama2-70B-MaxText: "
                 "qkv_proj_offloaded; its log's 8192 tokens per chip per step, though its config listing says 3 x 4096)",
                 calibrates=True),
    PublishedRun("MaxText 22B", _MAXTEXT_22B, "tpu-v4-128", "fsdp=-1", 13, 2048, RECOMPUTE["full"], "splash", 0.567,
                 "AI-Hypercomputer/maxtext src/maxtext/configs/tpu/v4/README.md and 22b.sh (per_device_batch_size 13, full remat)",
                 calibrates=True),
    PublishedRun("Llama2-70B", _L2_70B, "tpu-v5e-256", "fsdp=-1", 2, 2048, _rerunning(_L2_70B, out_proj=True), "splash",
                 0.57, "AI-Hypercomputer/maxtext getting_started/Run_Llama2.md (MFU table) and configs/v5e/llama2_70b.sh "
                 "(per_device_batch_size 2, qkv_proj_offloaded)", calibrates=True),
    PublishedRun("Llama2-7B", CONFIGS["llama2-7b"], "gpu-h100-8", "fsdp=-1", 4, 4096, RECOMPUTE["dots"], "cudnn", 492 / 989,
                 "AI-Hypercomputer/maxtext src/maxtext/configs/gpu/a3/llama_2_7b/README.md: 492 TFLOP/s per chip on 1x A3 "
                 "(models/gpu/llama2_7b.yml: per_device_batch_size 4, minimal_with_context)", calibrates=True),
)


def decode_latency(cfg: LlamaConfig, topology: Topology, tensor: int, context: int, delayed: bool,
                   all_reduce_latency_s: float, weight_bytes: int = 2) -> float:
    """Seconds per new token when decoding one sequence (batch 1) under tensor parallelism over
    ``tensor`` chips, with ``context`` tokens in the KV cache: a roofline of weight streaming.

    At batch 1 every sublayer is bound by reading its weights (and attention by reading the cache)
    from HBM; its FLOPs are negligible. Each sublayer's all-reduce of one (embed,) activation costs
    ``all_reduce_latency_s`` (the fixed cost of a small collective, which the link bandwidth adds
    little to) plus its bytes over ``collective_seconds``. Under TP the next sublayer waits for it;
    under delayed TP (``delayed``) it runs while the next sublayer streams its weights, so a
    sublayer costs the longer of the two. The output layer's vocabulary shards are gathered as one
    more all-reduce. Not modelled: kernel launch gaps, the embedding lookup, sampling."""
    e, k, d = cfg.embed, cfg.kv_heads, cfg.head_dim
    attention_weights = e * (cfg.heads * d) * 2 + e * (k * d) * 2
    attention_bytes = (attention_weights * weight_bytes + 2 * context * k * d * weight_bytes) / tensor
    mlp_bytes = 3 * e * cfg.mlp * weight_bytes / tensor
    sum_bytes = 2 * (tensor - 1) / tensor * e * weight_bytes
    all_reduce = all_reduce_latency_s + collective_seconds("all-reduce", sum_bytes, False, topology) if tensor > 1 else 0.0
    stream = lambda b: b / topology.hbm_bandwidth  # noqa: E731
    sublayers = [stream(attention_bytes), stream(mlp_bytes)] * cfg.layers
    if delayed:
        layers_s = sum(max(s, all_reduce) for s in sublayers)
    else:
        layers_s = sum(s + all_reduce for s in sublayers)
    head_s = stream(cfg.vocab_size * e * weight_bytes / tensor) + (all_reduce if tensor > 1 else 0.0)
    return layers_s + head_s
