"""Hierarchical ZeRO (ZeRO++'s hpZ, InternEvo's hierarchical ZeRO): ``fsdp=N,param_shards=P``.

Weights are stored split P ways inside groups of P neighbouring devices (the ``fsdp`` axis, inside
a node or slice), so the forward and backward gathers stay on the fast links; gradients and
optimizer state are split over all N devices (``fsdp_group`` x ``fsdp``, G = N/P groups). The
mesh axis ``fsdp_group`` numbers the groups; the batch is split over it like over ``fsdp``.

Per step and device, for Psi weights (k micro-batches; compute, reduction and stored dtypes):
- over ``fsdp`` (P): the ZeRO-3 gathers and reduce-scatters (``fsdp.traffic``) with n = P;
- over ``fsdp_group`` (G): each micro-batch reduce-scatters the group's gradient shard,
  k * (Psi/P) * (G-1)/G * reduction bytes; after the update each group gathers its parameter
  shards from the optimizer shards, (Psi/P) * (G-1)/G * stored bytes.
Memory per device: weights 4*Psi/P, gradient buffer 4*Psi/N, Adam moments 8*Psi/N.
"""

from jaxpar.errors import SpecError

AXES = ("fsdp_group",)  # outer to fsdp: each group is P neighbouring devices
CROSSES_DCN = False


def _shards(key: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise SpecError(f"option {key}={text!r}: give the number of devices a weight is split over, e.g. {key}=4") from None


OPTIONS = {"param_shards": (_shards, 0)}  # 0: not hierarchical


def reshape(degrees: dict, options: dict) -> dict:
    """``fsdp=N,param_shards=P`` -> ``fsdp_group=N/P``, ``fsdp=P``."""
    shards, n = options["param_shards"], degrees["fsdp"]
    if not shards:
        return degrees
    if not 1 < shards < n or n % shards:
        raise SpecError(f"param_shards={shards} must divide fsdp={n} and lie strictly between 1 and {n} "
                        f"(weights split over groups of that many devices); e.g. param_shards={max(2, n // 2)}")
    return dict(degrees, fsdp=shards, fsdp_group=n // shards)


def check(strategy):
    if strategy.degrees["fsdp_group"] > 1 and "param_shards" not in strategy.given:
        raise SpecError(f"fsdp_group is set by param_shards: write fsdp=N,param_shards=P instead of fsdp_group=... in {strategy}")
    if strategy.options["param_shards"] and strategy.options["zero"] != 3:
        raise SpecError(f"param_shards splits stored weights inside groups, which zero={strategy.options['zero']} "
                        f"does not store split; drop zero= (hierarchical ZeRO is ZeRO-3) or param_shards")


def rules(strategy, compute: dict, stored: dict):
    compute["batch"] = compute["batch"] + AXES
    if strategy.degrees["fsdp_group"] > 1:
        # split over all N devices, fsdp major (``fsdp.rules`` puts its axis first): a device's
        # optimizer shard is then a piece of its group's weight shard, so the gradient's
        # reduce-scatter and the weights' gather after the update run over fsdp_group alone
        for mapping in ("optimizer", "grad"):
            stored[mapping]["embed"] = stored[mapping]["embed"] + AXES


def traffic(strategy, ctx) -> dict:
    g, p, k = ctx.mesh["fsdp_group"], ctx.mesh["fsdp"], ctx.microbatches
    if g == 1:
        return {}
    shard = ctx.psi / p * (g - 1) / g
    return {("reduce-scatter", "fsdp_group"): k * shard * ctx.reduce_bytes, ("all-gather", "fsdp_group"): shard * ctx.stored_bytes}


def memory(strategy, mesh) -> dict:
    g = mesh["fsdp_group"]
    return {"optimizer": g, "gradient_accumulation": g} if g > 1 else {}
