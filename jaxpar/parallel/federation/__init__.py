"""Federated sharded data parallelism over ``federation`` (FL+FSDP, FL+HSDP, the DiLoCo family).

``federation=G`` splits the devices into G groups (the outermost mesh axis, which may cross the
slow links between slices). Each group trains its own copy of the model under the rest of the
strategy (``"federation=2,fsdp=4"``: FL+FSDP; ``"federation=2,data=2,fsdp=2"``: FL+HSDP) on its
own rows of every global batch, with its own optimizer, for ``local_steps`` steps; then the copies
merge, shard by shard between the devices that hold the same shard in each group (one all-reduce
over ``federation``: 2 (Psi / n) (G - 1) / G bytes per device for G groups of n devices):

- ``outer=avg``: the copies' mean (xFFL's federated averaging);
- ``outer=sgd`` / ``outer=nesterov``: an outer optimizer steps the model as of the last merge by
  the mean pseudo-gradient (that model minus each copy): momentum SGD, or Nesterov momentum
  (DiLoCo: ``outer_lr=0.7``, ``outer_momentum=0.9``, the defaults), each group keeping the
  model and the outer momentum (the same in every group, so the merge moves nothing else).

Each group's inner optimizer state stays its own (AdamW's moments are never averaged) unless
``merge_opt_state=on``. ``fragments=F`` (Streaming DiLoCo) merges the stacked layers a 1/F share at
a time, fragment f at steps (f + 1) H / F of every H (fragment 0 also holds the weights outside
the layers), so each merge sends 1/F of the bytes and the merges spread over the H steps; F must
divide the layers and H. ``merge_delay=D`` (Streaming DiLoCo's overlap) applies a merge's result D
steps after the copies it merged, while the groups train on, so its communication has D steps to
run behind them: the copy's fragment then becomes ``merge_mix`` (default 0.5) of itself plus the
rest of the merged fragment. Nothing crosses ``federation`` between merges: each group's step is its
own program on its own devices (``train/federated.py``'s ``FederatedTrainer``). With ``federation=1`` a run is the
inner strategy's, bitwise.
"""

from jaxpar.errors import SpecError
from jaxpar.parallel.base import count_option, option_of, switch

AXES = ("federation",)
CROSSES_DCN = True  # the merges are its only traffic, every local_steps steps
RUNNER = "jaxpar.federate"  # jaxpar train's loop over the groups
OUTER = ("avg", "sgd", "nesterov")


def _rate(key: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0 or value == float("inf"):
        raise SpecError(f"option {key}={text!r}: give a finite number, 0 or more (e.g. {key}=0.7)")
    return value


OPTIONS = {
    "local_steps": (count_option(lambda n: n >= 1, "give the inner steps between merges, 1 or more (e.g. local_steps=8)"), 8),
    "outer": (option_of({name: name for name in OUTER}, f"use one of {', '.join(OUTER)}"), "avg"),
    "outer_lr": (_rate, 0.7),
    "outer_momentum": (_rate, 0.9),
    "merge_opt_state": (switch, False),
    "fragments": (count_option(lambda n: n >= 1, "give how many shares of the stacked layers merge in turn, 1 or more "
                                                 "(e.g. fragments=4)"), 1),
    "merge_delay": (count_option(lambda n: n >= 0, "give the steps a merge's result waits before it is applied, 0 or more "
                                                   "(e.g. merge_delay=1)"), 0),
    "merge_mix": (_rate, 0.5),
}


def check(strategy) -> None:
    """Refuse federation options without ``federation`` to apply them to."""
    given = sorted(set(strategy.given) & set(OPTIONS))
    if given and strategy.degrees.get("federation", 1) == 1:
        raise SpecError(f"option {given[0]} is for federated training; add federation=G (G groups, e.g. federation=2) "
                        f"or drop {given[0]}")
    options = strategy.options
    if "merge_mix" in strategy.given and not options["merge_delay"]:
        raise SpecError("option merge_mix mixes a delayed merge's result into the copy trained on meanwhile; add "
                        "merge_delay=D or drop merge_mix")
    if options["merge_mix"] > 1:
        raise SpecError(f"option merge_mix={options['merge_mix']}: the share of the copy kept is between 0 and 1 "
                        "(Streaming DiLoCo's is 0.5)")
    if options["merge_delay"] and options["merge_delay"] >= options["local_steps"] // options["fragments"]:
        raise SpecError(f"option merge_delay={options['merge_delay']}: a fragment's merge must be applied before the next "
                        f"fragment merges, every local_steps / fragments = {options['local_steps'] // options['fragments']} "
                        "steps; give a smaller delay")
    if strategy.options["outer_momentum"] >= 1:
        raise SpecError(f"option outer_momentum={strategy.options['outer_momentum']}: a momentum of 1 or more never "
                        "forgets a step; give one below 1 (DiLoCo's is 0.9)")


def check_slices(strategy, num_slices: int) -> None:
    """On a topology of several slices ``federation`` is the outermost axis and its groups take the
    slow links between them (the mesh puts it first, whatever the order written): refuse a degree
    whose groups would straddle slices, so that a group's own traffic crossed the slow links."""
    groups = strategy.degrees.get("federation", 1)
    if num_slices > 1 and groups > 1 and groups % num_slices and num_slices % groups:
        raise SpecError(f"federation={groups} on {num_slices} slices would cut groups across the slow links between "
                        f"slices; give a degree that divides {num_slices} or is a multiple of it")


def rules(strategy, compute: dict, stored: dict) -> None:
    if strategy.degrees.get("federation", 1) > 1:  # (a layout without groups keeps the batch axes it had)
        compute["batch"] = AXES + compute["batch"]  # each group its own rows


def roles(strategy) -> dict:
    return {"federation": AXES}


def check_run(planned, cfg) -> None:
    """The ordinary step would all-reduce every gradient over ``federation``: refuse it."""
    if planned.role("federation"):
        raise SpecError(f"federation={planned_degree(planned)} trains one copy of the model per group, merged every "
                        "local_steps steps: jaxpar train runs it, and jaxpar.train.federated.FederatedTrainer (the "
                        "one-program step, jaxpar compile's and a Trainer's, does not); federation=1 runs the rest of the strategy")


def planned_degree(planned) -> int:
    mesh = getattr(planned, "mesh", None)
    return mesh.shape["federation"] if mesh is not None else planned.degrees["federation"]
