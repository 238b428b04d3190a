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

Into jaxpar, tensors are read one at a time (``safetensors.safe_open``), each of jaxpar's stacked
weights built from its layers' tensors and placed on the devices split over its largest dim, then
the whole saved as a verified checkpoint (step 0, parameters only) that any layout restores; the
tokenizer file is kept beside it. Out, each weight is read back verified and written in the dtype
the source had (recorded), so a round trip gives the same tensors bitwise.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil

import jax
import numpy as np

from jaxpar import corpus
from jaxpar.errors import JaxparError
from jaxpar.models import config_of, config_record, llama
from jaxpar.train import checkpoint as checkpoint_lib

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
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


def _placed(value: np.ndarray, devices) -> jax.Array:
    """``value`` on ``devices``, split over its largest dim they divide (else on each whole)."""
    mesh = jax.sharding.Mesh(np.array(devices), ("devices",))
    dims = [d for d in np.argsort(value.shape)[::-1] if value.shape[d] % len(devices) == 0]
    spec = [None] * value.ndim
    if dims:
        spec[dims[0]] = "devices"
    return jax.device_put(value, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)))


def from_hf(source: str, target: str, name: str = "hf-llama", log=lambda message: None) -> dict:
    """Convert the Hugging Face Llama in ``source`` into a jaxpar checkpoint in ``target`` (which
    must hold none); returns what it wrote."""
    cfg, raw = read_config(source)
    read, files = _reader(source)
    devices = jax.devices()
    params, dtypes = {"layers": {}}, {}
    for ours, (theirs, shape) in TOP.items():
        if ours == "unembedding" and cfg.tie_embeddings:
            continue
        tensor = read(theirs)
        dtypes[theirs] = str(tensor.dtype)
        params[ours] = _placed(np.asarray(shape(tensor), np.float32), devices)
    for ours, (theirs, shape) in LAYER.items():
        stacked = np.empty((cfg.layers, *shape(read(f"model.layers.0.{theirs}"), cfg).shape), np.float32)
        for i in range(cfg.layers):
            tensor = read(f"model.layers.{i}.{theirs}")
            dtypes[f"model.layers.{i}.{theirs}"] = str(tensor.dtype)
            stacked[i] = shape(tensor, cfg)
        params["layers"][ours] = _placed(stacked, devices)
        log(f"converted {ours} ({cfg.layers} layers)")
    meta = {"model": name, "strategy": f"fsdp={len(devices)}", "topology": "converted", "devices": len(devices), "processes": 1,
            **config_record(cfg), "data": {"seq_len": int(raw.get("max_position_embeddings", 2048))},
            "hf": {"source": os.path.abspath(source), "config": raw, "dtypes": dtypes, "files": sorted(set(files.values()))}}
    ckpt = checkpoint_lib.Checkpointer(checkpoint_lib.CheckpointConfig(target, keep=1))
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


def to_hf(checkpoint_dir: str, target: str, step: int | None = None, log=lambda message: None) -> dict:
    """Write checkpoint ``step`` (default: the newest) of a jaxpar Llama as a Hugging Face
    directory ``target``: config.json, model.safetensors and the kept tokenizer if any."""
    from safetensors.numpy import save_file

    arrays, meta = checkpoint_lib.load_arrays(checkpoint_dir, step)  # read whole on this host, verified
    cfg = config_of(meta)
    if type(cfg) is not llama.LlamaConfig:
        raise JaxparError(f"checkpoint in {checkpoint_dir} holds {meta['model']}, not a Llama: --to-hf writes Llama checkpoints")
    dtypes = meta.get("hf", {}).get("dtypes", {})
    out = {}
    for ours, (theirs, shape) in TOP.items():
        if f"params/{ours}" in arrays:
            out[theirs] = _back(shape(arrays[f"params/{ours}"]), dtypes.get(theirs))
    for ours, (theirs, _) in LAYER.items():
        stacked = arrays[f"params/layers/{ours}"]
        for i in range(cfg.layers):
            name = f"model.layers.{i}.{theirs}"
            out[name] = _back(_to_hf_shape(ours, stacked[i], cfg), dtypes.get(name))
    os.makedirs(target, exist_ok=True)
    save_file(out, os.path.join(target, "model.safetensors"), metadata={"format": "pt"})
    config = dict(meta.get("hf", {}).get("config", {}), **hf_config(cfg))
    with open(os.path.join(target, CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    kept = glob.glob(os.path.join(checkpoint_dir, corpus.tokenizer.KEPT + ".json"))
    if kept:
        shutil.copyfile(kept[0], os.path.join(target, "tokenizer.json"))
    log(f"wrote {len(out)} tensors to {target}")
    return {"tensors": len(out), "directory": target}


def _to_hf_shape(ours: str, value: np.ndarray, cfg: llama.LlamaConfig) -> np.ndarray:
    """One layer's jaxpar weight in the Hugging Face shape (``LAYER``'s inverse)."""
    if ours in ("wq", "wk", "wv"):
        return value.reshape(cfg.embed, -1).T
    if ours == "wo":
        return value.reshape(-1, cfg.embed).T
    return value.T if value.ndim == 2 else value


def _back(value: np.ndarray, dtype: str | None) -> np.ndarray:
    """``value`` in the dtype its source had (float32 where none is recorded), contiguous."""
    if dtype is None:
        return np.ascontiguousarray(value)
    import ml_dtypes  # jax's own dependency: bfloat16 for numpy

    target = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    return np.ascontiguousarray(value.astype(target))


def hf_config(cfg: llama.LlamaConfig) -> dict:
    """The Hugging Face config.json of a jaxpar Llama config (``read_config``'s inverse)."""
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": cfg.vocab_size, "hidden_size": cfg.embed,
            "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim, "intermediate_size": cfg.mlp, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps,
            "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu"}
