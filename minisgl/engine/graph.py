"""CUDA graphs for decode steps: record the kernels once, replay them every step.

A small model's decode step is short on the GPU and long on the CPU, which launches hundreds
of kernels a token. A captured graph replays them all with one launch; the price is that it
knows only the addresses and shapes it recorded. So the engine keeps a step's inputs and
logits in :class:`GraphInputs`, made once (and the attention backend its page arrays), one
graph is captured per batch size, a batch is padded up to the next captured size with entries
in a padding row whose one page nobody owns (:func:`~minisgl.attention.base.pad_batch`), and
only decode batches qualify. Graphs are off on a CPU, when ``cuda_graph`` says so, or when the backend cannot be
captured; the runner then says why. Chapter 8 tells the story.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from minisgl.attention import BatchLayout
from minisgl.engine.config import EngineConfig
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
    return list(config.cuda_graph_batch_sizes or default_capture_sizes(config.graph_max_bs))


def padded_batch_size(batch_size: int, capture_sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds ``batch_size`` requests; None if none does.

    ``capture_sizes`` must be sorted. A batch larger than every captured size runs eagerly.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    i = bisect_left(capture_sizes, batch_size)
    return capture_sizes[i] if i < len(capture_sizes) else None


def cuda_graph_disabled_reason(enabled: bool, device: torch.device,
                               attn_backend: str) -> str | None:
    """Why decode steps cannot be captured here, or None when they can."""
    if not enabled:
        return "turned off by the cuda_graph setting"
    if device.type != "cuda":
        return (f"the device is {device.type}: a CUDA graph records CUDA kernel launches, so "
                "it needs a CUDA GPU")
    if attn_backend != "flashinfer":
        return (f"the {attn_backend} attention backend cannot be captured (it builds new "
                "metadata tensors every step); the flashinfer backend can")
    return None


@dataclass(frozen=True)
class GraphInputs:
    """The memory captured decode steps read their inputs from and write their logits to.

    A replay changes these tensors' contents, never their addresses. ``fields`` holds what
    the attention backend's ``prepare`` computes for a batch of ``bs`` tokens: positions in
    ``fields[:bs]``, slots in ``fields[bs:2 * bs]``, last indices after them.
    """

    input_ids: torch.Tensor  # [max_bs] int64
    fields: torch.Tensor  # [3 * max_bs] int64
    logits: torch.Tensor  # [max_bs, vocab] float32

    @classmethod
    def allocate(cls, max_bs: int, vocab_size: int, device: torch.device) -> GraphInputs:
        return cls(torch.zeros(max_bs, dtype=torch.int64, device=device),
                   torch.zeros(3 * max_bs, dtype=torch.int64, device=device),
                   torch.zeros(max_bs, vocab_size, dtype=torch.float32, device=device))


class GraphRunner:
    """Captures the engine's decode step for a list of batch sizes and replays it.

    Args:
        batch_sizes: the batch sizes to capture, at least one (``capture_batch_sizes`` of a
            checked config).
        device: the CUDA device.
        prepare: ``prepare(bs)`` readies a batch of ``bs`` padding entries in the fixed
            memory (outside the graph: planning runs on the host).
        run: ``run(bs)`` is the step a graph records: the model over the fixed inputs.

    Use :meth:`disabled` for a runner that replays nothing.
    """

    # What a runner that captured nothing keeps (see :meth:`disabled`).
    disabled_reason: str | None = None
    batch_sizes: tuple[int, ...] = ()
    max_batch_size = 0  # the largest captured size
    capture_seconds = 0.0

    def __init__(self, batch_sizes: Sequence[int], device: torch.device,
                 prepare: Callable[[int], object], run: Callable[[int], None]) -> None:
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.max_batch_size = self.batch_sizes[-1]
        # batch size -> the captured size that serves it, looked up once per step
        self._padded_size = [0] + [padded_batch_size(b, self.batch_sizes)
                                   for b in range(1, self.max_batch_size + 1)]
        self.device = device
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture_all(prepare, run)

    @classmethod
    def disabled(cls, reason: str) -> GraphRunner:
        """A runner that captures and replays nothing; ``disabled_reason`` says why."""
        runner = cls.__new__(cls)
        runner.disabled_reason, runner.graphs = reason, {}
        logger.info("CUDA graphs: off (%s); decode steps run eagerly", reason)
        return runner

    @property
    def enabled(self) -> bool:
        return self.disabled_reason is None

    @torch.no_grad()
    def _capture_all(self, prepare: Callable[[int], object], run: Callable[[int], None]) -> None:
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
            prepare(bs)  # redone before every replay, with the real batch
            # Warm up once eagerly on the capture stream: lazy initialisation (cuBLAS handles
            # and workspaces, kernel compilation) must not happen inside the capture.
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                run(bs)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    run(bs)
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

    def size_for(self, batch: BatchLayout) -> int | None:
        """The captured size that replays ``batch``: None unless it is a decode batch no
        larger than the largest captured size."""
        if not batch.is_decode or batch.size > self.max_batch_size:  # 0 when disabled
            return None
        return self._padded_size[batch.size]

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
