"""Checkpoints with orbax: saved under one layout, restored under any other, verified on the way back.

A checkpoint holds two items:

- ``state``: the ``TrainState`` (parameters, optimizer state, step), each array written in shards
  by the processes that hold them;
- ``meta``: JSON with the step, the run's seed and data position, the model and layout it was
  saved under, the shape and dtype of every array, a checksum of every saved shard of every array,
  and a SHA-256 of the JSON itself.

All randomness in a jaxpar run is a pure function of the seed and the step (initialisation uses
the seed; batch ``k`` is ``data.batch_at(seed, k)``), so seed + step are the whole RNG state and
the next step is the data position: a resumed run reads exactly the batches it would have read.

Restoring reads the arrays straight into the shardings of the *new* layout (``Trainer.abstract_state``),
so a checkpoint saved under ``fsdp=8`` on 8 devices in 2 processes restores under
``data=2,tensor=4``, on 4 devices, or in 1 process. The arrays are compared with the new model's
before anything is read, and a mismatch names the arrays that differ.

Integrity (orbax does not check what it reads back). Each array's checksum is a pair of weighted
sums of its bits modulo 2**32, one pair per block of the layout it was saved under, with weights
drawn from each element's global position (``block_checksums``). Integer sums do not depend on the
order they are added in, so every device sums the elements it holds and only the small sums cross
devices: the checksum is computed where each shard lives when saving, and again under whatever
layout restores it. Any one flipped bit changes a sum (the weights are odd); other damage goes
unseen with a chance of about 2**-64. ``restore`` checks all of it before it returns anything;
``restore_newest_verified`` walks back from the newest checkpoint to the newest that passes, and
moves the damaged ones aside (``<step>.damaged``), never deleting them.

Keeping the last N: a checkpoint older than the newest N is deleted only when one of those N is
verified (read back and checked; jaxpar reads the newest back when none is, about once every N
saves), so at least one intact checkpoint always survives.

One writer per directory: a run that saves, fresh or resumed, takes an exclusive lock on
``<dir>/jaxpar.lock`` (``fcntl.flock``, which the kernel releases when the process dies, so a
killed run leaves no lock behind) before it touches anything; in a multi-process job process 0
holds it for the job, and every process learns whether it got it.

Room: a run checks at start that the disk has room for one checkpoint of its state
(``check_room``, from the abstract state: nothing allocated), and every save checks again.

Orbax writes each checkpoint into ``<step>.orbax-checkpoint-tmp`` and renames it to ``<step>``
only when every process has finished writing; a save that is interrupted therefore never looks
complete, and the previous checkpoint stays the latest.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import functools
import gc
import hashlib
import json
import logging
import math
import os
import shutil
import socket
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jaxpar.errors import JaxparError, JobFailed, size_text
from jaxpar.flags import flag

LOCK_NAME = "jaxpar.lock"
DAMAGED_SUFFIX = ".damaged"


class CheckpointDamaged(JaxparError):
    """A checkpoint that is unreadable, incomplete, or fails its checksums."""

    def __init__(self, step: int, reason: str):
        super().__init__(f"checkpoint {step}: {reason}")
        self.step, self.reason = step, reason


class CheckpointLocked(JaxparError):
    """Another live run writes to the checkpoint directory."""


class CheckpointWriteFailed(JobFailed):
    """A save could not be written (a full disk, a vanished directory...)."""


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    # jaxpar train's options (jaxpar.flags); every and keep are None there unless given (without a directory, refused)
    directory: str = flag(name="checkpoint-dir", metavar="DIR", help="save checkpoints here")
    # save every this many steps (and after the last step)
    every: int = flag(100, name="checkpoint-every", given=True, metavar="K", help="save every K steps and after the last (default 100)")
    # complete checkpoints kept; older ones are deleted once a newer one is verified
    keep: int = flag(3, name="keep-checkpoints", given=True, metavar="N",
                     help="keep the last N checkpoints; older ones go once one of these verifies (default 3)")
    async_save: bool = True  # write in the background while training goes on
    # GB of arrays orbax writes at once (None: its default, 96), which bounds a save's host memory; each shard must be smaller
    save_concurrent_gb: float | None = None


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


# --- checksums -------------------------------------------------------------------------------------


def _mix(h):
    """MurmurHash3's 32-bit finaliser: spreads every input bit over the output (uint32 in, out)."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _as_words(x):
    """The bits of ``x`` as uint32, one word per element (two for 8-byte types)."""
    bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    words = jax.lax.bitcast_convert_type(x, bits).astype(jnp.uint32)
    if x.dtype.itemsize == 8:  # (..., 2): fold the halves so each element stays one word
        words = words[..., 0] ^ _mix(words[..., 1] + jnp.uint32(0x27D4EB2F))
    return words


def block_checksums(x, grid: tuple[int, ...]):
    """uint32[prod(grid), 2]: two position-weighted sums of ``x``'s bits per block, where ``grid``
    splits each dim into equal blocks (the shards of a layout). Independent of how ``x`` is sharded."""
    mesh = jax.typeof(x).sharding.mesh
    explicit = tuple(n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Explicit)
    if not explicit:
        return _block_checksums(x, grid)
    with jax.sharding.use_abstract_mesh(mesh):  # the blocking reshape is fine for XLA's partitioner; sharding-in-types refuses it
        return jax.sharding.auto_axes(
            functools.partial(_block_checksums, grid=grid), axes=explicit, out_sharding=jax.sharding.PartitionSpec())(x)


def _block_checksums(x, grid):
    shape = x.shape
    words = _as_words(x)
    flat = jnp.zeros(shape, jnp.uint32)
    for d in range(len(shape)):  # each element's global position, row-major (wraps past 2**32: still a fine seed)
        flat = flat * jnp.uint32(shape[d]) + jax.lax.broadcasted_iota(jnp.uint32, shape, d)
    sums = []
    for seed in (0x9E3779B9, 0x632BE5AB):
        weighted = words * (_mix(flat ^ jnp.uint32(seed)) | jnp.uint32(1))  # odd weights: one bit flip always shows
        blocked = weighted.reshape([n for size, g in zip(shape, grid) for n in (g, size // g)])
        sums.append(blocked.sum(axis=tuple(range(1, 2 * len(shape), 2)), dtype=jnp.uint32).reshape(-1))
    return jnp.stack(sums, axis=-1)


def _grid_of(leaf) -> tuple[int, ...]:
    """Blocks per dim of the layout ``leaf`` is sharded with (all ones when replicated)."""
    shard = leaf.sharding.shard_shape(leaf.shape)
    return tuple(size // s if s else 1 for size, s in zip(leaf.shape, shard))


def _bytes_to_write(state) -> int:
    """The bytes of ``state``'s arrays this process writes in a checkpoint (its distinct shards;
    replicas are written once), from a live state or an abstract one (shapes and shardings)."""
    total = 0
    for leaf in jax.tree.leaves(state):
        indices = leaf.sharding.addressable_devices_indices_map(leaf.shape).values()
        distinct = {tuple((part.start, part.stop) for part in index) for index in indices}
        total += len(distinct) * math.prod(leaf.sharding.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize
    return total


def state_checksums(state, grids: dict | None = None) -> dict:
    """{path: uint32 checksums per block} of a sharded state (live or just restored), as numpy.

    ``grids`` gives each array's blocks (default: its own sharding's, as when saving). Every device
    sums what it holds; only the sums cross devices, and every process gets all of them."""
    flat = flat_arrays(state)
    if not flat:
        return {}
    grids = grids or {path: _grid_of(leaf) for path, leaf in flat.items()}
    mesh = getattr(next(iter(flat.values())).sharding, "mesh", None)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()) if mesh is not None else None
    program = _sums_program(tuple((path, tuple(grids[path])) for path in flat), replicated)
    return {path: np.asarray(s.addressable_data(0)) for path, s in program(flat).items()}


@functools.lru_cache(maxsize=16)
def _sums_program(grids: tuple, replicated):
    """One jitted program per (arrays' blocks, mesh): compiled once for all the saves of a run."""
    return jax.jit(lambda arrays: {path: block_checksums(arrays[path], grid) for path, grid in grids}, out_shardings=replicated)


def _checksum_record(state) -> dict:
    """{path: {"grid": blocks per dim, "sums": [[a, b], ...]}} for the meta JSON."""
    flat = flat_arrays(state)
    sums = state_checksums(state)
    return {path: {"grid": list(_grid_of(flat[path])), "sums": sums[path].tolist()} for path in flat}


def compare_checksums(step: int, record: dict, actual: dict):
    """Raise CheckpointDamaged naming the first array shard whose sums differ."""
    bad = []
    for path, saved in record.items():
        got = actual[path]
        for shard, (want, have) in enumerate(zip(saved["sums"], got.tolist())):
            if list(want) != list(have):
                bad.append(f"array {path} shard {shard}")
    if bad:
        more = f" (and {len(bad) - 1} more shards)" if len(bad) > 1 else ""
        raise CheckpointDamaged(step, f"{bad[0]} fails its checksum{more}")


def _seal(meta: dict) -> dict:
    """``meta`` plus the SHA-256 of its canonical JSON."""
    body = json.dumps(meta, sort_keys=True)
    return dict(meta, meta_sha256=hashlib.sha256(body.encode()).hexdigest())


def _unseal(step: int, sealed: dict) -> dict:
    meta = {k: v for k, v in sealed.items() if k != "meta_sha256"}
    if "meta_sha256" not in sealed or "checksums" not in meta:
        raise CheckpointDamaged(step, "its metadata carries no checksums (not written by this jaxpar); it cannot be verified")
    if hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest() != sealed["meta_sha256"]:
        raise CheckpointDamaged(step, "its metadata fails its checksum")
    return meta


def first_line(err: BaseException) -> str:
    """The gist of an error from orbax, TensorStore or json, without their multi-line details."""
    text = (str(err).strip().splitlines() or [""])[0].split(" See full TensorStore details")[0]
    return f"{type(err).__name__}: {text}"[:300]


# --- the lock --------------------------------------------------------------------------------------


class _DirectoryLock:
    """An exclusive ``flock`` on ``<dir>/jaxpar.lock``, with the holder's pid and host written in it."""

    def __init__(self, directory: str):
        path = os.path.join(directory, LOCK_NAME)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 4096, 0).decode(errors="replace")
            os.close(self.fd)
            try:
                who = json.loads(holder)
                who = f"pid {who['pid']} on host {who['host']} (since {who['since']})"
            except (ValueError, KeyError):
                who = "another process"
            raise CheckpointLocked(
                f"checkpoint directory {directory} is in use by {who}: one run writes to a directory at a time; "
                "wait for it to finish, stop it, or choose another --checkpoint-dir"
            ) from None
        holder = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")})
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, holder.encode(), 0)

    def release(self):
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


# --- the checkpointer ------------------------------------------------------------------------------


def _quiet_orbax():
    """Orbax reports a failed background save as absl ERROR logs with full tracebacks, and its
    closed event loops as unraisable errors; jaxpar raises one error in words for each failure, so
    the user sees that instead (installed once, and only those unraisable errors are dropped)."""
    logging.getLogger("absl").setLevel(logging.CRITICAL)
    previous = sys.unraisablehook
    if getattr(previous, "jaxpar", False):
        return

    def hook(unraisable):
        if not (isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"):
            previous(unraisable)

    hook.jaxpar = True
    sys.unraisablehook = hook


class Checkpointer:
    """Save and restore a Trainer's state with orbax (see the module doc).

    ``writer=True`` (a run that saves) takes the directory's lock first; readers take none."""

    def __init__(self, cfg: CheckpointConfig, create: bool = True, writer: bool = True):
        if cfg.every <= 0 or cfg.keep <= 0:
            raise JaxparError(f"checkpoint every={cfg.every} and keep={cfg.keep} must both be positive")
        self.cfg = cfg
        self.directory = os.path.abspath(cfg.directory)
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise JaxparError(f"checkpoint directory {self.directory} is a file; choose a directory for --checkpoint-dir")
        _quiet_orbax()
        self.lock = self._lock_for_the_job() if writer else None  # before orbax touches the directory (it cleans up tmp saves)
        self.verified: set[int] = set()  # steps read back and checked by this run
        self._abstract = None  # the saved state's shapes and shardings, to read our own saves back
        self._failed = False  # a save failed and was reported
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None, create=create and writer, cleanup_tmp_directories=writer,
            enable_async_checkpointing=cfg.async_save,
        )
        bounded = {"state": ocp.StandardCheckpointHandler(save_concurrent_gb=cfg.save_concurrent_gb)} if cfg.save_concurrent_gb else None
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"), item_handlers=bounded)

    def _lock_for_the_job(self) -> _DirectoryLock | None:
        """Process 0 makes the directory and takes its lock; in a multi-process job every process
        learns the outcome, so that a refused job stops in every process before orbax starts."""
        lock, refusal = None, None
        if jax.process_index() == 0:
            try:
                os.makedirs(self.directory, exist_ok=True)
                if not os.access(self.directory, os.W_OK):
                    raise JaxparError(f"checkpoint directory {self.directory} is not writable; choose another --checkpoint-dir")
                lock = _DirectoryLock(self.directory)
            except OSError as err:
                refusal = JaxparError(f"checkpoint directory {self.directory} cannot be created ({err.strerror}); choose another --checkpoint-dir")
            except JaxparError as err:
                refusal = err
        if jax.process_count() > 1 and multihost_utils.broadcast_one_to_all(np.int32(refusal is not None)) and refusal is None:
            refusal = CheckpointLocked(f"checkpoint directory {self.directory} was refused to process 0 of this job (its message says why)")
        if refusal is not None:
            raise refusal
        return lock

    @classmethod
    def existing(cls, cfg: CheckpointConfig, writer: bool = False) -> Checkpointer:
        """Open a directory that must already hold a complete checkpoint."""
        if not os.path.isdir(cfg.directory):
            raise JaxparError(
                f"checkpoint directory {cfg.directory!r} does not exist; point --checkpoint-dir at the "
                "directory a run saved into, or drop --resume to start afresh"
            )
        ckpt = cls(cfg, create=False, writer=writer)
        if ckpt.latest_step() is None:
            ckpt.close()
            partial = [n for n in os.listdir(cfg.directory) if "tmp" in n or n.endswith(DAMAGED_SUFFIX)]
            hint = f" (only interrupted or damaged saves: {', '.join(sorted(partial))})" if partial else ""
            raise JaxparError(f"checkpoint directory {cfg.directory!r} holds no complete checkpoint{hint}; drop --resume to start afresh")
        return ckpt

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def should_save(self, step: int, last_step: int) -> bool:
        return step % self.cfg.every == 0 or step == last_step

    def save(self, step: int, state, meta: dict):
        """Start saving ``state`` as checkpoint ``step`` (in the background if async).

        Finishes the previous save first (raising CheckpointWriteFailed if it failed) and deletes
        checkpoints beyond the newest ``keep`` only when one of those is verified."""
        self.wait()
        self._check_space(step, state)
        self._abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
        meta = _seal(dict(meta, step=step, arrays=array_signature(state), checksums=_checksum_record(state)))
        try:
            self.manager.save(
                step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True
            )
        except Exception as err:  # noqa: BLE001 — whatever the file system says, the user gets one line
            raise self._write_failed(step, err) from None

    def check_room(self, abstract_state):
        """Refuse, at the start of a run, a disk that cannot hold one checkpoint of ``abstract_state``
        (shapes and shardings: nothing is allocated), rather than at the first save, steps later."""
        short = self._shortfall(abstract_state)
        if short:
            raise JaxparError(f"checkpoint directory {self.directory} cannot hold one checkpoint of this run ({short}); "
                              "free space there or choose another --checkpoint-dir")

    def _shortfall(self, state) -> str | None:
        """'N MiB to write, M MiB free' when the disk lacks room for a checkpoint of ``state``, else None."""
        needed = _bytes_to_write(state)
        try:
            free = shutil.disk_usage(self.directory).free
        except OSError:  # the directory is gone: the save itself says so
            return None
        if free < needed + needed // 20 + (64 << 10):  # arrays, plus room for orbax's and jaxpar's metadata
            return f"{size_text(needed)} to write, {size_text(free)} free"
        return None

    def _check_space(self, step: int, state):
        """Refuse a save that cannot fit before writing any of it (a full disk found halfway
        leaves orbax's background threads to fail noisily; the previous checkpoint is safe either way)."""
        short = self._shortfall(state)
        if short:
            raise self._write_failed(step, OSError(errno.ENOSPC, short))

    def _write_failed(self, step: int, err: BaseException) -> CheckpointWriteFailed:
        self._failed = True
        self.manager.reload()
        intact = [s for s in self.steps() if s != step]
        keep = f"checkpoint {intact[-1]} is intact" if intact else "no earlier checkpoint exists"
        full = (isinstance(err, OSError) and err.errno == errno.ENOSPC) or "No space left" in str(err)
        why = ("the disk is full" + (f" ({err.strerror})" if isinstance(err, OSError) and err.strerror else "")) if full else first_line(err)
        # only a full disk is cured by freeing space; anything else (a file removed under orbax, a
        # directory gone) is something outside this run touching the directory
        fix = ("free space or choose another --checkpoint-dir" if full else
               "check that nothing else writes to or deletes from it, or choose another --checkpoint-dir")
        return CheckpointWriteFailed(f"checkpoint {step} could not be written to {self.directory}: {why}; {keep}; {fix}, then --resume")

    def wait(self):
        """Block until a background save is complete, then apply keep-last-N."""
        pending = self.manager.latest_step()
        try:
            self.manager.wait_until_finished()
        except Exception as err:  # noqa: BLE001
            raise self._write_failed(pending, err) from None
        self._prune()

    def _prune(self):
        """Delete checkpoints older than the newest ``keep``, once one of those is verified."""
        steps = self.steps()
        if len(steps) <= self.cfg.keep:
            return  # (every process runs this: reading a checkpoint back is a collective)
        newest = steps[-self.cfg.keep:]
        if not self.verified & set(newest) and self._abstract is not None:
            try:
                self.restore(self._abstract, newest[-1])
            except CheckpointDamaged:
                pass  # keep the older ones: one of them is the newest that is known to be intact
        if self.verified & set(newest):
            for step in steps[: -self.cfg.keep]:
                self.manager.delete(step)

    def read_meta(self, step: int | None = None) -> dict:
        """The verified meta JSON of checkpoint ``step`` (default: latest); raises CheckpointDamaged."""
        step = self.latest_step() if step is None else step
        try:
            sealed = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as err:  # noqa: BLE001 — a missing or cut-off file: orbax and json raise many kinds
            raise CheckpointDamaged(step, f"its metadata cannot be read ({first_line(err)})") from None
        if not isinstance(sealed, dict):
            raise CheckpointDamaged(step, "its metadata cannot be read (not a JSON object)")
        return _unseal(step, sealed)

    def restore(self, abstract_state, step: int | None = None, check_meta=None):
        """(state laid out as ``abstract_state`` says, meta) of checkpoint ``step`` (default: latest).

        ``check_meta(meta)`` may refuse the checkpoint from its meta first. Checks the arrays against
        ``abstract_state`` next and names any that differ (a JaxparError: another model), then reads
        and checks every checksum (CheckpointDamaged) before returning."""
        step = self.latest_step() if step is None else step
        meta = self.read_meta(step)
        if check_meta is not None:
            check_meta(meta)
        problem = describe_mismatch(meta["arrays"], array_signature(abstract_state))
        if problem:
            raise JaxparError(
                f"checkpoint {step} in {self.directory} (model {meta.get('model')!r}) does not fit this model: {problem}\n"
                "restore with the model and optimizer it was saved with, or start a new checkpoint directory"
            )
        state = self._read(step, "its arrays", ocp.args.StandardRestore(abstract_state))
        actual = state_checksums(state, {path: rec["grid"] for path, rec in meta["checksums"].items()})
        compare_checksums(step, meta["checksums"], actual)
        self.verified.add(step)
        return state, meta

    def _read(self, step: int, what: str, args):
        """Orbax's restore of checkpoint ``step``'s state with ``args``. Truncated or missing array
        files surface as TensorStore errors: CheckpointDamaged says ``what`` cannot be read. A
        failed read leaves orbax's coroutines unawaited; they are collected here, their warnings
        dropped, so that the user sees the one message rather than a warning at some later time."""
        failure = None
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
            try:
                return self.manager.restore(step, args=ocp.args.Composite(state=args))["state"]
            except Exception as err:  # noqa: BLE001
                failure = first_line(err)
            gc.collect()  # (outside the except block, which holds the failed read's frames)
        raise CheckpointDamaged(step, f"{what} cannot be read ({failure})")

    def restore_params(self, params, step: int):
        """The parameters alone of checkpoint ``step``, laid out as ``params`` (a pure dict of
        ShapeDtypeStructs with shardings) says, whatever else the checkpoint holds (an optimizer
        state or none) and whatever layout saved them; each checked against its checksums
        (CheckpointDamaged), a model they do not fit refused naming the arrays."""
        meta = self.read_meta(step)
        item = {"params": params}
        saved = {path: sig for path, sig in meta["arrays"].items() if path.startswith("params/")}
        problem = describe_mismatch(saved, array_signature(item))
        if problem:
            raise JaxparError(f"checkpoint {step} in {self.directory!r} does not fit model {meta.get('model')!r}: {problem}")
        restore_args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape, dtype=s.dtype), item)
        restored = self._read(step, "its parameters", ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True))
        records = {path: meta["checksums"][path] for path in saved}
        compare_checksums(step, records, state_checksums(restored, {path: record["grid"] for path, record in records.items()}))
        return restored["params"]

    def restore_newest_verified(self, abstract_state, log=lambda msg: None, check_meta=None):
        """(state, meta) of the newest checkpoint that passes every check, moving newer damaged ones
        aside to ``<step>.damaged`` (so that the run can save those steps again) and saying so.
        Raises CheckpointDamaged listing every checkpoint when none passes. ``check_meta``: as for
        ``restore``, for the checkpoint about to be read."""
        failures = []
        for step in reversed(self.steps()):
            try:
                state, meta = self.restore(abstract_state, step, check_meta)
            except CheckpointDamaged as err:
                failures.append(err)
                log(f"{err}; trying the previous checkpoint")
                continue
            for damaged in failures:
                self._set_aside(damaged.step)
            if failures:
                if jax.process_count() > 1:  # every process sees the renames before it lists the steps again
                    multihost_utils.sync_global_devices("jaxpar: damaged checkpoints set aside")
                self.manager.reload()
                log(f"checkpoints {[d.step for d in failures]} moved aside as <step>{DAMAGED_SUFFIX}")
            return state, meta
        raise CheckpointDamaged(
            failures[0].step,
            f"no checkpoint in {self.directory} passes its checks:\n  " + "\n  ".join(str(e) for e in failures)
            + "\nstart afresh in another --checkpoint-dir (the damaged ones are left where they are)",
        )

    def _set_aside(self, step: int):
        if jax.process_index() != 0:
            return
        source, target = os.path.join(self.directory, str(step)), os.path.join(self.directory, f"{step}{DAMAGED_SUFFIX}")
        n = 1
        while os.path.exists(target):
            n += 1
            target = os.path.join(self.directory, f"{step}{DAMAGED_SUFFIX}{n}")
        os.rename(source, target)

    def close(self):
        """Finish any save, then release the directory (a save that failed was already reported)."""
        try:
            self.manager.close()
        except Exception as err:  # noqa: BLE001
            if not self._failed:
                raise self._write_failed(self.manager.latest_step(), err) from None
        finally:
            if self.lock:
                self.lock.release()
                self.lock = None


def _read_host_arrays(directory: str, step: int) -> dict:
    """{path: numpy array} of checkpoint ``step``, whole on this host, whatever layout saved it."""
    state_dir = os.path.join(directory, str(step), "state")
    reader = ocp.PyTreeCheckpointer()
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), reader.metadata(state_dir).item_metadata.tree)
    tree = reader.restore(state_dir, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
    return {path: np.asarray(v) for path, v in flat_arrays(tree).items()}


def _verified_host_arrays(ckpt: Checkpointer, step: int) -> tuple[dict, dict]:
    meta = ckpt.read_meta(step)
    try:
        arrays = _read_host_arrays(ckpt.directory, step)
    except Exception as err:  # noqa: BLE001
        raise CheckpointDamaged(step, f"its arrays cannot be read ({first_line(err)})") from None
    missing = set(meta["checksums"]) - set(arrays)
    if missing:
        raise CheckpointDamaged(step, f"array {sorted(missing)[0]} is missing")
    sums = {path: np.asarray(jax.jit(block_checksums, static_argnums=1)(arrays[path], tuple(rec["grid"])))
            for path, rec in meta["checksums"].items()}
    compare_checksums(step, meta["checksums"], sums)
    return arrays, meta


def newest_meta(directory: str) -> dict:
    """The meta of the newest checkpoint in ``directory`` (only its JSON is read)."""
    ckpt = Checkpointer.existing(CheckpointConfig(directory))
    try:
        return ckpt.read_meta(ckpt.latest_step())
    finally:
        ckpt.close()


def load_arrays(directory: str, step: int | None = None) -> tuple[dict, dict]:
    """({path: numpy array}, meta) of a checkpoint, read whole on this host and verified: for
    inspection and tests, whatever layout or process count saved it."""
    ckpt = Checkpointer.existing(CheckpointConfig(directory))
    try:
        return _verified_host_arrays(ckpt, ckpt.latest_step() if step is None else step)
    finally:
        ckpt.close()


def list_checkpoints(directory: str) -> list[dict]:
    """One row per checkpoint in ``directory`` (complete, interrupted or set aside): its step, the
    layout it was saved under and whether it verifies (each is read whole on this host)."""
    if not os.path.isdir(directory):
        raise JaxparError(f"checkpoint directory {directory!r} does not exist")
    ckpt = Checkpointer(CheckpointConfig(directory), create=False, writer=False)
    rows = []
    try:
        for step in ckpt.steps():
            row = {"step": step, "name": str(step), "status": "verified"}
            try:
                _, meta = _verified_host_arrays(ckpt, step)
                row.update({k: meta.get(k) for k in ("model", "strategy", "devices", "processes")})
            except CheckpointDamaged as err:
                row["status"] = f"damaged: {err.reason}"
            rows.append(row)
    finally:
        ckpt.close()
    for name in sorted(os.listdir(directory)):
        if name.endswith(".orbax-checkpoint-tmp") or DAMAGED_SUFFIX in name:
            kind = "interrupted save (never used)" if name.endswith("tmp") else "set aside as damaged"
            rows.append({"step": int(name.split(".")[0]) if name.split(".")[0].isdigit() else None, "name": name, "status": kind})
    return rows


def format_checkpoints(directory: str, rows: list[dict]) -> str:
    lines = [f"checkpoints in {os.path.abspath(directory)}", f"  {'name':24s} {'model':8s} {'strategy':24s} {'devices':>7s}  status"]
    for row in rows:
        lines.append(
            f"  {row['name']:24s} {str(row.get('model') or '-'):8s} {str(row.get('strategy') or '-'):24s} "
            f"{str(row.get('devices') or '-'):>7s}  {row['status']}"
        )
    if len(lines) == 2:
        lines.append("  (none)")
    return "\n".join(lines)
