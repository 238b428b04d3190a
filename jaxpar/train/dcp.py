"""Data-centric parallel (DCP): a batch of variable-length sequences runs with the parallel settings
its lengths call for, and updates the weights exactly as one device would.

Per step, on N devices whose weights are stored whole (the data and context axes; AdamW state
replicated):

1. **Buckets.** A device holds at most ``capacity`` token positions of a row. A sequence of n
   tokens needs context degree c, the smallest power of two with c x ``capacity`` >= n - 1 (the
   ring: every device again holds ``capacity`` positions) and with its work over c devices at
   most a device's mean share of the batch's work (a long sequence would otherwise keep its c
   devices busy after the others are done). Sequences go longest first into the
   fullest row of any degree they still fit in (best fit), else into a new row of their own
   degree: the tail of a long sequence's row holds short sequences rather than padding.
2. **Balance.** Each bucket's rows go to its N/c data groups, the most work first to the least
   loaded group (attention work is quadratic in a document's length, so a row's work is not its
   length). Every group runs as many rows: where a degree's rows do not fill its groups, whole
   rows of the lower degrees are joined into filler rows for the groups that would run an empty
   one (highest degree first), and only what is still short is padded with empty rows.
3. **Accumulation and remat per bucket**, from an analytic memory model: a device's activations
   for one call are ``rows x capacity x bytes_per_token`` (the Llama's saved activations per
   token, or one residual per layer under ``remat=full``); calls take as many rows as fit in
   ``memory_budget`` bytes, with remat only where one row would not fit without it.
4. **Programs.** Each (context degree, remat) is one ``Trainer`` and each call shape one compiled
   program. Rows per call are powers of two (a group's rows are split into calls by the binary
   digits of their count, none padded up to a power of two), so the shapes are few and known
   from the batch size (``call_shapes``): ``compile_ahead`` compiles them all before the
   first step, and the programs of a step are dispatched back to back (on XLA:CPU each waited for,
   see ``gradients``). A program returns every device's own unreduced
   gradient; they are added on each device, then reduced once over all devices, clipped and
   applied. Each token's loss is weighted by the global batch's real-token count, so the update
   equals that of the same batch on one device (or under a static layout).

``imbalance`` measures what this buys: the largest device's useful work (matmul FLOPs of its real
tokens plus the attention FLOPs of their within-document pairs) over the mean, for this plan, for
static context parallelism (rows of the longest length, split c ways, dealt out in order) and for
plain packing (data parallel rows of the longest length).
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.errors import JaxparError
from jaxpar.parallel import build_layout, parse_strategy
from jaxpar.train import reductions
from jaxpar.train.state import leave_to_rules
from jaxpar.train.step import TrainConfig, Trainer, TrainState


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One program's share of a step: ``rows[g]`` the rows data group g runs, each row a list of
    sequence indices packed into it, ``length`` positions per row, split ``context`` ways."""

    context: int
    length: int
    rows: tuple  # per data group: tuple of rows, each a tuple of sequence indices
    call_rows: tuple[int, ...]  # rows each data group runs in each call, in order (powers of two)
    remat: str


def sequence_work(n: int, cfg) -> float:
    """Useful training FLOPs of one sequence of n tokens (n - 1 predictions): 6 per weight per
    token in the matmuls, and 3 x 4 x heads x head_dim per causal query-key pair per layer."""
    matmul = cfg.flops_per_token(0) * (n - 1)
    attention = 3 * 4 * cfg.layers * cfg.heads * cfg.head_dim * (n - 1) * n / 2
    return matmul + attention


def bytes_per_token(cfg, remat: str, compute_bytes: int = 4) -> float:
    """The activations one token position keeps for the backward pass, per device (analytic)."""
    if remat != "none":
        return cfg.layers * cfg.embed * compute_bytes  # the layer's input, recomputed from
    per_layer = 8 * cfg.embed + 2 * cfg.heads * cfg.head_dim + 4 * cfg.kv_heads * cfg.head_dim + 3 * cfg.mlp
    return cfg.layers * per_layer * compute_bytes + cfg.vocab_size * 4  # + the float32 logits


def plan(lengths, num_devices: int, capacity: int, cfg, memory_budget: float) -> list[Bucket]:
    """The buckets of a batch of sequences of these lengths (module doc, points 1 to 3)."""
    lengths = [int(n) for n in lengths]
    work = lambda row: sum(sequence_work(lengths[i], cfg) for i in row)  # noqa: E731
    levels = _rows_by_context(lengths, num_devices, capacity, work)
    remat, fit = _remat_and_fit(capacity, cfg, memory_budget)
    buckets = []
    load = np.zeros(num_devices)  # useful work dealt to each device so far
    for c in sorted(levels, reverse=True):  # the longest first: the short rows then fill around them
        rows = levels[c]
        if c > 1:
            rows += _fillers(levels, c, -len(rows) % (num_devices // c), capacity * c, lengths)
        if not rows:  # every row went up as fillers
            continue
        dealt = _deal(rows, c, load, work)
        calls = _call_rows(len(dealt[0]), fit)
        buckets.append(Bucket(c, capacity * c, tuple(tuple(g) for g in dealt), calls, remat))
    return sorted(buckets, key=lambda b: b.context)


def _context_of(n: int, num_devices: int, capacity: int, work: float, share: float) -> int:
    """The smallest power of two c whose c x ``capacity`` positions hold a sequence of n tokens
    and whose devices' part of its ``work`` is at most ``share`` (a device's mean of the batch's
    work): a sequence that alone outweighs a device's share is spread over more devices."""
    if n - 1 > capacity * num_devices:
        raise JaxparError(f"a sequence of {n} tokens does not fit on {num_devices} devices of {capacity} positions each "
                          f"(at most {capacity * num_devices + 1} tokens); raise the capacity or cut the sequence")
    c = 1
    while n - 1 > capacity * c:
        c *= 2
    if num_devices % c:
        raise JaxparError(f"a sequence of {n} tokens needs context parallelism {c}, which does not divide {num_devices} devices")
    while work / c > share and num_devices % (2 * c) == 0:
        c *= 2
    return c


def _rows_by_context(lengths, num_devices: int, capacity: int, work) -> dict[int, list[list[int]]]:
    """Rows of sequence indices by context degree: longest first, each sequence into the fullest
    row it still fits in, by positions and by work (a row of degree c holds at most c devices'
    mean share of the batch's work), else into a new row of its own degree (``_context_of``;
    ``work(row)`` the useful FLOPs of a row): the tail of a long sequence's row holds short ones
    instead of padding, and no row outweighs its devices' share."""
    share = work(range(len(lengths))) / num_devices
    levels: dict[int, list[list[int]]] = {}
    free: list[list] = []  # per row: [free positions, work it may still take, context, row index]
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n, w = lengths[i] - 1, work([i])
        fits = [room for room in free if room[0] >= n and room[1] >= w]
        if fits:
            room = min(fits, key=lambda room: room[0])
        else:
            c = _context_of(lengths[i], num_devices, capacity, w, share)
            levels.setdefault(c, []).append([])
            room = [capacity * c, c * share, c, len(levels[c]) - 1]
            free.append(room)
        room[0] -= n
        room[1] -= w
        levels[room[2]][room[3]].append(i)
    return levels


def _fillers(levels, context: int, slots: int, positions: int, lengths) -> list[list[int]]:
    """Up to ``slots`` rows of ``positions`` made of whole rows taken from the lower degrees (the
    lowest first): the data groups of degree ``context`` that would otherwise run an empty row run
    these, which the lower degrees then no longer run."""
    used = lambda row: sum(lengths[i] - 1 for i in row)  # noqa: E731
    fillers = []
    for _ in range(slots):
        filler = []
        for c in sorted(k for k in levels if k < context):
            kept = []
            for row in levels[c]:
                if used(filler) + used(row) <= positions:
                    filler += row
                else:
                    kept.append(row)
            levels[c][:] = kept
        if not filler:
            break
        fillers.append(filler)
    return fillers


def _remat_and_fit(capacity: int, cfg, memory_budget: float) -> tuple[str, int]:
    """(remat, rows of ``capacity`` positions a device's call holds in ``memory_budget``): remat
    only where one row would not fit without it."""
    remat = "none" if capacity * bytes_per_token(cfg, "none") <= memory_budget else "full"
    return remat, max(1, int(memory_budget // (capacity * bytes_per_token(cfg, remat))))


def _call_rows(per_group: int, fit: int) -> tuple[int, ...]:
    """The rows a data group runs in each call: powers of two of at most ``fit`` rows (the binary
    digits of ``per_group``, at most the largest power of two that fits), so that the call shapes,
    and so the compiled programs, are few and known before the first step (``call_shapes``), and
    no call runs empty rows to reach a power of two."""
    largest = 2 ** (fit.bit_length() - 1)
    calls = []
    while per_group:
        calls.append(min(largest, 2 ** (per_group.bit_length() - 1)))
        per_group -= calls[-1]
    return tuple(calls)


def call_shapes(batch_size: int, num_devices: int, capacity: int, cfg, memory_budget: float) -> list[tuple[int, str, int]]:
    """Every (context, remat, rows per call over all groups) ``plan`` can give a batch of at most
    ``batch_size`` sequences: the programs to compile before the first step. Every degree that
    divides the devices can occur (a short sequence heavy enough for its work to be spread), and
    a bucket of context c has at most one row per sequence (a filler row holds several), dealt
    over N / c groups."""
    remat, fit = _remat_and_fit(capacity, cfg, memory_budget)
    shapes, c = [], 1
    while num_devices % c == 0:
        groups = num_devices // c
        most = max(_call_rows(math.ceil(batch_size / groups), fit))
        shapes += [(c, remat, groups * 2 ** k) for k in range(most.bit_length())]
        c *= 2
    return shapes


def _deal(rows, context: int, load: np.ndarray, work) -> list[list]:
    """Rows to the data groups of ``context`` devices each, the most work first to the group whose
    busiest device has the least (``load``, per device, is updated); then equal counts."""
    groups = len(load) // context
    dealt = [[] for _ in range(groups)]
    for row in sorted(rows, key=lambda r: -work(r)):
        g = min(range(groups), key=lambda k: (load[k * context:(k + 1) * context].max(), len(dealt[k])))
        dealt[g].append(tuple(row))
        load[g * context:(g + 1) * context] += work(row) / context
    most = max(len(d) for d in dealt)
    return [d + [()] * (most - len(d)) for d in dealt]


def imbalance(lengths, num_devices: int, capacity: int, cfg, memory_budget: float, static_context: int) -> dict[str, float]:
    """max / mean useful work per device for this plan, static context parallelism and packing."""
    lengths = [int(n) for n in lengths]
    work = lambda row: sum(sequence_work(lengths[i], cfg) for i in row)  # noqa: E731
    per_device = np.zeros(num_devices)
    for bucket in plan(lengths, num_devices, capacity, cfg, memory_budget):
        for g, rows in enumerate(bucket.rows):
            per_device[g * bucket.context:(g + 1) * bucket.context] += sum(work(r) for r in rows) / bucket.context
    longest = max(lengths) - 1

    def static(c):
        packed = first_fit(lengths, math.ceil(longest / c) * c)
        devices = np.zeros(num_devices)
        for k, row in enumerate(packed):  # in order, as a data loader deals them
            g = k % (num_devices // c)
            devices[g * c:(g + 1) * c] += work(row) / c
        return devices

    ratio = lambda d: float(d.max() / d.mean())  # noqa: E731
    return {"dcp": ratio(per_device), f"static context={static_context}": ratio(static(static_context)), "packing": ratio(static(1))}


def first_fit(lengths, row_length: int) -> list[list[int]]:
    rows, free = [], []
    for i, n in enumerate(lengths):
        slot = next((r for r, f in enumerate(free) if f >= n - 1), None)
        if slot is None:
            rows.append([])
            free.append(row_length)
            slot = len(rows) - 1
        rows[slot].append(i)
        free[slot] -= n - 1
    return rows


class DataCentricTrainer:
    """Trains ``model_fn`` on batches of variable-length sequences (lists of 1-D int token arrays)
    over ``devices`` (default: all), by the plan above. ``cfg.remat`` is chosen per bucket."""

    def __init__(self, model_fn, loss_fn, model_cfg, cfg: TrainConfig = TrainConfig(), *, capacity: int,
                 memory_budget: float, devices=None, optimizer=None):
        self.devices = list(devices if devices is not None else jax.devices())
        self.model_fn, self.loss_fn, self.model_cfg, self.cfg = model_fn, loss_fn, model_cfg, cfg
        self.capacity, self.memory_budget = capacity, memory_budget
        self._trainers: dict[tuple[int, str], Trainer] = {}
        self._programs: dict[tuple[int, str, int], object] = {}  # compiled, by (context, remat, rows per call)
        self.compiles = 0  # programs compiled so far (``compile_ahead`` and any shape it did not foresee)
        self.bucket_seconds: dict[int, list[float]] = {}  # context degree -> each step's time in its bucket (XLA:CPU)
        self.base = self._trainer(1, cfg.remat)  # holds the state: every weight whole on every device
        self.optimizer = leave_to_rules(optimizer, self.base.abstract) if optimizer else self.base.optimizer
        self._flat = NamedSharding(jax.sharding.Mesh(np.array(self.devices), ("devices",)), PartitionSpec("devices"))
        # the state is whole on every device, from init and after every update: one update program
        self._whole = NamedSharding(self.base.layout.mesh, PartitionSpec())
        self._apply = jax.jit(self._apply_fn, donate_argnums=(0,), out_shardings=(self._whole, self._whole))
        self._add = jax.jit(lambda total, part: jax.tree.map(jnp.add, total, part), donate_argnums=(0,))

    def _trainer(self, context: int, remat: str) -> Trainer:
        key = (context, remat)
        if key not in self._trainers:
            n = len(self.devices)
            layout = build_layout(parse_strategy(f"data={n // context},context={context}", n), self.devices)
            self._trainers[key] = Trainer(layout, self.model_fn, self.loss_fn, dataclasses.replace(self.cfg, remat=remat, microbatches=1))
        return self._trainers[key]

    def init(self, seed: int = 0) -> TrainState:
        state = self.base.init(seed=seed)
        state = TrainState(state.params, self.optimizer.init(state.params), state.step)
        return jax.device_put(state, self._whole)

    def plan(self, sequences) -> list[Bucket]:
        return plan([len(s) for s in sequences], len(self.devices), self.capacity, self.model_cfg, self.memory_budget)

    def compile_ahead(self, params, batch_size: int) -> int:
        """Compile, before the first step, the program of every call shape a batch of at most
        ``batch_size`` sequences can need (``call_shapes``): no step then waits on a compile.
        Returns how many were compiled."""
        shapes = call_shapes(batch_size, len(self.devices), self.capacity, self.model_cfg, self.memory_budget)
        for context, remat, rows in shapes:
            self._program(context, remat, params, rows_batch([], [()] * rows, self.capacity * context, 1))
        zeros = lambda: self._on_flat((jnp.zeros(()), jax.tree.map(lambda p: jnp.zeros((len(self.devices), *p.shape), p.dtype), params)))  # noqa: E731
        self._add(zeros(), zeros())  # the adds of a step's programs' outputs, compiled (and run once, on zeros)
        return len(shapes)

    def _on_flat(self, out):
        """A program's (loss, stacked gradients) on the devices as one flat layout (the same
        buffers: no copy), so that every program's outputs add in one compiled program."""
        loss, grads = out
        return (jax.device_put(loss, NamedSharding(self._flat.mesh, PartitionSpec())),
                jax.device_put(grads, jax.tree.map(lambda _: self._flat, grads)))

    def _program(self, context: int, remat: str, params, batch):
        """(the compiled program for this call shape, the batch put on its devices)."""
        trainer = self._trainer(context, remat)
        placed = trainer.put_batch(batch)
        key = (context, remat, len(batch["inputs"]))
        if key not in self._programs:
            self._programs[key] = jax.jit(trainer.local_grad_fn()).lower(params, placed).compile()
            self.compiles += 1
        return self._programs[key], placed

    def gradients(self, params, sequences):
        """(mean loss over the real tokens, the gradient reduced over all devices) of a batch."""
        real = sum(len(s) - 1 for s in sequences)
        total = None
        wait = self.devices[0].platform == "cpu"
        for bucket in self.plan(sequences):
            start = time.perf_counter()
            for first, count in zip(np.cumsum((0,) + bucket.call_rows), bucket.call_rows):
                rows = [row for g in bucket.rows for row in g[first:first + count]]
                program, batch = self._program(bucket.context, bucket.remat, params, rows_batch(sequences, rows, bucket.length, real))
                out = self._on_flat(program(params, batch))
                if wait:
                    # on XLA:CPU one program's collectives must be done before the next program
                    # starts: on 8 simulated devices a 12-step run otherwise left a collective-
                    # permute's rendezvous waiting on 2 devices until XLA aborted. Elsewhere the
                    # programs are dispatched back to back
                    jax.block_until_ready(out)
                total = out if total is None else self._add(total, out)
            if wait:  # each call waited for: the bucket's time is its own (elsewhere it would cost the overlap)
                self.bucket_seconds.setdefault(bucket.context, []).append(time.perf_counter() - start)
        loss, stacked = total
        return loss, jax.tree.map(lambda g: jnp.sum(g, axis=0), stacked)  # the one reduction, over every device

    def _apply_fn(self, state: TrainState, grads):
        norm, grads = reductions.norm_and_clip(grads, self.cfg.clip_norm, self.base.sharded_state.rule_updated)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        return TrainState(optax.apply_updates(state.params, updates), opt_state, state.step + 1), norm

    def step(self, state: TrainState, sequences):
        loss, grads = self.gradients(state.params, sequences)
        state, norm = self._apply(state, grads)
        return state, {"loss": loss, "grad_norm": norm}


def rows_batch(sequences, rows, length: int, real: int) -> dict:
    """The dict batch of these rows (each a tuple of sequence indices, packed in order) at
    ``length`` positions, each token's loss weighted by the global batch's ``real`` tokens."""
    out = {k: np.zeros((len(rows), length), np.int32) for k in ("inputs", "targets", "positions", "segments")}
    out["weights"] = np.zeros((len(rows), length), np.float32)
    for r, row in enumerate(rows):
        at = 0
        for segment, i in enumerate(row, start=1):
            s, n = np.asarray(sequences[i]), len(sequences[i]) - 1
            out["inputs"][r, at:at + n], out["targets"][r, at:at + n] = s[:-1], s[1:]
            out["positions"][r, at:at + n] = np.arange(n)
            out["segments"][r, at:at + n] = segment
            out["weights"][r, at:at + n] = len(rows) * length / real
            at += n
    return out


def train(model_fn, loss_fn, model_cfg, docs, *, steps: int, batch_size: int, capacity: int, memory_budget: float,
          seed: int = 0, cfg: TrainConfig = TrainConfig(), log=print, stop=lambda: False) -> dict:
    """The main job under DCP (``jaxpar train --dcp on``): each step ``batch_size`` of the corpus's
    documents (``data.documents_at``, at most ``capacity`` x devices + 1 tokens each), planned,
    run and applied; the report holds the losses and, over all steps' batches, the work imbalance
    of the plans against static context parallelism and plain packing, and, where each program is
    waited for (XLA:CPU), the median seconds a step spends in each context degree's bucket. ``stop()`` true after a
    step ends the run there (a signal caught by the caller: ``jaxpar train`` stops at a step boundary)."""
    from jaxpar.train import data  # the corpus; the planner above needs only lengths

    trainer = DataCentricTrainer(model_fn, loss_fn, model_cfg, cfg, capacity=capacity, memory_budget=memory_budget)
    n = len(trainer.devices)
    state, losses, ratios = trainer.init(seed), [], []
    start = time.perf_counter()
    compiled = trainer.compile_ahead(state.params, batch_size)
    log(f"compiled the {compiled} call shapes a step may need in {time.perf_counter() - start:.1f} s")
    for step in range(steps):
        batch = data.documents_at(docs, step, batch_size, seed, capacity * n + 1)
        # static context parallelism must hold the longest document the stream may bring: context=n
        ratios.append(imbalance([len(s) for s in batch], n, capacity, model_cfg, memory_budget, static_context=n))
        contexts = sorted({b.context for b in trainer.plan(batch)})
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
        log(f"step {step + 1}/{steps}: loss {losses[-1]:.4f}, {len(batch)} documents of {min(len(s) for s in batch)}-"
            f"{max(len(s) for s in batch)} tokens, context degrees {contexts}")
        if stop():
            break
    return {"losses": losses, "steps": steps, "last_step": len(losses), "programs": sorted(trainer._programs), "compiles": trainer.compiles,
            "imbalance": {kind: float(np.mean([r[kind] for r in ratios])) for kind in ratios[0]},
            "seconds_per_bucket": {c: float(np.median(t)) for c, t in sorted(trainer.bucket_seconds.items())}}
