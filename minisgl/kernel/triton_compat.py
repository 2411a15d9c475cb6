"""Triton where this build of torch has it, else ``None``.

CUDA builds of torch ship Triton; CPU-only machines do without. Kernel modules import
``triton`` and ``tl`` from here and define their kernels only when ``triton`` is not ``None``,
so the engine imports everywhere and each caller checks before it launches.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without Triton
    triton = None
    tl = None

__all__ = ["tl", "triton"]
