"""One attention op: every mask kind, four implementations, and the pieces a ring needs.

``attention(q, k, v, mask)`` is softmax(q k^T / sqrt(head_dim) + mask) v with q of shape (batch,
q_len, heads, head_dim) and k, v of shape (batch, kv_len, kv_heads, head_dim); heads a multiple of
kv_heads is grouped-query attention (each kv head serves heads // kv_heads query heads). The
softmax statistics (running max, sum, log-sum-exp) are float32 whatever the input dtype; the result
has q's shape and dtype.

The mask is a ``Mask``: any of causal, a sliding window (a query at position i sees keys in
[i - left, i + right]), a block mask (``BlockMask``: a Python function of (query block, key block)
-> bool, evaluated at trace time on block indices; block diffusion's three-part mask is one) and
segment ids (``Segments``: packed documents, a query sees only keys of its own segment), all
and-ed; ``Mask()`` is bidirectional. Positions are global: ``q_offset`` / ``kv_offset`` say where a
chunk starts in the whole sequence, so a ring can evaluate the same mask on the chunks it holds.
A device that holds a sequence's tokens in another order gives each token's place (``Indices``,
``mask.at``): block parallelism holds its own noisy blocks of a block diffusion input, then the
clean half; the mask is evaluated at those places (data, like segment ids: no block is skipped).

Implementations (``implementation=``):

- ``naive``: materialises the (q_len, kv_len) scores; the reference.
- ``blockwise``: pure JAX, blocks of queries x blocks of keys with an online softmax, memory linear
  in the length (a sequence within one block runs the naive code: the same computation). Its
  backward is a ``jax.custom_vjp`` that recomputes each block's probabilities
  from the saved log-sum-exp (FlashAttention-2): left to autodiff, the loops would save every
  block's probabilities and the backward would be quadratic in memory again. Blocks that causal, a
  window or a block mask leave empty are found at trace time (when the offsets are Python ints)
  and never computed, forward or backward.
- ``splash``: TPU, JAX's own Pallas kernel (``jax.experimental.pallas.ops.tpu.splash_attention``);
  the mask becomes its CausalMask / LocalMask / NumpyMask (block masks) and SegmentIds.
- ``cudnn``: GPU, cuDNN flash attention through ``jax.nn.dot_product_attention``; causal, causal
  sliding windows and bidirectional only (it has no segment ids or block masks here).
- ``auto``: splash on TPU (lengths multiples of 128), cudnn on GPU where the mask and dtype allow,
  otherwise blockwise (the CPU default). It reads ``jax.default_backend()``: an ahead-of-time
  compile for a TPU pod from a CPU host passes ``implementation="splash"`` itself.

The ring's pieces: ``attention_chunk`` gives (partial output, log-sum-exp) of a query chunk against
one key/value chunk at given offsets (differentiable in both), ``merge`` joins two such partial
results by the online-softmax rule. ``attention`` with naive or blockwise is ``attention_chunk`` on
the whole sequence: one code path.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.errors import JaxparError
from jaxpar.rules import _ACTIVE, _called, vary_over, varying_axes

IMPLEMENTATIONS = ("auto", "naive", "blockwise", "splash", "cudnn")
DEFAULT_BLOCK = 512
# the implementation ``attention(implementation=None)`` runs: a run's choice (``jaxpar train --attention``)
_IMPLEMENTATION: contextvars.ContextVar[str] = contextvars.ContextVar("jaxpar_attention", default="auto")


@contextlib.contextmanager
def use_implementation(name: str):
    """Make ``name`` the implementation of every ``attention`` call inside that names none (where
    that may be splash, its kernels' outputs are typed for shard_map: ``_splash_outputs_typed``)."""
    if name not in IMPLEMENTATIONS:
        raise JaxparError(f"unknown attention implementation {name!r}: choose one of {', '.join(IMPLEMENTATIONS)}")
    token = _IMPLEMENTATION.set(name)
    splash = name == "splash" or (name == "auto" and jax.default_backend() == "tpu")
    try:
        with _splash_outputs_typed() if splash else contextlib.nullcontext():
            yield
    finally:
        _IMPLEMENTATION.reset(token)


@contextlib.contextmanager
def _splash_outputs_typed():
    """While a step is traced (its backward too): every ``pallas_call`` output that declares no
    varying mesh axes is typed to vary over every axis its inputs vary over, as a per-device
    kernel's output does. JAX 0.10's splash kernel declares none, and inside the step's shard_map
    (check_vma, on which the step's gradient types rest) pallas_call refuses such outputs. JAX
    offers no supported way to type another library's kernel outputs (the splash kernel builds its
    own ``pallas_call``), so the call is wrapped only while such a step traces, and restored after;
    it goes once splash declares its outputs' varying axes."""
    from jax._src.core import ManualAxisType  # the type of an aval's varying axes; no public name yet
    from jax.experimental import pallas as pl

    original = pl.pallas_call

    def typed(kernel, out_shape=None, **kwargs):
        def call(*operands):
            mat = ManualAxisType(varying=frozenset().union(*(varying_axes(x) for x in jax.tree.leaves(operands))))

            def declare(shape):
                if isinstance(shape, jax.ShapeDtypeStruct) and shape.manual_axis_type is None:
                    return jax.ShapeDtypeStruct(shape.shape, shape.dtype, manual_axis_type=mat)
                return shape

            shapes = jax.tree.map(declare, out_shape, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
            return original(kernel, shapes, **kwargs)(*operands)

        return call

    pl.pallas_call = typed
    try:
        yield
    finally:
        pl.pallas_call = original


# --- the mask description ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BlockMask:
    """Which (query block, key block) pairs may attend: ``allowed(qb, kb) -> bool`` on block
    indices of ``block_size`` tokens, global over the whole sequence. Called at trace time only.
    ``num_blocks`` (query blocks, key blocks of the whole sequence) is needed only when a chunk's
    offsets are traced values (a ring whose chunk index depends on the device)."""

    allowed: Callable[[int, int], bool]
    block_size: int
    num_blocks: tuple[int, int] | None = None

    def table(self, q_blocks: range, kv_blocks: range) -> np.ndarray:
        return np.array([[bool(self.allowed(a, c)) for c in kv_blocks] for a in q_blocks], dtype=bool).reshape(len(q_blocks), len(kv_blocks))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Segments:
    """Segment ids of packed documents, int arrays (batch, q_len) and (batch, kv_len)."""

    q: jax.Array
    kv: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fetch:
    """Keys fetched from the other ranks of a context axis in one all-to-all: ``send`` (ring
    size, S) the indices of this device's keys it sends each rank, ``places`` (ring size x S,) the
    places of the keys it receives, rank by rank (-1: a padding slot)."""

    send: jax.Array
    places: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Indices:
    """Where the query and key tokens sit in the sequence the mask is defined over, int arrays
    (q_len,) and (kv_len,); a chunk's offset is added to them.

    Under a context-parallel ring, ``kv_ring`` (ring size, m) gives the places of the m keys each
    ring rank holds and sends round; ``kv`` then places only the keys before them, which stay on
    this device (its keys are [those ; its m ring keys], or a piece of the m where several devices
    share a ring rank: ``split_attention.RING_PIECES``). Block parallelism over a ring (CSBP)
    keeps its noisy blocks' keys and sends the clean ones. ``kv_fetch`` instead fetches, in one
    all-to-all over the context axis, the keys this device's queries may see (``Fetch``; ``kv``
    places all its own keys): CSBP under a sliding window."""

    q: jax.Array
    kv: jax.Array
    kv_ring: jax.Array | None = None
    kv_fetch: Fetch | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mask:
    """What may attend to what; every part given is and-ed. ``Mask()`` is bidirectional."""

    causal: bool = dataclasses.field(default=False, metadata=dict(static=True))
    window: tuple[int, int] | None = dataclasses.field(default=None, metadata=dict(static=True))  # (left, right)
    blocks: BlockMask | None = dataclasses.field(default=None, metadata=dict(static=True))
    segments: Segments | None = None
    indices: Indices | None = None

    def with_segments(self, q_ids, kv_ids=None) -> "Mask":
        """The same mask restricted to packed documents (kv ids default to the query ids)."""
        return dataclasses.replace(self, segments=Segments(jnp.asarray(q_ids), jnp.asarray(q_ids if kv_ids is None else kv_ids)))

    def at(self, q_indices, kv_indices=None, kv_ring=None, kv_fetch: Fetch | None = None) -> "Mask":
        """The same mask evaluated at these places of the tokens (kv default: the query's;
        ``kv_ring``, ``kv_fetch``: see ``Indices``)."""
        kv = jnp.asarray(q_indices if kv_indices is None else kv_indices)
        return dataclasses.replace(self, indices=Indices(jnp.asarray(q_indices), kv, None if kv_ring is None else jnp.asarray(kv_ring), kv_fetch))

    def kinds(self) -> list[str]:
        return [name for name, on in (("causal", self.causal), ("window", self.window is not None), ("block mask", self.blocks is not None), ("segments", self.segments is not None)) if on] or ["bidirectional"]

    def band(self) -> tuple[float, float]:
        """The allowed range of key position - query position, from causal and the window."""
        lo, hi = -math.inf, math.inf
        if self.window is not None:
            lo, hi = -self.window[0], self.window[1]
        if self.causal:
            hi = min(hi, 0)
        return lo, hi

    def dense(self, q_len: int, kv_len: int, q_offset=0, kv_offset=0) -> jax.Array:
        """The boolean mask (batch or 1, q_len, kv_len) of a q chunk against a kv chunk."""
        qpos, kpos = _places(self, q_len, kv_len, q_offset, kv_offset)
        table = _block_table(self, q_len, kv_len, q_offset, kv_offset)
        seg = (self.segments.q, self.segments.kv) if self.segments is not None else (None, None)
        return _allowed(self, table, qpos, kpos, *seg)


CAUSAL = Mask(causal=True)
BIDIRECTIONAL = Mask()


def _is_static(*offsets) -> bool:
    return all(isinstance(o, (int, np.integer)) for o in offsets)


def _refuse_ring_places(mask: Mask):
    if mask.indices is not None and (mask.indices.kv_ring is not None or mask.indices.kv_fetch is not None):
        raise JaxparError("Mask.at(kv_ring= or kv_fetch=) places keys that travel over a context axis; outside jaxpar's "
                          "step under context= give every key's place in kv_indices")


def _places(mask: Mask, q_len: int, kv_len: int, q_offset, kv_offset):
    """(q_len,), (kv_len,) int32: where a q chunk's and a kv chunk's tokens sit in the sequence."""
    if mask.indices is None:
        q, kv = jnp.arange(q_len, dtype=jnp.int32), jnp.arange(kv_len, dtype=jnp.int32)
    else:
        _refuse_ring_places(mask)
        q, kv = mask.indices.q.astype(jnp.int32), mask.indices.kv.astype(jnp.int32)
    return jnp.asarray(q_offset, jnp.int32) + q, jnp.asarray(kv_offset, jnp.int32) + kv


@dataclasses.dataclass(frozen=True)
class _Table:
    """A block mask's table over the block indices a chunk pair covers, from (q0, k0)."""

    values: np.ndarray
    q0: int
    k0: int
    block: int


def _block_table(mask: Mask, q_len, kv_len, q_offset, kv_offset) -> _Table | None:
    bm = mask.blocks
    if bm is None:
        return None
    if _is_static(q_offset, kv_offset) and mask.indices is None:
        qr = range(q_offset // bm.block_size, (q_offset + q_len - 1) // bm.block_size + 1)
        kr = range(kv_offset // bm.block_size, (kv_offset + kv_len - 1) // bm.block_size + 1)
        return _Table(bm.table(qr, kr), qr.start, kr.start, bm.block_size)
    if bm.num_blocks is None:
        raise JaxparError(
            "a block mask evaluated at traced offsets or at given token places (Mask.at) needs the whole sequence's "
            "block counts: pass BlockMask(..., num_blocks=(query blocks, key blocks))"
        )
    return _Table(bm.table(range(bm.num_blocks[0]), range(bm.num_blocks[1])), 0, 0, bm.block_size)


def _allowed(mask: Mask, table: _Table | None, qpos, kpos, seg_q=None, seg_kv=None):
    """(batch or 1, n, m) bool: query positions qpos (n,) against key positions kpos (m,)."""
    q, k = qpos[:, None], kpos[None, :]
    ok = jnp.ones((qpos.shape[0], kpos.shape[0]), bool)
    lo, hi = mask.band()
    if lo > -math.inf:
        ok &= k - q >= lo
    if hi < math.inf:
        ok &= k - q <= hi
    if table is not None:
        ok &= jnp.asarray(table.values)[q // table.block - table.q0, k // table.block - table.k0]
    ok = ok[None]
    if seg_q is not None:
        ok = ok & (seg_q[:, :, None] == seg_kv[:, None, :])
    return ok


def block_plan(mask: Mask, q_len: int, kv_len: int, block_q: int, block_kv: int, q_offset=0, kv_offset=0) -> np.ndarray:
    """(q blocks, kv blocks) bool: the block pairs that may hold an allowed entry, decided at trace
    time from causal, the window and the block mask (segments are data, so never decided here).
    Conservative: a pair marked True may still turn out empty, one marked False is empty. With
    traced offsets or token places given (``Mask.at``) nothing can be decided and every pair is
    computed."""
    nq, nk = q_len // block_q, kv_len // block_kv
    if not _is_static(q_offset, kv_offset) or mask.indices is not None:
        return np.ones((nq, nk), bool)
    qs = q_offset + block_q * np.arange(nq)
    ks = kv_offset + block_kv * np.arange(nk)
    lo, hi = mask.band()
    # some key - query difference of the pair falls in [lo, hi]
    plan = ((ks[None, :] - (qs[:, None] + block_q - 1)) <= hi) & (((ks[None, :] + block_kv - 1) - qs[:, None]) >= lo)
    table = _block_table(mask, q_len, kv_len, q_offset, kv_offset)
    if table is not None:
        b = table.block
        qb = (q_offset + np.arange(q_len)) // b - table.q0
        kb = (kv_offset + np.arange(kv_len)) // b - table.k0
        # mask-block pairs that are allowed and whose own ranges meet the band
        a_lo = np.maximum((table.q0 + np.arange(table.values.shape[0])) * b, q_offset)
        a_hi = np.minimum(a_lo // b * b + b - 1, q_offset + q_len - 1)
        c_lo = np.maximum((table.k0 + np.arange(table.values.shape[1])) * b, kv_offset)
        c_hi = np.minimum(c_lo // b * b + b - 1, kv_offset + kv_len - 1)
        fine = table.values & ((c_lo[None, :] - a_hi[:, None]) <= hi) & ((c_hi[None, :] - a_lo[:, None]) >= lo)
        over_q = np.zeros((nq, fine.shape[0]), np.int64)
        over_q[np.arange(q_len) // block_q, qb] = 1
        over_k = np.zeros((nk, fine.shape[1]), np.int64)
        over_k[np.arange(kv_len) // block_kv, kb] = 1
        plan &= (over_q @ fine.astype(np.int64) @ over_k.T) > 0
    return plan


# --- checks ----------------------------------------------------------------------------------------


def _check(q, k, v, mask: Mask):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise JaxparError(f"attention takes q (batch, q_len, heads, head_dim) and k, v (batch, kv_len, kv_heads, head_dim); got shapes {q.shape}, {k.shape}, {v.shape}")
    if k.shape != v.shape:
        raise JaxparError(f"k and v must have one shape; got k {k.shape} and v {v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise JaxparError(f"q {q.shape} and k {k.shape} must agree in batch and head_dim")
    heads, kv_heads = q.shape[2], k.shape[2]
    if heads % kv_heads:
        raise JaxparError(f"{heads} query heads are not a multiple of {kv_heads} kv heads: grouped-query attention needs heads = a multiple of kv_heads")
    if mask.window is not None:
        w = mask.window
        if len(w) != 2 or not all(isinstance(x, (int, np.integer)) and x >= 0 for x in w):
            raise JaxparError(f"window={w!r}: give (left, right), two non-negative ints (keys in [i - left, i + right])")
    if mask.segments is not None:
        want = ((q.shape[0], q.shape[1]), (k.shape[0], k.shape[1]))
        got = (tuple(mask.segments.q.shape), tuple(mask.segments.kv.shape))
        if got != want:
            raise JaxparError(f"segment ids of shapes {got[0]} (q) and {got[1]} (kv); expected {want[0]} and {want[1]} (batch, length)")
    if mask.indices is not None:
        ring = mask.indices.kv_ring
        got = (tuple(mask.indices.q.shape), (mask.indices.kv.shape[0] + (0 if ring is None else ring.shape[1]),))
        piece = k.shape[1] - mask.indices.kv.shape[0]  # this device's piece of its ring rank's keys (RING_PIECES)
        if ring is not None and 0 < piece and ring.shape[1] % piece == 0:
            got = (got[0], (k.shape[1],))
        if got != ((q.shape[1],), (k.shape[1],)):
            raise JaxparError(f"token places (Mask.at) of shapes {got[0]} (q) and {got[1]} (kv); expected {(q.shape[1],)} and {(k.shape[1],)}: one per position")


def _block_size(name: str, requested: int, length: int) -> int:
    block = min(requested, length)
    if length % block:
        raise JaxparError(f"length {length} is not a multiple of {name}={block}: pass a {name} that divides it")
    return block


# the kernels only one platform's compiler builds: (platform, what to use elsewhere)
PLATFORM_KERNELS = {"splash": ("tpu", "cudnn on a GPU, blockwise or auto"), "cudnn": ("gpu", "splash on a TPU, blockwise or auto")}


def check_platform(implementation: str, platform: str, where: str):
    """Refuse, before any work, a kernel that ``where`` (e.g. "topology v5p-8"), a ``platform``
    machine, cannot build: splash is a TPU Pallas kernel, cuDNN's flash attention a GPU one."""
    if implementation in PLATFORM_KERNELS and PLATFORM_KERNELS[implementation][0] != platform:
        kernel, fix = PLATFORM_KERNELS[implementation]
        raise JaxparError(f"--attention {implementation} is a {kernel.upper()} kernel, but {where} runs on {platform.upper()}: "
                          f"use {fix}")


def choose_implementation(implementation: str, mask: Mask, dtype=jnp.float32, backend: str | None = None, lengths: tuple[int, int] = (128, 128)) -> str:
    """The implementation ``attention`` will run; ``auto`` by backend (``jax.default_backend()``
    unless given). Refuses an unknown name and a mask the named implementation cannot do."""
    if implementation not in IMPLEMENTATIONS:
        raise JaxparError(f"unknown attention implementation {implementation!r}: choose one of {', '.join(IMPLEMENTATIONS)}")
    backend = backend or jax.default_backend()
    if implementation == "auto":
        if backend == "tpu" and all(n % 128 == 0 for n in lengths) and mask.indices is None:
            return "splash"
        if backend == "gpu" and _cudnn_refusal(mask, dtype) is None:
            return "cudnn"
        return "blockwise"
    if implementation == "splash" and mask.indices is not None:
        raise JaxparError("implementation='splash' cannot evaluate a mask at given token places (Mask.at: a sequence held "
                          "out of order, as block parallelism holds it): its mask is fixed when it is compiled; use 'blockwise'")
    if implementation == "cudnn":
        reason = _cudnn_refusal(mask, dtype)
        if reason:
            raise JaxparError(f"implementation='cudnn' cannot do {reason}: use 'splash' (TPU), 'blockwise' or 'auto'")
        if backend != "gpu":
            raise JaxparError(f"implementation='cudnn' needs a GPU; this backend is {backend!r}: use 'blockwise' or 'auto'")
    return implementation


def _cudnn_refusal(mask: Mask, dtype) -> str | None:
    if mask.segments is not None:
        return "segments (segment ids of packed documents)"
    if mask.indices is not None:
        return "a mask at given token places (Mask.at)"
    if mask.blocks is not None:
        return "a block mask"
    if mask.window is not None and not mask.causal and mask.window[1] != 0:
        return f"window={mask.window} (cuDNN has left windows only, with causal)"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype).name} (cuDNN flash attention runs float16 and bfloat16)"
    return None


# --- the op ----------------------------------------------------------------------------------------


def attention(q, k, v, mask: Mask | None = None, *, implementation: str | None = None, block_q: int = DEFAULT_BLOCK, block_kv: int = DEFAULT_BLOCK, interpret: bool = False):
    """softmax(q k^T / sqrt(head_dim), masked) v: (batch, q_len, heads, head_dim) in q's dtype.

    ``implementation``: None takes the run's (``use_implementation``; ``auto`` by default).
    ``block_q`` / ``block_kv``: blockwise and splash tile sizes (cut to the length; must divide it).
    ``interpret``: run splash's Pallas kernel in interpret mode (on CPU, for tests).

    Inside jaxpar's manual step with the sequence split over ``context`` (context parallelism),
    q, k, v and the segment ids are this device's positions of the sequence and the attention runs
    across devices (``parallel/context/split_attention.py``)."""
    _called("attention")
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    mask = BIDIRECTIONAL if mask is None else mask
    implementation = _IMPLEMENTATION.get() if implementation is None else implementation
    _check(q, k, v, mask)
    active = _ACTIVE.get()
    if active is not None and active.manual and _SPLIT_SEQUENCE and _SPLIT_SEQUENCE["splits"](active.layout):
        return _SPLIT_SEQUENCE["attention"](q, k, v, mask, active.layout, implementation, block_q, block_kv, interpret)
    return _whole(q, k, v, mask, implementation, block_q, block_kv, interpret)


# the attention of a sequence split over devices, which context parallelism's runtime
# (``parallel/context/split_attention.py``, built from this module's chunk pieces) registers when its
# strategy is imported (``parallel/context/__init__.py``): this module stays below both
_SPLIT_SEQUENCE: dict = {}


def register_split_sequence(fn, splits):
    """Make ``fn(q, k, v, mask, layout, implementation, block_q, block_kv, interpret)`` the
    attention run where ``splits(layout)``: the active layout splits the sequence over devices."""
    _SPLIT_SEQUENCE.update(attention=fn, splits=splits)


def _whole(q, k, v, mask: Mask, implementation: str, block_q: int, block_kv: int, interpret: bool):
    """Attention with every position of the sequence on this device."""
    impl = choose_implementation(implementation, mask, q.dtype, lengths=(q.shape[1], k.shape[1]))
    if impl == "splash":
        return _splash(q, k, v, mask, block_q, block_kv, interpret)
    if impl == "cudnn":
        w = None if mask.window is None else (mask.window[0], 0)
        return jax.nn.dot_product_attention(q, k, v, scale=1 / math.sqrt(q.shape[-1]), is_causal=mask.causal or w is not None, local_window_size=w, implementation="cudnn")
    if impl == "blockwise" and q.shape[1] <= block_q and k.shape[1] <= block_kv:
        impl = "naive"  # one block is the whole score matrix: the same computation, without the loops
    out, _ = attention_chunk(q, k, v, mask, implementation=impl, block_q=block_q, block_kv=block_kv)
    return out.astype(q.dtype)


def attention_chunk(q, k, v, mask: Mask | None = None, *, q_offset=0, kv_offset=0, implementation: str = "blockwise", block_q: int = DEFAULT_BLOCK, block_kv: int = DEFAULT_BLOCK):
    """(partial output float32 (batch, q_len, heads, head_dim), log-sum-exp float32 (batch, q_len,
    heads)) of a q chunk starting at ``q_offset`` against a kv chunk starting at ``kv_offset``.
    A query that sees no key of the chunk gets output 0 and log-sum-exp -inf. The mask's segment
    ids are the chunks' own. Offsets may be traced (a ring's chunk index); then no block is skipped."""
    mask = BIDIRECTIONAL if mask is None else mask
    _check(q, k, v, mask)
    if implementation not in ("naive", "blockwise"):
        raise JaxparError(f"attention_chunk implementation={implementation!r}: choose 'naive' or 'blockwise'")
    if implementation == "naive":
        return _naive(mask, q, k, v, q_offset, kv_offset)
    data, _ = _data_parts(mask)
    run, _ = _blockwise_for(q, k, mask, q_offset, kv_offset, block_q, block_kv)
    return run(q, k, v, *data, jnp.asarray(q_offset, jnp.int32), jnp.asarray(kv_offset, jnp.int32))


def chunk_grads(q, k, v, mask: Mask, out, lse, dout, *, q_offset=0, kv_offset=0, block_q: int = DEFAULT_BLOCK, block_kv: int = DEFAULT_BLOCK):
    """(dq, dk, dv) of one kv chunk's part in an attention whose merged result over all chunks is
    ``out`` (float32) with log-sum-exp ``lse``, for the output cotangent ``dout``: the blockwise
    backward with the whole result's statistics (a ring's backward pass, chunk by chunk)."""
    data, _ = _data_parts(mask)
    _, backward = _blockwise_for(q, k, mask, q_offset, kv_offset, block_q, block_kv)
    offsets = (jnp.asarray(q_offset, jnp.int32), jnp.asarray(kv_offset, jnp.int32))
    dq, dk, dv, *_ = backward((q, k, v, *data, *offsets, out, lse), (dout, jnp.zeros_like(lse)))
    return dq, dk, dv


def _data_parts(mask: Mask):
    """((segment ids q, kv, token places q, kv), each None where not given), the mask without them."""
    _refuse_ring_places(mask)
    seg = (mask.segments.q, mask.segments.kv) if mask.segments is not None else (None, None)
    places = (mask.indices.q, mask.indices.kv) if mask.indices is not None else (None, None)
    return (*seg, *places), dataclasses.replace(mask, segments=None, indices=None)


def _blockwise_for(q, k, mask: Mask, q_offset, kv_offset, block_q: int, block_kv: int):
    bq = _block_size("block_q", block_q, q.shape[1])
    bk = _block_size("block_kv", block_kv, k.shape[1])
    table = _block_table(mask, q.shape[1], k.shape[1], q_offset, kv_offset)
    plan = block_plan(mask, q.shape[1], k.shape[1], bq, bk, q_offset, kv_offset)
    return _blockwise_fn(_data_parts(mask)[1], table, bq, bk, plan)


def merge(a, b):
    """Join two (output, log-sum-exp) partial results of the same queries over disjoint keys."""
    (oa, la), (ob, lb) = a, b
    m = jnp.maximum(la, lb)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # both -inf: nothing seen yet; keep exp() finite
    wa, wb = jnp.exp(la - m), jnp.exp(lb - m)
    total = wa + wb
    seen = total > 0
    safe = jnp.where(seen, total, 1.0)
    out = (oa * wa[..., None] + ob * wb[..., None]) / safe[..., None]
    return out, jnp.where(seen, m + jnp.log(safe), -jnp.inf)


def full_varying(shape, value, *like):
    """A float32 constant typed to vary over every mesh axis one of ``like`` varies over: inside
    shard_map a loop's carry keeps one type, and what it accumulates varies as its inputs do."""
    return vary_over(jnp.full(shape, value, jnp.float32), set().union(*(varying_axes(y) for y in like if y is not None)))


# --- naive ----------------------------------------------------------------------------------------


def _grouped(q, kv_heads):
    b, n, h, d = q.shape
    return q.reshape(b, n, kv_heads, h // kv_heads, d)


def _finish(m, l, acc):
    """Normalise an online-softmax state; rows that saw nothing give 0 and lse -inf."""
    seen = l > 0
    safe = jnp.where(seen, l, 1.0)
    return acc / safe[..., None], jnp.where(seen, m + jnp.log(safe), -jnp.inf)


def _naive(mask, q, k, v, q_offset, kv_offset):
    b, nq, h, d = q.shape
    kh = k.shape[2]
    ok = mask.dense(nq, k.shape[1], q_offset, kv_offset)
    s = jnp.einsum("bqkgd,bskd->bkgqs", _grouped(q, kh), k, preferred_element_type=jnp.float32) / math.sqrt(d)
    s = jnp.where(ok[:, None, None], s, -jnp.inf)
    m = jax.lax.stop_gradient(s.max(-1))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m[..., None])
    out, lse = _finish(m, p.sum(-1), jnp.einsum("bkgqs,bskd->bkgqd", p, v.astype(jnp.float32)))
    return out.transpose(0, 3, 1, 2, 4).reshape(b, nq, h, d), lse.transpose(0, 3, 1, 2).reshape(b, nq, h)


# --- blockwise ------------------------------------------------------------------------------------


def _lists(plan: np.ndarray):
    """Per row of the plan: the column indices to visit (padded) and how many."""
    counts = plan.sum(1).astype(np.int32)
    idx = np.zeros((plan.shape[0], max(int(counts.max(initial=0)), 1)), np.int32)
    for i, row in enumerate(plan):
        cols = np.nonzero(row)[0]
        idx[i, : len(cols)] = cols
    return idx, counts


UNROLL = 4  # a row of at most this many blocks, known at trace time, is written out: no while loop


def _visit(lists, i, step, init):
    """``step(j, carry)`` over the blocks j that row ``i`` of a plan's ``lists`` visits: written
    out where ``i`` is a Python int and the row short, else a while loop of the row's trip count."""
    idx, count = lists
    if isinstance(i, int) and count[i] <= UNROLL:
        carry = init
        for t in range(int(count[i])):
            carry = step(int(idx[i, t]), carry)
        return carry
    idx, count = jnp.asarray(idx), jnp.asarray(count)  # constants made here: a closed-over tracer would leak from the custom VJP
    return jax.lax.fori_loop(0, count[i], lambda t, carry: step(idx[i, t], carry), init)


def _blockwise_fn(mask: Mask, table, bq: int, bk: int, plan: np.ndarray):
    kv_lists = _lists(plan)  # forward: for each q block, its kv blocks
    q_lists = _lists(plan.T)  # backward: for each kv block, its q blocks

    def scores(qi, kj, i, j, data, q_off, kv_off):
        """(b, kv_heads, group, bq, bk) float32 scores of q block i against kv block j, masked;
        ``data``: the segment ids and token places (``_data_parts``) of the whole chunks."""
        seg_q, seg_kv, at_q, at_kv = data
        s = jnp.einsum("bqkgd,bskd->bkgqs", qi, kj, preferred_element_type=jnp.float32) / math.sqrt(qi.shape[-1])
        sq = None if seg_q is None else jax.lax.dynamic_slice_in_dim(seg_q, i * bq, bq, 1)
        sk = None if seg_kv is None else jax.lax.dynamic_slice_in_dim(seg_kv, j * bk, bk, 1)
        qpos = i * bq + jnp.arange(bq) if at_q is None else jax.lax.dynamic_slice_in_dim(at_q, i * bq, bq)
        kpos = j * bk + jnp.arange(bk) if at_kv is None else jax.lax.dynamic_slice_in_dim(at_kv, j * bk, bk)
        ok = _allowed(mask, table, q_off + qpos, kv_off + kpos, sq, sk)
        return jnp.where(ok[:, None, None], s, -jnp.inf), ok[:, None, None]

    def blocks(q, k, v):
        b, nq, h, d = q.shape
        kh = k.shape[2]
        return (_grouped(q, kh).reshape(b, nq // bq, bq, kh, h // kh, d), k.reshape(b, -1, bk, kh, d), v.reshape(b, -1, bk, kh, d))

    def forward(q, k, v, seg_q, seg_kv, at_q, at_kv, q_off, kv_off):
        data = (seg_q, seg_kv, at_q, at_kv)
        b, nq, h, d = q.shape
        qb, kb, vb = blocks(q, k, v)
        kh, g = qb.shape[3], qb.shape[4]

        def q_block(i):
            qi = qb[:, i]

            def step(j, carry):
                m, l, acc = carry
                s, _ = scores(qi, kb[:, j], i, j, data, q_off, kv_off)
                m_new = jnp.maximum(m, s.max(-1))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # all masked so far: exp(-inf) = 0
                p = jnp.exp(s - m_safe[..., None])
                corr = jnp.exp(m - m_safe)
                pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), vb[:, j], preferred_element_type=jnp.float32)
                return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv

            ins = (q, k, v, *data, q_off, kv_off)
            init = (full_varying((b, kh, g, bq), -jnp.inf, *ins), full_varying((b, kh, g, bq), 0.0, *ins), full_varying((b, kh, g, bq, d), 0.0, *ins))
            m, l, acc = _visit(kv_lists, i, step, init)  # only the kv blocks the plan keeps
            return _finish(jnp.where(jnp.isfinite(m), m, 0.0), l, acc)

        if nq == bq:  # one query block: no loop
            outs, lses = jax.tree.map(lambda x: x[None], q_block(0))
        else:
            outs, lses = jax.lax.map(q_block, jnp.arange(nq // bq))  # (nq, b, kh, g, bq[, d])
        return outs.transpose(1, 0, 4, 2, 3, 5).reshape(b, nq, h, d), lses.transpose(1, 0, 4, 2, 3).reshape(b, nq, h)

    @jax.custom_vjp
    def run(q, k, v, seg_q, seg_kv, at_q, at_kv, q_off, kv_off):
        return forward(q, k, v, seg_q, seg_kv, at_q, at_kv, q_off, kv_off)

    def run_fwd(q, k, v, seg_q, seg_kv, at_q, at_kv, q_off, kv_off):
        out, lse = forward(q, k, v, seg_q, seg_kv, at_q, at_kv, q_off, kv_off)
        return (out, lse), (q, k, v, seg_q, seg_kv, at_q, at_kv, q_off, kv_off, out, lse)

    def run_bwd(res, cts):
        q, k, v, seg_q, seg_kv, at_q, at_kv, q_off, kv_off, out, lse = res
        data = (seg_q, seg_kv, at_q, at_kv)
        dout, dlse = cts
        b, nq, h, d = q.shape
        qb, kb, vb = blocks(q, k, v)
        kh, g = qb.shape[3], qb.shape[4]
        dout = dout.astype(jnp.float32)
        # d lse / d s = p, so the lse cotangent enters as a shift of FlashAttention-2's D term
        delta = (dout * out).sum(-1) - dlse
        as_q = lambda x: x.reshape(b, nq // bq, bq, kh, g).transpose(0, 1, 3, 4, 2)  # (b, q blocks, kh, g, bq)
        dob = dout.reshape(b, nq // bq, bq, kh, g, d)
        lse_b = as_q(lse)
        lse_b = jnp.where(jnp.isfinite(lse_b), lse_b, 0.0)
        delta_b = as_q(delta)

        def kv_block(dq, j):
            kj, vj = kb[:, j], vb[:, j]

            def step(i, carry):
                dk, dv, dq = carry
                qi, doi = qb[:, i], dob[:, i]
                s, ok = scores(qi, kj, i, j, data, q_off, kv_off)
                p = jnp.where(ok, jnp.exp(s - lse_b[:, i][..., None]), 0.0)  # recomputed from the saved lse
                dv = dv + jnp.einsum("bkgqs,bqkgd->bskd", p, doi)
                dp = jnp.einsum("bqkgd,bskd->bkgqs", doi, vj.astype(jnp.float32))
                ds = p * (dp - delta_b[:, i][..., None]) / math.sqrt(d)
                dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", ds, qi.astype(jnp.float32))
                dq = dq.at[:, i].add(jnp.einsum("bkgqs,bskd->bqkgd", ds, kj.astype(jnp.float32)))
                return dk, dv, dq

            zero = full_varying((b, bk, kh, d), 0.0, q, k, v, dout, *data, q_off, kv_off)
            dk, dv, dq = _visit(q_lists, j, step, (zero, zero, dq))
            return dq, (dk, dv)

        dq0 = full_varying(qb.shape, 0.0, q, k, v, dout, *data, q_off, kv_off)
        if k.shape[1] == bk:  # one key block: no loop
            dq, (dk, dv) = kv_block(dq0, 0)
            dk, dv = dk[None], dv[None]
        else:
            dq, (dk, dv) = jax.lax.scan(kv_block, dq0, jnp.arange(k.shape[1] // bk))
        unblock = lambda x: x.transpose(1, 0, 2, 3, 4).reshape(k.shape)
        return (dq.reshape(q.shape).astype(q.dtype), unblock(dk).astype(k.dtype), unblock(dv).astype(v.dtype), None, None, None, None, None, None)

    run.defvjp(run_fwd, run_bwd)
    return run, run_bwd


# --- splash (TPU) ---------------------------------------------------------------------------------


def splash_mask(mask: Mask, q_len: int, kv_len: int):
    """The splash-attention mask object (one head) for the static parts of ``mask``."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    shape = (q_len, kv_len)
    if mask.blocks is not None:
        with jax.ensure_compile_time_eval():  # a numpy array even under jit: splash reads it at trace time
            return sa.NumpyMask(np.asarray(dataclasses.replace(mask, segments=None).dense(q_len, kv_len))[0])
    if mask.window is not None:
        left, right = mask.window
        return sa.LocalMask(shape, window_size=(left, 0 if mask.causal else right), offset=0)
    if mask.causal:
        return sa.CausalMask(shape)
    return sa.FullMask(shape)


def _splash(q, k, v, mask: Mask, block_q: int, block_kv: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    b, nq, h, d = q.shape
    nk = k.shape[1]
    if nq % 128 or nk % 128:
        raise JaxparError(f"implementation='splash' needs lengths that are multiples of 128; got q_len {nq}, kv_len {nk}: use 'blockwise'")
    bq = _block_size("block_q", block_q, nq)
    bk = _block_size("block_kv", block_kv, nk)
    sizes = sa.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq, block_kv_dkv=bk, block_kv_dkv_compute=bk, block_q_dq=bq, block_kv_dq=bk)
    kernel = sa.make_splash_mha(sa.MultiHeadMask([splash_mask(mask, nq, nk)] * h), block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)
    # the kernel takes no scale: scale q first (MaxText does the same); heads-major, one batch row
    qt = (q / math.sqrt(d)).astype(q.dtype).transpose(0, 2, 1, 3)
    kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    if mask.segments is None:
        out = jax.vmap(lambda q1, k1, v1: kernel(q1, k1, v1))(qt, kt, vt)
    else:
        seg = mask.segments
        out = jax.vmap(lambda q1, k1, v1, sq, sk: kernel(q1, k1, v1, segment_ids=sa.SegmentIds(sq, sk)))(qt, kt, vt, seg.q.astype(jnp.int32), seg.kv.astype(jnp.int32))
    return out.transpose(0, 2, 1, 3).astype(q.dtype)
