"""Speculative decode steps: guess, verify in one pass, keep what passes, roll back the rest.

A decode step reads all the weights to make one token per request. :class:`Speculator` makes
several: a proposer guesses up to ``k`` tokens per request (prompt lookup, or a draft model),
the target feeds each request's last token and its guesses in one pass
(:func:`~minisgl.engine.verify.verify`), and each request takes the guesses the target agrees
with plus one token of the target's own. The guesses it rejected wrote K/V that is now wrong:
the request's length is cut back to what it kept, and whole pages past it go back to the pool.
The prefix cache never sees a rejected token, because it only ever takes tokens up to a
request's ``cached_len``. With a draft model on a GPU, the next round's draft steps and verify
pass are both launched from the verdict on the device, before the host reads it
(:class:`~minisgl.engine.verify_ahead.VerifyAhead`). Chapter 23 tells the story.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minisgl.core import Batch, Req
from minisgl.engine.draft import DraftModel
from minisgl.engine.engine import Engine
from minisgl.engine.verify import Guesses, verify
from minisgl.engine.verify_ahead import VerifyAhead
from minisgl.kvcache import OutOfPagesError
from minisgl.scheduler.cache import CacheManager
from minisgl.scheduler.config import SchedulerConfig, Speculation
from minisgl.scheduler.overlap import HostTokens
from minisgl.speculative.accept import Verdict, unpack
from minisgl.speculative.ngram import propose_ngram


def takes(req: Req) -> bool:
    """Whether ``req`` may decode speculatively: its next token depends only on the model's
    distribution. A grammar (chapter 22) or a logit adjustment (chapter 21) changes the
    distribution with every token, and logprobs are reported per decode step: such a request
    decodes one token a step, beside the others."""
    params = req.params
    return not (req.grammar is not None or params.adjusts_logits or params.logprobs is not None)


@dataclass
class SpeculativeStep:
    """What one speculative decode step did.

    Attributes:
        read: the requests in the order their tokens were appended, once per token.
        new_pages: pages the verify pass allocated (some went back after it).
        num_tokens: tokens the verify pass fed: each request's last token and its guesses.
    """

    read: list[Req]
    new_pages: int
    num_tokens: int


@dataclass
class _Launched:
    """A verify pass launched before the host read the verdict before it (VerifyAhead).

    Attributes:
        reqs: the requests it verifies, in order; each fed ``k`` guesses.
        verdict: its verdict, on the device; ``host``, ``ready``: its copy to the host.
        new_pages: pages reserved for it.
    """

    reqs: list[Req]
    verdict: Verdict
    host: torch.Tensor
    ready: torch.cuda.Event | None
    new_pages: int


class Speculator:
    """Runs the decode steps of a scheduler that speculates.

    Args:
        config: the scheduler's settings; ``config.speculative`` says how to guess.
        engine: the target's engine.
        cache: the scheduler's cache manager (pages for the verify pass).

    Attributes:
        k: the most guesses per request and step.
        draft: the draft model, or None for prompt lookup.
        num_proposed: guesses made so far.
        num_accepted: guesses the target kept so far.
        launches_ahead: whether a draft's next round may be launched before the host reads
            the verdict (``,ahead=off`` turns it off).
        ahead: the graphs that launch a verify pass from the device's verdict, where the
            draft's steps are launched ahead too (None elsewhere).
        rounds_verified_ahead: rounds whose verify pass was launched ahead.
    """

    def __init__(self, config: SchedulerConfig, engine: Engine, cache: CacheManager) -> None:
        assert config.speculative is not None
        settings = Speculation.parse(config.speculative)
        self.k = settings.k
        self.engine, self.cache = engine, cache
        self.draft = None if settings.draft is None else DraftModel(
            dataclasses.replace(config, model_path=settings.draft, speculative=None),
            engine.model_config.vocab_size, self.k)
        self.num_proposed = 0
        self.num_accepted = 0
        # a verdict's rows, [B, k + 2] at most, read without waiting for what follows them
        self._host_verdicts = HostTokens(engine.device, config.max_running_reqs * (self.k + 2))
        self.launches_ahead = settings.ahead and self.draft is not None
        self.ahead: VerifyAhead | None = None
        if (self.launches_ahead and self.draft.steps.ahead_graphs.enabled
                and engine.graph_runner.enabled and engine.attn_backend.name == "flashinfer"):
            self.ahead = VerifyAhead(engine, self.k, self.draft.steps.chain)
        self._launched: _Launched | None = None  # the next round's pass, launched already
        self.rounds_verified_ahead = 0

    def propose(self, reqs: Sequence[Req]) -> Guesses:
        """Each request's guesses, as many as it has room for."""
        room = [self._room(req) for req in reqs]
        if self.draft is not None:
            return self.draft.propose(reqs, room)
        return Guesses.from_lists([propose_ngram(req.token_ids, n) if n > 0 else []
                                   for req, n in zip(reqs, room)], self.engine.device)

    def _room(self, req: Req, coming: int = 0) -> int:
        """The guesses ``req`` may make once ``coming`` more tokens are out: at most ``k``, and
        never more than its ``max_tokens`` leaves room for after the target's own token."""
        return min(self.k, req.params.max_tokens - (len(req.output_ids) + coming) - 1)

    def decode(self, reqs: Sequence[Req], eos_token_ids: Sequence[int]) -> SpeculativeStep:
        """One speculative decode step of ``reqs`` (each has read its last sample); the
        scheduler retires those that finished."""
        launched, self._launched = self._launched, None
        if not reqs:
            self._drop(launched)
            return SpeculativeStep([], 0, 0)
        guesses = self.propose(reqs)
        lengths = [req.num_tokens for req in reqs]
        # While the target checks them, the guesses count in the request's length, as
        # tokens in flight do: the pass is then an ordinary prefill over a cached past.
        for req, count in zip(reqs, guesses.counts):
            req.in_flight = count
        num_fed = sum(guesses.counts) + len(reqs)
        if (launched is not None and launched.reqs == list(reqs)
                and guesses.counts == [self.k] * len(reqs)):
            # Launched last round from the device's verdict, with these very guesses.
            verdict, host, ready, new_pages = launched.verdict, launched.host, launched.ready, 0
            self.rounds_verified_ahead += 1
        else:
            self._drop(launched)
            new_pages = self.cache.reserve(reqs)
            verdict = verify(self.engine, Batch(list(reqs), "prefill"), guesses)
            # The verdict starts for the host, then the draft's next steps start from it on
            # the device: the host waits for the copy only, and the device goes on guessing.
            host, ready = self._host_verdicts.copy(verdict.packed().view(-1))
        if self.launches_ahead:
            self.draft.guess_ahead(verdict)
        # Each request's tokens go into the token pool on the device, as a decode step's
        # sample does, while the host would otherwise wait: it has nothing to write back.
        self.engine.token_pool.store_rows(reqs, lengths, [n + 1 for n in guesses.counts],
                                          verdict.tokens)
        self._launched = self._verify_next(reqs, lengths, guesses.counts, verdict)
        if self._launched is not None:
            new_pages += self._launched.new_pages
        if ready is not None:
            ready.synchronize()  # the host waits here
        emitted = unpack(host.view(len(reqs), -1).tolist())
        read: list[Req] = []
        for req, length, count, tokens in zip(reqs, lengths, guesses.counts, emitted):
            self.num_proposed += count
            self.num_accepted += len(tokens) - 1
            req.in_flight = 0
            taken = 0
            for token in tokens:
                taken += 1
                read.append(req)
                if req.append_token(token, eos_token_ids) is not None:
                    break
            # K/V now holds the last token and the kept guesses: positions before
            # length + kept. A request that stopped early holds fewer tokens than that.
            req.cached_len = length + min(len(tokens) - 1, taken)
        if any(req.finish_reason is not None for req in reqs):
            self._launched = None  # its batch is not the next one
        ahead = self.k if self._launched is not None else 0
        for req in reqs:
            self.cache.pages.shrink(req, ahead)
        return SpeculativeStep(read, new_pages, num_fed)

    def _drop(self, launched: _Launched | None) -> None:
        """``launched`` is not this round's pass (its batch changed): the pages kept for it go
        back. What it wrote lies past every request's length and is written over later."""
        for req in [] if launched is None else launched.reqs:
            if req.table_row is not None:  # not released since
                self.cache.pages.shrink(req)

    def _verify_next(self, reqs: Sequence[Req], lengths: list[int], counts: list[int],
                     verdict: Verdict) -> _Launched | None:
        """Launch the next round's verify pass from ``verdict`` on the device, before the host
        reads it, where it can be: a draft whose next steps were launched ahead, greedy
        requests that will all propose ``k`` guesses whatever is kept, and pages for every
        position the pass can reach (reserved here, given back once the verdict is read)."""
        if self.ahead is None or len(reqs) > self.ahead.max_batch_size:
            return None
        columns = self.draft.ahead_columns(reqs)
        if columns is None:
            return None
        for req, length, count in zip(reqs, lengths, counts):
            confirmed = length + count + 1  # at most, after this verdict
            if (not req.params.is_greedy or confirmed + self.k > self.ahead.max_context
                    or not self.draft.has_room(confirmed)
                    or self._room(req, count + 1) < self.k):
                return None
        try:  # every guess kept (in flight now), then the last token and k more
            new_pages = self.cache.pages.reserve(*reqs, ahead=self.k + 1)
        except (OutOfPagesError, ValueError):  # no eviction for a pass that may be dropped
            return None
        rows = [req.table_row for req in reqs]
        launched = self.ahead.launch(rows, lengths, columns, verdict)
        host, ready = self._host_verdicts.copy(launched.packed().view(-1))
        return _Launched(list(reqs), launched, host, ready, new_pages)

    def release(self, req: Req) -> None:
        """``req`` finished or was aborted: the draft forgets it."""
        if self.draft is not None:
            self.draft.release(req.uid)

    def counters(self, prefix: str = "") -> dict[str, int]:
        """Guesses made and kept so far, for ``/metrics``."""
        return {f"{prefix}spec_proposed_tokens": self.num_proposed,
                f"{prefix}spec_accepted_tokens": self.num_accepted}
