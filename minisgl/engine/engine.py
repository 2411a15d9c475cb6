"""The engine: one batched forward step over the paged KV cache, and nothing more.

:class:`Engine` loads the model, sizes the KV pool from the memory left (free GPU memory times
``memory_fraction``, or a fixed budget on a CPU), and builds the pool, the one owner of its pages
and rows (``engine.pages``), the attention backend, the token pool that keeps every running
request's token ids on the device, and the CUDA-graph runner. :meth:`Engine.forward` runs one
:class:`~minisgl.core.Batch`: input ids from the token pool, the model (replayed from a graph
when one serves the batch), one sampled token per request. Which requests run, and their
lengths, are the caller's business. Under tensor parallelism each rank runs an engine over its
share of the heads; rank 0's samples are everyone's. Chapter 7 tells the story.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
from dataclasses import dataclass

import torch

from minisgl.attention import (BatchLayout, create_attention_backend, pad_batch,
                               resolve_attention_backend)
from minisgl.core import Batch
from minisgl.distributed import get_tp_info
from minisgl.distributed.group import broadcast_from_rank0, device_for_rank, min_over_ranks
from minisgl.engine.config import EngineConfig
from minisgl.engine.graph import (GraphInputs, GraphRunner, capture_batch_sizes,
                                  cuda_graph_disabled_reason)
from minisgl.engine.adjustments import adjust_logits
from minisgl.engine.logprobs import PromptRows, batch_logprobs
from minisgl.engine.sample import make_generator, sample_batch
from minisgl.engine.token_pool import TokenPool
from minisgl.grammar.states import TokenBitmask
from minisgl.kvcache import MHAKVPool, RequestPages
from minisgl.kvcache.page_table import pages_for
from minisgl.layers.attention import use_attention_backend
from minisgl.layers.base import local_kv_heads
from minisgl.models import load_model
from minisgl.models.config import ModelConfig
from minisgl.utils.logger import get_logger
from minisgl.utils.torch_utils import host_to_device, resolve_device, resolve_dtype

logger = get_logger(__name__)


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


class Engine:
    """Loads a model and runs batched forward steps over a paged KV cache.

    Args:
        config: the settings (see :class:`~minisgl.engine.config.EngineConfig`).

    Attributes:
        model: the loaded model, in eval mode.
        kv_budget: how the KV pool was sized.
        kv_pool: the paged KV cache.
        pages: the one owner of the pool's pages and the page table's rows.
        attn_backend: the paged attention backend.
        max_seq_len: the longest sequence one request may reach.
        graph_runner: the CUDA-graph runner for decode steps.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # Under tensor parallelism this process is one rank (GPU r for rank r).
        self.tp = get_tp_info()
        self.device = device_for_rank(resolve_device(config.device), self.tp.rank, self.tp.size)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if self.device.type == "cuda":
            if self.device.index is None:  # "cuda" means the current device: name it
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)  # FlashInfer and CUDA graphs use the current one
        self.model = load_model(config.model_path, self.device, self.dtype)
        self.model_config: ModelConfig = self.model.config
        self.eos_token_ids = self.model_config.eos_token_ids
        # The attention heads this device holds (all of them unless tensor-parallel): what
        # the KV pool stores and the attention backend computes.
        self.rank_config = dataclasses.replace(
            self.model_config, num_qo_heads=self.model_config.num_qo_heads // self.tp.size,
            num_kv_heads=local_kv_heads(self.model_config.num_kv_heads, self.tp.size))

        limit = self.model_config.max_position_embeddings
        model_max_len = config.max_seq_len or limit
        if model_max_len > limit:
            raise ValueError(f"max_seq_len {model_max_len} exceeds the model's "
                             f"max_position_embeddings ({limit}): its rotary table stops there")
        # Size the cache *after* loading the model: what the weights took is no longer free.
        self.kv_budget = self._plan_kv_budget(max_pages_per_req=pages_for(model_max_len,
                                                                          config.page_size))
        self.kv_pool = MHAKVPool.from_config(self.rank_config, self.kv_budget.num_pages,
                                             config.page_size, self.dtype, self.device)
        # One request can never outgrow the pool, so neither may its page-table row.
        self.max_seq_len = min(model_max_len, self.kv_budget.num_tokens)
        backend = resolve_attention_backend(config.attention_backend, self.device, self.dtype,
                                            self.rank_config.head_dim)
        no_graphs = cuda_graph_disabled_reason(config.cuda_graph, self.device, backend)
        # With CUDA graphs, one row more: the padding row (see _make_graph_runner).
        num_rows = config.max_running_reqs + (no_graphs is None)
        self.pages = RequestPages(self.kv_budget.num_pages, num_rows, self.max_seq_len,
                                  page_size=config.page_size, device=self.device)
        self.attn_backend = create_attention_backend(
            backend, self.kv_pool, self.pages.table, self.rank_config.num_qo_heads,
            fixed_plans=config.fixed_plans)
        # The token ids of every row, on the device, so that a step can be launched
        # before the host has read the tokens the step before sampled.
        self.token_pool = TokenPool(num_rows, self.max_seq_len, self.device)
        self._log_kv_budget()
        self.graph_runner = self._make_graph_runner(no_graphs)

    def _plan_kv_budget(self, max_pages_per_req: int) -> KVBudget:
        """Decide the pool's memory: a fixed page count, free GPU memory, or the CPU setting.

        Then lower it to the smallest budget any rank can hold: every rank makes the same
        paging decisions, so every rank must have the same pages.
        """
        config, free = self.config, None
        if config.num_pages is not None:
            bytes_per_page = self.rank_config.kv_bytes_per_token(self.dtype) * config.page_size
            budget, source = config.num_pages * bytes_per_page, "the num_pages setting"
        elif self.device.type == "cuda":
            free = free_device_memory(self.device)
            budget = int(free * config.memory_fraction)
            source = (f"{config.memory_fraction:g} x {free / 2**30:.2f} GiB free on "
                      f"{self.device} after loading the model")
        else:
            assert config.cpu_kv_memory is not None  # EngineConfig read it from the environment
            budget, source = config.cpu_kv_memory, "cpu_kv_memory (MINISGL_CPU_KV_MEMORY)"
        # More pages than every row of the page table can map would never be used (+1: the
        # spare page the CUDA graphs pad their batches with).
        max_useful = config.max_running_reqs * max_pages_per_req + 1
        plan = plan_kv_budget(budget, source, self.rank_config, self.dtype, config.page_size,
                              max_useful, free_bytes=free)
        agreed = min_over_ranks(plan.num_pages)
        if agreed < plan.num_pages:
            plan = dataclasses.replace(
                plan, num_pages=agreed,
                source=f"{plan.source}, lowered to the smallest of {self.tp.size} ranks")
        return plan

    def _log_kv_budget(self) -> None:
        b = self.kv_budget
        logger.info("KV budget: %s = %.1f MiB", b.source, b.budget_bytes / 2**20)
        logger.info("KV pool: %d pages x %d tokens = %d tokens x %d bytes = %.1f MiB%s; "
                    "max_seq_len %d", b.num_pages, b.page_size, b.num_tokens, b.bytes_per_token,
                    b.pool_bytes / 2**20,
                    " (capped: enough for every page-table row)" if b.capped else "",
                    self.max_seq_len)

    def _make_graph_runner(self, disabled_reason: str | None) -> GraphRunner:
        """Capture decode steps as CUDA graphs, or say why not.

        The runner is built in either case; a disabled one replays nothing, so every batch
        runs eagerly, and its ``disabled_reason`` says why.
        """
        if disabled_reason is not None:
            return GraphRunner.disabled(disabled_reason)
        sizes = capture_batch_sizes(self.config)
        # A row whose one page no request will ever own: padding entries write there.
        self.pad_row = self.pages.padding_row()
        self.graph_inputs = GraphInputs.allocate(max(sizes), self.model_config.vocab_size,
                                                 self.device)
        self.attn_backend.enable_cuda_graphs(sizes)
        return GraphRunner(sizes, self.device, run=self._run_graph_inputs,
                           prepare=lambda bs: self._load_graph_inputs(
                               None, bs, self.graph_inputs.input_ids[:0]))

    # ----------------------------------------------------------------------- one forward step
    @torch.no_grad()
    def forward(self, batch: Batch, use_graph: bool = True, return_logprobs: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """One step: the model over every request's new tokens, and one sampled token each.

        Afterwards the K/V of every token fed are in the pool, and each sample is written into
        the token pool after its request's tokens, where the next step reads it. The requests'
        lengths are the caller's to move on (:meth:`Batch.advance`): the engine computes and
        decides nothing. ``use_graph=False`` runs a decode step eagerly even where a CUDA
        graph could serve it.

        Returns:
            ``[B]`` int64 next-token ids, one per request, in batch order, on the device; with
            ``return_logprobs``, also the logprobs its requests asked for
            (:func:`~minisgl.engine.logprobs.batch_logprobs`, chapter 21).
        """
        prompt = PromptRows.of(batch) if return_logprobs else None  # chapter 21
        logits = self.logits(batch, use_graph, None if prompt is None else prompt.rows)
        prompt_logits = logits[batch.size:]
        tokens = self.sample(batch, logits[:batch.size])
        if not return_logprobs:
            return tokens
        return tokens, batch_logprobs(logits[:batch.size], tokens, batch, prompt, prompt_logits)

    @torch.no_grad()
    def logits(self, batch: Batch, use_graph: bool = True,
               extra_rows: list[int] | None = None) -> torch.Tensor:
        """The ``[B, vocab]`` float32 logits of each request's last new token.

        The input ids come from the token pool. A decode batch that a captured CUDA graph can
        serve is replayed (unless ``use_graph`` is False); any other batch runs eagerly: the
        backend plans it, and the model scores only the rows ``last_indices`` points at, then
        ``extra_rows`` of the packed tokens (chapter 21: a prompt's logprobs), after them.
        """
        for req in batch.reqs:  # that its pages cover every position is checked with the slots
            if req.table_row is None:
                raise ValueError(f"request {req.uid} has no pages for its {req.num_tokens} "
                                 "tokens: call engine.pages.reserve(req) before running it")
        return self.layout_logits(batch, self.token_pool.input_ids(batch), use_graph,
                                  extra_rows)

    @torch.no_grad()
    def layout_logits(self, layout: BatchLayout, input_ids: torch.Tensor, use_graph: bool = True,
                      extra_rows: list[int] | None = None) -> torch.Tensor:
        """:meth:`logits` of any :class:`~minisgl.attention.BatchLayout` fed ``input_ids``.

        A :class:`~minisgl.core.Batch` is one layout; chapter 23's verify pass is another,
        a decode-shaped layout in which every token it checks is an entry of its own, so that
        the decode graphs serve it too.
        """
        if use_graph and (bs := self.graph_runner.size_for(layout)) is not None:
            return self.replay(layout, input_ids, bs=bs)
        meta = self.attn_backend.prepare(layout)
        rows = meta.last_indices
        if extra_rows:
            extra = torch.tensor(extra_rows, dtype=rows.dtype)
            rows = torch.cat([rows, host_to_device(extra, rows.device)])
        with use_attention_backend(self.attn_backend):
            return self.model.forward(input_ids, meta.positions, rows)

    def replay(self, batch: BatchLayout, input_ids: torch.Tensor, launched: bool = False,
               bs: int | None = None) -> torch.Tensor:
        """The logits of a decode batch, from the CUDA graph captured for its padded size.

        The batch is padded and written into the fixed memory (ids here; positions, slots and
        page arrays by the backend's ``prepare``); nothing is allocated on the device. The
        result is a view of the fixed logits: the next replay overwrites it. ``launched=True``
        runs the same padded batch, memory and plan with the kernels launched one by one
        instead of from the graph (tests show the two are equal bit for bit). ``bs``: the
        captured size, when the caller has looked it up already.
        """
        bs = bs or self.graph_runner.size_for(batch)
        if bs is None:
            kind = "decode" if batch.is_decode else "prefill"
            raise ValueError(f"no captured graph serves a {kind} batch of {batch.size} "
                             f"(captured decode sizes: {self.graph_runner.batch_sizes or 'none'})")
        self._load_graph_inputs(batch, bs, input_ids)
        if launched:
            self._run_graph_inputs(bs)
        else:
            self.graph_runner.graphs[bs].replay()
        return self.graph_inputs.logits[: batch.size]

    def _load_graph_inputs(self, batch: BatchLayout | None, bs: int,
                           input_ids: torch.Tensor) -> None:
        """Write ``batch`` (None: no requests) and its ``input_ids``, padded to ``bs``, into the
        fixed memory the graph of ``bs`` reads."""
        self.attn_backend.prepare(pad_batch(batch, bs, self.pad_row),
                                  out=self.graph_inputs.fields)
        real = input_ids.shape[0]
        self.graph_inputs.input_ids[:real].copy_(input_ids)
        self.graph_inputs.input_ids[real:bs].zero_()  # padding reads token 0

    def _run_graph_inputs(self, bs: int) -> None:
        """The step a graph records: the model over the first ``bs`` fixed inputs. Every row is
        one request's one new token, so every row is scored."""
        g = self.graph_inputs
        with use_attention_backend(self.attn_backend):
            self.model.forward(g.input_ids[:bs], g.fields[:bs], out=g.logits[:bs])

    def input_ids(self, batch: Batch) -> torch.Tensor:
        """The ``[T]`` token ids ``batch`` feeds, on the device, gathered from the token pool."""
        return self.token_pool.input_ids(batch)

    def sample(self, batch: Batch, logits: torch.Tensor) -> torch.Tensor:
        """One token per row of ``logits``, each with its request's parameters and generator,
        written into the token pool after each request's fed tokens.

        With several tensor-parallel ranks, rank 0 samples and the others receive its tokens, so
        every rank's requests continue with the same token whatever their logits' last bits.
        """
        if self.tp.rank == 0:
            for req in batch.reqs:  # a seeded request's own stream starts at its first sample
                if req.params.seed is not None and req.generator is None:
                    req.generator = make_generator(req.params.seed, self.device)
            if any(req.params.adjusts_logits for req in batch.reqs):  # chapter 21
                logits = adjust_logits(logits, batch, self.token_pool, self.eos_token_ids)
            if any(req.grammar is not None for req in batch.reqs):  # chapter 22: last, it wins
                logits = self.grammar_bitmask.apply(logits, [req.grammar for req in batch.reqs])
            tokens = sample_batch(logits, [req.params for req in batch.reqs],
                                  [req.generator for req in batch.reqs])
        else:
            tokens = torch.empty(len(batch.reqs), dtype=torch.int64, device=self.device)
        if self.tp.size > 1:
            tokens = broadcast_from_rank0(tokens)
        self.token_pool.store_samples(batch, tokens)
        return tokens

    @functools.cached_property
    def grammar_bitmask(self) -> TokenBitmask:
        """The allowed-token bits of a batch's constrained rows (chapter 22), allocated at the
        first one: an engine that never sees a grammar never holds it."""
        return TokenBitmask(self.token_pool.ids.shape[0], self.model_config.vocab_size,
                            self.device)

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
    return torch.cuda.mem_get_info(device)[0]  # (free, total)
