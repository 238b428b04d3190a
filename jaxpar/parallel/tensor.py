"""Megatron tensor parallelism (TP) over the ``tensor`` axis, with sequence parallelism as its
option ``sp=on`` (``sequence.py``).

Attention is split by heads (QKV column-parallel, output row-parallel), the MLP by its hidden
width (up/gate column-parallel, down row-parallel), the embedding and the output projection by
vocabulary (vocab-parallel lookup and cross-entropy). Each row-parallel output is all-reduced in
the forward pass and each block input in the backward pass: per layer 4 all-reduces of the
(batch, length, embed) activation, 2*A_b*(T-1)/T bytes each per device. With more tensor shards
than key/value heads (GQA), the key/value weights are kept whole on every device, each device
uses the heads its query heads read, and their gradients are all-reduced over ``tensor``.
"""

from jaxpar.parallel import data

AXES = ("tensor",)
CROSSES_DCN = False
LOGICAL_AXES = ("heads", "kv_heads", "mlp", "vocab")
# dims kept whole where they are shorter than the tensor degree (GQA's key/value heads; see rules.Layout)
REPLICABLE = frozenset({"kv_heads"})
OPTIONS: dict = {}
# the layout's role (``Layout.role``) under delayed TP (``delayed.py``): the mesh axes whose
# row-parallel partial sums a sublayer adds one sublayer late (``jaxpar.nn.residual_add``)
DELAYED = "delayed_sums"


def check(strategy):
    """Nothing to refuse here: the model's dims are checked against the degree by the layout."""


def rules(strategy, compute: dict, stored: dict):
    for name in LOGICAL_AXES:  # weights are stored as computed: the stored mappings inherit it
        compute[name] = compute[name] + AXES


def activation_passes(layers: int) -> int:
    """All-reduces of one (batch, length, embed) activation per step: per layer 2 forward (after
    attention and MLP) and 2 backward (before them), plus the embedding's forward and the output
    projection's backward. Sequence parallelism turns each into an all-gather and a reduce-scatter."""
    return 4 * layers + 2


def traffic(strategy, ctx) -> dict:
    t, model = ctx.mesh["tensor"], ctx.model
    if t == 1:
        return {}
    out: dict = {}
    add = lambda kind, b: out.__setitem__((kind, "tensor"), out.get((kind, "tensor"), 0.0) + b)  # noqa: E731
    # key/value weights kept whole: their gradients (gathered ones, per micro-batch) summed over tensor
    add("all-reduce", ctx.microbatches * data.grad_allreduce_bytes(ctx.replicated_psi * ctx.reduce_bytes, t))
    if model is None:
        return {k: v for k, v in out.items() if v}
    local_tokens = ctx.batch // ctx.batch_shards * ctx.held_length
    activation = activation_bytes(ctx)
    passes = activation_passes(model.layers)
    if strategy.options["sp"]:
        one_way = passes * activation * (t - 1) / t
        add("all-gather", one_way)
        add("reduce-scatter", one_way)
        norms = (2 * model.layers + 1) * model.embed * ctx.reduce_bytes  # norm-weight gradients summed over tensor
        add("all-reduce", data.grad_allreduce_bytes(norms, t))
    else:
        add("all-reduce", passes * data.grad_allreduce_bytes(activation, t))
    # vocab-parallel cross-entropy: max, sum of exponentials and target logit per token
    add("all-reduce", 3 * data.grad_allreduce_bytes(local_tokens * 4, t))
    return {k: v for k, v in out.items() if v}


def activation_bytes(ctx) -> float:
    """One device's (batch, length, embed) activation in the compute dtype."""
    return ctx.batch // ctx.batch_shards * ctx.held_length * ctx.model.embed * ctx.compute_bytes


def report(layout, measured, cfg) -> dict | None:
    """Per layer of the forward pass, the all-reduces over the tensor axes and how many of them are
    blocking (no matmul can run while one is in flight: ``measured.blocking``); Megatron TP has 2,
    delayed TP (``delay=1``) 0. None where the program has no loop over all the layers (a
    pipeline's stages each run a part): no count rather than a wrong 0."""
    if not layout.axes_of("heads"):
        return None
    forward = [loop for loop in measured.blocking if "transpose" not in loop["op_name"] and loop["trips"] == cfg.layers]
    if not forward:
        return None
    return {"delayed": bool(layout.role(DELAYED)), "axes": list(layout.axes_of("heads")),
            "all_reduces_per_layer": max((loop["collectives"] for loop in forward), default=0),
            "blocking_per_layer": max((loop["blocking"] for loop in forward), default=0)}


def summary(tp: dict) -> list[str]:
    how = "delayed (delay=1): each sublayer's sum read one sublayer later" if tp["delayed"] else "Megatron"
    return ["", f"tensor parallelism over {'/'.join(tp['axes'])}, {how}",
            f"  per layer, forward: {tp['all_reduces_per_layer']} all-reduces, {tp['blocking_per_layer']} of them blocking "
            f"(no matmul runs while it is in flight)"]
