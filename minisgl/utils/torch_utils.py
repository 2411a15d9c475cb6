"""Small helpers that turn user-facing strings into torch devices and dtypes.

The command line, the ``LLM`` class and the examples all accept ``--device auto|cpu|cuda`` and
``--dtype auto|float32|bfloat16|float16``. These functions are the one place where those
strings are checked and given a meaning, so every entry point rejects a typo the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")
DTYPE_CHOICES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# Spellings that configs and users also write for the same three dtypes.
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                  "half": "float16"}


# --8<-- [start:resolve]
def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """Turn ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` into a ``torch.device``.

    ``"auto"`` picks the first CUDA GPU when one is visible and the CPU otherwise. Asking for
    CUDA on a machine without it is an error rather than a silent fallback, because the user
    would otherwise measure the wrong thing.
    """
    if isinstance(device, torch.device):
        device = str(device)
    name = device.strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available here; "
                             "use --device cpu (or auto)")
        resolved = torch.device(name)
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} requested but only "
                             f"{torch.cuda.device_count()} CUDA device(s) are visible")
        return resolved
    raise ValueError(f"unknown device {device!r}; expected one of {', '.join(DEVICE_CHOICES)} "
                     "(or cuda:N)")


def resolve_dtype(dtype: str | torch.dtype = "auto",
                  device: str | torch.device = "cpu") -> torch.dtype:
    """Turn ``"auto"``, ``"float32"``, ``"bfloat16"`` or ``"float16"`` into a ``torch.dtype``.

    ``"auto"`` means float32 on the CPU (exact comparisons with the reference, and CPUs are not
    faster in half precision) and bfloat16 on CUDA (half the memory traffic, the format the
    released checkpoints were trained in).
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPE_CHOICES.values():
            raise ValueError(f"unsupported dtype {dtype}; expected one of "
                             f"{', '.join(DTYPE_CHOICES)}")
        return dtype
    name = dtype.strip().lower()
    name = _DTYPE_ALIASES.get(name, name)
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name in DTYPE_CHOICES:
        return DTYPE_CHOICES[name]
    raise ValueError(f"unknown dtype {dtype!r}; expected one of auto, {', '.join(DTYPE_CHOICES)}")
# --8<-- [end:resolve]


# --8<-- [start:default_dtype]
@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Temporarily make ``dtype`` the dtype of newly created floating-point tensors.

    Building a model inside ``with torch.device(d), default_dtype(t):`` allocates every
    parameter directly on ``d`` in ``t``: no float32 copy on the CPU that is then converted.
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
# --8<-- [end:default_dtype]


def count_parameters(module: torch.nn.Module) -> int:
    """Number of scalars in ``module``'s parameters, each shared tensor counted once."""
    return sum(p.numel() for p in module.parameters())
