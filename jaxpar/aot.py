"""Compile a training step for a topology ahead of time, on any machine.

For TPU topologies the devices come from ``jax.experimental.topologies.get_topology_desc`` (libtpu
from PyPI, ``pip install -e .[tpu]``): compile-only devices of a real pod, multi-slice included, so
XLA's TPU compiler builds the real program and nothing runs. Where libtpu is missing, and for GPU
and CPU topologies, the step is compiled for simulated CPU devices with the same mesh shape, and the
report says which compiler produced it. The model is abstract throughout (``nnx.eval_shape``).
"""

from __future__ import annotations

import dataclasses
import os

import jax

from jaxpar.analysis import hlo, memory, roofline, traffic
from jaxpar.attention import check_platform
from jaxpar.errors import JaxparError, JobFailed
from jaxpar.mesh import dcn_misplaced, split_ici_dcn
from jaxpar.models import family_of, llama
from jaxpar import parallel, planner, scalars
from jaxpar.parallel import parse_strategy
from jaxpar.parallel.stage import schedules
from jaxpar.topology import Topology
from jaxpar.run import (
    RunConfig, check_at_least, check_fits_fully_sharded, check_model_axes, check_unused_options, check_writable,
    plan_run, run_model_config, write_text_atomically,
)
from jaxpar.train.step import TrainConfig, Trainer


@dataclasses.dataclass(frozen=True)
class Target:
    devices: list
    compiler: str  # "tpu" (libtpu, ahead of time) or "cpu" (simulated devices, same mesh shape)
    note: str = ""


def tpu_devices(topology: Topology) -> list:
    """Compile-only devices of a TPU topology (all slices); raises if libtpu is not installed."""
    from jax.experimental import topologies

    # several processes may hold libtpu (tests, a notebook): compile-only use needs no exclusive lock
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    kwargs = {"num_slices": topology.num_slices} if topology.is_multi_slice else {}
    return list(topologies.get_topology_desc(platform="tpu", topology_name=topology.tpu_topology, **kwargs).devices)


def target_for(topology: Topology) -> Target:
    """Devices to compile for: the real TPU compiler where it can be had, else simulated CPUs."""
    if topology.platform == "tpu":
        try:
            devices = tpu_devices(topology)
            return Target(devices, "tpu")
        except Exception as err:  # libtpu missing or refusing: say so, fall back to CPU
            reason = f"TPU compiler unavailable ({type(err).__name__}: {str(err).splitlines()[0][:120]})"
    else:
        reason = f"{topology.platform} topology"
    cpus = jax.devices("cpu")
    if len(cpus) < topology.num_chips:
        raise JaxparError(
            f"{reason}: compiling for {topology.num_chips} simulated CPU devices needs them set before JAX "
            f"starts (XLA_FLAGS=--xla_force_host_platform_device_count={topology.num_chips}); "
            f"`jaxpar compile` does this itself, and `pip install -e .[tpu]` brings the TPU compiler"
        )
    return Target(cpus[: topology.num_chips], "cpu", f"{reason}: compiled by XLA:CPU for simulated devices with the same mesh shape")


# what a pod step compiles with unless told otherwise: bf16 compute (float32 master weights) and full
# remat, as MaxText's published plans; gradients are still reduced in float32 unless asked
POD_DEFAULTS = TrainConfig(compute_dtype="bfloat16", remat="full")


def compile_report(model, topology: Topology, strategy_text: str, batch_size: int, seq_len: int, cfg: TrainConfig = POD_DEFAULTS,
                   alternatives: int = 3, dump_hlo: str | os.PathLike | None = None, explicit: frozenset[str] = frozenset(),
                   progress=None, **run_options) -> dict:
    """Compile the training step for ``topology`` and report fit, traffic, cost and estimates.

    ``model``: a config name (``tiny``, ``llama2-7b``...) or a ``LlamaConfig``; ``cfg``: every
    option of the step as ``jaxpar train`` takes it (dtypes, remat, micro-batches, attention;
    ``attention="auto"`` is splash on a TPU pod). ``dump_hlo``: a directory to write the compiled
    program's text into; ``run_options``: the ``RunConfig`` fields that shape the program besides these:
    the options only the model's family takes (``block_size``, ``window`` of a block diffusion model,
    which reads ``seq_len`` tokens twice: [x_t ; x_0]; ``capacity_factor``, ``balance_weight``,
    ``bias_rate`` of a mixture of experts), ``tokenizer`` (the vocabulary follows it) and
    ``packing`` (rows of whole documents, with segment ids); ``explicit``: the fields of ``cfg`` given on
    purpose (refused, like any non-default value, where the layout would ignore them); ``progress``:
    a stream for a spinner while XLA compiles (minutes for a pod) and the time it took.

    A plan that cannot fit is a ``JobFailed`` when the compiler itself refuses it (XLA:TPU);
    otherwise the report says whether it fits (``memory_per_chip["fits"]``)."""

    name = model if isinstance(model, str) else "the model"
    model_cfg, strategy = _checked_plan(model, topology, strategy_text, batch_size, seq_len, cfg, explicit, run_options)
    family = family_of(model_cfg)
    if dump_hlo is not None:
        check_writable(str(dump_hlo), "--dump-hlo", directory=True)
    target = target_for(topology)
    n = len(target.devices)
    _, dcn = split_ici_dcn(strategy.spec, topology.num_slices)
    train_cfg = dataclasses.replace(cfg, attention=_attention_for(cfg.attention, target, seq_len, strategy),
                                    memory_bytes=topology.hbm_bytes)
    run = RunConfig(model=name, strategy=strategy_text, steps=cfg.total_steps, batch_size=batch_size, seq_len=seq_len,
                    train=train_cfg, explicit=explicit, **run_options)
    plan = plan_run(run, topology, target.devices, model_cfg, must_fit=False)  # the fit is what this reports
    trainer, batch, layout = Trainer.from_plan(plan.step), plan.example, plan.step.layout
    with scalars.working(f"compiling the step for {topology.name} ({target.compiler.upper()}, {n} devices)", progress):
        compiled = _compiled(trainer, batch, f"{name} with batch {batch_size} x {seq_len} under {strategy}", topology)
    if dump_hlo is not None:
        write_text_atomically(os.path.join(dump_hlo, "step.hlo.txt"), compiled.as_text())

    dcn_axes = tuple(a for a, d in dcn.items() if d > 1)
    cols = hlo.collectives(compiled.as_text(), layout.mesh, dcn_axes, topology.num_slices)
    rows = [(c.kind, c.mesh_axes, c.bytes_per_step, any(dcn[a] > 1 for a in c.mesh_axes)) for c in cols]
    model_length = family.reads(seq_len)  # a block diffusion model reads [x_t ; x_0]
    model_flops = model_cfg.flops_per_token(model_length) * batch_size * model_length
    estimate = _estimate(trainer, strategy, model_cfg, batch_size, model_length, rows, topology)
    cost = compiled.cost_analysis() or {}
    by_link, misplaced = _by_link(cols, rows, dcn, topology, strategy.spec)
    return {
        "dcn_warnings": misplaced,
        "model": model if isinstance(model, str) else "custom",
        "num_params": model_cfg.num_params(),
        "topology": topology.name,
        "chips": n,
        "strategy": str(strategy),
        "compiler": target.compiler,
        "compiler_note": target.note,
        "attention": train_cfg.attention,
        "options": {"compute_dtype": train_cfg.compute_dtype, "grad_reduce_dtype": train_cfg.grad_reduce_dtype,
                    "remat": train_cfg.remat, "microbatches": train_cfg.microbatches},
        "fsdp_policy": {"regather": trainer.plan.regather, "reason": trainer.plan.regather_reason},
        "batch_size": batch_size,
        "seq_len": seq_len,
        "memory_per_chip": _memory_per_chip(compiled.memory_analysis(), topology, trainer),
        "collectives": by_link,
        # by kind against the strategies' formulas (a ragged all-to-all: the buffers that bound it)
        "communication": traffic.compare(compiled.as_text(), trainer, strategy, (batch_size, model_length), model_cfg),
        "float32_gradient_reduction": _float32_gradient_cost(cols, trainer) if train_cfg.grad_reduce_dtype == "float32" else None,
        "compiler_cost_analysis": {k: cost.get(k) for k in ("flops", "bytes accessed", "optimal_seconds")},
        "model_flops_per_step": model_flops,
        "roofline": estimate.as_dict(),
        "alternatives": rank_alternatives(trainer, strategy, topology, model_cfg, batch_size, model_length, alternatives),
    }


def _compiled(trainer: Trainer, batch, what: str, topology: Topology):
    """The step compiled for the target; a program XLA:TPU refuses for its size is the answer to
    "does it fit?": no (a JobFailed, exit 1), with what to try."""
    try:
        return trainer.jit_step(batch).lower(trainer.abstract_state(), batch).compile()
    except jax.errors.JaxRuntimeError as err:
        if "RESOURCE_EXHAUSTED" not in str(err):
            raise
        raise JobFailed(
            f"{what} does not fit on {topology.name}: {str(err).splitlines()[0].split(': ', 1)[-1].rstrip('.')}. "
            f"Try regather=on (FSDP gathers each layer again instead of keeping every layer's weights), a "
            f"smaller --batch-size or --seq-len, or more sharding (tensor, fsdp)"
        ) from None


def _checked_plan(model, topology: Topology, strategy_text: str, batch_size: int, seq_len: int, cfg: TrainConfig,
                  explicit: frozenset[str], run_options: dict):
    """(model config, strategy) of a plan, every input refused that cannot work or would do nothing,
    before the (slow) TPU compiler is loaded or anything is built."""
    name = model if isinstance(model, str) else "the model"
    check_at_least("--batch-size", batch_size, 1)
    check_at_least("--seq-len", seq_len, 1)
    schedules.check_chunks(cfg.schedule, cfg.chunks)
    check_platform(cfg.attention, topology.platform, f"topology {topology.name}")  # the pod's kernels, not this host's
    if isinstance(model, llama.LlamaConfig):
        model_cfg = model
    else:
        model_cfg = run_model_config(RunConfig(model=model, seq_len=seq_len, **run_options))
    check_fits_fully_sharded(model_cfg.num_params(), topology, name)
    strategy = parse_strategy(strategy_text, topology.num_chips)
    check_model_axes(strategy, model_cfg, name)
    parallel.check_model(strategy, model_cfg, seq_len)
    check_unused_options(RunConfig(train=cfg, explicit=explicit), strategy)
    parallel.check_run(strategy, cfg)
    return model_cfg, strategy


def _attention_for(asked: str, target: Target, seq_len: int, strategy) -> str:
    """The kernel the pod runs for ``--attention asked``: ``auto`` is JAX's splash kernel on a TPU pod
    (this host's backend, the CPU, would choose blockwise), so the compiled memory is the pod's;
    lengths splash cannot tile take blockwise, and so do block parallelism (its mask is evaluated
    at each device's token places, which splash cannot) and the context ring (blockwise on each
    pair of chunks): the strategies' ``attention_kernel``."""
    if asked != "auto":
        return asked
    splash = target.compiler == "tpu" and seq_len % 128 == 0 and parallel.attention_kernel(strategy) is None
    return "splash" if splash else "blockwise"


def _memory_per_chip(stats, topology: Topology, trainer) -> dict:
    """The compiled step's memory per chip (XLA's memory analysis), its peak against HBM, and the
    state as stored (the ZeRO table)."""
    peak = (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes + stats.temp_size_in_bytes
            + stats.generated_code_size_in_bytes)
    return {
        "arguments": stats.argument_size_in_bytes,
        "outputs": stats.output_size_in_bytes,
        "aliased": stats.alias_size_in_bytes,
        "temporaries": stats.temp_size_in_bytes,
        "generated_code": stats.generated_code_size_in_bytes,
        "peak": peak,
        "hbm": topology.hbm_bytes,
        "fits": peak <= topology.hbm_bytes,
        **trainer.stored_bytes_per_device(),
        "zero_table": memory.zero_table(trainer),
    }


def _by_link(cols, rows, dcn: dict, topology: Topology, spec) -> tuple[dict, list[dict]]:
    """The compiled collectives summed by kind, mesh axes and link; and for each axis misplaced
    across slices, its bytes and their time over DCN against ICI."""
    by_link = {}
    for c, (_, _, sent, crosses) in zip(cols, rows):
        key = f"{c.kind} over {'+'.join(c.mesh_axes) or '-'} ({'DCN' if crosses else 'ICI'})"
        entry = by_link.setdefault(key, {"count": 0, "bytes_per_chip": 0.0})
        entry["count"] += c.executions
        entry["bytes_per_chip"] += sent
    misplaced = []
    for axis in dcn_misplaced(spec, dcn):
        sent = [(c.kind, b) for c, (_, _, b, _) in zip(cols, rows) if axis in c.mesh_axes]
        misplaced.append({
            "axis": axis,
            "bytes_per_chip": sum(b for _, b in sent),
            "dcn_seconds": sum(roofline.collective_seconds(k, b, True, topology) for k, b in sent),
            "ici_seconds": sum(roofline.collective_seconds(k, b, False, topology) for k, b in sent),
        })
    return by_link, misplaced


def _float32_gradient_cost(cols, trainer) -> dict:
    """What jaxpar's default, gradients reduced in float32, costs: the bytes per chip of the float32
    reductions over the axes the loss is summed over (bf16 would send half of them), and, where the
    layers compute in bf16 and gather their weights, the float32 stack of every layer's gradient the
    backward pass ends with (reduced in bf16 it is stacked in bf16: ``rules._narrow_stack``)."""
    layout = trainer.layout
    summed = set(layout.loss_axes)
    sent = sum(c.bytes_per_step for c in cols
               if c.kind in ("reduce-scatter", "all-reduce") and c.dtype == "f32" and c.mesh_axes and set(c.mesh_axes) <= summed)
    narrower = trainer.cfg.compute_dtype != "float32"
    return {"bytes_per_chip": sent, "bfloat16_saves": sent / 2,
            "bfloat16_saves_memory": trainer.sharded_state.gathered_layer_bytes(2, stored=True) if narrower else 0}


def _estimate(trainer, strategy, model_cfg, batch_size: int, seq_len: int, rows, topology: Topology) -> roofline.StepEstimate:
    """The roofline of ``trainer``'s step from traffic ``rows`` (kind, mesh axes, bytes per chip, crosses DCN)."""
    layout, cfg = trainer.layout, trainer.cfg
    return roofline.estimate_step(
        model_cfg, batch_size, seq_len, rows, topology, layout.mesh.size, state_bytes=memory.zero_table(trainer),
        batch_axes=layout.batch_axes, tensor=layout.mesh.shape["tensor"], recompute=roofline.RECOMPUTE[cfg.remat],
        attention=cfg.attention, compute_dtype=cfg.compute_dtype)


def rank_alternatives(trainer, current, topology: Topology, cfg, batch_size: int, seq_len: int, count: int) -> list[dict]:
    """The ``count`` best other layouts for the same chips, with the step's remat and micro-batches,
    as ``jaxpar plan`` ranks them (``jaxpar.planner``: analytic traffic and memory, not compiled);
    a layout that does not fit ranks after every one that does."""
    if count <= 0:
        return []
    step_cfg = trainer.cfg
    problem = planner.Problem(cfg, topology, batch_size, seq_len, compute_dtype=step_cfg.compute_dtype,
                              grad_reduce_dtype=step_cfg.grad_reduce_dtype, only_remat=step_cfg.remat,
                              only_microbatches=step_cfg.microbatches)
    rows = []
    for plan in planner.search(problem):
        if _same_layout(plan.candidate.strategy_text, current, topology.num_chips):
            continue
        rows.append({"strategy": plan.candidate.strategy_text, "step_s": plan.step_s,
                     "comm_s": plan.exposed_comm_s + plan.overlapped_comm_s, "mfu": plan.mfu, "fits": plan.fits,
                     "state_bytes_per_chip": sum(plan.memory[k] for k in ("parameters", "optimizer", "gradients"))})
        if len(rows) == count:
            break
    return rows


def _same_layout(text: str, current, chips: int) -> bool:
    strategy = parse_strategy(text, chips)
    return strategy.degrees == current.degrees and strategy.zero_stage == current.zero_stage


def compile_plans(plans, count: int, cfg: TrainConfig = POD_DEFAULTS) -> list[dict]:
    """The ``count`` best of ``plans`` (``jaxpar.planner.plan``) compiled (TPU ahead of time, else
    simulated CPU devices), each plan's predicted memory and traffic per device next to the
    compiler's (memory: the program's data, its peak less its code; traffic: every collective's
    bytes). A plan split unevenly across device groups compiles as its even layout (jaxpar runs one
    SPMD program), which the row says."""
    problem, rows = plans.problem, []
    for plan in plans.ranked[:count]:
        c = plan.candidate
        step_cfg = dataclasses.replace(cfg, remat=c.remat, microbatches=c.microbatches, compute_dtype=problem.compute_dtype,
                                       grad_reduce_dtype=problem.grad_reduce_dtype)
        report = compile_report(problem.cfg, problem.topology, c.strategy_text, problem.batch, plans.seq_len, step_cfg,
                                alternatives=0)
        mem = report["memory_per_chip"]
        rows.append({"plan": c.describe(), "compiler": report["compiler"],
                     "predicted_memory": plan.memory_bytes, "compiled_memory": mem["peak"] - mem["generated_code"],
                     "predicted_traffic": plan.traffic_bytes,
                     "compiled_traffic": sum(r["bytes_per_chip"] for r in report["collectives"].values()),
                     "note": _compiled_as(plan)})
    return rows


def _compiled_as(plan) -> str:
    """What of a plan its compile stands for: jaxpar runs one SPMD program, an equal share on every
    chip, so an uneven split compiles as the even one, and a placement of modules on device groups
    as a layout jaxpar runs on the same chips."""
    split = plan.split
    if split is None or (split.kind != "modules" and len(set(split.shares)) == 1):
        return ""
    if split.kind == "modules":
        return f"compiled as {plan.candidate.strategy_text}, a layout jaxpar runs on these chips ({split.describe()} is a plan only)"
    return f"compiled as the even split ({split.describe()} is a plan only)"


def format_report(report: dict) -> str:
    """The human table printed by ``jaxpar compile``."""
    gib = lambda b: f"{b / 2**30:8.2f} GiB"  # noqa: E731
    mem, est = report["memory_per_chip"], report["roofline"]
    compiler = "XLA:TPU, ahead of time" if report["compiler"] == "tpu" else report["compiler_note"]
    lines = [
        f"{report['model']} ({report['num_params'] / 1e9:.2f}B weights) on {report['topology']} ({report['chips']} chips), "
        f"strategy {report['strategy']}, batch {report['batch_size']} x {report['seq_len']}",
        f"compiled by {compiler}; attention {report['attention']}, "
        + ", ".join(f"{k.replace('_', '-')} {v}" for k, v in report["options"].items()),
        f"FSDP: {'weights gathered again for the backward pass' if report['fsdp_policy']['regather'] else 'gathered weights kept for the backward pass'} "
        f"({report['fsdp_policy']['reason']})",
        "",
        f"memory per chip: {'fits' if mem['fits'] else 'DOES NOT FIT'} ({gib(mem['peak']).strip()} of {gib(mem['hbm']).strip()} HBM)",
    ]
    for kind in ("parameters", "optimizer", "arguments", "outputs", "temporaries", "generated_code"):
        lines.append(f"  {kind:16s} {gib(mem[kind])}")
    for w in report["dcn_warnings"]:
        lines.append(
            f"WARNING: axis {w['axis']!r} crosses slices: {gib(w['bytes_per_chip']).strip()} per chip per step over DCN, "
            f"{w['dcn_seconds']:.3f} s instead of {w['ici_seconds']:.3f} s on ICI"
        )
    lines += ["", "collectives per step (bytes per chip)"]
    for name, row in sorted(report["collectives"].items(), key=lambda kv: -kv[1]["bytes_per_chip"]):
        lines.append(f"  {name:44s} x{row['count']:<6d} {gib(row['bytes_per_chip'])}")
    lines.append("  by kind against the analytic optimum: " + ", ".join(
        f"{kind} {row['ratio']:.3f}" for kind, row in report["communication"].items() if "ratio" in row and row["optimal_bytes"]))
    if report["float32_gradient_reduction"]:
        f32 = report["float32_gradient_reduction"]
        memory_saved = (f" and hold {gib(f32['bfloat16_saves_memory']).strip()} less at the end of the backward pass (the layers' "
                        f"gradients stacked in bf16)") if f32["bfloat16_saves_memory"] else ""
        lines.append(f"  gradients are reduced in float32 (the default: never silently bf16): {gib(f32['bytes_per_chip']).strip()}; "
                     f"--grad-reduce-dtype bfloat16 would send {gib(f32['bfloat16_saves']).strip()} less{memory_saved}")
    cost = report["compiler_cost_analysis"]
    lines += [
        "",
        f"compiler's estimate (loop bodies counted once; a hint only): {cost['flops'] or 0:.3e} flops, "
        f"{cost['bytes accessed'] or 0:.3e} bytes accessed, " + _compiler_seconds(cost['optimal_seconds']),
        f"roofline estimate (matmuls at {100 * est['matmul_efficiency']:.0f}% of peak for {report['topology']}'s chip):",
        f"  compute {est['compute_s']:.3f} s = matmuls {est['matmul_s']:.3f} + attention {est['attention_s']:.3f} + HBM-bound "
        f"{est['hbm_s']:.3f} (" + ", ".join(f"{part} {t:.3f}" for part, t in est["hbm_by_part_s"].items()) + ")",
        f"  communication: overlapped {est['overlapped_comm_s']:.3f} s, exposed {est['exposed_comm_s']:.3f} s (first gather "
        f"{est['first_gather_s']:.3f}, last reduction {est['last_reduction_s']:.3f}, activations {est['activation_comm_s']:.3f}, "
        f"DCN {est['dcn_s']:.3f})",
        f"  step {est['step_s']:.3f} s ({est['serial_step_s']:.3f} s serial), MFU {100 * est['mfu']:.1f}% "
        f"({100 * est['mfu_full_attention']:.1f}% counting all attention FLOPs, as MaxText publishes; ceiling "
        f"{100 * est['ceiling_mfu']:.1f}%)",
        "",
        "best alternatives (analytic traffic, not compiled)",
    ]
    for alt in report["alternatives"]:
        fits = "" if alt["fits"] else "  state DOES NOT FIT"
        lines.append(f"  {alt['strategy']:32s} step {alt['step_s']:.3f} s  MFU {100 * alt['mfu']:.1f}%  state {gib(alt['state_bytes_per_chip'])}{fits}")
    return "\n".join(lines)


def _compiler_seconds(seconds) -> str:
    # TPU programs keep scanned layers as loops whose bodies the compiler counts once: its figure
    # can even come out negative, which means nothing
    if seconds is None or seconds < 0:
        return f"no usable time ({seconds})"
    return f"{seconds:.4f} s"
