"""The main job: train a Llama under a layout on the shipped corpus, and report what it cost.

``run_training`` is what ``jaxpar train`` calls; Python users can call it directly. It reads no
compiled program itself (train/ never imports the analysis): ``jaxpar train`` passes
``analyze=jaxpar.report.step_report`` for the memory and communication figures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Any

import jax
import numpy as np

from jaxpar import corpus, flags, parallel, scalars
from jaxpar.errors import JaxparError, JobFailed, size_text
from jaxpar.launch import report_progress
from jaxpar.models import FAMILIES, config_of, config_record, family_of, model_and_loss, model_config
from jaxpar.models.family import Family
from jaxpar.parallel import STRATEGIES, Strategy, build_layout, check_model, parse_strategy
from jaxpar.parallel.stage import schedules
from jaxpar.topology import Topology
from jaxpar.train import data
from jaxpar.train.checkpoint import CheckpointConfig, Checkpointer, newest_meta
from jaxpar.train.placement import BatchPlacement
from jaxpar.train.plan import Plan, make_plan
from jaxpar.train.state import learning_rate_schedule
from jaxpar.train.step import TrainConfig, Trainer, nonfinite_message


@dataclasses.dataclass(frozen=True)
class RunConfig:
    # each flag is an option of the commands it names (jaxpar.flags), with train's default here
    model: str = flags.flag("tiny", commands=("train", "compile", "check", "bench"), help={
        "train": "tiny | llama-1b | llama2-7b | llama3-8b | llama2-70b | bd3lm-tiny | bd3lm-8b | moe-tiny | mixtral-8x7b | "
                 "deepseek-v3-like"})
    strategy: str = flags.flag("fsdp=4,tensor=2", commands=("train", "compile", "check"), help={
        "train": 'parallel spec and options, e.g. "data=2,fsdp=-1,tensor=2,zero=3,sp=off"',
        "compile": 'parallel spec and options, e.g. "fsdp=-1,regather=auto" (as for train)'})
    steps: int = flags.flag(300, commands=("train", "bench"), help={"bench": "steps per strategy (the first, which compiles, is not timed)"})
    batch_size: int = flags.flag(16, commands=("train", "compile", "check", "bench"), help={
        "train": "global batch, in sequences", "compile": "global batch, in sequences",
        "check": "global batch, in sequences (small: one step of each)"})
    seq_len: int = flags.flag(128, commands=("train", "compile", "check", "bench"), help={
        "compile": "tokens per sequence (a block diffusion model reads twice as many: [x_t ; x_0])"})
    seed: int = flags.flag(0, commands=("train", "check"))
    # rows of whole documents (train.data.packed_batch_at), not windows of the stream
    packing: bool = flags.flag(False, **flags.ON_OFF, commands=("train", "bench", "check", "compile"),
                              help="on: rows of whole documents with segment ids, loss over real tokens; off: windows of the text")
    # a block diffusion model's blocks (None: its config's)
    block_size: int | None = flags.flag(None, commands=("train", "compile"), help={
        "train": "block diffusion models (bd3lm-*): tokens per block, dividing --seq-len (default 16)",
        "compile": "block diffusion models (bd3lm-*): tokens per block, dividing --seq-len"})
    # a block diffusion model's sliding window in tokens (None: its config's)
    window: int | None = flags.flag(None, commands=("train", "compile"), help={
        "train": "block diffusion models: the clean tokens before a block that it attends to, whole blocks "
                 "(a sliding window; default the whole prefix)",
        "compile": "block diffusion models: a sliding window of clean tokens, whole blocks (as for train)"})
    # a mixture of experts' capacity per row as a multiple of an even share (None: its config's; 0: dropless)
    capacity_factor: float | None = flags.flag(None, commands=("train", "compile"), help={
        "train": "mixture-of-experts models (moe-tiny...): the copies an expert takes per row, as a multiple of an even "
                 "share, e.g. 1.25 (0: dropless, the default)",
        "compile": "mixture-of-experts models: capacity per row as a multiple of an even share (0: dropless)"})
    # the weight of a mixture of experts' load-balancing loss (None: its config's)
    balance_weight: float | None = flags.flag(None, commands=("train", "compile"), help={
        "train": "mixture-of-experts models: the weight of the load-balancing loss (default the model's, 0.01 for moe-tiny)",
        "compile": "mixture-of-experts models: the weight of the load-balancing loss"})
    # a mixture of experts' routing bias step (None: its config's; 0: no bias)
    bias_rate: float | None = flags.flag(None, commands=("train", "compile"), help={
        "train": "mixture-of-experts models: auxiliary-loss-free balancing, each step moving every layer's routing bias "
                 "by this much toward the experts that got fewer tokens than an even share (e.g. 0.001; 0: no bias, the default)",
        "compile": "mixture-of-experts models: the routing bias's step per training step (0: no bias)"})
    # a user's own corpus (jaxpar.corpus): files or globs, how to read them, the tokenizer
    data: str | None = flags.flag(None, group="data", commands=("train", "bench", "check"),
                                  help="your corpus instead of the built-in one: files, directories or globs, "
                                  "comma-separated (.txt, .jsonl, .parquet); tokenized once into a cache beside it")
    data_field: str = flags.flag("text", group="data", commands=("train", "bench", "check"),
                                 help="the field (JSON Lines) or column (Parquet) that holds the text")
    data_separator: str | None = flags.flag(None, group="data", commands=("train", "bench", "check"),
                                            help="split plain text files into documents where this occurs "
                                            "(e.g. a blank line: $'\\n\\n'); default: one document per file")
    tokenizer: str | None = flags.flag(None, group="data", commands=("train", "bench", "check", "compile"),
                                       help="bytes (UTF-8 bytes, vocabulary 256; the default), a Hugging Face "
                                       "tokenizer.json or a SentencePiece .model; the model's vocabulary follows it (with "
                                       "--init-from: the checkpoint's tokenizer by default)")
    eval_data: str | None = flags.flag(None, group="data", commands=("train", "bench"),
                                       help="held-out files (as --data); default: the last --eval-fraction of --data's documents")
    eval_fraction: float = flags.flag(0.05, group="data", commands=("train", "bench"),
                                      help="with --data and no --eval-data: the documents held out")
    eval_every: int = flags.flag(0, group="data", metavar="N", help="the held-out loss every N steps as well as at the end "
                                 "(0: at the end only), on the same held-out batch each time: in the report, the log and --tensorboard")
    data_cache: str | None = flags.flag(None, group="data", commands=("train", "bench", "check"),
                                        help="where token caches go (default: .jaxpar-cache beside the data)")
    # a checkpoint whose weights (and model config, and tokenizer) the run starts from
    init_from: str | None = flags.flag(None, metavar="CHECKPOINT_DIR", help="start from the weights of this checkpoint's newest "
                                       "step (a jaxpar run's, or jaxpar convert --from-hf's), its model and tokenizer, with a "
                                       "fresh optimizer: fine-tuning (--model is then the checkpoint's)")
    # TensorBoard event files of every step's figures (jaxpar.scalars)
    tensorboard: str | None = flags.flag(None, metavar="DIR", help="write each step's loss, learning rate, gradient norm, tokens/s, "
                                         "MFU estimate and memory (and the held-out loss at the end) as TensorBoard scalars under DIR")
    train: TrainConfig = TrainConfig()
    # TrainConfig fields set on purpose even where they equal the default (the CLI's flags): like
    # any other non-default value, they are refused when the layout would ignore them
    explicit: frozenset[str] = frozenset()


def check_at_least(flag: str, value: int, low: int, why: str = ""):
    """Refuse ``flag value`` below ``low``, naming both; ``why`` says what the bound is for."""
    if value < low:
        raise JaxparError(f"{flag} {value} is too small: it must be at least {low}{why}; pass {flag} {low} or more")


def check_writable(path: str, flag: str, directory: bool = False, room: int = 0):
    """Refuse, before any work, an output path that cannot be written: a file where a directory is
    wanted or the reverse, or a place where no file can be created (probed by creating and removing
    one in the directory the output will go into; missing directories are not created here), or,
    with ``room``, one on a disk with fewer bytes free (an output that would not fit at the end)."""
    target = os.path.abspath(path)
    if os.path.exists(target) and os.path.isdir(target) != directory:
        want = "a directory" if directory else f"a file path, e.g. {os.path.join(path, 'metrics.json')}"
        raise JaxparError(f"{flag} {path} is an existing {'file' if directory else 'directory'}; give {want}")
    base = target if directory else os.path.dirname(target)
    while not os.path.exists(base):  # made when the output is written
        base = os.path.dirname(base)
    if not os.path.isdir(base):
        raise JaxparError(f"{flag} {path}: {base} is a file, not a directory; choose a path under a directory")
    try:
        fd, probe = tempfile.mkstemp(dir=base, prefix=".jaxpar-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise JaxparError(f"{flag} {path} cannot be written ({err.strerror} in {base}); choose a writable location") from None
    free = shutil.disk_usage(base).free
    if free < room:
        raise JaxparError(f"{flag} {path}: the disk has {free >> 10} KiB free, and the output needs about {room >> 10} KiB; "
                          "free some space there or choose another path")


def check_run(run: RunConfig, checkpoint: CheckpointConfig | None = None, resume: str = "never"):
    """Refuse numbers and settings that cannot work, each with its value and the fix, before JAX is
    asked for devices (``build_trainer`` checks the strategy, the model and the fit)."""
    for flag, value in (
        ("--steps", run.steps), ("--batch-size", run.batch_size), ("--seq-len", run.seq_len),
        ("--microbatches", run.train.microbatches),
    ):
        check_at_least(flag, value, 1)
    check_at_least("--warmup-steps", run.train.warmup_steps, 0)
    check_at_least("--eval-every", run.eval_every, 0, " (0: the held-out loss at the end only)")
    schedules.check_chunks(run.train.schedule, run.train.chunks)
    if not 0 <= run.seed < 2**63:  # it seeds jax.random.key and numpy's generator, which take no negative seed
        raise JaxparError(f"--seed {run.seed} must be a whole number from 0 to 2**63-1; pass e.g. --seed 0")
    run_model_config(run)
    _check_data_options(run)
    rate, clip = run.train.learning_rate, run.train.clip_norm
    if not (math.isfinite(rate) and rate > 0):
        raise JaxparError(f"--learning-rate {rate:g} must be a finite positive number; give e.g. --learning-rate 3e-3")
    if not (math.isfinite(clip) and clip >= 0):
        raise JaxparError(f"--clip-norm {clip:g} must be a finite number, 0 or more (0: no clipping); give e.g. --clip-norm 1.0")
    if run.tensorboard is not None:
        check_writable(run.tensorboard, "--tensorboard", directory=True)
    if resume not in ("never", "auto", "required"):
        raise JaxparError(f"resume={resume!r} is not one of never, auto, required")
    if checkpoint is None:
        if resume != "never":
            raise JaxparError("--resume needs --checkpoint-dir, the directory the run saved into")
        return
    check_at_least("--checkpoint-every", checkpoint.every, 1)
    check_at_least("--keep-checkpoints", checkpoint.keep, 1)
    check_writable(checkpoint.directory, "--checkpoint-dir", directory=True)


def run_model_config(run: RunConfig):
    """The config of the run's model with the options only its family takes (``--block-size`` and
    ``--window`` for block diffusion models: ``Family.configure``); refuses another family's
    options, and ``--packing`` for a family that does not pack documents."""
    cfg = config_of(init_meta(run)) if run.init_from else model_config(run.model)
    family = family_of(cfg)
    for other in FAMILIES.values():
        for option in other.options:
            value = getattr(run, option)
            if option not in family.options and value is not None:
                example = next(iter(other.configs))
                raise JaxparError(f"--{option.replace('_', '-')} {value} is for {other.words}s (e.g. --model {example}); "
                                  f"{run.model} is a {family.words}: drop it")
    if run.packing and not family.packing:
        raise JaxparError(f"--packing on packs documents for next-token models; {run.model} ({family.words}) trains on "
                          f"windows of --seq-len tokens: drop --packing")
    cfg = family.configure(cfg, run.seq_len, **{option: getattr(run, option) for option in family.options})
    return _with_tokenizer_vocabulary(run, cfg, family)


VOCAB_MULTIPLE = 128  # a padded vocabulary splits over any power-of-two tensor degree up to 128


def _with_tokenizer_vocabulary(run: RunConfig, cfg, family: Family):
    """The model's vocabulary set to the run's tokenizer's, padded to ``VOCAB_MULTIPLE`` (the
    padding's ids never occur in the data, so they are never a target; the sampler never draws
    them). ``--tokenizer bytes`` keeps the model's own (every named config holds the 256 bytes);
    a model from ``--init-from`` keeps its own, which must hold the tokenizer's ids."""
    spec = tokenizer_spec(run)
    size = lambda: 256 if spec == corpus.BYTES else corpus.load(spec).vocab_size  # noqa: E731
    if run.init_from:
        if size() > cfg.vocab_size:
            raise JaxparError(f"--init-from {run.init_from}: its model has a vocabulary of {cfg.vocab_size} ids, and the "
                              f"tokenizer ({spec}) gives ids up to {size() - 1}; pass the model's own tokenizer with --tokenizer")
        return cfg
    if spec == corpus.BYTES:
        return cfg
    if family.rows is not None or not hasattr(cfg, "vocab_size"):
        raise JaxparError(f"--tokenizer {spec} sets the vocabulary of next-token models (Llama, mixture of experts); "
                          f"{run.model} is a {family.words}, which trains on byte tokens: drop --tokenizer")
    return dataclasses.replace(cfg, vocab_size=-(-size() // VOCAB_MULTIPLE) * VOCAB_MULTIPLE)


def init_meta(run: RunConfig) -> dict:
    """The meta of the newest checkpoint in ``--init-from``."""
    return newest_meta(run.init_from)


def model_name(run: RunConfig) -> str:
    """The model's name: ``--model``, or that of the ``--init-from`` checkpoint."""
    return init_meta(run)["model"] if run.init_from else run.model


def tokenizer_spec(run: RunConfig) -> str:
    """The run's tokenizer: ``--tokenizer``, else the ``--init-from`` checkpoint's, else bytes."""
    if run.tokenizer is not None:
        return run.tokenizer
    if run.init_from:
        identity = init_meta(run).get("tokenizer", {"identity": corpus.BYTES})["identity"]
        return corpus.kept(run.init_from, identity).spec
    return corpus.BYTES


def _check_data_options(run: RunConfig):
    """Refuse the options that read a user's corpus when no ``--data`` names one."""
    if run.data is None:
        for option, value in (("--eval-data", run.eval_data), ("--data-separator", run.data_separator), ("--data-cache", run.data_cache)):
            if value is not None:
                raise JaxparError(f"{option} {value} reads your corpus, and no --data names one: add --data FILES, or drop {option}")
        if tokenizer_spec(run) != corpus.BYTES:
            raise JaxparError(f"the tokenizer {tokenizer_spec(run)} reads your corpus, and no --data names one (the built-in "
                              f"corpus is UTF-8 bytes): add --data FILES")
    else:
        corpus.check_fraction(run.eval_fraction)


def open_data(run: RunConfig, log) -> tuple[corpus.Corpus, corpus.Corpus] | None:
    """(training, held-out) corpora of ``--data`` (tokenized into their caches first if need be),
    or None for the built-in corpus; the options that read files are refused without it."""
    if run.data is None:
        return None
    tokenizer = corpus.load(tokenizer_spec(run))
    read = dict(field=run.data_field, separator=run.data_separator, cache_root=run.data_cache, log=log)
    whole = corpus.open_corpus(run.data, tokenizer, **read)
    if run.eval_data is not None:
        return whole, corpus.open_corpus(run.eval_data, tokenizer, **read)
    return whole.split(run.eval_fraction)


def check_model_axes(strategy: Strategy, cfg, model: str):
    """Refuse a strategy with a mesh axis that needs something the model (config ``cfg``, called
    ``model``) lacks (``NEEDS_MODEL`` of its strategy, ``Family.axes``), suggesting the same
    degrees with that axis folded into ``data``."""
    degrees, written = strategy.spec.degrees, strategy.written_degrees
    family = next((f for f in FAMILIES.values() if type(cfg) is f.config_type), None)
    for module in STRATEGIES:
        for axis in module.AXES if module.NEEDS_MODEL else ():
            if written.get(axis, 1) > 1 and (family is None or axis not in family.axes):
                spec = dataclasses.replace(strategy.spec, degrees=dict(degrees, **{axis: 1, "data": degrees["data"] * degrees[axis]}))
                instead = dataclasses.replace(strategy, spec=spec)
                raise JaxparError(
                    f"the {axis} axis is not supported by model {model} yet: {module.NEEDS_MODEL}; drop {axis}={written[axis]} "
                    f"from the strategy, e.g. --strategy {instead}"
                )


def check_unused_options(run: RunConfig, strategy: Strategy):
    """Refuse options the layout would silently ignore: the user meant something by them."""
    train, defaults = run.train, TrainConfig()
    # (TrainConfig field, why it does nothing here and what to do)
    unused = [(field, why) for module in STRATEGIES for field, why in module.ignores(strategy).items()]
    if train.grad_sync == "exact":
        why = "--grad-sync exact sums gradients exactly; drop it or choose a compressed sync, e.g. --grad-sync dynamiq"
        unused += [("grad_sync_bits", why), ("grad_sync_axes", why)]
    for field, why in unused:
        value = getattr(train, field)
        if field in run.explicit or value != getattr(defaults, field):
            shown = ",".join(value) if isinstance(value, tuple) else value
            raise JaxparError(f"--{field.replace('_', '-')} {shown} does nothing here: {why}")


# float32 weights, float32 gradient buffer, Adam's two float32 moments
STATE_BYTES_PER_PARAM = 16


def check_fits_fully_sharded(num_params: int, topology: Topology, model: str = "the model"):
    """Refuse, before building anything, a model whose training state cannot fit even when every
    byte of it is sharded over all chips."""
    need = STATE_BYTES_PER_PARAM * num_params / topology.num_chips
    if need > topology.hbm_bytes:
        chips = math.ceil(STATE_BYTES_PER_PARAM * num_params / topology.hbm_bytes)
        raise JaxparError(
            f"{model} ({num_params / 1e9:.1f}B weights) needs {size_text(need)} per chip for weights, gradients and Adam "
            f"state even fully sharded over the {topology.num_chips} chips of {topology.name}, which have "
            f"{size_text(topology.hbm_bytes)} each: short by {size_text(need - topology.hbm_bytes)} per chip "
            f"before any activation. Use a topology with more than {chips} chips"
        )


def check_state_fits(state, topology: Topology, what: str):
    """Refuse a layout whose weights and optimizer state alone, as ``state`` (a ShardedState or a
    Trainer) stores them, exceed one chip's memory (gradients and activations come on top)."""
    need = sum(state.stored_bytes_per_device().values())
    if need > topology.hbm_bytes:
        raise JaxparError(
            f"{what} keeps {size_text(need)} of weights and optimizer state on each device, more than the "
            f"{size_text(topology.hbm_bytes)} per chip of {topology.name}; shard them more (e.g. --strategy fsdp=-1) "
            f"or choose a topology with more memory per chip"
        )


def devices_for(topology: Topology):
    """The devices to train on, checked against the topology: the first ``num_chips`` devices of
    one process, or all devices of a multi-process job (which must number exactly ``num_chips``)."""
    devices = jax.devices("cpu") if topology.platform == "cpu" else jax.devices()
    if topology.platform != devices[0].platform:
        raise JaxparError(
            f"topology {topology.name!r} is a {topology.platform} topology but JAX sees {devices[0].platform} devices; "
            f"train on the devices you have (e.g. --topology cpu-8) or plan for {topology.name} ahead of time"
        )
    if len(devices) < topology.num_chips or (jax.process_count() > 1 and len(devices) != topology.num_chips):
        per = f" ({jax.process_count()} processes x {jax.local_device_count()})" if jax.process_count() > 1 else ""
        raise JaxparError(
            f"topology {topology.name!r} has {topology.num_chips} chips but JAX sees {len(devices)} devices{per}; "
            f"pick a topology with {len(devices)} chips" + (" (a multi-process job uses every device)" if per else " or fewer")
        )
    return devices[: topology.num_chips]


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """Every decision of a run (``plan_run``): its model, strategy and layout, and its step's
    ``Plan`` (path, regather, remat, reductions, compile options) on the run's batch ``example``."""

    run: RunConfig
    model_cfg: Any
    family: Family
    strategy: Strategy
    step: Plan
    example: Any  # the run's batch as ShapeDtypeStructs, laid out as the step takes it


def plan_run(run: RunConfig, topology: Topology, devices=None, model_cfg=None, must_fit: bool = True) -> RunPlan:
    """One pass over a run's decisions, each refusal with the value and the fix, before anything
    is compiled or allocated: the model and its family's options, the fit, the strategy against
    the model and the options, the layout on ``devices`` (default: the topology's), the batch's
    splits, and the step's plan on the run's batch (``train.plan.make_plan``). ``model_cfg``: a
    config to use instead of ``run.model``'s; ``must_fit``: refuse a state that cannot fit (a
    compile reports it instead)."""
    cfg = model_cfg if model_cfg is not None else run_model_config(run)
    name = run.model if model_cfg is None else "the model"
    check_fits_fully_sharded(cfg.num_params(), topology, name)
    devices = devices_for(topology) if devices is None else devices
    strategy = parse_strategy(run.strategy, len(devices))
    check_model_axes(strategy, cfg, name)
    check_model(strategy, cfg, run.seq_len)
    check_unused_options(run, strategy)
    layout = build_layout(strategy, devices, num_slices=topology.num_slices)
    train_cfg = dataclasses.replace(run.train, total_steps=run.steps, memory_bytes=run.train.memory_bytes or topology.hbm_bytes)
    family = family_of(cfg)
    placement = BatchPlacement(layout, train_cfg.microbatches)
    placement.check(np.zeros((run.batch_size, 1)), run.seq_len)  # the batch and sequence splits
    example = placement.abstract(run.batch_size, run.seq_len, packed=run.packing, fields=family.batch_fields(run.seq_len))
    step = make_plan(layout, *model_and_loss(cfg), train_cfg, batch=example)
    if must_fit:
        check_state_fits(step.sharded_state, topology, f"{name} under {strategy}")
    return RunPlan(run, cfg, family, strategy, step, example)


def build_trainer(run: RunConfig, topology: Topology):
    """(Trainer, parsed strategy, model config) of a run (``plan_run``); nothing is allocated."""
    plan = plan_run(run, topology)
    return Trainer.from_plan(plan.step), plan.strategy, plan.model_cfg


def _scalar(x) -> float:
    """A replicated scalar as a Python float; works when the array spans several processes."""
    return float(np.asarray(x.addressable_data(0)))


class NothingToDo(JaxparError):
    """A resumed run whose checkpoint is already at or past ``--steps``: nothing is trained, and
    nothing in the directory is written or deleted (``jaxpar train`` says so and exits 0)."""


def check_same_function(run: RunConfig, cfg, strategy: Strategy, directory: str, meta: dict):
    """Refuse to resume a checkpoint as another function of the same weights than it was trained
    as (the arrays' shapes do not tell): another model, another config of its family
    (``Family.changed``: a BD3-LM's blocks or window), another function by a strategy
    (``changed`` of the strategies: delayed TP on or off), PipeDream's state against a synchronous
    schedule's. Reads only the checkpoint's meta."""
    where, afresh = f"checkpoint {meta['step']} in {directory}", "or choose another --checkpoint-dir to train afresh"
    if meta.get("model") != model_name(run):
        raise JaxparError(f"{where} holds model {meta.get('model')}, and this run is --model {model_name(run)}: pass --model "
                          f"{meta.get('model')} to resume it, {afresh}")
    saved, spec = meta.get("tokenizer", {"identity": corpus.BYTES, "spec": corpus.BYTES}), tokenizer_spec(run)
    if spec != saved["spec"] and corpus.load(spec).identity != saved["identity"]:
        raise JaxparError(f"{where} was trained with --tokenizer {saved['spec']} ({saved['identity'][:30]}), and this run's "
                          f"--tokenizer {spec} is another: its ids would mean other text. Pass --tokenizer "
                          f"{saved['spec']}, {afresh}")
    saved_streaming = any(path.startswith("stream/") for path in meta.get("arrays", {}))
    if saved_streaming != (run.train.schedule == "pipedream"):  # (PipeDream's state: the pipeline in flight)
        raise JaxparError(f"{where} was saved {'under' if saved_streaming else 'without'} --schedule pipedream, whose state "
                          f"holds each stage's optimizer state and the micro-batches in flight, and this run is "
                          f"--schedule {run.train.schedule}: resume it {'with' if saved_streaming else 'without'} --schedule "
                          f"pipedream, start another --checkpoint-dir from its weights with --init-from {directory} (a fresh optimizer "
                          f"state), {afresh}")
    family = family_of(cfg)
    why = family.changed(cfg, meta, {option: getattr(run, option) for option in family.options})
    why = why or parallel.changed(parse_strategy(meta["strategy"], meta["devices"]), strategy)
    if why:
        raise JaxparError(f"{where} {why}, {afresh}")


def _open_checkpoints(trainer: Trainer, checkpoint: CheckpointConfig | None, resume: str) -> Checkpointer | None:
    """The run's checkpoint directory, locked for this run whether it starts afresh or resumes (one
    writer per directory) and with room for one checkpoint, before any array is allocated."""
    if checkpoint is None:
        return None
    ckpt = Checkpointer.existing(checkpoint, writer=True) if resume == "required" else Checkpointer(checkpoint)
    try:
        ckpt.check_room(trainer.abstract_state())
    except BaseException:
        ckpt.close()
        raise
    return ckpt


def _start_state(trainer: Trainer, run: RunConfig, ckpt: Checkpointer | None, resume: str, log, check_meta, corpus_now=None):
    """(state, first step, checkpoint meta or None) of a fresh run or of the checkpoint it resumes;
    ``corpus_now``: the run's ``_data_meta`` corpus, noted where it is not the checkpoint's."""
    latest = ckpt.latest_step() if ckpt else None
    if latest is None or resume == "never":
        if latest is not None:
            raise JaxparError(
                f"checkpoint directory {ckpt.directory} already holds checkpoints {ckpt.steps()}; pass --resume to "
                "continue from the latest, or choose another --checkpoint-dir (nothing there is overwritten)"
            )
        return initial_state(trainer, run, log), 0, None
    # a damaged newest one is named and skipped; the one restored is checked against the run from
    # its meta first (check_meta: check_same_function), before any of its arrays is read
    state, meta = ckpt.restore_newest_verified(trainer.abstract_state(), log, check_meta)
    if meta["step"] >= run.steps:  # known only now: a newer checkpoint may have proved damaged
        raise NothingToDo(f"nothing to do: checkpoint {meta['step']} in {ckpt.directory} is at step {meta['step']}, and --steps "
                          f"{run.steps} asks for no more; nothing was trained or deleted: pass --steps above {meta['step']} to train on")
    saved = meta["data"]
    changed = [f"{k} {saved[k]} -> {v}" for k, v in _data_position(run, 0).items() if k != "next_step" and saved[k] != v]
    if corpus_now is not None and meta.get("corpus", corpus_now) != corpus_now:
        changed.append(f"corpus {meta['corpus']} -> {corpus_now}")
    if changed:
        log(f"note: resuming with other data settings ({', '.join(changed)}): later batches differ from the original run's")
    log(f"resuming from checkpoint {meta['step']} in {ckpt.directory} (saved under {meta['strategy']} on {meta['devices']} devices)")
    return state, meta["step"], meta


def initial_state(trainer: Trainer, run: RunConfig, log):
    """A fresh run's state: initialised by ``--seed``, or the weights of the ``--init-from``
    checkpoint (read verified, laid out as this run stores them) with a fresh optimizer state."""
    if not run.init_from:
        return trainer.init(run.seed)
    ckpt = Checkpointer.existing(CheckpointConfig(run.init_from))
    try:
        step = ckpt.latest_step()
        params = ckpt.restore_params(trainer.abstract_state().params, step)
    finally:
        ckpt.close()
    log(f"starting from the weights of checkpoint {step} in {run.init_from} ({init_meta(run)['model']})")
    return trainer.start_from(params)


def _data_position(run: RunConfig, next_step: int) -> dict:
    return {"seed": run.seed, "batch_size": run.batch_size, "seq_len": run.seq_len, "next_step": next_step}


def _data_meta(run: RunConfig, own) -> dict:
    """What a checkpoint records of the run's data: the tokenizer (its spec, identity and
    vocabulary: ``jaxpar generate`` decodes with it, a resume is checked against it) and the
    token caches the corpora were read from."""
    if own is None:
        tokenizer = corpus.load(tokenizer_spec(run))
        return {"tokenizer": {"spec": tokenizer.spec, "identity": tokenizer.identity, "vocab_size": tokenizer.vocab_size},
                "corpus": "built-in"}
    tokenizer = own[0].tokenizer
    return {"tokenizer": {"spec": os.path.abspath(tokenizer.spec) if tokenizer.kind != corpus.BYTES else corpus.BYTES,
                          "identity": tokenizer.identity, "vocab_size": tokenizer.vocab_size},
            "corpus": [os.path.basename(part.record["directory"]) for part in own]}


def rows_at(run: RunConfig, cfg):
    """``rows(corpus, step, first, stop)``: rows [first, stop) of the run's batch at ``step``, on the
    host, as its data settings make them (``corpus``: the token stream, or its documents under
    ``--packing``)."""
    if run.packing:  # whole documents packed into rows
        make = data.packed_batch_at
    elif family_of(cfg).rows is not None:  # windows of the token stream made into the family's rows (BD3-LM: corrupted)
        make = functools.partial(data.family_batch_at, family=family_of(cfg), cfg=cfg)
    else:  # random windows of the token stream
        make = data.local_batch_at
    return lambda corpus, step, first, stop: make(corpus, step, run.batch_size, run.seq_len, run.seed, first, stop)


def _own_rows(run: RunConfig, cfg, train: corpus.Corpus, held: corpus.Corpus):
    """(training reader, held-out reader, rows(reader, step, first, stop)) of ``--data``: Grain's
    windows or packed rows (``corpus.pipeline``), made into the family's rows where it has its own."""
    kind = corpus.PackedRows if run.packing else corpus.Windows
    held_words = "the held-out text (--eval-data)" if run.eval_data else f"the held-out text (--eval-fraction {run.eval_fraction} of --data)"
    readers = [kind(part, run.seq_len, run.batch_size, run.seed, what) for part, what in ((train, "--data"), (held, held_words))]
    family = family_of(cfg)
    if family.rows is not None:
        return (*readers, lambda reader, step, a, b: family.rows(cfg, reader.rows(step, a, b)[:, :run.seq_len], run.seed, step, a))
    return (*readers, lambda reader, step, a, b: reader.rows(step, a, b))


def batch_source(run: RunConfig, trainer: Trainer, cfg, tokens, held_out, own=None):
    """(training corpus, held-out corpus, batch_of(corpus, step)) as the run's data settings say
    (``own``: the (training, held-out) corpora of ``--data``)."""
    if own is not None:
        train, held, rows = _own_rows(run, cfg, *own)
    else:
        train, held = (data.documents(tokens), data.documents(held_out)) if run.packing else (tokens, held_out)
        rows = rows_at(run, cfg)
    batch_of = lambda corpus, step: trainer.put_process_batch(  # noqa: E731
        run.batch_size, lambda a, b: rows(corpus, step, a, b)
    )
    return train, held, batch_of


def first_batch(run: RunConfig, cfg, log=lambda message: None):
    """The run's batch at step 0, whole, on the host, as ``run_training`` reads it (``jaxpar check``'s)."""
    own = open_data(run, log)
    if own is not None:
        train, _, rows = _own_rows(run, cfg, *own)
        return rows(train, 0, 0, run.batch_size)
    tokens = data.split_corpus(data.corpus_tokens())[0]
    return rows_at(run, cfg)(data.documents(tokens) if run.packing else tokens, 0, 0, run.batch_size)


@dataclasses.dataclass
class _Steps:
    """What the training loop did: the job's figures per step (a resumed run's start with the
    checkpoint's), where it stopped and why."""

    losses: list
    grad_norms: list
    times: list
    done: int  # steps of the job completed
    first_loss_step: int  # losses[i] (and grad_norms, times) is step first_loss_step + i
    save_pauses: list = dataclasses.field(default_factory=list)  # training waited this long for each save to start
    nonfinite: dict | None = None  # the first step whose loss or gradient norm is NaN or infinite
    skipped: list = dataclasses.field(default_factory=list)  # steps whose update was dropped (not finite)
    interrupted: str | None = None  # "SIGINT" or "SIGTERM"
    held_out: list = dataclasses.field(default_factory=list)  # [step, held-out loss] every --eval-every steps


def run_training(
    run: RunConfig, topology: Topology, progress=sys.stderr,
    checkpoint: CheckpointConfig | None = None, resume: str = "never", catch_signals: bool = True,
    analyze=None, on_start=None, record: dict | None = None,
) -> dict:
    """Train and return the report (per-step losses and times, throughput, checkpoints).

    ``analyze(trainer, compiled_step, strategy, model_cfg, (batch_size, seq_len))``, when given,
    returns more fields for the report, read off the compiled step after training
    (``jaxpar.report.step_report``: memory and communication, as ``jaxpar train`` reports them).
    ``on_start()``, when given, is called once the state is made (initialised or restored), before
    the step is compiled (``jaxpar train`` writes a partial metrics file there).

    With ``checkpoint``, the state is saved every ``checkpoint.every`` steps and after the last;
    ``resume`` is ``never`` (the directory must hold no checkpoint), ``auto`` (continue from the
    latest complete checkpoint if there is one) or ``required`` (there must be one). Either way the
    run takes the directory's lock first. A checkpoint trained as another function (``check_same_function``)
    is refused before its arrays are read; one already at ``run.steps`` raises ``NothingToDo`` once
    it is verified, before anything is deleted. A resumed run's report holds every step of the job: the checkpoint keeps the earlier steps' figures.

    With ``catch_signals`` (and one process, called from the main thread), SIGINT and SIGTERM
    stop training after the step in progress: the state is saved (with ``checkpoint``) and the
    report says ``interrupted``: "SIGINT" or "SIGTERM" (the held-out loss is then not computed).
    A multi-process job is not stopped this way: its processes would stop at different steps and
    wait for each other; it resumes from its last periodic checkpoint. In a multi-process job every
    process calls this; only process 0 prints.

    ``record``: the run's resolved options (``runfile.resolved``, with their ``recorded`` table),
    kept in every checkpoint's meta: ``jaxpar train --config CHECKPOINT_DIR`` repeats the run."""
    check_run(run, checkpoint, resume)
    lead = jax.process_index() == 0
    log = (lambda msg: print(msg, file=progress, flush=True)) if (progress and lead) else (lambda msg: None)
    plan = plan_run(run, topology)
    trainer, strategy, cfg, family = Trainer.from_plan(plan.step), plan.strategy, plan.model_cfg, plan.family
    own = open_data(run, log)
    tokens, held_out = data.split_corpus(data.corpus_tokens()) if own is None else (None, None)
    if own is None and run.seq_len >= len(held_out):
        raise JaxparError(f"--seq-len {run.seq_len} is longer than the held-out text ({len(held_out)} tokens); use a shorter one")
    train, held, batch_of = batch_source(run, trainer, cfg, tokens, held_out, own)  # too little text is refused here, before any work
    ckpt, board = _open_checkpoints(trainer, checkpoint, resume), None
    try:
        if ckpt is not None and own is not None:  # its checkpoints are read with it (jaxpar generate)
            corpus.keep(own[0].tokenizer, ckpt.directory)
        check_meta = functools.partial(check_same_function, run, cfg, strategy, ckpt.directory) if ckpt else None
        data_meta = _data_meta(run, own)
        state, start, resumed = _start_state(trainer, run, ckpt, resume, log, check_meta, data_meta["corpus"])
        if on_start is not None:
            on_start()
        with scalars.working("compiling the step", progress if lead else None):
            compiled = trainer.jit_step(plan.example).lower(state, plan.example).compile()
        meta = {"model": model_name(run), "strategy": str(strategy), "topology": topology.name, "devices": trainer.layout.mesh.size,
                "processes": jax.process_count()}
        meta.update(family.meta(cfg), **config_record(cfg))  # what the sampler and a resume read (a BD3-LM's blocks and window)
        meta.update(data_meta, **({"run": record} if record is not None else {}))
        board = scalars.TensorBoard(run.tensorboard) if (run.tensorboard and lead) else None
        figures = _figures(run, trainer, cfg, topology, board) if board else None
        evaluate = _evaluator(trainer, plan.example, state, batch_of(held, 0), progress if lead else None) if run.eval_every else None
        state, steps = _train_steps(run, trainer, compiled, state, start, resumed, lambda step: batch_of(train, step), ckpt, meta,
                                    progress if lead else None, catch_signals, figures, evaluate)
    except BaseException:
        if ckpt is not None:  # the lock goes (a save that failed was reported already)
            with contextlib.suppress(Exception):
                ckpt.close()
        if board is not None:  # what was written stays readable
            board.close()
        raise
    report_progress("evaluating", steps.done)
    held_out_loss, batch_report = _at_the_end(trainer, family, compiled, state, steps, batch_of(held, 0), evaluate)
    if board:
        if not steps.held_out or steps.held_out[-1][0] != steps.done:  # (--eval-every wrote this step's already)
            board.add(steps.done, {"eval/held_out_loss": held_out_loss})
        board.close()
    model_length = family.reads(run.seq_len)  # a block diffusion model reads [x_t ; x_0]
    analysis = dict(analyze(trainer, compiled, strategy, cfg, (run.batch_size, model_length)) if analyze else {}, **batch_report)
    if trainer.pipedream is not None:  # the staleness each stage trained with
        analysis["pipedream"] = trainer.pipedream.report(state)
    return _report(run, topology, trainer, strategy, cfg, start, steps, held_out_loss, model_length, analysis, ckpt)


def _at_the_end(trainer: Trainer, family, compiled, state, steps: _Steps, batch, evaluate=None) -> tuple[float | None, dict]:
    """(held-out loss on ``batch``, the family's batch report) after training; (None, {}) when
    the run was interrupted, which stops without the evaluation."""
    if steps.interrupted:
        return None, {}
    report = {}
    if family.batch_report is not None:  # (before the held-out step, which consumes the state)
        split = math.prod(trainer.layout.mesh.shape[a] for a in trainer.layout.axes_of("experts"))
        # the batch from the host: the forward runs as XLA partitions it from the weights' layout
        report["batch_report"] = family.batch_report(trainer.merge(state.params), jax.device_get(batch), split)
    if trainer.pipedream is not None:  # its step's loss is that of the micro-batches in flight, at stale weights
        return (evaluate(state.params) if evaluate else _scalar(trainer.jit_loss(batch)(state.params, batch))), report
    # the compiled step's loss is the loss at the weights it is given (before its update): one
    # more call of it on a held-out batch, whose updated state is dropped, costs no compile
    return _scalar(compiled(state, batch)[1]["loss"]), report


def _evaluator(trainer: Trainer, example, state, batch, progress):
    """``evaluate(params)``: the held-out loss on ``batch`` (one compile, made here, before training)."""
    with scalars.working("compiling the held-out loss", progress):
        compiled = trainer.jit_loss(example).lower(state.params, batch).compile()
    return lambda params: _scalar(compiled(params, batch))


def _train_steps(run: RunConfig, trainer: Trainer, compiled, state, start: int, resumed: dict | None, batch_at, ckpt,
                 meta: dict, progress, catch_signals: bool, figures=None, evaluate=None):
    """(state, _Steps): the steps from ``start`` to ``run.steps``, saving as ``ckpt`` says, stopped
    at a step boundary by SIGINT or SIGTERM (``StopSignals``) or by a non-finite step;
    ``figures(step, loss, gradient norm, seconds, held-out loss or None)`` after each
    (``--tensorboard``); ``evaluate(params)`` every ``run.eval_every`` steps."""
    history = (resumed or {}).get("history", {"losses": [], "grad_norms": [], "step_times_s": []})  # checkpoints saved before they were kept hold none
    steps = _Steps(*(list(history[k]) for k in ("losses", "grad_norms", "step_times_s")), done=start,
                   first_loss_step=start - len(history["losses"]) + 1, held_out=list(history.get("held_out", [])))
    bar = scalars.Progress(start, run.steps, progress) if (progress and start < run.steps) else None
    catch = catch_signals and jax.process_count() == 1 and threading.current_thread() is threading.main_thread()
    with StopSignals(catch) as stop:
        for step in range(start, run.steps):
            batch = batch_at(step)
            report_progress("start", step + 1)  # from here on, this process waits for the others in collectives
            began = time.perf_counter()
            try:
                state, metrics = compiled(state, batch)
                loss = _scalar(metrics["loss"])  # waits for the step: the time below is the step's own
                grad_norm = _scalar(metrics["grad_norm"])
            except jax.errors.JaxRuntimeError as err:
                if jax.process_count() == 1:
                    raise
                raise JobFailed(
                    f"step {step + 1} failed in a collective: another process of the job has probably died or hung "
                    f"({str(err).splitlines()[0]}); restart the job from the last checkpoint with --resume"
                ) from err
            steps.times.append(time.perf_counter() - began)
            steps.losses.append(loss)
            steps.grad_norms.append(grad_norm)
            steps.done = done = step + 1
            if not (np.isfinite(loss) and np.isfinite(grad_norm)):  # the step left the state as it was
                steps.skipped.append(done)
                if steps.nonfinite is None:
                    steps.nonfinite = {"step": done, "loss": loss, "grad_norm": grad_norm,
                                       "cause": parallel.nonfinite_cause(trainer.layout)}
                    if progress:
                        print(nonfinite_message(**steps.nonfinite), file=progress, flush=True)  # at once: the summary comes only at the end
                if trainer.cfg.nonfinite == "stop":
                    break  # the report says where and why; the CLI exits 1
            report_progress("done", done)
            held_out = evaluate(state.params) if evaluate and done % run.eval_every == 0 else None
            if held_out is not None:
                steps.held_out.append([done, held_out])
            if bar:
                bar.update(done, f"loss {loss:.3f} {run.batch_size * run.seq_len / steps.times[-1]:,.0f} tok/s"
                           + (f" held-out {held_out:.3f}" if held_out is not None else ""), always=held_out is not None)
            if figures:
                figures(done, loss, grad_norm, steps.times[-1], held_out)
            if ckpt and (ckpt.should_save(done, run.steps) or stop.name):
                report_progress("saving", done)  # a save under load can outlast a short --hang-timeout
                began = time.perf_counter()
                so_far = {"losses": list(steps.losses), "grad_norms": list(steps.grad_norms), "step_times_s": list(steps.times),
                          "held_out": list(steps.held_out)}  # copies: saving goes on behind
                ckpt.save(done, state, dict(meta, data=_data_position(run, done), history=so_far))
                steps.save_pauses.append(time.perf_counter() - began)  # training waits this long; the writing goes on behind
            if stop.name:
                break
        if bar:
            bar.close()
        if ckpt:  # still under the handlers: a signal now does not cut the last save short
            ckpt.wait()
            ckpt.close()
    steps.interrupted = stop.name
    return state, steps


def _figures(run: RunConfig, trainer: Trainer, cfg, topology: Topology, board: scalars.TensorBoard):
    """``_train_steps``'s ``figures`` for ``--tensorboard``: a step's scalars into ``board``."""
    rate = learning_rate_schedule(trainer.cfg)
    length = family_of(cfg).reads(run.seq_len)
    flops = cfg.flops_per_token(length) * run.batch_size * length
    peak = topology.peak_bf16_flops * trainer.layout.mesh.size

    def add(step: int, loss: float, grad_norm: float, seconds: float, held_out: float | None = None):
        memory = jax.local_devices()[0].memory_stats() or {}  # none on the CPU
        board.add(step, {"train/loss": loss, "eval/held_out_loss": held_out, "train/grad_norm": grad_norm,
                         "train/learning_rate": float(rate(step - 1)),
                         "speed/tokens_per_s": run.batch_size * run.seq_len / seconds,
                         "speed/mfu_estimate": flops / seconds / peak if peak else None,
                         "memory/bytes_in_use": memory.get("bytes_in_use"), "memory/peak_bytes_in_use": memory.get("peak_bytes_in_use")})

    return add


def _report(run: RunConfig, topology: Topology, trainer: Trainer, strategy: Strategy, cfg, start: int, steps: _Steps,
            held_out_loss, model_length: int, analysis: dict, ckpt) -> dict:
    """The run's report (``run_training``)."""
    steady = steps.times[1:] or steps.times or [float("nan")]
    flops = cfg.flops_per_token(model_length) * run.batch_size * model_length
    return {
        "model": model_name(run),
        "num_params": cfg.num_params(),
        "topology": topology.name,
        "strategy": str(strategy),
        "mesh": {k: v for k, v in trainer.layout.mesh.shape.items()},
        "processes": jax.process_count(),
        "steps": run.steps,
        "start_step": start,
        "last_step": steps.done,
        "interrupted": steps.interrupted,
        "first_loss_step": steps.first_loss_step,  # losses[i] (and grad_norms, step_times_s) is step first_loss_step + i
        "batch_size": run.batch_size,
        "seq_len": run.seq_len,
        "seed": run.seed,
        "losses": steps.losses,
        "grad_norms": steps.grad_norms,
        "nonfinite": steps.nonfinite,
        "skipped_steps": steps.skipped,
        "path": {"name": trainer.plan.path, "reason": trainer.plan.path_reason},
        "fsdp_policy": {"regather": trainer.plan.regather, "reason": trainer.plan.regather_reason},
        "grad_sync": _grad_sync_report(trainer),
        "step_times_s": steps.times,
        "held_out_loss": held_out_loss,
        "held_out_losses": steps.held_out,  # [step, loss] every --eval-every steps
        "tokens_per_s": run.batch_size * run.seq_len / float(np.median(steady)),
        "model_flops_per_s": flops / float(np.median(steady)),
        **analysis,
        "checkpoints": {"directory": ckpt.directory, "steps": ckpt.steps(), "save_pause_s": steps.save_pauses} if ckpt else None,
    }


class StopSignals:
    """While active, SIGINT and SIGTERM do not kill the process: ``name`` records the first one
    ("SIGINT" or "SIGTERM") for the training loop to stop at the next step boundary. That first
    signal puts the previous handlers back, so a second one acts at once as it would have."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, active: bool = True):
        self.active, self.name, self.previous = active, None, {}

    def __enter__(self):
        if self.active:
            self.previous = {sig: signal.signal(sig, self._caught) for sig in self.SIGNALS}
        return self

    def _caught(self, signum, frame):
        self.name = signal.Signals(signum).name
        self._restore()

    def _restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}

    def __exit__(self, *exc):
        self._restore()


def interruption_message(report: dict) -> str:
    """The one-line summary of an interrupted run: where it stopped and how to go on."""
    where = f"interrupted by {report['interrupted']} after step {report['last_step']} of {report['steps']}"
    saved = report["checkpoints"]
    if saved and report["last_step"] in saved["steps"]:
        return f"{where}; checkpoint {report['last_step']} saved in {saved['directory']}; resume with --resume"
    return f"{where}; no checkpoint saved (with --checkpoint-dir a run can be resumed)"


def _grad_sync_report(trainer: Trainer) -> dict:
    sync = trainer.plan.grad_sync
    if sync is None:
        return {"name": "exact", "axes": [], "bits": None}
    return {"name": sync.name, "axes": list(sync.axes), "bits": sync.bits}


def write_json_atomically(path: str, payload: dict):
    """``write_text_atomically`` of ``payload`` as JSON."""
    write_text_atomically(path, json.dumps(payload, indent=1, default=float))


def write_text_atomically(path: str, text: str):
    """Write to a temporary file next to ``path`` and rename it: never a half-written file. The
    file gets the permissions any new file of the user gets (``open`` applies the umask). A write
    that fails (a full disk) raises ``JobFailed`` with the reason, and leaves nothing behind; a
    previous file at ``path`` is then left as it was. SIGINT and SIGTERM wait for the rename (the
    command line ends the process at once on them, which would leave the temporary file behind)."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    with StopSignals(threading.current_thread() is threading.main_thread()) as held:
        try:
            os.makedirs(directory, exist_ok=True)
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        except OSError as err:
            fix = "free some space there or choose another path" if err.errno == errno.ENOSPC else "choose another path"
            raise JobFailed(f"could not write {path} ({err.strerror or err}); {fix}") from None
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # gone already when the rename succeeded
    if held.name:  # now do what the signal would have done
        signal.raise_signal(getattr(signal, held.name))
