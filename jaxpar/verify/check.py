"""``jaxpar verify``: each property of a network checked by bounds, and a counterexample sought by
projected gradient descent where the bounds cannot prove it.

A verdict is one of: ``verified`` (the bounds rule out every disjunct of the unsafe set),
``falsified`` (an input in the box whose output, computed again in float32, lies in the unsafe
set: the counterexample is reported) or ``unknown`` (neither; the margin says by how much the
bounds missed: the worst disjunct's best row's lower bound of ``C y - d``, below 0).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.verify.network import Network
from jaxpar.verify.sharded import bound, compile_bound
from jaxpar.verify.vnnlib import Property


def attack(net: Network, prop: Property, steps: int = 50, restarts: int = 8, seed: int = 0):
    """An input in ``prop``'s box whose output lies in its unsafe set, or None: signed-gradient
    descent on each disjunct's worst row (max over rows of ``C y - d``, at most 0 inside the
    disjunct) from ``restarts`` random starts, projected onto the box."""
    lower, upper = (jnp.asarray(x).reshape(net.in_shape) for x in (prop.lower, prop.upper))

    def worst(x, c, d):
        return jnp.max(net(x).reshape(x.shape[0], -1) @ c.T - d, axis=-1)

    for c, d in prop.unsafe:
        c, d = jnp.asarray(c), jnp.asarray(d)
        if not len(d):  # no constraint: any input reaches the unsafe set
            return np.asarray(lower)
        x = lower + (upper - lower) * jax.random.uniform(jax.random.key(seed), (restarts, *net.in_shape))
        grad = jax.jit(jax.grad(lambda x: jnp.sum(worst(x, c, d))))
        for k in range(steps):
            size = (upper - lower) / 4 * (1 - k / steps)  # long steps first, then finer ones
            x = jnp.clip(x - size * jnp.sign(grad(x)), lower, upper)
            found = np.flatnonzero(np.asarray(worst(x, c, d)) <= 0)
            if found.size:
                return np.asarray(x[found[0]])
    return None


def check(net: Network, prop: Property, method: str, strategy: str = "", devices=None, alpha_steps: int = 20,
          attack_steps: int = 50, share_specs: bool = False) -> dict:
    """One property's verdict (module doc) with its bounds, time and what each device held."""
    began = time.perf_counter()
    c_all, d_all, groups = prop.spec()
    lower, upper = (np.asarray(x, np.float32).reshape((1, *net.in_shape)) for x in (prop.lower, prop.upper))
    spec = np.asarray(c_all, np.float32).reshape((len(d_all), *net.out_shape))
    result = bound(net, lower, upper, method, spec, strategy, devices, alpha_steps, share_specs=share_specs)
    margins = result.lower[0] - d_all  # lower bounds of C y - d
    record = {"method": method, "strategy": strategy or "one device", "lower_bounds": margins.tolist(),
              "upper_bounds": (result.upper[0] - d_all).tolist(),
              "margin": float(min(margins[groups == g].max() for g in range(len(prop.unsafe)))),
              "weight_bytes_per_device": result.program.weight_bytes, "memory_per_device": result.program.memory}
    if prop.verdict(margins):
        record["verdict"] = "verified"
    else:
        found = attack(net, prop, attack_steps)
        record["verdict"] = "falsified" if found is not None else "unknown"
        if found is not None:
            record["counterexample"] = {"input": found.ravel().tolist(), "output": np.asarray(net(found[None]))[0].ravel().tolist()}
    record["seconds"] = time.perf_counter() - began
    if result.program.mesh.size > 1:  # against one device: compiled, not run
        one = compile_bound(net, 1, len(d_all), method, "", devices, alpha_steps)
        record["one_device"] = {"weight_bytes": one.weight_bytes, "memory": one.memory}
    return record


def summary(name: str, record: dict) -> list[str]:
    """A property's record for a terminal."""
    verdict = record["verdict"]
    line = f"{name}: {verdict}"
    if verdict != "verified":
        line += f" (the bounds miss by {-record['margin']:.4g})"
    if verdict == "falsified":
        line += f"; counterexample output {np.round(record['counterexample']['output'], 4).tolist()}"
    memory = record["memory_per_device"]
    lines = [line, f"  {record['method']} under {record['strategy']}, {record['seconds']:.2f} s; margin "
                   f"{record['margin']:.4g}; per device: weights {record['weight_bytes_per_device']:,} B, "
                   f"temporaries {memory['temp_size']:,} B"]
    if "one_device" in record:
        one = record["one_device"]
        lines.append(f"  one device would hold weights {one['weight_bytes']:,} B, temporaries {one['memory']['temp_size']:,} B")
    return lines
