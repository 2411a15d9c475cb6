"""The KV pool for multi-head (and grouped-query) attention: one K and one V tensor per layer.

The pool stores every layer's keys and values, one row per *token slot*; page ``p`` owns slots
``p * page_size .. p * page_size + page_size - 1``. It does not know which request a slot
belongs to: the allocator and the page table do. The whole cache is one block allocated when
the engine starts; requests borrow its pages through the allocator and never allocate KV memory
of their own, so the engine's memory use stays flat. Chapter 5 tells the story.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from minisgl.utils.checks import check_int

if TYPE_CHECKING:
    from minisgl.models.config import ModelConfig


class MHAKVPool:
    """Keys and values of every layer, addressed by token slot, ``page_size`` slots per page.

    A slot is one token's K (or V) vectors for all KV heads of one layer: ``[num_kv_heads,
    head_dim]`` numbers. ``kv_cache(layer)`` holds the two ``[num_slots, num_kv_heads, head_dim]``
    tensors of that layer, and slot ``s`` is their row ``s``.

    Args:
        num_layers: transformer layers; each gets its own K and V tensor.
        num_kv_heads: KV heads *on this device* (under tensor parallelism each rank passes its
            share).
        head_dim: features per head.
        num_pages: pages in the pool.
        page_size: token slots per page (1 and 16 are the usual choices).
        dtype: the dtype the vectors are stored in (the model's activation dtype).
        device: where the pool lives.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int,
                 page_size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim), ("num_pages", num_pages),
                            ("page_size", page_size)):
            check_int(name, value, at_least=1)
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_pages, self.page_size, self.dtype = num_pages, page_size, dtype
        # One block: [K or V, layer, slot, head, feature], exactly the budget's size. Zeros,
        # not torch.empty: a slot never written (padding, a bug) reads as zeros, never NaN.
        self._kv = torch.zeros((2, num_layers, num_pages * page_size, num_kv_heads, head_dim),
                               dtype=dtype, device=device)
        self.device = self._kv.device

    @property
    def num_slots(self) -> int:
        """Token slots in the pool: every page's ``page_size`` slots."""
        return self.num_pages * self.page_size

    def kv_cache(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_id``'s keys and values: two ``[num_slots, num_kv_heads, head_dim]``
        views (no copy)."""
        return self._kv[0, layer_id], self._kv[1, layer_id]

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor,
                 layer_id: int) -> None:
        """Write the new tokens' K/V (``[T, num_kv_heads, head_dim]``) to slots ``out_loc[:T]``.

        ``out_loc`` comes from :meth:`PageTable.token_slots`; the write is one scatter.
        """
        if k.shape != v.shape or k.shape[0] != out_loc.shape[0]:
            raise ValueError(f"store_kv: k {tuple(k.shape)}, v {tuple(v.shape)} and out_loc "
                             f"{tuple(out_loc.shape)} must agree on the number of tokens")
        # .to() is free when the dtypes already match; the cast covers a float32 computation
        # feeding a bfloat16 cache (index assignment refuses mixed dtypes).
        k_cache, v_cache = self.kv_cache(layer_id)
        k_cache[out_loc] = k.to(self.dtype)
        v_cache[out_loc] = v.to(self.dtype)

    def gather_kv(self, slots: torch.Tensor, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Read back the keys and values at ``slots``: two ``[len(slots), num_kv_heads, head_dim]``.

        A copy, in the order of ``slots``: how the torch attention backend reads a request's
        scattered pages as one sequence. Fused kernels read the pages in place (:meth:`kv_pages`).
        """
        k, v = self.kv_cache(layer_id)
        return k[slots], v[slots]

    def kv_pages(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_id``'s K and V seen page by page: ``[num_pages, page_size, heads, dim]``.

        The same memory as :meth:`kv_cache`, reshaped (no copy): the form
        paged attention kernels such as FlashInfer's take.
        """
        k, v = self.kv_cache(layer_id)
        shape = (self.num_pages, self.page_size, *k.shape[1:])
        return k.view(shape), v.view(shape)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token slot takes over all layers, K and V together."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self._kv.element_size()

    @property
    def num_bytes(self) -> int:
        """Bytes the whole pool occupies."""
        return self._kv.numel() * self._kv.element_size()

    @staticmethod
    def num_pages_for_budget(budget_bytes: int, model_config: ModelConfig, page_size: int,
                             dtype: torch.dtype) -> int:
        """How many whole pages of ``page_size`` tokens fit in ``budget_bytes`` of memory.

        A page costs ``page_size * model_config.kv_bytes_per_token(dtype)`` bytes; what is left
        after the last whole page stays unused.
        """
        check_int("page_size", page_size, at_least=1)
        check_int("budget_bytes", budget_bytes, at_least=0)
        return budget_bytes // (page_size * model_config.kv_bytes_per_token(dtype))

    @classmethod
    def from_config(cls, model_config: ModelConfig, num_pages: int, page_size: int,
                    dtype: torch.dtype, device: torch.device | str) -> MHAKVPool:
        """A pool shaped for ``model_config`` (all of its KV heads: a single-device engine)."""
        return cls(model_config.num_layers, model_config.num_kv_heads, model_config.head_dim,
                   num_pages, page_size, dtype, device)
