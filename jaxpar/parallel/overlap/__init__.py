"""Collective matmul, the option ``tp_overlap=on`` of tensor parallelism with sequence parallelism.

Under Megatron SP each block's input is all-gathered along the sequence before its column-parallel
matmuls, and its row-parallel output reduce-scattered after. With ``tp_overlap=on`` neither
collective runs whole: the all-gather becomes a ring of ``ppermute``s of sequence chunks, each
chunk's matmuls computed while the next chunk travels, and the reduce-scatter a ring that carries
partial sums, each hop's matmul computed while the previous hop's sum travels. The ring runs both
ways at once, half of each chunk each way (``jaxpar.nn.enter_block(..., then=)`` and
``jaxpar.nn.reduce_partial(..., project=)``). The bytes are the all-gather's and reduce-scatter's.
"""

from jaxpar.errors import SpecError
from jaxpar.parallel.base import switch

AXES: tuple[str, ...] = ()  # it runs over tensor's axis
CROSSES_DCN = False
OPTIONS = {"tp_overlap": (switch, False)}
# the layout's role (``Layout.role``): the mesh axes whose block-entry all-gathers and exit
# reduce-scatters run as rings of ppermutes under the block's matmuls (``jaxpar.nn.enter_block``'s ``then``)
OVERLAPPED = "overlapped"


def check(strategy):
    if not strategy.options["tp_overlap"]:
        return
    if strategy.degrees["tensor"] == 1:
        raise SpecError(f"tp_overlap=on overlaps tensor parallelism's collectives with its matmuls, but strategy {strategy} "
                        f"has tensor=1; add tensor=N,sp=on")
    if not strategy.options["sp"]:
        raise SpecError(f"tp_overlap=on decomposes sequence parallelism's all-gather and reduce-scatter into rings, but "
                        f"strategy {strategy} has sp=off; add sp=on")


def rules(strategy, compute: dict, stored: dict):
    """Nothing of its own: weights and activations are laid out as under TP with SP."""


def roles(strategy) -> dict[str, tuple[str, ...]]:
    return {OVERLAPPED: ("tensor",) if strategy.options["tp_overlap"] else ()}


def manual_only(layout, calls) -> str | None:
    # it acts at the block boundaries the model marks with jaxpar.nn.enter_block and reduce_partial
    return "collective matmul (tp_overlap=on)" if layout.role(OVERLAPPED) else None
