"""The quantizer's Triton kernels on one NVIDIA GPU: bitwise checks against the XLA twins, then speed.

    JAX_PLATFORMS=cuda python benchmarks/gpu_kernels.py [out.json]     # H100 / H200, jax[cuda]
    python benchmarks/gpu_kernels.py --interpret-smoke [out.json]      # any machine: tiny, interpret mode

1. Bitwise: ``encode_groups_kernel`` / ``decode_groups_kernel`` (backend "gpu") against
   ``quantize.encode_groups`` / ``decode_groups`` on ~64M heavy-tailed values with mixed widths, a
   zero block and a NaN block, with and without dither, decode with and without the accumulate.
   Mismatches are counted, never raised. The accumulate is compared with the twin's decode plus a
   separate add (``ieee``) and, for information, with the jitted twin, which XLA may contract into
   an FMA (``xla_fused``).
2. Speed: medians of 20 runs of encode and of decode + accumulate, kernels and XLA twins, in GB/s
   of the bytes a pass must move (values, planes, scales, widths, local, output) and as a fraction
   of the card's HBM bandwidth; a sweep of the kernels' tile and warps; and a whole
   ``quantize_dynamiq`` + ``dequantize_dynamiq`` round trip (scales, widths, compaction: the XLA
   parts included) with the twins and with the kernels.

Figures go to stdout and to the JSON file (default ./gpu_kernels.json). Runs in well under 3 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's jaxpar, installed or not

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxpar.collectives import quantize as Q  # noqa: E402
from jaxpar.kernels import quantize as K  # noqa: E402
from jaxpar.kernels import wire as W  # noqa: E402

warnings.filterwarnings("ignore", "The Pallas Triton backend is deprecated", DeprecationWarning)

HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}  # SXM parts; a PCIe H100 is lower (2.0e12)
BITS = 4.0  # average width of the round trip
START = np.uint32(12345)


def hbm_peak(kind: str) -> float | None:
    if "H100" in kind and "PCIe" in kind:
        return 2.0e12
    return next((bw for name, bw in HBM_BYTES_PER_S.items() if name in kind), None)


def message(groups: int, seed: int = 0):
    """Heavy-tailed values (Student t, 1.5 dof) whose group magnitudes span ~12 orders, the twins'
    own group scales, widths 2..12 at random, local values; block 1 all zero, block 2 with NaN/inf."""
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)

    @jax.jit
    def make():
        values = jax.random.t(k1, 1.5, (groups, W.GROUP), jnp.float32)
        values = values * jnp.exp(jax.random.uniform(k2, (groups, 1), jnp.float32, -14.0, 14.0))
        values = values.at[8:16].set(0.0).at[16, 3].set(jnp.nan).at[17, 0].set(jnp.inf)
        gscale = Q.group_scales(*Q.block_scales(values.reshape(-1)))
        width = jax.random.randint(k3, (groups,), W.MIN_BITS, W.MAX_BITS + 1, jnp.int32)
        local = jax.random.normal(k4, (groups, W.GROUP), jnp.float32)
        return values, gscale, width, local

    return jax.block_until_ready(make())


def differing(a, b) -> int:
    """How many 32-bit words differ (NaNs compared by their bits)."""
    bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint32) if x.dtype == jnp.float32 else x  # noqa: E731
    return int(jax.jit(lambda x, y: jnp.sum(bits(x) != bits(y)))(a, b))


def median_seconds(fn, *args, runs: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def speed(seconds: float, nbytes: int, peak: float | None) -> dict:
    rate = nbytes / seconds
    return {"ms": seconds * 1e3, "GB_per_s": rate / 1e9, "fraction_of_hbm": None if peak is None else rate / peak}


def record(report: dict, name: str, part) -> None:
    """Run one part; a failure is recorded in the report and the script goes on."""
    t = time.perf_counter()
    try:
        report[name] = part()
    except Exception as err:  # noqa: BLE001 - one broken part must not hide the others
        traceback.print_exc()
        report[name] = {"error": f"{type(err).__name__}: {err}"[:2000]}
    print(f"[{name}] {time.perf_counter() - t:.1f} s: {json.dumps(report[name], default=str)[:1500]}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="gpu_kernels.json", help="JSON file for the figures")
    parser.add_argument("--interpret-smoke", action="store_true", help="tiny sizes in interpret mode, on any machine")
    parser.add_argument("--values", type=int, default=64 * 2**20, help="values per message (default 64M)")
    args = parser.parse_args(argv)

    began = time.perf_counter()
    smoke = args.interpret_smoke
    device = jax.devices()[0]
    if not smoke and device.platform != "gpu":
        print(f"no GPU: the default device is {device} (use --interpret-smoke on a machine without one)", file=sys.stderr)
        return 2
    interpret = smoke
    groups = 1024 + 40 if smoke else args.values // W.GROUP  # the smoke size also pads a partial tile
    runs = 2 if smoke else 20
    peak = None if smoke else hbm_peak(device.device_kind)
    report = {
        "device": device.device_kind,
        "platform": device.platform,
        "jax": jax.__version__,
        "interpret": interpret,
        "values": groups * W.GROUP,
        "groups": groups,
        "runs_per_median": runs,
        "hbm_bytes_per_s": peak,
        "kernel_tile_groups": K.GPU_TILE,
        "kernel_warps": K.GPU_WARPS,
    }
    print(json.dumps(report), flush=True)
    values, gscale, width, local = message(groups)
    mseed = W.message_seed(2024, 1, 3)
    planes_rand = jax.random.bits(jax.random.key(7), (groups, W.MAX_BITS), jnp.uint32)

    def kernels():  # fresh jits: the kernels read K.GPU_* when traced
        return (
            jax.jit(lambda v, s, w, m: K.encode_groups_kernel(v, s, w, m, START, backend="gpu", interpret=interpret)),
            jax.jit(lambda p, s, w, m, x: K.decode_groups_kernel(p, s, w, m, START, x, backend="gpu", interpret=interpret)),
        )

    encode_t = jax.jit(lambda v, s, w, m: W.encode_groups(v, s, w, m, START))
    decode_t = jax.jit(lambda p, s, w, m, x: W.decode_groups(p, s, w, m, START, x))
    add = jax.jit(jnp.add)  # a separate add: no FMA with the decode's multiply

    def accumulate_compiles():
        """The accumulate's inline PTX is the one part no CPU test compiles: if Triton refuses it,
        fall back to a plain add (which Triton may fuse into an FMA) and say so."""
        small = [a[: 4 * K.GPU_TILE] for a in (planes_rand, gscale, width, local)]
        try:
            jax.block_until_ready(kernels()[1](small[0], small[1], small[2], mseed, small[3]))
            return {"unfused_add": True}
        except Exception as err:  # noqa: BLE001
            traceback.print_exc()
            K.GPU_UNFUSED_ADD = False
            return {"unfused_add": False, "error": f"{type(err).__name__}: {err}"[:2000]}

    record(report, "accumulate_kernel", accumulate_compiles)
    encode_k, decode_k = kernels()

    def bitwise():
        out = {}
        for seeded in (True, False):
            m = mseed if seeded else None
            tag = "dither" if seeded else "nearest"
            twin_planes = encode_t(values, gscale, width, m)
            out[f"encode_{tag}"] = differing(encode_k(values, gscale, width, m), twin_planes)
            for planes_name, planes in (("encoded", twin_planes), ("random_words", planes_rand)):
                plain = decode_t(planes, gscale, width, m, None)
                out[f"decode_{tag}_{planes_name}"] = differing(decode_k(planes, gscale, width, m, None), plain)
                got = decode_k(planes, gscale, width, m, local)
                out[f"decode_local_{tag}_{planes_name}_ieee"] = differing(got, add(plain, local))
                out[f"decode_local_{tag}_{planes_name}_xla_fused"] = differing(got, decode_t(planes, gscale, width, m, local))
        out["words_compared_encode"] = groups * W.MAX_BITS
        out["words_compared_decode"] = groups * W.GROUP
        out["all_equal"] = all(v == 0 for k, v in out.items() if not k.endswith("xla_fused") and not k.startswith("words"))
        return out

    record(report, "bitwise", bitwise)

    encode_bytes = groups * (W.GROUP * 4 + 4 + 4 + W.MAX_BITS * 4)  # values, scale, width in; planes out
    decode_bytes = groups * (W.MAX_BITS * 4 + 4 + 4 + 2 * W.GROUP * 4)  # planes, scale, width, local in; values out

    def encode_speed(fn):
        return speed(median_seconds(fn, values, gscale, width, mseed, runs=runs), encode_bytes, peak)

    def decode_speed(fn, planes):
        return speed(median_seconds(fn, planes, gscale, width, mseed, local, runs=runs), decode_bytes, peak)

    def speeds():
        planes = encode_t(values, gscale, width, mseed)
        return {
            "encode_kernel": encode_speed(encode_k),
            "encode_xla_twin": encode_speed(encode_t),
            "decode_accumulate_kernel": decode_speed(decode_k, planes),
            "decode_accumulate_xla_twin": decode_speed(decode_t, planes),
            "bytes_encode": encode_bytes,
            "bytes_decode_accumulate": decode_bytes,
        }

    record(report, "speed", speeds)

    def round_trip():
        x, acc = values.reshape(-1), local.reshape(-1)
        x = jnp.where(jnp.isfinite(x), x, 0.0)  # a NaN block would poison the comparison of sums

        out, results = {}, {}
        for name, impl in (("xla_twins", W.TWINS), ("kernels", K.pallas_impl("gpu", interpret=interpret))):

            def trip(x, acc):
                packed = Q.quantize_dynamiq(x, BITS, mseed, impl=impl)
                return packed, Q.dequantize_dynamiq(packed, BITS, mseed, acc, impl=impl)

            def quantize_only(x):
                return Q.quantize_dynamiq(x, BITS, mseed, impl=impl)

            trip_j, quant_j = jax.jit(trip), jax.jit(quantize_only)
            results[name] = jax.block_until_ready(trip_j(x, acc))
            out[name] = {
                "round_trip_ms": median_seconds(trip_j, x, acc, runs=runs) * 1e3,
                "quantize_ms": median_seconds(quant_j, x, runs=runs) * 1e3,
            }
        (p_twin, y_twin), (p_kern, y_kern) = results["xla_twins"], results["kernels"]
        out["bits"] = BITS
        out["packed_words_differing"] = differing(p_kern.words, p_twin.words)
        out["decoded_words_differing"] = differing(y_kern, y_twin)  # may be > 0: the twin's accumulate can be an FMA
        out["decoded_max_abs_diff"] = float(jnp.max(jnp.abs(y_kern - y_twin)))
        out["speedup"] = out["xla_twins"]["round_trip_ms"] / out["kernels"]["round_trip_ms"]
        return out

    record(report, "round_trip", round_trip)

    def sweep():
        planes, out, default = encode_t(values, gscale, width, mseed), [], (K.GPU_TILE, K.GPU_WARPS)
        try:
            configs = [(64, 4)] if smoke else [(t, w) for t in (64, 128, 256) for w in (2, 4, 8)]
            for tile, warps in configs:
                if time.perf_counter() - began > 140:  # keep the whole run under 3 minutes
                    out.append({"stopped": "time budget"})
                    return out
                K.GPU_TILE, K.GPU_WARPS = tile, warps
                enc, dec = kernels()
                row = {"tile_groups": tile, "warps": warps}
                try:
                    row["encode"], row["decode_accumulate"] = encode_speed(enc), decode_speed(dec, planes)
                except Exception as err:  # noqa: BLE001
                    row["error"] = f"{type(err).__name__}: {err}"[:500]
                out.append(row)
        finally:
            K.GPU_TILE, K.GPU_WARPS = default
        return out

    record(report, "kernel_sweep", sweep)
    report["seconds"] = time.perf_counter() - began
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {os.path.abspath(args.out)} after {report['seconds']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
