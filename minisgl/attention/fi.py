"""Paged attention with FlashInfer's kernels (CUDA only); chapter 6 tells the story.

FlashInfer reads the KV pool where it lies: one layer's cache as pages (the "NHD" layout of
:meth:`MHAKVPool.kv_pages`) and, for the batch, CSR arrays: ``indices`` (the page ids, request
after request), ``indptr`` (``[B + 1]``: request ``i`` owns entries ``indptr[i] ..
indptr[i + 1] - 1``), ``last_page_len`` (``[B]``) and, for queries, ``qo_indptr``. Its
wrappers ``plan`` once per batch on the host (how to split the work into thread blocks) and
``run`` once per layer: hence the backend's ``prepare`` per batch and ``forward`` per layer.
The prefill wrapper serves batches with several new tokens per request (causal mask aligned
to each sequence's end), the decode wrapper one token per request; decode also runs inside a
CUDA graph over fixed arrays (:meth:`FlashInferBackend.enable_cuda_graphs`). Where
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

from minisgl.attention.base import AttnMetadata, BaseAttnBackend, BatchLayout
from minisgl.attention.utils import indptr_tensor
from minisgl.kvcache.mha_pool import MHAKVPool
from minisgl.kvcache.page_table import PageTable, pages_for
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


def page_arrays(page_table: PageTable, layout: BatchLayout, spares: int = 0) -> dict[str, Any]:
    """The CSR description of where each request's keys are (pages, not token slots), on the
    host: FlashInfer's ``indptr``, ``indices``, ``last_page_len`` and ``qo_indptr``. With
    ``spares``, that many copies of the last page id follow the batch's ``indices``."""
    page_size = page_table.page_size
    totals = np.add(layout.cached_lens, layout.new_lens)  # keys each request attends over
    num_pages = pages_for(totals, page_size)
    ids = np.empty(int(num_pages.sum()) + spares, dtype=np.int32)
    end = 0
    # A slice per request: its row's first pages (prepare checked that the row holds them).
    for row, count in zip(layout.rows, num_pages.tolist()):
        ids[end:end + count] = page_table.page_ids[row, :count]
        end += count
    ids[end:] = ids[end - 1]
    return {
        "page_indptr": indptr_tensor(num_pages),
        "page_indices": torch.from_numpy(ids),
        # tokens in each request's last page: between 1 and page_size
        "last_page_lens": torch.from_numpy((totals - (num_pages - 1) * page_size).astype(np.int32)),
        "qo_indptr": indptr_tensor(layout.new_lens),
    }


def piece_arrays(page_table: PageTable, layout: BatchLayout, num_pieces: int,
                 spares: bool = False) -> dict[str, Any]:
    """:func:`page_arrays` for a decode batch :mod:`minisgl.layers.fast` cuts into at most
    ``num_pieces`` pieces: one entry per piece, and the pieces' ``query_rows``. With
    ``spares``, exactly ``num_pieces`` entries (a captured graph's count): the pieces left
    over read one token of the batch's last page, and no request merges them."""
    arrays = page_arrays(page_table, layout, spares=num_pieces if spares else 0)
    num_pages = np.diff(arrays["page_indptr"].numpy()).astype(np.int64)
    pages, last_lens, owners, piece_indptr = fast.paths.cut_into_pieces(
        num_pages, arrays["last_page_lens"].numpy().astype(np.int64), page_table.page_size,
        num_pieces)
    if spares:
        spare = num_pieces - len(pages)
        arrays["page_indices"] = arrays["page_indices"][: int(num_pages.sum()) + spare]  # a view
        pages = np.concatenate([pages, np.ones(spare, dtype=np.int64)])
        last_lens = np.concatenate([last_lens, np.ones(spare, dtype=np.int64)])
        owners = np.concatenate([owners, np.zeros(spare, dtype=np.int64)])
    arrays.update(page_indptr=indptr_tensor(pages),
                  last_page_lens=torch.from_numpy(last_lens.astype(np.int32)),
                  query_rows=QueryRows(owners=torch.from_numpy(owners.astype(np.int32)),
                                       indptr=torch.from_numpy(piece_indptr.astype(np.int32))))
    return arrays


@dataclass(frozen=True)
class PageArrays:
    """The fixed device arrays a captured decode batch's kernel reads its pages from, int32:
    ``indptr`` (at least ``B + 1``), ``indices`` (every page of ``B`` requests) and
    ``last_page_lens`` (at least ``B``)."""

    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_lens: torch.Tensor


class FlashInferBackend(BaseAttnBackend):
    """FlashInfer paged prefill and decode over the engine's KV pool.

    Args:
        kv_pool: the KV pool; must be on a CUDA device, in float16 or bfloat16.
        page_table: the page table (same page size and device as the pool).
        num_qo_heads: query heads on this device.
        workspace_bytes: size of FlashInfer's float scratch buffer.
        workspace: a scratch buffer to share instead (see :meth:`sibling`).
        fixed_plans: decode on tensor cores with each request's keys in one chunk, a plan that
            depends on the batch size alone: a size planned when its graph was captured serves
            any later batch of it once the page arrays are written (chapter 23's draft steps
            write them all at once). For short sequences, such as a draft model's; long ones
            lose the chunks' parallelism.
    """

    name = "flashinfer"

    def __init__(self, kv_pool: MHAKVPool, page_table: PageTable, num_qo_heads: int,
                 workspace_bytes: int = WORKSPACE_BYTES,
                 workspace: torch.Tensor | None = None, fixed_plans: bool = False) -> None:
        super().__init__(kv_pool, page_table, num_qo_heads)
        check_flashinfer_supports(self.device, kv_pool.dtype, self.head_dim)
        self._flashinfer = flashinfer = import_flashinfer()
        # A decode query is one row, too thin for a tensor-core product; with GQA the query
        # heads sharing a KV head stack into a taller block, which pays off from a group of
        # about 4 (SGLang's and upstream mini-sglang's threshold). Pieces (chapter 20) are cut
        # for the CUDA-core kernel only: a captured batch of 1,024 pieces would need more
        # scratch on tensor cores than the workspace holds.
        self.use_tensor_cores = fixed_plans or self.num_qo_heads // self.num_kv_heads >= 4
        self.fixed_plans = fixed_plans
        # Zeros: FlashInfer requires the workspace to start zeroed.
        self._workspace = workspace if workspace is not None else torch.zeros(
            workspace_bytes, dtype=torch.uint8, device=self.device)
        # "fa2" rather than "auto", which would pick the FA3 kernels on Hopper GPUs: FA2 runs on
        # every GPU FlashInfer supports, compiles quicker, and upstream mini-sglang found FA3
        # slower for its workloads.
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, kv_layout="NHD", backend="fa2")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, kv_layout="NHD", use_tensor_cores=self.use_tensor_cores)
        # captured batch size -> its decode wrapper over fixed arrays, its fixed query rows
        # and its number of pieces
        self._graph_wrappers: dict[int, tuple[Any, QueryRows | None, int]] = {}
        self._planned_sizes: set[int] = set()  # captured sizes planned once (fixed_plans)
        # plan() stages its arrays in pinned host memory and copies them to the GPU
        # asynchronously. Planning again before that copy ran would overwrite the staging
        # memory under it, so each plan waits for the previous one's copy (see _plan).
        self._plan_copied = torch.cuda.Event()
        self._plan_copied.record()

    def sibling(self, fixed_plans: bool | None = None) -> FlashInferBackend:
        """A backend over the same pool, page table and scratch memory, with plans of its own:
        batches planned on several siblings can all be planned before any of them runs
        (chapter 23's draft steps). The scratch is shared safely: kernels on one stream run one
        after another. ``fixed_plans``: the sibling's (None: this backend's)."""
        return FlashInferBackend(self.kv_pool, self.page_table, self.num_qo_heads,
                                 workspace=self._workspace,
                                 fixed_plans=self.fixed_plans if fixed_plans is None
                                 else fixed_plans)

    def _decode_pieces(self, batch_size: int) -> int:
        """Pieces a decode batch is cut into: on the CUDA-core kernel only (see __init__)."""
        return 0 if self.use_tensor_cores else fast.paths.decode_pieces(batch_size)

    def _plan(self, layout: BatchLayout, fields: dict[str, Any], static: bool) -> FIMetadata:
        if static:  # a CUDA graph's batch: its wrapper plans over fixed arrays
            wrapper, fixed_rows, num_pieces = self._graph_wrappers[layout.size]
        else:
            wrapper = self._decode if layout.is_decode else self._prefill
            num_pieces = self._decode_pieces(layout.size) if layout.is_decode else 0
        arrays = (piece_arrays(self.page_table, layout, num_pieces, spares=static)
                  if num_pieces else page_arrays(self.page_table, layout))
        rows: QueryRows | None = arrays.get("query_rows")
        if static:  # into the fixed arrays the graph's kernels read
            # Staged in pinned memory, so that the host does not wait for the device to reach
            # the copies: all in one, as each pinning costs tens of microseconds.
            host = [arrays["page_indptr"], arrays["last_page_lens"], arrays["page_indices"]]
            host += [rows.owners, rows.indptr] if rows is not None else []
            staged = torch.cat(host).pin_memory().split([len(array) for array in host])
            arrays["page_indptr"], arrays["last_page_lens"] = staged[:2]  # plan() copies these
            self._graph_page_indices[: len(staged[2])].copy_(staged[2], non_blocking=True)
            arrays["page_indices"] = self._graph_page_indices[:0]  # nothing for plan() to copy
            if rows is not None:
                fixed_rows.owners.copy_(staged[3], non_blocking=True)
                fixed_rows.indptr.copy_(staged[4], non_blocking=True)
                arrays["query_rows"] = fixed_rows
        else:
            arrays["page_indices"] = host_to_device(arrays["page_indices"], self.device)
            if rows is not None:
                arrays["query_rows"] = QueryRows(host_to_device(rows.owners, self.device),
                                                 host_to_device(rows.indptr, self.device))
        meta = FIMetadata(**fields, **arrays, wrapper=wrapper)
        if static and self.fixed_plans and layout.size in self._planned_sizes:
            # The plan made when this size's graph was captured holds for any lengths: only
            # the arrays change, and they go where plan() would have copied them.
            self._graph_indptr[: len(meta.page_indptr)].copy_(meta.page_indptr, non_blocking=True)
            self._graph_last_lens[: len(meta.last_page_lens)].copy_(meta.last_page_lens,
                                                                    non_blocking=True)
            return meta
        # plan(): the wrapper looks at the batch's lengths and splits the work, once a batch.
        # It stages its own arrays in pinned memory, so it waits for the last plan's copy.
        self._plan_copied.synchronize()
        common = {"num_qo_heads": self.num_qo_heads, "num_kv_heads": self.num_kv_heads,
                  "page_size": self.page_size, "q_data_type": self.kv_pool.dtype,
                  "kv_data_type": self.kv_pool.dtype}
        if layout.is_decode:
            if self.fixed_plans:  # one chunk per request: no split, no merge
                common["disable_split_kv"] = True
            wrapper.plan(meta.page_indptr, meta.page_indices, meta.last_page_lens,
                         head_dim=self.head_dim, **common)
        else:
            # causal=True masks each request's queries against the END of its keys: query t of
            # T new tokens sees keys 0 .. total_len - T + t, so a cached prefix needs no more.
            wrapper.plan(meta.qo_indptr, meta.page_indptr, meta.page_indices,
                         meta.last_page_lens, head_dim_qk=self.head_dim, causal=True, **common)
        self._plan_copied.record()
        if static:
            self._planned_sizes.add(layout.size)
        return meta

    def _attend(self, q: torch.Tensor, layer_id: int, meta: AttnMetadata) -> torch.Tensor:
        assert isinstance(meta, FIMetadata)
        kv_pages = self.kv_pool.kv_pages(layer_id)  # the layer's pool page by page: no copy
        if meta.query_rows is None:
            return meta.wrapper.run(q.contiguous(), kv_pages)
        # A row per piece: the merge weighs the pieces' outputs by their log-sum-exp.
        out, lse = meta.wrapper.run(q, kv_pages, return_lse=True)
        return fast.paths.merge_pieces(out, lse, meta.query_rows.indptr)

    def enable_cuda_graphs(self, batch_sizes: Sequence[int],
                           arrays: PageArrays | None = None) -> None:
        """Give each decode batch size to be captured a wrapper over fixed arrays.

        A CUDA graph records the addresses its kernels read, so the page arrays of a captured
        batch size live in tensors made here, once, or in ``arrays`` (a caller that writes
        them itself: chapter 23's draft steps); planning a batch for it (``prepare`` with
        ``out``) copies the batch's arrays into them. All sizes share one set: only one graph
        runs at a time.
        """
        pieces = {bs: self._decode_pieces(bs) for bs in batch_sizes}
        max_bs = max(batch_sizes)
        max_entries = max(max_bs, *pieces.values())
        if arrays is None:
            arrays = PageArrays(
                indptr=torch.zeros(max_entries + 1, dtype=torch.int32, device=self.device),
                indices=torch.zeros(max_bs * self.page_table.max_pages_per_req
                                    + max(pieces.values()), dtype=torch.int32,
                                    device=self.device),
                last_page_lens=torch.zeros(max_entries, dtype=torch.int32, device=self.device))
        elif max_entries > max_bs:
            raise ValueError("a caller's page arrays hold one entry per request: they cannot "
                             "serve a decode cut into pieces (use tensor cores)")
        indptr, indices, last_lens = arrays.indptr, arrays.indices, arrays.last_page_lens
        self._graph_indptr, self._graph_page_indices, self._graph_last_lens = (
            indptr, indices, last_lens)
        for bs, num_pieces in pieces.items():
            entries = num_pieces or bs  # the kernel's requests: pieces, or the batch's
            wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, kv_layout="NHD", use_cuda_graph=True,
                use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=indptr[: entries + 1], paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last_lens[:entries])
            clear_plan_staging(wrapper)
            rows = QueryRows(
                owners=torch.zeros(num_pieces, dtype=torch.int32, device=self.device),
                indptr=torch.zeros(bs + 1, dtype=torch.int32, device=self.device),
            ) if num_pieces else None
            self._graph_wrappers[bs] = (wrapper, rows, num_pieces)


def clear_plan_staging(wrapper: Any) -> None:
    """Zero the pinned host memory a CUDA-graph wrapper stages its plans in.

    With ``fixed_plans`` (tensor cores, no split), a captured batch's kernel launches a fixed
    grid of blocks, one per entry of a work list, but ``plan()`` fills in the list's real
    entries only and copies the whole list from this memory to the device (FlashInfer 0.6.5,
    ``PrefillPlan``; a split plan marks the other blocks idle instead). The other blocks read
    whatever the memory held before. Newly pinned memory holds zeros, so they redo entry 0's
    work and write the same values again. Memory freed by another wrapper (an engine dropped
    earlier in the process) holds its plans: request numbers past this batch, and the kernel
    reads out of bounds. (FlashInfer issue 4002; a fix that launches only the real entries was
    proposed there.)
    """
    staging = getattr(wrapper, "_pin_memory_int_workspace_buffer", None)
    if staging is not None:
        staging.zero_()


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
