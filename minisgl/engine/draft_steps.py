"""A draft's decode steps launched as one: no host work between them (chapter 23).

A small draft model is quick on the GPU and slow to drive from the host. Run as ordinary
steps, each of its tokens waits for the host to form a batch, reserve pages, plan attention,
replay a graph and store the sample, which at batch 1 takes several times the GPU's own work.
Yet everything that host work computes is known before the first step: a draft decodes
greedily, so step ``j`` of every request feeds position ``cached_len + j``, and its input is the
argmax of step ``j - 1``, which can stay on the device. :class:`DraftSteps` therefore reserves
the pages of all its steps at once, plans every step's attention before the first runs (each
step has a backend of its own, with its own plan and fixed arrays), and runs the steps back to
back with each argmax written where the next step reads its input: one CUDA graph per batch
size where the engine captures graphs, eagerly elsewhere. The host reads every token once, at
the end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from minisgl.attention import BatchLayout, layout_of, pad_batch
from minisgl.core import Batch
from minisgl.engine.graph import GraphRunner
from minisgl.layers.attention import use_attention_backend

if TYPE_CHECKING:  # engine.py does not import this module: no cycle at run time
    from minisgl.engine.engine import Engine

GRAPH_BATCH_SIZES = (1, 4, 16, 64, 256)  # the chained steps' captured sizes (see __init__)


class DraftSteps:
    """``num_steps`` greedy decode steps of a batch, launched together.

    Args:
        engine: the draft's engine.
        num_steps: steps per launch (a draft that guesses ``k`` tokens runs ``k + 1``).

    Attributes:
        graphs: the runner of the chained steps' graphs (disabled where the engine's is).
    """

    def __init__(self, engine: Engine, num_steps: int) -> None:
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self.engine = engine
        self.num_steps = num_steps
        if not engine.graph_runner.enabled:
            self.graphs = engine.graph_runner  # disabled, and says why
            return
        # Few sizes: each costs every step a FlashInfer wrapper of its own (8 MiB of device and
        # of pinned host memory), while padding a small draft's batch costs next to nothing.
        # The largest is capped at the most requests, so that every batch has a graph: launched
        # a kernel at a time, a draft's steps cost several times what a replay does.
        sizes = sorted({min(bs, engine.config.max_running_reqs) for bs in GRAPH_BATCH_SIZES})
        # A backend per step, each with its own plans and fixed arrays, so that every step
        # can be planned before the first one runs.
        self._backends = [engine.attn_backend.sibling() for _ in range(num_steps)]
        for backend in self._backends:
            backend.enable_cuda_graphs(sizes)
        max_bs, device = max(sizes), engine.device
        self._fields = torch.zeros(num_steps, 3 * max_bs, dtype=torch.int64, device=device)
        # Row j is step j's input; row j + 1 its argmax, which step j + 1 reads.
        self._chain = torch.zeros(num_steps + 1, max_bs, dtype=torch.int64, device=device)
        self._logits = torch.zeros(max_bs, engine.model_config.vocab_size, dtype=torch.float32,
                                   device=device)
        self.graphs = GraphRunner(sizes, device, run=self._run_fixed,
                                  prepare=lambda bs: self._load(None, bs, self._chain[0, :0]))

    def run(self, batch: Batch) -> torch.Tensor:
        """Decode ``batch`` greedily ``num_steps`` times; returns the ``[num_steps, B]`` tokens,
        on the device.

        The pages of every step's token are reserved first (all or nothing: OutOfPagesError
        leaves the requests as they were). Afterwards each request stands where
        ``num_steps`` ordinary steps would have left it (``cached_len`` that many tokens on, as
        many in flight), except that its samples are returned, not written into the token pool:
        a draft's tokens are only ever read back as guesses.
        """
        engine, more = self.engine, self.num_steps - 1
        input_ids = engine.token_pool.input_ids(batch)
        for req in batch.reqs:  # counted in flight: pages for every step's token
            req.in_flight += more
        try:
            engine.pages.reserve(*batch.reqs)
        except Exception:
            for req in batch.reqs:
                req.in_flight -= more
            raise
        bs = self.graphs.size_for(batch)
        if bs is None:
            tokens = self._run_eager(batch, input_ids)
        else:
            self._load(batch, bs, input_ids)
            self.graphs.graphs[bs].replay()
            tokens = self._chain[1:, : batch.size]
        batch.advance()  # the first step; then the others
        for req in batch.reqs:
            req.cached_len += more
        return tokens

    def _load(self, first: BatchLayout | None, bs: int, input_ids: torch.Tensor) -> None:
        """Plan every step of ``first`` (None: padding only), padded to ``bs``, into its
        backend's fixed arrays and this runner's fields, and write the first step's input."""
        for step, backend in enumerate(self._backends):
            batch = None if first is None else _later(first, step)
            backend.prepare(pad_batch(batch, bs, self.engine.pad_row), out=self._fields[step])
        real = input_ids.shape[0]
        self._chain[0, :real].copy_(input_ids)
        self._chain[0, real:bs].zero_()  # padding reads token 0

    def _run_fixed(self, bs: int) -> None:
        """What a graph records: every step over the fixed memory, argmax fed forward."""
        model, logits = self.engine.model, self._logits[:bs]
        for step, backend in enumerate(self._backends):
            with use_attention_backend(backend):
                model.forward(self._chain[step, :bs], self._fields[step, :bs], out=logits)
            torch.argmax(logits, dim=-1, out=self._chain[step + 1, :bs])

    def _run_eager(self, first: BatchLayout, input_ids: torch.Tensor) -> torch.Tensor:
        """The same steps launched one kernel at a time (no graph serves the batch)."""
        engine = self.engine
        tokens, ids = [], input_ids
        for step in range(self.num_steps):
            meta = engine.attn_backend.prepare(_later(first, step))
            with use_attention_backend(engine.attn_backend):
                logits = engine.model.forward(ids, meta.positions, meta.last_indices)
            ids = logits.argmax(dim=-1)
            tokens.append(ids)
        return torch.stack(tokens)


def _later(first: BatchLayout, step: int) -> BatchLayout:
    """``first``, ``step`` decode steps on: every request one token further."""
    return layout_of(first.rows, [n + step for n in first.cached_lens], first.new_lens,
                     is_decode=True)
