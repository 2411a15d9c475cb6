"""The engine: one batched forward step over the paged KV cache, and nothing more.

Chapters 2 to 6 built the parts: a model that takes a flat sequence of tokens with their
positions, a sampler, a KV pool split into pages, a page table, attention backends that read
the pages. The :class:`Engine` puts them together and owns them:

1. **start-up**: load the model, size the KV pool from what memory is left (free GPU memory
   times ``memory_fraction``, or a fixed budget on a CPU), build the pool, the owner of its
   pages and rows (:class:`~minisgl.kvcache.request_pages.RequestPages`: the page allocator and
   the page table together) and the attention backend;
2. **pages for requests**: not the engine's business beyond building their owner:
   ``engine.pages.reserve(req)`` gives a request a row and the pages its next forward pass
   writes to, ``engine.pages.release(req)`` takes them back. Whoever decides which requests
   run (an example's loop, chapter 9's scheduler) asks ``engine.pages``; the engine only
   checks that every request of a batch has its pages;
3. **a step**: :meth:`Engine.forward` packs a :class:`~minisgl.core.Batch` of requests into one
   flat input, lets the attention backend prepare the batch's metadata (slots, positions, the
   rows to score), runs the model once and samples one token per request, each with its own
   sampling parameters.

The engine decides nothing about *which* requests run together or when: that is the
scheduler's job (chapter 9), which calls these methods. Examples and tests of this chapter call
them by hand.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Protocol

import torch

from minisgl.attention import create_attention_backend
from minisgl.attention.utils import pages_for
from minisgl.core import Batch
from minisgl.engine.config import EngineConfig
from minisgl.engine.sample import make_generator, sample_batch
from minisgl.kvcache import MHAKVPool, RequestPages
from minisgl.layers.attention import use_attention_backend
from minisgl.models import load_model
from minisgl.models.config import ModelConfig
from minisgl.utils.logger import get_logger
from minisgl.utils.torch_utils import resolve_device, resolve_dtype

logger = get_logger(__name__)

GiB = 2**30


@dataclass(frozen=True)
class KVBudget:
    """How the KV pool was sized: the budget, where it came from, and what it buys.

    Attributes:
        source: where ``budget_bytes`` came from, in words.
        budget_bytes: memory the pool may occupy.
        bytes_per_token: one token's K and V in every layer (``ModelConfig.kv_bytes_per_token``).
        page_size: token slots per page.
        num_pages: pages in the pool: the whole pages that fit in the budget, capped at what
            the page table can ever map.
        max_useful_pages: that cap: every row of the page table full, plus one spare page.
        free_bytes: CUDA only: free device memory measured after loading the model.
    """

    source: str
    budget_bytes: int
    bytes_per_token: int
    page_size: int
    num_pages: int
    max_useful_pages: int
    free_bytes: int | None = None

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size

    @property
    def num_tokens(self) -> int:
        """Token slots in the pool."""
        return self.num_pages * self.page_size

    @property
    def pool_bytes(self) -> int:
        """Memory the pool occupies: never more than the budget."""
        return self.num_pages * self.bytes_per_page

    @property
    def capped(self) -> bool:
        """True when the budget would buy more pages than the page table can use."""
        return self.num_pages == self.max_useful_pages < self.budget_bytes // self.bytes_per_page


def plan_kv_budget(budget_bytes: int, source: str, model_config: ModelConfig,
                   dtype: torch.dtype, page_size: int, max_useful_pages: int,
                   free_bytes: int | None = None) -> KVBudget:
    """Turn a memory budget into a number of pages (a pure function: no device involved)."""
    pages = MHAKVPool.num_pages_for_budget(budget_bytes, model_config, page_size, dtype)
    budget = KVBudget(source=source, budget_bytes=budget_bytes,
                      bytes_per_token=model_config.kv_bytes_per_token(dtype),
                      page_size=page_size, num_pages=min(pages, max_useful_pages),
                      max_useful_pages=max_useful_pages, free_bytes=free_bytes)
    if budget.num_pages < 1:
        raise ValueError(f"the KV budget ({source}: {budget_bytes} bytes) does not hold one page "
                         f"of {page_size} tokens x {budget.bytes_per_token} bytes; give the cache "
                         "more memory (memory_fraction on CUDA, cpu_kv_memory / "
                         "MINISGL_CPU_KV_MEMORY on CPU) or a smaller page_size")
    return budget


class DecodeGraphs(Protocol):
    """What the engine asks of a CUDA-graph runner (chapter 8's ``graph.GraphRunner``)."""

    def can_replay(self, batch: Batch) -> bool:
        """Whether ``batch`` is a decode batch small enough for a captured graph."""

    def replay(self, batch: Batch, input_ids: torch.Tensor) -> torch.Tensor:
        """Run ``batch`` through a captured graph; the ``[B, vocab]`` logits."""


class Engine:
    """Loads a model and runs batched forward steps over a paged KV cache.

    Args:
        config: the settings (see :class:`~minisgl.engine.config.EngineConfig`).

    Attributes:
        model: the loaded model, in eval mode.
        kv_budget: how the KV pool was sized.
        kv_pool: the paged KV cache (chapter 5).
        pages: the one owner of the pool's pages and the page table's rows.
        attn_backend: the paged attention backend (chapter 6).
        max_seq_len: the longest sequence one request may reach.
        graph_runner: the CUDA-graph runner for decode steps (chapter 8).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if self.device.type == "cuda":
            if self.device.index is None:  # "cuda" means the current device: name it
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)  # FlashInfer and CUDA graphs use the current one
        self.model = load_model(config.model_path, self.device, self.dtype)
        self.model_config: ModelConfig = self.model.config
        self.eos_token_ids = self.model_config.eos_token_ids

        # Size the cache *after* loading the model: what the weights took is no longer free.
        model_max_len = self._model_max_seq_len()
        self.kv_budget = self._plan_kv_budget(max_pages_per_req=pages_for(model_max_len,
                                                                          config.page_size))
        self.kv_pool = MHAKVPool.from_config(self.model_config, self.kv_budget.num_pages,
                                             config.page_size, self.dtype, self.device)
        # One request can never outgrow the pool, so neither may its page-table row.
        self.max_seq_len = min(model_max_len, self.kv_budget.num_tokens)
        self.pages = RequestPages(self.kv_budget.num_pages, config.max_running_reqs,
                                  self.max_seq_len, page_size=config.page_size,
                                  device=self.device)
        # Without tensor parallelism this device holds every query head.
        self.attn_backend = create_attention_backend(
            config.attention_backend, self.kv_pool, self.pages.table,
            self.model_config.num_qo_heads)
        self._log_kv_budget()
        self.graph_runner: DecodeGraphs | None = self._make_graph_runner()

    def _model_max_seq_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        wanted = self.config.max_seq_len
        if wanted is not None and wanted > limit:
            raise ValueError(f"max_seq_len {wanted} exceeds the model's "
                             f"max_position_embeddings ({limit}): its rotary table stops there")
        return limit if wanted is None else wanted

    def _plan_kv_budget(self, max_pages_per_req: int) -> KVBudget:
        """Decide the pool's memory: a fixed page count, free GPU memory, or the CPU setting."""
        config = self.config
        # More pages than every row of the page table can map would never be used (+1: the
        # spare page chapter 8's CUDA graphs pad their batches with).
        max_useful = config.max_running_reqs * max_pages_per_req + 1
        bytes_per_page = self.model_config.kv_bytes_per_token(self.dtype) * config.page_size
        if config.num_pages is not None:
            return plan_kv_budget(config.num_pages * bytes_per_page, "the num_pages setting",
                                  self.model_config, self.dtype, config.page_size, max_useful)
        if self.device.type == "cuda":
            free = free_device_memory(self.device)
            return plan_kv_budget(int(free * config.memory_fraction),
                                  f"{config.memory_fraction:g} x {free / GiB:.2f} GiB free on "
                                  f"{self.device} after loading the model",
                                  self.model_config, self.dtype, config.page_size, max_useful,
                                  free_bytes=free)
        assert config.cpu_kv_memory is not None  # EngineConfig filled it in from the environment
        return plan_kv_budget(config.cpu_kv_memory, "cpu_kv_memory (MINISGL_CPU_KV_MEMORY)",
                              self.model_config, self.dtype, config.page_size, max_useful)

    def _log_kv_budget(self) -> None:
        b = self.kv_budget
        logger.info("KV budget: %s = %.1f MiB", b.source, b.budget_bytes / 2**20)
        logger.info("KV pool: %d pages x %d tokens = %d tokens x %d bytes = %.1f MiB%s; "
                    "max_seq_len %d", b.num_pages, b.page_size, b.num_tokens, b.bytes_per_token,
                    b.pool_bytes / 2**20,
                    " (capped: enough for every page-table row)" if b.capped else "",
                    self.max_seq_len)

    def _make_graph_runner(self) -> DecodeGraphs | None:
        """Chapter 8 captures decode steps as CUDA graphs here; until then every step is eager."""
        return None

    # ----------------------------------------------------------------------- one forward step
    @torch.no_grad()
    def forward(self, batch: Batch, use_graph: bool = True) -> torch.Tensor:
        """One step: the model over every request's new tokens, and one sampled token each.

        Afterwards the K/V of every token fed are in the pool. The requests' lengths are the
        caller's to move on (:meth:`Batch.advance`): the engine computes and decides nothing.
        ``use_graph=False`` runs a decode step eagerly even where a CUDA graph could serve it
        (chapter 8).

        Returns:
            ``[B]`` int64 next-token ids, one per request, in batch order, on the device.
        """
        return self.sample(batch, self.logits(batch, use_graph))

    @torch.no_grad()
    def logits(self, batch: Batch, use_graph: bool = True) -> torch.Tensor:
        """The ``[B, vocab]`` float32 logits of each request's last new token.

        The input ids are packed from the requests' token lists. A decode batch that a captured CUDA
        graph can serve is replayed (chapter 8) unless ``use_graph`` is False; any other batch runs
        eagerly: the backend plans it (:meth:`~minisgl.attention.BaseAttnBackend.prepare`), and the
        model scores only the rows ``last_indices`` points at.
        """
        for req in batch.reqs:
            if req.table_row is None or self.pages.pages_needed(req):
                raise ValueError(f"request {req.uid} has no pages for its {req.num_tokens} "
                                 "tokens: call engine.pages.reserve(req) before running it")
        input_ids = self.input_ids(batch)
        if use_graph and self.graph_runner is not None and self.graph_runner.can_replay(batch):
            return self.graph_runner.replay(batch, input_ids)
        meta = self.attn_backend.prepare(batch)
        with use_attention_backend(self.attn_backend):
            return self.model.forward(input_ids, meta.positions, meta.last_indices)

    def input_ids(self, batch: Batch) -> torch.Tensor:
        """The ``[T]`` token ids ``batch`` feeds, packed from the requests' lists, on the device."""
        ids = torch.tensor(batch.new_token_ids(), dtype=torch.int64)
        return ids.to(self.device, non_blocking=True)

    def sample(self, batch: Batch, logits: torch.Tensor) -> torch.Tensor:
        """One token per row of ``logits``, each with its request's parameters and generator."""
        for req in batch.reqs:  # a seeded request's own stream starts at its first sample
            if req.params.seed is not None and req.generator is None:
                req.generator = make_generator(req.params.seed, self.device)
        return sample_batch(logits, [req.params for req in batch.reqs],
                            [req.generator for req in batch.reqs])

    # ----------------------------------------------------------------------- bookkeeping
    def __repr__(self) -> str:
        name = ", ".join(self.model_config.architectures) or self.model_config.model_type
        return (f"Engine({name} on {self.device}, {str(self.dtype)[6:]}, "
                f"{self.kv_budget.num_pages} pages x {self.kv_budget.page_size} tokens, "
                f"{self.attn_backend.name} attention)")


def free_device_memory(device: torch.device) -> int:
    """Bytes free on a CUDA device, after returning PyTorch's cached blocks to it.

    PyTorch keeps freed blocks in its own cache; they count as used for ``mem_get_info`` until
    ``empty_cache`` hands them back. Collecting garbage first frees tensors that only a
    reference cycle still held (an engine built earlier in the same process, say).
    """
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info(device)
    return free
