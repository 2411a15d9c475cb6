"""The scheduler: which requests run in the next forward pass, step after step.

The engine runs one batch it is handed. The :class:`Scheduler` decides the batches:

- requests arrive at any time (:meth:`Scheduler.add`) and wait in a queue;
- each :meth:`Scheduler.step` runs one forward pass: a **prefill** batch of waiting requests
  when any of them can be admitted (their worst-case KV pages fit, see ``prefill.py``), else a
  **decode** batch of every running request;
- a request that samples an end-of-sequence token, one of its stop tokens, or its
  ``max_tokens``-th token finishes in that same step: it leaves the batch, its pages go back,
  and a waiting request can take them on the very next step. Requests join and leave the
  running batch at every step: that is *continuous batching*;
- :meth:`Scheduler.abort` drops a request wherever it is, freeing its pages.

The parts are small and each has its module: ``prefill`` (the queue and admission), ``decode``
(the running set), ``cache`` (every page a request holds, through a prefix cache) and ``utils``
(a request's worst case, a step's report).

A step has four stages, each its own method so that a variant can change one of them:
:meth:`~Scheduler.schedule_next_batch` picks the requests (and cuts prompts into chunks),
:meth:`~Scheduler.prepare_batch` gives them pages, :meth:`~Scheduler.forward_batch` runs the
engine, and :meth:`~Scheduler.process_batch` appends the sampled tokens and retires finished
requests (the overlap scheduler, ``overlap.py``, does this during the next step's forward pass).

With ``chunked_prefill`` on (``chunking.py``), no prefill step computes more than
``max_prefill_tokens`` tokens: a longer prompt is computed a chunk per prefill step, and the
running requests decode between two of its chunks.
"""

from __future__ import annotations

import dataclasses

import torch

from minisgl.core import Batch, Req
from minisgl.engine.engine import Engine
from minisgl.scheduler.cache import CacheManager, make_prefix_cache
from minisgl.scheduler.chunking import ChunkedPrefillBudget, cut_reqs, is_mid_prefill, unsampled
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.decode import DecodeManager
from minisgl.scheduler.prefill import PrefillBudget, PrefillManager
from minisgl.scheduler.utils import StepResult, lifetime_pages, lifetime_tokens, output_room
from minisgl.utils.logger import get_logger

logger = get_logger(__name__)


class Scheduler:
    """Forms batches from requests that come and go, and runs them on an engine.

    Args:
        config: the engine's settings and the scheduler's (see :class:`SchedulerConfig`).

    Attributes:
        engine: the engine the batches run on (built from ``config``).
        cache: the cache manager: rows and pages of admitted requests.
        prefill: the waiting queue.
        decode: the running requests.
        eos_token_ids: the checkpoint's end-of-sequence token ids.
        max_seq_len: the longest sequence a request may reach: the engine's limit, and never
            more than the pool holds, so that any one request fits an otherwise empty pool.
        num_steps: steps that ran a batch so far.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        if not isinstance(config, SchedulerConfig):
            raise TypeError(f"Scheduler takes a SchedulerConfig, got {type(config).__name__}")
        self.config = config
        self.engine = Engine(config)
        self.cache = CacheManager(self.engine,
                                  make_prefix_cache(config.prefix_cache, config.page_size))
        self.prefill = PrefillManager(self.cache)
        self.decode = DecodeManager()
        self.eos_token_ids = tuple(self.engine.eos_token_ids)
        self.max_seq_len = min(self.engine.max_seq_len,
                               self.cache.num_pages * config.page_size)
        self.num_steps = 0
        self._live_uids: set[int] = set()  # waiting or running
        # The last prefill batch cut a prompt, so the running requests go next.
        self._decode_owed = False

    # ------------------------------------------------------------------ requests in and out
    def add(self, req: Req) -> None:
        """Queue a new request. It runs once admitted, on a later :meth:`step`.

        A ``max_tokens`` that would take the request past ``max_seq_len`` is lowered to fit
        (the request then finishes with ``"length"`` there), with a warning.

        Raises:
            ValueError: the uid is already waiting or running; the request has run before; a
                token id is outside the vocabulary; the prompt alone exceeds ``max_seq_len``.
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
        if lifetime_tokens(req) > self.max_seq_len:
            room = output_room(len(req.prompt_ids), self.max_seq_len)
            logger.warning("request %d: max_tokens %d lowered to %d to fit max_seq_len %d",
                           req.uid, req.params.max_tokens, room, self.max_seq_len)
            req.params = dataclasses.replace(req.params, max_tokens=room)
        self._live_uids.add(req.uid)
        self.prefill.add(req)

    def abort(self, uid: int) -> Req | None:
        """Drop request ``uid``, waiting or running, and free its pages at once.

        Returns the dropped request (its ``finish_reason`` stays None: it did not finish), or
        None when no such request is waiting or running: it finished already, or never came.
        A client that gives up races with its request finishing, so this is not an error.
        """
        req = self.prefill.remove(uid)
        if req is None:
            req = self.decode.remove(uid)
        if req is None:
            return None
        if req.table_row is not None:  # running (or partly prefilled)
            self.cache.release(req)
        self._live_uids.discard(uid)
        logger.debug("request %d aborted after %d output token(s)", uid, len(req.output_ids))
        return req

    @property
    def num_waiting(self) -> int:
        return len(self.prefill.waiting)

    @property
    def num_running(self) -> int:
        return len(self.decode.running)

    @property
    def num_live(self) -> int:
        """Requests that still own their uid: waiting or running (the overlap scheduler adds
        retiring)."""
        return self.num_waiting + self.num_running

    @property
    def has_work(self) -> bool:
        """Whether any request is waiting or running."""
        return self.prefill.runnable or bool(self.decode.running)

    # ------------------------------------------------------------------ one step
    def step(self) -> StepResult:
        """Run one batch, prefill or decode, and report what happened.

        Returns an idle result (``phase`` None) when no request is waiting or running.
        """
        batch = self.schedule_next_batch()
        if batch is None:
            return self.idle_step()
        num_tokens = batch.num_tokens  # read before the forward pass moves cached_len
        new_lens = tuple(batch.new_lens)  # likewise (each request's chunk)
        new_pages = self.prepare_batch(batch)
        next_tokens = self.forward_batch(batch)
        finished = self.process_batch(batch, next_tokens)
        result = self._report(batch, num_tokens, finished, new_pages=new_pages, new_lens=new_lens)
        self.num_steps += 1
        return result

    def idle_step(self) -> StepResult:
        """The step when no batch can run: idle, unless requests wait that could never run."""
        if self.prefill.runnable:  # admission can always take a request into an empty pool
            raise RuntimeError(f"{self.num_waiting} request(s) wait but none can be admitted "
                               f"with nothing running: {self.prefill_budget()}")
        return self._report(None, 0, [])

    def schedule_next_batch(self) -> Batch | None:
        """The next batch: prefill first, then decode.

        Waiting requests that fit start now, and the running ones skip this step. New requests
        get their first token as soon as possible and join the decode batch, which makes every
        later decode step serve more requests at once; the price is a pause in the running
        requests' output while a prompt is computed (chunked prefill bounds that pause).
        """
        # After a prefill batch that cut a prompt, the running requests decode before
        # its next chunk, so that however long the prompt, they wait one step at a time.
        owed, self._decode_owed = self._decode_owed, False
        if owed and bool(self.decode.running):
            return self.decode.schedule()
        if self.prefill.runnable:
            batch = self.prefill.schedule(self.prefill_budget())
            if batch is not None:
                self._decode_owed = bool(cut_reqs(batch))
                return batch
        return self.decode.schedule()

    def prefill_budget(self) -> PrefillBudget:
        """What a prefill batch formed now may take.

        The pages are those available minus what the running requests may still need to reach
        their own worst case: each was promised its pages on admission, and a promise is kept.
        """
        promised = sum(lifetime_pages(req, self.config.page_size) - self.cache.pages_held(req)
                       for req in self.admitted_reqs())
        # With chunked prefill the token budget is hard, and cuts prompts to fit.
        budget_class = ChunkedPrefillBudget if self.config.chunked_prefill else PrefillBudget
        return budget_class(tokens=self.config.max_prefill_tokens,
                            pages=self.cache.available_pages - promised,
                            rows=self.engine.pages.num_free_rows)

    def admitted_reqs(self) -> list[Req]:
        """Requests holding a row and a promise of pages: the running ones (and a request
        whose prompt is being prefilled in chunks, which still waits in line)."""
        return self.decode.running + [req for req in self.prefill.waiting
                                      if req.table_row is not None]

    def prepare_batch(self, batch: Batch) -> int:
        """Pages for every token this batch writes; returns how many were allocated."""
        return self.cache.reserve(batch.reqs)

    def forward_batch(self, batch: Batch) -> torch.Tensor:
        """Run the batch on the engine and move its requests past it: the ``[B]`` sampled token
        ids, still on the device."""
        # A cut request's sample is thrown away: it must not move its random generator on.
        with unsampled(cut_reqs(batch)):
            tokens = self.engine.forward(batch)
        batch.advance()
        return tokens

    def process_batch(self, batch: Batch, next_tokens: torch.Tensor) -> list[Req]:
        """Append each request's new token; retire the finished ones. Returns them.

        A prefilled request that did not finish joins the running set. A finished one leaves
        the batch now and hands its pages back, so the next step can give them to someone else.
        """
        finished: list[Req] = []
        for req, token in zip(batch.reqs, next_tokens.tolist(), strict=True):
            if is_mid_prefill(req):  # only a chunk of its prompt ran: no new token
                continue
            if req.append_token(token, self.eos_token_ids) is not None:
                self._retire(req)
                finished.append(req)
            elif batch.is_prefill:
                self.decode.add(req)
        return finished

    def _retire(self, req: Req) -> None:
        self.decode.remove(req.uid)  # absent when it finished on its first token
        self.cache.release(req)
        self._live_uids.discard(req.uid)
        logger.debug("request %d finished (%s) after %d token(s)", req.uid, req.finish_reason,
                     len(req.output_ids))

    # ------------------------------------------------------------------ bookkeeping
    def _report(self, batch: Batch | None, num_tokens: int, finished: list[Req],
                new_pages: int = 0, new_lens: tuple[int, ...] = ()) -> StepResult:
        return StepResult(
            step=self.num_steps,
            phase=None if batch is None else batch.phase,
            uids=() if batch is None else tuple(req.uid for req in batch.reqs),
            num_tokens=num_tokens,
            new_pages=new_pages,
            pages_in_use=self.cache.pages_in_use,
            num_pages=self.cache.num_pages,
            waiting=tuple(req.uid for req in self.prefill.waiting),
            running=tuple(req.uid for req in self.decode.running),
            finished=tuple(finished),
            new_lens=new_lens,
        )

    def check_integrity(self) -> None:
        """Check that no page and no row is lost or counted twice (tests call it every step).

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
        if len(self._live_uids) != self.num_live:
            raise RuntimeError(f"{len(self._live_uids)} live uids for {self.num_live} live "
                               f"requests ({self.num_waiting} waiting, {self.num_running} running)")
        # Only the request at the head of the queue may be between two chunks.
        partial = [req.uid for req in self.prefill.waiting if is_mid_prefill(req)]
        if partial and (len(partial) > 1 or partial[0] != self.prefill.waiting[0].uid):
            raise RuntimeError(f"requests {partial} are partly prefilled; only the head of the "
                               f"queue ({self.prefill.waiting[0].uid}) may be")

    def __repr__(self) -> str:
        return (f"Scheduler({self.num_waiting} waiting, {self.num_running} running, "
                f"{self.cache.pages_in_use}/{self.cache.num_pages} pages in use, "
                f"prefix cache {self.config.prefix_cache})")
