"""CUDA graphs for decode steps: record the kernels once, replay them every step.

A small model's decode step is short on the GPU and long on the CPU, which launches hundreds
of kernels a token. A captured graph replays them all with one launch; the price is that it
knows only the addresses and shapes it recorded. So the inputs live in static buffers made at
capture (``input_ids``, the logits, and the attention backend's positions, slots and page
arrays), one graph is captured per batch size, a batch is padded up to the next captured size
with entries that read and write a spare page nobody owns, and only decode batches qualify.
Graphs are off on a CPU, when ``cuda_graph`` says so, or when the backend cannot be captured;
the runner then says why. Chapter 8 tells the story.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Sequence

import torch
from tqdm import tqdm

from minisgl.attention import BaseAttnBackend
from minisgl.core import Batch
from minisgl.engine.config import EngineConfig
from minisgl.layers.attention import use_attention_backend
from minisgl.models.base import BaseLLMModel
from minisgl.utils.logger import get_logger

logger = get_logger(__name__)


def default_capture_sizes(max_batch_size: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then every multiple of 8, up to ``max_batch_size``.

    Small batches are common and padding them doubles their work, so they get their own
    graphs; above 8 a multiple of 8 wastes at most 7 padded rows. ``max_batch_size`` itself
    is always included, so every batch up to it has a graph.
    """
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = [s for s in (1, 2, 4) if s <= max_batch_size]
    sizes += list(range(8, max_batch_size + 1, 8))
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


def capture_batch_sizes(config: EngineConfig) -> list[int]:
    """The sizes an engine captures: the explicit list of the config, or the default list."""
    if config.cuda_graph_batch_sizes is not None:
        return list(config.cuda_graph_batch_sizes)
    return default_capture_sizes(config.graph_max_bs)


def padded_batch_size(batch_size: int, capture_sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds ``batch_size`` requests; None if none does.

    ``capture_sizes`` must be sorted. A batch larger than every captured size runs eagerly.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    i = bisect_left(capture_sizes, batch_size)
    return capture_sizes[i] if i < len(capture_sizes) else None


def cuda_graph_disabled_reason(enabled: bool, device: torch.device,
                               attn_backend: BaseAttnBackend) -> str | None:
    """Why decode steps cannot be captured here, or None when they can."""
    if not enabled:
        return "turned off by the cuda_graph setting"
    if device.type != "cuda":
        return (f"the device is {device.type}: a CUDA graph records CUDA kernel launches, so "
                "it needs a CUDA GPU")
    if not attn_backend.supports_cuda_graph:
        return (f"the {attn_backend.name} attention backend cannot be captured (it builds new "
                "metadata tensors every step); the flashinfer backend can")
    return None


class GraphRunner:
    """Captures the model's decode step for a list of batch sizes and replays it.

    Args:
        model: the model (on a CUDA device).
        attn_backend: a backend with ``supports_cuda_graph`` (FlashInfer).
        batch_sizes: the batch sizes to capture.
        pad_page: a KV page no request owns, for the padding entries.
        vocab_size: width of the logits.

    Use :meth:`disabled` for a runner that replays nothing.
    """

    def __init__(self, model: BaseLLMModel, attn_backend: BaseAttnBackend,
                 batch_sizes: Sequence[int], *, pad_page: int, vocab_size: int) -> None:
        if not batch_sizes:
            raise ValueError("batch_sizes must name at least one batch size to capture")
        self.disabled_reason: str | None = None
        self.batch_sizes: tuple[int, ...] = tuple(sorted(set(batch_sizes)))
        self.max_batch_size = self.batch_sizes[-1]  # the largest captured size (0 when disabled)
        self.model = model
        self.attn_backend = attn_backend
        self.device = attn_backend.device
        max_bs = self.max_batch_size
        attn_backend.init_graph_buffers(max_bs, pad_page)
        # The graphs read their inputs from, and write their logits to, these tensors (and the
        # backend's buffers, positions among them) and no others: a replay changes their
        # contents, never their addresses. The padding rows keep token 0; their results are
        # never read.
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=self.device)
        self.logits = torch.zeros(max_bs, vocab_size, dtype=torch.float32, device=self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0
        self._capture_all()

    @classmethod
    def disabled(cls, reason: str) -> GraphRunner:
        """A runner that captures and replays nothing; ``disabled_reason`` says why."""
        runner = cls.__new__(cls)
        runner.disabled_reason = reason
        runner.batch_sizes = ()
        runner.max_batch_size = 0
        runner.graphs = {}
        runner.capture_seconds = 0.0
        logger.info("CUDA graphs: off (%s); decode steps run eagerly", reason)
        return runner

    @property
    def enabled(self) -> bool:
        return self.disabled_reason is None

    @torch.no_grad()
    def _capture_all(self) -> None:
        """Capture one graph per batch size, largest first, all in one memory pool.

        Largest first: the first capture sizes the pool for the biggest intermediate tensors,
        and each smaller graph then fits in memory the pool already holds.
        """
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        stream = torch.cuda.Stream(self.device)  # captures must not run on the default stream
        pool = None
        for bs in tqdm(sorted(self.batch_sizes, reverse=True), desc="capturing CUDA graphs",
                       unit="graph", leave=False, disable=None):
            # A batch of bs padding entries, planned outside the graph: plan() runs on the
            # CPU and is redone before every replay with the real batch.
            self.attn_backend.prepare_for_capture(bs)
            # Warm up once eagerly on the capture stream: lazy initialisation (cuBLAS handles
            # and workspaces, kernel compilation) must not happen inside the capture.
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._forward_padded(bs)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._forward_padded(bs)
            except RuntimeError as exc:
                raise RuntimeError(f"capturing the decode step for batch size {bs} failed; "
                                   "run eagerly with cuda_graph=False") from exc
            if pool is None:
                pool = graph.pool()  # the smaller graphs allocate from this one's pool
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info("CUDA graphs: captured %d decode batch sizes (%s) in %.1f s, %.0f MiB",
                    len(self.graphs), _short_list(self.batch_sizes), self.capture_seconds,
                    used / 2**20)

    def _forward_padded(self, bs: int) -> None:
        """The step a graph records: the model over the first ``bs`` rows of the buffers."""
        positions = self.attn_backend.metadata.positions  # a view of the backend's buffer
        with use_attention_backend(self.attn_backend):
            # Every row is a request's one new token, so every row is scored: no logits
            # indices needed.
            self.logits[:bs] = self.model.forward(self.input_ids[:bs], positions)

    def can_replay(self, batch: Batch) -> bool:
        """A decode batch no larger than the largest captured size."""
        return batch.is_decode and batch.size <= self.max_batch_size  # 0 when disabled

    def replay(self, batch: Batch, input_ids: torch.Tensor) -> torch.Tensor:
        """The ``[B, vocab]`` logits of the decode batch, by replaying a graph.

        The batch is padded to the next captured size. The result is a view of the static
        logits buffer: it is overwritten by the next replay, so use (or clone) it first.
        """
        bs = self._load(batch, input_ids)
        self.graphs[bs].replay()
        return self.logits[: batch.size]

    def run_padded_eagerly(self, batch: Batch, input_ids: torch.Tensor) -> torch.Tensor:
        """What :meth:`replay` computes, launched kernel by kernel instead of from the graph.

        The same padded batch, the same buffers, the same attention plan: only the graph is
        missing. Tests use it to show that a replay computes exactly what the recorded
        launches compute.
        """
        bs = self._load(batch, input_ids)
        with torch.no_grad():
            self._forward_padded(bs)
        return self.logits[: batch.size]

    def _load(self, batch: Batch, input_ids: torch.Tensor) -> int:
        """Copy the batch into the static buffers, padded; returns the graph's batch size."""
        if not self.can_replay(batch):
            raise ValueError(f"no captured graph serves a {batch.phase} batch of {batch.size} "
                             f"(captured decode sizes: {_short_list(self.batch_sizes) or 'none'})")
        bs = padded_batch_size(batch.size, self.batch_sizes)
        assert bs is not None  # can_replay checked the size
        # The backend writes the real entries' positions, slots and pages into its fixed
        # buffers and points the padding entries at the spare page; nothing is allocated.
        self.attn_backend.prepare_for_replay(batch, bs)
        self.input_ids[: batch.size].copy_(input_ids)
        self.input_ids[batch.size:bs].zero_()
        return bs

    def __repr__(self) -> str:
        if not self.enabled:
            return f"GraphRunner(disabled: {self.disabled_reason})"
        return f"GraphRunner(batch sizes {_short_list(self.batch_sizes)})"


def _short_list(sizes: Sequence[int]) -> str:
    """``1, 2, 4, 8, 16, ..., 256`` rather than 35 numbers."""
    sizes = list(sizes)
    if len(sizes) <= 6:
        return ", ".join(map(str, sizes))
    return ", ".join(map(str, sizes[:5])) + f", ..., {sizes[-1]}"
