"""Checkpoints with orbax: saved under one layout, restored under any other.

A checkpoint holds two items:

- ``state``: the ``TrainState`` (parameters, optimizer state, step), each array written in shards
  by the processes that hold them;
- ``meta``: JSON with the step, the run's seed and data position, the model and layout it was
  saved under, and the shape and dtype of every array.

All randomness in a jaxpar run is a pure function of the seed and the step (initialisation uses
the seed; batch ``k`` is ``data.batch_at(seed, k)``), so seed + step are the whole RNG state and
the next step is the data position: a resumed run reads exactly the batches it would have read.

Restoring reads the arrays straight into the shardings of the *new* layout (``Trainer.abstract_state``),
so a checkpoint saved under ``fsdp=8`` on 8 devices in 2 processes restores under
``data=2,tensor=4``, on 4 devices, or in 1 process. The arrays are compared with the new model's
before anything is read, and a mismatch names the arrays that differ.

Orbax writes each checkpoint into ``<step>.orbax-checkpoint-tmp`` and renames it to ``<step>``
only when every process has finished writing; a save that is interrupted therefore never looks
complete, and the previous checkpoint stays the latest. Old checkpoints are deleted only after a
newer one is complete.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxpar.errors import JaxparError


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    directory: str
    every: int = 100  # save every this many steps (and after the last step)
    keep: int = 3  # complete checkpoints kept; older ones are deleted once a newer one is complete
    async_save: bool = True  # write in the background while training goes on


def flat_arrays(tree) -> dict:
    """{"params/layers/attn/wq": leaf, "opt_state/0/mu/...": leaf, ...}: one name per array,
    the same whether the tree holds NamedTuples (a live state) or dicts and lists (as read back)."""
    def name(key):
        return str(getattr(key, "name", getattr(key, "key", getattr(key, "idx", key))))

    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {"/".join(name(k) for k in path): leaf for path, leaf in flat}


def array_signature(state) -> dict:
    """{path: [shape, dtype]} of every array in a state (abstract or concrete)."""
    return {path: [list(leaf.shape), str(leaf.dtype)] for path, leaf in flat_arrays(state).items()}


def describe_mismatch(saved: dict, expected: dict, limit: int = 8) -> str | None:
    """Which arrays differ between two signatures, in words; None when they agree."""
    problems = []
    for path in sorted(set(saved) | set(expected), key=lambda p: (not p.startswith("params/"), p)):  # weights first
        if path not in expected:
            problems.append(f"{path} is in the checkpoint but not in this model")
        elif path not in saved:
            problems.append(f"{path} is in this model but not in the checkpoint")
        elif saved[path] != expected[path]:
            (s_shape, s_dtype), (e_shape, e_dtype) = saved[path], expected[path]
            problems.append(f"{path}: checkpoint {s_dtype}{s_shape}, model {e_dtype}{e_shape}")
    if not problems:
        return None
    more = f"\n  ... and {len(problems) - limit} more" if len(problems) > limit else ""
    return f"{len(problems)} arrays differ:\n  " + "\n  ".join(problems[:limit]) + more


class Checkpointer:
    """Save and restore a Trainer's state with orbax (see the module doc)."""

    def __init__(self, cfg: CheckpointConfig, create: bool = True):
        if cfg.every <= 0 or cfg.keep <= 0:
            raise JaxparError(f"checkpoint every={cfg.every} and keep={cfg.keep} must both be positive")
        self.cfg = cfg
        self.directory = os.path.abspath(cfg.directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep, create=create, cleanup_tmp_directories=True,
            enable_async_checkpointing=cfg.async_save,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    @classmethod
    def existing(cls, cfg: CheckpointConfig) -> Checkpointer:
        """Open a directory that must already hold a complete checkpoint."""
        if not os.path.isdir(cfg.directory):
            raise JaxparError(
                f"checkpoint directory {cfg.directory!r} does not exist; point --checkpoint-dir at the "
                "directory a run saved into, or drop --resume to start afresh"
            )
        ckpt = cls(cfg, create=False)
        if ckpt.latest_step() is None:
            partial = [n for n in os.listdir(cfg.directory) if "tmp" in n]
            hint = f" (only interrupted saves: {', '.join(sorted(partial))})" if partial else ""
            raise JaxparError(f"checkpoint directory {cfg.directory!r} holds no complete checkpoint{hint}; drop --resume to start afresh")
        return ckpt

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def should_save(self, step: int, last_step: int) -> bool:
        return step % self.cfg.every == 0 or step == last_step

    def save(self, step: int, state, meta: dict):
        """Start saving ``state`` as checkpoint ``step`` (in the background if async)."""
        meta = dict(meta, step=step, arrays=array_signature(state))
        self.manager.save(
            step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True
        )

    def read_meta(self, step: int | None = None) -> dict:
        step = self.latest_step() if step is None else step
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def restore(self, abstract_state, step: int | None = None):
        """(state laid out as ``abstract_state`` says, meta) of checkpoint ``step`` (default: latest).

        Checks the arrays against ``abstract_state`` first and names any that differ."""
        step = self.latest_step() if step is None else step
        meta = self.read_meta(step)
        problem = describe_mismatch(meta["arrays"], array_signature(abstract_state))
        if problem:
            raise JaxparError(
                f"checkpoint {step} in {self.directory} (model {meta.get('model')!r}) does not fit this model: {problem}\n"
                "restore with the model and optimizer it was saved with, or start a new checkpoint directory"
            )
        restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))
        return restored["state"], meta

    def wait(self):
        """Block until a background save is complete."""
        self.manager.wait_until_finished()

    def close(self):
        self.manager.close()


def load_arrays(directory: str, step: int | None = None) -> tuple[dict, dict]:
    """({path: numpy array}, meta) of a checkpoint, read whole on this host: for inspection and
    tests, whatever layout or process count saved it."""
    ckpt = Checkpointer.existing(CheckpointConfig(directory))
    step = ckpt.latest_step() if step is None else step
    meta = ckpt.read_meta(step)
    state_dir = os.path.join(ckpt.directory, str(step), "state")
    reader = ocp.PyTreeCheckpointer()
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), reader.metadata(state_dir).item_metadata.tree)
    tree = reader.restore(state_dir, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
    return {path: np.asarray(v) for path, v in flat_arrays(tree).items()}, meta
