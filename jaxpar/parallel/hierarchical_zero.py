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
from jaxpar.mesh import divisors
from jaxpar.parallel.base import count_option

AXES = ("fsdp_group",)  # outer to fsdp: each group is P neighbouring devices
CROSSES_DCN = False


# 0, the default, is "not hierarchical": given, it would do nothing
OPTIONS = {"param_shards": (count_option(lambda n: n >= 2, "give the number of devices a weight is split over, at least 2, "
                                         "e.g. param_shards=4; or drop param_shards"), 0)}


def reshape(degrees: dict, options: dict) -> dict:
    """``fsdp=N,param_shards=P`` -> ``fsdp_group=N/P``, ``fsdp=P``."""
    shards, n = options["param_shards"], degrees["fsdp"]
    if not shards:
        return degrees
    groups = [d for d in divisors(n) if 1 < d < n]  # group sizes that leave at least 2 groups
    if shards not in groups:
        why = "hierarchical ZeRO: weights split inside groups of that many devices, gradients and optimizer state over all of fsdp"
        size = max(shards, 2)
        bigger = f"fsdp= a multiple of {size} above it, e.g. fsdp={2 * size},param_shards={size}"
        if n == 1:
            raise SpecError(f"param_shards={shards} splits the fsdp axis into groups ({why}), but the strategy has no fsdp "
                            f"axis (fsdp=1); use {bigger}, or drop param_shards")
        fix = f"one of {', '.join(map(str, groups))}" if groups else f"none: {n} is prime; use {bigger}"
        raise SpecError(f"param_shards={shards} must divide fsdp={n} and lie strictly between 1 and {n} ({why}): {fix}; "
                        f"or drop param_shards")
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
    g, k = ctx.mesh["fsdp_group"], ctx.microbatches
    if g == 1:
        return {}
    # the weights split further over fsdp_group (one left whole there is data.traffic's)
    shard = sum(w.stored("param") for w in ctx.weights if "fsdp_group" in w.stored_over["optimizer"]) * (g - 1) / g
    return {("reduce-scatter", "fsdp_group"): k * shard * ctx.reduce_bytes, ("all-gather", "fsdp_group"): shard * ctx.stored_bytes}
