"""Block parallelism (BP) for block diffusion models (``models/bd3lm.py``), ``block=P``, and
context-sharded block parallelism (CSBP), ``block=P,context=C``.

A BD3-LM reads [x_t ; x_0]: N noisy blocks, each denoised from itself and the clean blocks before
it, and the clean sequence, block-causal. Under BP every device of the ``block`` axis owns N / P
whole noisy blocks of every row of its batch shard, in dual-end pairs (block i with block N-1-i:
a pair sees N+1 blocks' keys whatever i, so every device does the same attention work), and
computes the clean half itself: the clean keys and values its blocks read are its own, and
nothing but the weights' gradients crosses ``block``. Which blocks a device owns and how its
share of a row is cut are in this folder's ``blocks.py``.

The layout: ``length`` and ``residual_length`` are split over ``block`` (a device holds its
noisy blocks then the clean half), so the loss and the weights' gradients are summed over
``block`` as over the batch axes (``Layout.loss_axes``); the batch's rows reach every device of a
``block`` group whole. Per device and step the only traffic is that gradient all-reduce, which
``block`` joins (a ring all-reduce over data x block instead of data). The clean half's work is
repeated on every device, the price of sending no keys and values, but only up to the last block
a noisy block reads: N/P + N-1 blocks of every row (``blocks.clean_prefix``).

CSBP, ``block=P,context=C`` (P a multiple of C; P devices in all): the clean half is split over
the ``context`` ring in zigzag chunks as under context parallelism, and each ring rank's share
over its P/C devices, so a device holds 2L/P tokens: its N/P noisy blocks and L/P clean tokens.
The noisy blocks are owned by all P devices (the mesh axes ``block`` of P/C and ``context`` of C
together, context inner). ``block=P,context=P`` is the matched CSBP: the clean keys and values
travel the ring (``parallel/context/split_attention.py``, at given places), the noisy ones never
leave their device. Per layer and device the ring sends (C-1)/C of the clean K/V forward, and
backward the same again plus the clean K/V gradients in float32, C hops of 1/C: against context
parallelism of [x_t ; x_0] over P devices, half the tokens travel. With P > C each clean token is
still computed once: the P/C devices of a ring rank all-gather their pieces' K/V over ``block``
before the ring ((P/C-1)/(P/C) of the rank's share, again under remat) and reduce-scatter the
gradients back (``split_attention.RING_PIECES``); none of them recomputes another's.

``clean_kv=fetch`` (for a model with a sliding window, where a block reads W/B clean blocks):
instead of the ring, each device fetches, in one all-to-all over ``context``, the clean tokens its
blocks read and it does not hold, in slots of S tokens (the most one device needs from another).
Per layer and device: forward (C-1) x S tokens' K/V, backward their cotangents the same (and the
forward again under remat).
"""

import math

from jaxpar.errors import LayoutError, SpecError
from jaxpar.mesh import divisors
from jaxpar.parallel import data
from jaxpar.parallel.base import option_of
from jaxpar.parallel.block.blocks import BLOCKS, attention_work, check_degree, fetch_plan, held_places
from jaxpar.parallel.context.split_attention import FETCH, RING, RING_PIECES, SHARES

AXES = ("block",)
NEEDS_MODEL = "it splits a block diffusion model's noisy blocks (e.g. --model bd3lm-tiny)"
CROSSES_DCN = True  # only the gradient all-reduce crosses it, as over data
CLEAN_KV = ("ring", "fetch")


OPTIONS = {"clean_kv": (option_of({k: k for k in CLEAN_KV}, "choose ring (the clean keys and values travel the context "
                                   "ring) or fetch (each device fetches, in one all-to-all, the clean blocks its sliding "
                                   "windows read)"), "ring")}


def check(strategy):
    degrees = strategy.degrees
    if "clean_kv" in strategy.given and not (_ranks(strategy) > 1 and degrees["context"] > 1):
        raise SpecError(f"clean_kv= says how the clean keys and values cross the context axis under CSBP "
                        f"(block=P,context=C); {strategy} has no such split: drop clean_kv or add block= and context=")
    if _ranks(strategy) == 1:
        return
    for axis, why in (("stage", "a pipeline's stages would each hold a share of a different row"),
                      ("expert", "a block diffusion model has no experts")):
        if degrees[axis] > 1:
            raise SpecError(f"block={_ranks(strategy)} with {axis}={degrees[axis]}: {why}; drop {axis}= or block=")
    if degrees["context"] > 1 and strategy.options["context_algorithm"] != "ring":
        raise SpecError(f"block with context={degrees['context']} (CSBP) moves the clean keys and values on a ring: "
                        f"use context_algorithm=ring, not {strategy.options['context_algorithm']}")


def fold(degrees: dict[str, int], num_devices: int) -> dict[str, int]:
    """The degrees as written, ``block=P,context=C``, as the mesh holds them: ``block`` P/C, so
    that block x context = P devices. Refuses a P that is not a multiple of C, suggesting degrees
    that are and that fill ``num_devices``."""
    p, c = degrees.get("block", 1), degrees.get("context", 1)
    if p == -1 or p == 1 or c == 1:
        return degrees
    if c == -1 or p % c:
        fixes = _refolds(degrees, num_devices)
        raise SpecError(f"block={p} with context={c}: the BP degree (devices that own noisy blocks) must be a multiple of "
                        f"the context degree (devices the clean half is split over), block=P,context=C using P devices; "
                        + (f"on {num_devices} devices e.g. --strategy {' or '.join(fixes)}" if fixes else
                           f"no such degrees fill {num_devices} devices with the other axes as given: change them too"))
    return dict(degrees, block=p // c)


def unfold(degrees: dict[str, int], written: dict[str, int]) -> dict[str, int]:
    """CSBP is written with block=P counting every device that owns blocks; the mesh's block axis
    is P / C, which is 1 where P = C."""
    if written.get("block", 1) != 1 and degrees["context"] > 1:
        return {"block": degrees["block"] * degrees["context"]}
    return {}


def _ranks(strategy) -> int:
    """The devices that own a block diffusion model's noisy blocks: the written block=P."""
    return strategy.written_degrees["block"]


def _refolds(degrees: dict[str, int], num_devices: int) -> list[str]:
    """Up to three strategies near ``degrees`` whose block is a multiple of context and that fill
    ``num_devices`` (the other axes kept; ``data`` takes what is left if nothing fills it)."""
    p, c = degrees["block"], degrees["context"]
    near = [dict(degrees, block=c * k) for k in range(1, num_devices // c + 1)] if c > 1 else []
    near += [dict(degrees, context=d) for d in divisors(p) if 1 < d]
    out = []
    for cand in near:
        folded = dict(cand, block=cand["block"] // cand["context"])
        fixed = math.prod(d for d in folded.values() if d != -1)
        if num_devices % fixed:
            continue
        if -1 not in folded.values() and fixed != num_devices:
            cand = {"data": cand.get("data", 1) * num_devices // fixed, **cand}
        text = ",".join(f"{axis}={d}" for axis, d in cand.items())
        if text not in out:
            out.append(text)
    return out[:3]


def roles(strategy) -> dict[str, tuple[str, ...]]:
    """The axes the noisy blocks are split over (context inner), which also cut each row's share
    in the loss; under clean_kv=fetch the context axis the clean keys are fetched over."""
    blocks = AXES + (("context",) if _ranks(strategy) > 1 else ())
    fetch = ("context",) if strategy.options["clean_kv"] == "fetch" else ()
    csbp = strategy.degrees["context"] > 1 and not fetch
    pieces = AXES if csbp and strategy.degrees["block"] > 1 else ()  # P > C: the clean share split, all-gathered
    return {BLOCKS: blocks, SHARES: blocks, FETCH: fetch, RING_PIECES: pieces}


def check_model(strategy, cfg, seq_len: int):
    """Refuse diffusion blocks the P devices cannot own in pairs (under CSBP 2P blocks also split
    the clean half over the C ring ranks and let clean_kv=fetch deal them, C dividing P)."""
    if _ranks(strategy) > 1:
        check_degree(seq_len // cfg.block_size, _ranks(strategy))


def check_calls(layout, calls):
    if layout.role(BLOCKS) and "block_share" not in calls:
        raise LayoutError(
            f"the layout splits a block diffusion model's noisy blocks over {'/'.join(layout.role(BLOCKS))} (block "
            f"parallelism), but the loss never takes this device's share of the batch "
            f"(jaxpar.nn.block_share, as jaxpar.models.bd3lm.loss_fn does): every device would "
            f"compute the whole objective. Use a block diffusion model, or drop block=")


def manual_only(layout, calls) -> str | None:
    return "block parallelism (block > 1)" if layout.role(BLOCKS) else None


def runtime_axes(layout) -> tuple[str, ...]:
    return layout.role(BLOCKS)


def attention_kernel(layout) -> str | None:
    """The mask is evaluated at each device's token places, which only the blockwise kernel takes."""
    return "blockwise" if layout.role(BLOCKS) else None


def _size(layout, axes) -> int:
    return math.prod(layout.mesh.shape[a] for a in axes)


def report(layout, measured, cfg) -> dict | None:
    """The clean keys and values the context ring carries per layer against the formula, the bytes
    of every other collective over the block axes but the gradient all-reduce (noisy keys and
    values never travel: 0), and each device's attention work (``measured.length``: the model's 2L)."""
    if not layout.role(BLOCKS):
        return None
    ranks, ring, fetch = _size(layout, layout.role(BLOCKS)), _size(layout, layout.role(RING)), bool(layout.role(FETCH))
    moved = "all-to-all" if fetch else "collective-permute"  # the fetch, or the ring
    clean = measured.communication.get(moved, {"measured_bytes": 0.0, "optimal_bytes": 0.0})
    clean_ring = (moved, tuple(layout.role(RING)))
    pieces = [c for c in measured.collectives if c.kind in ("all-gather", "reduce-scatter") and layout.role(RING_PIECES)
              and c.mesh_axes == tuple(layout.role(RING_PIECES))]
    others = sum(c.bytes_per_step for c in measured.collectives if set(c.mesh_axes) & set(layout.role(BLOCKS))
                 and c.kind != "all-reduce" and (c.kind, c.mesh_axes) != clean_ring and c not in pieces)
    length = measured.length
    work = attention_work(length // 2, cfg.block_size, ranks, ring, cfg.window, fetch)
    ring_permutes = [c for c in measured.collectives if c.kind == "collective-permute" and c.mesh_axes == tuple(layout.role(RING))]
    return {"ranks": ranks, "ring": ring, "noisy_blocks_per_device": length // 2 // cfg.block_size // ranks,
            "tokens_per_device": int(held_places(length // 2, cfg.block_size, ranks, ring, fetch).shape[1]),
            "clean_kv": "fetched in one all-to-all" if fetch else "on the ring",
            "clean_kv_per_layer": {"measured_bytes": clean["measured_bytes"] / cfg.layers,
                                   "formula_bytes": clean["optimal_bytes"] / cfg.layers,
                                   "context_parallel_bytes": None if fetch else _context_parallel_bytes(ring_permutes, ring, ranks)},
            "clean_pieces_bytes_per_layer": sum(c.bytes_per_step for c in pieces) / cfg.layers,
            "other_bytes_over_block_axes": others, "attention_work_per_device": work.tolist(),
            "imbalance": float(work.max() / work.mean())}


def _context_parallel_bytes(ring_permutes, ring: int, ranks: int) -> float | None:
    """Per layer and device, what context parallelism over the same ``ranks`` devices would send:
    the ring's formula (``parallel/context``) for the whole [x_t ; x_0], read off this program's
    clean ring (the K or V of one rank's share in the compute dtype, their gradients in float32)."""
    sizes = {c.operand_bytes for c in ring_permutes}
    if not sizes:
        return None
    share = max(sizes) / 4  # elements of one rank's clean K (or V): its float32 gradient's bytes / 4
    compute_bytes = min(sizes) / share
    kv = 2 * 2 * share * ring  # K and V of both halves of [x_t ; x_0], the device's rows
    return 2 * (ranks - 1) / ranks * kv * compute_bytes + kv * 4


def summary(bp: dict) -> list[str]:
    ring = f", the clean half split over {bp['ring']} (CSBP)" if bp["ring"] > 1 else ", the clean half on every device"
    kv = bp["clean_kv_per_layer"]
    lines = ["", f"block parallelism: {bp['noisy_blocks_per_device']} noisy blocks and {bp['tokens_per_device']} tokens per device "
             f"of {bp['ranks']}{ring}; per layer and device",
             f"  clean K/V {bp['clean_kv']:25s} {kv['measured_bytes']:14,.0f} bytes   formula {kv['formula_bytes']:14,.0f}"]
    if kv["context_parallel_bytes"]:
        lines.append(f"  context={bp['ranks']} would send               {kv['context_parallel_bytes']:14,.0f} bytes   "
                     f"(this layout {kv['measured_bytes'] / kv['context_parallel_bytes']:.2f}x)")
    if bp["clean_pieces_bytes_per_layer"]:
        lines.append(f"  clean K/V pieces all-gathered and their gradients reduce-scattered over the ring rank's devices "
                     f"{bp['clean_pieces_bytes_per_layer']:,.0f} bytes")
    return lines + [f"  anything else over the block axes but the gradient all-reduce (noisy K/V stay): {bp['other_bytes_over_block_axes']:,.0f} bytes",
                    f"  attention work per device, max / mean: {bp['imbalance']:.3f}"]


def rules(strategy, compute: dict, stored: dict):
    compute["length"] = compute["length"] + AXES
    compute["residual_length"] = compute["residual_length"] + AXES


def traffic(strategy, ctx) -> dict:
    """The gradient all-reduce's bytes that ``block`` adds to the data axes' (and context's), and
    under ``clean_kv=fetch`` the fetch's all-to-all (the ring's are context's)."""
    p, ring, model = ctx.mesh["block"], ctx.mesh["context"], ctx.model
    if not ctx.layout.role(BLOCKS):
        return {}
    shard = ctx.all_reduced("block") * ctx.reduce_bytes
    n = ctx.mesh["data"] * ring * ctx.mesh["context_a2a"]
    out = {("all-reduce", "block"): data.grad_allreduce_bytes(shard, n * p) - data.grad_allreduce_bytes(shard, n)} if p > 1 else {}
    if ctx.layout.role(RING_PIECES) and model is not None:
        # each device's piece of its ring rank's clean K/V (L / P tokens) is all-gathered over its
        # rank's P / C devices (again under remat), and the gradients reduce-scattered once
        kv_heads = max(1, model.kv_heads // ctx.mesh["tensor"])
        share = ctx.batch // ctx.batch_shards * ctx.length // 2 // ring * kv_heads * model.head_dim * 2 * ctx.compute_bytes
        moved = model.layers * (p - 1) / p * share
        out[("all-gather", "block")] = (1 + (ctx.remat != "none")) * moved
        out[("reduce-scatter", "block")] = moved
    if ctx.layout.role(FETCH) and model is not None:
        length = ctx.length // 2  # tokens per half of [x_t ; x_0]
        slot = fetch_plan(ctx.clean_reads, length, model.block_size, p * ring, ring)[0].shape[2]
        kv_heads = max(1, model.kv_heads // ctx.mesh["tensor"])
        pair = ctx.batch // ctx.batch_shards * slot * kv_heads * model.head_dim * 2 * ctx.compute_bytes  # K and V of a slot
        out[("all-to-all", "context")] = model.layers * (1 + (ctx.remat != "none") + 1) * (ring - 1) * pair
    return out

