"""The linear layers' product on a GPU: one Triton kernel for one row, float32 logits from cuBLAS.

Both replace ``F.linear(x, weight).to(out_dtype)`` in :func:`minisgl.layers.linear.matmul`.
At batch 1 every projection multiplies one row ``x`` ``[1, K]`` by ``W`` ``[N, K]``, bound by
reading ``W`` once; for some shapes cuBLAS reads it well below the memory's bandwidth
(``benchmark/gemv_tiling.py`` puts each product's time beside its bytes' read time). Here
each program streams its own ``BLOCK_N`` rows of ``W``, ``BLOCK_K`` columns at a time, sums in
float32 and writes its outputs once: the matrix is read exactly once, nothing is reduced
across programs.

Two passes of their own fold into the read of ``x``, one kernel instead of two each: with
``gated`` the kernel reads ``x = [gate | up]`` (width ``2K``) and multiplies
``silu(gate) * up`` (the MLP's activation, into the down projection); with ``norm`` it
multiplies ``rmsnorm(x + residual)`` (a decoder layer's add-and-norm, into the projection
after it). The LM head's float32 logits above one row come from cuBLAS's float32 sums directly
(``torch.mm``'s ``out_dtype``): no rounding, no second pass over ``[T, vocab]``.
The Triton kernel exists only where Triton does (:mod:`.triton_compat`).
"""

from __future__ import annotations

import torch

from minisgl.kernel.trials import enabled, on_gpu_16bit, ready, same_place
from minisgl.kernel.triton_compat import tl, triton


# Two rows per program, 1,024 columns per step, four warps: few rows per program make more
# programs than SMs, long rows make coalesced reads. benchmark/gemv_tiling.py times every tiling
# of a model's batch-1 products with the weights out of L2, to choose this on a new GPU.
TILES = (2, 1024, 4)  # (BLOCK_N, BLOCK_K, num_warps)


if triton is not None:
    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, res_ptr, norm_ptr, res_out_ptr, eps,
                     K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GATED: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr,
                     PDL: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        # K is a compile-time constant: a model has three or four, each compiled once.
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * K  # int64: an LM head has N * K > 2**31
        first = tl.arange(0, BLOCK_K)
        w_first = tl.load(w_rows + first[None, :], mask=row_ok[:, None] & (first < K)[None, :],
                          other=0.0)
        if PDL:  # launched early: the weights are no kernel's output, x and residual are
            tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start as SMs free up
            tl.extra.cuda.gdc_wait()  # until the kernel before has finished and is visible
        if NORM:  # every program first takes 1/rms of the whole row: K numbers, read from L2
            squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
            for start in range(0, K, BLOCK_K):
                cols = start + tl.arange(0, BLOCK_K)
                s = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
                if HAS_RES:
                    s += tl.load(res_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
                squares += s * s
            inv_rms = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for start in tl.static_range(0, K, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            col_ok = cols < K
            if start == 0:
                w = w_first
            else:
                w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                            other=0.0)
            x = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            if GATED:  # x is silu(gate) * up, rounded as the activation kernel would store it
                up = tl.load(x_ptr + K + cols, mask=col_ok, other=0.0).to(tl.float32)
                x = (x * tl.sigmoid(x) * up).to(x_ptr.dtype.element_ty).to(tl.float32)
            if NORM:  # x is rmsnorm(x + residual), rounded as the norm kernel would store it
                if HAS_RES:
                    x += tl.load(res_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
                    if tl.program_id(0) == 0:  # the new residual: one program writes it,
                        # into a tensor no program reads
                        tl.store(res_out_ptr + cols, x.to(res_out_ptr.dtype.element_ty),
                                 mask=col_ok)
                scale = tl.load(norm_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
                x = (x * inv_rms * scale).to(x_ptr.dtype.element_ty).to(tl.float32)
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=row_ok)


def gemv(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None,
         gated: bool = False, tiles: tuple[int, int, int] = TILES) -> torch.Tensor:
    """``x @ weight.T`` for one row: ``x`` ``[1, K]``, ``weight`` ``[N, K]``, both contiguous.

    With ``gated``, ``x`` is ``[1, 2K]`` = ``[gate | up]`` and the row multiplied is
    ``silu(gate) * up``. Returns a new ``[1, N]`` tensor of ``out_dtype`` (default ``x``'s):
    the sum is kept in float32 and rounded once, if at all. ``tiles`` is
    ``(BLOCK_N, BLOCK_K, num_warps)``.
    """
    y = torch.empty(1, weight.shape[0], dtype=out_dtype or x.dtype, device=x.device)
    _launch(x, weight, y, gated=gated, tiles=tiles)
    return y


def normed_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                eps: float, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rmsnorm(x + residual) @ weight.T`` for one row, and the new residual ``x + residual``
    (``x`` itself when ``residual`` is None): a decoder layer's add-and-norm folded into the
    read of the projection after it."""
    y = torch.empty(1, weight.shape[0], dtype=x.dtype, device=x.device)
    new_residual = x if residual is None else torch.empty_like(x)
    _launch(x, weight, y, norm=(residual, norm_weight, eps, new_residual))
    return y, new_residual


def _launch(x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, gated: bool = False,
            norm: tuple[torch.Tensor | None, torch.Tensor, float, torch.Tensor] | None = None,
            tiles: tuple[int, int, int] = TILES) -> None:
    assert triton is not None, "call can_gemv() first"
    n, k = weight.shape
    block_n, block_k, num_warps = tiles
    residual, norm_weight, eps, res_out = norm if norm is not None else (None, None, 0.0, None)
    pdl = enabled("pdl") and ready("pdl", x, _trial_pdl)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, y, n, residual, norm_weight, res_out, eps, K=k, BLOCK_N=block_n,
        BLOCK_K=block_k, GATED=gated, NORM=norm is not None, HAS_RES=residual is not None,
        PDL=pdl, num_warps=num_warps, **({"launch_pdl": True} if pdl else {}))


def can_gemv(x: torch.Tensor, weight: torch.Tensor, gated: bool = False,
             step: str = "gemv") -> bool:
    """Whether :func:`gemv` can take ``x @ weight.T``: one row (a batch-1 decode step) on a GPU,
    in 16 bits, both operands contiguous, kernel ``step`` on (and the plain kernel with it).
    Larger batches stay with cuBLAS, which is as fast or faster from two rows on."""
    if not (on_gpu_16bit(x, step) and enabled("gemv") and x.dim() == 2 and x.shape[0] == 1):
        return False
    width = weight.shape[-1] * (2 if gated else 1)
    if not (same_place(x, weight) and weight.dim() == 2 and x.shape[1] == width
            and x.is_contiguous() and weight.is_contiguous()):
        return False
    return ready("gemv", x, _trial_gemv)


def can_mm_float32(x: torch.Tensor, out_dtype: torch.dtype | None) -> bool:
    """Whether cuBLAS can write ``x @ W.T`` in float32 from 16-bit operands on this GPU
    (``torch.mm``'s ``out_dtype``, which older versions of torch lack)."""
    return (out_dtype == torch.float32 and on_gpu_16bit(x, "gemv") and x.dim() == 2
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


def gated_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``(silu(gate) * up) @ weight.T`` for ``x = [gate | up]`` by one :func:`gemv`; None when
    it cannot take the call (more than one row, or not on a GPU)."""
    return gemv(x, weight, gated=True) if can_gemv(x, weight, True, "gated") else None


def normed_matmul(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                  eps: float, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`normed_gemv` where it can take the call (one row on a GPU); None elsewhere."""
    if not (can_gemv(x, weight, step="normed") and same_place(x, norm_weight)
            and norm_weight.is_contiguous()):
        return None
    if residual is not None and not (same_place(x, residual) and residual.shape == x.shape
                                     and residual.is_contiguous()):
        return None
    return normed_gemv(x, residual, norm_weight, eps, weight)


def _trial_gemv(device: torch.device, dtype: torch.dtype) -> None:
    gemv(torch.zeros(1, 64, dtype=dtype, device=device),
         torch.zeros(3, 64, dtype=dtype, device=device))


def _trial_pdl(device: torch.device, dtype: torch.dtype) -> None:
    """Programmatic dependent launch needs a Hopper GPU or later and a Triton that has it."""
    if torch.cuda.get_device_capability(device)[0] < 9:
        raise RuntimeError("programmatic dependent launch needs compute capability 9.0+")
    x, weight = torch.zeros(1, 64, dtype=dtype, device=device), torch.ones(3, 64, dtype=dtype,
                                                                             device=device)
    y = torch.empty(1, 3, dtype=dtype, device=device)
    _gemv_kernel[(1,)](x, weight, y, 3, None, None, None, 0.0, K=64, BLOCK_N=4, BLOCK_K=64,
                       GATED=False, NORM=False, HAS_RES=False, PDL=True, num_warps=1,
                       launch_pdl=True)


def _trial_mm_float32(device: torch.device, dtype: torch.dtype) -> None:
    x = torch.zeros(2, 64, dtype=dtype, device=device)
    torch.mm(x, torch.zeros(3, 64, dtype=dtype, device=device).t(), out_dtype=torch.float32)
