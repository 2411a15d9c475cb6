"""Which class implements which architecture: the ``architectures`` field of config.json.

Each entry names the module that defines the class rather than importing it here, so adding an
architecture is one line and loading one model never imports the others. Chapter 3 tells the
story; chapter 18 adds the other families.
"""

from __future__ import annotations

import importlib

from minisgl.models.base import BaseLLMModel

# config.json "architectures" entry (the class's name) -> its module under minisgl.models
MODEL_REGISTRY: dict[str, str] = {
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


def supported_architectures() -> list[str]:
    """The architecture names :func:`get_model_class` accepts, sorted."""
    return sorted(MODEL_REGISTRY)


def get_model_class(architectures: list[str] | tuple[str, ...]) -> type[BaseLLMModel]:
    """The model class for a config's ``architectures`` list (the first supported entry wins)."""
    if not architectures:
        raise ValueError("config.json has no 'architectures' entry, so the model class is "
                         f"unknown; supported: {', '.join(supported_architectures())}")
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return getattr(importlib.import_module(f"minisgl.models.{MODEL_REGISTRY[arch]}"), arch)
    raise ValueError(
        f"unsupported model architecture {list(architectures)!r} (from config.json "
        f"'architectures'); supported: {', '.join(supported_architectures())}"
    )
