"""The next verify pass, launched before the host reads this one's verdict (chapter 23).

A round of draft speculation ends with the host reading the verdict, then doing its
bookkeeping, then preparing the next verify pass. At batch 1 that stretch takes longer than the
draft's next steps, which the device runs meanwhile (:meth:`DraftModel.guess_ahead`), so the
device waits for the host every round. Yet everything the next pass needs is on the device as
soon as the verdict is: request ``i`` feeds the verdict's last token at its length plus the
guesses it kept, then the draft's next ``k`` guesses at the positions after it. So
:class:`VerifyAhead` launches that pass right after the draft's steps, before the host reads
anything: a CUDA graph per batch size computes the pass's inputs from the verdict (as
:func:`~minisgl.engine.draft_steps.device_step_arrays` does for the draft's steps), runs the
target over them and applies the greedy rule, leaving the next verdict in fixed memory.

Its attention backend plans once per size (``fixed_plans``: one chunk of keys per entry), so
contexts longer than ``MAX_AHEAD_CONTEXT`` are verified the ordinary way, as are sampled
requests and batches larger than ``MAX_AHEAD_BATCH``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from minisgl.attention import pad_batch
from minisgl.attention.fi import PageArrays
from minisgl.engine.draft_steps import MAX_AHEAD_BATCH, AheadInputs, device_step_arrays
from minisgl.engine.graph import GraphRunner
from minisgl.kvcache.page_table import pages_for
from minisgl.layers.attention import use_attention_backend
from minisgl.speculative.accept import Verdict, accept_greedy

if TYPE_CHECKING:  # engine.py does not import this module: no cycle at run time
    from minisgl.engine.engine import Engine

# The longest context verified ahead: one chunk of keys per entry is as fast as a split plan
# for short contexts and slower for long ones, and the page arrays grow with it.
MAX_AHEAD_CONTEXT = 2048
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16)  # requests; a graph of bs feeds bs * (k + 1) entries


class VerifyAhead:
    """Verify passes launched from the device's verdict, for batches of up to
    ``MAX_AHEAD_BATCH`` greedy requests with ``k`` guesses each.

    Args:
        engine: the target's engine (CUDA graphs on, FlashInfer attention).
        k: guesses per request.
        chain: the draft's step tokens (:attr:`DraftSteps.chain`): column ``c`` of rows
            ``1 .. k`` holds the guesses of the draft's request ``c``.

    Attributes:
        max_batch_size: the largest batch a graph serves.
        max_context: the most tokens a request may reach in a pass launched here.
    """

    def __init__(self, engine: Engine, k: int, chain: torch.Tensor) -> None:
        self.engine, self.k = engine, k
        self._chain = chain
        sizes = [bs for bs in GRAPH_BATCH_SIZES
                 if bs <= min(MAX_AHEAD_BATCH, engine.config.max_running_reqs)]
        self.max_batch_size = max_bs = max(sizes)
        per, device = k + 1, engine.device
        max_entries = max_bs * per
        self.max_context = min(MAX_AHEAD_CONTEXT, engine.max_seq_len)
        self.width = pages_for(self.max_context, engine.pages.table.page_size)
        # Uploaded per launch: each request's length when the verdict's pass was launched,
        # its column of the draft's chain and whether it is real (1) or padding (0); and the
        # page ids of its row.
        self._inputs = AheadInputs(
            entries=torch.zeros(3, max_bs, dtype=torch.int64, device=device),
            row_pages=torch.zeros(max_bs, self.width, dtype=torch.int32, device=device))
        self._staged = self._inputs.pinned_twin()
        self._copied = torch.cuda.Event()  # the last launch's copies have read self._staged
        self._copied.record()
        # the verdict a pass starts from (copied in), and the one it ends with
        self._last = (torch.zeros(max_bs, dtype=torch.int64, device=device),
                      torch.zeros(max_bs, per, dtype=torch.int64, device=device))
        self._next = (torch.zeros(max_bs, dtype=torch.int64, device=device),
                      torch.zeros(max_bs, per, dtype=torch.int64, device=device))
        # what BaseAttnBackend.prepare lays out: positions, K/V slots, last indices
        self._fields = torch.zeros(3 * max_entries, dtype=torch.int64, device=device)
        self._arrays = PageArrays(
            indptr=torch.zeros(max_entries + 1, dtype=torch.int32, device=device),
            indices=torch.zeros(max_entries * self.width, dtype=torch.int32, device=device),
            last_page_lens=torch.zeros(max_entries, dtype=torch.int32, device=device))
        self._logits = torch.zeros(max_entries, engine.model_config.vocab_size,
                                   dtype=torch.float32, device=device)
        self._backend = engine.attn_backend.sibling(fixed_plans=True)
        self._backend.enable_cuda_graphs([bs * per for bs in sizes], self._arrays)
        self.graphs = GraphRunner(sizes, device, run=self._run, prepare=self._plan_padding)

    def launch(self, rows: list[int], starts: list[int], columns: list[int],
               verdict: Verdict) -> Verdict:
        """Launch the verify pass that follows ``verdict``; returns its verdict, on the device
        (fixed memory: the next launch overwrites it).

        Request ``i`` (page-table row ``rows[i]``) had ``starts[i]`` tokens confirmed when
        ``verdict`` was launched; it feeds the verdict's last token at position
        ``starts[i] + accepted[i]``, then its ``k`` guesses in column ``columns[i]`` of the
        draft's chain. The caller keeps within ``max_batch_size`` requests and ``max_context``
        tokens, and reserves pages as far as the pass can reach.
        """
        size = len(rows)
        bs = next(bs for bs in self.graphs.batch_sizes if bs >= size)
        pad = bs - size
        self._copied.synchronize()  # the host writes where the last launch's copies read
        self._staged.entries[:, :bs] = torch.tensor(
            [starts + [0] * pad, columns + [0] * pad, [1] * size + [0] * pad])
        table = self.engine.pages.table
        self._staged.row_pages[: bs * self.width].numpy()[:] = (
            table.page_ids[rows + [self.engine.pad_row] * pad, : self.width].reshape(-1))
        self._inputs.copy_from(self._staged, bs, self.width)
        self._copied.record()
        accepted, tokens = self._last
        accepted[:size].copy_(verdict.accepted)
        tokens[:size].copy_(verdict.tokens)
        self.graphs.graphs[bs].replay()
        return Verdict(self._next[0][:size], self._next[1][:size])

    def _plan_padding(self, bs: int) -> None:
        """Plan a batch of padding entries before the graph of ``bs`` requests is captured:
        the plan then serves any batch of that size (``fixed_plans``)."""
        entries = bs * (self.k + 1)
        self._backend.prepare(pad_batch(None, entries, self.engine.pad_row), out=self._fields)

    def _run(self, bs: int) -> None:
        """What a graph records: the pass's inputs from the verdict, the target, the rule."""
        per = self.k + 1
        entries = bs * per
        starts, columns, real = self._inputs.entries[:, :bs]
        accepted, tokens = self._last
        kept = accepted[:bs] * real  # padding stays at position 0 of the padding row
        rows = torch.arange(bs, device=real.device)
        last = tokens[rows, kept] * real  # the verdict's last token; padding feeds token 0
        guesses = self._chain[1:per].index_select(1, columns).T  # [bs, k]
        input_ids = torch.cat([last[:, None], guesses], dim=1).view(-1)
        steps = torch.arange(per, device=real.device)
        positions = ((starts + kept)[:, None] + steps[None, :] * real[:, None]).view(-1)
        arrays = device_step_arrays(
            positions, real.bool().repeat_interleave(per),
            self._inputs.row_pages[:bs].repeat_interleave(per, dim=0),
            self.engine.pages.table.page_size, 1, capacity=entries * self.width)
        self._fields[: 3 * entries].copy_(arrays["fields"][0])
        self._arrays.indptr[: entries + 1].copy_(arrays["indptr"][0])
        self._arrays.last_page_lens[:entries].copy_(arrays["last_page_lens"][0])
        self._arrays.indices[: entries * self.width].copy_(arrays["page_ids"][0])
        logits = self._logits[:entries]
        with use_attention_backend(self._backend):
            self.engine.model.forward(input_ids, self._fields[:entries], out=logits)
        verdict = accept_greedy(guesses, logits.argmax(dim=-1).view(bs, per))
        self._next[0][:bs].copy_(verdict.accepted)
        self._next[1][:bs].copy_(verdict.tokens)
