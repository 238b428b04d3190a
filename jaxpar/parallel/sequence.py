"""Megatron sequence parallelism (SP), the option ``sp=on`` of tensor parallelism.

The regions that TP leaves replicated (norms, residual adds) are split along the sequence over
the ``tensor`` axis: the logical axis ``residual_length`` maps to ``tensor``. Entering a block the
activation is all-gathered along the sequence; leaving it, the row-parallel partial sums are
reduce-scattered back (instead of all-reduced): the same bytes as TP, with 1/T of the norm and
residual activations per device. Norm weights, used on a slice of the sequence, have their
gradients summed over ``tensor``. (Its traffic is in ``tensor.traffic``.)
"""

from jaxpar.errors import SpecError
from jaxpar.parallel.base import switch

AXES: tuple[str, ...] = ()  # it splits over tensor's axis
CROSSES_DCN = False
LOGICAL_AXIS = "residual_length"


OPTIONS = {"sp": (switch, False)}


def check(strategy):
    if strategy.options["sp"] and strategy.degrees["tensor"] == 1:
        raise SpecError(f"sp=on splits the sequence over the tensor axis, but strategy {strategy} has tensor=1; add tensor=N")


def rules(strategy, compute: dict, stored: dict):
    if strategy.options["sp"]:
        compute[LOGICAL_AXIS] = compute[LOGICAL_AXIS] + ("tensor",)


def manual_only(layout, calls) -> str | None:
    # the GSPMD path reaches the sequence split only through the model's own jaxpar.nn.constrain calls
    if "tensor" in layout.axes_of(LOGICAL_AXIS) and "constrain" not in calls:
        return "sequence parallelism (sp=on)"
    return None
