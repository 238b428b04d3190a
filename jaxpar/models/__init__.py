"""The models jaxpar knows by name (``--model``), by family: each family is one file holding its
``FAMILY`` bundle (``family.Family``: config, model, loss, batch rows, options, what a checkpoint
records), registered below in one line. A config's exact class says its family (``family_of``): a
``bd3lm.BD3LMConfig`` is a ``LlamaConfig`` with the diffusion's own fields, so what reads only
shapes (sizes, FLOPs, memory) takes either."""

from __future__ import annotations

import dataclasses

from jaxpar.errors import JaxparError
from jaxpar.models import bd3lm, llama, moe
from jaxpar.models.family import Family

FAMILIES: dict[str, Family] = {}
CONFIGS: dict = {}  # every family's configs by --model name


def register(family: Family) -> None:
    """Make ``family`` and its configs known by name (``--model``, checkpoints)."""
    clash = sorted(set(family.configs) & set(CONFIGS))
    if family.name in FAMILIES or clash:
        raise JaxparError(f"model family {family.name!r} is registered already, or names configs another family has ({clash})")
    FAMILIES[family.name] = family
    CONFIGS.update(family.configs)


def unregister(name: str) -> None:
    for config in FAMILIES.pop(name).configs:
        del CONFIGS[config]


for _family in (llama.FAMILY, bd3lm.FAMILY, moe.FAMILY):  # a new family: its file, and its FAMILY here
    register(_family)


def model_config(name: str):
    """The config of the model called ``name`` (``tiny``, ``llama2-7b``, ``llama3-8b``,
    ``bd3lm-tiny``, ``moe-tiny``...); an unknown name is refused with the known ones."""
    if name not in CONFIGS:
        raise JaxparError(f"unknown model {name!r}; choose one of {', '.join(CONFIGS)}")
    return CONFIGS[name]


def config_record(cfg) -> dict:
    """What a checkpoint records of ``cfg`` so that ``config_of`` rebuilds it (a converted or a
    re-tokenized model has a config no name gives)."""
    return {"family": family_of(cfg).name, "model_config": dataclasses.asdict(cfg)}


def config_of(meta: dict):
    """The config of the model a checkpoint holds: from its ``config_record``, or (checkpoints
    saved before it was kept) from its model's name."""
    if "model_config" not in meta:
        return model_config(meta["model"])
    if meta.get("family") not in FAMILIES:
        raise JaxparError(f"the checkpoint's model is of family {meta.get('family')!r}, which jaxpar does not know "
                          f"(it knows {', '.join(FAMILIES)})")
    return FAMILIES[meta["family"]].config_type(**meta["model_config"])


def family_of(cfg) -> Family:
    """The family whose config class ``cfg`` is exactly; a config of no registered family is refused."""
    for family in FAMILIES.values():
        if type(cfg) is family.config_type:
            return family
    raise JaxparError(f"{type(cfg).__name__} is the config of no registered model family ({', '.join(FAMILIES)}); "
                      f"register its family in jaxpar/models/__init__.py (FAMILIES)")


def model_and_loss(cfg):
    """(``model_fn(rngs)``, ``loss_fn(model, batch)``) of ``cfg``'s family."""
    family = family_of(cfg)
    return (lambda rngs: family.model(cfg, rngs)), family.loss
