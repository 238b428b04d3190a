"""Delayed tensor parallelism (DTP), the option ``delay=1`` of tensor parallelism.

Under TP every attention and MLP sublayer ends in a blocking all-reduce: the next sublayer needs
the finished sum of the devices' partial outputs. Under DTP each device keeps its own copy of the
residual stream and adds to it, after sublayer k, its own partial output of sublayer k at once and
the other devices' partial outputs of sublayer k - 1: the all-reduce of sublayer k's partial sum
is issued when it is made and read one sublayer later, so it runs while sublayer k + 1 computes.
After the last sublayer the remaining sum is added, and every device's copy is the same again.

This is a different function from TP (a device sees its peers' contributions one sublayer late),
so a model is trained as DTP to be served as DTP. The model says where its sublayers end with
``jaxpar.nn.residual_add`` and carries the pending partial sum between them
(``nn.start_delayed`` / ``nn.finish_delayed``); ``delay=0`` is TP itself, the same program.

The bytes are TP's per layer: each sublayer's partial sum is all-reduced once forward, and its
cotangent once backward. A uniform layer scan carries the pending sum from the first layer on, so
a step sums one activation of zeros more than TP each way (the first sublayer's empty pending). The
report counts the collectives nothing can compute under (``analysis.hlo.blocking_collectives``):
2 per layer under TP, 0 under DTP.
"""

from jaxpar.errors import LayoutError, SpecError
from jaxpar.parallel import data, tensor
from jaxpar.parallel.base import count_option
from jaxpar.parallel.tensor import DELAYED

AXES: tuple[str, ...] = ()  # it delays the sums over tensor's axis
CROSSES_DCN = False
DELAYS = (0, 1)


OPTIONS = {"delay": (count_option(lambda n: n in DELAYS, "give delay=1 (each sublayer's all-reduce read one sublayer later) "
                                   "or delay=0 (tensor parallelism as it is)"), 0)}


def check(strategy):
    if not strategy.options["delay"]:
        return
    degrees = strategy.degrees
    if degrees["tensor"] == 1:
        raise SpecError(f"delay=1 delays the all-reduces of tensor parallelism, but strategy {strategy} has tensor=1; "
                        f"add tensor=N (e.g. tensor=4,delay=1)")
    if strategy.options["sp"]:
        raise SpecError(f"delay=1 with sp=on in {strategy}: under sequence parallelism each device holds a slice of the "
                        f"residual stream, so it has no copy of its own to add its partial sums to first; drop one of the two")
    if degrees["stage"] > 1:
        raise SpecError(f"delay=1 with stage={degrees['stage']} in {strategy}: the pending partial sum would cross the "
                        f"pipeline's stage boundaries; serve or train DTP without a pipeline")


def roles(strategy) -> dict[str, tuple[str, ...]]:
    return {DELAYED: ("tensor",) if strategy.options["delay"] else ()}


def check_calls(layout, calls):
    if layout.role(DELAYED) and "residual_add" not in calls:
        made = sorted(set(calls))
        raise LayoutError(
            f"the layout delays tensor parallelism's sums (delay=1), but the model never adds a sublayer to its residual "
            f"stream with jaxpar.nn.residual_add ({'it calls ' + ', '.join(made) if made else 'it makes no jaxpar call'}): "
            f"it would train as plain TP. Carry the residual stream with jaxpar.nn.start_delayed, residual_add and "
            f"finish_delayed (as jaxpar.models.llama does), or drop delay=1")


def comparable(layout) -> str | None:
    """Delayed TP adds each sublayer's sum one sublayer late: another function than one device's by
    design (its oracle is a single-device simulation of the delayed algorithm, as
    tests/test_delayed_tp.py writes it), so against one device every weight differs."""
    if not layout.role(DELAYED):
        return None
    return ("delay=1 computes another function than one device (each sublayer reads the others' sums one "
            "sublayer late), so comparing it with one device says nothing; check the same strategy with "
            "delay=0, which checks the layout's splits and sums")


def _delayed_over(strategy) -> int:
    """The tensor degree whose all-reduces ``strategy`` delays, else 0: one function per degree."""
    return strategy.degrees["tensor"] if strategy.options["delay"] else 0


def changed(saved, strategy) -> str | None:
    """Why weights trained under ``saved`` are another function under ``strategy`` (None: they are not)."""
    before, now = _delayed_over(saved), _delayed_over(strategy)
    if before == now:
        return None
    said = lambda d: f"delay=1 over tensor={d}" if d else "no delay=1"  # noqa: E731
    fix = f"resume with tensor={before},delay=1 in --strategy" if before else "drop delay=1 from --strategy to resume it"
    return (f"was trained under {saved} ({said(before)}), and this run's strategy {strategy} has {said(now)}: delayed TP is "
            f"another function of the same weights, one per tensor degree; {fix}")


def serves_manually(layout) -> bool:
    return bool(layout.role(DELAYED))  # each device keeps its own residual stream


def runtime_axes(layout) -> tuple[str, ...]:
    return layout.role(DELAYED)


# XLA merges all-reduces that do not depend on each other into one (CPU, GPU and TPU each have such a
# pass). Under DTP a layer's two sums are independent by design: merged, the earlier one is issued
# only when the later one's operand is ready, and the next sublayer waits on both (measured on the
# CPU program: one tuple all-reduce per layer, the MLP's input reading it). DTP's programs are
# compiled without the merge.
_COMBINERS = "all-reduce-combiner,cpu-all-reduce-combiner,gpu-all-reduce-combiner"


def compiler_options(layout) -> dict:
    return {"xla_disable_hlo_passes": _COMBINERS} if layout.role(DELAYED) else {}


def rules(strategy, compute: dict, stored: dict):
    """Nothing of its own: weights are split as under TP."""


def traffic(strategy, ctx) -> dict:
    """What DTP adds to tensor.traffic's all-reduces: the first sublayer's pending sum of zeros,
    once forward and once backward, and the norm scales' gradients, which the devices' own copies
    of the stream make differ (summed over tensor, as under sequence parallelism)."""
    if not strategy.options["delay"] or ctx.model is None:
        return {}
    t, model = ctx.mesh["tensor"], ctx.model
    norms = (2 * model.layers + 1) * model.embed * ctx.reduce_bytes
    zeros = 2 * data.grad_allreduce_bytes(tensor.activation_bytes(ctx), t)
    return {("all-reduce", "tensor"): zeros + data.grad_allreduce_bytes(norms, t)}

