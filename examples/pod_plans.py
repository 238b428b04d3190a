"""Plan three pod jobs from this machine: compile each training step for the real TPU pod ahead of
time (libtpu: `pip install -e .[tpu]`) and print its fit, its traffic and the estimated MFU of the
best layout, next to the MFU the public MaxText documentation reports for the same model and pod.

    python examples/pod_plans.py [MODEL ...] [--batch-per-chip B] [--seq-len L]
                                 # a few minutes and several GB of RAM per compile

The MaxText figures are measured on real pods; ours are roofline estimates (a bound: kernels below
peak, bubbles and host overhead are not in it). Batch shapes are ours, chosen per chip. Exits with
an error if a plan was not compiled by the TPU compiler or does not fit in HBM.
"""
import argparse
import sys

from jaxpar.aot import compile_report, format_report
from jaxpar.topology import load_topology

# model, topology, strategy, per-chip batch, sequence length, MFU reported by MaxText (or None)
PLANS = [
    ("llama2-7b", "tpu-v5p-256", "fsdp=-1", 4, 4096, None),
    # Llama3.1-8B has llama3-8b's shapes. jaxpar's attention materialises the (length x length)
    # scores (no flash kernel yet), so these batches are smaller than MaxText's.
    ("llama3-8b", "tpu-v6e-256", "fsdp=-1", 1, 4096, 0.4546),
    # keeping all 80 layers' gathered weights would take 140 GB per chip: gather them again instead
    ("llama2-70b", "tpu-v5p-1024", "fsdp=-1,regather=on", 1, 4096, 0.654),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = [plan[0] for plan in PLANS]
    parser.add_argument("models", nargs="*", metavar="MODEL", help=f"plan only these ({', '.join(names)}; default: all)")
    parser.add_argument("--batch-per-chip", type=int, help="instead of each plan's own")
    parser.add_argument("--seq-len", type=int, help="instead of each plan's own (4096)")
    args = parser.parse_args()
    unknown = [m for m in args.models if m not in names]
    if unknown:
        parser.error(f"no plan for {', '.join(unknown)}; choose from {', '.join(names)}")
    failed = []
    for model, topology_name, strategy, per_chip, seq, maxtext in PLANS:
        if args.models and model not in args.models:
            continue
        topology = load_topology(topology_name)
        batch = (args.batch_per_chip or per_chip) * topology.num_chips
        report = compile_report(model, topology, strategy, batch, args.seq_len or seq)
        print(format_report(report))
        best = min([{"strategy": report["strategy"], **report["roofline"]}, *report["alternatives"]], key=lambda r: r["step_s"])
        measured = f"{100 * maxtext:.2f}% measured by MaxText" if maxtext else "no MaxText figure published for this pair"
        print(f"\n==> {model} on {topology_name}: best layout {best['strategy']}, estimated MFU {100 * best['mfu']:.1f}% "
              f"(jaxpar roofline estimate) vs {measured}\n{'=' * 100}\n")
        if report["compiler"] != "tpu" or not report["memory_per_chip"]["fits"]:
            failed.append(model)
    if failed:
        sys.exit(f"not compiled for the TPU pod, or not fitting in its HBM: {', '.join(failed)}")


if __name__ == "__main__":
    main()
