"""Paged attention in plain PyTorch: runs anywhere, and is the reference for the fused kernels.

It *gathers* each request's keys and values out of the pages into a contiguous copy (the pool's
``gather_kv``) and computes ordinary attention on it; FlashInfer reads the pages in place, with
the same result, which the tests check. A prefill (or mixed) batch attends request by request
with chapter 3's :func:`~minisgl.layers.attention.causal_attention`, its mask shifted by the
cached length; a decode batch is one computation over a padded ``[B, max_len]`` block
(:func:`paged_decode_attention`). Scores and softmax are float32 whatever the cache dtype.
Chapter 6 tells the story.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from minisgl.attention.base import AttnMetadata, BaseAttnBackend, BatchLayout, total_lens
from minisgl.attention.utils import indptr_of
from minisgl.kvcache.page_table import slots_of
from minisgl.layers.attention import causal_attention
from minisgl.utils.torch_utils import host_to_device


@dataclass
class TorchNativeMetadata(AttnMetadata):
    """Where each request's keys are, as token slots.

    Attributes:
        kv_slots: prefill batches only: ``[sum(total_len)]`` int64, the slots of every
            request's tokens ``0 .. total_len - 1``, requests concatenated.
        kv_indptr: request ``i``'s slots are ``kv_slots[kv_indptr[i]:kv_indptr[i + 1]]``.
        qo_indptr: request ``i``'s new tokens are rows ``qo_indptr[i]:qo_indptr[i + 1]`` of q.
        slot_table: decode batches only: ``[B, max_len]`` slots, padded.
        slot_valid: decode batches only: ``[B, max_len]``, False on padding.
    """

    kv_slots: torch.Tensor | None = None
    kv_indptr: list[int] | None = None
    qo_indptr: list[int] | None = None
    slot_table: torch.Tensor | None = None
    slot_valid: torch.Tensor | None = None


class TorchNativeBackend(BaseAttnBackend):
    """Gather the pages, then attend: paged attention for the CPU, and a reference on the GPU."""

    name = "torch"

    def _plan(self, layout: BatchLayout, fields: dict[str, Any],
              static: bool) -> TorchNativeMetadata:
        totals = total_lens(layout)
        if layout.is_decode:
            # Every request's slots side by side, [B, max_len] (prepare checked that its row
            # maps them). Padding points at the request's position 0, so every entry is a legal
            # index and the padding only needs a mask.
            columns = np.arange(max(totals))
            valid = columns[None, :] < np.asarray(totals)[:, None]
            slot_table = slots_of(self.page_table.page_ids, np.asarray(layout.rows)[:, None],
                                  np.where(valid, columns[None, :], 0), self.page_size)
            return TorchNativeMetadata(
                **fields, slot_table=host_to_device(torch.from_numpy(slot_table), self.device),
                slot_valid=host_to_device(torch.from_numpy(valid), self.device))
        # Every key a request attends over: positions 0 .. total_len - 1 of its row.
        kv_slots = self.page_table.batch_token_slots(layout.rows, [0] * layout.size, totals)
        return TorchNativeMetadata(**fields, kv_slots=kv_slots, kv_indptr=indptr_of(totals),
                                   qo_indptr=indptr_of(layout.new_lens))

    def _attend(self, q: torch.Tensor, layer_id: int, meta: AttnMetadata) -> torch.Tensor:
        assert isinstance(meta, TorchNativeMetadata)
        k_cache, v_cache = self.kv_pool.kv_cache(layer_id)
        if meta.slot_table is not None:
            return paged_decode_attention(q, k_cache, v_cache, meta.slot_table, meta.slot_valid)
        return self._ragged_prefill(q, k_cache, v_cache, meta)

    @staticmethod
    def _ragged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: TorchNativeMetadata) -> torch.Tensor:
        """Each request's new queries over its whole sequence, one request at a time."""
        assert meta.layout is not None and meta.kv_slots is not None and meta.kv_indptr is not None
        assert meta.qo_indptr is not None
        # One gather for the whole batch: the pages of every request, copied out in order.
        keys, values = k_cache[meta.kv_slots], v_cache[meta.kv_slots]
        qo, kv = meta.qo_indptr, meta.kv_indptr
        outputs = [
            causal_attention(q[qo[i]:qo[i + 1]], keys[kv[i]:kv[i + 1]],
                             values[kv[i]:kv[i + 1]], num_cached=cached)
            for i, cached in enumerate(meta.layout.cached_lens)
        ]
        return torch.cat(outputs)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slot_table: torch.Tensor, slot_valid: torch.Tensor) -> torch.Tensor:
    """One query per request over that request's keys, the whole batch in one computation.

    Args:
        q: ``[B, Hq, D]``, the one new query of each request.
        k_cache: ``[num_slots, Hkv, D]``, the layer's keys in the pool (new ones stored).
        v_cache: ``[num_slots, Hkv, D]``, its values.
        slot_table: ``[B, L]`` int64, the slots of request ``i``'s tokens in ``slot_table[i]``,
            padded to the longest request ``L``.
        slot_valid: ``[B, L]`` bool, False where ``slot_table`` is padding.

    Returns:
        ``[B, Hq, D]`` in the dtype of ``q``.
    """
    batch, num_qo_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    keys = k_cache[slot_table].float()  # [B, L, Hkv, D]: each request's pages, side by side
    values = v_cache[slot_table].float()
    qg = q.float().view(batch, num_kv_heads, num_qo_heads // num_kv_heads, head_dim)
    scores = torch.einsum("bhgd,blhd->bhgl", qg, keys) * head_dim**-0.5
    # The newest token is the last valid key, so there is no future to hide: the only mask
    # is the padding of the shorter requests.
    scores.masked_fill_(~slot_valid[:, None, None, :], float("-inf"))
    out = torch.einsum("bhgl,blhd->bhgd", scores.softmax(dim=-1), values)
    return out.reshape(batch, num_qo_heads, head_dim).to(q.dtype)
