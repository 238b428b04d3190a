"""Plan pod jobs from this machine: compile each training step for the real TPU pod ahead of time
(libtpu: `pip install -e .[tpu]`) and print the chosen plan's peak memory, traffic by link, roofline
step time and MFU, next to what MaxText reaches on the same pod.

    python examples/pod_plans.py [PLAN ...] [--batch-per-chip B] [--seq-len L] [--model NAME]
                                 # about a minute and a few GB of RAM per 7B compile; the 70B plans
                                 # on 256-512 chips take several minutes and more than 10 GB each

Two kinds of MaxText figures, labelled as what they are:
- llama2-7b on three pods: MaxText's own step compiled here ahead of time with the same settings
  (global batch of one sequence per chip, 2048 tokens, bf16 compute and gradient reduction, full
  remat, splash attention): its per-chip peak memory and collective bytes, counted as jaxpar counts
  its own;
- Llama2-70B on 512 v5p chips, Llama3.1-8B and Llama3.1-70B on 256 v6e chips: the MFU MaxText
  publishes, measured on real pods (``jaxpar.analysis.roofline.PUBLISHED_RUNS`` names the sources),
  against jaxpar's roofline estimate for the same per-chip batch and length.
jaxpar's plans take ``regather=auto`` (the FSDP policy chosen by memory) and bf16 gradient
reduction, MaxText's setting. Exits with an error if a plan was not compiled by the TPU compiler
or does not fit in its HBM.
"""
import argparse
import dataclasses
import sys

from jaxpar.aot import POD_DEFAULTS, compile_report, format_report
from jaxpar.analysis.roofline import PUBLISHED_RUNS
from jaxpar.topology import load_topology

MAXTEXT_SETTINGS = dataclasses.replace(POD_DEFAULTS, grad_reduce_dtype="bfloat16")


@dataclasses.dataclass(frozen=True)
class Plan:
    name: str
    model: object  # a config name or a LlamaConfig
    topology: str
    strategy: str
    batch_per_chip: int
    seq_len: int
    maxtext: str  # what MaxText reaches on this pod, and how it was measured


def published(model: str, topology: str) -> Plan:
    (run,) = [r for r in PUBLISHED_RUNS if r.model == model and r.topology == topology]
    return Plan(f"{model}/{topology}", run.config, topology, run.strategy, run.batch_per_chip, run.seq_len,
                f"MFU {100 * run.mfu:.2f}% measured by MaxText on the pod (published)")


def compiled_here(topology: str, strategy: str, peak_gb: float, traffic: str) -> Plan:
    return Plan(f"llama2-7b/{topology}", "llama2-7b", topology, strategy, 1, 2048,
                f"peak {peak_gb:.3f} GB and {traffic} GB of collectives per chip (MaxText's step compiled here)")


# MaxText's step (commit e591f30, train_compile.py with per_device_batch_size=1, max_target_length=2048,
# remat_policy=full, attention=flash), compiled here on 2026-12-02: peak = arguments + outputs - aliased
# + temporaries + code from its memory_analysis(), as jaxpar's is counted; collectives counted by
# jaxpar.analysis.hlo on its compiled text
PLANS = [
    compiled_here("v5p-64", "fsdp=-1", 6.452, "40.00"),
    compiled_here("v5e-256", "fsdp=-1", 2.904, "39.27"),
    compiled_here("2xv5p-64", "data=2,fsdp=-1", 6.361, "42.14 ICI + 0.43 DCN"),
    published("Llama2-70B", "tpu-v5p-1024"),
    published("Llama3.1-8B", "tpu-v6e-256"),
    published("Llama3.1-70B", "tpu-v6e-256"),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = [plan.name for plan in PLANS]
    parser.add_argument("plans", nargs="*", metavar="PLAN", help=f"plan only these ({', '.join(names)}; default: all)")
    parser.add_argument("--batch-per-chip", type=int, help="instead of each plan's own")
    parser.add_argument("--seq-len", type=int, help="instead of each plan's own")
    parser.add_argument("--model", help="instead of each plan's model (e.g. tiny: the script in seconds)")
    args = parser.parse_args()
    unknown = [p for p in args.plans if p not in names]
    if unknown:
        parser.error(f"no plan {', '.join(unknown)}; choose from {', '.join(names)}")
    failed = []
    for plan in PLANS:
        if args.plans and plan.name not in args.plans:
            continue
        topology = load_topology(plan.topology)
        batch = (args.batch_per_chip or plan.batch_per_chip) * topology.num_chips
        report = compile_report(args.model or plan.model, topology, plan.strategy, batch, args.seq_len or plan.seq_len,
                                MAXTEXT_SETTINGS, alternatives=0)
        print(format_report(report))
        mem, est = report["memory_per_chip"], report["roofline"]
        links = {}
        for name, row in report["collectives"].items():
            link = name.rsplit("(", 1)[1].rstrip(")")
            links[link] = links.get(link, 0.0) + row["bytes_per_chip"]
        traffic = " + ".join(f"{b / 1e9:.2f} {link}" for link, b in sorted(links.items()))
        print(f"\n==> {plan.name}: {report['strategy']} ({'regather' if report['fsdp_policy']['regather'] else 'keep'}), "
              f"peak {mem['peak'] / 1e9:.3f} GB, {traffic} GB of collectives per chip, step {est['step_s']:.3f} s, "
              f"MFU {100 * est['mfu_full_attention']:.1f}% (compiled and estimated here)\n"
              f"    MaxText: {plan.maxtext}\n{'=' * 100}\n")
        if report["compiler"] != "tpu" or not mem["fits"]:
            failed.append(plan.name)
    if failed:
        sys.exit(f"not compiled for the TPU pod, or not fitting in its HBM: {', '.join(failed)}")


if __name__ == "__main__":
    main()
