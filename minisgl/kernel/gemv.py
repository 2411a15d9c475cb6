"""The linear layers' product on a GPU: one Triton kernel for one row, float32 logits from cuBLAS.

Both replace ``F.linear(x, weight).to(out_dtype)`` in :func:`minisgl.layers.linear.matmul`.
At batch 1 every projection multiplies one row ``x`` ``[1, K]`` by ``W`` ``[N, K]``, bound by
reading ``W`` once; for some shapes cuBLAS reads it at a third of the bandwidth or less (on the
H200, Qwen3-0.6B's 1,024 x 2,048 output projection took 12.4 µs where its 4 MiB take 1). Here
each program streams its own ``BLOCK_N`` rows of ``W``, ``BLOCK_K`` columns at a time, sums in
float32 and writes its outputs once: the matrix is read exactly once, nothing is reduced
across programs. The LM head's float32 logits come from cuBLAS's float32 sums directly
(``torch.mm``'s ``out_dtype``): no rounding, no second pass over ``[T, vocab]``.
The Triton kernel exists only where Triton does (:mod:`.triton_compat`).
"""

from __future__ import annotations

import torch

from minisgl.kernel.trials import on_gpu_16bit, ready, same_place
from minisgl.kernel.triton_compat import tl, triton

# Measured on the H200 for Qwen3-0.6B's projections (N 1,024 to 6,144, K 1,024 to 3,072):
# 16 rows of 512 columns per step, four warps, was the fastest of six tilings for each.
BLOCK_N = 16
BLOCK_K = 512
NUM_WARPS = 4

if triton is not None:
    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        # K is a compile-time constant: a model has three or four, each compiled once.
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * K  # int64: an LM head has N * K > 2**31
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            col_ok = cols < K
            w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            x = tl.load(x_ptr + cols, mask=col_ok, other=0.0)
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=row_ok)


def gemv(x: torch.Tensor, weight: torch.Tensor,
         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ weight.T`` for one row: ``x`` ``[1, K]``, ``weight`` ``[N, K]``, both contiguous.

    Returns a new ``[1, N]`` tensor of ``out_dtype`` (default ``x``'s): the sum is kept in
    float32 and rounded once, if at all.
    """
    assert triton is not None, "call can_gemv() first"
    n, k = weight.shape
    y = torch.empty(1, n, dtype=out_dtype or x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, BLOCK_N),)](x, weight, y, n, K=k, BLOCK_N=BLOCK_N,
                                             BLOCK_K=BLOCK_K, num_warps=NUM_WARPS)
    return y


def can_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`gemv` can take ``x @ weight.T``: one row (a batch-1 decode step) on a GPU,
    in 16 bits, both operands contiguous. Larger batches stay with cuBLAS, which is as fast or
    faster from two rows on."""
    if not (on_gpu_16bit(x) and x.dim() == 2 and x.shape[0] == 1):
        return False
    if not (same_place(x, weight) and weight.dim() == 2 and x.shape[1] == weight.shape[1]
            and x.is_contiguous() and weight.is_contiguous()):
        return False
    return ready("gemv", x, _trial_gemv)


def can_mm_float32(x: torch.Tensor, out_dtype: torch.dtype | None) -> bool:
    """Whether cuBLAS can write ``x @ W.T`` in float32 from 16-bit operands on this GPU
    (``torch.mm``'s ``out_dtype``, which older versions of torch lack)."""
    return (out_dtype == torch.float32 and on_gpu_16bit(x) and x.dim() == 2
            and ready("mm_float32", x, _trial_mm_float32))


def matmul(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor | None:
    """``x @ weight.T`` in ``out_dtype`` by :func:`gemv` or float32 cuBLAS, into ``out`` when
    given; None when neither takes the call (the caller's ``F.linear`` then computes it)."""
    if can_gemv(x, weight):
        y = gemv(x, weight, out_dtype)
        return y if out is None else out.copy_(y)
    if can_mm_float32(x, out_dtype):  # float32 out of 16-bit operands
        return torch.mm(x, weight.t(), out_dtype=out_dtype, out=out)
    return None


def _trial_gemv(device: torch.device, dtype: torch.dtype) -> None:
    gemv(torch.zeros(1, 64, dtype=dtype, device=device),
         torch.zeros(3, 64, dtype=dtype, device=device))


def _trial_mm_float32(device: torch.device, dtype: torch.dtype) -> None:
    x = torch.zeros(2, 64, dtype=dtype, device=device)
    torch.mm(x, torch.zeros(3, 64, dtype=dtype, device=device).t(), out_dtype=torch.float32)
