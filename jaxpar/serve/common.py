"""What jaxpar's samplers share: argument checks, the rule that picks an id from logits, the
weights placed as a layout computes with them (nothing to gather per step when serving; rows padded
to whole rows per data shard; an axis that would only copy work refused), and reading them from a
``jaxpar train`` directory (the newest checkpoint that verifies, or the one asked for)."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.errors import JaxparError
from jaxpar import corpus, models
from jaxpar.models import config_of, family_of, model_and_loss
from jaxpar.parallel import compiler_options, serves_manually
from jaxpar.rules import Layout, logical_names, use_layout
from jaxpar.train import checkpoint as checkpoint_lib
from jaxpar.train.state import abstract_model

BYTE_VOCAB = 256  # the main job's tokens are UTF-8 bytes (train/data.py)
# the families serving has a decoder for (serve/llama.py, serve/bd3lm.py), and whether it runs
# many positions in one step (a BD3-LM denoises a block of them), which a layout may split over
# context or block devices; a Llama decodes one token a step
SPLITS_LENGTH = {"llama": False, "bd3lm": True, "moe": False}
NEXT_TOKEN = ("llama", "moe")  # the families the Llama decoder (serve/llama.py) generates from


def check_decoder(family: str, model: str) -> None:
    """Refuse, in words, a model of a family serving has no decoder for."""
    if family not in SPLITS_LENGTH:
        raise JaxparError(f"model {model} is a {family_words(family)}, which jaxpar generate has no decoder for (it has one "
                          f"for {', '.join(family_words(f) + 's' for f in SPLITS_LENGTH)}); evaluate it with jaxpar check instead")


def family_words(name: str) -> str:
    """What messages call one model of the registered family ``name`` ("Llama")."""
    return models.FAMILIES[name].words


def is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def is_real(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) and math.isfinite(x)


def check_pick(temperature, top_p) -> None:
    """Refuse a ``temperature`` or ``top_p`` that ``pick`` cannot use, with the range it must lie in."""
    if not is_real(temperature) or temperature < 0:
        raise JaxparError(f"temperature={temperature!r} must be a finite number >= 0 (0: greedy, the most probable id)")
    if not is_real(top_p) or not 0 < top_p <= 1:
        raise JaxparError(f"top_p={top_p!r} must lie in (0, 1] (1: sample from the whole distribution)")
    # refused rather than ignored: greedy picks the most probable id, which every nucleus holds, so
    # the text would be greedy's while the caller believes it sampled
    if temperature == 0 and top_p < 1:
        raise JaxparError(f"top_p={top_p!r} does nothing at temperature=0 (greedy decoding takes the most probable id, which "
                          f"every nucleus holds): give a temperature above 0 to sample from the nucleus, or drop top_p")


def pick(logits, temperature: float, top_p: float, key):
    """Each position's id: the argmax, or a sample at ``temperature`` from the top-p nucleus."""
    if temperature == 0:
        return jnp.argmax(logits, -1).astype(jnp.int32)
    scaled = logits / temperature
    if top_p < 1:
        probs = jax.nn.softmax(scaled, -1)
        descending = -jnp.sort(-probs, -1)
        ahead = jnp.cumsum(descending, -1) - descending  # the probability of the ids more probable than each
        least_kept = jnp.min(jnp.where(ahead < top_p, descending, jnp.inf), -1, keepdims=True)  # the most probable always
        scaled = jnp.where(probs >= least_kept, scaled, -jnp.inf)
    return jax.random.categorical(key, scaled, -1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class ServePlan:
    """Serving's decisions under a layout (``plan_serving``), made before any weight is placed."""

    layout: Layout | None  # None: one device
    family: str
    manual: bool  # run inside one shard_map, jaxpar's own collectives placing them (delayed TP)
    compiler_options: dict | None


def plan_serving(layout: Layout | None, state, family: str) -> ServePlan:
    """The plan of serving a model of ``family`` (weights ``state``, abstract or not) under
    ``layout``: a mesh axis that would only copy work is refused (``check_layout``), and the
    strategies say whether it runs inside one shard_map and with which compile options."""
    check_layout(layout, state, family)
    return ServePlan(layout, family, serves_manually(layout), compiler_options(layout))


class Served:
    """A model's weights placed for serving under ``layout`` (default: one device, as they are),
    and the compiled programs of a subclass's ``_name`` methods (``_program``): partitioned by XLA,
    or, where the plan is ``manual`` (a layout only jaxpar's own collectives can run: delayed TP),
    run inside one ``shard_map`` over the layout's mesh with the model's ``jaxpar.nn`` calls
    placing them."""

    DONATES: dict = {}  # program name -> the arguments it consumes (a cache it returns updated)
    family = ""  # a key of models.FAMILIES (a subclass's)

    def __init__(self, model, layout: Layout | None, vocab, model_vocab: int, vocab_name: str):
        self.vocab = model_vocab if vocab is None else vocab
        if not is_int(self.vocab) or not 0 < self.vocab <= model_vocab:
            raise JaxparError(f"vocab={vocab!r} must be an int in [1, {vocab_name}={model_vocab}]: the ids it may produce")
        self.layout = layout
        self._graphdef, state = nnx.split(model)
        self.plan = plan_serving(layout, state, self.family)
        if layout is not None:
            state = map_weights(lambda var: jax.device_put(var.get_value(), compute_sharding(var, layout)), state)
        self._template = state
        self.params = nnx.to_pure_dict(state)
        self._programs: dict = {}

    def _program(self, name: str, *static):
        """The jitted method ``_name`` with its leading ``static`` arguments bound."""
        key = (name, *static)
        if key not in self._programs:
            fn = functools.partial(getattr(self, "_" + name), *static)
            if self.plan.manual:
                fn = self._in_shard_map(fn, *self._specs(name))
            self._programs[key] = jax.jit(fn, donate_argnums=self.DONATES.get(name, ()),
                                          compiler_options=self.plan.compiler_options)
        return self._programs[key]

    def _specs(self, name: str):
        """(in_specs, out_specs) of program ``name`` inside the manual shard_map (a subclass's)."""
        raise NotImplementedError(f"{type(self).__name__} has no manual programs")

    def _in_shard_map(self, fn, in_specs, out_specs):
        layout = self.layout

        def local(*args):
            with use_layout(layout, manual=True):
                return fn(*args)

        return jax.shard_map(local, mesh=layout.mesh, in_specs=in_specs, out_specs=out_specs)

    @property
    def param_specs(self):
        """Each weight's PartitionSpec as it is placed (the manual programs' in_specs)."""
        return jax.tree.map(lambda a: a.sharding.spec, self.params)

    def _model(self, params):
        state = jax.tree.map(lambda v: v, self._template)  # a copy: the template keeps its own arrays
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self._graphdef, state)


def compute_sharding(var, layout: Layout):
    """Where a weight lives under ``layout`` when serving: as the layout computes with it (nothing
    to gather per step)."""
    value = var.get_value()
    names = layout.effective_names(logical_names(var) or (None,) * value.ndim, value.shape)
    names = tuple(None if n == "layers" else n for n in names)  # the layer stack is read one layer at a time
    return layout.sharding(names, "compute", value.shape)


def map_weights(fn, state):
    """``state`` with each weight's value replaced by ``fn(variable)``."""
    return jax.tree.map(lambda var: var.replace(value=fn(var)), state, is_leaf=lambda v: isinstance(v, nnx.Variable))


def check_layout(layout: Layout | None, state, family: str) -> None:
    """Refuse a mesh axis that serving would only copy work over: one that splits no weight of
    ``state`` (abstract or not), not the rows and, for a family that runs one position a step (a
    Llama), not the sequence either."""
    if layout is None:
        return
    used = set(layout.batch_axes) | (set(layout.axes_of("length")) if SPLITS_LENGTH[family] else set())
    for var in jax.tree.leaves(state, is_leaf=lambda v: isinstance(v, nnx.Variable)):
        for entry in compute_sharding(var, layout).spec:
            used.update((entry,) if isinstance(entry, str) else entry or ())
    idle = [(axis, n) for axis, n in layout.mesh.shape.items() if n > 1 and axis not in used]
    if not idle:
        return
    axis, n = idle[0]
    why = (f"a {family_words(family)} decodes one token a step, which cannot be split over devices" if axis in layout.axes_of("length")
           else f"it splits no weight of the model and not the rows, so its {n} devices would each compute the same")
    raise JaxparError(f"{axis}={n} cannot serve: {why}; use tensor (the weights) or data (the rows) instead")


def pad_rows(rows: int, layout: Layout | None) -> int:
    """How many rows to add to ``rows`` so that each data shard of ``layout`` gets whole rows (the
    samplers add copies of the first and drop their outputs)."""
    return 0 if layout is None else -rows % layout.batch_shards


# --- from a checkpoint of the main job -------------------------------------------------------------


def open_checkpoints(checkpoint_dir: str) -> checkpoint_lib.Checkpointer:
    """The checkpoints of a ``jaxpar train --checkpoint-dir``, opened to read (no lock taken);
    a path that is no such directory, or one that holds no complete checkpoint, is refused in words."""
    where, fix = f"--checkpoint-dir {checkpoint_dir!r}", "point it at a directory `jaxpar train --checkpoint-dir` saved into"
    if not os.path.exists(checkpoint_dir):
        raise JaxparError(f"{where} does not exist; {fix}")
    if not os.path.isdir(checkpoint_dir):
        raise JaxparError(f"{where} is a file, not a checkpoint directory; {fix}")
    ckpt = checkpoint_lib.Checkpointer(checkpoint_lib.CheckpointConfig(checkpoint_dir), create=False, writer=False)
    if not ckpt.steps():
        ckpt.close()
        partial = sorted(n for n in os.listdir(checkpoint_dir) if "tmp" in n or checkpoint_lib.DAMAGED_SUFFIX in n)
        what = f"only interrupted or damaged saves ({', '.join(partial)})" if partial else "no checkpoint"
        raise JaxparError(f"{where} holds {what}; train into it first, or {fix}")
    return ckpt


def _steps_to_try(ckpt, checkpoint_dir: str, step: int | None) -> list[int]:
    """``step``, refused in words if the directory lacks it; default every step, newest first."""
    steps = ckpt.steps()
    if step is None:
        return steps[::-1]
    if step not in steps:
        raise JaxparError(f"--step {step}: {checkpoint_dir!r} holds no checkpoint {step}; it holds "
                          f"{', '.join(map(str, steps))}: choose one of those")
    return [step]


def checkpoint_family(checkpoint_dir: str, step: int | None = None) -> str:
    """The model family (``llama``, ``bd3lm``) of checkpoint ``step`` (default: the newest whose
    meta reads) of a ``jaxpar train`` directory, from its meta alone."""
    ckpt = open_checkpoints(checkpoint_dir)
    try:
        for candidate in _steps_to_try(ckpt, checkpoint_dir, step):
            try:
                meta = ckpt.read_meta(candidate)
                family = family_of(config_of(meta)).name
                check_decoder(family, meta["model"])
                return family
            except checkpoint_lib.CheckpointDamaged:
                if step is not None or candidate == ckpt.steps()[0]:
                    raise
    finally:
        ckpt.close()


def restore_model(checkpoint_dir: str, family: str, *, layout: Layout | None = None, step: int | None = None, check_meta=None):
    """(model, meta) of a ``jaxpar train`` checkpoint of a model of ``family``
    (``models.FAMILIES``' names: llama, bd3lm): checkpoint ``step``, or by default the newest that
    verifies (a newer damaged one is named in a warning, and left where it is). Only the
    TrainState's parameters are read, straight into ``layout``'s compute shardings (default: the
    first device), and checked against their saved checksums. ``check_meta(meta, cfg)`` may
    refuse the request from the checkpoint's meta before any array is read."""
    ckpt, damaged = open_checkpoints(checkpoint_dir), []
    try:
        for candidate in _steps_to_try(ckpt, checkpoint_dir, step):
            try:
                model, meta = _restore_step(ckpt, checkpoint_dir, candidate, family, layout, check_meta)
                break
            except checkpoint_lib.CheckpointDamaged as err:
                if step is not None:  # the one asked for: no other
                    others = [str(s) for s in ckpt.steps() if s != step]
                    raise JaxparError(f"{err}; choose another with --step ({', '.join(others) or 'none'})") from None
                damaged.append(err)
        else:
            raise JaxparError(f"no checkpoint in {checkpoint_dir!r} verifies: {'; '.join(map(str, damaged))}; train again, or "
                              f"restore the directory from a copy")
    finally:
        ckpt.close()
    if damaged:
        gist = "; ".join(f"checkpoint {d.step} is damaged ({d.reason.split(' (')[0]})" for d in damaged)  # the rest: jaxpar checkpoints
        warnings.warn(f"{gist}: read checkpoint {meta['step']} instead, the newest that verifies (--step N chooses one; "
                      f"`jaxpar checkpoints {checkpoint_dir}` lists them)", stacklevel=2)
    return model, meta


def _restore_step(ckpt, checkpoint_dir: str, step: int, family: str, layout: Layout | None, check_meta):
    """``restore_model`` of one step; raises CheckpointDamaged naming what is damaged."""
    meta = ckpt.read_meta(step)
    cfg = config_of(meta)
    cfg = family_of(cfg).saved(cfg, meta)
    if family_of(cfg).name != family:
        raise JaxparError(f"checkpoint {step} in {checkpoint_dir!r} holds {meta['model']!r}, a {family_of(cfg).words}; "
                          f"this generates from {family_words(family)}s")
    if check_meta is not None:
        check_meta(meta, cfg)
    graphdef, abstract = abstract_model(model_and_loss(cfg)[0])
    check_layout(layout, abstract, family)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    where = (lambda var: one) if layout is None else (lambda var: compute_sharding(var, layout))
    shapes = map_weights(lambda var: jax.ShapeDtypeStruct(var.get_value().shape, var.get_value().dtype, sharding=where(var)), abstract)
    restored = ckpt.restore_params(nnx.to_pure_dict(shapes), step)
    state = jax.tree.map(lambda v: v, abstract)
    nnx.replace_by_pure_dict(state, restored)
    return nnx.merge(graphdef, state), meta


def encode_text(text: str) -> np.ndarray:
    """The main job's tokens of ``text``: its UTF-8 bytes, int32 (length,)."""
    return np.asarray(corpus.load(corpus.BYTES).encode(text), np.int32)


def decode_tokens(tokens) -> str:
    """Byte tokens as text (UTF-8; a byte sequence that is not valid UTF-8 becomes U+FFFD)."""
    return corpus.load(corpus.BYTES).decode(tokens)


@dataclasses.dataclass(frozen=True)
class Generated:
    text: str  # the prompt and its continuation, decoded together
    continuation: str  # the generated bytes alone, decoded
    tokens: np.ndarray  # int32 (length,): the prompt's bytes, then the generated ones (whole blocks)
    prompt_tokens: int  # how many of ``tokens`` are the prompt's
    model: str  # the checkpoint's model name
    step: int  # the checkpoint's step
