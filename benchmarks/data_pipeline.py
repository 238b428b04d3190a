"""A user's own data and weights: tokenizing and caching a corpus, reading batches through Grain,
and converting a Hugging Face Llama of about 1B parameters, all on files this script writes.

    python benchmarks/data_pipeline.py [--megabytes 100] [--skip-convert | --only-convert]

1. A corpus of ``--megabytes`` MB of JSON Lines, made at run time from the standard library's
   docstrings (the built-in corpus, ``train.data``), each document numbered so that none repeats:
   the time to tokenize it and write its cache, with the byte tokenizer and with a byte-level BPE
   tokenizer (``tokenizers``, 8,192 ids, trained here on the first 4 MB), and the time to open the
   cache again.
2. Reading batches (``corpus.Windows`` and ``corpus.PackedRows``): tokens per second for one
   process at the main job's shapes (16 x 128) and at llama-1b's (8 x 2048), next to what a step
   consumes (the main job on this CPU; llama-1b at 40% MFU on an H100, 989 TFLOP/s bf16).
3. ``jaxpar convert`` of a random Llama with llama-1b's shapes written in the Hugging Face layout
   (bfloat16, two safetensors shards), each way in a process of its own as the command runs:
   seconds, and the peak resident memory of each part (Linux's ``VmHWM``, reset between parts)
   against the model's size in float32: reading and placing the weights, the checkpoint's
   checksums, orbax's write; orbax's read, the checksums, writing the safetensors files.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import json
import multiprocessing
import os
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from jaxpar import corpus  # noqa: E402
from jaxpar.models import llama  # noqa: E402
from jaxpar.train import data  # noqa: E402


def write_corpus(directory: str, megabytes: float) -> list[str]:
    """JSON Lines files of about ``megabytes`` MB: the built-in corpus's documents, numbered."""
    docs = [bytes(d.astype(np.uint8).tolist()).decode("utf-8", errors="replace") for d in data.documents(data.corpus_tokens())]
    paths, written, n = [], 0, 0
    while written < megabytes * 1e6:
        path = os.path.join(directory, f"part-{len(paths):03d}.jsonl")
        with open(path, "w") as f:
            while f.tell() < 25e6 and written + f.tell() < megabytes * 1e6:
                f.write(json.dumps({"text": f"[{n}] {docs[n % len(docs)]}"}) + "\n")
                n += 1
            written += f.tell()
        paths.append(path)
    return paths


def bpe(directory: str, paths: list[str]) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    with open(paths[0]) as f:
        sample = [json.loads(line)["text"] for line, _ in zip(f, range(4000))]
    tokenizer.train_from_iterator(sample, trainers.BpeTrainer(vocab_size=8192, special_tokens=["</s>"],
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = os.path.join(directory, "tokenizer.json")
    tokenizer.save(path)
    return path


def caching(directory: str, megabytes: float) -> dict:
    os.makedirs(os.path.join(directory, "corpus"))
    paths = write_corpus(os.path.join(directory, "corpus"), megabytes)
    size = sum(os.path.getsize(p) for p in paths)
    spec = ",".join(paths)
    opened = {}
    for name, tokenizer in (("bytes", corpus.load("bytes")), ("bpe-8192", corpus.load(bpe(directory, paths)))):
        began = time.perf_counter()
        whole = corpus.open_corpus(spec, tokenizer, cache_root=os.path.join(directory, "cache"))
        made = time.perf_counter() - began
        began = time.perf_counter()
        corpus.open_corpus(spec, tokenizer, cache_root=os.path.join(directory, "cache"))
        print(f"{name:9} {size / 1e6:7.1f} MB, {whole.record['documents']:,} documents, {len(whole.tokens):,} tokens: "
              f"tokenized and cached in {made:6.1f} s ({size / 1e6 / made:5.1f} MB/s); reopened in {time.perf_counter() - began:.2f} s")
        opened[name] = whole
    return opened


def reading(whole: corpus.Corpus):
    main_job = 4_100  # tokens/s of the main job's step on this CPU (jaxpar train, 8 simulated devices)
    cfg = llama.CONFIGS["llama-1b"]
    h100 = 0.4 * 989e12 / cfg.flops_per_token(2048)
    for shape, consumes, what in (((16, 128), main_job, "the main job here"), ((8, 2048), h100, "llama-1b at 40% MFU on an H100")):
        for kind in (corpus.Windows, corpus.PackedRows):
            reader = kind(whole, shape[1], shape[0], seed=0)
            reader.rows(0, 0, shape[0])
            began, steps = time.perf_counter(), 0
            while time.perf_counter() - began < 2.0:
                steps += 1
                reader.rows(steps, 0, shape[0])
            rate = steps * shape[0] * shape[1] / (time.perf_counter() - began)
            print(f"{kind.__name__:10} {shape[0]:>3} x {shape[1]:<5} {rate:>12,.0f} tokens/s per process; {what} consumes "
                  f"{consumes:,.0f} ({rate / consumes:,.0f}x)")


def converting(directory: str):
    import ml_dtypes
    from safetensors.numpy import save_file

    from jaxpar import hf

    cfg = llama.CONFIGS["llama-1b"]
    source = os.path.join(directory, "hf")
    os.makedirs(source)
    rng = np.random.default_rng(0)
    e, h, k, d, m, v = cfg.embed, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp, cfg.vocab_size
    shapes = {"model.embed_tokens.weight": (v, e), "model.norm.weight": (e,), "lm_head.weight": (v, e)}
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (h * d, e), p + "self_attn.k_proj.weight": (k * d, e),
                       p + "self_attn.v_proj.weight": (k * d, e), p + "self_attn.o_proj.weight": (e, h * d),
                       p + "mlp.gate_proj.weight": (m, e), p + "mlp.up_proj.weight": (m, e), p + "mlp.down_proj.weight": (e, m),
                       p + "input_layernorm.weight": (e,), p + "post_attention_layernorm.weight": (e,)})
    names = sorted(shapes)
    index = {}
    for part, chunk in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        file = f"model-{part + 1:05d}-of-00002.safetensors"
        save_file({n: (rng.standard_normal(shapes[n], np.float32) * 0.02).astype(ml_dtypes.bfloat16) for n in chunk},
                  os.path.join(source, file))
        index.update({n: file for n in chunk})
    with open(os.path.join(source, hf.INDEX), "w") as f:
        json.dump({"weight_map": index}, f)
    with open(os.path.join(source, hf.CONFIG), "w") as f:
        json.dump(dict(hf.hf_config(cfg), max_position_embeddings=2048, torch_dtype="bfloat16"), f)
    size = sum(os.path.getsize(os.path.join(source, f)) for f in set(index.values()))
    params = sum(int(np.prod(s)) for s in shapes.values())
    model = 4 * params
    print(f"convert: {params / 1e9:.2f}B parameters, {size / 1e9:.2f} GB of bfloat16 safetensors ({model / 1e9:.2f} GB in float32)")
    spawn = multiprocessing.get_context("spawn")
    for way, target, named in (("--from-hf", "ckpt", ("read and placed", "checksums", "orbax's write")),
                               ("--to-hf", "back", ("orbax's read", "checksums", "safetensors written"))):
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as fresh:  # a process of its own, as the command
            seconds, before, parts = fresh.submit(_one_way, way, source, os.path.join(directory, target)).result()
        source = os.path.join(directory, target)  # the next way reads what this one wrote
        peak = max(p for p, _ in parts)
        text = ", ".join(f"{name} {p / 1e9:.2f} / {now / 1e9:.2f}" for name, (p, now) in zip(named, parts))
        print(f"  {way:9} {seconds:6.1f} s, peak resident {peak / 1e9:.2f} GB ({peak / model:.1f}x the float32 model; "
              f"{before / 1e9:.2f} GB before); each part's peak / resident at its end, GB: {text}")


def _one_way(way: str, source: str, target: str) -> tuple[float, int, list]:
    """One way of ``jaxpar convert`` in this process: (seconds, resident bytes before, [(peak,
    resident) of each part]), the parts parted by the checkpoint's checksum program."""
    from jaxpar import hf
    from jaxpar.train import checkpoint as checkpoint_lib

    parts = []
    checksums = checkpoint_lib.state_checksums

    def measured(*args, **kwargs):
        parts.append(_peak_since_last())
        out = checksums(*args, **kwargs)
        parts.append(_peak_since_last())
        return out

    checkpoint_lib.state_checksums = measured
    before = _peak_since_last()[1]
    began = time.perf_counter()
    (hf.from_hf if way == "--from-hf" else hf.to_hf)(source, target)
    seconds = time.perf_counter() - began
    return seconds, before, parts + [_peak_since_last()]


def _peak_since_last() -> tuple[int, int]:
    """(this process's peak resident bytes since the last call, those resident now): Linux's VmHWM
    and VmRSS. Then the memory freed is given back to the system (glibc's malloc_trim), so that the
    next part's peak counts what it holds, not what the allocator kept of the part before, and the
    peak is reset (clear_refs)."""
    with open("/proc/self/status") as f:
        status = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.startswith(("VmHWM:", "VmRSS:"))}
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status["VmHWM"], status["VmRSS"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=100.0)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--skip-convert", action="store_true")
    which.add_argument("--only-convert", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as directory:
        if not args.only_convert:
            opened = caching(directory, args.megabytes)
            reading(opened["bpe-8192"])
        if not args.skip_convert:
            converting(directory)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
