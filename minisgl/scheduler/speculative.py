"""Speculative decode steps: guess, verify in one pass, keep what passes, roll back the rest.

A decode step reads all the weights to make one token per request. :class:`Speculator` makes
several: a proposer guesses up to ``k`` tokens per request (prompt lookup, or a draft model),
the target feeds each request's last token and its guesses in one pass
(:func:`~minisgl.engine.verify.verify`), and each request takes the guesses the target agrees
with plus one token of the target's own. The guesses it rejected wrote K/V that is now wrong:
the request's length is cut back to what it kept, and whole pages past it go back to the pool.
The prefix cache never sees a rejected token, because it only ever takes tokens up to a
request's ``cached_len``. Chapter 23 tells the story.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from minisgl.core import Batch, Req
from minisgl.engine.draft import DraftModel
from minisgl.engine.engine import Engine
from minisgl.engine.verify import Guesses, verify
from minisgl.scheduler.cache import CacheManager
from minisgl.scheduler.config import SchedulerConfig, Speculation
from minisgl.scheduler.overlap import HostTokens
from minisgl.speculative.accept import unpack
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

    def propose(self, reqs: Sequence[Req]) -> Guesses:
        """Each request's guesses: at most ``k``, and never more than its ``max_tokens`` leaves
        room for after the target's own token."""
        room = [min(self.k, req.params.max_tokens - len(req.output_ids) - 1) for req in reqs]
        if self.draft is not None:
            return self.draft.propose(reqs, room)
        return Guesses.from_lists([propose_ngram(req.token_ids, n) if n > 0 else []
                                   for req, n in zip(reqs, room)], self.engine.device)

    def decode(self, reqs: Sequence[Req], eos_token_ids: Sequence[int]) -> SpeculativeStep:
        """One speculative decode step of ``reqs`` (each has read its last sample); the
        scheduler retires those that finished."""
        if not reqs:
            return SpeculativeStep([], 0, 0)
        guesses = self.propose(reqs)
        lengths = [req.num_tokens for req in reqs]
        # While the target checks them, the guesses count in the request's length, as
        # tokens in flight do: the pass is then an ordinary prefill over a cached past.
        for req, count in zip(reqs, guesses.counts):
            req.in_flight = count
        new_pages = self.cache.reserve(reqs)
        batch = Batch(list(reqs), "prefill")
        verdict = verify(self.engine, batch, guesses)
        # The verdict starts for the host, then the draft's next steps start from it on the
        # device: the host waits for the copy only, and the device goes on guessing.
        packed = verdict.packed()
        host, ready = self._host_verdicts.copy(packed.view(-1))
        if self.draft is not None:
            self.draft.guess_ahead(verdict)
        # Each request's tokens go into the token pool on the device, as a decode step's
        # sample does, while the host would otherwise wait: it has nothing to write back.
        self.engine.token_pool.store_rows(reqs, lengths, [n + 1 for n in guesses.counts],
                                          verdict.tokens)
        if ready is not None:
            ready.synchronize()  # the host waits here
        emitted = unpack(host.view(packed.shape).tolist())
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
            self.cache.pages.shrink(req)
        return SpeculativeStep(read, new_pages, batch.num_tokens)

    def release(self, req: Req) -> None:
        """``req`` finished or was aborted: the draft forgets it."""
        if self.draft is not None:
            self.draft.release(req.uid)

    def counters(self, prefix: str = "") -> dict[str, int]:
        """Guesses made and kept so far, for ``/metrics``."""
        return {f"{prefix}spec_proposed_tokens": self.num_proposed,
                f"{prefix}spec_accepted_tokens": self.num_accepted}
