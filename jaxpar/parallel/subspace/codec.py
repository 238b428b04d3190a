"""The subspace and the pipeline boundary's code: what a stage sends is the residual stream's
coordinates in a fixed k-dimensional subspace, not the stream.

Under ``subspace=k`` every write a model makes to its residual stream (``jaxpar.nn.residual_add``)
is projected onto span(U), U a fixed (d, k) matrix with orthonormal columns drawn from a fixed
seed, the same on every device and never sent (a constant of the program). The stream after the
embedding is then ``x = x0 + U c``: ``x0`` the embedding's output, ``c`` k coordinates. Each stage
of an SPMD pipeline holds the edge weights and the micro-batch, so it computes ``x0`` itself: a
boundary carries ``c = U^T (x - x0)`` (k values a position, against d) each way, and the next
stage rebuilds ``x = x0 + U c``, exactly up to float rounding. (The subspace networks of arXiv
2506.01260 add a fixed token embedding to the stream and send the token id with ``c``, for stages
that hold no embedding; here every stage holds one, so the id is not needed.)

Through the boundary the gradients are the stream's too: ``x``'s gradient reaches ``c`` as
``U^T dx`` and the embedding, which every stage rebuilds, gets its part of the gradient from
each stage (the pipeline sums the edge weights' gradients over the stages). With k = d, U is
square and orthonormal and the model is the dense one.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

SEED = 2506  # one basis for every device, run and process: the boundary's code depends on it


@functools.lru_cache(maxsize=16)
def basis(width: int, k: int) -> np.ndarray:
    """U: (width, k) float32 with orthonormal columns, from ``SEED`` (a QR of a Gaussian matrix),
    made on the host once and put in the program as a constant."""
    gaussian = np.random.default_rng(SEED).standard_normal((width, k))
    q, r = np.linalg.qr(gaussian)
    return (q * np.sign(np.diag(r))).astype(np.float32)  # (signs fixed: one U for every QR)


def project(y, k: int):
    """``y`` (..., d) projected onto the subspace: U U^T y, in float32 (U in bf16 would not be
    orthonormal to the code's rounding)."""
    u = jnp.asarray(basis(y.shape[-1], k))
    return ((y.astype(jnp.float32) @ u) @ u.T).astype(y.dtype)


def _change_and_coordinates(x, x0, k: int):
    """(x - x0, U^T (x - x0)), in float32."""
    v = x.astype(jnp.float32) - x0.astype(jnp.float32)
    return v, v @ jnp.asarray(basis(x.shape[-1], k))


def encode(x, x0, k: int):
    """The coordinates a boundary carries, in ``x``'s dtype: U^T (x - x0)."""
    return _change_and_coordinates(x, x0, k)[1].astype(x.dtype)


# A stage's output may leave x0 + span(U) by its rounding (each write rounded to the stream's
# dtype: about eps times the stream per write) and by no more than this share of the change.
STRAY_SHARE = 1e-3
ROUNDING_ALLOWANCE = 64


def checked_encode(y, x0, k: int):
    """``encode(y, x0, k)``, made NaN when ``y - x0`` has more outside span(U) than rounding makes:
    a write to the stream the model did not mark with ``residual_add`` (not projected) would be
    dropped at the boundary, and the pipeline would train another function than its one-device
    twin, which keeps it. The step is then non-finite (not applied) and the message says why
    (``nonfinite_cause``). Its cost: two sums of squares (||v||^2 - ||U^T v||^2 is the part
    outside, U's columns orthonormal); a step inside the subspace is bitwise unchanged."""
    v, c = _change_and_coordinates(y, x0, k)
    change = jnp.sum(v * v)
    outside = change - jnp.sum(c * c)
    rounding = ROUNDING_ALLOWANCE * float(jnp.finfo(y.dtype).eps) ** 2 * jnp.sum(jnp.square(y.astype(jnp.float32)))
    poison = jax.lax.stop_gradient(jnp.where(outside > STRAY_SHARE * change + rounding, jnp.nan, 0.0))
    return (c + poison).astype(y.dtype)


def decode(c, x0, k: int):
    """The stream back from its coordinates, in ``x0``'s dtype: x0 + U c."""
    u = jnp.asarray(basis(x0.shape[-1], k))
    return (x0.astype(jnp.float32) + c.astype(jnp.float32) @ u.T).astype(x0.dtype)


@dataclasses.dataclass(frozen=True)
class SubspacePieces:
    """A model's pipeline pieces (``pipeline.PipelineModel`` or ``LayerScanPieces``) whose
    boundaries carry the stream's k coordinates: the first piece hands on zero coordinates (the
    stream is then the embedding), each stage rebuilds the stream from the embedding it computes
    again, runs its chunk and hands on the coordinates of the result, the last piece rebuilds it."""

    pieces: object
    k: int
    reads_edge_everywhere = True  # every stage computes the embedding: each one's edge gradients count

    def first(self, edge, chunk, batch):
        # zeros, typed as the stream's coordinates; no gradient: the stage after it rebuilds x0
        x0 = jax.lax.stop_gradient(self.pieces.first(edge, chunk, batch))
        return encode(x0, x0, self.k)

    def stage(self, edge, chunk, c, batch):
        x0 = self.pieces.first(edge, chunk, batch)
        return checked_encode(self.pieces.stage(edge, chunk, decode(c, x0, self.k), batch), x0, self.k)

    def last(self, edge, chunk, c, batch):
        x0 = self.pieces.first(edge, chunk, batch)
        return self.pieces.last(edge, chunk, decode(c, x0, self.k), batch)
