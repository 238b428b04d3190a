"""Compressed multi-hop all-reduce and reduce-scatter over a named mesh axis, inside ``shard_map``.

A ring (or, for power-of-two axes, a butterfly: recursive halving then doubling) of ``ppermute``
hops. In the reduce phase each hop dequantizes the partial sum it receives, adds the local values
and quantizes again; in the all-gather phase the owner of each finished chunk quantizes it once
and the compressed chunk is forwarded untouched, every rank (the owner too) decoding the same
bits, so every rank ends with a bit-identical result.

Randomness for stochastic rounding comes from one ``seed`` shared by all ranks, folded with the
hop and the chunk, so a run is reproducible and every rank can tell which dither a value saw.

``scheme``: ``exact`` (``psum`` / ``psum_scatter``), ``dynamiq`` (hierarchical scales, per-group
widths, see ``quantize.py``) or ``uniform`` (the naive per-hop quantizer). Sizes that do not
divide into blocks or ranks are padded, never refused; tensors smaller than ``min_size`` values
per rank fall back to the exact collective, where compression gains nothing.

``impl`` (a ``jaxpar.kernels.wire.GroupImpl``) does each message's per-group encode and decode: the
pure-JAX twins by default, or the Pallas kernels (``jaxpar.kernels.quantize.pallas_impl``), with
the same bits.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxpar.collectives.quantize import QUANTIZERS, check_bits
from jaxpar.kernels.wire import BLOCK, MAX_BITS, MIN_BITS, TWINS, GroupImpl, Packed, message_seed

SCHEMES = ("exact", "dynamiq", "uniform")


@functools.lru_cache(maxsize=64)
def hop_bits(algorithm: str, ranks: int, bits: float) -> tuple[float, ...]:
    """Average bit width of each hop's messages, in eighths of a bit: reduce hops 0.. then the
    all-gather (last entry), with the wire average at most ``bits``.

    A value quantized as part of a sum of k vectors adds error ~ k 4^-b; a hop's weight w sums
    that over the times each value is quantized at that hop (a butterfly hop j quantizes each
    value on ranks / 2^(j+1) ranks, as sums of 2^j vectors). Its cost c is the chunks it puts on
    the wire (the all-gather chunk is forwarded ranks - 1 times). Minimising sum w 4^-b within
    sum c b <= budget gives b = lam + log2(w / c) / 2 (clipped to the allowed widths), so later
    hops, whose partial sums are larger, get more bits."""
    if algorithm == "ring":
        weights = [k + 1 for k in range(ranks - 1)] + [ranks]
        costs = [1] * (ranks - 1) + [ranks - 1]
    else:
        hops = ranks.bit_length() - 1
        weights = [(ranks >> (j + 1)) * 2**j for j in range(hops)] + [ranks]
        costs = [ranks >> (j + 1) for j in range(hops)] + [ranks - 1]
    budget = bits * sum(costs)
    tilt = [0.5 * math.log2(w / c) for w, c in zip(weights, costs)]

    def widths(lam):
        return [min(max(lam + t, MIN_BITS), MAX_BITS) for t in tilt]

    lo, hi = MIN_BITS - max(tilt), MAX_BITS - min(tilt)
    for _ in range(60):  # the budget spent grows with lam
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(c * b for c, b in zip(costs, widths(mid))) <= budget else (lo, mid)
    return tuple(math.floor(b * 8 + 1e-9) / 8 for b in widths(lo))


class _Codec:
    """Quantize / dequantize with the hop's width and seed; ``None`` seed = nearest rounding.
    Hop ``len(widths) - 1`` is the all-gather's."""

    def __init__(self, scheme: str, widths: tuple[float, ...], seed, impl: GroupImpl):
        self.quantize, self.dequantize = QUANTIZERS[scheme]
        self.widths, self.seed, self.impl = widths, seed, impl
        self.gather_hop = len(widths) - 1

    def _seed(self, hop, chunk):
        return None if self.seed is None else message_seed(self.seed, hop, chunk)

    def encode(self, values, hop, chunk) -> Packed:
        return self.quantize(values, self.widths[hop], self._seed(hop, chunk), impl=self.impl)

    def decode(self, packed: Packed, hop, chunk, local=None):
        """The receiver names the hop and chunk it got, and so draws the sender's dither; a reduce
        hop adds its ``local`` values in the same pass."""
        return self.dequantize(packed, self.widths[hop], self._seed(hop, chunk), local, impl=self.impl)


DEFAULT_BITS = {"dynamiq": 5.125, "uniform": 8}  # dynamiq: 5.5 bits per value on the wire, scales included


def _codec(scheme: str, algorithm: str, ranks: int, bits: float | None, seed, impl: GroupImpl) -> tuple[_Codec | None, str]:
    """The codec of a compressed collective (None for an exact one) and the algorithm it runs."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme {scheme!r} is not one of {', '.join(SCHEMES)}")
    if algorithm not in ("auto", "ring", "butterfly"):
        raise ValueError(f"algorithm {algorithm!r} is not 'auto', 'ring' or 'butterfly'")
    power_of_two = ranks & (ranks - 1) == 0
    if algorithm == "butterfly" and not power_of_two:
        raise ValueError(f"the butterfly needs a power-of-two axis; this one has {ranks} ranks: use algorithm='ring'")
    if algorithm == "auto":  # the butterfly quantizes each value fewer times (log2 ranks hops, not ranks - 1)
        algorithm = "butterfly" if power_of_two else "ring"
    if scheme == "exact":
        return None, algorithm
    bits = DEFAULT_BITS[scheme] if bits is None else bits
    check_bits(bits, scheme)
    widths = hop_bits(algorithm, ranks, bits) if scheme == "dynamiq" else (bits,) * ranks
    return _Codec(scheme, widths, seed, impl), algorithm


def _chunks(x: jax.Array, ranks: int) -> tuple[jax.Array, int]:
    """x flattened to float32 and padded into [ranks, chunk] with chunk a multiple of BLOCK."""
    flat = x.reshape(-1).astype(jnp.float32)
    chunk = math.ceil(flat.size / ranks / BLOCK) * BLOCK
    return jnp.pad(flat, (0, ranks * chunk - flat.size)).reshape(ranks, chunk), chunk


def _ring_reduce_scatter(chunks, axis_name, ranks, codec):
    """Rank r ends with the sum of chunk r (float32), after ranks - 1 compressed hops."""
    r = jax.lax.axis_index(axis_name)
    to_next = [(i, (i + 1) % ranks) for i in range(ranks)]
    first = (r - 1) % ranks
    packed = codec.encode(chunks[first], 0, first)
    for hop in range(ranks - 1):
        c = (r - hop - 2) % ranks
        partial = codec.decode(jax.lax.ppermute(packed, axis_name, to_next), hop, c, chunks[c])
        if hop < ranks - 2:
            packed = codec.encode(partial, hop + 1, c)
    return partial


def _ring_all_gather(mine, axis_name, ranks, codec, chunk, transport="ppermute"):
    """Every rank gets every rank's chunk, decoded from the owner's one compressed copy.
    ``transport``: the hops as XLA ppermutes, or the Pallas TPU ring kernel (``pallas_ring``)."""
    r = jax.lax.axis_index(axis_name)
    to_next = [(i, (i + 1) % ranks) for i in range(ranks)]
    packed = codec.encode(mine, codec.gather_hop, r)
    if transport == "pallas_ring":
        from jaxpar.kernels import ring  # Pallas is imported only where the kernel is asked for

        gathered = ring.ring_all_gather_packed(packed, axis_name)  # [ranks, ...] per field, row = owner
        return jnp.stack([codec.decode(jax.tree.map(lambda a: a[o], gathered), codec.gather_hop, o) for o in range(ranks)])
    out = jnp.zeros((ranks, chunk), jnp.float32).at[r].set(codec.decode(packed, codec.gather_hop, r))
    for hop in range(ranks - 1):
        packed = jax.lax.ppermute(packed, axis_name, to_next)
        owner = (r - hop - 1) % ranks
        out = out.at[owner].set(codec.decode(packed, codec.gather_hop, owner))
    return out


def _butterfly_reduce_scatter(chunks, axis_name, ranks, codec):
    """Recursive halving: log2(ranks) hops, each sending half of what is left, compressed."""
    r = jax.lax.axis_index(axis_name)
    segment = chunks  # the chunks this rank still reduces, [len, chunk]
    distance, hop = ranks // 2, 0
    while distance:
        low, high = segment[:distance], segment[distance:]
        upper = (r // distance) % 2 == 1  # keep the upper half, send the lower one
        keep, send = jnp.where(upper, high, low), jnp.where(upper, low, high)
        # a half is named by its first chunk id, for the dither key: the same on sender and receiver
        base = (r // (2 * distance)) * 2 * distance
        packed = codec.encode(send.reshape(-1), hop, base + jnp.where(upper, 0, distance))
        received = jax.lax.ppermute(packed, axis_name, [(i, i ^ distance) for i in range(ranks)])
        segment = codec.decode(received, hop, base + jnp.where(upper, distance, 0), keep.reshape(-1)).reshape(keep.shape)
        distance, hop = distance // 2, hop + 1
    return segment[0]


def _butterfly_all_gather(mine, axis_name, ranks, codec, chunk):
    """Recursive doubling of the owners' compressed chunks, forwarded untouched."""
    r = jax.lax.axis_index(axis_name)
    packed = codec.encode(mine, codec.gather_hop, r)
    distance = 1
    while distance < ranks:
        theirs = jax.lax.ppermute(packed, axis_name, [(i, i ^ distance) for i in range(ranks)])
        upper = (r // distance) % 2 == 1
        packed = jax.tree.map(
            lambda a, b: jnp.where(upper, jnp.concatenate([b, a]), jnp.concatenate([a, b])), packed, theirs
        )
        distance *= 2
    by_owner = jax.tree.map(lambda a: a.reshape((ranks, a.shape[0] // ranks) + a.shape[1:]), packed)
    return jax.vmap(lambda p, owner: codec.decode(p, codec.gather_hop, owner))(by_owner, jnp.arange(ranks))


_REDUCE_SCATTER = {"ring": _ring_reduce_scatter, "butterfly": _butterfly_reduce_scatter}
_ALL_GATHER = {"ring": _ring_all_gather, "butterfly": _butterfly_all_gather}


def all_reduce(
    x: jax.Array, axis_name: str, *, scheme: str = "dynamiq", bits: float | None = None, seed=0,
    algorithm: str = "auto", min_size: int = 4096, all_gather_transport: str = "ppermute", impl: GroupImpl = TWINS,
) -> jax.Array:
    """Sum of ``x`` over ``axis_name``, compressed on the wire; bit-identical on every rank.

    ``bits``: average payload bits per value (default 5.125 for dynamiq, 8 for uniform); ``seed``
    (an int, or a traced integer such as the step) drives the shared dither, None rounds to
    nearest; ``algorithm``: auto (butterfly on power-of-two axes, else ring), ring or butterfly;
    ``all_gather_transport``: ``ppermute`` (XLA hops) or ``pallas_ring`` (the ring's all-gather as
    one Pallas TPU kernel with remote DMAs, ``jaxpar.kernels.ring``; algorithm ring only; on CPU
    under ``pltpu.force_tpu_interpret_mode()``). Both give the same bits. ``impl``: the per-group
    encode / decode (see the module doc)."""
    if all_gather_transport not in ("ppermute", "pallas_ring"):
        raise ValueError(f"all_gather_transport {all_gather_transport!r} is not 'ppermute' or 'pallas_ring'")
    ranks = jax.lax.axis_size(axis_name)
    codec, algorithm = _codec(scheme, algorithm, ranks, bits, seed, impl)
    if all_gather_transport == "pallas_ring" and algorithm != "ring":
        raise ValueError(f"all_gather_transport='pallas_ring' runs the ring's all-gather; algorithm is {algorithm!r}: pass algorithm='ring'")
    if codec is None or ranks == 1 or x.size < min_size * ranks:
        return jax.lax.psum(x, axis_name)
    chunks, chunk = _chunks(x, ranks)
    mine = _REDUCE_SCATTER[algorithm](chunks, axis_name, ranks, codec)
    if algorithm == "ring":
        total = _ring_all_gather(mine, axis_name, ranks, codec, chunk, all_gather_transport)
    else:
        total = _ALL_GATHER[algorithm](mine, axis_name, ranks, codec, chunk)
    return total.reshape(-1)[: x.size].reshape(x.shape).astype(x.dtype)


def reduce_scatter(
    x: jax.Array, axis_name: str, *, scheme: str = "dynamiq", bits: float | None = None, seed=0,
    algorithm: str = "auto", min_size: int = 4096, impl: GroupImpl = TWINS,
) -> jax.Array:
    """``psum_scatter(x, axis_name, scatter_dimension=0, tiled=True)``, compressed on the wire:
    rank r gets the sum of block r of ``x``'s leading dimension (which the ranks must divide)."""
    ranks = jax.lax.axis_size(axis_name)
    codec, algorithm = _codec(scheme, algorithm, ranks, bits, seed, impl)
    if x.shape[0] % ranks:
        raise ValueError(f"leading dimension {x.shape[0]} of a reduce-scatter must divide over {ranks} ranks")
    if codec is None or ranks == 1 or x.size < min_size * ranks:
        return jax.lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=True)
    rows = x.reshape(ranks, -1).astype(jnp.float32)
    per_rank = rows.shape[1]
    chunk = math.ceil(per_rank / BLOCK) * BLOCK
    chunks = jnp.pad(rows, ((0, 0), (0, chunk - per_rank)))
    mine = _REDUCE_SCATTER[algorithm](chunks, axis_name, ranks, codec)
    return mine[:per_rank].reshape((x.shape[0] // ranks,) + x.shape[1:]).astype(x.dtype)


def two_hop_all_reduce(x: jax.Array, axis_name: str, *, bits: int = 4, seed=0, impl: GroupImpl = TWINS) -> jax.Array:
    """The two-hop baseline (ZeRO++ qgZ style): every rank quantizes each rank's chunk of its own
    vector once (uniform, ``bits``), one all-to-all delivers them, each owner sums the ranks - 1
    decoded chunks and its own, and the owners' quantized sums are all-gathered. Each value is
    quantized twice, but every rank sends its whole vector in the first hop. For benchmarks."""
    ranks = jax.lax.axis_size(axis_name)
    codec, _ = _codec("uniform", "ring", ranks, bits, seed, impl)
    r = jax.lax.axis_index(axis_name)
    chunks, chunk = _chunks(x, ranks)
    sent = jax.vmap(lambda c, dest: codec.encode(c, 0, dest * ranks + r))(chunks, jnp.arange(ranks))
    got = jax.tree.map(lambda a: jax.lax.all_to_all(a, axis_name, 0, 0, tiled=True), sent)
    decoded = jax.vmap(lambda p, sender: codec.decode(p, 0, r * ranks + sender))(got, jnp.arange(ranks))
    mine = jnp.sum(jnp.where((jnp.arange(ranks) == r)[:, None], chunks[r], decoded), axis=0)
    packed = codec.encode(mine, codec.gather_hop, r)
    gathered = jax.tree.map(lambda a: jax.lax.all_gather(a, axis_name), packed)
    total = jax.vmap(lambda p, owner: codec.decode(p, codec.gather_hop, owner))(gathered, jnp.arange(ranks))
    return total.reshape(-1)[: x.size].reshape(x.shape).astype(x.dtype)
