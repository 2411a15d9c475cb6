"""The scheduler's settings: the engine's, plus the few that decide how batches are formed.

A :class:`SchedulerConfig` *is* an :class:`~minisgl.engine.config.EngineConfig` (the scheduler
builds its engine from it) with a few more fields:

- ``max_prefill_tokens``: the per-step token budget of a prefill batch;
- ``prefix_cache``: which prefix cache keeps KV pages after their request finishes;
- ``chunked_prefill``: make the token budget a hard limit by cutting long prompts
  into chunks computed over several steps;
- ``overlap``: let the host plan the next step while the device runs this one
  (read by :class:`~minisgl.scheduler.scheduler.Scheduler`);
- ``speculative``: guess several tokens per decode step and verify them in one pass
  (chapter 23; :class:`Speculation` reads the setting).

The engine's ``max_running_reqs`` (rows of the page table) is also the scheduler's limit on
requests running at once: a request needs a row to hold pages.
"""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.engine.config import EngineConfig
from minisgl.env import read_env
from minisgl.scheduler.cache import PREFIX_CACHES
from minisgl.utils.checks import check_int

# Upstream mini-sglang's default per-step token budget. A prefill of this many tokens keeps a
# large GPU busy; more only makes the decoding requests that wait behind it wait longer.
DEFAULT_MAX_PREFILL_TOKENS = 8192


@dataclass(frozen=True)
class Speculation:
    """How decode steps guess ahead (chapter 23), read from ``SchedulerConfig.speculative``.

    The setting is ``ngram`` (prompt lookup: no model) or ``draft=PATH`` (a small model of
    the same tokenizer), optionally followed by ``,k=N``: at most ``N`` guesses a step
    (default 4), and by ``,ahead=off``: a draft's next round waits for the host to read the
    verdict before it (to measure what launching it ahead saves; on by default).

    Attributes:
        draft: the draft model's checkpoint, or None for prompt lookup.
        k: the most tokens guessed per request and step.
        ahead: whether a draft's next steps and verify pass may be launched from the device's
            verdict before the host reads it (CUDA graphs only).
    """

    draft: str | None
    k: int = 4
    ahead: bool = True

    @classmethod
    def parse(cls, text: str) -> Speculation:
        head, *options = [part.strip() for part in str(text).split(",")]
        usage = "ngram or draft=PATH, optionally followed by ,k=N (N >= 1) and ,ahead=on|off"
        if head == "ngram":
            draft = None
        elif head.startswith("draft=") and head[len("draft="):]:
            draft = head[len("draft="):]
        else:
            raise ValueError(f"speculative must be {usage}; got {text!r}")
        k, ahead = 4, True
        for option in options:
            name, _, value = option.partition("=")
            if name == "k" and value.isdigit() and int(value) >= 1:
                k = int(value)
            elif name == "ahead" and value in ("on", "off"):
                ahead = value == "on"
            else:
                raise ValueError(f"speculative must be {usage}; got {text!r}")
        return cls(draft=draft, k=k, ahead=ahead)


@dataclass(frozen=True)
class SchedulerConfig(EngineConfig):
    """Everything :class:`~minisgl.scheduler.scheduler.Scheduler` needs to start.

    Attributes (besides the engine's):
        max_prefill_tokens: the most prompt tokens one prefill step computes, summed over its
            requests. Requests join a prefill batch first come, first served, until the next
            would go over. The first request of a batch is always taken, however long its
            prompt: unless ``chunked_prefill`` is on, a prompt longer than the budget runs in
            a batch of its own.
        prefix_cache: the prefix cache: ``"naive"`` keeps nothing; ``"radix"`` shares common
            prefixes between requests.
    """

    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS
    prefix_cache: str = "naive"
    # When True, no prefill step computes more than max_prefill_tokens tokens: the
    # prompt that does not fit is cut, and the rest of it runs in the next prefill steps (see
    # scheduler/prefill.py). Off by default: a prompt is computed whole unless asked.
    chunked_prefill: bool = False
    # Whether a step reads the tokens of the batch before it, so that the host's work for the
    # next step overlaps the device's for this one (scheduler/overlap.py). None (the default)
    # means on, unless MINISGL_DISABLE_OVERLAP is set; the config then holds True or False.
    overlap: bool | None = None
    # Chapter 23: None (off), "ngram" or "draft=PATH", with ",k=N" for N guesses a step
    # (:class:`Speculation`). A verify step reads its tokens at once, so overlap is off then.
    speculative: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()  # the engine's fields first
        if self.speculative is not None:
            Speculation.parse(self.speculative)  # raises naming what is wrong
            if self.overlap:
                raise ValueError("overlap scheduling and speculative decoding exclude each "
                                 "other: a step's guesses need the token the step before "
                                 "sampled; leave overlap unset or set it to False")
            object.__setattr__(self, "overlap", False)
        check_int("max_prefill_tokens", self.max_prefill_tokens, at_least=1)
        if not isinstance(self.chunked_prefill, bool):
            raise TypeError(f"chunked_prefill must be True or False, got {self.chunked_prefill!r}")
        if self.overlap is None:  # the environment is read once, here, at the edge
            object.__setattr__(self, "overlap", not read_env().disable_overlap)
        if not isinstance(self.overlap, bool):
            raise TypeError(f"overlap must be True, False or None (on unless "
                            f"MINISGL_DISABLE_OVERLAP is set), got {self.overlap!r}")
        if self.prefix_cache not in PREFIX_CACHES:
            raise ValueError(f"prefix_cache must be one of {', '.join(PREFIX_CACHES)}; "
                             f"got {self.prefix_cache!r}")

    @property
    def max_decode_entries(self) -> int:
        """A verify pass (chapter 23) feeds each request's last token and its guesses as decode
        entries of their own: ``k + 1`` a request, which the CUDA graphs must cover too (with
        graphs for the requests alone, batch 1 would verify eagerly)."""
        entries = super().max_decode_entries
        if self.speculative is None:
            return entries
        return entries * (Speculation.parse(self.speculative).k + 1)
