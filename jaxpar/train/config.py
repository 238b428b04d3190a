"""How a model is trained: ``TrainConfig``, the optimizer and step options ``Trainer`` takes (the
strategy, and so the layout, is separate: ``jaxpar.parallel``)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    total_steps: int = 300
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    b1: float = 0.9
    b2: float = 0.95
    compute_dtype: str = "float32"  # float32 | bfloat16 (weights stay float32: the master copy)
    grad_reduce_dtype: str = "float32"  # dtype gradients are summed across devices in; explicit, never implied
    microbatches: int = 1  # gradient accumulation steps per optimizer step
    donate: bool = True  # reuse the old state's buffers for the new state
    grad_sync: str = "exact"  # exact | dynamiq | int8: how gradients are summed across batch axes (grad_sync.py)
    grad_sync_bits: float | None = None  # dynamiq: average bits per value (None: the collective's default)
    grad_sync_axes: tuple[str, ...] | None = None  # batch axes to compress (None: those crossing slow links, else all)
    grad_sync_min_size: int = 4096  # values per device below which a compressed reduction stays exact
    schedule: str = "1f1b"  # pipeline schedule when the mesh has stage > 1 (parallel/schedules.py)
    chunks: int = 1  # layer chunks per stage (interleaved-1f1b: virtual stages per device)
    remat: str = "none"  # none | full | dots: what the backward pass recomputes per layer (remat.py)
    attention: str = "auto"  # auto | naive | blockwise | splash | cudnn: jaxpar.attention's implementation
    path: str = "auto"  # auto | manual | gspmd: who places the collectives (see Trainer.path_reason)
    nonfinite: str = "stop"  # stop | skip: a step whose loss or gradient is NaN/inf raises, or is skipped
    # a device's memory, for choices made by memory (regather=auto); None: what the devices report
    memory_bytes: float | None = None


PATHS = ("auto", "manual", "gspmd")
NONFINITE = ("stop", "skip")
