"""Megatron sequence parallelism (SP), on top of tensor parallelism.

The regions that TP leaves replicated (norms, residual adds) are split along the sequence over
the ``tensor`` axis: the logical axis ``residual_length`` maps to ``tensor``. Entering a block the
activation is all-gathered along the sequence; leaving it, the row-parallel partial sums are
reduce-scattered back (instead of all-reduced): the same bytes as TP, with 1/T of the norm and
residual activations per device. Norm weights, used on a slice of the sequence, have their
gradients summed over ``tensor``.
"""

LOGICAL_AXIS = "residual_length"
