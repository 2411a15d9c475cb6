"""Paged attention with FlashInfer's fused kernels (CUDA only).

FlashInfer reads the KV pool where it lies. It takes the cache of one layer as pages
(``[num_pages, page_size, num_kv_heads, head_dim]``, the "NHD" layout, which is exactly
:meth:`MHAKVPool.kv_pages`) and, for the batch, three small arrays in CSR form:

* ``indices``: the page ids, request after request, in token order;
* ``indptr`` (``[B + 1]``): request ``i`` owns entries ``indptr[i] .. indptr[i + 1] - 1`` of
  ``indices``;
* ``last_page_len`` (``[B]``): how many tokens of each request's last page are in use.

Queries are packed too (``qo_indptr``). Its wrappers work in two steps: ``plan`` looks at the
lengths once per batch on the host and decides how to split the work into thread blocks;
``run`` is then called by every layer and only launches kernels. That split is why the engine's
backend interface has a ``prepare`` per batch and a ``forward`` per layer.

Two wrappers serve two kinds of batch: ``BatchPrefillWithPagedKVCacheWrapper`` for batches with
several new tokens per request (causal mask aligned to the end of each sequence, so a cached
prefix comes for free), and ``BatchDecodeWithPagedKVCacheWrapper`` for one new token per
request. Decode can run inside a CUDA graph when its wrapper is built with
``use_cuda_graph=True`` over buffers that never move; :meth:`FlashInferBackend.init_graph_buffers`
allocates them.

``flashinfer`` is imported when a backend is built, not when this module is, so the package
imports on machines without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from minisgl.attention.base import AttnMetadata, BaseAttnBackend, BatchLayout
from minisgl.attention.utils import (
    gather_page_ids,
    indptr_tensor,
    last_page_len,
    pages_for,
)
from minisgl.kvcache.mha_pool import MHAKVPool
from minisgl.kvcache.page_table import PageTable
from minisgl.utils.logger import get_logger

logger = get_logger(__name__)

# The scratch memory FlashInfer's kernels write partial results to when they split a long
# sequence across several thread blocks; 128 MiB is what its documentation recommends.
WORKSPACE_BYTES = 128 * 2**20
SUPPORTED_HEAD_DIMS = (64, 128, 256)  # head sizes FlashInfer's kernels are built for
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


def import_flashinfer() -> ModuleType:
    """``import flashinfer``, or an error that says how to get it."""
    try:
        import flashinfer
    except ImportError as exc:
        raise ImportError("the flashinfer attention backend needs the flashinfer-python "
                          "package: pip install -e '.[gpu]' (or choose the torch backend)"
                          ) from exc
    return flashinfer


@dataclass
class FIMetadata(AttnMetadata):
    """Where each request's keys are, as pages, and the wrapper planned for this batch."""

    page_indptr: torch.Tensor  # [B + 1] int32, host
    page_indices: torch.Tensor  # [sum(pages)] int32, device
    last_page_lens: torch.Tensor  # [B] int32, host
    qo_indptr: torch.Tensor  # [B + 1] int32, host
    wrapper: Any  # the FlashInfer wrapper whose plan matches these arrays


@dataclass
class GraphBuffers:
    """The fixed device memory that captured decode graphs read.

    A CUDA graph records the addresses its kernels read. Replaying it for a new batch means
    writing the new batch's arrays *into these same tensors*; the wrappers built with
    ``use_cuda_graph=True`` do that in ``plan``, and ``out_loc`` is filled here.
    """

    max_batch_size: int
    pad_page: int  # a page no request owns: padding entries write and read it
    page_indptr: torch.Tensor  # [max_batch_size + 1] int32
    page_indices: torch.Tensor  # [max_batch_size * max_pages_per_req] int32
    last_page_lens: torch.Tensor  # [max_batch_size] int32
    out_loc: torch.Tensor  # [max_batch_size] int64


class FlashInferBackend(BaseAttnBackend):
    """FlashInfer paged prefill and decode over the engine's KV pool.

    Args:
        kv_pool: the KV pool; must be on a CUDA device, in float16 or bfloat16.
        page_table: the page table (same page size and device as the pool).
        num_qo_heads: query heads on this device.
        workspace_bytes: size of FlashInfer's float scratch buffer.
    """

    name = "flashinfer"
    supports_cuda_graph = True

    def __init__(self, kv_pool: MHAKVPool, page_table: PageTable, num_qo_heads: int,
                 workspace_bytes: int = WORKSPACE_BYTES) -> None:
        super().__init__(kv_pool, page_table, num_qo_heads)
        check_flashinfer_supports(self.device, kv_pool.dtype, self.head_dim)
        flashinfer = import_flashinfer()
        self._flashinfer = flashinfer
        # Zeros: FlashInfer requires the workspace to start zeroed.
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        # "fa2" rather than "auto", which would pick the FA3 kernels on Hopper GPUs: FA2 runs on
        # every GPU FlashInfer supports, compiles quicker, and upstream mini-sglang found FA3
        # slower for its workloads.
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, kv_layout="NHD", backend="fa2")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, kv_layout="NHD", use_tensor_cores=self.use_tensor_cores)
        self._graph: GraphBuffers | None = None
        self._graph_wrappers: dict[int, Any] = {}  # captured batch size -> its decode wrapper
        # plan() stages its arrays in pinned host memory and copies them to the GPU
        # asynchronously. Planning again before that copy ran would overwrite the staging
        # memory under it, so each plan waits for the previous one's copy (see _run_plan).
        self._plan_copied = torch.cuda.Event()
        self._plan_copied.record()

    @property
    def use_tensor_cores(self) -> bool:
        """Decode on tensor cores when each KV head serves at least 4 query heads.

        A decode query is a single row, too thin for a tensor-core matrix product; with GQA
        the ``group`` query heads that share a KV head stack into a taller block, which pays
        off from a group of about 4 (the threshold SGLang and upstream mini-sglang use).
        """
        return self.num_qo_heads // self.num_kv_heads >= 4

    def _page_arrays(self, layout: BatchLayout) -> dict[str, torch.Tensor]:
        """The CSR description of where each request's keys are: pages, not token slots."""
        num_pages = [pages_for(n, self.page_size) for n in layout.total_lens]
        return {
            "page_indptr": indptr_tensor(num_pages),
            "page_indices": gather_page_ids(self.page_table, layout.rows, num_pages),
            "last_page_lens": torch.tensor([last_page_len(n, self.page_size)
                                            for n in layout.total_lens], dtype=torch.int32),
            "qo_indptr": indptr_tensor(layout.new_lens),
        }

    def _plan(self, layout: BatchLayout) -> FIMetadata:
        wrapper = self._decode if layout.is_decode else self._prefill
        meta = FIMetadata(**self._new_token_fields(layout), **self._page_arrays(layout),
                          wrapper=wrapper)
        self._run_plan(meta)
        return meta

    def _run_plan(self, meta: FIMetadata) -> None:
        """Let the wrapper look at this batch's lengths and split the work; once per batch."""
        self._plan_copied.synchronize()
        common = {"num_qo_heads": self.num_qo_heads, "num_kv_heads": self.num_kv_heads,
                  "page_size": self.page_size, "q_data_type": self.kv_pool.dtype,
                  "kv_data_type": self.kv_pool.dtype}
        if isinstance(meta.wrapper, self._flashinfer.BatchDecodeWithPagedKVCacheWrapper):
            meta.wrapper.plan(meta.page_indptr, meta.page_indices, meta.last_page_lens,
                              head_dim=self.head_dim, **common)
        else:
            # causal=True masks each request's queries against the END of its keys: query t of
            # T new tokens sees keys 0 .. total_len - T + t, so a cached prefix needs no more.
            meta.wrapper.plan(meta.qo_indptr, meta.page_indptr, meta.page_indices,
                              meta.last_page_lens, head_dim_qk=self.head_dim, causal=True,
                              **common)
        self._plan_copied.record()

    def _attend(self, q: torch.Tensor, layer_id: int, meta: AttnMetadata) -> torch.Tensor:
        assert isinstance(meta, FIMetadata)
        # The layer's pool seen page by page: the same memory, no copy.
        return meta.wrapper.run(q.contiguous(), self.kv_pool.kv_pages(layer_id))

    def init_graph_buffers(self, max_batch_size: int, pad_page: int) -> None:
        """Allocate the buffers every captured decode graph reads; call once, before capturing.

        Args:
            max_batch_size: the largest batch size that will be captured.
            pad_page: a page of the pool that no request will ever own (the engine takes it
                from the allocator and keeps it). A batch smaller than its graph is padded
                with entries of one token in this page: they compute garbage nobody reads,
                and they write it where nobody looks.
        """
        if self._graph is not None:
            raise RuntimeError("init_graph_buffers was already called")
        if not 0 <= pad_page < self.kv_pool.num_pages:
            raise ValueError(f"pad_page {pad_page} is not a page of the pool "
                             f"(0..{self.kv_pool.num_pages - 1})")
        if max_batch_size < 1 or max_batch_size > self.page_table.max_reqs:
            raise ValueError(f"max_batch_size {max_batch_size} must be between 1 and the page "
                             f"table's {self.page_table.max_reqs} rows")
        max_pages = max_batch_size * self.page_table.max_pages_per_req
        self._graph = GraphBuffers(
            max_batch_size=max_batch_size, pad_page=pad_page,
            page_indptr=torch.zeros(max_batch_size + 1, dtype=torch.int32, device=self.device),
            page_indices=torch.zeros(max_pages, dtype=torch.int32, device=self.device),
            last_page_lens=torch.zeros(max_batch_size, dtype=torch.int32, device=self.device),
            out_loc=torch.zeros(max_batch_size, dtype=torch.int64, device=self.device),
        )

    def _graph_wrapper(self, batch_size: int) -> Any:
        """The decode wrapper of one captured batch size, over slices of the fixed buffers."""
        graph = self._graph
        if graph is None:
            raise RuntimeError("call init_graph_buffers() before capturing CUDA graphs")
        if not 1 <= batch_size <= graph.max_batch_size:
            raise ValueError(f"batch_size {batch_size} must be between 1 and the "
                             f"max_batch_size {graph.max_batch_size} given to init_graph_buffers")
        if batch_size not in self._graph_wrappers:
            self._graph_wrappers[batch_size] = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, kv_layout="NHD", use_cuda_graph=True,
                use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=graph.page_indptr[: batch_size + 1],
                paged_kv_indices_buffer=graph.page_indices,
                paged_kv_last_page_len_buffer=graph.last_page_lens[:batch_size])
        return self._graph_wrappers[batch_size]

    def prepare_for_capture(self, batch_size: int) -> FIMetadata:
        """Make a decode batch of ``batch_size`` padding entries current, to capture its graph.

        The model's forward pass is then run inside ``torch.cuda.graph``; it records reads of
        the fixed buffers, whatever values they hold now.
        """
        wrapper = self._graph_wrapper(batch_size)
        pads = self._padding(0, batch_size)
        meta = FIMetadata(layout=None, out_loc=self._graph.out_loc[:batch_size],
                          positions=torch.zeros(batch_size, dtype=torch.int64, device=self.device),
                          last_indices=torch.arange(batch_size, device=self.device),
                          wrapper=wrapper, **pads)
        self._graph.out_loc[:batch_size].fill_(self._pad_slot)
        self._run_plan(meta)
        self._metadata = meta
        return meta

    def prepare_for_replay(self, layout: BatchLayout, batch_size: int) -> FIMetadata:
        """Point the graph captured for ``batch_size`` at the decode batch ``layout``.

        Computes the batch's metadata, pads it with ``batch_size - layout.num_reqs`` padding
        entries, writes the new-token slots into the fixed ``out_loc`` and plans the graph's
        wrapper (which copies the page arrays into its fixed buffers). The returned metadata
        describes the padded batch; its ``positions`` are padded with zeros.
        """
        if not layout.is_decode:
            raise ValueError("only decode batches are replayed as CUDA graphs")
        if layout.num_reqs > batch_size:
            raise ValueError(f"a batch of {layout.num_reqs} requests does not fit the graph "
                             f"captured for {batch_size}")
        wrapper = self._graph_wrapper(batch_size)
        fields = self._new_token_fields(layout)
        real = self._page_arrays(layout)
        pads = self._padding(layout.num_reqs, batch_size)
        num_real = layout.num_reqs
        out_loc = self._graph.out_loc[:batch_size]
        out_loc[:num_real].copy_(fields["out_loc"])
        out_loc[num_real:].fill_(self._pad_slot)
        padded = torch.zeros(batch_size - num_real, dtype=torch.int64, device=self.device)
        meta = FIMetadata(
            layout=layout, out_loc=out_loc,
            positions=torch.cat([fields["positions"], padded]),
            last_indices=torch.arange(batch_size, device=self.device),
            page_indptr=torch.cat([real["page_indptr"],
                                   real["page_indptr"][-1] + pads["page_indptr"][1:]]),
            page_indices=torch.cat([real["page_indices"], pads["page_indices"]]),
            last_page_lens=torch.cat([real["last_page_lens"], pads["last_page_lens"]]),
            qo_indptr=torch.arange(batch_size + 1, dtype=torch.int32),
            wrapper=wrapper,
        )
        self._run_plan(meta)
        self._metadata = meta
        return meta

    @property
    def _pad_slot(self) -> int:
        assert self._graph is not None
        return self._graph.pad_page * self.page_size

    def _padding(self, num_real: int, batch_size: int) -> dict[str, torch.Tensor]:
        """Page arrays for ``batch_size - num_real`` padding entries: one token in the pad page."""
        assert self._graph is not None
        count = batch_size - num_real
        return {
            "page_indptr": torch.arange(count + 1, dtype=torch.int32),
            "page_indices": torch.full((count,), self._graph.pad_page, dtype=torch.int32,
                                       device=self.device),
            "last_page_lens": torch.ones(count, dtype=torch.int32),
            "qo_indptr": torch.arange(count + 1, dtype=torch.int32),
        }


def check_flashinfer_supports(device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    """Raise a ValueError naming the reason when FlashInfer cannot serve this setup."""
    if device.type != "cuda":
        raise ValueError(f"the flashinfer attention backend needs a CUDA device, but the KV "
                         f"pool is on {device}; use the torch backend (or auto)")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"the flashinfer attention backend runs in float16 or bfloat16, not "
                         f"{dtype}; use --dtype bfloat16 or the torch backend")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"the flashinfer attention backend supports head_dim "
                         f"{SUPPORTED_HEAD_DIMS}, not {head_dim}; use the torch backend")
