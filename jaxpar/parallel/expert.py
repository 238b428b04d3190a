"""Expert parallelism over ``expert``: the experts of a mixture-of-experts layer (logical axis
``experts``) are split over ``expert``. jaxpar's Llama has no expert layers (it refuses this axis);
the all-to-all traffic of token routing comes with the first model that has them.
"""

AXES = ("expert",)
NEEDS_MODEL = "it needs mixture-of-experts layers to split"
CROSSES_DCN = False
OPTIONS: dict = {}


def check(strategy):
    """Nothing to refuse here (the model says whether it has experts)."""


def rules(strategy, compute: dict, stored: dict):
    compute["experts"] = compute["experts"] + AXES  # the stored mappings inherit it


def traffic(strategy, ctx) -> dict:
    return {}


def memory(strategy, mesh) -> dict:
    return {}
