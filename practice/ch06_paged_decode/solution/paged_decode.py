"""Decode attention over a paged KV cache, for a whole batch (reference solution)."""

from __future__ import annotations

import torch


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 seq_slots: list[torch.Tensor]) -> torch.Tensor:
    """One decode step of attention: each request's one query over all of its keys.

    Args:
        q: ``[B, Hq, D]``, the query of each request's newest token.
        k_cache: ``[num_slots, Hkv, D]``, one layer's keys in the KV pool.
        v_cache: ``[num_slots, Hkv, D]``, its values.
        seq_slots: ``B`` 1-D int64 tensors; ``seq_slots[i]`` lists the pool slots of request
            ``i``'s tokens in position order, its newest token last (already stored).

    Returns:
        ``[B, Hq, D]`` in the dtype of ``q``.
    """
    num_qo_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[1]
    group = num_qo_heads // num_kv_heads
    out = torch.empty_like(q)
    for i, slots in enumerate(seq_slots):
        keys = k_cache[slots].float()  # [S, Hkv, D]: the request's pages, in token order
        values = v_cache[slots].float()
        # Query head h belongs to group h // group and reads KV head h // group.
        query = q[i].float().view(num_kv_heads, group, head_dim)
        scores = torch.einsum("hgd,shd->hgs", query, keys) * head_dim**-0.5
        # No causal mask: the newest token is the last key, so every key is in its past.
        probs = scores.softmax(dim=-1)
        out[i] = torch.einsum("hgs,shd->hgd", probs, values).reshape(num_qo_heads, head_dim)
    return out
