"""A user's own Flax model under jaxpar against the same model under plain ``jax.jit``.

    python benchmarks/any_model.py [--steps 10] [--width 64] [--layers 2]

The model is written here as a plain Flax user writes one, with no jaxpar import and no activation
constraint: a Gemma-like transformer (grouped-query attention, a sliding-window layer then a global
one, tied embeddings, weights annotated with logical names). On 8 simulated CPU devices, per layout,
jaxpar's training step (its GSPMD path) and a plain ``jax.jit`` step with the same weight, optimizer
and batch shardings (the same loss and AdamW) are compiled in one process and run interleaved: the
median step time of each over ``--steps`` steps after a warm-up, the compiled temporaries and the
collective bytes per device per step (``analysis/hlo.py``). The simulated devices share two cores,
so a step's time is every device's work added up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxpar.analysis import hlo  # noqa: E402
from jaxpar.parallel import build_layout, parse_strategy  # noqa: E402
from jaxpar.train.step import TrainConfig, Trainer  # noqa: E402

LAYOUTS = ("data=8", "fsdp=8", "data=2,fsdp=4", "fsdp=4,tensor=2", "fsdp=8,param_shards=4")
VOCAB, WINDOW = 64, 8
init = nnx.initializers.normal(0.02)
named = nnx.with_partitioning


# --- the user's model (nothing here knows jaxpar) ---------------------------------------------


class Block(nnx.Module):
    def __init__(self, width, heads, kv_heads, hidden, window, rngs):
        self.heads, self.kv_heads, self.head_dim, self.window = heads, kv_heads, width // heads, window
        linear = lambda n_in, n_out, names: nnx.Linear(n_in, n_out, use_bias=False, kernel_init=named(init, names), rngs=rngs)  # noqa: E731
        self.attn_norm = nnx.RMSNorm(width, scale_init=named(nnx.initializers.ones, ("embed",)), rngs=rngs)
        self.q = linear(width, heads * self.head_dim, ("embed", "heads"))
        self.k = linear(width, kv_heads * self.head_dim, ("embed", "kv_heads"))
        self.v = linear(width, kv_heads * self.head_dim, ("embed", "kv_heads"))
        self.o = linear(heads * self.head_dim, width, ("heads", "embed"))
        self.mlp_norm = nnx.RMSNorm(width, scale_init=named(nnx.initializers.ones, ("embed",)), rngs=rngs)
        self.gate, self.up = linear(width, hidden, ("embed", "mlp")), linear(width, hidden, ("embed", "mlp"))
        self.down = linear(hidden, width, ("mlp", "embed"))

    def __call__(self, x):
        b, length, _ = x.shape
        h = self.attn_norm(x)
        q = self.q(h).reshape(b, length, self.heads, self.head_dim)
        k, v = (p(h).reshape(b, length, self.kv_heads, self.head_dim) for p in (self.k, self.v))
        window = (self.window, 0) if self.window else None
        x = x + self.o(jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=window).reshape(b, length, -1))
        h = self.mlp_norm(x)
        return x + self.down(jax.nn.gelu(self.gate(h)) * self.up(h))


class GemmaLike(nnx.Module):
    def __init__(self, width, layers, rngs):
        self.width = width
        self.embed = nnx.Embed(VOCAB, width, embedding_init=named(init, ("vocab", "embed")), rngs=rngs)
        self.blocks = nnx.List([Block(width, 4, 2, 2 * width, WINDOW if i % 2 == 0 else None, rngs) for i in range(layers)])
        self.norm = nnx.RMSNorm(width, scale_init=named(nnx.initializers.ones, ("embed",)), rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) * jnp.sqrt(float(self.width))
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.norm(x))  # tied embeddings


def loss_fn(model, tokens):
    return optax.softmax_cross_entropy_with_integer_labels(model(tokens[:, :-1]), tokens[:, 1:]).mean()


# --- the comparison ---------------------------------------------------------------------------


def programs(spec: str, width: int, layers: int, optimizer):
    """(jaxpar's step, plain jit's step, each with its first arguments) compiled for ``spec``."""
    layout = build_layout(parse_strategy(spec, 8), jax.devices())
    # no clipping: the plain step below is plain AdamW (jaxpar still measures the gradient's norm)
    trainer = Trainer(layout, lambda rngs: GemmaLike(width, layers, rngs), loss_fn, TrainConfig(donate=False, clip_norm=0.0),
                      optimizer=optimizer)
    state = trainer.init(seed=0)
    batch = trainer.put_batch(np.asarray(jax.random.randint(jax.random.key(1), (16, 65), 0, VOCAB)))

    def plain_step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(trainer.graphdef, trainer._with_values(p)), tokens))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    shardings = trainer.state_shardings
    plain = jax.jit(plain_step, in_shardings=(shardings.params, shardings.opt_state, batch.sharding),
                    out_shardings=(shardings.params, shardings.opt_state, None))
    ours = trainer.jit_step(batch).lower(state, batch).compile()
    theirs = plain.lower(state.params, state.opt_state, batch).compile()
    return layout, (ours, (state, batch)), (theirs, (state.params, state.opt_state, batch))


def median_seconds(compiled, args, steps: int) -> float:
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    optimizer = optax.adamw(1e-3)
    print(f"Gemma-like model, width {args.width}, {args.layers} layers, batch 16 x 64, AdamW; 8 simulated CPU devices; "
          f"median of {args.steps} steps, the two programs interleaved")
    print(f"{'layout':24s} {'ms jaxpar / jit':>18s} {'time':>6s} {'temp KB jaxpar / jit':>22s} {'temp':>6s} {'KB sent jaxpar / jit':>22s} {'sent':>6s}")
    for spec in LAYOUTS:
        layout, ours, theirs = programs(spec, args.width, args.layers, optimizer)
        times = {"jaxpar": [], "jit": []}
        for _ in range(3):  # interleaved rounds: the machine's noise falls on both
            for name, (compiled, call_args) in (("jaxpar", ours), ("jit", theirs)):
                times[name].append(median_seconds(compiled, call_args, args.steps))
        ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
        temp = {name: c.memory_analysis().temp_size_in_bytes / 1e3 for name, (c, _) in (("jaxpar", ours), ("jit", theirs))}
        sent = {name: sum(x.bytes_per_step for x in hlo.collectives(c.as_text(), layout.mesh)) / 1e3
                for name, (c, _) in (("jaxpar", ours), ("jit", theirs))}
        ratio = lambda d: d["jaxpar"] / d["jit"]  # noqa: E731
        print(f"{spec:24s} {ms['jaxpar']:8.2f} / {ms['jit']:7.2f} {ratio(ms):5.2f}x {temp['jaxpar']:10.1f} / {temp['jit']:9.1f} "
              f"{ratio(temp):5.2f}x {sent['jaxpar']:10.1f} / {sent['jit']:9.1f} {ratio(sent):5.2f}x")


if __name__ == "__main__":
    main()
