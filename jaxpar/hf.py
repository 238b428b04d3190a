"""Llama-family weights in the Hugging Face layout, in and out (``jaxpar convert``).

A Hugging Face Llama directory holds ``config.json``, the weights as ``*.safetensors`` (one file,
or several named by ``model.safetensors.index.json``) and usually ``tokenizer.json``. The names
and shapes map one to one onto jaxpar's Llama (``models/llama.py``):

====================================================  ======================================
Hugging Face (``torch.nn.Linear``: (out, in))         jaxpar (stacked over ``layers``)
====================================================  ======================================
``model.embed_tokens.weight`` (V, E)                  ``embedding`` (V, E)
``model.layers.i.self_attn.q_proj.weight`` (H D, E)   ``layers/wq`` [i] (E, H, D)
``...k_proj`` / ``...v_proj`` (K D, E)                ``layers/wk`` / ``layers/wv`` [i] (E, K, D)
``...o_proj.weight`` (E, H D)                         ``layers/wo`` [i] (H, D, E)
``...mlp.gate_proj`` / ``up_proj`` (M, E)             ``layers/w_gate`` / ``w_up`` [i] (E, M)
``...mlp.down_proj.weight`` (E, M)                    ``layers/w_down`` [i] (M, E)
``...input_layernorm`` / ``post_attention_layernorm``  ``layers/attn_norm`` / ``mlp_norm`` [i] (E,)
``model.norm.weight`` (E,)                            ``final_norm`` (E,)
``lm_head.weight`` (V, E) (absent when tied)          ``unembedding`` (E, V)
====================================================  ======================================

Both use the half-split rotary convention (the Hugging Face checkpoints' q/k rows are already
permuted to it), so the heads need no reordering. A config the Llama family cannot express (another
architecture, biases, scaled RoPE, another activation) is refused naming the field.

Both ways stream: beyond what the devices hold, the host holds one Hugging Face tensor at a time
(and its float32 conversion). Into jaxpar, each of jaxpar's stacked weights is allocated on the
devices split over its largest dim (so that any layout restores it), then each layer's tensor is
read alone (``safetensors.safe_open``), put in jaxpar's shape and written into its slot by a jitted
update that donates the stacked weight, so that the devices hold one copy of it. The whole is saved
as a verified checkpoint (step 0, parameters only), orbax writing about one tensor's bytes at a time;
the tokenizer file is kept beside it. Out, the parameters are restored onto the devices, split the
same way and verified against their checksums; each tensor is brought to the host alone, in the
dtype the source had (recorded), so a round trip gives the same tensors bitwise, and written into
Hugging Face's sharded layout: files of at most ``max_shard_bytes`` (5 GB, as Hugging Face's
default), ``model.safetensors`` when one suffices, else ``model-0000k-of-0000n.safetensors`` and
their index. On a CPU the devices' memory is the host's: there the placed model counts as well.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import shutil
import struct

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import corpus
from jaxpar.errors import JaxparError
from jaxpar.models import config_of, config_record, llama
from jaxpar.train import checkpoint as checkpoint_lib

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 10**9  # Hugging Face's default max_shard_size, "5GB"
# safetensors' names of the dtypes written
SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16"}
# per-layer tensors: jaxpar's stacked name -> (Hugging Face name inside a layer, to jaxpar's shape)
LAYER = {
    "wq": ("self_attn.q_proj.weight", lambda w, c: w.T.reshape(c.embed, c.heads, c.head_dim)),
    "wk": ("self_attn.k_proj.weight", lambda w, c: w.T.reshape(c.embed, c.kv_heads, c.head_dim)),
    "wv": ("self_attn.v_proj.weight", lambda w, c: w.T.reshape(c.embed, c.kv_heads, c.head_dim)),
    "wo": ("self_attn.o_proj.weight", lambda w, c: w.T.reshape(c.heads, c.head_dim, c.embed)),
    "w_gate": ("mlp.gate_proj.weight", lambda w, c: w.T),
    "w_up": ("mlp.up_proj.weight", lambda w, c: w.T),
    "w_down": ("mlp.down_proj.weight", lambda w, c: w.T),
    "attn_norm": ("input_layernorm.weight", lambda w, c: w),
    "mlp_norm": ("post_attention_layernorm.weight", lambda w, c: w),
}
# top-level tensors: jaxpar's name -> (Hugging Face name, to jaxpar's shape)
TOP = {
    "embedding": ("model.embed_tokens.weight", lambda w: w),
    "final_norm": ("model.norm.weight", lambda w: w),
    "unembedding": ("lm_head.weight", lambda w: w.T),
}
# what jaxpar's Llama cannot express: (config key, the values it can)
REFUSED = (("hidden_act", ("silu",)), ("attention_bias", (False, None)), ("mlp_bias", (False, None)), ("rope_scaling", (None,)))


def read_config(directory: str) -> tuple[llama.LlamaConfig, dict]:
    """(jaxpar's config of the Llama in ``directory``, its config.json); another family refused."""
    path = os.path.join(directory, CONFIG)
    if not os.path.isfile(path):
        raise JaxparError(f"--from-hf {directory}: no {CONFIG} there; give the directory of a Hugging Face Llama checkpoint")
    with open(path) as f:
        raw = json.load(f)
    kind = raw.get("model_type")
    if kind != "llama":
        raise JaxparError(f"--from-hf {directory}: model_type {kind!r} is not a Llama; jaxpar converts model_type \"llama\" "
                          f"(architectures {raw.get('architectures')})")
    for key, allowed in REFUSED:
        if raw.get(key, allowed[0]) not in allowed:
            raise JaxparError(f"--from-hf {directory}: {key} = {raw[key]!r}, which jaxpar's Llama cannot express "
                              f"(it has {key} = {allowed[0]!r}); convert a model without it")
    heads = raw["num_attention_heads"]
    cfg = llama.LlamaConfig(vocab_size=raw["vocab_size"], embed=raw["hidden_size"], layers=raw["num_hidden_layers"], heads=heads,
                            kv_heads=raw.get("num_key_value_heads", heads), head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
                            mlp=raw["intermediate_size"], rope_theta=float(raw.get("rope_theta", 10_000.0)),
                            norm_eps=float(raw.get("rms_norm_eps", 1e-5)), tie_embeddings=bool(raw.get("tie_word_embeddings", False)))
    return cfg, raw


def _files_by_name(directory: str) -> dict[str, str]:
    """{tensor name: the safetensors file holding it} (from the index, or every file's keys)."""
    from safetensors import safe_open  # the `data` extra

    index = os.path.join(directory, INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            return {name: os.path.join(directory, file) for name, file in json.load(f)["weight_map"].items()}
    out = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        with safe_open(path, "np") as f:
            out.update({name: path for name in f.keys()})
    if not out:
        raise JaxparError(f"--from-hf {directory}: no *.safetensors file there; give a checkpoint saved with safetensors")
    return out


def _reader(directory: str):
    """``read(name)``: one tensor of the checkpoint as a numpy array (only that tensor is read)."""
    from safetensors import safe_open

    files = _files_by_name(directory)

    def read(name: str) -> np.ndarray:
        if name not in files:
            raise JaxparError(f"--from-hf {directory}: tensor {name} is missing; the checkpoint is incomplete or not a Llama")
        with safe_open(files[name], "np") as f:
            return f.get_tensor(name)

    return read, files


def _split(shape, mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
    """An array of ``shape`` split over its largest dim the devices divide (else whole on each)."""
    dims = [d for d in np.argsort(shape)[::-1] if shape[d] % mesh.size == 0]
    spec = [None] * len(shape)
    if dims:
        spec[dims[0]] = "devices"
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))


def _devices_mesh() -> jax.sharding.Mesh:
    """This process's devices, one axis."""
    return jax.sharding.Mesh(np.array(jax.devices()), ("devices",))


def _stacked(read, theirs: str, shape, cfg: llama.LlamaConfig, mesh, dtypes: dict) -> jax.Array:
    """One of jaxpar's stacked weights on the devices, filled a layer's tensor at a time."""
    stacked, put = None, None
    for i in range(cfg.layers):
        name = f"model.layers.{i}.{theirs}"
        tensor = read(name)
        dtypes[name] = str(tensor.dtype)
        layer = shape(tensor, cfg)
        if stacked is None:
            whole = (cfg.layers, *layer.shape)
            sharding = _split(whole, mesh)
            stacked = jax.jit(lambda: jnp.zeros(whole, jnp.float32), out_shardings=sharding)()
            # the stacked weight is donated, so the devices never hold it twice; each device is sent
            # only its part of a layer; the layer's index is an argument, so one program serves all
            part = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*sharding.spec[1:]))
            put = jax.jit(lambda into, at, one: into.at[at].set(one.astype(into.dtype)), donate_argnums=0,
                          in_shardings=(sharding, None, part), out_shardings=sharding)
        stacked = put(stacked, np.int32(i), layer).block_until_ready()  # (one layer in flight, not a queue of them)
        del tensor, layer  # before the next layer's tensor is read
    return stacked


def _save_bound_gb(params: dict, layers: int) -> float:
    """What orbax may write at once: one Hugging Face tensor in float32, or one device's shard of
    an array where that is larger (orbax writes a shard whole), with a margin (it refuses a shard
    of exactly its bound)."""
    arrays = jax.tree.leaves(params)
    tensors = [a.nbytes for key, a in params.items() if key != "layers"] + [a.nbytes // layers for a in params["layers"].values()]
    shards = [math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in arrays]
    return 1.01 * max(tensors + shards) / 1e9


def from_hf(source: str, target: str, name: str = "hf-llama", log=lambda message: None) -> dict:
    """Convert the Hugging Face Llama in ``source`` into a jaxpar checkpoint in ``target`` (which
    must hold none); returns what it wrote."""
    cfg, raw = read_config(source)
    held = sorted(int(n) for n in os.listdir(target) if n.isdigit()) if os.path.isdir(target) else []
    if held:  # before any tensor is read (and again when saving)
        raise JaxparError(f"--to {target} already holds checkpoints {held}; give an empty directory")
    read, files = _reader(source)
    mesh = _devices_mesh()
    params, dtypes = {"layers": {}}, {}
    for ours, (theirs, shape) in TOP.items():
        if ours == "unembedding" and cfg.tie_embeddings:
            continue
        tensor = read(theirs)
        dtypes[theirs] = str(tensor.dtype)
        value = np.asarray(shape(tensor), np.float32)
        params[ours] = jax.device_put(value, _split(value.shape, mesh))
        del tensor, value  # before the next tensor is read
    for ours, (theirs, shape) in LAYER.items():
        params["layers"][ours] = _stacked(read, theirs, shape, cfg, mesh, dtypes)
        log(f"converted {ours} ({cfg.layers} layers)")
    meta = {"model": name, "strategy": f"fsdp={mesh.size}", "topology": "converted", "devices": mesh.size, "processes": 1,
            **config_record(cfg), "data": {"seq_len": int(raw.get("max_position_embeddings", 2048))},
            "hf": {"source": os.path.abspath(source), "config": raw, "dtypes": dtypes, "files": sorted(set(files.values()))}}
    bound = _save_bound_gb(params, cfg.layers)
    ckpt = checkpoint_lib.Checkpointer(checkpoint_lib.CheckpointConfig(target, keep=1, save_concurrent_gb=bound))
    try:
        if ckpt.latest_step() is not None:
            raise JaxparError(f"--to {target} already holds checkpoints {ckpt.steps()}; give an empty directory")
        meta.update(_tokenizer_meta(source, target))
        ckpt.save(0, {"params": params}, meta)
        ckpt.wait()
    finally:
        ckpt.close()
    return {"config": dataclasses.asdict(cfg), "tensors": len(dtypes), "directory": target}


def _tokenizer_meta(source: str, target: str) -> dict:
    """The checkpoint's tokenizer: the source's tokenizer.json, kept in ``target`` (else bytes)."""
    path = os.path.join(source, "tokenizer.json")
    if not os.path.isfile(path):
        return {}
    tokenizer = corpus.load(path)
    corpus.keep(tokenizer, target)
    return {"tokenizer": {"spec": path, "identity": tokenizer.identity, "vocab_size": tokenizer.vocab_size}}


def to_hf(checkpoint_dir: str, target: str, step: int | None = None, log=lambda message: None,
          max_shard_bytes: int = MAX_SHARD_BYTES) -> dict:
    """Write checkpoint ``step`` (default: the newest) of a jaxpar Llama as a Hugging Face
    directory ``target``: config.json, the safetensors files (with their index when there are
    several) and the kept tokenizer if any."""
    existing = glob.glob(os.path.join(target, "*.safetensors")) + glob.glob(os.path.join(target, INDEX))
    if existing:  # stale files of another conversion would be read with the new ones
        raise JaxparError(f"--to-hf {target} already holds {os.path.basename(sorted(existing)[0])}; give a directory without weights")
    params, meta, cfg = _restored(checkpoint_dir, step)
    tensors = _hf_tensors(params, cfg, meta.get("hf", {}).get("dtypes", {}))
    os.makedirs(target, exist_ok=True)
    _write_shards(target, tensors, max_shard_bytes, log)
    config = dict(meta.get("hf", {}).get("config", {}), **hf_config(cfg))
    with open(os.path.join(target, CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    kept = glob.glob(os.path.join(checkpoint_dir, corpus.tokenizer.KEPT + ".json"))
    if kept:
        shutil.copyfile(kept[0], os.path.join(target, "tokenizer.json"))
    log(f"wrote {len(tensors)} tensors to {target}")
    return {"tensors": len(tensors), "directory": target}


def _restored(checkpoint_dir: str, step: int | None) -> tuple[dict, dict, llama.LlamaConfig]:
    """(the parameters of checkpoint ``step`` on the devices, each split as ``from_hf`` splits it
    and verified against its checksums, whatever else the checkpoint holds; its meta; its config)."""
    ckpt = checkpoint_lib.Checkpointer.existing(checkpoint_lib.CheckpointConfig(checkpoint_dir))
    try:
        step = ckpt.latest_step() if step is None else step
        meta = ckpt.read_meta(step)
        cfg = config_of(meta)
        if type(cfg) is not llama.LlamaConfig:
            raise JaxparError(f"checkpoint in {checkpoint_dir} holds {meta['model']}, not a Llama: --to-hf writes Llama checkpoints")
        mesh, params = _devices_mesh(), {}
        for path, (shape, dtype) in meta["arrays"].items():
            if path.startswith("params/"):
                *parents, leaf = path.split("/")[1:]
                node = params
                for parent in parents:
                    node = node.setdefault(parent, {})
                node[leaf] = jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=_split(shape, mesh))
        return ckpt.restore_params(params, step), meta, cfg
    finally:
        ckpt.close()


def _hf_tensors(params: dict, cfg: llama.LlamaConfig, dtypes: dict) -> list[tuple[str, tuple, np.dtype, object]]:
    """[(name, shape, dtype, fetch)] of the Hugging Face tensors of ``params``, in the order they
    are written; ``fetch()`` brings that one tensor to the host, in the dtype its source had
    (recorded by ``from_hf``; else the checkpoint's)."""
    tensors = []

    def add(name, program, *args):
        out = jax.eval_shape(program, *args)
        dtype = jnp.dtype(dtypes.get(name, out.dtype))
        if dtype.name not in SAFETENSORS_DTYPES:  # (refused before any file is written)
            raise JaxparError(f"tensor {name} is {dtype.name}, which jaxpar does not write as safetensors")
        tensors.append((name, out.shape, dtype, lambda: np.asarray(program(*args)).astype(dtype, copy=False)))

    for ours, (theirs, shape) in TOP.items():
        if ours in params:
            add(theirs, jax.jit(shape), params[ours])
    for ours, (theirs, _) in LAYER.items():
        layer = jax.jit(lambda stacked, i, kind=ours: _to_hf_shape(kind, stacked[i], cfg))
        for i in range(cfg.layers):
            add(f"model.layers.{i}.{theirs}", layer, params["layers"][ours], np.int32(i))
    return tensors


def _write_shards(target: str, tensors: list, max_shard_bytes: int, log):
    """``tensors`` as Hugging Face's sharded layout: each file at most ``max_shard_bytes`` (a
    larger tensor alone in one), in order; one file is ``model.safetensors``, several are named
    ``model-0000k-of-0000n.safetensors`` and listed by ``model.safetensors.index.json``."""
    shards, size = [[]], 0
    for tensor in tensors:
        nbytes = _nbytes(tensor)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += nbytes
    files = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    if len(files) == 1:
        files = ["model.safetensors"]
    for file, shard in zip(files, shards):
        _write_safetensors(os.path.join(target, file), shard)
        log(f"wrote {file} ({len(shard)} tensors)")
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(map(_nbytes, tensors))},
                 "weight_map": {tensor[0]: file for file, shard in zip(files, shards) for tensor in shard}}
        with open(os.path.join(target, INDEX), "w") as f:
            json.dump(index, f, indent=2)


def _nbytes(tensor) -> int:
    _, shape, dtype, _ = tensor
    return math.prod(shape) * dtype.itemsize


def _write_safetensors(path: str, tensors: list):
    """One safetensors file, written a tensor at a time (``safetensors.numpy.save_file`` takes
    every tensor in memory at once): the JSON header's length (8 bytes, little-endian), the header
    ({name: dtype, shape, byte range in the data}, padded with spaces to a multiple of 8), then each
    tensor's bytes in the header's order (little-endian, as on every host jax runs on)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for tensor in tensors:
        name, shape, dtype, _ = tensor
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype.name], "shape": list(shape), "data_offsets": [offset, offset + _nbytes(tensor)]}
        offset += _nbytes(tensor)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for _, _, _, fetch in tensors:
            fetch().tofile(f)


def _to_hf_shape(ours: str, value, cfg: llama.LlamaConfig):
    """One layer's jaxpar weight in the Hugging Face shape (``LAYER``'s inverse)."""
    if ours in ("wq", "wk", "wv"):
        return value.reshape(cfg.embed, -1).T
    if ours == "wo":
        return value.reshape(-1, cfg.embed).T
    return value.T if value.ndim == 2 else value


def shard_size_bytes(text: str) -> int:
    """Bytes of a size as Hugging Face writes ``max_shard_size``: "5GB" (10**9), "500MiB" (2**20), or bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    digits = text.strip().upper().rstrip("KMGIB")
    unit = text.strip().upper()[len(digits):]
    if not digits.isdigit() or unit not in units or int(digits) == 0:
        raise JaxparError(f"--max-shard-size {text!r}: give a size such as 5GB, 500MB or 2GiB")
    return int(digits) * units[unit]


def hf_config(cfg: llama.LlamaConfig) -> dict:
    """The Hugging Face config.json of a jaxpar Llama config (``read_config``'s inverse)."""
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": cfg.vocab_size, "hidden_size": cfg.embed,
            "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim, "intermediate_size": cfg.mlp, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps,
            "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu"}
