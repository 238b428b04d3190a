"""A mixture-of-experts language model: the Llama of ``llama.py`` with a routed mixture of experts
as every layer's MLP (Mixtral, DeepSeek-V3's shape).

Each layer's router sends every token to ``top_k`` of ``experts`` SwiGLU experts of hidden width
``mlp`` (``jaxpar.experts``: softmax or sigmoid scores, optionally group-limited, dropless or with
a capacity factor), plus ``shared_experts`` SwiGLUs of the same width that every token goes
through (one SwiGLU of ``shared_experts x mlp``). The loss is the next-token cross-entropy plus
``balance_weight`` x the mean over the layers of each layer's load-balancing loss. With a
``bias_rate`` each layer's router also adds a bias per expert to the scores it chooses by
(DeepSeek-V3's auxiliary-loss-free balancing): a weight no optimizer trains, moved after every step
by ``bias_rate`` toward the experts that got fewer copies than an even share of that step's batch
(``experts.bias_steering``, ``nn.RuleUpdated``).

Weights and their logical names: the router (layers, embed, experts: replicated, every device
routes its own tokens to every expert), the routing bias (layers, experts: replicated too), the
experts' gate and up (layers, experts, embed, mlp) and down (layers, experts, mlp, embed), the
shared experts' as the Llama's MLP. Under expert
parallelism ``experts`` is split over the ``expert`` axis (``jaxpar/parallel/expert/``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar import experts
from jaxpar.attention import CAUSAL
from jaxpar.errors import JaxparError
from jaxpar.experts import Routing
from jaxpar.models import llama
from jaxpar.models.family import Family
from jaxpar.models.llama import BLOCK, RESIDUAL, LlamaConfig, _param, fan_in
from jaxpar.nn import RuleUpdated, constrain, cross_entropy, enter_block, mixture_of_experts, residual_add

EXPERTS = ("layers", "experts", "embed", "mlp")  # the experts' gate and up; down: (layers, experts, mlp, embed)
ROUTER = ("layers", "embed", None)  # every device reads the whole router: it routes its tokens to every expert
BIAS = ("layers", None)  # and the whole routing bias


@dataclasses.dataclass(frozen=True)
class MoEConfig(LlamaConfig):
    """A Llama's shapes with a mixture of experts as the MLP: ``mlp`` is each expert's hidden width."""

    experts: int = dataclasses.field(kw_only=True)
    top_k: int = dataclasses.field(kw_only=True)
    shared_experts: int = dataclasses.field(default=0, kw_only=True)
    score: str = dataclasses.field(default="softmax", kw_only=True)  # the router's: softmax or sigmoid
    groups: int = dataclasses.field(default=1, kw_only=True)  # group-limited routing (1: off)
    top_groups: int = dataclasses.field(default=1, kw_only=True)
    capacity_factor: float | None = dataclasses.field(default=None, kw_only=True)  # None: dropless
    balance_weight: float = dataclasses.field(default=0.01, kw_only=True)  # of the load-balancing loss
    bias_rate: float = dataclasses.field(default=0.0, kw_only=True)  # the routing bias's step (0: no bias)

    def __post_init__(self):
        self.routing  # refuses a routing that cannot work, when the config is made
        if not self.bias_rate >= 0:
            raise JaxparError(f"bias_rate={self.bias_rate} must be 0 or more (0: no routing bias; DeepSeek-V3 uses 0.001)")

    def layer_extras(self) -> str | None:
        """What the layers hand the loss beside the residual stream, in words (None: nothing)."""
        extras = [f"load-balancing losses (balance_weight={self.balance_weight})"] if self.balance_weight else []
        extras += [f"routing-bias steps (bias_rate={self.bias_rate})"] if self.bias_rate else []
        return " and ".join(extras) or None

    @property
    def routing(self) -> Routing:
        return Routing(self.experts, self.top_k, self.score, self.groups, self.top_groups, self.capacity_factor)

    def without_mlp(self) -> LlamaConfig:
        """A Llama of these shapes with no MLP: attention, norms and embeddings."""
        return LlamaConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(LlamaConfig)} | {"mlp": 0})

    def num_params(self) -> int:
        e, m = self.embed, self.mlp
        per_layer = e * self.experts + 3 * e * m * (self.experts + self.shared_experts) + (self.experts if self.bias_rate else 0)
        return self.without_mlp().num_params() + self.layers * per_layer

    def active_params(self) -> int:
        """Weights one token's forward pass reads: its top_k experts and the shared ones, not the rest."""
        idle = self.layers * 3 * self.embed * self.mlp * (self.experts - self.top_k)
        return self.num_params() - idle

    def active_mlp(self) -> int:
        return self.mlp * (self.top_k + self.shared_experts)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: the active weights' matmuls (6 each) and attention's scores."""
        active_mlp = self.layers * (self.embed * self.experts + 3 * self.embed * self.mlp * (self.top_k + self.shared_experts))
        return self.without_mlp().flops_per_token(seq_len) + 6 * active_mlp


CONFIGS = {
    "moe-tiny": MoEConfig(vocab_size=256, embed=64, layers=2, heads=4, kv_heads=2, head_dim=16, mlp=64, experts=8, top_k=2),
    "mixtral-8x7b": MoEConfig(vocab_size=32_000, embed=4096, layers=32, heads=32, kv_heads=8, head_dim=128, mlp=14_336,
                              rope_theta=1_000_000.0, experts=8, top_k=2, balance_weight=0.02),
    # DeepSeek-V3's widths, experts and routing (256 routed + 1 shared, 8 per token from 4 of 8
    # groups, sigmoid scores), on grouped-query attention instead of its latent attention, every
    # layer a mixture (it keeps the first three dense)
    "deepseek-v3-like": MoEConfig(vocab_size=129_280, embed=7168, layers=61, heads=128, kv_heads=16, head_dim=128, mlp=2048,
                                  experts=256, top_k=8, shared_experts=1, score="sigmoid", groups=8, top_groups=4,
                                  balance_weight=0.0001, bias_rate=0.001),
}


class MoELayerStack(llama.LayerStack):
    def mlp_weights(self, cfg: MoEConfig, rngs: nnx.Rngs):
        n, x, e, m = cfg.layers, cfg.experts, cfg.embed, cfg.mlp
        self.router = _param(rngs, (n, e, x), ROUTER, fan_in(e))
        self.w_gate = _param(rngs, (n, x, e, m), EXPERTS, fan_in(e))
        self.w_up = _param(rngs, (n, x, e, m), EXPERTS, fan_in(e))
        self.w_down = _param(rngs, (n, x, m, e), ("layers", "experts", "mlp", "embed"), fan_in(m * 2 * n))
        if cfg.shared_experts:
            s = m * cfg.shared_experts
            self.shared_gate = _param(rngs, (n, e, s), ("layers", "embed", "mlp"), fan_in(e))
            self.shared_up = _param(rngs, (n, e, s), ("layers", "embed", "mlp"), fan_in(e))
            self.shared_down = _param(rngs, (n, s, e), ("layers", "mlp", "embed"), fan_in(s * 2 * n))
        if cfg.bias_rate:
            self.router_bias = RuleUpdated(jnp.zeros((n, x), jnp.float32), out_sharding=BIAS, eager_sharding=False)


class MoE(llama.Llama):
    stack = MoELayerStack

    def mlp(self, x, pending, w, cfg):
        return mixture_sublayer(x, pending, w, cfg)

    def routing_counts(self, tokens):
        """(copies, kept), each (layers, experts): the token copies each layer routes to each expert
        for ``tokens`` (rows, length), and those within its capacity (all, dropless)."""
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = llama.embed_lookup(self.embedding, tokens, RESIDUAL)
        return llama._layers(x, nnx.state(self.layers), self.cfg, positions, CAUSAL, _counting_sublayer)[1]


def _counting_sublayer(x, pending, w, cfg: MoEConfig):
    """``mixture_sublayer``'s stream, and its routing's (copies, kept) per expert."""
    carry, _ = mixture_sublayer(x, pending, w, cfg)
    h = llama._rms_norm(x, w["mlp_norm"], cfg.norm_eps)
    routing = cfg.routing
    _, chosen, _ = experts.route(jnp.einsum("rle,ex->rlx", h, w["router"]), routing, w.get("router_bias"))
    kept = experts.keep_within_capacity(chosen, experts.ranks_in_row(chosen, routing.experts), routing, h.shape[1])
    count = lambda e: jnp.sum(jax.nn.one_hot(e, routing.experts, dtype=jnp.int32), axis=(0, 1, 2))  # noqa: E731
    return carry, (count(chosen), count(kept))


def mixture_sublayer(x, pending, w, cfg: MoEConfig):
    """((the stream after the mixture-of-experts sublayer, the partial sum it leaves pending),
    (its load-balancing loss, its routing bias's steering term), each None where the model has
    neither): the routed experts' output and the shared experts', partial sums over ``mlp``'s axes,
    finished by the residual add."""
    h = enter_block(llama._rms_norm(x, w["mlp_norm"], cfg.norm_eps), RESIDUAL, BLOCK)
    bias = w.get("router_bias")
    out, sums = mixture_of_experts(h, BLOCK, w["router"], w["w_gate"], w["w_up"], w["w_down"], cfg.routing, bias)
    if cfg.shared_experts:
        act = constrain(jax.nn.silu(jnp.einsum("ble,em->blm", h, w["shared_gate"])) * jnp.einsum("ble,em->blm", h, w["shared_up"]),
                        ("batch", "length", "mlp"))
        out = out + jnp.einsum("blm,me->ble", act, w["shared_down"])
    # the balance losses leave the layer scan only where the loss reads them (a pipeline passes
    # nothing but the residual stream between stages)
    balance = experts.balance_loss(sums, cfg.top_k) if cfg.balance_weight else None
    steering = experts.bias_steering(bias, sums.copies, cfg.bias_rate) if bias is not None else None
    return residual_add(x, out, ("mlp",), RESIDUAL, pending), (balance, steering)


def loss_fn(model: MoE, batch):
    """Next-token cross-entropy (batches as ``llama.loss_fn`` takes them) plus ``balance_weight`` x
    the layers' mean load-balancing loss, plus the routing biases' steering terms (0, their
    gradient the biases' steps)."""
    if not isinstance(batch, dict):
        batch = {"inputs": batch[:, :-1], "targets": batch[:, 1:]}
    logits, (balance, steering) = model.call_and_extras(batch["inputs"], batch.get("positions"), batch.get("segments"))
    loss = cross_entropy(logits, batch["targets"], llama.LOGITS, batch.get("weights"))
    if balance is not None:
        loss = loss + model.cfg.balance_weight * jnp.mean(balance)
    return loss if steering is None else loss + jnp.sum(steering)


def configure(cfg: MoEConfig, seq_len: int, capacity_factor: float | None = None, balance_weight: float | None = None,
              bias_rate: float | None = None) -> MoEConfig:
    """``cfg`` with a run's ``--capacity-factor`` (0: dropless), ``--balance-weight`` and ``--bias-rate``."""
    if capacity_factor is not None:
        cfg = dataclasses.replace(cfg, capacity_factor=capacity_factor or None)
    if balance_weight is not None:
        if balance_weight < 0:
            raise JaxparError(f"--balance-weight {balance_weight} must be 0 or more (0 leaves the load-balancing loss out)")
        cfg = dataclasses.replace(cfg, balance_weight=balance_weight)
    if bias_rate is not None:
        if not bias_rate >= 0:
            raise JaxparError(f"--bias-rate {bias_rate} must be 0 or more (0: no routing bias); e.g. --bias-rate 0.001")
        cfg = dataclasses.replace(cfg, bias_rate=bias_rate)
    return cfg


def changed(cfg: MoEConfig, saved: dict, given: dict) -> str | None:
    """Why a checkpoint's routing (``saved``: its meta) makes another function than ``cfg``'s."""
    if bool(saved.get("bias_rate", 0)) != bool(cfg.bias_rate):
        had = "with a routing bias (bias_rate {})".format(saved["bias_rate"]) if saved.get("bias_rate") else "without a routing bias"
        return (f"was trained {had}, and this run {'has one' if cfg.bias_rate else 'has none'}: the bias is one of its "
                f"weights; pass the run's own --bias-rate {saved.get('bias_rate', 0)} to resume it")
    routing, now = saved.get("routing"), dataclasses.asdict(cfg.routing)
    if routing is None or routing == now:
        return None
    differ = ", ".join(f"{key} {routing.get(key)} (now {now[key]})" for key in now if routing.get(key) != now[key])
    return (f"was trained routing with {differ}: another routing makes another function of the same weights; "
            f"pass the run's own --capacity-factor to resume it")


def routing_report(model: MoE, batch, devices: int) -> dict:
    """The routing of ``batch`` (as the loss takes it) by the trained ``model``: copies per expert and
    per device of the ``devices`` the experts are split over (max / mean, layer by layer), and the
    copies dropped beyond capacity."""
    tokens = batch[:, :-1] if not isinstance(batch, dict) else batch["inputs"]
    copies, kept = (np.asarray(c) for c in jax.jit(MoE.routing_counts)(model, tokens))
    per_device = copies.reshape(copies.shape[0], devices, -1).sum(-1)
    imbalance = lambda loads: (loads.max(-1) / loads.mean(-1)).tolist()  # noqa: E731
    return {"copies_per_expert": copies.tolist(), "expert_max_over_mean": imbalance(copies), "devices": devices,
            "device_max_over_mean": imbalance(per_device), "dropped_fraction": float(1 - kept.sum() / copies.sum())}


def _summary(section: dict) -> list[str]:
    worst = lambda ratios: f"{max(ratios):.2f}"  # noqa: E731
    return ["", f"expert load on the held-out batch (max / mean copies, worst layer): per expert {worst(section['expert_max_over_mean'])}, "
                f"per device of {section['devices']} {worst(section['device_max_over_mean'])}; dropped beyond capacity "
                f"{100 * section['dropped_fraction']:.2f}% of the copies"]


def _meta(cfg: MoEConfig) -> dict:
    return {"routing": dataclasses.asdict(cfg.routing), "balance_weight": cfg.balance_weight, "bias_rate": cfg.bias_rate}


def _saved(cfg: MoEConfig, meta: dict) -> MoEConfig:
    """``cfg`` with the routing bias its checkpoint's run had, or none (a run before bias_rate was
    recorded had none); the sampler routes dropless whatever the run's capacity factor."""
    return dataclasses.replace(cfg, bias_rate=meta.get("bias_rate", 0.0))


FAMILY = Family(name="moe", words="mixture-of-experts model", config_type=MoEConfig, configs=CONFIGS,
                model=lambda cfg, rngs: MoE(cfg, rngs=rngs), loss=loss_fn, axes=frozenset({"expert"}), meta=_meta,
                options=("capacity_factor", "balance_weight", "bias_rate"), configure=configure, changed=changed,
                batch_report=routing_report, summary=_summary, saved=_saved)
