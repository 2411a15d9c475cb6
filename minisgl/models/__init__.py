"""Model configurations and the networks themselves.

``minisgl.models.config`` turns a checkpoint's ``config.json`` into a validated
:class:`~minisgl.models.config.ModelConfig`; every shape in the engine is read from it.
:func:`load_model` goes from a checkpoint to a ready model in one call.

This file imports nothing heavy at module level: processes that only need a config (the
tokenizer and the server processes) import ``minisgl.models.config`` and must not
pay for torch and safetensors on the way.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from minisgl.models.base import BaseLLMModel


def load_model(path_or_id: str | os.PathLike[str], device: str | torch.device = "auto",
               dtype: str | torch.dtype = "auto", progress: bool = True) -> BaseLLMModel:
    """Load a checkpoint (local directory or hub id) as a ready-to-run model in eval mode.

    ``device`` is ``auto|cpu|cuda`` and ``dtype`` ``auto|float32|bfloat16|float16``
    (auto: float32 on CPU, bfloat16 on CUDA). The steps: find the directory, read its config,
    pick the class the config's ``architectures`` names, build it, load the weights.
    """
    import torch

    from minisgl.models.config import ModelConfig
    from minisgl.models.register import get_model_class
    from minisgl.models.weight import load_weights
    from minisgl.utils.hf import resolve_model_path
    from minisgl.utils.torch_utils import default_dtype, resolve_device, resolve_dtype

    model_dir = resolve_model_path(path_or_id)
    config = ModelConfig.from_pretrained(model_dir)
    model_cls = get_model_class(config.architectures)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    # Build directly on the target device in the target dtype: each parameter is allocated
    # once, uninitialised, where it will live, and the loader fills it in place.
    with torch.device(torch_device), default_dtype(torch_dtype):
        model = model_cls(config)
    load_weights(model, model_dir, progress=progress)
    return model.eval()
