"""Megatron tensor parallelism (TP) over the ``tensor`` axis.

Attention is split by heads (QKV column-parallel, output row-parallel), the MLP by its hidden
width (up/gate column-parallel, down row-parallel), the embedding and the output projection by
vocabulary (vocab-parallel lookup and cross-entropy). Each row-parallel output is all-reduced in
the forward pass and each block input in the backward pass: per layer 4 all-reduces of the
(batch, length, embed) activation, 2*A_b*(T-1)/T bytes each per device.
"""

LOGICAL_AXES = ("heads", "kv_heads", "mlp", "vocab")


def activation_passes(layers: int) -> int:
    """All-reduces of one (batch, length, embed) activation per step: per layer 2 forward (after
    attention and MLP) and 2 backward (before them), plus the embedding's forward and the output
    projection's backward. Sequence parallelism turns each into an all-gather and a reduce-scatter."""
    return 4 * layers + 2
