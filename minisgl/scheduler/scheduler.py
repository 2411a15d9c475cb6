"""The scheduler: which requests run in the next forward pass, step after step.

Requests wait in a queue (``prefill.py``) until their worst-case pages fit, run in prefill or
decode batches, and leave the step their last token is read: continuous batching
(chapter 9). Long prompts may be cut into chunks (``prefill.py``, chapter 10). One loop serves
both ways of running: synchronously, the host reads a batch's tokens right after launching it;
with ``overlap`` (chapter 12) it reads them one step later, while the device runs the next batch
(``overlap.py``: the batch in flight and its copy to the host). Under tensor parallelism rank 0's
scheduler tells its ``followers`` every input, so that every rank runs the same steps
(chapter 17). With ``speculative`` set, a decode step guesses ahead and verifies the guesses in
one pass (``speculative.py``, chapter 23).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from minisgl.core import Batch, Phase, Req
from minisgl.engine.engine import Engine
from minisgl.engine.logprobs import unpack_logprobs
from minisgl.grammar.states import Grammars
from minisgl.scheduler.cache import PREFIX_CACHES, CacheManager
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.overlap import HostTokens, InFlight
from minisgl.scheduler.prefill import (ChunkedPrefillBudget, PrefillBudget, PrefillManager,
                                       cut_reqs, lifetime_pages, output_room, unsampled)
from minisgl.scheduler.speculative import SpeculativeStep, Speculator, takes
from minisgl.utils.logger import get_logger

if TYPE_CHECKING:  # tp.py builds on this module
    from minisgl.scheduler.tp import RankFollowers

logger = get_logger(__name__)


@dataclass(frozen=True)
class StepResult:
    """What one scheduler step did.

    Attributes:
        step: the step's number, from 0.
        phase: ``"prefill"`` or ``"decode"``; None when there was nothing to run.
        uids: the requests of the batch, in batch order.
        num_tokens: tokens fed to the model (prompt tokens in a prefill, one per request in a
            decode step).
        new_pages: KV pages allocated for this step.
        pages_in_use: KV pages held after the step (finished requests' pages already returned).
        num_pages: KV pages the scheduler manages in all.
        waiting: uids still in the waiting queue after this step, in arrival order.
        running: uids holding KV pages after this step (they decode in the next decode step).
        finished: requests that finished in this step; each has its ``finish_reason``.
        new_lens: tokens each request of the batch computed, in batch order (a request whose
            prompt was cut computed only a chunk of it).
        read: the requests whose next token the host read in this step (``finished`` among
            them): with overlap, those of the batch before.
    """

    step: int
    phase: Phase | None
    uids: tuple[int, ...]
    num_tokens: int
    new_pages: int
    pages_in_use: int
    num_pages: int
    waiting: tuple[int, ...]
    running: tuple[int, ...]
    finished: tuple[Req, ...]
    new_lens: tuple[int, ...] = ()
    read: tuple[Req, ...] = ()


class Scheduler:
    """Forms batches from requests that come and go, and runs them on an engine.

    Args:
        config: the engine's settings and the scheduler's (see :class:`SchedulerConfig`).
        followers: under tensor parallelism, the other ranks (rank 0 only); None otherwise.

    Attributes:
        engine: the engine the batches run on (built from ``config``).
        cache: the cache manager: rows and pages of admitted requests.
        prefill: the waiting queue.
        running: uid -> request, for the requests prefilled and not finished, in the order
            they joined: each decode batch takes them all.
        overlap: whether a step reads the tokens of the batch before it (switchable while
            ``has_work`` is False).
        max_seq_len: the longest sequence a request may reach.
        num_steps: steps run so far.

    A step's :class:`StepResult` describes the batch it launched, and the requests whose last
    token it read: with overlap, those of the batch before.
    """

    def __init__(self, config: SchedulerConfig, followers: RankFollowers | None = None) -> None:
        if not isinstance(config, SchedulerConfig):
            raise TypeError(f"Scheduler takes a SchedulerConfig, got {type(config).__name__}")
        self.config = config
        self.followers = followers
        self.engine = Engine(config)
        self.cache = CacheManager(self.engine, PREFIX_CACHES[config.prefix_cache](config.page_size))
        self.prefill = PrefillManager(self.cache)
        self.running: dict[int, Req] = {}
        self.overlap = config.overlap
        self.eos_token_ids = tuple(self.engine.eos_token_ids)
        self.max_seq_len = min(self.engine.max_seq_len, self.cache.num_pages * config.page_size)
        self.num_steps = 0
        self._live_uids: set[int] = set()  # waiting, running or retiring
        # Out of the running set, still holding pages: their last token is not read yet.
        self._retiring: dict[int, Req] = {}
        self._in_flight: InFlight | None = None  # launched, tokens not read (overlap only)
        self._host_tokens = HostTokens(self.engine.device, config.max_running_reqs)
        self._decode_owed = False  # the last prefill cut a prompt: the running requests go next
        # Chapter 22: the matchers of requests with a grammar (built at the first one).
        self.grammars = Grammars(config.model_path, self.engine.model_config.vocab_size,
                                 self.eos_token_ids)
        self.speculator: Speculator | None = None  # chapter 23
        if config.speculative is not None:
            if self.engine.tp.size > 1:
                raise ValueError("speculative decoding runs on one rank: it cannot be combined "
                                 "with tensor parallelism")
            self.speculator = Speculator(config, self.engine, self.cache)

    # ------------------------------------------------------------------ requests in and out
    def add(self, req: Req) -> None:
        """Queue a new request; it runs once admitted, on a later :meth:`step`.

        A ``max_tokens`` that would take the request past ``max_seq_len`` is lowered to fit
        (it then finishes with ``"length"`` there), with a warning.

        Raises:
            ValueError: the uid is already live; the request has run before; a token id is
                outside the vocabulary; the prompt alone exceeds ``max_seq_len``.
        """
        if req.uid in self._live_uids:
            raise ValueError(f"request uid {req.uid} is already waiting or running")
        if req.table_row is not None or req.cached_len or req.output_ids or req.is_finished:
            raise ValueError(f"request {req.uid} has run before; add a fresh Req")
        vocab_size = self.engine.model_config.vocab_size
        if max(req.prompt_ids) >= vocab_size:
            raise ValueError(f"request {req.uid}: token id {max(req.prompt_ids)} is outside the "
                             f"vocabulary (0..{vocab_size - 1})")
        if len(req.prompt_ids) > self.max_seq_len:
            raise ValueError(f"request {req.uid}: its prompt of {len(req.prompt_ids)} tokens is "
                             f"longer than max_seq_len ({self.max_seq_len})")
        if self.followers is not None:  # as it came in: a follower's add() adjusts it alike
            self.followers.added(req)
        room = output_room(len(req.prompt_ids), self.max_seq_len)
        if req.params.max_tokens > room:
            logger.warning("request %d: max_tokens %d lowered to %d to fit max_seq_len %d",
                           req.uid, req.params.max_tokens, room, self.max_seq_len)
            req.params = dataclasses.replace(req.params, max_tokens=room)
        if req.params.grammar is not None:  # chapter 22
            req.grammar = self.grammars.start(req.params.grammar)
        self._live_uids.add(req.uid)
        self.prefill.waiting.append(req)

    def abort(self, uid: int) -> Req | None:
        """Drop request ``uid``, waiting or running, and free its pages at once.

        Returns the dropped request (its ``finish_reason`` stays None), or None when no such
        request is waiting or running: it finished (or its last token is in flight), or never
        came. A client that gives up races with its request finishing: not an error.
        """
        if self.followers is not None:
            self.followers.aborted(uid)
        req = self.prefill.remove(uid) or self.running.pop(uid, None)
        if req is None:
            return None
        req.in_flight = 0  # a sample in flight is never read: the batch's reader skips it
        self._release(req)
        logger.debug("request %d aborted after %d output token(s)", uid, len(req.output_ids))
        return req

    @property
    def num_waiting(self) -> int:
        return len(self.prefill.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def has_work(self) -> bool:
        """Whether a request waits or runs, or a batch's tokens are still to be read."""
        return bool(self.prefill.waiting or self.running or self._in_flight)

    # ------------------------------------------------------------------ one step
    def step(self) -> StepResult:
        """Launch one batch, prefill or decode, read the tokens due, and report.

        Returns an idle result (``phase`` None) when no batch could be launched. Under tensor
        parallelism the followers step first, and a failed step raises their error.
        """
        if self.followers is not None:
            self.followers.stepping(self.num_steps)
        try:
            early = self._read_constrained_early()  # chapter 22
            batch = self.schedule_next_batch()
            new_pages, launched, guessed, fed = 0, None, [], 0
            if batch is not None:
                ran: Batch | None = batch
                if batch.is_decode and self.speculator is not None:  # chapter 23
                    ran, spec = self._decode_speculatively(batch)
                    guessed, new_pages, fed = spec.read, spec.new_pages, spec.num_tokens
                if ran is not None:
                    new_pages += self.cache.reserve(ran.reqs)
                    launched = self._launch(ran)
                    fed += ran.num_tokens
                self.num_steps += 1
            elif self._in_flight is None and self.prefill.waiting:
                raise RuntimeError(f"{self.num_waiting} request(s) wait but none can be admitted "
                                   f"with nothing running: {self.prefill_budget()}")
            if self.overlap:
                due, self._in_flight = self._in_flight, launched
            else:
                due = launched
            read = early + guessed + ([] if due is None else self._read(due))
            return StepResult(
                step=self.num_steps - (batch is not None),
                phase=None if batch is None else batch.phase,
                uids=() if batch is None else tuple(req.uid for req in batch.reqs),
                num_tokens=fed,
                new_pages=new_pages,
                pages_in_use=self.cache.pages_in_use,
                num_pages=self.cache.num_pages,
                waiting=tuple(req.uid for req in self.prefill.waiting),
                running=tuple(self.running),
                finished=tuple(dict.fromkeys(req for req in read if req.finish_reason)),
                new_lens=() if batch is None else tuple(batch.new_lens),
                read=tuple(read),
            )
        except Exception as exc:
            if self.followers is None:
                raise
            raise self.followers.failed(self.num_steps, exc) from exc

    def schedule_next_batch(self) -> Batch | None:
        """The next batch: prefill first, then decode.

        Waiting requests that fit start now and the running ones skip this step: a new
        request gets its first token soon and then joins every decode batch. After a prefill
        that cut a prompt, the running requests decode before its next chunk.
        """
        owed, self._decode_owed = self._decode_owed, False
        if self.prefill.waiting and not (owed and self.running):
            batch = self.prefill.schedule(self.prefill_budget())
            if batch is not None:
                self._decode_owed = bool(cut_reqs(batch))
                return batch
        # Every running request, one new token each. The set changes between steps, so a
        # batch never carries finished requests nor waits for the slowest.
        return Batch(list(self.running.values()), "decode") if self.running else None

    def prefill_budget(self) -> PrefillBudget:
        """What a prefill batch formed now may take: the pages available minus what admitted
        requests may still need to reach their own worst case (a promise is kept)."""
        promised = sum(lifetime_pages(req, self.config.page_size)
                       - self.cache.pages.pages_held(req) for req in self.admitted_reqs())
        budget_class = ChunkedPrefillBudget if self.config.chunked_prefill else PrefillBudget
        return budget_class(tokens=self.config.max_prefill_tokens,
                            pages=self.cache.available_pages - promised,
                            rows=self.engine.pages.num_free_rows)

    def admitted_reqs(self) -> list[Req]:
        """Requests holding a row: running, retiring, or between two chunks of a prompt."""
        return (list(self.running.values()) + list(self._retiring.values())
                + [req for req in self.prefill.waiting if req.table_row is not None])

    def _launch(self, batch: Batch) -> InFlight:
        """Run ``batch`` on the engine, move its requests past it, and start copying its tokens
        to the host.

        A request whose last token is now in flight leaves the running set at once: it
        finishes whatever it samples, so it must not run again. A prefilled request that
        goes on joins the running set.
        """
        # chapter 21: logprobs are computed only for a batch in which a request asks
        asks = any(req.params.logprobs is not None or req.params.prompt_logprobs is not None
                   for req in batch.reqs)
        if batch.is_prefill:  # a cut chunk's sample is thrown away: its generator stays put
            with unsampled(cut_reqs(batch)):
                out = self.engine.forward(batch, return_logprobs=asks)
        else:
            out = self.engine.forward(batch, return_logprobs=asks)
        tokens, logprobs = out if asks else (out, None)
        batch.advance()  # lengths are the scheduler's: the engine only computed
        for req, complete in zip(batch.reqs, batch.completes):
            if not complete:  # only a chunk of its prompt ran
                continue
            if batch.is_prefill:  # chapter 21: a prompt is shared from its prefill on
                self.cache.cache_prompt(req)
            if len(req.output_ids) + req.in_flight >= req.params.max_tokens:
                self.running.pop(req.uid, None)
                self._retiring[req.uid] = req
            elif batch.is_prefill:
                self.running[req.uid] = req
        if logprobs is not None:  # chapter 21: copied before the tokens, whose event covers both
            logprobs = logprobs.to_host()
        return InFlight(batch, *self._host_tokens.copy(tokens), logprobs)

    def _decode_speculatively(self, batch: Batch) -> tuple[Batch | None, SpeculativeStep]:
        """Chapter 23: decode with guesses the requests of ``batch`` that may
        (:func:`~minisgl.scheduler.speculative.takes`), and retire those that finished.

        Returns the others as a decode batch (None if there are none), and what the
        speculative step did.
        """
        rest = [req for req in batch.reqs if not takes(req)]
        step = self.speculator.decode([req for req in batch.reqs if takes(req)],
                                      self.eos_token_ids)
        for req in dict.fromkeys(step.read):
            if req.finish_reason is not None:
                self.running.pop(req.uid, None)
                self._release(req)
        return (Batch(rest, "decode") if rest else None), step

    def _read_constrained_early(self) -> list[Req]:
        """With overlap, read the batch in flight now, before the next is formed, when a
        request with a grammar sampled in it: its next mask depends on that token (chapter 22).
        Batches without such a request keep the overlap."""
        flight = self._in_flight
        if flight is None or not any(req.grammar is not None and complete for req, complete
                                     in zip(flight.batch.reqs, flight.batch.completes)):
            return []
        self._in_flight = None
        return self._read(flight)

    def _read(self, flight: InFlight) -> list[Req]:
        """Append ``flight``'s tokens to their requests and retire the finished; returns the
        requests that took a token.

        A request that finished while it also runs in the batch now in flight (an EOS the host
        could not foresee) is a *zombie*: that batch's token for it is dropped when read, and
        its pages go back only then, because that batch still writes into them.
        """
        if flight.ready is not None:  # the host's one wait; bounded: a dead peer's collective
            flight.ready.synchronize()  # is aborted (chapter 17)
        read: list[Req] = []
        logprobs, prompt_logprobs = ({}, {}) if flight.logprobs is None else unpack_logprobs(
            flight.logprobs, flight.batch)  # chapter 21
        for i, entries in prompt_logprobs.items():  # every chunk's, whether cut or not
            flight.batch.reqs[i].prompt_logprobs.extend(entries)
        for i, (req, complete, token) in enumerate(zip(
                flight.batch.reqs, flight.batch.completes, flight.host_tokens.tolist(),
                strict=True)):
            if not complete or req.table_row is None:  # a cut chunk, or aborted since launch
                continue
            # A zombie: its real last token came from the batch before.
            if req.finish_reason is not None:
                req.in_flight -= 1
                self._release(req)
                continue
            read.append(req)
            if i in logprobs:
                req.output_logprobs.append(logprobs[i])
            finished = req.append_token(token, self.eos_token_ids) is not None
            if req.grammar is not None:  # chapter 22: a complete grammar ends the request
                finished = req.grammar.advance(req, token)
            if not finished:
                continue
            self.running.pop(req.uid, None)
            logger.debug("request %d finished (%s) after %d token(s)", req.uid,
                         req.finish_reason, len(req.output_ids))
            if req.in_flight:  # it runs in the batch in flight: keep its pages until then
                self._retiring[req.uid] = req
            else:
                self._release(req)
        return read

    def _release(self, req: Req) -> None:
        self._retiring.pop(req.uid, None)
        if self.speculator is not None:  # chapter 23: the draft's copy goes too
            self.speculator.release(req)
        if req.table_row is not None:  # it held a row: running, or partly prefilled
            self.cache.release(req)
        self._live_uids.discard(req.uid)

    # ------------------------------------------------------------------ bookkeeping
    def gauges(self, prefix: str = "") -> dict[str, int]:
        """The state ``/metrics`` shows, under counter names that start with ``prefix``; pages
        the prefix cache could evict count as free."""
        in_use = self.cache.pages_in_use - self.cache.prefix_cache.num_evictable_pages
        gauges = {f"{prefix}running": len(self.running),
                  f"{prefix}waiting": len(self.prefill.waiting),
                  f"{prefix}kv_pages_in_use": in_use}
        if self.speculator is not None:  # chapter 23: guesses made and kept
            gauges.update(self.speculator.counters(prefix))
        return gauges

    def check_integrity(self) -> None:
        """Check that no page, row or uid is lost or counted twice, and that every request's
        ``in_flight`` counts its samples in the batch in flight (tests call it every step).

        Raises:
            RuntimeError: the bookkeeping disagrees with itself.
        """
        self.cache.check_integrity()
        admitted = len(self.admitted_reqs())
        rows_used = self.config.max_running_reqs - self.engine.pages.num_free_rows
        if not admitted == self.cache.num_admitted == rows_used:
            raise RuntimeError(f"{admitted} request(s) should hold rows, the cache manager "
                               f"tracks {self.cache.num_admitted}, the page table has "
                               f"{rows_used} in use")
        live = self.num_waiting + self.num_running + len(self._retiring)
        if len(self._live_uids) != live:
            raise RuntimeError(f"{len(self._live_uids)} live uids for {live} live "
                               f"requests ({self.num_waiting} waiting, {self.num_running} running)")
        partial = [req.uid for req in self.prefill.waiting if req.table_row is not None]
        if partial and (len(partial) > 1 or partial[0] != self.prefill.waiting[0].uid):
            raise RuntimeError(f"requests {partial} are partly prefilled; only the head of the "
                               f"queue ({self.prefill.waiting[0].uid}) may be")
        flight = self._in_flight
        unread = set() if flight is None else {
            req for req, complete in zip(flight.batch.reqs, flight.batch.completes) if complete}
        for req in self.admitted_reqs():
            if req.in_flight != (req in unread):
                raise RuntimeError(f"request {req.uid} counts {req.in_flight} token(s) in "
                                   f"flight; the batch in flight holds {int(req in unread)}")

    def close(self) -> None:
        """Release what outlives the process's memory: a leader's followers leave the group."""
        if self.followers is not None:
            self.followers.close()
