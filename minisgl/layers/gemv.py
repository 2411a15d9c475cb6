"""One row times a weight matrix: the projections of a batch-1 decode step as one Triton kernel.

At batch 1 every projection of a decode step multiplies one row ``x`` ``[1, K]`` by a weight
``W`` ``[N, K]``: a matrix-vector product, bound by reading ``W`` once. cuBLAS picks its kernels
for matrix products; for some of these shapes its choice reads the weights at a third of the
bandwidth or less (on the H200, Qwen3-0.6B's output projection, 1,024 x 2,048, took 12.4 µs
where reading its 4 MiB takes 1). Here each program owns ``BLOCK_N`` rows of ``W``: it streams
them ``BLOCK_K`` columns at a time, multiplies by the matching slice of ``x`` and sums in
float32, then writes its ``BLOCK_N`` outputs once. Every program reads only its own rows, so
the whole matrix is read exactly once and nothing is reduced across programs.

The kernel exists only where Triton does (:mod:`minisgl.utils.triton_compat`);
:func:`minisgl.layers.fused.can_gemv` decides which calls come here.
"""

from __future__ import annotations

import torch

from minisgl.utils.triton_compat import tl, triton

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
    assert triton is not None, "call minisgl.layers.fused.can_gemv() first"
    n, k = weight.shape
    y = torch.empty(1, n, dtype=out_dtype or x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, BLOCK_N),)](x, weight, y, n, K=k, BLOCK_N=BLOCK_N,
                                             BLOCK_K=BLOCK_K, num_warps=NUM_WARPS)
    return y
