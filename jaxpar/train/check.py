"""``jaxpar check``: one step of a layout against the same model on one device, weight by weight.

Both compute the loss and the (unclipped) gradient of every weight from the same initial weights
(the same seed gives the same values on any layout) and the same batch. A weight fails when its
largest gradient difference exceeds ``tolerance`` times its largest one-device gradient entry.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import Mesh

from jaxpar import parallel
from jaxpar.errors import JaxparError
from jaxpar.rules import Layout

# default tolerances, by compute dtype: float32 sums in another order differ in the last bits;
# bfloat16 keeps 8 bits of mantissa
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}


@dataclasses.dataclass(frozen=True)
class WeightCheck:
    path: str
    max_difference: float  # largest |gradient under the layout - gradient on one device|
    scale: float  # largest |gradient on one device|
    ok: bool


@dataclasses.dataclass(frozen=True)
class CheckReport:
    path: str  # manual | gspmd: which path the layout took
    loss: float
    reference_loss: float
    tolerance: float
    weights: tuple[WeightCheck, ...]
    # weights whose one-device gradient (the oracle's) is NaN or infinite: nothing to compare against
    nonfinite_reference: tuple[str, ...] = ()

    @property
    def reference_finite(self) -> bool:
        return bool(np.isfinite(self.reference_loss)) and not self.nonfinite_reference

    @property
    def failed(self) -> list[WeightCheck]:
        """The weights whose gradient differs from one device's (none is blamed when one device's
        own loss or gradients are not finite: the layout is then not what went wrong)."""
        return [w for w in self.weights if not w.ok] if self.reference_finite else []

    @property
    def ok(self) -> bool:
        loss_ok = abs(self.loss - self.reference_loss) <= self.tolerance * max(abs(self.reference_loss), 1e-6)
        return self.reference_finite and loss_ok and not self.failed

    def format(self) -> str:
        if not self.reference_finite:
            some = f" and the gradients of {len(self.nonfinite_reference)} of {len(self.weights)} weights (e.g. " \
                   f"{self.nonfinite_reference[0]})" if self.nonfinite_reference else ""
            return (f"on one device, without any layout, the loss ({self.reference_loss:.7g}){some} are not all finite: the "
                    f"batch or the loss is non-finite (NaN or inf in the batch, a log of 0, a division by 0), not the "
                    f"layout; nothing was compared. Check the batch and the loss function")
        lines = [f"loss {self.loss:.7g} against {self.reference_loss:.7g} on one device ({self.path} path); "
                 f"tolerance {self.tolerance:g} of each weight's largest gradient"]
        for w in self.failed:
            lines.append(f"  FAIL {w.path}: gradient differs by {w.max_difference:.3g} (largest entry {w.scale:.3g})")
        lines.append(f"{len(self.weights) - len(self.failed)} of {len(self.weights)} weights match"
                     + ("" if self.ok else "; this layout does not compute what one device computes"))
        return "\n".join(lines)


def one_device(layout: Layout) -> Layout:
    """The same rules on a mesh of one device (every axis of degree 1)."""
    names = layout.mesh.axis_names
    mesh = Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(names)), names, axis_types=layout.mesh.axis_types)
    return dataclasses.replace(layout, mesh=mesh, dcn_axes=())


def check_tolerance(tolerance: float | None):
    """Refuse a tolerance no difference could be measured against (negative, zero, NaN, infinite)."""
    if tolerance is not None and not (math.isfinite(tolerance) and tolerance > 0):
        raise JaxparError(f"--tolerance {tolerance!r} must be a finite positive fraction of each weight's largest gradient "
                          f"entry; give e.g. --tolerance 1e-4, or drop it (by dtype: {TOLERANCE})")


def check_comparable(layout: Layout):
    """Refuse a layout that computes another function than one device by design: delayed TP adds
    each sublayer's sum one sublayer late (its oracle is a single-device simulation of the delayed
    algorithm, as tests/test_delayed_tp.py writes it), so against one device every weight differs."""
    why = parallel.comparable(layout)
    if why is not None:
        raise JaxparError(why)


def check_trainer(trainer, batch, tolerance: float | None = None, seed: int = 0) -> CheckReport:
    """Compare ``trainer``'s layout with one device on host ``batch`` (see the module docstring)."""
    check_tolerance(tolerance)
    check_comparable(trainer.layout)
    Trainer = type(trainer)  # the twin on one device is built the same way

    cfg = dataclasses.replace(trainer.cfg, clip_norm=0.0, donate=False)
    tolerance = TOLERANCE[cfg.compute_dtype] if tolerance is None else tolerance
    results = []
    for layout in (trainer.layout, one_device(trainer.layout)):
        t = Trainer(layout, trainer.model_fn, trainer.loss_fn, cfg, trainer.optimizer)
        state = t.init(seed)
        loss, _, grads = jax.jit(t.grad_fn())(state.params, t.put_batch(batch))
        results.append((t.plan.path, float(loss), jax.tree_util.tree_leaves_with_path(jax.device_get(grads))))
    (path, loss, got), (_, reference_loss, want) = results
    weights = []
    for (key, a), (_, b) in zip(got, want):
        difference, scale = float(np.max(np.abs(a - b))), float(np.max(np.abs(b)))
        ok = bool(np.isfinite(difference)) and difference <= tolerance * max(scale, 1e-12)
        weights.append(WeightCheck(jax.tree_util.keystr(key, simple=True, separator="/"), difference, scale, ok))
    nonfinite = tuple(w.path for w, (_, b) in zip(weights, want) if not np.all(np.isfinite(b)))
    return CheckReport(path, loss, reference_loss, tolerance, tuple(weights), nonfinite)
