"""``jaxpar`` command line: a thin layer over the Python API (no logic of its own)."""

from __future__ import annotations

import argparse
import math
import contextlib
import os
import signal
import sys
import time

# Exit statuses, the same for every command: defined with the errors that cause them
from jaxpar.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, EXIT_ON_SIGNAL, EXIT_SIGINT, EXIT_SIGTERM, EXIT_STATUSES, JaxparError
# the options of train, compile, check, bench and launch are declared on their config classes' fields
from jaxpar.flags import add_flags, config_from_args, given_flags

# where a command's defaults are not train's (those of the config classes)
COMPILE_DEFAULTS = {"model": "llama2-7b", "strategy": "fsdp=-1", "batch_size": 256, "seq_len": 2048}  # and aot.POD_DEFAULTS
CHECK_DEFAULTS = {"batch_size": 8, "seq_len": 32}  # small: one step of each
BENCH_DEFAULTS = {"steps": 6}


def _simulate_cpu_devices(count: int):
    """Ask XLA for ``count`` simulated CPU devices; must run before JAX initialises. JAX is kept to
    the CPU so that an installed TPU or GPU plugin is not probed for devices that are not there."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    if "jax" in sys.modules:  # imported with the command's options (main): it read JAX_PLATFORMS then, XLA_FLAGS not yet
        import jax

        if not jax.config.jax_platforms:
            jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])


def _cpu_topology_simulated(name: str):
    """The topology called ``name``; a CPU one gets its simulated devices (before JAX starts)."""
    from jaxpar.topology import load_topology

    topology = load_topology(name)
    if topology.platform == "cpu":
        _simulate_cpu_devices(topology.num_chips)
    return topology


def _train_parser(sub, chosen: str | None):
    p = sub.add_parser("train", help="train a Llama under a layout on the shipped corpus (default: tiny, cpu-8, fsdp=4,tensor=2)")
    if chosen != "train":  # its options load its config classes, and jax with them (main)
        return p
    from jaxpar.launch import DistributedArgs
    from jaxpar.run import RunConfig
    from jaxpar.train.checkpoint import CheckpointConfig
    from jaxpar.train.config import TrainConfig

    p.add_argument("--topology", default="cpu-8", help="a name from meshes/ or a path to a topology TOML file")
    p.add_argument("--config", metavar="RUN.toml", help="take options from a run file (key = value, each key an option's name; "
                   "options given here override it), or from a run's checkpoint directory or metrics JSON to repeat it")
    add_flags(p, RunConfig, "train")
    p.add_argument("--metrics-json", metavar="PATH", help="write per-step loss and time and the memory and communication report here")
    add_flags(p, TrainConfig, "train")  # its gradient sync options in their own group
    p.add_argument("--dcp", default="off", choices=["on", "off"],
                   help="data-centric parallel: batches of whole documents, each step's lengths choose its context "
                        "degrees (--seq-len: positions per device; --batch-size: documents per step)")
    p.add_argument("--context-algorithm", choices=["ring", "all-to-all", "hybrid"],
                   help="attention across a sequence split by context=N (default ring; hybrid also needs a2a=U in the strategy)")
    c = p.add_argument_group("checkpoints (orbax; restorable under any layout, device count or process count)")
    add_flags(c, CheckpointConfig, "train")
    c.add_argument(
        "--resume", nargs="?", const="required", choices=["required", "auto"],
        help="continue from the latest complete checkpoint in --checkpoint-dir; --resume=auto also starts afresh when there is none",
    )
    add_flags(p, DistributedArgs, "train")
    return p


def _launch_parser(sub, chosen: str | None):
    p = sub.add_parser(
        "launch", help="run a command as N local processes of one jax.distributed job; restart it from its last checkpoint on failure",
        usage="jaxpar launch [options] -- COMMAND ...",
    )
    if chosen != "launch":
        return p
    from jaxpar.launch import LaunchConfig

    add_flags(p, LaunchConfig, "launch")
    p.add_argument("job", nargs=argparse.REMAINDER, metavar="COMMAND", help="the command, after '--'")
    return p


def _launch(args) -> int:
    from jaxpar.launch import LaunchConfig, launch

    command = args.job[1:] if args.job[:1] == ["--"] else args.job
    return launch(command, config_from_args(LaunchConfig, args, "launch"))  # on SIGINT or SIGTERM it stops the children on its way out


def _bench_parser(sub, chosen: str | None):
    p = sub.add_parser("bench", help="every strategy on the same model and devices: step time, traffic vs optimum, memory vs ZeRO table")
    if chosen != "bench":
        return p
    from jaxpar.run import RunConfig

    p.add_argument("--topology", default="cpu-8")
    add_flags(p, RunConfig, "bench", BENCH_DEFAULTS)
    p.add_argument("--strategies", help="comma-free list separated by ';' (default: the standard set)")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    return p


def _bench(args) -> int:
    topology = _cpu_topology_simulated(args.topology)
    from jaxpar.bench import STRATEGIES, bench, format_table, parse_strategies
    from jaxpar.run import RunConfig, check_writable, write_json_atomically

    strategies = parse_strategies(args.strategies) if args.strategies else STRATEGIES
    if args.json:
        check_writable(args.json, "--json")
    run = config_from_args(RunConfig, args, "bench")
    rows = bench(run, topology, strategies)
    print(format_table(rows))
    if args.json:
        write_json_atomically(args.json, {"model": args.model, "topology": args.topology, "rows": rows})
    return EXIT_OK


def _compile_parser(sub, chosen: str | None):
    p = sub.add_parser("compile", help="compile the training step for a topology ahead of time and report fit, traffic and estimated speed")
    if chosen != "compile":
        return p
    from jaxpar.aot import POD_DEFAULTS
    from jaxpar.run import RunConfig
    from jaxpar.train.config import TrainConfig

    p.add_argument("--topology", default="tpu-v5p-256", help="a TPU slice by name (v5p-64, v5e-16, 2xv5p-64...), a name from meshes/ or a TOML file")
    add_flags(p, RunConfig, "compile", COMPILE_DEFAULTS)
    # every option of train's that changes the compiled program, with a pod's defaults (bf16, full remat)
    add_flags(p, TrainConfig, "compile", POD_DEFAULTS)
    p.add_argument("--context-algorithm", choices=["ring", "all-to-all", "hybrid"], help="attention across a sequence split by context=N")
    p.add_argument("--dump-hlo", metavar="DIR", help="write the compiled program's text to DIR/step.hlo.txt")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON")
    return p


def _compile(args) -> int:
    from jaxpar.topology import load_topology

    topology = load_topology(args.topology)
    if topology.platform != "tpu":
        _simulate_cpu_devices(topology.num_chips)
    from jaxpar.aot import compile_report, format_report
    from jaxpar.errors import JobFailed, size_text
    from jaxpar.models import FAMILIES
    from jaxpar.run import check_at_least, check_writable, write_json_atomically
    from jaxpar.train.step import TrainConfig

    if args.json:
        check_writable(args.json, "--json")
    check_at_least("--microbatches", args.microbatches, 1)
    cfg = config_from_args(TrainConfig, args, "compile")
    strategy = args.strategy + (f",context_algorithm={args.context_algorithm}" if args.context_algorithm else "")
    report = compile_report(args.model, topology, strategy, args.batch_size, args.seq_len, cfg, dump_hlo=args.dump_hlo,
                            explicit=frozenset(given_flags(TrainConfig, args, "compile")),
                            tokenizer=args.tokenizer, packing=args.packing, progress=sys.stderr,
                            **{option: getattr(args, option) for family in FAMILIES.values() for option in family.options})
    print(format_report(report))
    if args.dump_hlo:
        print(f"\ncompiled program written to {args.dump_hlo}/step.hlo.txt")
    if args.json:
        write_json_atomically(args.json, report)
    mem = report["memory_per_chip"]
    if not mem["fits"]:  # a plan that does not fit is a failed plan, as when XLA:TPU refuses it (exit 1 both ways)
        raise JobFailed(f"the plan DOES NOT FIT: {size_text(mem['peak'])} per chip, {size_text(mem['hbm'])} of HBM "
                        f"(the report above)")
    return EXIT_OK


def _plan_parser(sub, chosen: str | None):  # no config class: its options are its own
    p = sub.add_parser("plan", help="search layouts (degrees, micro-batches, remat, FSDP policy, uneven splits across device "
                                    "groups) for a model on a topology under a cost model; rank them and say why the others lose")
    p.add_argument("--model", default=COMPILE_DEFAULTS["model"], help="a model by name (jaxpar.models.CONFIGS)")
    p.add_argument("--topology", default="tpu-v5p-256", help="a TPU slice by name, a name from meshes/ or a TOML file "
                                                             "(several [[groups]]: a heterogeneous cluster)")
    p.add_argument("--batch-size", type=int, default=COMPILE_DEFAULTS["batch_size"], help="sequences per step")
    p.add_argument("--seq-len", type=int, default=COMPILE_DEFAULTS["seq_len"], help="tokens per sequence")
    p.add_argument("--top", type=int, default=5, help="how many plans to print (default 5)")
    p.add_argument("--compile", type=int, default=0, metavar="N",
                   help="compile the best N plans (TPU ahead of time, else simulated CPU devices): predicted against compiled")
    p.add_argument("--json", metavar="PATH", help="write the plans as JSON")
    return p


def _plan(args) -> int:
    from jaxpar.run import check_at_least, check_writable, write_json_atomically
    from jaxpar.topology import load_topology

    check_at_least("--top", args.top, 1)
    check_at_least("--compile", args.compile, 0)
    if args.json:
        check_writable(args.json, "--json")
    topology = load_topology(args.topology)
    if args.compile and topology.platform != "tpu":
        _simulate_cpu_devices(topology.num_chips)
    from jaxpar import planner

    plans = planner.plan(args.model, topology, args.batch_size, args.seq_len, top=max(args.top, args.compile))
    compiled = None
    if args.compile:
        from jaxpar.aot import compile_plans

        compiled = compile_plans(plans, args.compile)
    print(planner.format_plans(plans, compiled))
    if args.json:
        write_json_atomically(args.json, planner.as_json(plans, compiled))
    return EXIT_OK


def _generate_parser(sub, chosen: str | None):  # no config class: its options are its own
    p = sub.add_parser("generate", help="continue text from a checkpoint of jaxpar train: a Llama token by token (KV cache), "
                                        "a block diffusion model (bd3lm-*) block by block")
    p.add_argument("--checkpoint-dir", required=True, metavar="DIR", help="a --checkpoint-dir of jaxpar train")
    p.add_argument("--prompt", default=None, help="text to continue (UTF-8 bytes, the main job's tokens)")
    p.add_argument("--prompts-file", metavar="PATH", help="a Llama: continue each line of this file, all in one batch")
    p.add_argument("--max-new-tokens", type=int, help="a Llama: tokens to generate per prompt (default 64)")
    p.add_argument("--new-blocks", type=int, help="a block diffusion model: blocks to generate (default 4)")
    p.add_argument("--denoise-steps", type=int, help="a block diffusion model: denoising steps per block (1 to the block size; "
                                                     "default the block size)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); above 0: sample")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature above 0: sample from the smallest set of ids "
                                                             "holding this much probability")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step", type=int, metavar="N", help="generate from checkpoint N (default: the newest that verifies)")
    p.add_argument("--topology", help="devices to run on (default: CPU, as many simulated devices as --strategy lays out)")
    p.add_argument("--strategy", help='a layout for the weights, e.g. "tensor=2" or "data=2,tensor=4" (default: one device); '
                                      'the prompts are padded to whole rows per data shard')
    p.add_argument("--json", metavar="PATH", help="write the tokens, the text and the time as JSON")
    p.add_argument("--permutation", metavar="PATH", help="a Llama: place heads and MLP columns on the tensor shards as this "
                                                        "file of `jaxpar affinity` says (for delay=1)")
    return p


def _affinity_parser(sub, chosen: str | None):  # no config class: its options are its own
    p = sub.add_parser("affinity", help="choose which heads and MLP columns each tensor shard holds for delayed TP "
                                        "(affinity-aware sharding) from a Llama checkpoint; write the permutation")
    p.add_argument("--checkpoint-dir", required=True, metavar="DIR", help="a --checkpoint-dir of jaxpar train (a Llama)")
    p.add_argument("--tensor", type=int, required=True, help="the tensor degree the model will be served under")
    p.add_argument("--out", required=True, metavar="PATH", help="where to write the permutation (JSON)")
    p.add_argument("--method", default="affinity", help="affinity (default), random or identity")
    p.add_argument("--seed", type=int, default=0, help="the random assignment's seed")
    p.add_argument("--step", type=int, metavar="N", help="read checkpoint N (default: the newest that verifies)")
    return p


def _affinity(args) -> int:
    _simulate_cpu_devices(1)  # the weights are read on the host: no accelerator plugin is probed
    from jaxpar import affinity
    from jaxpar.serve import common
    from jaxpar.run import check_writable

    check_writable(args.out, "--out")
    with _one_line_warnings("affinity"):
        model, meta = common.restore_model(args.checkpoint_dir, "llama", step=args.step)
    weights, cfg = affinity.weights_of(model), model.cfg
    chosen = affinity.assign(weights, cfg, args.tensor, args.method, args.seed)
    affinity.save(chosen, args.out, meta["model"], cfg)
    print(f"{meta['model']} checkpoint {meta['step']}, tensor={args.tensor}: coupling between consecutive sublayers kept "
          f"on one device (seen at once under delay=1)")
    for method in affinity.METHODS:
        kept = affinity.kept_coupling(weights, cfg, chosen if method == args.method else affinity.assign(weights, cfg, args.tensor, method, args.seed))
        print(f"  {method:9s} {100 * kept:6.2f}%{'   <- written to ' + args.out if method == args.method else ''}")
    return EXIT_OK


@contextlib.contextmanager
def _one_line_warnings(command: str):
    """Warnings printed as one line each, ``jaxpar COMMAND: warning: ...`` (not Python's file, line
    and source line); recorders (pytest.warns) still see them."""
    import warnings

    previous = warnings.formatwarning
    warnings.formatwarning = lambda message, *rest, **kw: f"jaxpar {command}: warning: {message}\n"
    try:
        yield
    finally:
        warnings.formatwarning = previous


def _generate_topology(args):
    """--topology, or (the default) simulated CPU devices, as many as --strategy lays out (set
    before JAX starts), so that a strategy runs as written on any machine."""
    if args.topology is not None:
        return _cpu_topology_simulated(args.topology)
    import dataclasses
    import math

    from jaxpar.errors import SpecError
    from jaxpar.mesh import parse_degrees
    from jaxpar.parallel import OPTIONS
    from jaxpar.topology import load_topology

    axes = ",".join(part for part in (args.strategy or "").split(",") if part.partition("=")[0].strip() not in OPTIONS)
    try:
        count = math.prod(degree for degree in parse_degrees(axes).values() if degree > 0)  # -1 fills one device
    except SpecError:
        count = 1  # parse_strategy refuses it in words, with the rest of the strategy
    _simulate_cpu_devices(count)
    return dataclasses.replace(load_topology("cpu-1"), name=f"cpu-{count}", num_chips=count, ici_shape=(count,),
                               source="simulated CPU devices for --strategy")


def _generate_prompts(args) -> list[str]:
    """The prompts: --prompt, or each non-empty line of --prompts-file."""
    if args.prompt is not None and args.prompts_file:
        raise JaxparError("give --prompt or --prompts-file, not both")
    if not args.prompts_file:
        try:  # bytes the shell passed that are not UTF-8 arrive as lone surrogates (Python's surrogateescape)
            (args.prompt or "").encode("utf-8")
        except UnicodeEncodeError:
            raise JaxparError(f"--prompt {args.prompt!r} holds bytes that are not UTF-8 text; give the prompt as UTF-8 "
                              f"(the byte tokenizer reads its UTF-8 bytes), or put it in a UTF-8 --prompts-file") from None
        return [args.prompt or ""]
    try:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts = [line.rstrip("\n") for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as err:
        raise JaxparError(f"--prompts-file {args.prompts_file!r} cannot be read as UTF-8 text: {err}") from None
    if not prompts:
        raise JaxparError(f"--prompts-file {args.prompts_file!r} has no non-empty line: write one prompt a line")
    return prompts


def _generate(args) -> int:
    import time

    topology = _generate_topology(args)
    from jaxpar.serve import common
    from jaxpar.run import check_writable, devices_for

    common.check_pick(args.temperature, args.top_p)
    if args.json:
        check_writable(args.json, "--json")
    prompts = _generate_prompts(args)
    family = common.checkpoint_family(args.checkpoint_dir, args.step)
    next_token = family in common.NEXT_TOKEN
    wrong = ("--new-blocks", "--denoise-steps") if next_token else ("--max-new-tokens", "--prompts-file", "--permutation")
    given = [flag for flag in wrong if getattr(args, flag[2:].replace("-", "_")) is not None]
    if given:
        raise JaxparError(f"{given[0]} is for {'block diffusion models' if next_token else 'a Llama'}; the checkpoint holds "
                          f"a {common.family_words(family)}")
    if next_token and args.prompt is None and not args.prompts_file:
        raise JaxparError("give --prompt TEXT or --prompts-file PATH: a Llama continues text (it has no start token)")
    if not args.strategy and topology.num_chips > 1:  # else the weights would sit on one of them, without a word
        raise JaxparError(f"--topology {args.topology} has {topology.num_chips} devices but without --strategy generation runs on "
                          f"one: give --strategy with degrees that multiply to {topology.num_chips} (e.g. \"tensor="
                          f"{topology.num_chips}\"), or drop --topology")
    layout = None
    if args.strategy:
        from jaxpar.parallel import build_layout, parse_strategy

        devices = devices_for(topology)
        layout = build_layout(parse_strategy(args.strategy, len(devices)), devices)
    began = time.perf_counter()
    with _one_line_warnings("generate"):
        if next_token:
            return _generate_llama(args, prompts, layout, began, family)
        return _generate_blocks(args, prompts[0], layout, began)


@contextlib.contextmanager
def _generating(total: int, what: str):
    """``progress(done)`` for a sampler: a bar of the ``total`` new ``what`` on a terminal
    (the first includes the compiles); None in a log, where the summary line says it all."""
    from jaxpar import scalars

    if not scalars.terminal(sys.stderr):
        yield None
        return
    bar = scalars.Progress(0, total, sys.stderr, what=f"generate ({what})")
    try:
        yield lambda done: bar.update(done, "")
    finally:
        bar.close()


def _generate_llama(args, prompts, layout, began, family: str) -> int:
    import time

    from jaxpar.serve import llama as decoder
    from jaxpar.run import check_at_least, write_json_atomically

    new = 64 if args.max_new_tokens is None else args.max_new_tokens
    check_at_least("--max-new-tokens", new, 1)
    with _generating(new, "tokens") as progress:
        outs, decoded = decoder.generate_from_checkpoint(args.checkpoint_dir, prompts, new, temperature=args.temperature,
                                                         top_p=args.top_p, seed=args.seed, layout=layout, step=args.step,
                                                         permutation=args.permutation, family=family, progress=progress)
    seconds = time.perf_counter() - began
    for out in outs:
        print(out.text)
    steady = decoded.step_seconds[2:]  # the prefill and the first step compile
    speed = f"; decoding {decoded.tokens_per_second:.0f} tokens/s, {1000 * sum(steady) / len(steady):.1f} ms a step" if steady else ""
    print(f"\n{len(outs)} x {new} new tokens in {seconds:.2f} s (restore and compiles included){speed}; {outs[0].model} "
          f"checkpoint {outs[0].step}", file=sys.stderr)
    if args.json:
        write_json_atomically(args.json, {
            "prompts": [{"text": o.text, "continuation": o.continuation, "tokens": [int(t) for t in o.tokens],
                         "prompt_tokens": o.prompt_tokens} for o in outs],
            "step_seconds": decoded.step_seconds, "tokens_per_second": decoded.tokens_per_second, "seconds": seconds,
            "model": outs[0].model, "step": outs[0].step})
    return EXIT_OK


def _generate_blocks(args, prompt, layout, began) -> int:
    import time

    from jaxpar.serve import bd3lm as sampler
    from jaxpar.run import check_at_least, write_json_atomically

    new_blocks = 4 if args.new_blocks is None else args.new_blocks
    check_at_least("--new-blocks", new_blocks, 1)
    # --denoise-steps is checked against the checkpoint's block size, from its meta, before any array is read
    with _generating(new_blocks, "blocks") as progress:
        out = sampler.generate_from_checkpoint(args.checkpoint_dir, prompt, new_blocks, denoise_steps=args.denoise_steps,
                                               temperature=args.temperature, top_p=args.top_p, seed=args.seed, layout=layout,
                                               step=args.step, progress=progress)
    seconds = time.perf_counter() - began
    print(out.text)
    new = len(out.tokens) - out.prompt_tokens
    print(f"\n{new} new tokens in {seconds:.2f} s ({new / seconds:.0f} tokens/s, restore and compiles included); "
          f"{out.model} checkpoint {out.step}", file=sys.stderr)
    if args.json:
        write_json_atomically(args.json, {"text": out.text, "continuation": out.continuation, "tokens": [int(t) for t in out.tokens],
                                          "prompt_tokens": out.prompt_tokens, "seconds": seconds, "model": out.model, "step": out.step})
    return EXIT_OK


def _check_parser(sub, chosen: str | None):
    p = sub.add_parser("check", help="one step of a layout against the same model on one device: names every weight whose gradient differs")
    if chosen != "check":
        return p
    from jaxpar.run import RunConfig
    from jaxpar.train.config import TrainConfig

    p.add_argument("--topology", default="cpu-8")
    add_flags(p, RunConfig, "check", CHECK_DEFAULTS)
    add_flags(p, TrainConfig, "check")
    p.add_argument("--tolerance", type=float, help="largest gradient difference per weight, as a fraction of its largest "
                   "one-device gradient entry (default 1e-4 in float32, 3e-2 in bfloat16)")
    return p


def _check(args) -> int:
    topology = _cpu_topology_simulated(args.topology)
    from jaxpar.run import RunConfig, build_trainer, check_run, first_batch
    from jaxpar.train import check as check_lib
    from jaxpar.train.step import TrainConfig

    run = config_from_args(RunConfig, args, "check", steps=1, train=config_from_args(TrainConfig, args, "check"))
    check_run(run, None, "never")
    check_lib.check_tolerance(args.tolerance)
    trainer, _, model_cfg = build_trainer(run, topology)
    check_lib.check_comparable(trainer.layout)
    # the run's first batch, from --data or the main job's corpus (a block diffusion model's [x_t ; x_0] too)
    batch = first_batch(run, model_cfg, lambda message: print(message, file=sys.stderr))
    report = trainer.check(batch, args.tolerance, args.seed)
    print(f"{args.model} under {args.strategy} on {topology.name}: {report.format()}")
    return EXIT_OK if report.ok else EXIT_FAILED


def _checkpoints_parser(sub, chosen: str | None):  # no config class: its options are its own
    p = sub.add_parser("checkpoints", help="list the checkpoints in a directory: step, model, layout and whether each verifies")
    p.add_argument("directory", metavar="DIR", help="a --checkpoint-dir a run saved into")
    return p


def _checkpoints(args) -> int:
    _simulate_cpu_devices(1)  # the arrays are read whole on this host and checked there
    from jaxpar.train.checkpoint import format_checkpoints, list_checkpoints

    rows = list_checkpoints(args.directory)
    print(format_checkpoints(args.directory, rows))
    return EXIT_OK if all(row["status"] == "verified" for row in rows if row["name"].isdigit()) else EXIT_FAILED


def _convert_parser(sub, chosen: str | None):  # no config class: its options are its own
    p = sub.add_parser("convert", help="Llama weights between the Hugging Face layout (config.json + safetensors) and a jaxpar "
                                       "checkpoint (restorable under any layout; --init-from fine-tunes from it)")
    way = p.add_mutually_exclusive_group(required=True)
    way.add_argument("--from-hf", metavar="DIR", help="a Hugging Face Llama directory to read")
    way.add_argument("--from", dest="from_checkpoint", metavar="CHECKPOINT_DIR", help="a jaxpar checkpoint directory to read")
    p.add_argument("--to", metavar="CHECKPOINT_DIR", help="with --from-hf: the jaxpar checkpoint directory to write (empty)")
    p.add_argument("--to-hf", metavar="DIR", help="with --from: the Hugging Face directory to write")
    p.add_argument("--name", default="hf-llama", help="with --from-hf: the model's name in the checkpoint")
    p.add_argument("--step", type=int, help="with --from: the checkpoint to write (default: the newest)")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="with --to-hf: the largest safetensors file, as Hugging Face's max_shard_size (default 5GB; e.g. 500MB, 2GiB)")
    return p


def _convert(args) -> int:
    one_way = (args.from_hf, args.to, args.to_hf is None) if args.from_hf else (args.from_checkpoint, args.to_hf, args.to is None)
    if not all(one_way):
        raise JaxparError("jaxpar convert reads one way: --from-hf DIR --to CHECKPOINT_DIR, or --from CHECKPOINT_DIR --to-hf DIR")
    from jaxpar import hf

    say = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    if args.from_hf:
        done = hf.from_hf(args.from_hf, args.to, args.name, say)
    else:
        done = hf.to_hf(args.from_checkpoint, args.to_hf, args.step, say, hf.shard_size_bytes(args.max_shard_size))
    print(f"wrote {done['tensors']} tensors to {done['directory']}")
    return EXIT_OK


def _verify_parser(sub, chosen: str | None):  # no config class: its options are its own
    p = sub.add_parser("verify", help="prove (or falsify) properties of a network over input regions by IBP, CROWN or "
                                      "alpha-CROWN bounds, on one device or under fsdp/tensor/data")
    p.add_argument("--model", required=True, metavar="FILE.onnx", help="a feed-forward network (dense, conv, ReLU) in ONNX")
    p.add_argument("--property", required=True, action="append", metavar="FILE.vnnlib",
                   help="a VNN-LIB property: an input box and the unsafe outputs (repeat for several)")
    p.add_argument("--method", default="crown", help="ibp, crown or alpha-crown (default crown)")
    p.add_argument("--strategy", default="", help="a layout of data, fsdp and tensor over simulated devices, e.g. fsdp=8 "
                                                  "(default: one device)")
    p.add_argument("--share-specs", action="store_true",
                   help="under fsdp, each device bounds its share of the specifications: the bound matrices' memory and "
                        "work divided by the fsdp degree (bounds equal one device's to float32 rounding, not bitwise)")
    p.add_argument("--alpha-steps", type=int, default=20, metavar="N", help="alpha-CROWN's optimisation steps (default 20)")
    p.add_argument("--attack-steps", type=int, default=50, metavar="N",
                   help="steps of the search for a counterexample where the bounds cannot prove a property (default 50)")
    p.add_argument("--json", metavar="FILE", help="also write every property's verdict, bounds, time and memory as JSON")
    return p


def _verify(args) -> int:
    from jaxpar.verify import sharded

    _simulate_cpu_devices(max(1, math.prod(sharded.degrees(args.strategy, 1 << 30).values())))
    from jaxpar.verify import check, onnx_file, vnnlib

    if args.json:  # (jaxpar.run, the training stack, is imported only for its JSON writing)
        from jaxpar.run import check_writable, write_json_atomically

        check_writable(args.json, "--json", room=1 << 16)
    net = onnx_file.load_onnx(args.model)
    properties = {path: vnnlib.load_vnnlib(path, math.prod(net.in_shape), math.prod(net.out_shape)) for path in args.property}
    records = {}  # every file read and checked before the first bound
    for number, (path, prop) in enumerate(properties.items(), 1):
        where = f"under {args.strategy}" if args.strategy else "on one device"
        print(f"[{number}/{len(properties)}] {path}: {args.method} {where}, then a search for a counterexample "
              f"if the bounds do not prove it ...", flush=True)
        records[path] = check.check(net, prop, args.method, args.strategy, alpha_steps=args.alpha_steps,
                                    attack_steps=args.attack_steps, share_specs=args.share_specs)
        print("\n".join(check.summary(path, records[path])), flush=True)
    if args.json:
        write_json_atomically(args.json, {"model": args.model, "properties": records})
    return EXIT_OK if all(r["verdict"] == "verified" for r in records.values()) else EXIT_FAILED


def _train(args) -> int:
    from jaxpar import launch
    from jaxpar.topology import load_topology

    topology = load_topology(args.topology)
    dist = config_from_args(launch.DistributedArgs, args, "train")
    if topology.platform == "cpu":
        _simulate_cpu_devices(launch.local_share(topology.num_chips, dist))
    from jaxpar.report import format_summary, step_report
    from jaxpar.train.checkpoint import CheckpointConfig
    from jaxpar.run import (
        NothingToDo, RunConfig, check_run, check_writable, interruption_message, run_training, write_json_atomically,
    )
    from jaxpar.train.step import TrainConfig

    checkpoint = None
    given = given_flags(CheckpointConfig, args, "train")  # --checkpoint-every, --keep-checkpoints
    if args.checkpoint_dir:
        checkpoint = config_from_args(CheckpointConfig, args, "train")
    elif given:
        flag, value = next(iter(given.values()))
        raise JaxparError(f"{flag} {value} does nothing without --checkpoint-dir; add --checkpoint-dir DIR or drop it")
    if os.environ.get(launch.ENV_ROLE) and "every" in given:  # (their exchange: every round's end is saved)
        raise JaxparError(f"--checkpoint-every {given['every'][1]}: decoupled learners and their syncer save at every "
                          "round's end, as the merges need; drop --checkpoint-every")
    # a job the launcher restarts resumes if it saves checkpoints at all
    resume = args.resume or (os.environ.get(launch.ENV_RESUME, "never") if checkpoint else "never")
    strategy = args.strategy + (f",context_algorithm={args.context_algorithm}" if args.context_algorithm else "")
    # explicit: --schedule and --chunks as given, refused without a stage axis even at their defaults
    run = config_from_args(RunConfig, args, "train", strategy=strategy, explicit=frozenset(given_flags(TrainConfig, args, "train")),
                           train=config_from_args(TrainConfig, args, "train"))
    check_run(run, checkpoint, resume)  # before joining a multi-process job (run_training checks again)
    if args.metrics_json:  # the report: about 3 KiB of settings and figures, and 75 bytes a step
        check_writable(args.metrics_json, "--metrics-json", room=8192 + 96 * run.steps)
    if args.dcp == "on":
        return _train_dcp(args, topology, run)
    from jaxpar.parallel import parse_strategy, runner

    own_runner = runner(parse_strategy(run.strategy, topology.num_chips))
    if own_runner:
        if os.environ.get(launch.ENV_ROLE):  # one process of jaxpar launch --learners: a learner may be a job of several
            launch.initialize(dist, topology.platform)
        elif launch.local_share(topology.num_chips, dist) != topology.num_chips:
            raise JaxparError(f"--strategy {run.strategy} runs in one process yet; drop the multi-process options")
        return _train_apart(args, topology, run, own_runner, checkpoint, resume)
    launch.initialize(dist, topology.platform)
    record = _record(args, "train")
    try:
        report = run_training(run, topology, checkpoint=checkpoint, resume=resume, analyze=step_report,
                              on_start=_partial_metrics(args.metrics_json, run, topology), record=record)
    except NothingToDo as done:  # a job that is finished already: a rerun, or a launcher's restart after the last save
        print(f"jaxpar train: {done}", file=sys.stderr)
        return EXIT_OK
    import jax

    if jax.process_index() == 0:  # process 0 speaks for the job
        if report["interrupted"]:
            print(f"jaxpar train: {interruption_message(report)}", file=sys.stderr)
        else:
            print(format_summary(report))
        if args.metrics_json:
            write_json_atomically(args.metrics_json, dict(report, run=record))
            print(f"\nmetrics written to {args.metrics_json}")
    if report["interrupted"]:
        return EXIT_ON_SIGNAL[report["interrupted"]]
    return EXIT_FAILED if report["nonfinite"] else EXIT_OK


def _command_options(chosen: str) -> dict:
    """{key: argparse action} of the options of the command ``chosen`` (``runfile.options_of``)."""
    from jaxpar import runfile

    parser = _parser(chosen)
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return runfile.options_of(commands.choices[chosen])


def _checkpoint_record(directory: str) -> dict:
    """The run record (``_record``) kept in the newest checkpoint of ``directory``."""
    from jaxpar.train.checkpoint import newest_meta

    meta = newest_meta(directory)
    if "run" not in meta:
        raise JaxparError(f"--config {directory}: its checkpoints keep no run record (saved before records were kept, or not by "
                          f"jaxpar train); give a run file")
    return meta["run"]


def _record(args, chosen: str) -> dict:
    """The run's resolved options and, in ``recorded``, the versions it ran with (a run file)."""
    from importlib import metadata

    import jax

    from jaxpar import runfile

    recorded = {"jaxpar": metadata.version("jaxpar"), "jax": jax.__version__, "command": chosen,
                "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    return dict(runfile.resolved(args, _command_options(chosen)), **{runfile.RECORDED: recorded})


def _partial_metrics(path: str | None, run, topology):
    """``run_training``'s ``on_start`` for ``--metrics-json``: a partial report, written before the
    step is compiled, so that a disk that filled up since the start (``check_writable`` saw room for
    the report) is refused then (exit 2) rather than after training; the full report replaces it
    whole at the end, and a run that dies or cannot write it leaves the partial one as it is."""
    if not path:
        return None

    def write():
        import jax

        from jaxpar.errors import JaxparError, JobFailed
        from jaxpar.run import write_json_atomically

        if jax.process_index() != 0:  # process 0 writes for the job
            return
        partial = {"partial": True, "note": "the run started; its report replaces this file when it ends",
                   "topology": topology.name, **{k: getattr(run, k) for k in ("model", "strategy", "steps", "batch_size", "seq_len", "seed")}}
        try:
            write_json_atomically(path, partial)
        except JobFailed as err:
            raise JaxparError(f"--metrics-json {path}: {err}") from None

    return write


def _train_apart(args, topology, run, runner: str, checkpoint, resume: str) -> int:
    """``jaxpar train`` of a strategy that its own runner trains (``parallel.runner``: federation's
    groups): its ``train`` and ``summary``, in one process (or, under ``jaxpar launch --learners``,
    one learner, which reports nothing, or the syncer)."""
    import importlib

    from jaxpar.run import write_json_atomically

    module = importlib.import_module(runner)
    report = module.train(run, topology, checkpoint=checkpoint, resume=resume)
    if report is None:
        return EXIT_OK
    print("\n".join(module.summary(report)))
    if args.metrics_json:
        write_json_atomically(args.metrics_json, report)
        print(f"\nmetrics written to {args.metrics_json}")
    return EXIT_OK


def _train_dcp(args, topology, run) -> int:
    """``jaxpar train --dcp on``: the documents of the main job's corpus, or of ``--data``, under
    data-centric parallel."""
    from jaxpar.models import llama
    from jaxpar.train import data, dcp
    from jaxpar.run import StopSignals, open_data, run_model_config, write_json_atomically
    from jaxpar.train.step import TrainConfig

    # (the run's numbers were checked with the main job's: check_run)
    ignored = [flag for flag, given in (
        ("--strategy", args.strategy != "fsdp=4,tensor=2"), ("--checkpoint-dir", args.checkpoint_dir), ("--packing", args.packing == "on"),
        ("--context-algorithm", args.context_algorithm), ("--microbatches", args.microbatches != 1), ("--remat", args.remat != "none"),
        ("--grad-sync", args.grad_sync != "exact"), ("--grad-reduce-dtype", args.grad_reduce_dtype != "float32"),
        ("--schedule", args.schedule is not None), ("--chunks", args.chunks is not None), ("--skip-nonfinite", args.skip_nonfinite),
        ("--block-size", args.block_size is not None), ("--window", args.window is not None),
        ("--init-from", args.init_from), ("--tensorboard", args.tensorboard)) if given]
    if ignored:
        raise JaxparError(f"--dcp on chooses the layout, accumulation and recomputation of every step itself (data and context "
                          f"over all devices, whole documents, one exact float32 gradient sum); drop {', '.join(ignored)}")
    cfg = run_model_config(run)  # the vocabulary follows --tokenizer
    if type(cfg) is not llama.LlamaConfig:
        raise JaxparError(f"--dcp on trains a Llama on whole documents; --model {args.model} is not one: drop --dcp, or pick a Llama")
    own = open_data(run, lambda message: print(message, file=sys.stderr, flush=True))
    docs = own[0].documents() if own else data.documents(data.split_corpus(data.corpus_tokens())[0])
    train_cfg = TrainConfig(learning_rate=args.learning_rate, warmup_steps=args.warmup_steps, total_steps=args.steps,
                            compute_dtype=args.compute_dtype, attention=args.attention)
    with StopSignals() as signals:  # SIGINT / SIGTERM stop the run at the next step boundary, as the main job's
        report = dcp.train(lambda rngs: llama.Llama(cfg, rngs=rngs), llama.loss_fn, cfg, docs, steps=args.steps,
                           batch_size=args.batch_size, capacity=args.seq_len, memory_budget=0.5 * topology.hbm_bytes, seed=args.seed,
                           cfg=train_cfg, stop=lambda: signals.name is not None)
    report["interrupted"] = signals.name
    ratios = ", ".join(f"{kind} {ratio:.2f}" for kind, ratio in report["imbalance"].items())
    print(f"programs (context degree, remat, rows per call): {report['programs']}\nwork imbalance per device (max / mean, mean over steps): {ratios}")
    if report["seconds_per_bucket"]:
        print("seconds per step in each bucket (median): " + ", ".join(f"context {c}: {t:.3f} s" for c, t in report["seconds_per_bucket"].items()))
    if args.metrics_json:
        write_json_atomically(args.metrics_json, report)
    if signals.name:
        print(f"jaxpar train: interrupted by {signals.name} after step {report['last_step']} of {report['steps']} "
              f"(--dcp on keeps no checkpoint)", file=sys.stderr)
        return EXIT_ON_SIGNAL[signals.name]
    return EXIT_OK


class _Terminated(BaseException):
    """SIGTERM, raised like KeyboardInterrupt so that cleanup (``finally``) runs on the way out."""


def _end_now(command: str, signum: int):
    """Say that ``command`` was stopped by ``signum`` and end the process at once with 130 / 143."""
    with contextlib.suppress(Exception):  # a reader gone away: the exit status still tells
        sys.stdout.flush()
    with contextlib.suppress(Exception):
        print(f"jaxpar {command}: {'interrupted by SIGINT' if signum == signal.SIGINT else 'stopped by SIGTERM'}",
              file=sys.stderr, flush=True)
    os._exit(EXIT_SIGINT if signum == signal.SIGINT else EXIT_SIGTERM)


@contextlib.contextmanager
def _signals_end(command: str):
    """While ``command`` runs, SIGINT and SIGTERM end it at once with one line and 130 / 143 (the
    training loop defers them to the end of its step itself, atomic writes to their rename; a
    signal the parent ignores stays ignored).

    The handler leaves by ``os._exit``, not by an exception, for two reasons seen with jaxpar train.
    jax waits for a compile that runs on an XLA thread and lets Python run handlers meanwhile: an
    exception then unwound the main thread, and the interpreter's finalisation destroyed the XLA
    client under the compile still running (SIGSEGV, status 139, 7 times in 8 during a compile). And
    an exception raised by a handler is lost when the signal lands in a gc callback (jax registers
    one) or a ``__del__``: Ctrl-C while jax was imported printed "Exception ignored" and the run went
    on to the end. Exiting at once leaves nothing half-written: orbax commits a checkpoint by a rename
    (an interrupted save is never picked up) and output files are written atomically. ``launch``
    still raises: its ``finally`` blocks stop its processes, and it runs no XLA."""
    def handler(signum, frame):
        if command == "launch":
            raise KeyboardInterrupt if signum == signal.SIGINT else _Terminated
        _end_now(command, signum)

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig, old in previous.items():
        if old is not signal.SIG_IGN:
            signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            if old is not None:  # None: set outside Python, not restorable from here
                signal.signal(sig, old)


def _epilog() -> str:
    return "exit statuses:\n" + "\n".join(f"  {code:<4d} {meaning}" for code, meaning in EXIT_STATUSES.items())


def _parser(chosen: str | None) -> argparse.ArgumentParser:
    """jaxpar's parser; of the commands with config classes, only ``chosen`` gets its options."""
    parser = argparse.ArgumentParser(
        prog="jaxpar", description="Write a model once with logical axis names; run it under any layout.",
        epilog=_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command")
    for add in (_train_parser, _bench_parser, _compile_parser, _plan_parser, _launch_parser, _checkpoints_parser, _check_parser,
                _generate_parser, _affinity_parser, _convert_parser, _verify_parser):
        add(sub, chosen)
    return parser


COMMANDS = {"train": _train, "bench": _bench, "compile": _compile, "plan": _plan, "launch": _launch, "checkpoints": _checkpoints,
            "check": _check, "generate": _generate, "affinity": _affinity, "convert": _convert, "verify": _verify}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # The command is the first word that is not an option (jaxpar itself takes -h only). Its options
    # come from its config classes, whose modules import jax: the other commands' are not loaded,
    # and a signal while they load ends it as one that comes later would.
    chosen = next((arg for arg in argv if not arg.startswith("-")), None)
    if chosen not in COMMANDS:  # none, or not one: the usage (or -h), or argparse's refusal
        parser = _parser(None)
        parser.parse_args(argv)
        parser.print_help()
        return EXIT_BAD_INPUT
    message = None
    with _signals_end(chosen):
        try:
            if chosen == "train":  # a run file's options first: those given here override them
                from jaxpar import runfile

                argv = runfile.with_config(argv, _command_options(chosen), _checkpoint_record)
            status = COMMANDS[chosen](_parser(chosen).parse_args(argv))
        except JaxparError as err:  # bad input (2), or a job that ran and failed (JobFailed: 1)
            status, message = err.exit_status, str(err)
        except KeyboardInterrupt:
            status, message = EXIT_SIGINT, "interrupted by SIGINT"
        except _Terminated:
            status, message = EXIT_SIGTERM, "stopped by SIGTERM"
    if message:
        print(f"jaxpar {chosen}: {message}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
