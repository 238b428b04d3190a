"""Context parallelism over ``context``: positions inside attention and MLP blocks, and in the
residual stream, are split over ``context`` (the logical axes ``length`` and ``residual_length``).
Attention across the split (ring attention) is not in jaxpar's models yet: the Llama refuses this
axis; the traffic of ring attention comes with it.
"""

AXES = ("context",)
CROSSES_DCN = False
OPTIONS: dict = {}


def check(strategy):
    """Nothing to refuse here (the model says whether it can split its sequence)."""


def rules(strategy, compute: dict, stored: dict):
    compute["length"] = compute["length"] + AXES
    compute["residual_length"] = compute["residual_length"] + AXES


def traffic(strategy, ctx) -> dict:
    return {}


def memory(strategy, mesh) -> dict:
    return {}
