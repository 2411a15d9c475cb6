"""A draft model: a small model that guesses what the target will write next (chapter 23).

The draft runs on its own :class:`~minisgl.engine.engine.Engine`, with its own KV pool, pages and
token pool, and keeps its own copy of every request it guesses for: a
:class:`~minisgl.core.Req` whose prompt is everything the target has confirmed so far. Each
round the copy is brought up to date (the confirmed tokens it lacks are written from the host,
its cache is cut back to the guesses the target kept), then it decodes greedily ``k + 1``
steps, all launched as one (:class:`~minisgl.engine.draft_steps.DraftSteps`): no host work
between them. Its guesses stay on the device for the verify pass.

It runs one step more than it guesses, so that its cache also holds its last guess: whatever
the target keeps, the copy then has exactly one confirmed token to feed at the next round, the
target's last, at the position after the kept guesses. Both are on the device as soon as the
verdict is, so on a GPU the next round is launched from there before the host reads the verdict
(:meth:`DraftModel.guess_ahead`), and the host sets the copies' lengths afterwards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minisgl.core import Batch, Req, SamplingParams
from minisgl.engine.config import EngineConfig
from minisgl.engine.draft_steps import DraftSteps
from minisgl.engine.engine import Engine
from minisgl.engine.verify import Guesses
from minisgl.kvcache import OutOfPagesError
from minisgl.speculative.accept import Verdict
from minisgl.utils.logger import get_logger
from minisgl.utils.torch_utils import host_to_device

logger = get_logger(__name__)

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)  # the draft's tokens are only guesses


class DraftModel:
    """Guesses up to ``k`` tokens per request with a small model of the same vocabulary.

    Args:
        config: the draft's engine settings (the target's, with the draft's checkpoint).
        vocab_size: the target's vocabulary size; the draft's must equal it (the two must share
            a tokenizer: a guess is a token id of the target's).
        k: the most guesses per request and round.

    Attributes:
        engine: the draft's engine.
        steps: its ``k + 1`` decode steps, launched as one.
        rounds_ahead: rounds whose steps were launched ahead of the verdict before them.
    """

    def __init__(self, config: EngineConfig, vocab_size: int, k: int) -> None:
        # Its decode steps run only as DraftSteps' chains, which have graphs of their own: one
        # captured size keeps the engine's padding row, which those graphs pad with.
        # Its sequences are short, so one chunk of keys per request loses nothing, and a plan
        # that holds for any lengths spares the host a plan() per chained step (fixed_plans).
        self.engine = Engine(dataclasses.replace(config, cuda_graph_batch_sizes=(1,),
                                                 fixed_plans=True))
        if self.engine.model_config.vocab_size != vocab_size:
            raise ValueError(f"the draft model {config.model_path} has a vocabulary of "
                             f"{self.engine.model_config.vocab_size} tokens, the target "
                             f"{vocab_size}: a draft must share the target's tokenizer")
        self.k = k
        self.steps = DraftSteps(self.engine, k + 1)
        self._copies: dict[int, _Copy] = {}
        # last round's guesses, on the device, and which copy made which row
        self._unread: tuple[torch.Tensor, list[tuple[_Copy, int, int]]] | None = None
        self._ahead: _Ahead | None = None  # the guesses of steps launched ahead
        self.rounds_ahead = 0

    def propose(self, reqs: Sequence[Req], counts: Sequence[int]) -> Guesses:
        """Up to ``counts[i]`` (at most ``k``) guesses for the tokens after ``reqs[i]``'s
        confirmed ones, on the device: nothing here waits for it.

        Every request must have read its last sample (nothing in flight). A request with a
        count of 0 gets none and its copy is left as it is, and so does one within ``k``
        tokens of the draft's ``max_seq_len`` (every copy runs ``k + 1`` steps). A copy whose
        steps ran ahead last round (:meth:`guess_ahead`) has its guesses already.
        """
        ran_ahead, self._ahead = self._ahead, None
        self._read_last_guesses()
        want = {req.uid: min(n, self.k) for req, n in zip(reqs, counts, strict=True)
                if n > 0 and self.has_room(req.num_tokens)}
        ready: list[tuple[int, _Copy]] = []  # (row of reqs, copy) of guesses made ahead
        behind: list[tuple[int, _Copy]] = []  # those that guess now
        for i, req in enumerate(reqs):
            if req.uid not in want:
                continue
            if ran_ahead is not None and req.uid in ran_ahead.rows:
                ready.append((i, self._settle(req)))
            else:
                behind.append((i, self._bring_up_to_date(req)))
        if ran_ahead is not None:  # ran ahead, not used now: their lengths are unknown
            for uid in ran_ahead.rows.keys() - {copy.req.uid for _, copy in ready}:
                self.release(uid)
        # (rows of reqs, a tensor of guesses, the rows of it they take)
        parts: list[tuple[list[int], torch.Tensor, list[int]]] = []
        if ready:
            parts.append(([i for i, _ in ready], ran_ahead.tokens,
                          [ran_ahead.rows[c.req.uid] for _, c in ready]))
        if behind:
            try:
                steps = self._decode([copy for _, copy in behind])
                # Step j's argmax is guess j; the last step's only puts the last guess in the
                # cache. A copy, too: the graph's memory is overwritten next round.
                parts.append(([i for i, _ in behind], steps[: self.k].T.contiguous(),
                              list(range(len(behind)))))
            except OutOfPagesError:  # the draft has no prefix cache: its pool can fill first
                logger.warning("the draft's KV pool is full: no guesses this round")
                for _, copy in behind:
                    self.release(copy.req.uid)
                    del want[copy.req.uid]
                behind = []
        guessed = _gather_rows(parts, len(reqs), self.k, self.engine.device)
        counts = [want.get(req.uid, 0) for req in reqs]
        self._unread = (guessed, [(copy, i, counts[i]) for i, copy in ready + behind])
        return Guesses(guessed, counts)

    def has_room(self, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` confirmed tokens gets guesses: its copy's
        ``k + 1`` steps must fit in the draft's ``max_seq_len``."""
        return num_tokens <= self.engine.max_seq_len - self.k

    def guess_ahead(self, verdict: Verdict) -> None:
        """Launch the next round's steps of every copy that guessed this round, from
        ``verdict`` on the device, before the host reads it: the device goes from the verify
        pass straight on to the draft's next steps while the host reads the verdict and does
        its bookkeeping. Nothing is launched where the draft cannot (no ahead graph for the
        batch, a copy too near ``max_seq_len``, too few pages); the next round then guesses
        as usual."""
        if self._unread is None:
            return
        owners = self._unread[1]
        copies = [copy for copy, _, _ in owners]
        if not copies or any(c.base + 2 * self.k + 1 > self.engine.max_seq_len for c in copies):
            return
        try:
            steps = self.steps.run_ahead(Batch([c.req for c in copies], "decode"),
                                         [c.base for c in copies],
                                         [row for _, row, _ in owners], verdict)
        except OutOfPagesError:
            return
        if steps is None:
            return
        # Their caches ran on past these guesses: the host never needs to read them.
        self._unread = None
        self._ahead = _Ahead(steps[: self.k].T.contiguous(),
                             {copy.req.uid: i for i, copy in enumerate(copies)})
        self.rounds_ahead += 1

    def ahead_columns(self, reqs: Sequence[Req]) -> list[int] | None:
        """Where each of ``reqs`` finds the guesses of the steps launched ahead this round:
        its column of :attr:`DraftSteps.chain` (rows ``1 .. k``); None unless every one of
        them has such guesses."""
        if self._ahead is None or any(req.uid not in self._ahead.rows for req in reqs):
            return None
        return [self._ahead.rows[req.uid] for req in reqs]

    def release(self, uid: int) -> None:
        """Forget request ``uid`` (it finished or was aborted): its copy's pages go back."""
        copy = self._copies.pop(uid, None)
        if copy is not None and copy.req.table_row is not None:
            self.engine.pages.release(copy.req)

    def _read_last_guesses(self) -> None:
        """Give each copy the guesses it made last round, which the host has not read: the
        target's verdict on them has been read since, so the device is done and the copy to
        the host waits for nothing."""
        if self._unread is None:
            return
        tokens, owners = self._unread
        self._unread = None
        rows = tokens.tolist()
        for copy, row, count in owners:
            copy.guesses = rows[row][:count]

    @property
    def num_copies(self) -> int:
        """Requests the draft holds a copy of."""
        return len(self._copies)

    def _settle(self, req: Req) -> _Copy:
        """``req``'s copy after its steps ran ahead last round: they fed the target's last
        token, at the position after the kept guesses, and guessed on from it. Now that the
        host has read the verdict, the copy's lengths are set to where those steps left it
        (as :meth:`DraftSteps.run` leaves a copy) and the pages reserved for more kept
        guesses go back."""
        copy, tokens = self._copies[req.uid], req.token_ids
        copy.req.prompt_ids = tokens
        copy.req.cached_len = len(tokens) + self.k
        copy.req.in_flight = self.k + 1  # its last step's argmax
        self.engine.pages.shrink(copy.req)
        copy.base, copy.guesses = len(tokens), []
        return copy

    def _bring_up_to_date(self, req: Req) -> _Copy:
        """``req``'s copy, its prompt the confirmed tokens, its cache cut back to what is
        still true of them."""
        tokens = req.token_ids
        copy = self._copies.get(req.uid)
        if copy is None:
            copy = self._copies[req.uid] = _Copy(Req(req.uid, tokens, params=GREEDY))
        else:
            # Its cache holds the tokens confirmed last round, then its guesses: those still
            # match as far as the target kept them.
            kept = 0
            for guess, token in zip(copy.guesses, tokens[copy.base:]):
                if guess != token:
                    break
                kept += 1
            copy.req.prompt_ids = tokens
            copy.req.in_flight = 0
            # (never the last confirmed token: the copy feeds that one next)
            copy.req.cached_len = min(copy.req.cached_len, copy.base + kept, len(tokens) - 1)
            self.engine.pages.shrink(copy.req)
        copy.base, copy.guesses = len(tokens), []
        return copy

    def _decode(self, copies: list[_Copy]) -> torch.Tensor:
        """Catch every copy up to its last confirmed token, then decode ``k + 1`` steps each;
        returns the ``[k + 1, C]`` tokens, on the device."""
        engine = self.engine
        behind = [c.req for c in copies if c.req.new_len > 1]  # new, or skipped a round
        if behind:  # compute all but the last confirmed token; its sample is not wanted
            batch = Batch(behind, "prefill", chunk_lens=[req.new_len - 1 for req in behind])
            engine.pages.reserve(*batch.reqs)
            engine.forward(batch)
            batch.advance()
        return self.steps.run(Batch([c.req for c in copies], "decode"))


@dataclass
class _Ahead:
    """The guesses of steps launched ahead: ``tokens`` row ``rows[uid]`` is request ``uid``'s."""

    tokens: torch.Tensor  # [C, k]
    rows: dict[int, int]


def _gather_rows(parts: list[tuple[list[int], torch.Tensor, list[int]]], size: int, k: int,
                 device: torch.device) -> torch.Tensor:
    """A ``[size, k]`` tensor whose row ``rows[j]`` is ``tokens[taken[j]]``, for each
    ``(rows, tokens, taken)`` of ``parts``; zeros elsewhere (rows with no guesses)."""
    if len(parts) == 1:
        rows, tokens, taken = parts[0]
        if rows == list(range(size)) and taken == list(range(tokens.shape[0])):
            return tokens
    full = torch.zeros(size, k, dtype=torch.int64, device=device)
    for rows, tokens, taken in parts:  # both index lists in one copy
        index = host_to_device(torch.tensor([rows, taken], dtype=torch.int64), device)
        full[index[0]] = tokens[index[1]]
    return full


class _Copy:
    """The draft's copy of one request, and what it guessed last.

    Attributes:
        req: the copy: its prompt is the target's confirmed tokens, its samples its guesses.
        base: how many tokens were confirmed when it last guessed.
        guesses: the guesses it made then (the tokens after ``base``).
    """

    def __init__(self, req: Req) -> None:
        self.req = req
        self.base = 0
        self.guesses: list[int] = []
