"""How a model is trained: ``TrainConfig``, the optimizer and step options ``Trainer`` takes (the
strategy, and so the layout, is separate: ``jaxpar.parallel``).

A field declared with ``flag`` is also an option of the commands it names (``jaxpar.flags``): the
CLI adds it and builds this class from it, so a new option is its field and help alone."""

from __future__ import annotations

import dataclasses

from jaxpar.flags import flag

DTYPES = ["float32", "bfloat16"]
GRAD_SYNC = "gradient sync (how gradients are summed across the batch axes)"  # the group of its options in train's help
# the options that change the compiled program are compile's too (with a pod's defaults: aot.POD_DEFAULTS)
TRAIN_COMPILE = ("train", "compile")


def _axes(text: str) -> tuple[str, ...]:
    """--grad-sync-axes "data, fsdp" -> ("data", "fsdp")."""
    return tuple(filter(None, (axis.strip() for axis in text.split(","))))


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    learning_rate: float = flag(3e-3)
    warmup_steps: int = flag(20)
    total_steps: int = 300
    weight_decay: float = 0.1
    clip_norm: float = flag(1.0, help="scale each step's gradient down to this global norm (0: no clipping; default 1.0)")
    b1: float = 0.9
    b2: float = 0.95
    # float32 | bfloat16 (weights stay float32: the master copy)
    compute_dtype: str = flag("float32", choices=DTYPES, commands=(*TRAIN_COMPILE, "check"), help={
        "train": "bfloat16 keeps float32 master weights", "compile": "bfloat16 keeps float32 master weights"})
    # dtype gradients are summed across devices in; explicit, never implied
    grad_reduce_dtype: str = flag("float32", choices=DTYPES, commands=TRAIN_COMPILE, help={
        "train": "dtype gradients are summed across devices in",
        "compile": "dtype gradients are summed across devices in (bfloat16 halves the reduction bytes)"})
    # gradient accumulation steps per optimizer step
    microbatches: int = flag(1, commands=(*TRAIN_COMPILE, "check"), help={
        "train": "gradient accumulation steps per optimizer step (with stage=N: pipeline micro-batches)",
        "compile": "gradient accumulation steps (with stage=N: pipeline micro-batches)"})
    donate: bool = True  # reuse the old state's buffers for the new state
    # exact | dynamiq | int8: how gradients are summed across batch axes (grad_sync.py); checked there, hence no choices
    grad_sync: str = flag("exact", metavar="{exact,dynamiq,int8}", group=GRAD_SYNC, help=(
        "exact: psum in --grad-reduce-dtype (default); dynamiq: compressed all-reduce with block scales and "
        "per-group widths (about 5 bits per value); int8: naive 8-bit per-hop quantization"))
    # dynamiq: average bits per value (None: the collective's default)
    grad_sync_bits: float | None = flag(None, metavar="B", group=GRAD_SYNC, help="dynamiq: average bits per value (default: the collective's)")
    # batch axes to compress (None: those crossing slow links, else all)
    grad_sync_axes: tuple[str, ...] | None = flag(None, metavar="AXES", group=GRAD_SYNC, to_config=_axes, help=(
        "comma-separated batch mesh axes to compress, e.g. data (default: those that cross slow links between slices or nodes, else all)"))
    grad_sync_min_size: int = 4096  # values per device below which a compressed reduction stays exact
    # pipeline schedule when the mesh has stage > 1 (parallel/stage/schedules.py); given: refused without a stage axis
    schedule: str = flag("1f1b", given=True, choices=["gpipe", "1f1b", "eager-1f1b", "interleaved-1f1b", "pipedream"], commands=TRAIN_COMPILE, help={
        "train": "pipeline schedule when the strategy has stage=N (default 1f1b)",
        "compile": "pipeline schedule when the strategy has stage=N"})
    # a pipeline's sends slowed for real (each tick that sends waits latency + bytes / bandwidth):
    # wall-clock comparisons of links slower than this machine's (0: as fast as they are)
    stage_link_mbps: float = flag(0.0, given=True, metavar="MBPS", help=(
        "with stage=N: make every send between stages take its bytes over this many megabits per second, "
        "for real (e.g. 200; with --stage-link-latency-ms, internet-grade links on simulated devices)"))
    stage_link_latency_ms: float = flag(0.0, given=True, metavar="MS", help=(
        "with stage=N: make every send between stages wait this many milliseconds before its first byte, for real (e.g. 50)"))
    # layer chunks per stage (interleaved-1f1b: virtual stages per device)
    chunks: int = flag(1, given=True, commands=TRAIN_COMPILE, help={
        "train": "layer chunks per stage (interleaved-1f1b: virtual stages per device, >= 2; default 1)",
        "compile": "layer chunks per stage (interleaved-1f1b)"})
    # none | full | dots: what the backward pass recomputes per layer (remat.py)
    remat: str = flag("none", choices=["none", "full", "dots"], commands=TRAIN_COMPILE, help={"train": "what the backward pass recomputes"})
    # auto | naive | blockwise | splash | cudnn: jaxpar.attention's implementation
    attention: str = flag("auto", choices=["auto", "naive", "blockwise", "splash", "cudnn"], commands=TRAIN_COMPILE, help={
        "train": "attention implementation (auto: splash on TPU, cuDNN on GPU where the mask allows, else blockwise)",
        "compile": "attention implementation (auto: splash on a TPU pod where the length tiles, else blockwise)"})
    path: str = "auto"  # auto | manual | gspmd: who places the collectives (see Trainer.path_reason)
    # stop | skip: a step whose loss or gradient is NaN/inf raises, or is skipped
    nonfinite: str = flag("stop", name="skip-nonfinite", action="store_true", to_config=lambda skip: "skip" if skip else "stop",
                          from_config=lambda nonfinite: nonfinite == "skip", help=(
                              "drop the update of a step whose loss or gradient is NaN or inf and go on (default: stop there, exit 1)"))
    # a device's memory, for choices made by memory (regather=auto); None: what the devices report
    memory_bytes: float | None = None


PATHS = ("auto", "manual", "gspmd")
NONFINITE = ("stop", "skip")
