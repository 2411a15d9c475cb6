"""Which class implements which architecture: the ``architectures`` field of config.json.

Each entry names a module and a class rather than importing them here, so adding an
architecture is one line and loading one model never imports the others. Chapter 3 tells the
story; chapter 18 adds the other families.
"""

from __future__ import annotations

import importlib

from minisgl.models.base import BaseLLMModel

# config.json "architectures" entry -> (module under minisgl.models, class name)
MODEL_REGISTRY: dict[str, tuple[str, str]] = {
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
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
            module_name, class_name = MODEL_REGISTRY[arch]
            module = importlib.import_module(f"minisgl.models.{module_name}")
            return getattr(module, class_name)
    raise ValueError(
        f"unsupported model architecture {list(architectures)!r} (from config.json "
        f"'architectures'); supported: {', '.join(supported_architectures())}"
    )
