"""Bounds under a layout (``jaxpar.verify``): what each device holds and how long the bounds take,
on one device against ``fsdp=8``, ``tensor=2`` and ``tensor=4`` (8 simulated CPU devices).

    python benchmarks/verify.py [--widths 1024,2048,4096,8192] [--layers 4,8] [--alpha-widths ...]
                                [--budget-gib 1] [--breakdown 4096x8] [--time-widths 256,512,1024] [--runs 5]
                                [--skip memory,budget,no-ynn,breakdown,time]

1. Memory by the compiler, no weights made: random MLPs of ``layers`` dense layers (width -> width,
   the last width -> 10) with ``jax.ShapeDtypeStruct`` weights, one region, the 10 outputs as
   specifications, compiled by ``compile_bound`` and not run. Per device: the weight shards, the
   compiled temporaries, and the peak = arguments + outputs + temporaries. (XLA:CPU's
   ``peak_memory`` is arguments + outputs only: it leaves out the temporaries, which XLA:CPU holds
   as one block sized by its heap simulation, so it is not the peak here.) Then, for a per-device
   budget, the widest MLP whose CROWN program fits on one device, under fsdp=8 and under tensor=4;
   and CROWN's peaks again with XLA:CPU's YNNPACK fusions off (``xla_cpu_experimental_ynn_fusion_type``
   empty), which otherwise take their operands materialized.
2. Where the peak goes: the values live at XLA's peak (its live-range report, dumped with the
   optimized HLO), by kind; with and without the YNNPACK fusions.
3. Time, run for real: a small CNN and MLPs of ``--time-widths`` with random weights; the median of
   ``runs`` runs after one warm-up run, and the largest difference from one device's bounds.
   Simulated devices share this machine's cores: a layout's time is all its devices' work added up
   (fsdp=8 alone computes the same bounds on 8 devices), so it shows work, not a cluster's speed.

About 5 minutes on 2 cores; the compiles of section 1 take about a minute and a half.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import pathlib
import re
import statistics
import tempfile
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxpar.verify import compile_bound, from_nnx  # noqa: E402
from jaxpar.verify.network import Affine, Network, ReLU  # noqa: E402

LAYOUTS = ("", "fsdp=8", "tensor=2", "tensor=4")
NO_YNN = {"xla_cpu_experimental_ynn_fusion_type": ""}  # XLA:CPU without its YNNPACK fusions
METHODS = ("ibp", "crown", "alpha-crown")
OUTPUTS = 10
MiB = 2**20


def abstract_mlp(width: int, layers: int) -> Network:
    """``layers`` dense layers width -> width (the last width -> 10) with ReLUs between, weights as
    shapes only: nothing is allocated."""
    chain = []
    for i in range(layers):
        out = OUTPUTS if i == layers - 1 else width
        w, b = jax.ShapeDtypeStruct((width, out), jnp.float32), jax.ShapeDtypeStruct((out,), jnp.float32)
        chain.append(Affine(f"dense{i}", "dense", w, b, (width,), (out,)))
        if i < layers - 1:
            chain.append(ReLU(f"relu{i}", (width,)))
    return Network(tuple(chain), (width,), (OUTPUTS,))


def measure(width: int, layers: int, method: str, layout: str, alpha_steps: int, options=None) -> dict:
    """One compile: per-device weight bytes, temporaries, peak (bytes) and compile seconds."""
    start = time.perf_counter()
    program = compile_bound(abstract_mlp(width, layers), 1, OUTPUTS, method, layout, alpha_steps=alpha_steps,
                            compiler_options=options)
    m = program.memory
    return {"weights": program.weight_bytes, "temp": m["temp_size"],
            "peak": m["argument_size"] + m["output_size"] + m["temp_size"], "compile_s": time.perf_counter() - start}


def memory_table(widths, layer_counts, alpha_widths, alpha_steps: int) -> float:
    """Section 1's table; returns the seconds its compiles took."""
    print(f"{'method':11} {'layers':>6} {'width':>5} {'layout':9} {'weights MiB':>11} {'temp MiB':>9} {'peak MiB':>9} "
          f"{'weights x':>9} {'peak x':>7} {'weights -%':>10} {'peak -%':>7} {'compile s':>9}")
    total = 0.0
    for method in METHODS:
        for layers in layer_counts:
            for width in (alpha_widths if method == "alpha-crown" else widths):
                one = None
                for layout in LAYOUTS:
                    row = measure(width, layers, method, layout, alpha_steps)
                    one, total = one or row, total + row["compile_s"]
                    w, p = row["weights"] / one["weights"], row["peak"] / one["peak"]
                    print(f"{method:11} {layers:6d} {width:5d} {layout or 'one':9} {row['weights'] / MiB:11.1f} "
                          f"{row['temp'] / MiB:9.1f} {row['peak'] / MiB:9.1f} {w:9.3f} {p:7.3f} {100 * (1 - w):10.1f} "
                          f"{100 * (1 - p):7.1f} {row['compile_s']:9.2f}", flush=True)
            print()
    return total


def reduction_table(widths, layer_counts, method: str, options, alpha_steps: int):
    """Peak per device (MiB) and its reduction against one device, one row per MLP."""
    print(f"{'layers':>6} {'width':>5} " + " ".join(f"{(layout or 'one') + ' peak MiB':>18} {'-%':>5}" for layout in LAYOUTS))
    for layers in layer_counts:
        for width in widths:
            peaks = [measure(width, layers, method, layout, alpha_steps, options)["peak"] for layout in LAYOUTS]
            print(f"{layers:6d} {width:5d} " + " ".join(f"{p / MiB:18.1f} {100 * (1 - p / peaks[0]):5.1f}" for p in peaks),
                  flush=True)
    print()


def widest(layers: int, layout: str, budget: int, step: int, largest: int) -> tuple:
    """(the widest multiple of ``step`` whose CROWN program's peak fits ``budget``, its peak, the
    next width's peak): doubling from 1024, then bisection between the last fit and the first miss."""
    peak = lambda w: measure(w, layers, "crown", layout, 1)["peak"]
    fit, miss, peaks = 0, None, {}
    width = 1024
    while width <= largest:
        peaks[width] = peak(width)
        if peaks[width] > budget:
            miss = width
            break
        fit, width = width, width * 2
    if miss is None:
        return fit, peaks.get(fit), None, f"fits at {largest}, the search's cap"
    lo, hi = fit // step, miss // step  # in units of step: lo fits (or is 0), hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        peaks[mid * step] = peak(mid * step)
        lo, hi = (mid, hi) if peaks[mid * step] <= budget else (lo, mid)
    return lo * step, peaks.get(lo * step), peaks[hi * step], ""


def budget_table(layer_counts, budget_gib: float, step: int, largest: int):
    budget = int(budget_gib * 2**30)
    print(f"widest CROWN MLP within {budget_gib:g} GiB per device (peak = arguments + outputs + temporaries; "
          f"widths in steps of {step}):")
    print(f"{'layers':>6} {'layout':9} {'width':>6} {'peak MiB':>9} {'next width peak MiB':>20} {'width x one':>11}")
    for layers in layer_counts:
        one = None
        for layout in ("", "fsdp=8", "tensor=4"):
            width, fit_peak, next_peak, note = widest(layers, layout, budget, step, largest)
            one = one or width
            fit = "-" if fit_peak is None else f"{fit_peak / MiB:.1f}"
            after = "-" if next_peak is None else f"{next_peak / MiB:.1f}"
            print(f"{layers:6d} {layout or 'one':9} {width:6d} {fit:>9} {after:>20} "
                  f"{(width / one if one else float('nan')):11.2f} {note}", flush=True)
    print()


# Section 2: the values live at XLA's peak, read from the live-range report it dumps with the
# optimized HLO (xla_dump_to), each put in one kind: the weight shards and the boxes (arguments);
# weights gathered over fsdp; the identity (made from iota); broadcasts (a value at least 8 times
# its operands that is no product: a bias, the box's centre or radius or a ReLU's slopes spread to
# an A matrix's shape); computed (A matrices, their positive and negative parts, |W|, ...). "from
# weights": the bytes of those computed from the weights alone, which XLA may compute at the start
# of the program, ahead of the pass that uses them.
KINDS = ("weights", "boxes", "gathered", "identity", "broadcasts", "computed")
DTYPE_BYTES = {"f32": 4, "s32": 4, "u32": 4, "pred": 1, "f16": 2, "bf16": 2, "s8": 1, "u8": 1, "f64": 8, "s64": 8}


def shape_bytes(shape: str) -> int:
    return sum(DTYPE_BYTES.get(t, 4) * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
               for t, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape))


def entry_instructions(hlo: str) -> dict:
    """{name: (shape, opcode, operand names, op_name)} of the optimized module's entry computation."""
    entry = hlo[hlo.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    table = {}
    for line in entry.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (\(.*?\)|\S+) ([\w\-]+)\((.*?)\)(.*)", line)
        if m:
            name, shape, op, args, rest = m.groups()
            op_name = re.search(r'op_name="([^"]+)"', rest)
            table[name] = (shape, op, re.findall(r"%([\w.\-]+)", args), op_name.group(1) if op_name else "")
    return table


def kind_of(name: str, table: dict) -> str:
    shape, op, args, op_name = table[name]
    if op == "parameter":
        return "weights" if op_name.startswith("weights") else "boxes"  # (arguments: the boxes and the spec)
    if "all_gather" in op_name or op.startswith("all-gather"):
        return "gathered"
    if not args:
        return "identity"  # made from iota: the identity each intermediate pass starts from
    if "dot" not in op_name and shape_bytes(shape) >= 8 * sum(shape_bytes(table[a][0]) for a in args if a in table):
        return "broadcasts"  # a bias or the box's centre or radius spread to an A matrix's shape
    return "computed"  # A matrices, their positive and negative parts, |W|, ...


def peak_values(directory: str):
    """([(bytes, kind, computed from the weights alone)] live at XLA's peak, the peak's bytes)."""
    read = lambda suffix: pathlib.Path(glob.glob(os.path.join(directory, "*" + suffix))[0]).read_text()
    report = read("cpu_after_optimizations-live-range.txt")
    table = entry_instructions(read("cpu_after_optimizations.txt"))
    live = report[report.index("(peak):"):].split("Stack trace")[0]
    memo = {}

    def sources(name):  # the parameters a value is computed from
        if name not in memo:
            shape, op, args, op_name = table.get(name, ("", "constant", [], ""))
            memo[name] = {op_name.split("[")[0]} if op == "parameter" else set().union(*(sources(a) for a in args))
        return memo[name]

    values = [(int(size), kind_of(name, table), table[name][1] != "parameter" and sources(name) <= {"weights"})
              for name, size in re.findall(r"\s+(\S+?)\{\}: (\d+) bytes", live) if name in table]
    return values, sum(v[0] for v in values)


def breakdown_row(width: int, layers: int, method: str, layout: str, options: dict, alpha_steps: int) -> str:
    with tempfile.TemporaryDirectory() as directory:
        measure(width, layers, method, layout, alpha_steps, {**options, "xla_dump_to": directory})
        try:
            values, total = peak_values(directory)
        except (IndexError, ValueError) as error:  # XLA's dump format is not an API
            return f"could not read XLA's live-range report: {error}"
    by_kind = collections.Counter()
    for size, kind, _ in values:
        by_kind[kind] += size
    alone = sum(size for size, _, from_weights in values if from_weights)
    return (" ".join(f"{by_kind[k] / MiB:10.1f}" for k in KINDS)
            + f" {total / MiB:10.1f} {total / (width * width * 4):5.1f} {alone / MiB:12.1f}")


def breakdown_table(width: int, layers: int, alpha_steps: int):
    print(f"values live at XLA's peak, MiB per device: MLP {width} x {layers} layers, one region; \"A\" = "
          f"{width * width * 4 / MiB:.0f} MiB, one intermediate pass's A matrix (1 x {width} specs x {width}) or one weight")
    print(f"{'XLA:CPU':12} {'method':6} {'layout':9} " + " ".join(f"{k:>10}" for k in KINDS)
          + f" {'live total':>10} {'in As':>5} {'from weights':>12}")
    for compiler, options, methods in (("default", {}, ("ibp", "crown")), ("no YNNPACK", NO_YNN, ("crown",))):
        for method in methods:
            for layout in LAYOUTS:
                row = breakdown_row(width, layers, method, layout, options, alpha_steps)
                print(f"{compiler:12} {method:6} {layout or 'one':9} {row}", flush=True)
    print()


class MLP(nnx.Module):
    def __init__(self, widths, rngs):
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(widths, widths[1:])])

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


class CNN(nnx.Module):
    """16x16x3 -> conv 16 (stride 2) -> conv 32 (stride 2) -> dense 128 -> 10."""

    def __init__(self, rngs):
        self.conv1 = nnx.Conv(3, 16, (3, 3), strides=2, rngs=rngs)
        self.conv2 = nnx.Conv(16, 32, (3, 3), strides=2, rngs=rngs)
        self.hidden = nnx.Linear(4 * 4 * 32, 128, rngs=rngs)
        self.out = nnx.Linear(128, OUTPUTS, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.conv2(nnx.relu(self.conv1(x)))).reshape(x.shape[0], -1)
        return self.out(nnx.relu(self.hidden(x)))


def timed(program, net, lower, upper, spec, runs: int):
    """(median seconds of ``runs`` runs after a warm-up run, the last result)."""
    result = program.run(net, lower, upper, spec)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        result = program.run(net, lower, upper, spec)  # (run returns numpy arrays: it waits for them)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def time_table(widths, layers: int, regions: int, eps: float, runs: int, alpha_steps: int):
    nets = [("CNN 16x16x3", CNN(nnx.Rngs(0)), (16, 16, 3))]
    nets += [(f"MLP {w} x {layers}", MLP([w] * layers + [OUTPUTS], nnx.Rngs(0)), (w,)) for w in widths]
    print(f"{regions} region(s) of radius {eps} around normal points, the {OUTPUTS} outputs as specifications; "
          f"median of {runs} runs after a warm-up run; alpha-CROWN {alpha_steps} steps")
    print(f"{'network':16} {'method':11} {'layout':9} {'run ms':>8} {'x one':>6} {'max |diff|':>10} {'rel diff':>8} "
          f"{'mean gap':>9} {'compile s':>9}")
    for title, model, shape in nets:
        net = from_nnx(model, shape)
        centre = jax.random.normal(jax.random.key(1), (regions, *shape))
        lower, upper = centre - eps, centre + eps
        spec = jnp.broadcast_to(jnp.eye(OUTPUTS), (regions, OUTPUTS, OUTPUTS))
        for method in METHODS:
            one = None
            for layout in ("", "fsdp=8", "tensor=4"):
                start = time.perf_counter()
                program = compile_bound(net, regions, OUTPUTS, method, layout, alpha_steps=alpha_steps)
                compile_s = time.perf_counter() - start
                seconds, result = timed(program, net, lower, upper, spec, runs)
                one = one or (seconds, result)
                diff = max(np.abs(result.lower - one[1].lower).max(), np.abs(result.upper - one[1].upper).max())
                scale = max(np.abs(one[1].lower).max(), np.abs(one[1].upper).max())
                gap = float(np.mean(result.upper - result.lower))
                print(f"{title:16} {method:11} {layout or 'one':9} {1e3 * seconds:8.2f} {seconds / one[0]:6.2f} {diff:10.2e} "
                      f"{diff / scale:8.1e} {gap:9.3g} {compile_s:9.2f}", flush=True)
        print()


def ints(text: str) -> list:
    return [int(x) for x in text.split(",") if x]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=ints, default=[1024, 2048, 4096, 8192])
    parser.add_argument("--layers", type=ints, default=[4, 8])
    parser.add_argument("--alpha-widths", type=ints, default=[], help="alpha-CROWN's widths in section 1 (default --widths)")
    parser.add_argument("--alpha-steps", type=int, default=5)
    parser.add_argument("--budget-gib", type=float, default=1.0, help="per-device memory for the widest-MLP search")
    parser.add_argument("--budget-step", type=int, default=256, help="the search's width resolution")
    parser.add_argument("--breakdown", default="4096x8", help="WIDTHxLAYERS for section 2 ('' skips it)")
    parser.add_argument("--time-widths", type=ints, default=[256, 512, 1024])
    parser.add_argument("--time-layers", type=int, default=4)
    parser.add_argument("--regions", type=int, default=1, help="regions bounded at once in section 3")
    parser.add_argument("--eps", type=float, default=0.01)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--skip", default="", help="sections to leave out, e.g. 'time' or 'memory,budget'")
    args = parser.parse_args()
    skip, start = set(args.skip.split(",")), time.perf_counter()
    print(f"jax {jax.__version__}, {len(jax.devices())} simulated CPU devices; MiB = 2**20 bytes\n")
    if "memory" not in skip:
        print("== 1. Memory by the compiler, no weights made (MiB per device; x and -%: against one device)")
        seconds = memory_table(args.widths, args.layers, args.alpha_widths or args.widths, args.alpha_steps)
        print(f"(these compiles: {seconds:.0f} s)\n")
    if "budget" not in skip:
        budget_table(args.layers, args.budget_gib, args.budget_step, largest=65536)
    if "no-ynn" not in skip:
        print("CROWN's peak with XLA:CPU's YNNPACK fusions off (compiler option xla_cpu_experimental_ynn_fusion_type=''):")
        reduction_table(args.widths, args.layers, "crown", NO_YNN, args.alpha_steps)
    if "breakdown" not in skip and args.breakdown:
        width, layers = ints(args.breakdown.replace("x", ","))
        print("== 2. Where the peak goes")
        breakdown_table(width, layers, args.alpha_steps)
    if "time" not in skip:
        print("== 3. Time, run for real")
        time_table(args.time_widths, args.time_layers, args.regions, args.eps, args.runs, args.alpha_steps)
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
