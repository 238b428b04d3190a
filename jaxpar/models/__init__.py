"""The models jaxpar knows by name (``--model``): the Llama family of ``llama.CONFIGS`` and the
block diffusion family of ``bd3lm.CONFIGS`` (``bd3lm-tiny``, ``bd3lm-8b``). A config's class says
its family (``model_family``): a ``bd3lm.BD3LMConfig`` is a ``LlamaConfig`` with the diffusion's
own fields, so what reads only shapes (sizes, FLOPs, memory) takes either."""

from __future__ import annotations

from jaxpar.errors import JaxparError
from jaxpar.models import bd3lm, llama

CONFIGS: dict[str, llama.LlamaConfig] = {**llama.CONFIGS, **bd3lm.CONFIGS}


def model_config(name: str) -> llama.LlamaConfig:
    """The config of the model called ``name`` (``tiny``, ``llama2-7b``, ``llama3-8b``,
    ``bd3lm-tiny``...); an unknown name is refused with the known ones."""
    if name not in CONFIGS:
        raise JaxparError(f"unknown model {name!r}; choose one of {', '.join(CONFIGS)}")
    return CONFIGS[name]


def model_family(cfg: llama.LlamaConfig) -> str:
    """``"bd3lm"`` for a block diffusion config (its model is ``bd3lm.BD3LM``, its loss
    ``bd3lm.loss_fn`` on ``bd3lm.corrupt`` batches), else ``"llama"``."""
    return "bd3lm" if isinstance(cfg, bd3lm.BD3LMConfig) else "llama"


def model_and_loss(cfg: llama.LlamaConfig):
    """(``model_fn(rngs)``, ``loss_fn(model, batch)``) of ``cfg``'s family."""
    if model_family(cfg) == "bd3lm":
        return (lambda rngs: bd3lm.BD3LM(cfg, rngs=rngs)), bd3lm.loss_fn
    return (lambda rngs: llama.Llama(cfg, rngs=rngs)), llama.loss_fn
