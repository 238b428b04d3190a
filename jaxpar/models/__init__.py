"""The models jaxpar knows by name (``--model``): today the Llama family of ``llama.CONFIGS``."""

from __future__ import annotations

from jaxpar.errors import JaxparError
from jaxpar.models import llama


def model_config(name: str) -> llama.LlamaConfig:
    """The config of the model called ``name`` (``tiny``, ``llama2-7b``, ``llama3-8b``...); an
    unknown name is refused with the known ones."""
    if name not in llama.CONFIGS:
        raise JaxparError(f"unknown model {name!r}; choose one of {', '.join(llama.CONFIGS)}")
    return llama.CONFIGS[name]
