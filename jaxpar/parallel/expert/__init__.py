"""Expert parallelism (EP) over ``expert``: the experts of a mixture-of-experts layer (logical axis
``experts``) are split over ``expert``, and so is the batch (outside the experts the axis is a
data axis). Tokens travel to the devices that hold their experts and back (``exchange.py``);
``expert_exchange=`` chooses how: ``ragged`` (``jax.lax.ragged_all_to_all``: only the routed copies
on the wire), ``padded`` (its dense twin, for backends whose runtime lacks the ragged one: XLA:CPU),
or ``auto`` (the default: by the devices' backend).

It composes with data and FSDP, with tensor parallelism (expert-tensor: each expert's hidden width
over ``tensor``), with context parallelism (each device routes the positions it holds) and with
pipelines. Under ZeRO (``fsdp`` > 1) the weights outside the experts are stored split over
``fsdp`` x ``expert`` (the axis is a data axis for them, as MaxText stores them), and the experts'
weights over ``fsdp`` alone on their ``embed`` dim: each is gathered per layer from its own split.

Gradients: an expert's weights live on one device of each ``expert`` group and the exchange's
backward already brings it every token's cotangent, so they are never reduced over ``expert``;
every other weight is: reduce-scattered over ``fsdp`` x ``expert`` where it is stored so, else
all-reduced with the batch axes (one all-reduce over ``data`` x ``expert``).

Traffic per MoE layer and device, with T tokens on a device, k experts per token, P devices and the
slots of S rows (``exchange.slot_rows``) of embed width h in the compute dtype: the padded twin sends
(P-1) x S x h forward and as much back, and the same again in the backward pass (four all-to-alls),
plus the counts once (P-1 x E/P int32). The ragged exchange puts only the copies that leave the
device on the wire, (P-1)/P x T x k of them for even routing, each way (``wire_bytes``); its compiled
program is bounded by the buffers it sends from, T x k rows out and P x S back (``layer_bytes``).
The balance loss adds one all-reduce of 2E 32-bit sums per layer over the devices the tokens are
split over, and E more for a recomputed forward (the routing bias alone: E, the copies per expert).
"""

import math

from jaxpar.errors import LayoutError, SpecError
from jaxpar.parallel import data, fsdp
from jaxpar.parallel.base import option_of
from jaxpar.parallel.expert import exchange
from jaxpar.parallel.expert.exchange import EXCHANGE, PADDED, RAGGED

AXES = ("expert",)
NEEDS_MODEL = "it splits the experts of a mixture-of-experts model (e.g. --model moe-tiny)"
CROSSES_DCN = False
EXCHANGES = ("auto", "ragged", "padded")

OPTIONS = {"expert_exchange": (option_of({e: e for e in EXCHANGES}, "choose auto (by the backend), ragged "
                                         "(ragged_all_to_all) or padded (its dense twin, for XLA:CPU)"), "auto")}


def check(strategy):
    if "expert_exchange" in strategy.given and strategy.degrees.get("expert", 1) == 1:
        raise SpecError(f"expert_exchange= says how tokens cross the expert axis; {strategy} has no expert axis: "
                        f"drop expert_exchange or add expert=N")


def check_model(strategy, cfg, seq_len: int) -> None:
    """Refuse experts that do not split evenly over the expert degree."""
    degree = strategy.degrees.get("expert", 1)
    count = getattr(cfg, "experts", None)
    if degree > 1 and count is not None and count % degree:
        fits = [d for d in range(1, count + 1) if count % d == 0]
        raise LayoutError(f"expert={degree} does not divide the model's {count} experts: each device holds the same "
                          f"number of whole experts; use expert= one of {', '.join(map(str, fits))}")


def rules(strategy, compute: dict, stored: dict):
    if strategy.degrees.get("expert", 1) > 1:  # (a plain Flax model's own batch shardings name no expert axis it does not use)
        compute["batch"] = compute["batch"] + AXES
        # where ZeRO splits the state over fsdp, the weights outside the experts are split over
        # expert too (a data axis for them), next to fsdp so that a hierarchical ZeRO group's
        # optimizer shard stays a piece of the weight's shard; the experts' own weights are
        # computed split over expert already, so their storage leaves it out (``Layout.dim_axes``)
        for rules_ in stored.values():
            axes = rules_[fsdp.SHARDED_LOGICAL_AXIS]
            if fsdp.AXES[0] in axes:
                after = axes.index(fsdp.AXES[0]) + 1
                rules_[fsdp.SHARDED_LOGICAL_AXIS] = axes[:after] + AXES + axes[after:]
    compute["experts"] = compute["experts"] + AXES  # the stored mappings inherit it


def roles(strategy) -> dict[str, tuple[str, ...]]:
    choice = strategy.options["expert_exchange"]
    return {EXCHANGE: AXES, RAGGED: AXES if choice == "ragged" else (), PADDED: AXES if choice == "padded" else ()}


def traffic(strategy, ctx) -> dict:
    """The exchange's all-to-all bytes per device per step (see the module doc), from the model's
    shapes, and what joining ``expert`` adds to data's gradient all-reduce: every weight but the
    experts is summed over data x expert."""
    layout, model = ctx.layout, ctx.model
    devices = math.prod(ctx.mesh[a] for a in layout.role(EXCHANGE))
    if devices == 1:
        return {}
    shard = ctx.all_reduced("expert") * ctx.reduce_bytes
    n = ctx.mesh["data"]
    out = {("all-reduce", "expert"): data.grad_allreduce_bytes(shard, n * devices) - data.grad_allreduce_bytes(shard, n)}
    if model is None or not getattr(model, "experts", None):
        return out
    rows = ctx.batch // ctx.batch_shards // ctx.microbatches
    forward, backward = layer_bytes(layout, model, rows, ctx.held_length, ctx.compute_bytes, exchange.runs_ragged(layout), ctx.length)
    forwards = 1 + (ctx.remat != "none")  # recomputation runs the forward's exchanges again
    for kind in forward:
        out[(kind, "expert")] = ctx.microbatches * model.layers * (forwards * forward[kind] + backward.get(kind, 0.0))
    # each layer's balance sums over all tokens (32-bit): the copies per expert for the balance
    # loss or the routing bias, the probabilities too for the balance loss; a recomputed forward
    # sums only the probabilities again (the backward pass keeps the integer copies)
    copies, probs = bool(model.balance_weight or model.bias_rate), bool(model.balance_weight)
    sums = copies + forwards * probs
    if sums:
        tokens = math.prod(ctx.mesh.values()) // ctx.mesh.get("stage", 1)
        out[("all-reduce", "expert")] += ctx.microbatches * model.layers * data.grad_allreduce_bytes(sums * model.experts * 4, tokens)
    return out


def layer_bytes(layout, model, rows: int, length: int, compute_bytes: int, ragged: bool, row_length: int | None = None):
    """({collective kind: bytes}, {...}) one device sends per MoE layer in the forward pass (the
    exchange and its reverse, and the counts) and in the backward pass (their transposes), for
    ``rows`` x ``length`` tokens on the device, of rows of ``row_length`` (default ``length``: the
    capacity is per whole row). A ragged exchange is counted as its compiled program bounds it:
    the whole buffer it sends from, the copies (T x k rows) out and the slots (P x S) back; what
    it puts on the wire depends on the routing (``wire_bytes``)."""
    devices = math.prod(layout.mesh.shape[a] for a in layout.role(EXCHANGE))
    local = model.experts // devices
    tokens = rows * length
    slot = exchange.slot_rows(tokens, model.top_k, local, rows, model.routing.capacity(row_length or length))
    row = model.embed * compute_bytes
    counts = (devices - 1) * local * 4  # int32 per source and expert
    if not ragged:
        moved = 2 * (devices - 1) * slot * row
        return {"all-to-all": moved + counts}, {"all-to-all": moved}
    moved = (tokens * model.top_k + devices * slot) * row * (devices - 1) / devices
    return {"ragged-all-to-all": moved, "all-to-all": counts + (devices - 1) * 4}, {"ragged-all-to-all": moved}


def wire_bytes(layout, model, rows: int, length: int, compute_bytes: int) -> float:
    """Bytes a ragged exchange puts on the wire per MoE layer and device, forward and backward, at
    even routing: (P-1)/P of the device's T x k copies each way."""
    devices = math.prod(layout.mesh.shape[a] for a in layout.role(EXCHANGE))
    return 4 * (devices - 1) / devices * rows * length * model.top_k * model.embed * compute_bytes


def report(layout, measured, cfg) -> dict | None:
    """The exchange's bytes per MoE layer and device (its all-to-alls, ragged or not), measured
    on the compiled step against the formula (``traffic``: over the step's micro-batches and
    recomputation)."""
    axes = layout.role(EXCHANGE)
    if not axes or not getattr(cfg, "experts", None):
        return None
    devices = math.prod(layout.mesh.shape[a] for a in axes)
    kinds = ("all-to-all", "ragged-all-to-all")
    moved = sum(c.bytes_per_step for c in measured.collectives if c.kind in kinds and c.mesh_axes == axes)
    return {"exchange": "ragged" if exchange.runs_ragged(layout) else "padded", "devices": devices,
            "experts_per_device": cfg.experts // devices, "measured_bytes_per_layer": moved / cfg.layers,
            "formula_bytes_per_layer": sum(measured.optimum.get((kind, "expert"), 0.0) for kind in kinds) / cfg.layers}


def summary(section: dict) -> list[str]:
    return ["", f"expert parallelism: {section['experts_per_device']} experts on each of {section['devices']} devices, "
                f"the {section['exchange']} exchange; per MoE layer and device",
            f"  all-to-all             {section['measured_bytes_per_layer']:14,.0f} bytes   formula {section['formula_bytes_per_layer']:14,.0f}"]
