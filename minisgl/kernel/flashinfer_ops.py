"""FlashInfer's one-kernel RMSNorm, RoPE and SiLU-and-multiply, for the layers' plain code.

In PyTorch every operation is a kernel with a launch and a pass over memory: in bfloat16
RMSNorm (:meth:`RMSNorm.forward <minisgl.layers.norm.RMSNorm.forward>`) is eight kernels, RoPE
(:meth:`RotaryEmbedding.forward <minisgl.layers.rotary.RotaryEmbedding.forward>`) twenty, the
residual add and :func:`~minisgl.layers.activation.silu_and_mul` three more. FlashInfer does
each as one kernel. float32 stays on PyTorch: FlashInfer builds these for 16 bits only.
``flashinfer`` is imported at the first CUDA tensor, so everything runs on machines without it.
Two kernels work in place (the residual-add norm and RoPE); callers use the returned tensors.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from minisgl.kernel.trials import ALIGN_BYTES, aligned, on_gpu_16bit, ready, same_place
from minisgl.utils.logger import get_logger

logger = get_logger(__name__)

ROPE_HEAD_DIMS = (64, 128, 256, 512)  # head sizes the rotary kernel is specialised for
OPS = ("rmsnorm", "fused_add_rmsnorm", "rope", "silu_and_mul")

_kernels: SimpleNamespace | None = None
import_error: str | None = None  # why flashinfer could not be imported, once tried and failed


def available(x: torch.Tensor) -> bool:
    """True when ``x`` may go through FlashInfer: on CUDA, float16/bfloat16, flashinfer present.

    The per-operation checks start here and add what their kernel needs of shapes and strides.
    """
    return on_gpu_16bit(x, "flashinfer") and _load() is not None


def _load() -> SimpleNamespace | None:
    """Import FlashInfer's kernels once; None (logged at debug level) when that fails."""
    global _kernels, import_error
    if _kernels is None and import_error is None:  # not tried yet
        try:
            from flashinfer.activation import silu_and_mul
            from flashinfer.norm import fused_add_rmsnorm, rmsnorm
            from flashinfer.rope import apply_rope_with_cos_sin_cache_inplace
        except Exception as exc:  # noqa: BLE001 - ImportError, or a broken install
            import_error = f"{type(exc).__name__}: {exc}"
            logger.debug("fused kernels: flashinfer is not importable (%s); norms, RoPE and "
                         "SiLU run as PyTorch code", import_error)
        else:
            _kernels = SimpleNamespace(
                rmsnorm=rmsnorm, fused_add_rmsnorm=fused_add_rmsnorm,
                rope=apply_rope_with_cos_sin_cache_inplace, silu_and_mul=silu_and_mul)
    return _kernels


# ------------------------------------------------------------------------------- RMSNorm

def can_rmsnorm(x: torch.Tensor, weight: torch.Tensor,
                residual: torch.Tensor | None = None) -> bool:
    """Whether :func:`rmsnorm` can take this call.

    Plain form: ``x`` [T, hidden] or [T, heads, head_dim] (qk-norm; any row and head strides,
    so the q and k slices of the fused qkv output need no copy). Residual form: ``x`` and
    ``residual`` two distinct [T, hidden] tensors.
    """
    if not available(x) or x.numel() == 0 or not same_place(x, weight):
        return False
    if weight.shape != (x.shape[-1],) or not aligned(weight) or not aligned(x):
        return False
    if residual is None:
        return x.dim() in (2, 3) and ready("rmsnorm", x, _trial_rmsnorm)
    return (x.dim() == 2 and residual.shape == x.shape and same_place(x, residual)
            and aligned(residual) and residual.data_ptr() != x.data_ptr()
            and ready("fused_add_rmsnorm", x, _trial_fused_add_rmsnorm))


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            residual: torch.Tensor | None = None
            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """RMSNorm as one kernel: :meth:`RMSNorm.forward <minisgl.layers.norm.RMSNorm.forward>`;
    None where :func:`can_rmsnorm` refuses the call.

    The plain form writes a new tensor. The residual form works IN PLACE: ``residual``
    becomes ``x + residual``, then ``x`` becomes its normalised value; both are returned.
    """
    if not can_rmsnorm(x, weight, residual):
        return None
    assert _kernels is not None  # can_rmsnorm loaded them
    if residual is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        return _kernels.rmsnorm(x, weight, eps=eps, out=out)
    _kernels.fused_add_rmsnorm(x, residual, weight, eps=eps)
    return x, residual


# --------------------------------------------------------------------------------- RoPE

def can_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
             cos_sin_cache: torch.Tensor, head_dim: int) -> bool:
    """Whether :func:`rope_inplace` can take this call.

    The kernel exists for head sizes 64, 128, 256 and 512; it reads ``cos_sin_cache``
    [max_position, rotary_dim] in float32, cos in the first half of a row and sin in the second,
    and moves features in vectors of ``max(16 bytes, head_dim / 32)``, so a partial rotation
    (``rotary_dim < head_dim``) must cover whole vectors in each half.
    """
    if head_dim not in ROPE_HEAD_DIMS or not available(q) or not same_place(q, k) or not q.shape[0]:
        return False
    vector = max(ALIGN_BYTES // q.element_size(), head_dim // 32)
    if cos_sin_cache.dim() != 2 or (cos_sin_cache.shape[1] // 2) % vector != 0:
        return False
    if (cos_sin_cache.dtype != torch.float32 or cos_sin_cache.device != q.device
            or not cos_sin_cache.is_contiguous()):
        return False
    if (positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64)
            or positions.device != q.device or not positions.is_contiguous()
            or not q.shape[0] == k.shape[0] == positions.shape[0]):
        return False
    if not (_heads_aligned(q, head_dim) and _heads_aligned(k, head_dim)):
        return False
    return ready("rope", q, _trial_rope)


def _heads_aligned(t: torch.Tensor, head_dim: int) -> bool:
    """``t`` seen as [T, heads, head_dim] (as the kernel sees it) is aligned."""
    if t.stride(-1) != 1 or t.shape[-1] % head_dim != 0:
        return False
    try:
        return aligned(t.view(t.shape[0], -1, head_dim))
    except RuntimeError:  # a layout that cannot be viewed per head without a copy
        return False


def rope_inplace(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 cos_sin_cache: torch.Tensor, head_dim: int) -> bool:
    """Rotate ``q`` and ``k`` ([T, H*D] or [T, H, D]) IN PLACE, pairs (i, i + rotary_dim/2);
    False (nothing done) where :func:`can_rope` refuses the call."""
    if not can_rope(positions, q, k, cos_sin_cache, head_dim):
        return False
    assert _kernels is not None  # can_rope loaded them
    # is_neox=True is the "rotate half" pairing of Llama/Qwen checkpoints; False would pair
    # neighbours (2i, 2i + 1).
    _kernels.rope(positions, q, k, head_dim, cos_sin_cache, is_neox=True)
    return True


# ------------------------------------------------------------------------ SiLU and multiply

def can_silu_and_mul(x: torch.Tensor) -> bool:
    """Whether :func:`silu_and_mul` can take ``x`` [..., 2 * d]: contiguous, whole vectors in d."""
    if not available(x) or x.numel() == 0 or not x.is_contiguous():
        return False
    if x.data_ptr() % ALIGN_BYTES or (x.shape[-1] // 2) % (ALIGN_BYTES // x.element_size()):
        return False
    return ready("silu_and_mul", x, _trial_silu_and_mul)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """``silu(x[..., :d]) * x[..., d:]`` as one kernel, into a new tensor; None where
    :func:`can_silu_and_mul` refuses the call."""
    if not can_silu_and_mul(x):
        return None
    assert _kernels is not None  # can_silu_and_mul loaded them
    return _kernels.silu_and_mul(x)


# ---------------------------------------------------------------------- trials

def _trial_rmsnorm(device: torch.device, dtype: torch.dtype) -> None:
    assert _kernels is not None
    weight = torch.ones(64, dtype=dtype, device=device)
    for shape in ((2, 64), (2, 2, 64)):  # the hidden-state and the per-head (qk-norm) forms
        x = torch.zeros(shape, dtype=dtype, device=device)
        _kernels.rmsnorm(x, weight, eps=1e-6, out=torch.empty_like(x))


def _trial_fused_add_rmsnorm(device: torch.device, dtype: torch.dtype) -> None:
    assert _kernels is not None
    x, residual = torch.zeros(2, 2, 64, dtype=dtype, device=device).unbind(0)
    _kernels.fused_add_rmsnorm(x, residual, torch.ones(64, dtype=dtype, device=device), eps=1e-6)


def _trial_rope(device: torch.device, dtype: torch.dtype) -> None:
    assert _kernels is not None
    q = torch.zeros(2, 2 * 64, dtype=dtype, device=device)
    k = torch.zeros(2, 64, dtype=dtype, device=device)
    cache = torch.zeros(4, 64, dtype=torch.float32, device=device)
    positions = torch.zeros(2, dtype=torch.int64, device=device)
    _kernels.rope(positions, q, k, 64, cache, is_neox=True)


def _trial_silu_and_mul(device: torch.device, dtype: torch.dtype) -> None:
    assert _kernels is not None
    _kernels.silu_and_mul(torch.zeros(2, 128, dtype=dtype, device=device))
