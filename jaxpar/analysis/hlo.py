"""Every collective of a compiled XLA program, with how often it runs and the bytes it moves.

Reads the text of ``jax.jit(f).lower(...).compile().as_text()``:

    cols = collectives(compiled.as_text(), mesh)
    summarize(cols)   # kind -> {"count", "bytes_per_device"}
    by_axes(cols)     # (kind, mesh_axes) -> {"count", "bytes_per_device"}
    link_bytes(compiled.as_text(), mesh)   # (sender, receiver) Device.id -> collective-permute bytes
    blocking_collectives(compiled.as_text())   # per layer loop: collectives nothing computes under

Conventions (all checked on programs compiled by jax 0.10 for CPU and, ahead of time, TPU):
- Device ids in replica groups and source-target pairs are *logical* ids (partition ids):
  positions in ``mesh.devices.flat``, not ``Device.id``. This holds for SPMD programs
  (``num_replicas=1``), which is all that jit/shard_map produce.
- ``executions`` multiplies the trip counts of every while loop around the collective, through
  any ``call``/``fusion``/``async-start``/``conditional`` in between. Each branch of a
  ``conditional`` is counted as if it ran (an upper bound), unless the collective's op name
  carries ``marks.branch_runs(n, trips)``: then it runs n of every trips trips of its loop. A loop
  whose trip count cannot be read counts once, with a warning.
- ``collective-permute``: ``group_size`` is the size of the largest set of devices linked by its
  source-target pairs (2 for a swap, n for a ring over n), ``mesh_axes`` the axes along which some
  pair moves data, and ``senders`` the share of the program's devices that send their operand
  (1 for a ring; a pipeline's tick sends only from the stages that carry a micro-batch): the bytes
  per device are the operand's times that share, the mean over the devices (0 bytes when every
  pair is a self-pair: GSPMD emits such pairs and they are local copies).
- Collectives in computations that nothing calls are left out.
- Each collective is counted once, however many copies of it the program prints. XLA:TPU (seen on
  v5e, jax 0.10) splits an async collective into a chain of fusions — start, continuations that
  overlap it with compute, done — and each fusion holds a copy of it with the same ``channel_id``
  and ``chain_id`` (a frontend attribute). Copies = same opcode, ``channel_id`` and ``chain_id``;
  they count once, with the largest ``executions`` among them. A ``channel_id`` alone does not name
  a collective: XLA:TPU gives ``channel_id=1`` to many different ones, even in one loop body.
  Instructions without both attributes are each counted (a ``-start``/``-done`` pair once, by its
  ``-start``).
- Not counted: ``send``/``recv`` (multi-slice transfers on TPU) and other point-to-point ops.
"""
from __future__ import annotations

import math
import re
import warnings
from collections import defaultdict
from dataclasses import dataclass, replace

import numpy as np

from jaxpar import marks

# (a ragged all-to-all sends as much of its first operand as its sizes say: counted here at that
# operand's whole size, the bound its static shapes give)
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute")


@dataclass(frozen=True)
class Collective:
    kind: str  # one of KINDS
    name: str  # HLO instruction name (the -start op for async pairs)
    dtype: str  # element type of the (first) result
    operand_bytes: int  # per device, summed over tuple elements
    result_bytes: int  # per device, summed over tuple elements
    group_size: int  # devices per replica group (collective-permute: see module doc)
    mesh_axes: tuple[str, ...]  # mesh axes whose coordinate varies inside a group, in mesh order
    executions: int  # times it runs per call of the program
    lowered_as: str = ""  # the op XLA emitted when it differs from the kind it implements (see below)
    senders: float = 1.0  # collective-permute: the share of the devices that send (see the module doc)
    scalars: bool = False  # an all-reduce of scalars only (a loss, the pieces of a norm): in no formula

    @property
    def bytes_per_execution(self) -> float:
        """Bytes one device sends per execution, ring model (a permute: the mean over the devices)."""
        n = self.group_size
        if self.kind == "collective-permute":
            return float(self.operand_bytes) * self.senders if n > 1 else 0.0
        f = (n - 1) / n
        return {
            "all-gather": self.result_bytes * f,
            "reduce-scatter": self.operand_bytes * f,
            "all-reduce": 2 * self.operand_bytes * f,
            "all-to-all": self.operand_bytes * f,
            "ragged-all-to-all": self.operand_bytes * f,
        }[self.kind]

    @property
    def bytes_per_step(self) -> float:
        return self.bytes_per_execution * self.executions


def summarize(cols: list[Collective]) -> dict[str, dict]:
    """kind -> {"count": executions summed, "bytes_per_device": bytes one device sends per step}."""
    return _total(cols, lambda c: c.kind)


def by_axes(cols: list[Collective]) -> dict[tuple[str, tuple[str, ...]], dict]:
    """(kind, mesh_axes) -> {"count", "bytes_per_device"}, e.g. to tell FSDP from TP traffic."""
    return _total(cols, lambda c: (c.kind, c.mesh_axes))


def _total(cols, key) -> dict:
    out: dict = {}
    for c in cols:
        d = out.setdefault(key(c), {"count": 0, "bytes_per_device": 0.0})
        d["count"] += c.executions
        d["bytes_per_device"] += c.bytes_per_step
    return out


# ---------------------------------------------------------------- shapes


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string; tuples are summed. ``f32[16,64]{1,0}`` -> 4096."""
    total = 0
    for dt, dims in re.findall(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]", shape):
        n = math.prod(int(d.lstrip("<=")) for d in dims.split(",") if d)
        total += math.ceil(n * _bits(dt) / 8)
    return total


def _bits(dtype: str) -> int:
    # The width is the first number in the name: bf16, f8e4m3fn, c64 (2 x f32), s4 ...
    if dtype == "pred":
        return 8
    m = re.match(r"[a-z]+(\d+)", dtype)
    return int(m[1]) if m else 0  # token[], opaque[]: no data


def _dtype(shape: str) -> str:
    m = re.search(r"\b([a-z][a-z0-9]*)\[", shape)
    return m[1] if m else ""


# ---------------------------------------------------------------- parsing


@dataclass
class _Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]  # names
    raw: str  # text between the opcode's parentheses: constant(5), parameter(0)
    attrs: str


def _close(s: str, i: int) -> int:
    """Index of the bracket closing the one at s[i] (brackets of all kinds nest)."""
    depth = 0
    for j in range(i, len(s)):
        if s[j] in "([{":
            depth += 1
        elif s[j] in ")]}":
            depth -= 1
            if depth == 0:
                return j
    raise ValueError(f"unbalanced: {s[i:i + 80]}")


_INSTR = re.compile(r"\s+(ROOT\s+)?%?([^\s=]+)\s*=\s*")


def _parse(text: str):
    """-> ({computation: [instr]}, {computation: root instr}, entry name)."""
    text = re.sub(r"/\*.*?\*/", "", text)  # TPU prints /*index=5*/ inside long tuples
    comps: dict[str, list[_Instr]] = {}
    roots: dict[str, _Instr] = {}
    entry, cur = None, None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            m = re.match(r"(ENTRY\s+)?%?([^\s(]+)", line)
            cur = m[2]
            comps[cur] = []
            entry = cur if m[1] else entry
            continue
        m = _INSTR.match(line)
        if cur is None or not m:
            continue
        i = m.end()
        j = _close(line, i) + 1 if line[i] == "(" else line.index(" ", i)
        shape, rest = line[i:j], line[j:].lstrip()
        op = re.match(r"([\w\-]+)\(", rest)
        if not op:
            continue
        k = _close(rest, op.end() - 1)
        raw = rest[op.end():k]
        ins = _Instr(m[2], shape, op[1], re.findall(r"%([\w.\-]+)", raw), raw, rest[k + 1:])
        comps[cur].append(ins)
        if m[1]:
            roots[cur] = ins
    return comps, roots, entry


_CALL = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation|"
    r"branch_computations|called_computations)=(\{[^}]*\}|%?[\w.\-]+)")


def _callees(ins: _Instr) -> list[tuple[str, str]]:
    # async-done/-update repeat the async-start's calls=; following them would count twice.
    if ins.opcode in ("async-done", "async-update"):
        return []
    return [(key, n) for key, v in _CALL.findall(ins.attrs) for n in re.findall(r"%?([\w.\-]+)", v)]


# ---------------------------------------------------------------- replica groups


def replica_groups(attrs: str, n_devices: int) -> np.ndarray:
    """Groups of logical device ids, one row each, from an instruction's attributes."""
    m = re.search(r"replica_groups=", attrs)
    if not m:
        return np.arange(n_devices)[None]
    s = attrs[m.end():]
    if s.startswith("{"):  # explicit {{0,2},{1,3}}; {} means all devices
        rows = re.findall(r"\{([\d,\s]+)\}", s[:_close(s, 0) + 1])
        if not rows:
            return np.arange(n_devices)[None]
        return np.array([[int(x) for x in r.split(",")] for r in rows])
    if s.startswith("["):  # iota [4,2]<=[2,4]T(1,0): reshape/transpose of arange, one row each
        m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", s)
        return _iota(_ints(m[2]), _ints(m[3])).reshape(_ints(m[1]))
    if s.startswith("mesh["):
        return _mesh_groups(s)
    raise ValueError(f"unknown replica_groups syntax: {s[:80]}")


def _ints(s: str | None) -> list[int]:
    return [int(x) for x in s.split(",")] if s else []


def _iota(reshape: list[int], perm: list[int]) -> np.ndarray:
    return np.arange(math.prod(reshape)).reshape(reshape).transpose(perm or None)


def _mesh_groups(s: str) -> np.ndarray:
    """``mesh['axis_0'=4,'axis_1'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_0':(2)2}``.

    XLA's own mesh (its axes are not the jax mesh's) over logical ids; the braces list the axes
    a group spans, ``'a':(pre)size`` a sub-axis: axis a reshaped major-to-minor into
    [pre, size, rest], its middle part. A group = all devices differing only along those parts.
    """
    m = re.match(r"mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}", s)
    axes = re.findall(r"'([^']+)'=(\d+)", m[1])
    names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
    ids = m[2] or ""
    if ids.startswith("["):  # iota tile assignment
        d = re.match(r"\[([\d,]+)\](?:<=\[[\d,]+\])?(?:T\(([\d,]+)\))?", ids)
        devices = _iota(_ints(d[1]), _ints(d[2]))
    elif ids:  # explicit device list
        devices = np.array(_ints(ids.replace(" ", "")))
    else:
        devices = np.arange(math.prod(sizes))
    # Split each mesh axis at the boundaries of the sub-axes named, mark the parts grouped.
    spans: dict[int, list[tuple[int, int]]] = {}
    for a, pre, size in re.findall(r"'([^']+)'(?::\((\d+)\)(\d+))?", m[3]):
        i = names.index(a)
        spans.setdefault(i, []).append((int(pre), int(pre) * int(size)) if pre else (1, sizes[i]))
    dims, grouped = [], []
    for i, n in enumerate(sizes):
        cuts = sorted({1, n, *(b for span in spans.get(i, []) for b in span)})
        for lo, hi in zip(cuts, cuts[1:]):
            if any(a <= lo and hi <= b for a, b in spans.get(i, [])):
                grouped.append(len(dims))
            dims.append(hi // lo)
    kept = [d for d in range(len(dims)) if d not in grouped]
    g = math.prod(dims[d] for d in grouped)
    return devices.reshape(dims).transpose(kept + grouped).reshape(-1, g)


def _source_target_pairs(attrs: str) -> np.ndarray:
    """A collective-permute's (source, target) logical ids, one row each."""
    return np.array(re.findall(r"\{(\d+),(\d+)\}", attrs), dtype=int).reshape(-1, 2)


def _axes_spanned(pairs_or_groups, mesh) -> tuple[str, ...]:
    """Mesh axes along which the device coordinates differ inside any row."""
    coords = np.stack(np.unravel_index(np.asarray(pairs_or_groups), mesh.devices.shape), -1)
    varies = (coords != coords[:, :1]).any(axis=(0, 1))
    return tuple(a for a, v in zip(mesh.axis_names, varies) if v)


def _largest_component(pairs: np.ndarray) -> int:
    parent: dict[int, int] = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for a, b in pairs:
        parent[find(a)] = find(b)
    sizes: dict[int, int] = {}
    for x in list(parent):
        sizes[find(x)] = sizes.get(find(x), 0) + 1
    return max(sizes.values(), default=1)


# ---------------------------------------------------------------- loops


def _trip_count(w: _Instr, comps, roots, table) -> int | None:
    """known_trip_count from backend_config (CPU, GPU), else read the loop (TPU drops it)."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', w.attrs)
    if m:
        return int(m[1])
    names = dict(_callees(w))
    op, attrs, args = _through_fusion(roots[names["condition"]], roots, table)
    d = re.search(r"direction=(\w+)", attrs)
    if op != "compare" or not d or len(args) != 2:
        return None
    kinds = [table[a].opcode for a in args]
    if kinds == ["constant", "get-tuple-element"]:  # limit < iv  ==  iv > limit
        args, direction = args[::-1], {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE"}.get(d[1], d[1])
    elif kinds == ["get-tuple-element", "constant"]:
        direction = d[1]
    else:
        return None
    idx = int(re.search(r"index=(\d+)", table[args[0]].attrs)[1])
    limit = int(table[args[1]].raw)
    init = _const(_tuple_elem(table.get(w.operands[0]), idx, table), table)
    step_op, _, step_args = _through_fusion(_tuple_elem(roots[names["body"]], idx, table), roots, table)
    steps = [_const(a, table) for a in step_args] if step_op == "add" else []
    step = next((s for s in steps if s), 1)
    if init is None or step <= 0:
        return None
    if direction in ("LT", "NE"):
        return max(0, -(-(limit - init) // step))
    if direction == "LE":
        return max(0, (limit - init) // step + 1)
    return None


def _through_fusion(ins: _Instr | None, roots, table):
    """(opcode, attrs, operands) of ins, looking inside a fusion whose root uses its parameters."""
    if ins is None:
        return None, "", []
    if ins.opcode != "fusion":
        return ins.opcode, ins.attrs, ins.operands
    r = roots[dict(_callees(ins))["calls"]]
    args = [ins.operands[int(table[a].raw)] if table[a].opcode == "parameter" else a for a in r.operands]
    return r.opcode, r.attrs, args


def _tuple_elem(ins: _Instr | None, idx: int, table) -> _Instr | None:
    if ins is None or ins.opcode != "tuple" or idx >= len(ins.operands):
        return None
    return table.get(ins.operands[idx])


def _const(ins: _Instr | str | None, table) -> int | None:
    ins = table.get(ins) if isinstance(ins, str) else ins
    while ins is not None and ins.opcode == "copy":
        ins = table.get(ins.operands[0])
    if ins is not None and ins.opcode == "constant" and re.fullmatch(r"-?\d+", ins.raw):
        return int(ins.raw)
    return None


def _holds_collectives(comps):
    """computation name -> whether it, or a computation it calls, holds a collective."""
    memo: dict[str, bool] = {}

    def holds(c: str) -> bool:
        if c not in memo:
            memo[c] = False  # guards against cycles
            memo[c] = any(ins.opcode.removesuffix("-start") in KINDS or any(holds(callee) for _, callee in _callees(ins))
                          for ins in comps.get(c, []))
        return memo[c]

    return holds


def _executions(comps, roots, table, entry) -> dict[str, int]:
    """How many times each computation runs per program call (0 if unreachable)."""
    callers: dict[str, list[tuple[str, int]]] = {}
    holds = _holds_collectives(comps)
    for comp, instrs in comps.items():
        for ins in instrs:
            trip = None
            for key, callee in _callees(ins):
                mult = 1
                if ins.opcode == "while" and key in ("body", "condition"):
                    if trip is None:
                        trip = _trip_count(ins, comps, roots, table)
                        if trip is None and holds(callee):  # a loop without collectives changes no count
                            warnings.warn(f"trip count of {ins.name} unknown; counting its body once")
                    mult = (trip or 1) + (key == "condition")
                callers.setdefault(callee, []).append((comp, mult))
    memo: dict[str, int] = {entry: 1}

    def run(c: str) -> int:
        if c not in memo:
            memo[c] = 0  # guards against cycles, which HLO does not have
            memo[c] = sum(run(p) * k for p, k in callers.get(c, []))
        return memo[c]

    return {c: run(c) for c in comps}


# ---------------------------------------------------------------- main entry


# ---------------------------------------------------------------- rewritten collectives
# XLA's TPU compiler may implement an all-gather as an all-reduce of a zero buffer into which each
# device wrote its shard (dynamic-update-slice), and a reduce-scatter as an all-reduce whose every
# use keeps only this device's slice (dynamic-slice, often fused into the next op). Such all-reduces
# are counted as the collective they implement, with ``lowered_as="all-reduce"``.

_PASS_THROUGH = ("bitcast", "copy", "reshape", "transpose", "copy-start", "copy-done")
# a slice of their result reads only the same slice of an operand of their shape (two gradients of
# one weight added, then sliced)
_ELEMENTWISE = ("add", "subtract", "multiply", "divide", "convert", "negate", "maximum", "minimum", "select")


def _writes_own_slice(name: str, table, comps, roots) -> bool:
    """Is ``name`` a dynamic-update-slice into a buffer (directly or as a fusion's root)?"""
    ins = table.get(name)
    while ins is not None and ins.opcode in _PASS_THROUGH and ins.operands:
        ins = table.get(ins.operands[0])
    if ins is None:
        return False
    if ins.opcode == "dynamic-update-slice":
        return True
    if ins.opcode == "fusion":
        called = [n for _, n in _callees(ins)]
        root = roots.get(called[0]) if called else None
        while root is not None and root.opcode in _PASS_THROUGH and root.operands:
            root = table.get(root.operands[0])
        return root is not None and root.opcode == "dynamic-update-slice"
    return False


def _slices_kept(name: str, users, table, comps, depth: int = 0) -> set[int] | None:
    """The element counts of the dynamic slices every use of ``name`` keeps of it (through fusions,
    copies and elementwise ops of its shape); None where a use reads more than a slice."""
    uses = users.get(name, [])
    if not uses or depth > 8:
        return None
    kept: set[int] = set()
    for use in uses:
        if use.opcode == "dynamic-slice" and use.operands[0] == name:
            kept.add(_elements(use.shape))
            continue
        if use.opcode in _PASS_THROUGH or use.opcode == "get-tuple-element" or (
                use.opcode in _ELEMENTWISE and _elements(use.shape) == _elements(table[name].shape)):
            inner = [_slices_kept(use.name, users, table, comps, depth + 1)]
        elif use.opcode == "fusion":
            called = [n for _, n in _callees(use)]
            params = {int(i.raw): i.name for i in comps.get(called[0], []) if i.opcode == "parameter"} if called else {}
            inner = [_slices_kept(params[k], users, table, comps, depth + 1) if k in params else None
                     for k, o in enumerate(use.operands) if o == name]
        else:
            return None
        if not inner or any(x is None for x in inner):
            return None
        kept.update(*inner)
    return kept


def _elements(shape: str) -> int:
    dims = re.search(r"\[([\d,]*)\]", shape)
    return math.prod(int(d) for d in dims[1].split(",") if d) if dims else 0


def _scatters(name: str, operand_shape: str, group: int, users, table, comps) -> bool:
    """Does every use of ``name`` keep at most a 1/group slice of it (a reduce-scatter; a larger
    slice, say 1/4 over 8 devices, is an all-reduce kept over fewer of them)?"""
    kept = _slices_kept(name, users, table, comps)
    return bool(kept) and all(k * group <= _elements(operand_shape) for k in kept)


def _implemented_kind(ins, group: int, table, comps, roots, users) -> str:
    """The collective an all-reduce over groups of ``group`` implements: all-gather,
    reduce-scatter, or all-reduce."""
    if ins.operands and all(_writes_own_slice(o, table, comps, roots) for o in ins.operands):
        return "all-gather"
    if len(ins.operands) == 1 and ins.operands[0] in table and _scatters(ins.name, table[ins.operands[0]].shape, group, users, table, comps):
        return "reduce-scatter"
    return "all-reduce"


def _element_kinds(ins, group: int, table, comps, users) -> list[str] | None:
    """Per operand of an all-reduce XLA combined from several (a tuple: gradients sliced after it,
    a scalar loss beside them), reduce-scatter or all-reduce, a scalar apart ("scalar
    all-reduce"); None unless the result is only read element by element."""
    if len(ins.operands) < 2:
        return None
    elements = defaultdict(list)
    for use in users.get(ins.name, []):
        index = re.search(r"\bindex=(\d+)", use.attrs) if use.opcode == "get-tuple-element" else None
        if index is None:
            return None
        elements[int(index[1])].append(use)
    kinds = []
    for i, operand in enumerate(ins.operands):
        shape = table[operand].shape if operand in table else ""
        if elements[i] and all(_scatters(e.name, shape, group, users, table, comps) for e in elements[i]):
            kinds.append("reduce-scatter")
        else:
            kinds.append("scalar all-reduce" if _elements(shape) == 1 else "all-reduce")
    return kinds


# Multi-slice TPU programs hand cross-slice collectives to the runtime as host-transfer sends.
_CROSS_SLICE = re.compile(r'_xla_host_transfer_handler_name="xla_megascale_runtime".*?_xla_host_transfer_rendezvous="([^"]+)"')


def _cross_slice_kind(rendezvous: str) -> str:
    for prefix, kind in (("all-gather", "all-gather"), ("all_gather", "all-gather"), ("reduce-scatter", "reduce-scatter"),
                         ("psum_scatter", "reduce-scatter"), ("all-to-all", "all-to-all"), ("all_to_all", "all-to-all")):
        if rendezvous.startswith(prefix):
            return kind
    return "all-reduce"  # psum, all-reduce, pmax...


def _chain_copy_key(ins: _Instr) -> tuple[str, str, str] | None:
    """(opcode, channel id, chain id) shared by the copies of one chained async collective."""
    channel = re.search(r"\bchannel_id=(\d+)", ins.attrs)
    chain = re.search(r'\bchain_id="([^"]*)"', ins.attrs)
    return (ins.opcode, channel[1], chain[1]) if channel and chain else None


def collectives(hlo_text: str, mesh, dcn_axes: tuple[str, ...] = (), num_slices: int = 1) -> list[Collective]:
    """Every collective in the program text, in the order printed.

    On multi-slice TPU programs, cross-slice traffic appears as ``send`` ops for the multi-slice
    runtime; each is counted as a collective of the kind its rendezvous names, over ``dcn_axes``
    with ``num_slices`` participants (the layout's split says which axes cross slices)."""
    comps, roots, entry = _parse(hlo_text)
    table = {i.name: i for instrs in comps.values() for i in instrs}
    runs = _executions(comps, roots, table, entry)
    # Async pairs: the result is the -done's shape (the -start's is a tuple with buffers).
    done = {i.operands[0]: i for i in table.values() if i.opcode.endswith("-done") and i.operands}
    users: dict[str, list[_Instr]] = {}
    for i in table.values():
        for o in set(i.operands):
            users.setdefault(o, []).append(i)
    out = []
    first_copy: dict[tuple[str, str, str], int] = {}  # chain copy key -> index in out
    for comp, instrs in comps.items():
        for ins in instrs:
            kind = ins.opcode.removesuffix("-start")
            cross = _CROSS_SLICE.search(ins.attrs) if ins.opcode == "send" and num_slices > 1 else None
            if cross and runs[comp]:
                data = shape_bytes(table[ins.operands[0]].shape) if ins.operands and ins.operands[0] in table else 0
                out.append(Collective(_cross_slice_kind(cross[1]), ins.name, _dtype(table[ins.operands[0]].shape),
                                      data, data, num_slices, dcn_axes, runs[comp]))
                continue
            if kind not in KINDS or not runs[comp]:
                continue
            key = _chain_copy_key(ins)
            if key in first_copy:
                # In every program seen the copies' fusions sit in one computation, so they run
                # equally often; were a chain split across a loop boundary, the copy inside the
                # loop is the one that runs each trip.
                i = first_copy[key]
                out[i] = replace(out[i], executions=max(out[i].executions, runs[comp]))
                continue
            if key:
                first_copy[key] = len(out)
            result = done[ins.name].shape if ins.opcode.endswith("-start") and ins.name in done else ins.shape
            sent = ins.operands[:1] if kind == "ragged-all-to-all" else ins.operands  # (the rest: its output buffer, offsets, sizes)
            operand_bytes = sum(shape_bytes(table[o].shape) for o in sent if o in table)
            senders, runs_here = 1.0, _branch_executions(ins, runs[comp])
            if kind == "collective-permute":
                pairs = _source_target_pairs(ins.attrs)
                moving = pairs[pairs[:, 0] != pairs[:, 1]]
                size = _largest_component(moving) if len(moving) else 1
                axes = _axes_spanned(moving, mesh) if len(moving) else ()
                senders = len(set(moving[:, 0].tolist())) / mesh.devices.size if len(moving) else 1.0
            else:
                groups = replica_groups(ins.attrs, mesh.devices.size)
                size, axes = groups.shape[1], _axes_spanned(groups, mesh)
            if kind == "all-reduce":
                source = done[ins.name] if ins.opcode.endswith("-start") and ins.name in done else ins
                out += _reductions(ins, table, comps, roots, {**users, ins.name: users.get(source.name, [])},
                                   Collective(kind, ins.name, _dtype(result), operand_bytes, shape_bytes(result), int(size), axes, runs_here))
                continue
            out.append(Collective(kind, ins.name, _dtype(result), operand_bytes, shape_bytes(result),
                                  int(size), axes, runs_here, "", senders))
    return out


def _reductions(ins, table, comps, roots, users, whole: Collective) -> list[Collective]:
    """An all-reduce as the collectives it implements: one, or one per kind among the elements
    of a combined one (``_element_kinds``; its scalars an all-reduce apart), each with its
    elements' bytes."""
    kind = _implemented_kind(ins, whole.group_size, table, comps, roots, users)
    kinds = _element_kinds(ins, whole.group_size, table, comps, users) if kind == "all-reduce" else None
    if kinds is None or len(set(kinds)) == 1:
        kind = kind if kinds is None else kinds[0]
        scalars, kind = kind == "scalar all-reduce", kind.removeprefix("scalar ")
        return [replace(whole, kind=kind, lowered_as="" if kind == "all-reduce" else "all-reduce", scalars=scalars)]
    parts = []
    for kind in dict.fromkeys(kinds):
        shapes = [table[o].shape for o, k in zip(ins.operands, kinds) if k == kind and o in table]
        size = sum(shape_bytes(x) for x in shapes)
        parts.append(replace(whole, kind=kind.removeprefix("scalar "), dtype=_dtype(shapes[0]) if shapes else whole.dtype,
                             operand_bytes=size, result_bytes=size, lowered_as="" if kind == "all-reduce" else "all-reduce",
                             scalars=kind == "scalar all-reduce"))
    return parts


def _branch_executions(ins, runs: int) -> int:
    """``runs`` of the computation ``ins`` sits in, or of them the share its ``marks.branch_runs``
    mark says its conditional branch is taken."""
    taken = marks.read_branch_runs(ins.attrs)
    return runs if taken is None else runs * taken[0] // taken[1]


def link_bytes(hlo_text: str, mesh) -> dict[tuple[int, int], int]:
    """(sender, receiver) ``Device.id`` -> bytes sent over that link per program call by the
    program's collective-permutes (executions included); self-pairs, local copies, are left out."""
    comps, _, _ = _parse(hlo_text)
    attrs = {i.name: i.attrs for instrs in comps.values() for i in instrs}
    ids = [d.id for d in mesh.devices.flat]  # the pairs hold logical ids: positions in the mesh
    out: dict[tuple[int, int], int] = defaultdict(int)
    for c in collectives(hlo_text, mesh):
        if c.kind == "collective-permute":
            for s, r in _source_target_pairs(attrs[c.name]):
                if s != r:
                    out[(ids[s], ids[r])] += c.operand_bytes * c.executions
    return dict(out)


# ---------------------------------------------------------------- what waits on a collective

_MATMULS = ("dot", "convolution")


def _computes(comps):
    """computation name -> whether it, or one it calls, does a matrix multiplication (XLA:CPU may
    emit one as a custom call into a BLAS library)."""
    memo: dict[str, bool] = {}

    def heavy(ins: _Instr) -> bool:
        if ins.opcode in _MATMULS or (ins.opcode == "custom-call" and re.search(r"matmul|gemm|dot", ins.attrs, re.I)):
            return True
        return any(computes(c) for _, c in _callees(ins))

    def computes(c: str) -> bool:
        if c not in memo:
            memo[c] = False
            memo[c] = any(heavy(ins) for ins in comps.get(c, []))
        return memo[c]

    return heavy


def blocking_collectives(hlo_text: str, kinds: tuple[str, ...] = ("all-reduce",)) -> list[dict]:
    """For each while loop whose body holds collectives of ``kinds``: how many there are per
    iteration, and how many of them are *blocking*: no matrix multiplication of the body can run
    while one is in flight, because every one of them either feeds it or waits on its result.

    Under Megatron TP each sublayer's all-reduce is blocking (the next sublayer's matmuls read the
    sum); under delayed TP none is (the next sublayer runs on the device's own copy of the stream,
    and the sum is read after it). Each entry: ``{"loop", "op_name", "trips", "collectives",
    "blocking"}``; ``op_name`` is the loop's source path from its metadata (a backward pass's loop
    names a ``transpose``). Nested loops count in their own entry; a nested loop that multiplies
    matrices counts as a matmul of the outer body."""
    comps, roots, entry = _parse(hlo_text)
    table = {ins.name: ins for instrs in comps.values() for ins in instrs}
    heavy = _computes(comps)
    out = []
    for instrs in comps.values():
        for loop in (ins for ins in instrs if ins.opcode == "while"):
            body = dict(_callees(loop))["body"]
            found = [ins for ins in comps[body] if ins.opcode.removesuffix("-start") in kinds and ins.opcode != "all-reduce-done"]
            if not found:
                continue
            operands = {ins.name: [o for o in ins.operands if o in table] for ins in comps[body]}
            users: dict[str, list[str]] = defaultdict(list)
            for name, ops in operands.items():
                for o in ops:
                    users[o].append(name)

            def reach(start: str, edges) -> set[str]:
                seen, todo = set(), [start]
                while todo:
                    for nxt in edges.get(todo.pop(), ()):
                        if nxt not in seen:
                            seen.add(nxt)
                            todo.append(nxt)
                return seen

            matmuls = {ins.name for ins in comps[body] if heavy(ins)}
            blocking = sum(1 for c in found if not matmuls - reach(c.name, operands) - reach(c.name, users) - {c.name})
            op_name = re.search(r'op_name="([^"]*)"', loop.attrs)
            out.append({"loop": loop.name, "op_name": op_name[1] if op_name else "",
                        "trips": _trip_count(loop, comps, roots, table), "collectives": len(found), "blocking": blocking})
    return out
