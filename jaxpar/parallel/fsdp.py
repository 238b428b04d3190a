"""Sharded data parallelism over ``fsdp``: ZeRO stages 1, 2 and 3 (= FSDP).

The batch is split over ``fsdp`` as over ``data``; what else is split is the ZeRO stage
(``zero=1|2|3``, default 3):

| stage | optimizer state | gradient accumulation buffer | weights |
|-------|-----------------|------------------------------|---------|
| 1     | sharded         | full                         | full    |
| 2     | sharded         | sharded                      | full    |
| 3     | sharded         | sharded                      | sharded |

Sharding means the ``embed`` dim of every weight (all of a Llama's weights have one) over ``fsdp``.
ZeRO-3 gathers each weight just before use and reduce-scatters its gradient (the backward of the
gather); ZeRO-1/2 reduce-scatter the gradients and all-gather the updated weights after the
optimizer step. Either way 2*Psi_b*(N-1)/N bytes per device per step, or 3*Psi_b*(N-1)/N under
ZeRO-3 when the weights are gathered again for the backward pass (``regather=on``, also what a
pipeline's recompute does). Under ZeRO-3 a lookup table (the token embedding) is the exception: it
is never gathered; each device looks up its group's tokens in its own columns and an all-to-all
of the rows (and of their gradients) replaces the table's gather and reduce-scatter
(``jaxpar.nn.embed_lookup``): 2 x tokens x width x (N-1)/N per device, far less than the table.

``regather=auto`` (the default) chooses per layer stack from the analytic memory, before compiling
(``choose_regather``): keeping every layer's gathered weights for the backward pass saves one pass
of weight traffic but holds the whole stack's weights on every chip at once.
"""

from jaxpar.errors import SpecError, size_text
from jaxpar.parallel.base import SWITCH_WORDS, count_option, option_of

AXES = ("fsdp",)
ID_BYTES = 4  # token ids are int32
CROSSES_DCN = False
SHARDED_LOGICAL_AXIS = "embed"
STAGES = (1, 2, 3)
# which stored mappings shard ``embed`` over fsdp, from the stage on
SHARDED_FROM = {"optimizer": 1, "grad": 2, "param": 3}


OPTIONS = {
    "zero": (count_option(lambda n: n in STAGES, "not a ZeRO stage; use zero=1 (optimizer state), 2 (+gradients) or "
                                                 "3 (+weights, FSDP)"), 3),
    # on / off, or auto (None): the plan chooses by memory (``choose_regather``)
    "regather": (option_of({**SWITCH_WORDS, "auto": None}, "use auto (chosen by memory), on or off"), None),
}

# regather=auto keeps a stack's gathered weights only where they are cheap in memory: at most this
# share of a chip's memory (beyond it the same bytes buy a longer sequence or a larger batch, while
# the extra gather overlaps the backward pass's compute), and with the stored state they must leave
# this share free for activations and temporaries
KEEP_AT_MOST = 0.10
HEADROOM = 0.25


def choose_regather(kept_bytes: float, state_bytes: float, memory_bytes: float | None) -> tuple[bool, str]:
    """(regather, why) for ``regather=auto``: ``kept_bytes`` per chip that keeping a layer stack's
    gathered weights for the backward pass holds, ``state_bytes`` the stored weights and optimizer
    state per chip, ``memory_bytes`` a chip's memory (None: unknown)."""
    kept = f"keeping every layer's gathered weights holds {size_text(kept_bytes)} per chip"
    if memory_bytes is None:
        return False, f"{kept}; the devices report no memory limit, so they are kept (regather=on to save it)"
    if state_bytes + kept_bytes > (1 - HEADROOM) * memory_bytes:
        return True, (f"{kept}, which with the stored state ({size_text(state_bytes)}) leaves less than {HEADROOM:.0%} of "
                      f"{size_text(memory_bytes)} for activations: gathered again for the backward pass")
    if kept_bytes > KEEP_AT_MOST * memory_bytes:
        return True, (f"{kept}, over {KEEP_AT_MOST:.0%} of {size_text(memory_bytes)}: gathered again for the backward pass "
                      f"(one more weight pass of traffic, overlapped with its compute; regather=off keeps them)")
    return False, f"{kept}, at most {KEEP_AT_MOST:.0%} of {size_text(memory_bytes)}: kept (one weight pass less traffic)"


def manual_only(layout, calls) -> str | None:
    return "regather=on" if layout.regather is True else None  # only the manual step gathers again


def check(strategy):
    f = strategy.degrees["fsdp"]
    for key in ("zero", "regather"):
        if key in strategy.given and f == 1:
            raise SpecError(f"{key}={strategy.given[key]} acts on the fsdp axis, but strategy {strategy} has fsdp=1; add e.g. fsdp=-1")


def rules(strategy, compute: dict, stored: dict):
    compute["batch"] = compute["batch"] + AXES
    if strategy.degrees["fsdp"] > 1:
        for mapping, first in SHARDED_FROM.items():
            if strategy.options["zero"] >= first:
                rules_ = stored[mapping]  # fsdp major: see hierarchical_zero.rules
                rules_[SHARDED_LOGICAL_AXIS] = AXES + rules_[SHARDED_LOGICAL_AXIS]


def traffic(strategy, ctx) -> dict:
    """Bytes per device per step over ``fsdp`` (n devices) for the weights a device holds after
    tensor parallelism and the pipeline divide them (``ctx.weights``: each stored split over fsdp,
    and over expert too outside the experts, m ways in all; the formulas below with n = m).

    ZeRO-3 gathers in the compute dtype and reduce-scatters in the reduction dtype each micro-batch,
    gathering the layer weights a second time for the backward pass under ``ctx.regather``;
    ZeRO-1/2 reduce-scatter gradients (ZeRO-2 every micro-batch, ZeRO-1 once) and all-gather the
    updated weights in their stored dtype."""
    k = ctx.microbatches
    if ctx.mesh["fsdp"] == 1:
        return {}
    if strategy.options["zero"] != 3:
        reduce_scatters = k if strategy.options["zero"] == 2 else 1
        moved = sum(w.psi * (1 - 1 / w.ways["optimizer"]) for w in ctx.weights)
        return {("reduce-scatter", "fsdp"): reduce_scatters * moved * ctx.reduce_bytes, ("all-gather", "fsdp"): moved * ctx.stored_bytes}
    # lookup tables are read at their shards (``nn.embed_lookup``): instead of a gather and a
    # reduce-scatter of the table, a gather of the group's token ids and an all-to-all of the
    # looked-up rows each way
    tokens = ctx.batch // (ctx.batch_shards * k) * ctx.held_length
    out = dict.fromkeys((("all-gather", "fsdp"), ("reduce-scatter", "fsdp"), ("all-to-all", "fsdp")), 0.0)
    for w in ctx.weights:
        n = w.ways["param"]
        share = (n - 1) / n
        if w.table_width:
            out[("all-gather", "fsdp")] += k * tokens * n * ID_BYTES * share
            out[("all-to-all", "fsdp")] += 2 * k * tokens * w.table_width * share * ctx.compute_bytes
        else:
            gathers = 1 + (ctx.regather and w.layer)
            out[("all-gather", "fsdp")] += k * gathers * w.psi * share * ctx.compute_bytes
            out[("reduce-scatter", "fsdp")] += k * w.psi * share * ctx.reduce_bytes
    return out
