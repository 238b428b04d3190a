"""Megatron tensor parallelism (TP) over the ``tensor`` axis.

Attention is split by heads (QKV column-parallel, output row-parallel), the MLP by its hidden
width (up/gate column-parallel, down row-parallel), the embedding and the output projection by
vocabulary (vocab-parallel lookup and cross-entropy). Each row-parallel output is all-reduced in
the forward pass and each block input in the backward pass: per layer 4 all-reduces of the
(batch, length, embed) activation, 2*A_b*(T-1)/T bytes each per device.
"""

LOGICAL_AXES = ("heads", "kv_heads", "mlp", "vocab")


def layer_allreduce_bytes(activation_bytes: float, t: int) -> float:
    """Bytes per device per layer per step: 2 forward + 2 backward all-reduces of one activation."""
    return 4 * 2.0 * activation_bytes * (t - 1) / t if t > 1 else 0.0
