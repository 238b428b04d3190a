"""AxoNN's 4D tensor parallelism (Singh et al., arXiv 2305.13525) over ``tp_x`` and ``tp_y``.

Each weight matrix W (in, out) is split over a 2-D grid of devices: its "in" dim over one group and
its "out" dim over the other, the roles alternating from one matmul to the next, so that a
matmul's output (split over the "out" group along its hidden dim) is already laid out as the next
matmul's input. In a transformer block, in logical names: ``embed`` -> ``tp_x``; ``heads``,
``kv_heads``, ``mlp`` and ``vocab`` -> ``tp_y``. QKV and up/gate take embed (X) to heads/mlp (Y);
the attention output and down projections take heads/mlp (Y) back to embed (X). AxoNN's third
group Z (depth: weights stored split ZeRO-3 style, gathered per layer, batch split) is jaxpar's
``fsdp`` axis, and G_data is ``data``: "data=2,tp_x=2,tp_y=2" and "tp_x=2,tp_y=2,fsdp=2" are AxoNN
layouts.

Per matmul, forward: the output's partial sums all-reduced over the "in" group (X for QKV and
up/gate, Y for the output and down projections); backward: the input's gradient all-reduced over
the "out" group (Y for QKV and up/gate, X for the output and down projections). Q, K and V read one
input, as do up and gate: their input gradients are summed locally and all-reduced once. The
residual stream is split over X along ``embed``, so RMSNorm sums its squares over X (one float per
token, forward, and one again backward).

A layout that splits ``embed`` in its compute mapping runs on the GSPMD path (``train/gspmd.py``):
jaxpar's manual step keeps ``embed`` whole inside a block (a model's RMSNorm takes a local mean
over it). XLA's partitioner places the collectives; the Llama's own constraints (``nn.constrain``
with the logical names above) hold the activations to AxoNN's layout. ``traffic`` is what it
emits, measured on the compiled step (``tests/test_axonn.py``).

One of ``tp_x``/``tp_y`` alone is allowed: ``tp_y=N`` is Megatron's 1-D split (heads, MLP width
and vocabulary over N; on the manual path where the model calls jaxpar, as ``tensor=N``), ``tp_x=N``
splits only the model width (GSPMD path). AxoNN replaces Megatron TP: ``tensor=`` and its options
(``sp``, ``delay``, ``tp_overlap``) are refused next to it, as is a pipeline when ``embed`` is split
(pipelines need the manual step).
"""

import dataclasses

from jaxpar.errors import SpecError
from jaxpar.parallel import data, tensor

AXES = ("tp_x", "tp_y")
CROSSES_DCN = False
OPTIONS: dict = {}
X_AXES = ("embed",)  # logical axes split over tp_x
Y_AXES = ("heads", "kv_heads", "mlp", "vocab")  # and over tp_y


def check(strategy):
    degrees = strategy.degrees
    x, y = degrees["tp_x"], degrees["tp_y"]
    if x == 1 and y == 1:
        return
    grid = f"tp_x={x},tp_y={y}"
    if degrees["tensor"] > 1:
        raise SpecError(f"strategy {strategy} combines AxoNN's grid ({grid}) with tensor={degrees['tensor']}: both split the "
                        f"heads and the MLP width; pick one tensor parallelism (drop tensor=, or drop tp_x= and tp_y=)")
    for key, what in (("sp", "sequence parallelism"), ("delay", "delayed tensor parallelism"),
                      ("tp_overlap", "collective matmul")):
        if key in strategy.given and strategy.options[key]:
            raise SpecError(f"{key}={strategy.given[key]} is {what}, an option of Megatron's tensor=, but strategy "
                            f"{strategy} splits its weights over AxoNN's grid ({grid}); drop {key}=")
    if degrees["stage"] > 1 and x > 1:
        raise SpecError(f"strategy {strategy} pipelines (stage={degrees['stage']}) and splits the model width over "
                        f"tp_x={x}: a split model width runs only on the GSPMD path, and a pipeline only on jaxpar's "
                        f"manual step; drop stage= (use fsdp= or data= for the rest of the devices), or use tp_x=1")


def rules(strategy, compute: dict, stored: dict):
    """Weights are stored as computed (the stored mappings inherit these); ``fsdp`` (Z) adds its
    own split of ``embed`` on top."""
    for name in X_AXES:
        compute[name] = compute[name] + ("tp_x",)
    for name in Y_AXES:
        compute[name] = compute[name] + ("tp_y",)


NORM_BYTES = 4  # RMSNorm sums its squares in float32
CROSS_ENTROPY_SUMS = 3  # vocab-parallel cross-entropy: max, sum of exponentials and target logit per token


def local_widths(model, x: int, y: int) -> dict:
    """The widths one device holds of each activation a layer's matmuls read or write."""
    # else key/value heads are kept whole over tp_y (rules.Layout.replicable; needs more than 8 devices, not measured)
    kv_split = model.kv_heads % y == 0
    return {"embed": model.embed // x, "q": model.heads * model.head_dim // y, "mlp": model.mlp // y,
            "kv": model.kv_heads * model.head_dim // (y if kv_split else 1), "kv_split": kv_split}


def layer_traffic(ctx) -> dict:
    """All-reduce bytes one device sends per layer, by mesh axis, as XLA's partitioner places them
    under ``embed`` -> tp_x (X), heads/mlp -> tp_y (Y), for T tokens a device holds:

    - forward over X: the QKV and up/gate outputs' partial sums (T x (q + 2 kv) and T x 2 mlp, each
      device's share of heads/mlp) and the two norms' sums of squares (2T floats);
    - forward over Y: the attention output and down projections' partial sums (2 x T x embed/X);
    - backward over X: the input gradients of the attention output and down projections
      (T x q and T x mlp) and the two norms' sums (2T floats);
    - backward over Y: the input gradients of Q, K, V, gate and up, each all-reduced on its own
      (5 x T x embed/X; K and V only where split over Y). AxoNN sums the three of attention and the
      two of the MLP before one all-reduce each (2 x T x embed/X); XLA's partitioner does not
      reassociate them, so they cost 3 (or 1 + 2 kv) x and 2 x that.
    Each all-reduce of B bytes over n devices sends 2B(n-1)/n. (Measured with remat="none"; a
    recomputed forward pass may send its all-reduces again.)"""
    x, y, model = ctx.mesh["tp_x"], ctx.mesh["tp_y"], ctx.model
    tokens, c = ctx.batch // ctx.batch_shards * ctx.held_length, ctx.compute_bytes
    w = local_widths(model, x, y)
    over_x = tokens * c * (w["q"] + 2 * w["kv"] + 2 * w["mlp"]) + tokens * c * (w["q"] + w["mlp"]) + 4 * tokens * NORM_BYTES
    over_y = tokens * c * w["embed"] * (2 + (3 if w["kv_split"] else 1) + 2)
    return {("all-reduce", "tp_x"): data.grad_allreduce_bytes(over_x, x), ("all-reduce", "tp_y"): data.grad_allreduce_bytes(over_y, y)}


def traffic(strategy, ctx) -> dict:
    """Bytes per device per step over tp_x and tp_y: ``layer_traffic`` per layer, plus the edges:
    the final norm's sums (over X, forward and backward), the output projection's logits
    (T x vocab/Y, over X, forward) and its input gradient (T x embed/X, over Y, backward), the
    embedding lookup's rows from a vocab-split table (T x embed/X, over Y, forward) and the
    vocab-parallel cross-entropy's sums (3T floats, over Y); with fsdp=F > 1 the token embedding's
    gradient, which XLA's partitioner makes whole over the vocabulary and sums over Y (vocab x
    embed/(X F) floats; measured under ZeRO-3). With tp_x=1 the layout is Megatron's
    1-D split over tp_y on jaxpar's manual step: ``tensor.traffic``'s formula over tp_y."""
    x, y = ctx.mesh["tp_x"], ctx.mesh["tp_y"]
    if x == 1 and y == 1:
        return {}
    if x == 1:  # Megatron over tp_y (the manual step, the Llama's own collectives)
        megatron = tensor.traffic(strategy, dataclasses.replace(ctx, mesh=dict(ctx.mesh, tensor=y)))
        return {(kind, "tp_y"): b for (kind, _), b in megatron.items()}
    if ctx.model is None:
        return {}
    model, tokens, c = ctx.model, ctx.batch // ctx.batch_shards * ctx.held_length, ctx.compute_bytes
    per_layer = layer_traffic(ctx)
    edge_x = 2 * tokens * NORM_BYTES + tokens * model.vocab_size // y * c
    edge_y = 2 * tokens * model.embed // x * c + CROSS_ENTROPY_SUMS * tokens * NORM_BYTES
    f = ctx.mesh["fsdp"]
    if f > 1:  # stored over fsdp too, the table's gradient comes out of XLA's scatter whole over vocab
        edge_y += model.vocab_size * model.embed // (x * f) * ctx.reduce_bytes
    out = {("all-reduce", "tp_x"): model.layers * per_layer[("all-reduce", "tp_x")] + data.grad_allreduce_bytes(edge_x, x),
           ("all-reduce", "tp_y"): model.layers * per_layer[("all-reduce", "tp_y")] + data.grad_allreduce_bytes(edge_y, y)}
    return {k: v for k, v in out.items() if v}
