"""What jaxpar's samplers share: argument checks, the rule that picks an id from logits, and the
weights placed as a layout computes with them (nothing to gather per step when serving)."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from jaxpar.errors import JaxparError
from jaxpar.models import model_and_loss, model_config, model_family
from jaxpar.parallel import delayed
from jaxpar.rules import Layout, logical_names, use_layout
from jaxpar.train import checkpoint as checkpoint_lib
from jaxpar.train.state import abstract_model

BYTE_VOCAB = 256  # the main job's tokens are UTF-8 bytes (train/data.py)
FAMILIES = {"llama": "Llama", "bd3lm": "block diffusion model"}  # models.model_family's names, in words


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


class Served:
    """A model's weights placed for serving under ``layout`` (default: one device, as they are),
    and the compiled programs of a subclass's ``_name`` methods (``_program``): partitioned by XLA,
    or, where ``manual`` (a layout only jaxpar's own collectives can run: delayed TP), run inside
    one ``shard_map`` over the layout's mesh with the model's ``jaxpar.nn`` calls placing them."""

    DONATES: dict = {}  # program name -> the arguments it consumes (a cache it returns updated)
    manual = False

    def __init__(self, model, layout: Layout | None, vocab, model_vocab: int, vocab_name: str):
        self.vocab = model_vocab if vocab is None else vocab
        if not is_int(self.vocab) or not 0 < self.vocab <= model_vocab:
            raise JaxparError(f"vocab={vocab!r} must be an int in [1, {vocab_name}={model_vocab}]: the ids it may produce")
        self.layout = layout
        self._graphdef, state = nnx.split(model)
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
            if self.manual:
                fn = self._in_shard_map(fn, *self._specs(name))
            self._programs[key] = jax.jit(fn, donate_argnums=self.DONATES.get(name, ()),
                                          compiler_options=delayed.compiler_options(self.layout))
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


# --- from a checkpoint of the main job -------------------------------------------------------------


def checkpoint_family(checkpoint_dir: str) -> str:
    """The model family (``llama``, ``bd3lm``) of the newest ``jaxpar train`` checkpoint in
    ``checkpoint_dir``, from its meta alone."""
    ckpt = checkpoint_lib.Checkpointer.existing(checkpoint_lib.CheckpointConfig(checkpoint_dir))
    try:
        return model_family(model_config(ckpt.read_meta(ckpt.latest_step())["model"]))
    finally:
        ckpt.close()


def restore_model(checkpoint_dir: str, family: str, *, layout: Layout | None = None, step: int | None = None, check_meta=None):
    """(model, meta) of a ``jaxpar train`` checkpoint (default: the newest) of a model of
    ``family`` (``models.model_family``: llama, bd3lm): only the TrainState's parameters are
    read, straight into ``layout``'s compute shardings (default: the first device), and checked
    against their saved checksums (``CheckpointDamaged`` names a damaged array).
    ``check_meta(meta, cfg)`` may refuse the request from the checkpoint's meta before any array
    is read."""
    ckpt = checkpoint_lib.Checkpointer.existing(checkpoint_lib.CheckpointConfig(checkpoint_dir))
    try:
        step = ckpt.latest_step() if step is None else step
        if step not in ckpt.steps():
            raise JaxparError(f"checkpoint directory {checkpoint_dir!r} holds no checkpoint {step}; it holds {ckpt.steps()}")
        meta = ckpt.read_meta(step)
        cfg = model_config(meta["model"])
        if model_family(cfg) != family:
            raise JaxparError(f"checkpoint {step} in {checkpoint_dir!r} holds {meta['model']!r}, a {FAMILIES[model_family(cfg)]}; "
                              f"this generates from {FAMILIES[family]}s")
        if check_meta is not None:
            check_meta(meta, cfg)
        graphdef, abstract = abstract_model(model_and_loss(cfg)[0])
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        where = (lambda var: one) if layout is None else (lambda var: compute_sharding(var, layout))
        shapes = map_weights(lambda var: jax.ShapeDtypeStruct(var.get_value().shape, var.get_value().dtype, sharding=where(var)), abstract)
        item = {"params": nnx.to_pure_dict(shapes)}
        saved = {path: sig for path, sig in meta["arrays"].items() if path.startswith("params/")}
        problem = checkpoint_lib.describe_mismatch(saved, checkpoint_lib.array_signature(item))
        if problem:
            raise JaxparError(f"checkpoint {step} in {checkpoint_dir!r} does not fit model {meta['model']!r}: {problem}")
        restore_args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape, dtype=s.dtype), item)
        try:
            restored = ckpt.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)))["state"]
        except Exception as err:  # noqa: BLE001 - truncated or missing array files surface as TensorStore errors
            raise checkpoint_lib.CheckpointDamaged(step, f"its parameters cannot be read ({checkpoint_lib.first_line(err)})") from None
        records = {path: meta["checksums"][path] for path in saved}
        sums = checkpoint_lib.state_checksums(restored, {path: record["grid"] for path, record in records.items()})
        checkpoint_lib.compare_checksums(step, records, sums)
    finally:
        ckpt.close()
    state = jax.tree.map(lambda v: v, abstract)
    nnx.replace_by_pure_dict(state, restored["params"])
    return nnx.merge(graphdef, state), meta


def encode_text(text: str) -> np.ndarray:
    """The main job's tokens of ``text``: its UTF-8 bytes, int32 (length,)."""
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)


def decode_tokens(tokens) -> str:
    """Byte tokens as text (UTF-8; a byte sequence that is not valid UTF-8 becomes U+FFFD)."""
    return bytes(np.asarray(tokens, np.uint8).tolist()).decode("utf-8", errors="replace")


@dataclasses.dataclass(frozen=True)
class Generated:
    text: str  # the prompt and its continuation, decoded together
    continuation: str  # the generated bytes alone, decoded
    tokens: np.ndarray  # int32 (length,): the prompt's bytes, then the generated ones (whole blocks)
    prompt_tokens: int  # how many of ``tokens`` are the prompt's
    model: str  # the checkpoint's model name
    step: int  # the checkpoint's step
