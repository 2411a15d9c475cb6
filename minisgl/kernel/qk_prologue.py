"""The attention prologue of one layer as one Triton kernel: qk-norm, RoPE and the K/V store.

It replaces the plain steps of :meth:`AttentionLayer.forward
<minisgl.layers.attention.AttentionLayer.forward>` (split, q_norm, k_norm, rope) and the
backend's K/V store: five kernels a layer, each moving a few kilobytes, whose launches set the
time of a batch-1 decode step. One program per (token, head) reads its slice of the qkv row
once and writes it where it goes: a query head normalised and rotated into the query tensor
(into several rows when the backend names them, as a decode cut into pieces does,
:mod:`.pieces`); a key head normalised and rotated into slot ``loc[t]`` of the key cache, its
value head copied to the same slot of the value cache. The arithmetic is that of the code it
replaces (norm and rotation in float32, each rounded once), so it agrees to the model dtype's
rounding. Full rotations of power-of-two heads only (:func:`can_qk_prologue`); the kernel
exists only where Triton does (:mod:`.triton_compat`).
"""

from __future__ import annotations

import torch

from minisgl.kernel.trials import on_gpu_16bit, ready, same_place
from minisgl.kernel.triton_compat import tl, triton


if triton is not None:
    @triton.jit
    def _norm_rope(x1, x2, w_ptr, out_ptr, cos, sin, eps, half_offsets, D: tl.constexpr,
                   HAS_NORM: tl.constexpr):
        """One head, split in its two halves ``x1``, ``x2`` (float32): normalise, rotate.

        The normalised head is rounded to ``out_ptr``'s dtype before the rotation."""
        HALF: tl.constexpr = D // 2
        OUT_TY = out_ptr.dtype.element_ty
        if HAS_NORM:
            inv_rms = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
            w1 = tl.load(w_ptr + half_offsets).to(tl.float32)
            w2 = tl.load(w_ptr + HALF + half_offsets).to(tl.float32)
            # Scaled in float32 and rounded once to the model's dtype, as the fused norm
            # kernel this one replaces did; the rotation then reads the rounded values.
            x1 = (x1 * inv_rms * w1).to(OUT_TY).to(tl.float32)
            x2 = (x2 * inv_rms * w2).to(OUT_TY).to(tl.float32)
        return x1 * cos - x2 * sin, x2 * cos + x1 * sin

    @triton.jit
    def _qk_prologue_kernel(qkv_ptr, qkv_row_stride, q_out_ptr, k_dst_ptr, v_dst_ptr,
                            dst_row_stride, loc_ptr, pos_ptr, q_w_ptr, k_w_ptr, cos_sin_ptr,
                            q_rows_ptr, eps, HQ: tl.constexpr, HKV: tl.constexpr,
                            D: tl.constexpr, HAS_NORM: tl.constexpr, HAS_LOC: tl.constexpr,
                            HAS_Q_ROWS: tl.constexpr):
        t = tl.program_id(0)
        head = tl.program_id(1)  # 0 .. HQ - 1: query heads; HQ .. HQ + HKV - 1: key heads
        HALF: tl.constexpr = D // 2
        half = tl.arange(0, HALF)
        out_ty = q_out_ptr.dtype.element_ty
        row = qkv_ptr + t.to(tl.int64) * qkv_row_stride
        # The qkv row is [q heads | k heads | v heads], D features each, so head h (query or
        # key) starts at column h * D.
        x1 = tl.load(row + head * D + half).to(tl.float32)
        x2 = tl.load(row + head * D + HALF + half).to(tl.float32)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        cos = tl.load(cos_sin_ptr + pos * D + half)  # the table's row: cos | sin, float32
        sin = tl.load(cos_sin_ptr + pos * D + HALF + half)
        if head < HQ:
            y1, y2 = _norm_rope(x1, x2, q_w_ptr, q_out_ptr, cos, sin, eps, half, D, HAS_NORM)
            if HAS_Q_ROWS:  # token t's query fills rows q_rows[t] .. q_rows[t + 1] - 1
                first_row = tl.load(q_rows_ptr + t)
                end_row = tl.load(q_rows_ptr + t + 1)
            else:
                first_row = t
                end_row = t + 1
            for q_row in range(first_row, end_row):
                dst = q_out_ptr + (q_row * HQ + head).to(tl.int64) * D
                tl.store(dst + half, y1.to(out_ty))
                tl.store(dst + HALF + half, y2.to(out_ty))
        else:
            kv_head = head - HQ
            y1, y2 = _norm_rope(x1, x2, k_w_ptr, q_out_ptr, cos, sin, eps, half, D, HAS_NORM)
            if HAS_LOC:
                slot = tl.load(loc_ptr + t).to(tl.int64)
            else:
                slot = t.to(tl.int64)
            cache_ty = k_dst_ptr.dtype.element_ty
            k_dst = k_dst_ptr + slot * dst_row_stride + kv_head * D
            tl.store(k_dst + half, y1.to(cache_ty))
            tl.store(k_dst + HALF + half, y2.to(cache_ty))
            full = tl.arange(0, D)
            value = tl.load(row + (HQ + HKV + kv_head) * D + full)
            tl.store(v_dst_ptr + slot * dst_row_stride + kv_head * D + full, value.to(cache_ty))


def launch(qkv: torch.Tensor, positions: torch.Tensor, num_qo_heads: int,
           num_kv_heads: int, head_dim: int, cos_sin_cache: torch.Tensor,
           q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
           k_dst: torch.Tensor, v_dst: torch.Tensor, loc: torch.Tensor | None,
           query_rows: torch.Tensor | None = None, num_query_rows: int = 0) -> torch.Tensor:
    """Launch the kernel; returns the queries ``[T, num_qo_heads, head_dim]``, or
    ``[num_query_rows, num_qo_heads, head_dim]`` with ``query_rows``.

    Args:
        qkv: ``[T, (Hq + 2 * Hkv) * head_dim]``, rows of unit stride.
        positions: ``[T]`` integer positions (rows of ``cos_sin_cache``).
        cos_sin_cache: ``[max_position, head_dim]`` float32, cos then sin in each row.
        q_weight, k_weight: the qk-norm scales ``[head_dim]``, or both None (no qk-norm).
        k_dst, v_dst: ``[N, Hkv, head_dim]`` where keys and values go: the pool's caches of
            this layer, or new ``[T, Hkv, head_dim]`` tensors.
        loc: ``[T]`` int64, the row of ``k_dst``/``v_dst`` of each token; None for row ``t``.
        query_rows: ``[T + 1]`` int32, ascending: token ``t``'s query is written to rows
            ``query_rows[t] .. query_rows[t + 1] - 1``; None for row ``t``. Rows no token
            claims are left unwritten.
    """
    assert triton is not None, "call can_qk_prologue() first"
    num_tokens = qkv.shape[0]
    num_rows = num_query_rows if query_rows is not None else num_tokens
    q = torch.empty(num_rows, num_qo_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    has_norm = q_weight is not None
    grid = (num_tokens, num_qo_heads + num_kv_heads)
    _qk_prologue_kernel[grid](
        qkv, qkv.stride(0), q, k_dst, v_dst, k_dst.stride(0),
        loc if loc is not None else positions, positions,
        q_weight if has_norm else qkv, k_weight if has_norm else qkv, cos_sin_cache,
        query_rows if query_rows is not None else positions, eps,
        HQ=num_qo_heads, HKV=num_kv_heads, D=head_dim, HAS_NORM=has_norm,
        HAS_LOC=loc is not None, HAS_Q_ROWS=query_rows is not None, num_warps=1)
    return q


# Where the backend wants the new keys, values and queries: the layers' ``KVDestination``, in
# launch()'s order: k_cache and v_cache [slots, Hkv, head_dim], loc [T] int64, query_rows
# ([T + 1] int32, or None for row t) and num_query_rows.
Destination = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, int]


def can_qk_prologue(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                    head_dim: int, norm_weights: tuple[torch.Tensor, torch.Tensor] | None
                    ) -> bool:
    """Whether :func:`qk_prologue` can take an attention layer's call: whole heads of a
    power-of-two size (``cos_sin_cache`` [max_position, head_dim], float32), each qkv row of
    unit stride."""
    if not on_gpu_16bit(qkv, "qk_prologue") or qkv.shape[0] == 0:
        return False
    if head_dim & (head_dim - 1) or head_dim < 32 or qkv.dim() != 2 or qkv.stride(1) != 1:
        return False
    if (cos_sin_cache.shape[1] != head_dim or cos_sin_cache.dtype != torch.float32
            or not cos_sin_cache.is_contiguous() or cos_sin_cache.device != qkv.device):
        return False
    if (positions.dim() != 1 or positions.shape[0] != qkv.shape[0]
            or not positions.is_contiguous() or positions.device != qkv.device):
        return False
    if norm_weights is not None and any(not same_place(w, qkv) or w.shape != (head_dim,)
                                        or not w.is_contiguous() for w in norm_weights):
        return False
    return ready("qk_prologue", qkv, _trial_qk_prologue)


def can_store_into(k_cache: torch.Tensor, v_cache: torch.Tensor, head_dim: int) -> bool:
    """Whether the kernel can write into these caches: ``[slots, heads, head_dim]``,
    unit-stride heads, the same slot stride for keys and values."""
    return all(t.is_cuda and t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == head_dim
               and t.stride(0) == k_cache.stride(0) for t in (k_cache, v_cache))


def qk_prologue(qkv: torch.Tensor, positions: torch.Tensor, num_qo_heads: int,
                num_kv_heads: int, head_dim: int, cos_sin_cache: torch.Tensor,
                norm_weights: tuple[torch.Tensor, torch.Tensor] | None, eps: float,
                kv_dst: Destination | None
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Split ``qkv``, normalise and rotate q and k, and put k and v where they go: one kernel.

    With ``kv_dst`` (and caches the kernel can write) the keys and values go into the pool,
    the queries into the rows it names, and ``(q, None, None)`` is returned; otherwise the keys
    and values come back as new ``[T, num_kv_heads, head_dim]`` tensors.
    """
    q_weight, k_weight = norm_weights if norm_weights is not None else (None, None)
    if kv_dst is not None and can_store_into(kv_dst[0], kv_dst[1], head_dim):
        return launch(qkv, positions, num_qo_heads, num_kv_heads, head_dim, cos_sin_cache,
                      q_weight, k_weight, eps, *kv_dst), None, None
    k, v = torch.empty(2, qkv.shape[0], num_kv_heads, head_dim, dtype=qkv.dtype,
                       device=qkv.device).unbind(0)
    q = launch(qkv, positions, num_qo_heads, num_kv_heads, head_dim, cos_sin_cache, q_weight,
               k_weight, eps, k, v, None)
    return q, k, v


def _trial_qk_prologue(device: torch.device, dtype: torch.dtype) -> None:
    qkv = torch.zeros(2, 3 * 64, dtype=dtype, device=device)
    cache = torch.zeros(4, 64, dtype=torch.float32, device=device)
    positions = torch.zeros(2, dtype=torch.int64, device=device)
    weight = torch.ones(64, dtype=dtype, device=device)
    k, v = torch.empty(2, 2, 1, 64, dtype=dtype, device=device).unbind(0)
    for norm_weight in (weight, None):  # with qk-norm (Qwen3) and without (Llama, Qwen2)
        launch(qkv, positions, 1, 1, 64, cache, norm_weight, norm_weight, 1e-6, k, v, None)
