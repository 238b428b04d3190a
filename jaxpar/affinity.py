"""Affinity-aware sharding for delayed tensor parallelism: which heads and MLP columns each tensor
shard holds, chosen so that what a device sees one sublayer late matters least.

Under DTP (``parallel/delayed.py``) a sublayer reads at once what its own device's units (key/value
head groups of attention, columns of the MLP) wrote in the sublayer before, and what the other
devices' units wrote only one sublayer later. The *coupling* of a writer unit u to a reader unit v
of the next sublayer is how strongly v reads what u writes, from the weights:
``|| W_out(u) diag(norm) W_in(v) ||_F`` (u's rows of the output projection, the reader's RMSNorm
scale, v's columns of its input projections). Units are then assigned to the D devices sublayer by
sublayer, each device taking an equal share, greedily by the coupling to the units the previous
sublayer put on it (``assign``): a balanced clustering along the chain of sublayers.

The result is a ``Permutation``: per layer, the order of the key/value head groups (each with its
query heads) and of the MLP columns, so that TP's contiguous split gives each device its cluster.
It is applied to the weights when they are loaded (``permute``), so checkpoints stay in canonical
order; under TP (``delay=0``) a permuted model computes the same function, as heads and columns only
change places. ``save``/``load`` keep it in a JSON file that names the model it was made for.
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import numpy as np
from flax import nnx

from jaxpar.errors import JaxparError
from jaxpar.parallel.tensor import DELAYED

METHODS = ("affinity", "random", "identity")
_SHAPE_KEYS = ("layers", "embed", "heads", "kv_heads", "head_dim", "mlp")


@dataclasses.dataclass(frozen=True)
class Permutation:
    shards: int  # the tensor degree it was made for
    groups: np.ndarray  # (layers, kv_heads): position p of layer l holds canonical group groups[l, p]
    columns: np.ndarray  # (layers, mlp): likewise for the MLP's columns
    method: str = "affinity"


def _check(cfg, shards: int):
    if not isinstance(shards, int) or shards < 1:
        raise JaxparError(f"shards={shards!r}: give the tensor degree the units are split over (an int >= 1)")
    for what, count in (("kv_heads", cfg.kv_heads), ("mlp", cfg.mlp)):
        if count % shards:
            raise JaxparError(f"the model's {count} {what} do not split evenly over {shards} tensor shards; use a tensor "
                              f"degree that divides {count}")


def _writes_and_reads(weights, cfg, layer: int):
    """Per layer: (attention groups' output rows (K, G*d, e), attention groups' input columns scaled
    by the norm (K, e, (G+2)*d), MLP columns' output rows (M, e), MLP columns' input columns scaled
    by the norm (M, e, 2))."""
    w = {name: np.asarray(value[layer], np.float64) for name, value in weights["layers"].items()}
    k, g, d = cfg.kv_heads, cfg.heads // cfg.kv_heads, cfg.head_dim
    attn_out = w["wo"].reshape(k, g * d, cfg.embed)
    q = w["wq"].reshape(cfg.embed, k, g * d)
    attn_in = np.concatenate([q, w["wk"], w["wv"]], axis=2).transpose(1, 0, 2) * w["attn_norm"][None, :, None]
    mlp_out = w["w_down"]
    mlp_in = np.stack([w["w_gate"], w["w_up"]], axis=2).transpose(1, 0, 2) * w["mlp_norm"][None, :, None]
    return attn_out, attn_in, mlp_out, mlp_in


def couplings(weights, cfg) -> list[np.ndarray]:
    """The coupling matrices along the chain of sublayers, writer units x reader units: attention
    of layer 0 -> its MLP (K, M), that MLP -> attention of layer 1 (M, K), ... (2L - 1 of them).
    ``weights``: a Llama's pure dict of arrays (``nnx.to_pure_dict``)."""
    out = []
    for layer in range(cfg.layers):
        attn_out, _, mlp_out, mlp_in = _writes_and_reads(weights, cfg, layer)
        # || rows(u) @ cols(v) ||_F for every pair: (K, G*d, e) x (M, e, 2)
        out.append(np.linalg.norm(np.einsum("kae,mef->kmaf", attn_out, mlp_in), axis=(2, 3)))
        if layer + 1 < cfg.layers:
            attn_in_next = _writes_and_reads(weights, cfg, layer + 1)[1]
            out.append(np.linalg.norm(np.einsum("me,kef->mkf", mlp_out, attn_in_next), axis=2))
    return out


def assign(weights, cfg, shards: int, method: str = "affinity", seed: int = 0) -> Permutation:
    """Each layer's head groups and MLP columns in the order that gives each of ``shards`` devices
    its share: by coupling (``affinity``), at random (``random``, from ``seed``), or as they are
    (``identity``)."""
    _check(cfg, shards)
    if method not in METHODS:
        raise JaxparError(f"method={method!r}: choose one of {', '.join(METHODS)}")
    sizes = [cfg.kv_heads, cfg.mlp] * cfg.layers
    if method == "identity":
        orders = [np.arange(n) for n in sizes]
    elif method == "random":
        rng = np.random.default_rng(seed)
        orders = [rng.permutation(n) for n in sizes]
    else:
        orders = [np.arange(sizes[0])]  # devices are alike: the first sublayer's split is any one
        for coupling, n in zip(couplings(weights, cfg), sizes[1:]):
            device_of = np.empty(len(orders[-1]), int)
            device_of[orders[-1]] = np.arange(len(orders[-1])) // (len(orders[-1]) // shards)
            # each reader unit's coupling to the writers on each device
            score = np.stack([coupling[device_of == dev].sum(axis=0) for dev in range(shards)], axis=1)
            orders.append(_balanced(score, n // shards))
    return Permutation(shards, np.stack(orders[0::2]), np.stack(orders[1::2]), method)


def _balanced(score: np.ndarray, capacity: int) -> np.ndarray:
    """Units -> devices, each device taking ``capacity`` units, greedily from the strongest
    (unit, device) score; returned as the unit order (device 0's units first)."""
    units, devices = score.shape
    taken, load, placed = np.zeros(units, bool), np.zeros(devices, int), [[] for _ in range(devices)]
    for flat in np.argsort(-score, axis=None, kind="stable"):
        unit, dev = divmod(int(flat), devices)
        if not taken[unit] and load[dev] < capacity:
            taken[unit], load[dev] = True, load[dev] + 1
            placed[dev].append(unit)
    return np.concatenate([np.sort(p) for p in placed])


def kept_coupling(weights, cfg, permutation: Permutation) -> float:
    """The fraction of all coupling between consecutive sublayers whose two units share a device
    under ``permutation`` (what DTP's reader sees at once rather than one sublayer late)."""
    orders = [o for pair in zip(permutation.groups, permutation.columns) for o in pair]
    kept = total = 0.0
    for coupling, writers, readers in zip(couplings(weights, cfg), orders, orders[1:]):
        device = lambda order: np.argsort(order) // (len(order) // permutation.shards)  # noqa: E731 - canonical unit -> device
        same = device(writers)[:, None] == device(readers)[None, :]
        kept += float(coupling[same].sum())
        total += float(coupling.sum())
    return kept / total


def permute(weights, cfg, permutation: Permutation, inverse: bool = False):
    """``weights`` (a Llama's pure dict) with each layer's head groups and MLP columns reordered
    (``inverse``: back to canonical order). The same function under TP: units only change places."""
    g = cfg.heads // cfg.kv_heads
    out = {**weights, "layers": dict(weights["layers"])}
    stack = {name: np.array(value) for name, value in weights["layers"].items()}
    for layer in range(cfg.layers):
        groups, columns = permutation.groups[layer], permutation.columns[layer]
        if inverse:
            groups, columns = np.argsort(groups), np.argsort(columns)
        heads = (groups[:, None] * g + np.arange(g)).reshape(-1)
        src = {name: np.array(value[layer]) for name, value in stack.items()}
        stack["wq"][layer] = src["wq"][:, heads]
        stack["wo"][layer] = src["wo"][heads]
        for name in ("wk", "wv"):
            stack[name][layer] = src[name][:, groups]
        for name in ("w_gate", "w_up"):
            stack[name][layer] = src[name][:, columns]
        stack["w_down"][layer] = src["w_down"][columns]
    out["layers"] = {name: stack[name].astype(np.asarray(weights["layers"][name]).dtype) for name in stack}
    return out


def weights_of(model) -> dict:
    """A Llama's weights as a pure dict of host arrays (what ``assign`` and ``permute`` read)."""
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))


def permute_model(model, permutation: Permutation) -> None:
    """Reorder a Llama's heads and MLP columns in place, as ``permute`` does its weights."""
    state = nnx.state(model)
    nnx.replace_by_pure_dict(state, permute(weights_of(model), model.cfg, permutation))
    nnx.update(model, state)


def _shape_of(cfg) -> dict:
    return {key: getattr(cfg, key) for key in _SHAPE_KEYS}


def save(permutation: Permutation, path: str, model: str, cfg) -> None:
    """Write ``permutation`` as JSON, with the model it was made for."""
    with open(path, "w") as f:
        json.dump({"model": model, "shape": _shape_of(cfg), "shards": permutation.shards, "method": permutation.method,
                   "groups": permutation.groups.tolist(), "columns": permutation.columns.tolist()}, f)


def load(path: str, model: str, cfg, *, serving: bool = False, layout=None) -> Permutation:
    """The permutation in ``path``, refused in words if it was made for another model and, when
    ``serving`` under ``layout`` (None: one device), if it would change nothing there (no delay) or
    was made for another tensor degree."""
    try:
        with open(path) as f:
            saved = json.load(f)
        made_for, shape = saved["model"], saved["shape"]
        permutation = Permutation(int(saved["shards"]), np.asarray(saved["groups"], int), np.asarray(saved["columns"], int),
                                  saved.get("method", "affinity"))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise JaxparError(f"cannot read the permutation file {path!r} ({err}); write one with `jaxpar affinity`") from None
    if shape != _shape_of(cfg):
        differ = ", ".join(f"{k} {shape.get(k)} there, {v} here" for k, v in _shape_of(cfg).items() if shape.get(k) != v)
        raise JaxparError(f"the permutation file {path!r} was made for model {made_for!r}, whose shape differs from that "
                          f"of {model!r} ({differ}); make one for this model with `jaxpar affinity`")
    ok = (permutation.groups.shape == (cfg.layers, cfg.kv_heads) and permutation.columns.shape == (cfg.layers, cfg.mlp)
          and all(sorted(o) == list(range(len(o))) for o in [*permutation.groups, *permutation.columns]))
    if not ok:
        raise JaxparError(f"the permutation file {path!r} is damaged: each layer must order every head group and MLP "
                          f"column once; make it again with `jaxpar affinity`")
    if serving:
        _check_layout(permutation, path, layout)
    return permutation


def _check_layout(permutation: Permutation, path: str, layout) -> None:
    """Refuse a permutation that would change nothing (no delay: every placement computes the same
    function) or that splits the units for another tensor degree than ``layout``'s."""
    delayed = () if layout is None else layout.role(DELAYED)
    if not delayed:
        raise JaxparError(f"the permutation file {path!r} places heads and MLP columns for delayed TP; served without delay=1 "
                          f"every placement computes the same function, so it would change nothing: add delay=1 to the "
                          f"strategy (e.g. \"tensor={permutation.shards},delay=1\") or drop the permutation")
    ways = math.prod(layout.mesh.shape[a] for a in delayed)
    if ways != permutation.shards:
        raise JaxparError(f"the permutation file {path!r} was made for tensor={permutation.shards} (`jaxpar affinity --tensor "
                          f"{permutation.shards}`) but this layout splits the heads over tensor={ways}: its device shares are "
                          f"not this layout's; make one with `jaxpar affinity --tensor {ways}`")
