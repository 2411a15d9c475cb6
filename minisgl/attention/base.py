"""What every paged attention backend shares: the batch it reads, its metadata, the base class.

A batch is, per request, a page-table row, a cached length and a number of new tokens
(:class:`BatchLayout`; the engine's ``Batch`` is one). A backend is used in two moves:
:meth:`BaseAttnBackend.prepare` once per batch turns that into tensors (:class:`AttnMetadata`:
each new token's slot and position, and whatever the kernel needs to find each request's keys;
a fused kernel also plans its work there), and :meth:`BaseAttnBackend.forward` once per layer
stores the layer's new K/V and attends. Chapter 6 tells the story.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np
import torch

from minisgl.kvcache.mha_pool import MHAKVPool
from minisgl.kvcache.page_table import PageTable
from minisgl.layers.fast import KVDestination, QueryRows
from minisgl.utils.torch_utils import host_to_device


class BatchLayout(Protocol):
    """What an attention backend reads of a batch: per request, in the order its tokens are
    packed, its page-table row, how many of its tokens are cached and how many it brings now.

    The engine's :class:`~minisgl.core.Batch` is one; :func:`layout_of` makes one from three
    lists. ``is_decode`` marks a batch where every request brings one token after a cached past:
    such a batch can use a decode kernel, and the engine may replay it as a CUDA graph.
    """

    size: int  # requests
    num_tokens: int  # new tokens: the length T of the model's input
    is_decode: bool
    cached_lens: Sequence[int]

    @property
    def rows(self) -> Sequence[int]: ...

    @property
    def new_lens(self) -> Sequence[int]: ...


@dataclass(frozen=True)
class _Layout:
    rows: list[int]
    cached_lens: list[int]
    new_lens: list[int]
    is_decode: bool
    size: int
    num_tokens: int


def layout_of(rows: Sequence[int], cached_lens: Sequence[int], new_lens: Sequence[int],
              is_decode: bool = False) -> BatchLayout:
    """A :class:`BatchLayout` from three parallel lists (one entry per request), checked."""
    if not len(rows) == len(cached_lens) == len(new_lens) > 0:
        raise ValueError(f"a batch needs at least one request, and rows, cached_lens and "
                         f"new_lens one entry per request; got {len(rows)}, {len(cached_lens)} "
                         f"and {len(new_lens)}")
    for row, cached, new in zip(rows, cached_lens, new_lens):
        if cached < 0 or new < 1 or (is_decode and new != 1):
            raise ValueError(f"row {row}: cached_len {cached} must be >= 0 and new_len {new} "
                             f">= 1 (exactly 1 in a decode batch)")
    if len(set(rows)) != len(rows):  # two requests on one row would write the same slots
        raise ValueError(f"page-table rows {list(rows)} appear more than once in one batch")
    return _Layout(list(rows), list(cached_lens), list(new_lens), is_decode, len(rows),
                   sum(new_lens))


def pad_batch(batch: BatchLayout | None, size: int, pad_row: int) -> BatchLayout:
    """A decode batch (None: no requests) with padding entries after its requests, ``size`` in
    all: each one token at position 0 of ``pad_row``, a row whose one page no request owns. A
    CUDA graph captured for ``size`` requests runs a smaller batch padded so (chapter 8)."""
    rows, cached = (list(batch.rows), list(batch.cached_lens)) if batch is not None else ([], [])
    pad = size - len(rows)
    return _Layout(rows + [pad_row] * pad, cached + [0] * pad, [1] * size, True, size, size)


def total_lens(layout: BatchLayout) -> list[int]:
    """Keys each request's queries attend over: its cached tokens and its new ones."""
    return [c + n for c, n in zip(layout.cached_lens, layout.new_lens)]


@dataclass
class AttnMetadata:
    """What :meth:`BaseAttnBackend.prepare` computed for one batch; every layer reuses it.

    Backends subclass it to add what their kernel needs. The fields here are what every
    backend has, and what the engine reads back to build the model's inputs.

    Attributes:
        layout: the batch's requests. Padding entries added for a CUDA graph are not in it,
            and the padding-only batch used to capture a graph has None.
        out_loc: ``[T]`` int64, the pool slot where each new token's K/V is stored.
        positions: ``[T]`` int64, each new token's position in its sequence (for RoPE).
        last_indices: ``[B]`` int64, the index in ``0 .. T-1`` of each request's last new
            token: the rows whose logits the engine samples from.
        query_rows: where the kernel reads the queries, when not one row per token (a decode
            cut into pieces, chapter 20); None otherwise.
    """

    layout: BatchLayout | None
    out_loc: torch.Tensor
    positions: torch.Tensor
    last_indices: torch.Tensor
    query_rows: QueryRows | None = field(default=None, kw_only=True)


class BaseAttnBackend(ABC):
    """A paged attention backend: it implements the layers' ``AttentionBackend`` protocol.

    Args:
        kv_pool: the pool the keys and values live in (this device's share of the heads).
        page_table: the rows of page ids that say where each request's tokens are.
        num_qo_heads: query heads on this device (under tensor parallelism, this rank's share).
    """

    name: ClassVar[str]

    def __init__(self, kv_pool: MHAKVPool, page_table: PageTable, num_qo_heads: int) -> None:
        if kv_pool.page_size != page_table.page_size:
            raise ValueError(f"the KV pool has {kv_pool.page_size}-token pages but the page "
                             f"table assumes {page_table.page_size}; they must agree")
        if kv_pool.device != page_table.device:
            raise ValueError(f"the KV pool is on {kv_pool.device} but the page table on "
                             f"{page_table.device}; attention reads both on one device")
        if num_qo_heads <= 0 or num_qo_heads % kv_pool.num_kv_heads:
            raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a positive multiple of "
                             f"the pool's num_kv_heads ({kv_pool.num_kv_heads})")
        self.kv_pool = kv_pool
        self.page_table = page_table
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = kv_pool.num_kv_heads
        self.head_dim = kv_pool.head_dim
        self.page_size = kv_pool.page_size
        self.device = kv_pool.device
        self._metadata: AttnMetadata | None = None

    def prepare(self, layout: BatchLayout, out: torch.Tensor | None = None) -> AttnMetadata:
        """Compute the metadata of the next forward pass; call once per batch, before the model.

        The returned metadata stays in effect (every :meth:`forward` call uses it) until the
        next ``prepare``. Its ``positions`` and ``last_indices`` are the model's inputs. The new
        tokens of request ``i`` are its positions ``cached_len .. total_len - 1``; the page
        table finds their slots on the host (and checks that the row holds pages for all of
        them), and the three arrays cross to the device in one copy the host does not wait for:
        into a new tensor, or into ``out`` (int64, at least ``2 * T + B`` long) for a batch
        that a CUDA graph runs from fixed memory (chapter 8). The backend's :meth:`_plan` adds
        what its kernel needs.
        """
        ends = np.add(layout.cached_lens, layout.new_lens)
        positions, slots = self.page_table.locate(layout.rows, layout.cached_lens, ends)
        last_indices = np.cumsum(layout.new_lens) - 1  # each request's last new token
        host = torch.from_numpy(np.concatenate([positions, slots, last_indices]))
        if out is None:
            fields = host_to_device(host, self.device)
        else:  # pinned, so that the copy does not wait for the device either
            fields = out[: len(host)].copy_(host.pin_memory() if out.is_cuda else host,
                                            non_blocking=True)
        positions, out_loc, last_indices = fields.split([len(slots), len(slots), layout.size])
        self._metadata = self._plan(layout, {"layout": layout, "out_loc": out_loc,
                                             "positions": positions,
                                             "last_indices": last_indices}, out is not None)
        return self._metadata

    @abstractmethod
    def _plan(self, layout: BatchLayout, fields: dict[str, Any], static: bool) -> AttnMetadata:
        """This backend's metadata for ``layout``, built on the :class:`AttnMetadata`
        ``fields`` every backend has (and its kernel planned, if it has one). ``static``: a
        CUDA graph will run the batch (:meth:`enable_cuda_graphs`)."""

    @property
    def metadata(self) -> AttnMetadata:
        """The metadata of the batch being run; an error before the first :meth:`prepare`."""
        return self._current()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer_id: int) -> torch.Tensor:
        """Store this layer's new K/V into the pool, then attend over every request's keys.

        Args:
            q: ``[T, num_qo_heads, head_dim]`` queries of the new tokens (rotary applied).
            k: ``[T, num_kv_heads, head_dim]`` their keys.
            v: ``[T, num_kv_heads, head_dim]`` their values.
            layer_id: the calling layer, which picks the pool's K/V tensors.

        Returns:
            ``[T, num_qo_heads, head_dim]`` in the dtype of ``q``.
        """
        meta = self._current(q.shape[0])
        # Store first: a new token attends to itself and to the new tokens before it, so its
        # own key must already be in the pool when the kernel reads the request's keys.
        self.kv_pool.store_kv(k, v, meta.out_loc, layer_id)
        if meta.query_rows is not None:
            q = q.index_select(0, meta.query_rows.owners)
        return self._attend(q, layer_id, meta)

    def _current(self, num_tokens: int | None = None) -> AttnMetadata:
        """The prepared batch's metadata, once ``num_tokens`` (the model's, if given) is known
        to match. Runs in every layer of every step: one call, no property in between."""
        meta = self._metadata
        if meta is None:
            raise RuntimeError(f"the {self.name} attention backend has no batch: call "
                               "prepare(layout) before running the model")
        if num_tokens is not None and num_tokens != meta.out_loc.shape[0]:
            raise ValueError(f"the model passed {num_tokens} tokens but the prepared batch has "
                             f"{meta.out_loc.shape[0]}; call prepare() for each batch")
        return meta

    # The split form of forward, for a layer whose kernel stores the keys and values itself on
    # the way from the qkv projection (minisgl.layers.fast): it asks where they go, writes them
    # there, and then only asks for attention.
    def kv_destination(self, layer_id: int, num_tokens: int) -> KVDestination:
        """Layer ``layer_id``'s key and value caches, the slots of the batch's new tokens and
        the rows in which the kernel reads their queries."""
        meta = self._current(num_tokens)
        k_cache, v_cache = self.kv_pool.kv_cache(layer_id)
        rows = meta.query_rows
        if rows is None:
            return KVDestination(k_cache, v_cache, meta.out_loc)
        return KVDestination(k_cache, v_cache, meta.out_loc, rows.indptr, len(rows.owners))

    def attend_stored(self, q: torch.Tensor, layer_id: int) -> torch.Tensor:
        """:meth:`forward` after the new K/V were written to :meth:`kv_destination`, and the
        queries to the rows it named."""
        meta = self._current()
        rows = meta.query_rows
        if q.shape[0] != (meta.out_loc.shape[0] if rows is None else len(rows.owners)):
            raise ValueError(f"attend_stored got {q.shape[0]} query rows; the prepared batch "
                             "reads the rows kv_destination named")
        return self._attend(q, layer_id, meta)

    @abstractmethod
    def _attend(self, q: torch.Tensor, layer_id: int, meta: AttnMetadata) -> torch.Tensor:
        """Attention over the pool's keys of layer ``layer_id``, as ``meta`` says, of the
        queries ``q`` in the kernel's rows (``meta.query_rows``)."""

    def enable_cuda_graphs(self, batch_sizes: Sequence[int]) -> None:
        """Get ready for decode batches of ``batch_sizes`` that CUDA graphs run from fixed
        memory. Only a backend whose kernels can read fixed arrays can be captured; the
        others say so instead of failing somewhere inside the capture."""
        raise NotImplementedError(f"the {self.name} attention backend does not support "
                                  "CUDA graphs")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(heads {self.num_qo_heads}/{self.num_kv_heads} x "
                f"{self.head_dim}, page_size={self.page_size}, device={self.device})")

