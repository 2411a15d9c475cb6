"""What every kernel of this package shares: the on/off switch, a first trial, layout checks.

Each decision looks at tensor metadata only (device, dtype, shapes, strides, alignment), never
at values, so it costs no host-device synchronisation and a CUDA graph can capture either path.
Each kernel is tried once on a tiny input the first time a call could use it (it may compile
then); a failure turns that kernel off for the process, with one warning, and its caller runs
the plain PyTorch code instead of crashing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from minisgl.utils.logger import get_logger

logger = get_logger(__name__)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)  # what the kernels are instantiated for
ALIGN_BYTES = 16  # the kernels move 16 bytes per load and store
Trial = Callable[[torch.device, torch.dtype], None]

_enabled = True
_op_errors: dict[str, str | None] = {}  # op -> None (works) or why it was turned off
_logged_dtypes: set[torch.dtype] = set()


def ready(op: str, like: torch.Tensor, trial: Trial) -> bool:
    """Whether kernel ``op`` works, running ``trial`` on a tiny input the first time.

    The trial builds or loads the kernel and catches what fails at that point (a compiler or
    library missing on this machine). It is never run inside a CUDA-graph capture: a call that
    comes first there takes the PyTorch path (the engine's warm-up run precedes its captures).
    """
    if op not in _op_errors:
        if torch.cuda.is_current_stream_capturing():
            return False
        try:
            trial(like.device, like.dtype)
        except Exception as exc:  # noqa: BLE001 - whatever fails, fall back to PyTorch
            _op_errors[op] = f"{type(exc).__name__}: {exc}"
            logger.warning("fused kernels: %s failed a first trial (%s); it runs "
                           "as PyTorch code from now on", op, _op_errors[op])
        else:
            _op_errors[op] = None
    return _op_errors[op] is None


def op_status(op: str) -> str:
    """"on", "not tried yet", or why ``op`` runs as PyTorch code."""
    if op not in _op_errors:
        return "not tried yet"
    error = _op_errors[op]
    return "on" if error is None else f"off ({error})"


def aligned(t: torch.Tensor) -> bool:
    """Last dimension contiguous, and every row/head starting on a 16-byte boundary."""
    return (t.stride(-1) == 1 and t.data_ptr() % ALIGN_BYTES == 0
            and all(s * t.element_size() % ALIGN_BYTES == 0 for s in t.stride()[:-1]))


def same_place(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.device == b.device


def on_gpu_16bit(x: torch.Tensor) -> bool:
    """The kernels are on, and ``x`` is a float16/bfloat16 CUDA tensor."""
    if not (_enabled and x.is_cuda):
        return False
    if x.dtype not in SUPPORTED_DTYPES:
        if x.dtype not in _logged_dtypes:  # once per dtype: this runs for every layer's call
            _logged_dtypes.add(x.dtype)
            logger.debug("fused kernels: none takes %s; those calls run as PyTorch code", x.dtype)
        return False
    return True


@contextlib.contextmanager
def use_fused(on: bool) -> Iterator[None]:
    """Turn the kernels on or off inside the ``with`` block (process-wide).

    ``use_fused(False)`` runs the PyTorch code on CUDA too: the reference the GPU tests compare
    the kernels with, and a way to measure what the kernels save.
    """
    global _enabled
    previous, _enabled = _enabled, on
    try:
        yield
    finally:
        _enabled = previous
