"""Paged attention with FlashInfer's kernels (CUDA only); chapter 6 tells the story.

FlashInfer reads the KV pool where it lies: one layer's cache as pages (the "NHD" layout of
:meth:`MHAKVPool.kv_pages`) and, for the batch, CSR arrays: ``indices`` (the page ids, request
after request), ``indptr`` (``[B + 1]``: request ``i`` owns entries ``indptr[i] ..
indptr[i + 1] - 1``), ``last_page_len`` (``[B]``) and, for queries, ``qo_indptr``. Its
wrappers ``plan`` once per batch on the host (how to split the work into thread blocks) and
``run`` once per layer: hence the backend's ``prepare`` per batch and ``forward`` per layer.
The prefill wrapper serves batches with several new tokens per request (causal mask aligned
to each sequence's end), the decode wrapper one token per request; decode also runs inside a
CUDA graph over fixed buffers (:meth:`FlashInferBackend.init_graph_buffers`). Where
:mod:`minisgl.layers.fast` has kernels (chapter 20), a large decode batch is cut into pieces,
each an entry of the kernel, merged after it. ``flashinfer`` is imported when a backend is
built, so the package imports on machines without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch

from minisgl.attention.base import AttnMetadata, BaseAttnBackend, BatchLayout, total_lens
from minisgl.attention.utils import (
    gather_page_ids,
    indptr_tensor,
    last_page_len,
    pages_for,
)
from minisgl.kvcache.mha_pool import MHAKVPool
from minisgl.kvcache.page_table import PageTable, slots_of
from minisgl.layers import fast
from minisgl.layers.fast import QueryRows
from minisgl.utils.logger import get_logger
from minisgl.utils.torch_utils import host_to_device

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
    """Where each request's keys are, as pages, and the wrapper planned for this batch.

    The kernel's ``E`` entries are the batch's requests (or, with ``query_rows``, the pieces
    :mod:`minisgl.layers.fast` cut them into, each reading its query from a row of its own).
    """

    page_indptr: torch.Tensor  # [E + 1] int32, host
    page_indices: torch.Tensor  # [sum(pages)] int32, device
    last_page_lens: torch.Tensor  # [E] int32, host
    qo_indptr: torch.Tensor  # [E + 1] int32, host
    wrapper: Any  # the FlashInfer wrapper whose plan matches these arrays


@dataclass
class GraphBuffers:
    """The fixed memory that captured decode graphs read, and its host staging.

    A CUDA graph records the addresses its kernels read. Replaying it for a new batch means
    writing the new batch's arrays *into these same tensors*: every one of them is made here,
    once, and a replay only copies into it. The host builds a batch's arrays in the pinned
    ``host_*`` mirrors; one asynchronous copy per array moves them to the device, and nothing
    is allocated on the device per step. The kernel's entries are requests (or pieces, for a
    batch :mod:`minisgl.layers.fast` cuts into them): up to ``max_entries`` of either.
    """

    max_batch_size: int
    max_pieces: int  # 0 when no captured size is cut into pieces
    pad_page: int  # a page no request owns: padding entries write and read it
    page_indptr: torch.Tensor  # [max_entries + 1] int32 (the wrappers' plan copies into it)
    page_indices: torch.Tensor  # [max_batch_size * max_pages_per_req + max_pieces] int32
    last_page_lens: torch.Tensor  # [max_entries] int32 (plan copies into it)
    token_fields: torch.Tensor  # [2, max_batch_size] int64: positions, then out_loc
    last_indices: torch.Tensor  # [max_batch_size] int64, 0 .. max_batch_size - 1
    piece_owners: torch.Tensor  # [max_pieces] int64
    piece_indptr: torch.Tensor  # [max_batch_size + 1] int32
    host_page_indptr: torch.Tensor  # pinned host mirrors of the arrays above
    host_page_indices: torch.Tensor
    host_last_page_lens: torch.Tensor
    host_token_fields: torch.Tensor
    host_piece_owners: torch.Tensor
    host_piece_indptr: torch.Tensor
    host_qo_indptr: torch.Tensor  # [max_entries + 1] int32, 0 .. max_entries (host)

    @classmethod
    def allocate(cls, max_batch_size: int, max_pages_per_req: int, pad_page: int,
                 device: torch.device, max_pieces: int = 0) -> GraphBuffers:
        """Every buffer, zeroed; the host mirrors pinned when ``device`` is a GPU."""
        pin = device.type == "cuda"

        def device_and_host(*shape: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
            # Pinned host memory: a copy from it is truly asynchronous (from pageable memory
            # the driver may first wait for the stream).
            return (torch.zeros(shape, dtype=dtype, device=device),
                    torch.zeros(shape, dtype=dtype, pin_memory=pin))

        max_entries = max(max_batch_size, max_pieces)
        indptr, host_indptr = device_and_host(max_entries + 1, dtype=torch.int32)
        indices, host_indices = device_and_host(max_batch_size * max_pages_per_req + max_pieces,
                                                dtype=torch.int32)
        last, host_last = device_and_host(max_entries, dtype=torch.int32)
        fields, host_fields = device_and_host(2, max_batch_size, dtype=torch.int64)
        owners, host_owners = device_and_host(max_pieces, dtype=torch.int64)
        piece_indptr, host_piece_indptr = device_and_host(max_batch_size + 1, dtype=torch.int32)
        return cls(max_batch_size=max_batch_size, max_pieces=max_pieces, pad_page=pad_page,
                   page_indptr=indptr, page_indices=indices, last_page_lens=last,
                   token_fields=fields, last_indices=torch.arange(max_batch_size, device=device),
                   piece_owners=owners, piece_indptr=piece_indptr,
                   host_page_indptr=host_indptr, host_page_indices=host_indices,
                   host_last_page_lens=host_last, host_token_fields=host_fields,
                   host_piece_owners=host_owners, host_piece_indptr=host_piece_indptr,
                   host_qo_indptr=torch.arange(max_entries + 1, dtype=torch.int32))


def stage_decode_batch(graph: GraphBuffers, page_table: PageTable, rows: Sequence[int],
                       cached_lens: Sequence[int], batch_size: int, num_pieces: int = 0) -> int:
    """Write a decode batch, padded to ``batch_size``, into the host mirrors of ``graph``.

    Numpy over the page table: a copy per request and a few vectorised operations,
    nothing allocated on the device, and the device never waited for. Each padding entry is one
    token in the pad page. Returns how many page ids were written. (``num_pieces``: the
    entries are pieces instead, :func:`stage_pieces`.)
    """
    size, num_real = page_table.page_size, len(rows)
    rows = np.fromiter(rows, dtype=np.int64, count=num_real)
    cached = np.fromiter(cached_lens, dtype=np.int64, count=num_real)
    counts = np.ones(batch_size, dtype=np.int64)  # a padding entry: one page, one token
    counts[:num_real] = cached // size + 1  # the new token is at position cached_len
    last_lens = np.ones(batch_size, dtype=np.int64)
    last_lens[:num_real] = cached % size + 1
    indices = graph.host_page_indices.numpy()
    total = page_table.gather_pages(rows.tolist(), counts[:num_real].tolist(), out=indices)
    indices[total: total + batch_size - num_real] = graph.pad_page
    total += batch_size - num_real
    fields = graph.host_token_fields.numpy()
    fields[0, :num_real], fields[0, num_real:batch_size] = cached, 0
    fields[1, :num_real] = slots_of(page_table.page_ids, rows, cached, size)
    fields[1, num_real:batch_size] = graph.pad_page * size
    if num_pieces:
        return stage_pieces(graph, counts, last_lens, size, num_pieces, total)
    np.cumsum(counts, out=graph.host_page_indptr.numpy()[1: batch_size + 1])
    graph.host_last_page_lens.numpy()[:batch_size] = last_lens
    return total


def stage_pieces(graph: GraphBuffers, counts: np.ndarray, last_lens: np.ndarray,
                 page_size: int, num_pieces: int, total: int) -> int:
    """:func:`stage_decode_batch`'s entries when :mod:`minisgl.layers.fast` cuts the batch into
    exactly ``num_pieces`` pieces: the spare ones are one token in the pad page, and no request
    merges them. The page ids stay the requests' own; ``total`` of them are written."""
    pages, piece_last_lens, owners, piece_indptr = fast.paths.cut_into_pieces(
        counts, last_lens, page_size, num_pieces)
    indices, batch_size = graph.host_page_indices.numpy(), len(counts)
    indptr, entry_last_lens = graph.host_page_indptr.numpy(), graph.host_last_page_lens.numpy()
    used = len(pages)
    pages = np.concatenate([pages, np.ones(num_pieces - used, dtype=np.int64)])  # the spares
    indices[total: total + num_pieces - used] = graph.pad_page
    np.cumsum(pages, out=indptr[1: num_pieces + 1])
    entry_last_lens[:used], entry_last_lens[used:num_pieces] = piece_last_lens, 1
    owners_out = graph.host_piece_owners.numpy()
    owners_out[:used], owners_out[used:num_pieces] = owners, 0
    graph.host_piece_indptr.numpy()[: batch_size + 1] = piece_indptr
    return total + num_pieces - used


def copy_pieces(graph: GraphBuffers, batch_size: int, num_pieces: int) -> None:
    """Start the device copies of what :func:`stage_pieces` staged."""
    graph.piece_owners[:num_pieces].copy_(graph.host_piece_owners[:num_pieces], non_blocking=True)
    graph.piece_indptr[: batch_size + 1].copy_(graph.host_piece_indptr[: batch_size + 1],
                                               non_blocking=True)


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
        # captured batch size -> its metadata, whose wrapper reads the fixed buffers
        self._graph_metadata_by_size: dict[int, FIMetadata] = {}
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
        totals = total_lens(layout)
        num_pages = [pages_for(n, self.page_size) for n in totals]
        return {
            "page_indptr": indptr_tensor(num_pages),
            "page_indices": gather_page_ids(self.page_table, layout.rows, num_pages),
            "last_page_lens": torch.tensor([last_page_len(n, self.page_size) for n in totals],
                                           dtype=torch.int32),
            "qo_indptr": indptr_tensor(layout.new_lens),
        }

    def _piece_arrays(self, layout: BatchLayout) -> dict[str, Any]:
        """:meth:`_page_arrays` for a decode batch :mod:`minisgl.layers.fast` cuts into pieces:
        one entry per piece."""
        arrays = self._page_arrays(layout)
        num_pages = np.diff(arrays["page_indptr"].numpy()).astype(np.int64)
        pages, last_lens, owners, piece_indptr = fast.paths.cut_into_pieces(
            num_pages, arrays["last_page_lens"].numpy().astype(np.int64), self.page_size,
            fast.paths.decode_pieces(layout.size))
        arrays.update(page_indptr=indptr_tensor(pages.tolist()),
                      last_page_lens=torch.from_numpy(last_lens.astype(np.int32)),
                      query_rows=QueryRows(
                          owners=host_to_device(torch.from_numpy(owners), self.device),
                          indptr=host_to_device(torch.from_numpy(
                              piece_indptr.astype(np.int32)), self.device)))
        return arrays

    def _plan(self, layout: BatchLayout, fields: dict[str, Any]) -> FIMetadata:
        if not layout.is_decode:
            arrays, wrapper = self._page_arrays(layout), self._prefill
        elif fast.paths.decode_pieces(layout.size):
            arrays, wrapper = self._piece_arrays(layout), self._decode
        else:
            arrays, wrapper = self._page_arrays(layout), self._decode
        meta = FIMetadata(**fields, **arrays, wrapper=wrapper)
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
        kv_pages = self.kv_pool.kv_pages(layer_id)  # the layer's pool page by page: no copy
        if meta.query_rows is not None:
            return self._attend_in_pieces(q, kv_pages, meta.wrapper, meta.query_rows)
        return meta.wrapper.run(q.contiguous(), kv_pages)

    def _attend_in_pieces(self, q: torch.Tensor, kv_pages: torch.Tensor, wrapper: Any,
                          pieces: QueryRows) -> torch.Tensor:
        """``q`` holds a row per piece (``meta.query_rows``); the merge weighs the pieces'
        outputs by their log-sum-exp into each request's output."""
        out, lse = wrapper.run(q, kv_pages, return_lse=True)
        return fast.paths.merge_pieces(out, lse, pieces.indptr)

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
        self._graph = GraphBuffers.allocate(max_batch_size, self.page_table.max_pages_per_req,
                                            pad_page, self.device,
                                            max_pieces=fast.paths.decode_pieces(max_batch_size))

    def _graph_metadata(self, batch_size: int) -> FIMetadata:
        """The metadata of one captured batch size: views of the fixed buffers, made once.

        The decode wrapper of that size is built over slices of the same buffers. Its plan is
        given no page indices to copy (an empty view): :meth:`_stage_graph_batch` copies them.
        """
        graph = self._graph
        if graph is None:
            raise RuntimeError("call init_graph_buffers() before capturing CUDA graphs")
        if not 1 <= batch_size <= graph.max_batch_size:
            raise ValueError(f"batch_size {batch_size} must be between 1 and the "
                             f"max_batch_size {graph.max_batch_size} given to init_graph_buffers")
        if batch_size not in self._graph_metadata_by_size:
            num_pieces = fast.paths.decode_pieces(batch_size)
            entries = num_pieces or batch_size  # the kernel's requests: pieces, or the batch's
            wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, kv_layout="NHD", use_cuda_graph=True,
                use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=graph.page_indptr[: entries + 1],
                paged_kv_indices_buffer=graph.page_indices,
                paged_kv_last_page_len_buffer=graph.last_page_lens[:entries])
            query_rows = QueryRows(owners=graph.piece_owners[:num_pieces],
                               indptr=graph.piece_indptr[: batch_size + 1]) if num_pieces else None
            self._graph_metadata_by_size[batch_size] = FIMetadata(
                layout=None, out_loc=graph.token_fields[1, :batch_size],
                positions=graph.token_fields[0, :batch_size],
                last_indices=graph.last_indices[:batch_size],
                page_indptr=graph.host_page_indptr[: entries + 1],
                page_indices=graph.page_indices[:0],
                last_page_lens=graph.host_last_page_lens[:entries],
                qo_indptr=graph.host_qo_indptr[: entries + 1], wrapper=wrapper,
                query_rows=query_rows)
        return self._graph_metadata_by_size[batch_size]

    def prepare_for_capture(self, batch_size: int) -> FIMetadata:
        """Make a decode batch of ``batch_size`` padding entries current, to capture its graph.

        The model's forward pass is then run inside ``torch.cuda.graph``; it records reads of
        the fixed buffers, whatever values they hold now.
        """
        return self._prepare_graph_batch(None, batch_size)

    def prepare_for_replay(self, layout: BatchLayout, batch_size: int) -> FIMetadata:
        """Point the graph captured for ``batch_size`` at the decode batch ``layout``.

        Writes the batch, padded with ``batch_size - layout.size`` padding entries, into
        the graph's fixed buffers and plans its wrapper; allocates no device memory. The
        returned metadata (the same object at every replay of this size) describes the padded
        batch; its ``positions`` are padded with zeros.
        """
        if not layout.is_decode:
            raise ValueError("only decode batches are replayed as CUDA graphs")
        if layout.size > batch_size:
            raise ValueError(f"a batch of {layout.size} requests does not fit the graph "
                             f"captured for {batch_size}")
        return self._prepare_graph_batch(layout, batch_size)

    def _prepare_graph_batch(self, layout: BatchLayout | None, batch_size: int) -> FIMetadata:
        meta = self._graph_metadata(batch_size)
        # The staging may still be the source of the previous step's copies: the event that
        # guards plan()'s own pinned staging guards it too.
        self._plan_copied.synchronize()
        if layout is None:
            self._stage_graph_batch((), (), batch_size)
        else:
            self._stage_graph_batch(layout.rows, layout.cached_lens, batch_size)
        meta.layout = layout
        self._run_plan(meta)  # copies page_indptr and last_page_lens into the fixed buffers
        self._metadata = meta
        return meta

    def _stage_graph_batch(self, rows: Sequence[int], cached_lens: Sequence[int],
                           batch_size: int) -> None:
        """Write the padded batch's arrays to the host staging (:func:`stage_decode_batch`);
        start their device copies, one per array."""
        graph = self._graph
        assert graph is not None
        num_pieces = fast.paths.decode_pieces(batch_size)
        total = stage_decode_batch(graph, self.page_table, rows, cached_lens, batch_size,
                                   num_pieces)
        graph.token_fields.copy_(graph.host_token_fields, non_blocking=True)
        graph.page_indices[:total].copy_(graph.host_page_indices[:total], non_blocking=True)
        if num_pieces:
            copy_pieces(graph, batch_size, num_pieces)


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
