"""Pipeline schedules side by side on 8 simulated CPU devices: bubble, memory, compile and step time.

    python benchmarks/pipeline.py [--stages 4] [--microbatches 8] [--layers 8] [--repeats 3]

Model: the repo's tiny Llama with ``--layers`` layers, one gradient computation per step
(``pipeline_value_and_grad`` under an all-manual layout ``stage=S,data=8/S``, as the training step
would run it), batch of 4 sequences of 64 tokens per micro-batch. Columns:

- ticks, bubble: from the schedule table (F = B = one tick); ``bubble@lat2``: the same schedule
  when a send takes a whole tick (``latency=2``), where eager 1F1B pays off;
- peak in flight on stage 0, and the activation buffer slots the executor allocates;
- temp MiB: ``compiled.memory_analysis().temp_size_in_bytes`` per device;
- compile s, step ms (median of ``--repeats`` runs after a warm-up);
- sent KiB: the collective-permute bytes per device per step read off the compiled program
  (``analysis/hlo.py``: each tick's permute spans only the stages that send), next to the formula,
  2 m (S v - 1) / S activations.

On simulated CPU devices all "devices" share the host's cores, so the step time measures the total
work (each backward recomputes its forward), not the critical path: the bubble shows in step time
only on real, parallel devices. The last row is the same model without a pipeline, for reference.

First, estimated (no compile, ``analysis/overlap.py``): ``llama3-8b`` in S stages, one stage per
node of 8 H100s (``gpu-h100-64``: every stage boundary on InfiniBand), data=8 inside a node, m
micro-batches of 8 x 4096 tokens: a forward's seconds from the stage's matmul FLOPs at the
roofline's H100 efficiency, a backward twice that, a send one GPU's activation at the node's
InfiniBand share; the step run per device in the schedule's program order (a send exposed only on
the critical path) and in lockstep (the SPMD executor: every send exposed), and the same with a link
slow enough that a send takes half a forward, where eager 1F1B pays off.

Then the MPMD pipeline (``parallel/stage/mpmd.py``), each stage on 8/S devices with a layout of its own
(``--mpmd-specs``, default alternating ``data=k`` and ``tensor=k``), per schedule: first-step
seconds (compiles included), step ms, and the activation bytes that crossed between stages per step
with broadcast delivery against naive per-receiver sends.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--estimate-only", action="store_true", help="only the estimated table")
    parser.add_argument("--mpmd-specs", default=None, help="comma-free specs joined by ';', e.g. 'tensor=4;data=4'")
    return parser.parse_args()


def main():
    args = parse_args()
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    estimate_table(args.stages, args.microbatches)
    if args.estimate_only:
        return
    import jax
    from flax import nnx

    from jaxpar.analysis import hlo
    from jaxpar.models import llama
    from jaxpar.parallel import build_layout, parse_strategy
    from jaxpar.parallel.stage import pipeline as pl
    from jaxpar.train.state import abstract_model

    S, m = args.stages, args.microbatches
    cfg = dataclasses.replace(llama.CONFIGS["tiny"], layers=args.layers)
    graphdef, abstract = abstract_model(lambda r: llama.Llama(cfg, rngs=r))
    with nnx.use_eager_sharding(False):
        params = nnx.to_pure_dict(nnx.state(llama.Llama(cfg, rngs=nnx.Rngs(0))))
    model = pl.split_by_layer_stack(llama.pipeline_pieces(cfg), abstract)
    stacked, edge = model.split(params)
    layout = build_layout(parse_strategy(f"stage={S},data={8 // S}", 8))
    tokens = jax.random.randint(jax.random.key(0), (m, 4, 65), 0, cfg.vocab_size)

    def seconds(run):
        start = time.perf_counter()
        jax.block_until_ready(run())
        return time.perf_counter() - start

    def median_ms(run):
        return statistics.median(seconds(run) for _ in range(args.repeats)) * 1e3

    def timed(fn, *xs):
        start = time.perf_counter()
        compiled = jax.jit(fn).lower(*xs).compile()
        compile_s = time.perf_counter() - start
        jax.block_until_ready(compiled(*xs))
        memory = compiled.memory_analysis()
        return compile_s, median_ms(lambda: compiled(*xs)), memory.temp_size_in_bytes / 2**20, compiled.as_text()
    candidates = schedule_candidates(S, m, cfg.layers)
    header = f"{'schedule':<20} {'ticks':>5} {'bubble':>7} {'bubble@lat2':>11} {'in flight':>9} {'slots':>5} " \
             f"{'temp MiB':>8} {'compile s':>9} {'step ms':>8} {'sent KiB':>9} {'formula':>8}"
    # one micro-batch's activation between stages, per device (its rows split over data)
    activation = 4 // (8 // S) * 64 * cfg.embed * 4
    print(f"tiny Llama, {cfg.layers} layers, stage={S} x data={8 // S}, {m} micro-batches of 4 x 64 tokens")
    print(header)
    print("-" * len(header))
    pieces = model.pieces
    for label, schedule, slow in candidates:

        def grads(s, e, t, schedule=schedule):
            return pl.pipeline_value_and_grad(pieces.stage_fn, s, t, layout.mesh, schedule, first_fn=pieces.first_fn,
                                              last_fn=pieces.last_fn, edge_params=e, layout=layout, names=model.names)

        compile_s, step_ms, temp, text = timed(grads, stacked, edge, tokens)
        sent = sum(c.bytes_per_step for c in hlo.collectives(text, layout.mesh) if c.kind == "collective-permute")
        formula = 2 * m * (S * schedule.chunks - 1) * activation / S  # every boundary, forward and back, mean per device
        print(f"{label:<20} {schedule.ticks:>5} {schedule.bubble_fraction():>7.3f} {slow.bubble_fraction():>11.3f} "
              f"{schedule.peak_in_flight()[0]:>9} {pl.lower(schedule).act_slots:>5} {temp:>8.2f} {compile_s:>9.1f} "
              f"{step_ms:>8.1f} {sent / 1024:>9.1f} {formula / 1024:>8.1f}")

    def reference(p, t):
        def loss(p):
            net = nnx.merge(graphdef, p)
            return sum(llama.loss_fn(net, mb) for mb in t) / len(t)

        return jax.value_and_grad(loss)(p)

    with jax.default_device(jax.devices()[0]):
        compile_s, step_ms, temp, _ = timed(reference, params, tokens)
    print(f"{'no pipeline, 1 dev':<20} {'':>5} {'':>7} {'':>11} {'':>9} {'':>5} {temp:>8.2f} {compile_s:>9.1f} {step_ms:>8.1f}")

    mpmd_table(args, candidates, model, stacked, edge, jax.device_get(tokens), median_ms)


def schedule_candidates(S: int, m: int, layers: int) -> list:
    """(label, schedule, the same when a send takes a whole tick) of the schedules that fit these sizes."""
    from jaxpar.parallel.stage import pipeline as pl
    from jaxpar.parallel.stage import schedules as sc

    candidates = []
    for name, chunks in [("gpipe", 1), ("1f1b", 1), ("eager-1f1b", 1), ("interleaved-1f1b", 2)]:
        try:
            schedule = sc.make(name, S, m, chunks)
            pl.layers_per_chunk(layers, schedule)
        except sc.ScheduleError as error:
            print(f"{name:<20} skipped: {error}")
            continue
        candidates.append((name if chunks == 1 else f"{name} v={chunks}", schedule, sc.make(name, S, m, chunks, latency=2)))
    return candidates


def mpmd_table(args, candidates, model, stacked, edge, host_tokens, median_ms):
    """The MPMD pipeline per schedule: first step (compiles), step time, bytes between stages."""
    import jax

    from jaxpar.models import llama
    from jaxpar.parallel.stage import mpmd

    S = args.stages
    k = 8 // S
    specs = args.mpmd_specs.split(";") if args.mpmd_specs else [f"data={k}" if s % 2 == 0 else f"tensor={k}" for s in range(S)]
    layouts = mpmd.stage_layouts(specs)
    print(f"\nMPMD: stages {' | '.join(specs)}")
    header = f"{'schedule':<20} {'first step s':>12} {'step ms':>8} {'sent MiB':>8} {'naive MiB':>9}"
    print(header)
    print("-" * len(header))
    for label, schedule, _ in candidates:
        pipe = mpmd.MPMDPipeline(model.pieces, layouts, schedule, names=model.names, activation_names=llama.RESIDUAL)
        weights = pipe.place(stacked, edge)
        step = lambda: pipe.value_and_grad(weights, host_tokens)  # noqa: E731
        start = time.perf_counter()
        jax.block_until_ready(step())
        first_s = time.perf_counter() - start
        sent = (pipe.traffic.forward_bytes + pipe.traffic.backward_bytes) / 2**20
        print(f"{label:<20} {first_s:>12.1f} {median_ms(step):>8.1f} {sent:>8.2f} "
              f"{pipe.traffic.naive_bytes / 2**20:>9.2f}")

def estimate_table(S: int, m: int):
    from jaxpar.analysis import overlap, roofline
    from jaxpar.models import llama
    from jaxpar.parallel.stage import schedules as sc
    from jaxpar.topology import load_topology

    cfg, topology, tokens = llama.CONFIGS["llama3-8b"], load_topology("gpu-h100-64"), 4096  # per GPU per micro-batch
    rate = topology.peak_bf16_flops * roofline.matmul_efficiency(topology.chip)
    layer = cfg.embed * (cfg.heads + cfg.kv_heads) * cfg.head_dim * 2 + 3 * cfg.embed * cfg.mlp
    forward = 2 * layer * cfg.layers / S * tokens / rate
    send = tokens * cfg.embed * 2 / roofline.link_bandwidth(topology, True)
    print(f"estimated: llama3-8b, {S} stages of 8 x H100 (InfiniBand between), {m} micro-batches of 8 x {tokens}; "
          f"forward {1e3 * forward:.1f} ms, backward {2e3 * forward:.1f} ms, send {1e3 * send:.2f} ms "
          f"(slow link: {0.5e3 * forward:.1f} ms)")
    header = f"{'schedule':<20} {'bubble':>7} {'step s':>7} {'exposed':>8} {'lockstep s':>10} {'exposed':>8} {'slow link s':>11} {'exposed':>8}"
    print(header)
    print("-" * len(header))
    for name, chunks in [("gpipe", 1), ("1f1b", 1), ("eager-1f1b", 1), ("interleaved-1f1b", 2)]:
        try:
            schedule = sc.make(name, S, m, chunks)
        except sc.ScheduleError as error:
            print(f"{name:<20} skipped: {error}")
            continue
        f = forward / chunks
        cells = [(overlap.schedule_seconds(schedule, f, 2 * f, x, lockstep), overlap.schedule_exposed(schedule, f, 2 * f, x, lockstep))
                 for x, lockstep in ((send, False), (send, True), (forward / 2, False))]
        print(f"{name if chunks == 1 else f'{name} v={chunks}':<20} {schedule.bubble_fraction():>7.3f} "
              + " ".join(f"{step:>{w}.3f} {exposed:>8.3f}" for (step, exposed), w in zip(cells, (7, 10, 11))))
    print()


if __name__ == "__main__":
    main()
