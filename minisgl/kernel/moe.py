"""Mixture of experts on a GPU: one Triton kernel per projection, safe inside a CUDA graph.

It replaces :func:`~minisgl.moe.grouped.moe_grouped` and equals
:func:`~minisgl.moe.reference.moe_reference`. The grouped path learns each expert's row count
on the host, which a CUDA graph cannot do; here every size is fixed by ``T`` alone:
:func:`align_by_expert` sorts the (token, expert) pairs by expert on the GPU and pads each
expert's run to a multiple of ``block_m`` (room for the worst case; the used length stays a
tensor), then :func:`_expert_matmul_kernel` runs one program per (block of rows, block of
output columns): it gathers its rows, multiplies them by its block's expert with ``tl.dot``
(16-bit in, float32 sums), optionally scales them by their routing weights and scatters them
back. It runs for gate/up and for down, with the SiLU gate between; each token's top_k rows
are summed last. The kernel exists only where Triton does (:mod:`.triton_compat`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from minisgl.kernel.trials import on_gpu_16bit
from minisgl.kernel.triton_compat import tl, triton

BLOCK_N = 64
BLOCK_K = 64


def fused_available(x: torch.Tensor) -> bool:
    """True when :func:`moe_fused` can run on ``x``: a 16-bit CUDA tensor, Triton installed.

    float32 stays on the other paths: ``tl.dot`` would round float32 inputs to TF32.
    """
    return triton is not None and on_gpu_16bit(x, "moe")


@dataclass(frozen=True)
class AlignedRows:
    """The (token, expert) pairs sorted by expert, each expert's run padded to ``block_m``.

    ``rows`` [capacity]: a pair id per slot, or ``num_pairs`` for padding; ``block_expert``
    [capacity / block_m]: the expert of each block (``E`` past the end); ``num_padded`` [1]:
    how many slots are in use.
    """

    rows: torch.Tensor
    block_expert: torch.Tensor
    num_padded: torch.Tensor
    block_m: int


def align_by_expert(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedRows:
    """Lay out the pairs for the kernel using tensor operations only (no host synchronisation)."""
    flat = expert_ids.flatten()
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would ask the host for a size
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, dim=0)
    order = torch.argsort(flat, stable=True)
    sorted_expert = flat[order]
    first_of_expert = torch.cumsum(counts, dim=0) - counts
    rank = torch.arange(num_pairs, device=flat.device) - first_of_expert[sorted_expert]
    slot = (padded_end - padded)[sorted_expert] + rank
    # Worst case: every expert's run needs block_m - 1 slots of padding.
    capacity = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    rows = torch.full((capacity,), num_pairs, dtype=torch.int32, device=flat.device)
    rows.scatter_(0, slot, order.to(torch.int32))
    block_starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)
    return AlignedRows(rows, block_expert, padded_end[-1:].to(torch.int32), block_m)


if triton is not None:

    @triton.jit
    def _expert_matmul_kernel(
        a_ptr, w_ptr, c_ptr, pair_weight_ptr,
        rows_ptr, block_expert_ptr, num_padded_ptr,
        num_pairs, n_out, k_in, a_row_divisor,
        stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_cm, stride_cn,
        SCALE_BY_WEIGHT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """c[pair] = a[pair // a_row_divisor] @ w[expert].T (x pair weight) for one tile."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return  # beyond the last expert's padded run
        slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(rows_ptr + slots)
        real = pairs < num_pairs  # padding slots hold num_pairs
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        a_rows = (pairs // a_row_divisor).to(tl.int64)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :] * stride_ak
        w_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, tl.cdiv(k_in, BLOCK_K)):
            k_left = k_in - k0 * BLOCK_K
            a = tl.load(a_ptrs, mask=real[:, None] & (ks[None, :] < k_left), other=0.0)
            w = tl.load(w_ptrs, mask=(ks[:, None] < k_left) & (cols[None, :] < n_out), other=0.0)
            acc = tl.dot(a, w, acc)
            a_ptrs += BLOCK_K * stride_ak
            w_ptrs += BLOCK_K * stride_wk
        if SCALE_BY_WEIGHT:
            acc = acc * tl.load(pair_weight_ptr + pairs, mask=real, other=0.0)[:, None]
        c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=real[:, None] & (cols[None, :] < n_out))


def _expert_matmul(a: torch.Tensor, weights: torch.Tensor, aligned: AlignedRows, num_pairs: int,
                   a_row_divisor: int, pair_weights: torch.Tensor | None) -> torch.Tensor:
    """[num_pairs, out]: each pair's row of ``a`` times its expert's ``weights[e].T``."""
    n_out, k_in = weights.shape[1], weights.shape[2]
    out = torch.empty(num_pairs, n_out, dtype=a.dtype, device=a.device)
    grid = (aligned.block_expert.numel(), triton.cdiv(n_out, BLOCK_N))
    _expert_matmul_kernel[grid](
        a, weights, out, pair_weights if pair_weights is not None else out,
        aligned.rows, aligned.block_expert, aligned.num_padded,
        num_pairs, n_out, k_in, a_row_divisor,
        a.stride(0), a.stride(1), weights.stride(0), weights.stride(1), weights.stride(2),
        out.stride(0), out.stride(1),
        SCALE_BY_WEIGHT=pair_weights is not None,
        BLOCK_M=aligned.block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )
    return out


def moe_fused(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
              expert_ids: torch.Tensor, weights: torch.Tensor,
              silu_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The same sum as the reference, in two kernel launches plus the gate and the final sum.

    ``expert_ids`` and ``weights`` ([T, top_k]) are the router's choice (``Routing``);
    ``silu_and_mul`` is the layers' gate, passed in because this package sits below them.
    The caller checks :func:`fused_available` first (the MoE layer's ``fused`` path does)."""
    num_tokens, top_k = expert_ids.shape
    num_pairs = num_tokens * top_k
    # Small blocks when there are few rows (decode), larger ones for prefill.
    block_m = 16 if num_pairs <= 1024 else 64
    aligned = align_by_expert(expert_ids, gate_up.shape[0], block_m)
    hidden = silu_and_mul(_expert_matmul(x, gate_up, aligned, num_pairs, top_k, None))
    pair_weights = weights.flatten().float().contiguous()
    y = _expert_matmul(hidden, down, aligned, num_pairs, 1, pair_weights)
    return y.view(num_tokens, top_k, -1).float().sum(dim=1).to(x.dtype)
