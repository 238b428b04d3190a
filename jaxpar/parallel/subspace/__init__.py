"""Subspace pipeline boundaries, the option ``subspace=k`` of the pipeline (``stage``).

Every write to the residual stream (``jaxpar.nn.residual_add``: the model marks them) is projected
onto a fixed k-dimensional subspace, so a pipeline boundary carries k coordinates a position
instead of the stream's d values, forward and backward (``codec.py``): k/d of the bytes (15.6% at
k = 160, d = 1024), for links too slow for the stream. It is another function than the dense
model (the same with k = d): the layout's one-device twin projects the same writes, so one device
stays its oracle.
"""

from jaxpar.errors import LayoutError, SpecError
from jaxpar.parallel.base import count_option
from jaxpar.parallel.subspace.codec import SubspacePieces

AXES: tuple[str, ...] = ()  # it shrinks what crosses the stage axis
CROSSES_DCN = False
SUBSPACE = "subspace"  # the layout's setting: k, 0 when off

OPTIONS = {SUBSPACE: (count_option(lambda k: k >= 0, "give the subspace's dimension, a whole number from 1 up to the "
                                                     "model's width (subspace=0: off)"), 0)}


def check(strategy):
    k = strategy.options[SUBSPACE]
    if k and strategy.degrees["stage"] == 1:
        raise SpecError(f"subspace={k} shrinks what a pipeline's stages send each other, but strategy {strategy} has no "
                        f"pipeline; add stage=N (e.g. stage=4,data=2,subspace={k}) or drop subspace={k}")
    if k and strategy.degrees.get("tp_x", 1) > 1:
        raise SpecError(f"subspace={k} with tp_x={strategy.degrees['tp_x']} in {strategy}: AxoNN splits the residual "
                        f"stream's width, which the subspace's projection needs whole; use tensor=N or drop one of the two")


def settings(strategy) -> dict:
    return {SUBSPACE: strategy.options[SUBSPACE]}


def check_weights(layout, weights: dict):
    """Refuse a k above the stream's width (the weights' ``embed`` dim)."""
    k = layout.settings.get(SUBSPACE, 0)
    widths = {shape[dim] for names, shape in weights.values() for dim, name in enumerate(names or ()) if name == "embed"}
    if k and widths and k > min(widths):
        raise LayoutError(f"subspace={k} is above the model's width {min(widths)} (its weights' embed dim): a subspace "
                          f"of the residual stream has at most {min(widths)} dimensions; give subspace={min(widths)} or less")


def check_calls(layout, calls):
    k = layout.settings.get(SUBSPACE, 0)
    if k and "residual_add" not in calls:
        made = sorted(set(calls))
        raise LayoutError(
            f"subspace={k} projects every write to the residual stream, but the model never marks one with "
            f"jaxpar.nn.residual_add ({'it calls ' + ', '.join(made) if made else 'it makes no jaxpar call'}): its "
            f"stages' outputs would not lie in the subspace. Add each attention and MLP output to the stream with "
            f"jaxpar.nn.residual_add (as jaxpar.models.llama does), or drop subspace={k}")


def nonfinite_cause(layout) -> str | None:
    k = layout.settings.get(SUBSPACE, 0)
    if not k:
        return None
    return (f"Under subspace={k} a stage whose output leaves the subspace makes the step non-finite on purpose: every "
            f"write to the residual stream must be made with jaxpar.nn.residual_add (a write added with a plain + is "
            f"not projected, and the stage boundary would drop it); if the first step is non-finite, look for one")


def pipeline_pieces(layout, pieces):
    k = layout.settings.get(SUBSPACE, 0)
    return SubspacePieces(pieces, k) if k else pieces


def changed(saved, strategy) -> str | None:
    before, now = saved.options.get(SUBSPACE, 0), strategy.options[SUBSPACE]
    if before == now:
        return None
    said = lambda k: f"subspace={k}" if k else "no subspace"  # noqa: E731
    return (f"was trained under {saved} ({said(before)}), and this run's strategy {strategy} has {said(now)}: the "
            f"subspace constrains what the weights compute; resume with {said(before)}")


def report(layout, measured, cfg) -> dict | None:
    """The pipeline boundaries' bytes a device sends per step (its collective-permutes over stage,
    measured on the compiled step), against a dense boundary's (the same times d/k)."""
    k = layout.settings.get(SUBSPACE, 0)
    if not k:
        return None
    sent = sum(c.bytes_per_step for c in measured.collectives if c.kind == "collective-permute" and "stage" in c.mesh_axes)
    width = getattr(cfg, "embed", None)  # (a model config that names its width)
    section = {"k": k, "boundary_bytes": sent}
    if width:
        section.update(width=width, dense_boundary_bytes=sent * width / k, ratio=k / width)
    return section


def summary(section: dict) -> list[str]:
    line = f"subspace boundaries: k={section['k']}, {section['boundary_bytes']:,.0f} B sent per device and step"
    if "width" in section:
        line += (f" against {section['dense_boundary_bytes']:,.0f} B for the dense stream (k/d = {section['k']}/"
                 f"{section['width']} = {section['ratio']:.1%})")
    return ["", line]
