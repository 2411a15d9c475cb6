"""What every kernel of this package shares: the on/off switch, a first trial, layout checks.

Each decision looks at tensor metadata only (device, dtype, shapes, strides, alignment), never
at values, so it costs no host-device synchronisation and a CUDA graph can capture either path.
Each kernel is tried once on a tiny input the first time a call could use it (it may compile
then); a failure turns that kernel off for the process, with one warning, and its caller runs
the plain PyTorch code instead of crashing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator

import torch

from minisgl.utils.logger import get_logger

logger = get_logger(__name__)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)  # what the kernels are instantiated for
ALIGN_BYTES = 16  # the kernels move 16 bytes per load and store
Trial = Callable[[torch.device, torch.dtype], None]

# The kernels in the order chapter 20 adds them; use_fused can turn on any subset.
STEPS = (
    "flashinfer",  # RMSNorm, RoPE and SiLU-and-multiply, one FlashInfer kernel each
    "qk_prologue",  # split, qk-norm, RoPE and the K/V store of an attention layer, one kernel
    "gemv",  # the one-row matrix kernel at batch 1, and float32 logits from cuBLAS
    "gated",  # SiLU-and-multiply folded into the down projection's read
    "normed",  # a decoder layer's add-and-norm folded into the next projection's read
    # Decode cut into pieces and merged by log-sum-exp, for large batches. Off: measured, it
    # did not pay (benchmark/pieces_cutover.py, recorded in chapter 20).
    "pieces",
    "moe",  # the mixture of experts' grouped kernels
    # Hopper's programmatic dependent launch for the row kernel: its programs start reading
    # their weights while the kernel before it finishes. Off: measured, it did not pay.
    "pdl",
)
# What use_fused(True) and a new process turn on: the steps that paid when measured.
DEFAULT_STEPS = frozenset(STEPS) - {"pieces", "pdl"}
_enabled: frozenset[str] = DEFAULT_STEPS
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


def enabled(step: str) -> bool:
    """Whether kernel ``step`` (one of :data:`STEPS`) is on."""
    assert step in STEPS, step
    return step in _enabled


def on_gpu_16bit(x: torch.Tensor, step: str) -> bool:
    """Kernel ``step`` is on, and ``x`` is a float16/bfloat16 CUDA tensor."""
    if not (enabled(step) and x.is_cuda):
        return False
    if x.dtype not in SUPPORTED_DTYPES:
        if x.dtype not in _logged_dtypes:  # once per dtype: this runs for every layer's call
            _logged_dtypes.add(x.dtype)
            logger.debug("fused kernels: none takes %s; those calls run as PyTorch code", x.dtype)
        return False
    return True


@contextlib.contextmanager
def use_fused(on: bool | Collection[str]) -> Iterator[None]:
    """Turn the kernels on or off inside the ``with`` block (process-wide): the default ones
    (:data:`DEFAULT_STEPS`), none, or only the :data:`STEPS` named.

    ``use_fused(False)`` runs the PyTorch code on CUDA too: the reference the GPU tests compare
    the kernels with, and a way to measure what the kernels save; a growing subset measures
    what each one adds (benchmark/kernel_steps.py). Decide before an engine captures its
    graphs: a replay runs what was captured.
    """
    global _enabled
    wanted = DEFAULT_STEPS if on is True else frozenset(() if on is False else on)
    if unknown := wanted - set(STEPS):
        raise ValueError(f"unknown kernel steps {sorted(unknown)}; known: {', '.join(STEPS)}")
    previous, _enabled = _enabled, wanted
    try:
        yield
    finally:
        _enabled = previous
