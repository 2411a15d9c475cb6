"""Decode attention over a paged KV cache, for a whole batch.

Write `paged_decode`. See README.md for the rules and hints;
`python practice/judge.py ch06_paged_decode` checks your work.
"""

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
    raise NotImplementedError("paged_decode: gather each request's K/V at its slots, then attend")
