"""A draft's decode steps launched as one: no host work between them (chapter 23).

A small draft model is quick on the GPU and slow to drive from the host. Run as ordinary
steps, each of its tokens waits for the host to form a batch, reserve pages, plan attention,
replay a graph and store the sample, which at batch 1 takes several times the GPU's own work.
Yet everything that host work computes is known before the first step: a draft decodes
greedily, so step ``j`` of every request feeds position ``cached_len + j``, and its input is the
argmax of step ``j - 1``, which can stay on the device. :class:`DraftSteps` therefore reserves
the pages of all its steps at once, computes every step's inputs in one pass on the host
(:func:`step_arrays`) and copies them to the device together (each step has a backend of its
own, with its own plan and fixed arrays), and runs the steps back to back with each argmax
written where the next step reads its input: one CUDA graph per batch size where the engine
captures graphs, eagerly elsewhere.

When the first position is known only on the device (the draft's next round, launched before
the host has read the target's verdict), a small graph computes the same inputs there
(:meth:`DraftSteps.run_ahead`, :func:`device_step_arrays`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from minisgl.attention import BatchLayout, layout_of, pad_batch
from minisgl.attention.fi import PageArrays
from minisgl.core import Batch
from minisgl.engine.graph import GraphRunner
from minisgl.kvcache.page_table import PageTable, expand_ranges, pages_for, slots_of
from minisgl.layers.attention import use_attention_backend
from minisgl.speculative.accept import Verdict
from minisgl.utils.torch_utils import host_to_device

if TYPE_CHECKING:  # engine.py does not import this module: no cycle at run time
    from minisgl.engine.engine import Engine

GRAPH_BATCH_SIZES = (1, 4, 16, 64, 256)  # the chained steps' captured sizes (see __init__)
# The largest batch whose steps can be launched ahead, from the device (see run_ahead): the
# arrays that launch computes on the device grow with the batch times a row's most pages,
# and speculating pays at small batches.
MAX_AHEAD_BATCH = 16


class DraftSteps:
    """``num_steps`` greedy decode steps of a batch, launched together.

    Args:
        engine: the draft's engine.
        num_steps: steps per launch (a draft that guesses ``k`` tokens runs ``k + 1``).

    Attributes:
        graphs: the runner of the chained steps' graphs (disabled where the engine's is).
        ahead_graphs: the runner of the graphs that compute the steps' inputs on the device,
            for batches of up to ``MAX_AHEAD_BATCH`` (:meth:`run_ahead`).
    """

    def __init__(self, engine: Engine, num_steps: int) -> None:
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self.engine = engine
        self.num_steps = num_steps
        if not engine.graph_runner.enabled:
            self.graphs = self.ahead_graphs = engine.graph_runner  # disabled, and says why
            return
        if not getattr(engine.attn_backend, "fixed_plans", False):
            # Each size's steps are planned once, when its graph is captured: a plan that
            # depends on the lengths (a decode split into chunks) would be wrong for longer ones.
            raise ValueError("chained draft steps replay plans made at capture: the engine "
                             "must be built with fixed_plans=True")
        # Few sizes: each costs every step a FlashInfer wrapper of its own (8 MiB of device and
        # of pinned host memory), while padding a small draft's batch costs next to nothing.
        # The largest is capped at the most requests, so that every batch has a graph: launched
        # a kernel at a time, a draft's steps cost several times what a replay does.
        sizes = sorted({min(bs, engine.config.max_running_reqs) for bs in GRAPH_BATCH_SIZES})
        # A backend per step, each with its own plans, so that every step can be planned
        # before the first one runs. Their fixed arrays are rows of this runner's, so that
        # one copy writes a round's inputs for every step.
        max_bs, device = max(sizes), engine.device
        max_pages = max_bs * engine.pages.table.max_pages_per_req
        # Row j is step j's input; row j + 1 its argmax, which step j + 1 reads.
        self._chain = torch.zeros(num_steps + 1, max_bs, dtype=torch.int64, device=device)
        self._inputs = StepInputs(
            input_ids=self._chain[0],
            fields=torch.zeros(num_steps, 3 * max_bs, dtype=torch.int64, device=device),
            indptr=torch.zeros(num_steps, max_bs + 1, dtype=torch.int32, device=device),
            last_page_lens=torch.zeros(num_steps, max_bs, dtype=torch.int32, device=device),
            page_ids=torch.zeros(num_steps, max_pages, dtype=torch.int32, device=device))
        self._staged = self._inputs.pinned_twin()
        self._copied = torch.cuda.Event()  # the last round's copies have read self._staged
        self._copied.record()
        self._backends = [engine.attn_backend.sibling() for _ in range(num_steps)]
        for step, backend in enumerate(self._backends):
            backend.enable_cuda_graphs(sizes, self._inputs.page_arrays(step))
        self._logits = torch.zeros(max_bs, engine.model_config.vocab_size, dtype=torch.float32,
                                   device=device)
        self.graphs = GraphRunner(sizes, device, run=self._run_fixed, prepare=self._plan_padding)
        # Launching ahead: a graph per small size computes every step's inputs on the device
        # from the verdict (copied into fixed rows) and what the host uploads.
        ahead_sizes = [bs for bs in sizes if bs <= MAX_AHEAD_BATCH]
        max_rows = engine.config.max_running_reqs  # a verdict's rows
        self._verdict = (torch.zeros(max_rows, dtype=torch.int64, device=device),
                         torch.zeros(max_rows, num_steps, dtype=torch.int64, device=device))
        self._ahead = AheadInputs(
            entries=torch.zeros(3, max(ahead_sizes), dtype=torch.int64, device=device),
            row_pages=torch.zeros(max(ahead_sizes), engine.pages.table.max_pages_per_req,
                                  dtype=torch.int32, device=device))
        self._ahead_staged = self._ahead.pinned_twin()
        self.ahead_graphs = GraphRunner(ahead_sizes, device, run=self._compute_ahead_inputs,
                                        prepare=lambda bs: None)

    @property
    def chain(self) -> torch.Tensor:
        """``[num_steps + 1, max_bs]``: row 0 the first step's inputs, row ``j + 1`` step
        ``j``'s argmax, column ``i`` the batch's request ``i`` (fixed memory, on the device)."""
        return self._chain

    def run(self, batch: Batch) -> torch.Tensor:
        """Decode ``batch`` greedily ``num_steps`` times; returns the ``[num_steps, B]`` tokens,
        on the device.

        The pages of every step's token are reserved first (all or nothing: OutOfPagesError
        leaves the requests as they were). Afterwards each request stands where
        ``num_steps`` ordinary steps would have left it (``cached_len`` that many tokens on, as
        many in flight), except that its samples are returned, not written into the token pool:
        a draft's tokens are only ever read back as guesses. Each request feeds its last token,
        which the host must have read (none in flight): the first input is the host's.
        """
        engine, more = self.engine, self.num_steps - 1
        if any(req.in_flight or req.new_len != 1 for req in batch.reqs):
            raise ValueError("draft steps feed each request's last token, read by the host: "
                             "none may be in flight, and the rest must be cached")
        input_ids = [(req.output_ids or req.prompt_ids)[-1] for req in batch.reqs]
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
            tokens = self._run_eager(batch, host_to_device(torch.tensor(input_ids),
                                                           engine.device))
        else:
            self._load(batch, bs, input_ids)
            self.graphs.graphs[bs].replay()
            tokens = self._chain[1:, : batch.size]
        batch.advance()  # the first step; then the others
        for req in batch.reqs:
            req.cached_len += more
        return tokens

    def run_ahead(self, batch: Batch, starts: list[int], verdict_rows: list[int],
                  verdict: Verdict) -> torch.Tensor | None:
        """Launch the next round's steps before the host has read ``verdict``: the first
        input of request ``i`` is the target's token in row ``verdict_rows[i]``, fed at position
        ``starts[i] + accepted``, which only the device knows yet; so the device computes every
        step's inputs itself, and the host waits for nothing.

        Each request of ``batch`` must stand where :meth:`run` left it, ``starts[i]`` tokens
        confirmed: its cache then holds the guesses the verdict kept. Its pages are reserved for
        the most the steps can reach (every guess kept); the caller gives back the rest once
        it knows the verdict, and sets each request's lengths. Returns the ``[num_steps, B]``
        tokens on the device, or None where no graph launches ahead (no pages are taken then).
        """
        bs = self.ahead_graphs.size_for(batch)
        if bs is None:
            return None
        # Every guess kept: ``num_steps - 1`` positions past the end; the lengths stay the
        # caller's to set.
        self.engine.pages.reserve(*batch.reqs, ahead=self.num_steps - 1)
        size, table = batch.size, self.engine.pages.table
        layout = pad_batch(batch, bs, self.engine.pad_row)
        width = max(table.num_pages(row) for row in layout.rows)
        self._copied.synchronize()  # the host writes where the last copies read
        self._ahead_staged.entries[:, :bs] = torch.tensor(
            [starts + [0] * (bs - size), [1] * size + [0] * (bs - size),
             verdict_rows + [0] * (bs - size)])
        self._ahead_staged.row_pages[: bs * width].numpy()[:] = (
            table.page_ids[layout.rows, :width].reshape(-1))
        self._ahead.copy_from(self._ahead_staged, bs, width)
        self._copied.record()
        accepted, tokens = self._verdict
        accepted[: verdict.accepted.shape[0]].copy_(verdict.accepted)
        tokens[: verdict.tokens.shape[0], : verdict.tokens.shape[1]].copy_(verdict.tokens)
        self.ahead_graphs.graphs[bs].replay()
        self.graphs.graphs[bs].replay()
        return self._chain[1:, :size]

    def _compute_ahead_inputs(self, bs: int) -> None:
        """What an ahead graph records: each entry's first position and input from the
        verdict, then every step's inputs from them (:func:`device_step_arrays`)."""
        starts, moves, rows = self._ahead.entries[:, :bs]
        accepted, tokens = self._verdict
        kept = accepted[rows] * moves  # the padding entries stay where they are
        torch.mul(tokens[rows, kept], moves, out=self._chain[0, :bs])
        width = self._ahead.row_pages.shape[1]
        arrays = device_step_arrays(starts + kept, moves.bool(), self._ahead.row_pages[:bs],
                                    self.engine.pages.table.page_size, self.num_steps,
                                    capacity=bs * width)
        inputs = self._inputs
        inputs.fields[:, : 3 * bs].copy_(arrays["fields"])
        inputs.indptr[:, : bs + 1].copy_(arrays["indptr"])
        inputs.last_page_lens[:, :bs].copy_(arrays["last_page_lens"])
        inputs.page_ids[:, : bs * width].copy_(arrays["page_ids"])

    def _plan_padding(self, bs: int) -> None:
        """Plan every step's backend for a batch of ``bs`` padding entries, before its graph
        is captured: the plans then serve any batch of ``bs`` (the draft's ``fixed_plans``)."""
        for step, backend in enumerate(self._backends):
            backend.prepare(pad_batch(None, bs, self.engine.pad_row),
                            out=self._inputs.fields[step])
        self._chain[0, :bs].zero_()

    def _load(self, first: BatchLayout, bs: int, input_ids: list[int]) -> None:
        """Write every step's inputs for ``first`` (fed ``input_ids``), padded to ``bs``, where
        the graph of ``bs`` reads them: computed in one pass on the host, then a copy per
        array to the device."""
        arrays = step_arrays(self.engine.pages.table,
                             pad_batch(first, bs, self.engine.pad_row), first.size,
                             self.num_steps)
        arrays["input_ids"] = np.array(input_ids + [0] * (bs - first.size))  # padding: token 0
        self._copied.synchronize()  # the host writes where the last round's copies read
        self._staged.fill(arrays)
        self._inputs.copy_from(self._staged, width=arrays["page_ids"].shape[1])
        self._copied.record()

    def _run_fixed(self, bs: int) -> None:
        """What a graph records: every step over the fixed memory, argmax fed forward."""
        model, logits = self.engine.model, self._logits[:bs]
        for step, backend in enumerate(self._backends):
            with use_attention_backend(backend):
                model.forward(self._chain[step, :bs], self._inputs.fields[step, :bs],
                              out=logits)
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


SHORT_ARRAYS = ("input_ids", "fields", "indptr", "last_page_lens")  # copied whole


@dataclass
class StepInputs:
    """Every chained step's inputs: the first step's token ids (the later steps' are the
    argmaxes before them), then step ``j``'s in row ``j`` of each array: the model's fields
    (positions, K/V slots and last indices, as :meth:`BaseAttnBackend.prepare` lays them out)
    and the page arrays its attention reads."""

    input_ids: torch.Tensor  # [max_bs] int64
    fields: torch.Tensor  # [S, 3 * max_bs] int64
    indptr: torch.Tensor  # [S, max_bs + 1] int32
    last_page_lens: torch.Tensor  # [S, max_bs] int32
    page_ids: torch.Tensor  # [S, the pages of max_bs requests at most] int32

    def pinned_twin(self) -> StepInputs:
        """Host arrays of the same shapes in pinned memory, from which copies run without the
        host waiting; the page ids' grow with the batches (:meth:`fill`)."""
        def pinned(t: torch.Tensor) -> torch.Tensor:
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return StepInputs(pinned(self.input_ids), pinned(self.fields), pinned(self.indptr),
                          pinned(self.last_page_lens),
                          torch.empty(0, dtype=torch.int32, pin_memory=True))

    def page_arrays(self, step: int) -> PageArrays:
        """Step ``step``'s rows, as the fixed arrays of its backend's graphs."""
        return PageArrays(self.indptr[step], self.page_ids[step], self.last_page_lens[step])

    def fill(self, arrays: dict[str, np.ndarray]) -> None:
        """Write :func:`step_arrays`' output and the ``input_ids`` into this pinned twin: each
        row from its start, the page ids packed, ``[S, width]``."""
        for name in SHORT_ARRAYS:
            array = arrays[name]
            getattr(self, name).numpy()[..., : array.shape[-1]] = array
        page_ids = arrays["page_ids"]
        if self.page_ids.numel() < page_ids.size:  # rare: twice what is needed
            self.page_ids = torch.empty(2 * page_ids.size, dtype=torch.int32, pin_memory=True)
        self.page_ids[: page_ids.size].numpy()[:] = page_ids.reshape(-1)

    def copy_from(self, host: StepInputs, width: int) -> None:
        """Copy the pinned twin ``host`` here without the host waiting: the short arrays
        whole, and the first ``width`` page ids of each row."""
        for name in SHORT_ARRAYS:
            getattr(self, name).copy_(getattr(host, name), non_blocking=True)
        num_steps = self.page_ids.shape[0]
        packed = host.page_ids[: num_steps * width].view(num_steps, width)
        self.page_ids[:, :width].copy_(packed, non_blocking=True)


@dataclass
class AheadInputs:
    """What the host uploads for steps launched ahead (:meth:`DraftSteps.run_ahead`): per entry
    its confirmed length, whether it is real (1) or padding (0) and its row of the verdict, in
    the three rows of ``entries``; and the page ids of its page-table row."""

    entries: torch.Tensor  # [3, max_bs] int64
    row_pages: torch.Tensor  # [max_bs, max_pages_per_req] int32

    def pinned_twin(self) -> AheadInputs:
        """Host arrays in pinned memory; the page ids packed, ``[bs * width]``."""
        return AheadInputs(torch.empty(self.entries.shape, dtype=torch.int64, pin_memory=True),
                           torch.empty(self.row_pages.numel(), dtype=torch.int32,
                                       pin_memory=True))

    def copy_from(self, host: AheadInputs, bs: int, width: int) -> None:
        """Copy the first ``bs`` entries and ``width`` pages of each from the pinned twin
        ``host``, without the host waiting."""
        self.entries.copy_(host.entries, non_blocking=True)
        packed = host.row_pages[: bs * width].view(bs, width)
        self.row_pages[:bs, :width].copy_(packed, non_blocking=True)


def step_arrays(table: PageTable, layout: BatchLayout, num_real: int,
                num_steps: int) -> dict[str, np.ndarray]:
    """The inputs of ``num_steps`` decode steps of ``layout`` in one pass: step ``j`` feeds
    position ``cached_len + j`` of each of the first ``num_real`` entries; the padding after
    them stays where :func:`~minisgl.attention.pad_batch` put it.

    Returns ``[num_steps, ...]`` arrays, row ``j`` what ``prepare`` computes for step ``j``:
    ``fields`` (positions, slots, last indices), and FlashInfer's ``indptr``,
    ``last_page_lens`` and ``page_ids`` (each row's first ``indptr[j, -1]`` entries).
    """
    size, page_size = layout.size, table.page_size
    rows = np.asarray(layout.rows, dtype=np.int64)
    moves = np.arange(size) < num_real
    positions = np.asarray(layout.cached_lens, dtype=np.int64) + np.outer(np.arange(num_steps),
                                                                          moves)
    slots = slots_of(table.page_ids, rows[None, :], positions, page_size)
    if (slots < 0).any():  # a page id of NO_PAGE
        raise ValueError("a chained step's token has no page: reserve every step's pages "
                         "first")
    fields = np.concatenate([positions, slots, np.broadcast_to(np.arange(size),
                                                               positions.shape)], axis=1)
    num_pages = pages_for(positions + 1, page_size)  # [S, B]: pages each entry attends over
    last_page_lens = positions + 1 - (num_pages - 1) * page_size
    indptr = np.zeros((num_steps, size + 1), dtype=np.int64)
    np.cumsum(num_pages, axis=1, out=indptr[:, 1:])
    # Entry (j, i) owns indptr[j, i] ..: page p of its row goes there + p.
    counts = num_pages.reshape(-1)
    page, owner = expand_ranges(np.zeros_like(counts), counts)
    step, entry = np.divmod(owner, size)
    page_ids = np.zeros((num_steps, int(indptr[:, -1].max())), dtype=np.int32)
    page_ids[step, indptr[step, entry] + page] = table.page_ids[rows[entry], page]
    return {"fields": fields, "indptr": indptr.astype(np.int32),
            "last_page_lens": last_page_lens.astype(np.int32), "page_ids": page_ids}


def device_step_arrays(first_pos: torch.Tensor, moves: torch.Tensor, row_pages: torch.Tensor,
                       page_size: int, num_steps: int, capacity: int) -> dict[str, torch.Tensor]:
    """:func:`step_arrays` computed on the device, with shapes that depend only on the batch
    size (a CUDA graph records it): for when the positions are known only there.

    Args:
        first_pos: ``[B]`` int64, the position step 0 feeds, per entry.
        moves: ``[B]`` bool, the real entries; the padding stays at its position.
        row_pages: ``[B, W]`` int32, each entry's page ids, as far as its last step reaches.
        capacity: columns of the packed page ids: at least the most pages a step attends over.

    Returns:
        What :func:`step_arrays` returns; ``page_ids`` zero past each row's ``indptr[j, -1]``.
    """
    size, width = row_pages.shape
    device, row_pages = first_pos.device, row_pages.long()
    positions = first_pos + torch.arange(num_steps, device=device)[:, None] * moves  # [S, B]
    page_of = torch.div(positions, page_size, rounding_mode="floor")
    pages = row_pages.gather(1, page_of.T).T  # [S, B]
    slots = pages * page_size + positions % page_size
    fields = torch.cat([positions, slots,
                        torch.arange(size, device=device).expand(num_steps, size)], dim=1)
    num_pages = page_of + 1  # pages each entry attends over
    last_page_lens = positions + 1 - page_of * page_size
    indptr = torch.zeros(num_steps, size + 1, dtype=torch.int64, device=device)
    torch.cumsum(num_pages, dim=1, out=indptr[:, 1:])
    # Column t of step j belongs to the entry whose range indptr[j, i] .. holds it.
    column = torch.arange(capacity, device=device).expand(num_steps, capacity).contiguous()
    owner = torch.searchsorted(indptr[:, 1:].contiguous(), column, right=True)
    owner.clamp_(max=size - 1)
    page = (column - indptr.gather(1, owner)).clamp_(0, width - 1)
    values = row_pages.view(-1)[owner * width + page]
    page_ids = torch.where(column < indptr[:, -1:], values, 0)
    return {"fields": fields, "indptr": indptr.int(), "last_page_lens": last_page_lens.int(),
            "page_ids": page_ids.int()}
