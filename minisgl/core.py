"""The engine's core data types.

- :class:`SamplingParams`: the per-request knobs that decide how the next token is chosen from
  the model's logits and when generation stops.
- :class:`Req`: one request as the engine sees it: its tokens, how many of them already have
  keys and values in the KV pool, its page-table row, its random generator and whether it has
  finished.
- :class:`Batch`: the requests of one forward pass, all in the prefill phase or all in the
  decode phase.

These are plain data: nothing here allocates memory, runs a model or decides which request runs
next. The engine (``minisgl.engine.engine``) runs batches and the scheduler
(``minisgl.scheduler``) builds them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from minisgl.utils.checks import check_int, is_int, is_number

if TYPE_CHECKING:  # type names only: this module must stay importable without torch
    import torch

# A torch.Generator accepts any seed that fits in an unsigned 64-bit integer.
_MAX_SEED = 2**64 - 1
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs

# Why generation ended: a stop or end-of-sequence token, or max_tokens reached.
FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop, for one request.

    The filters are applied in a fixed order to the temperature-scaled distribution:
    top-k, then top-p on what top-k kept, then min-p. Each filter always keeps the most
    likely token, so some token can always be drawn.

    Attributes:
        temperature: Divides the logits before the softmax. ``0`` means greedy decoding
            (always the most likely token); values below 1 sharpen the distribution, values
            above 1 flatten it.
        top_k: Keep only the ``k`` most likely tokens; ``-1`` turns the filter off.
        top_p: Nucleus sampling: keep the smallest set of most likely tokens whose total
            probability is at least ``top_p``; ``1.0`` turns the filter off.
        min_p: Drop tokens whose probability is below ``min_p`` times the probability of
            the most likely token; ``0.0`` turns the filter off.
        ignore_eos: Keep generating after an end-of-sequence token (benchmarks use this to
            get outputs of a known length).
        max_tokens: The most tokens to generate for this request.
        stop_token_ids: Extra token ids that end generation, like an end-of-sequence token
            but applied even when ``ignore_eos`` is set.
        seed: Seed for this request's own random generator, so that its samples are
            reproducible whatever else shares the batch; ``None`` uses the global generator.
        stop: Text that ends generation: when the output text contains one of
            these strings, the answer is the text before it. The engine works on tokens and
            ignores them; the server's detokenizer applies them. A single string is one stop
            string.
        logit_bias: ``(token id, bias)`` pairs (a dict is accepted) added to the logits, each
            bias in [-100, 100]: -100 all but bans a token, 100 all but forces it.
        min_tokens: Until this many tokens are generated, the end-of-sequence and stop tokens
            cannot be sampled.
        repetition_penalty: Divides the positive logits, and multiplies the negative ones, of
            every token already in the prompt or output; ``1.0`` is off.
        frequency_penalty: Subtracted from a token's logit once per time it appears in the
            output so far, in [-2, 2].
        presence_penalty: Subtracted from the logit of every token that appears in the output
            so far, in [-2, 2].
        logprobs: None, or return each sampled token's log-probability and those of the
            ``logprobs`` most likely tokens in its place (0 to 20), raw: before the five
            adjustments above, temperature and the filters.
        prompt_logprobs: None, or the same for every prompt token but the first (each given
            the tokens before it); a request that asks computes its whole prompt, without the
            prefix cache.
        grammar: None, or a grammar every output must follow (llguidance's serialized form,
            from :mod:`minisgl.grammar.compile`): each token is drawn from those it allows next,
            and the request ends (``"stop"``) once the grammar is complete (chapter 22).

    The five before ``logprobs`` adjust the logits before temperature and the filters, in that order
    (chapter 21); greedy requests take the argmax of the adjusted logits.
    """

    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    ignore_eos: bool = False
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = ()  # applied by the server's detokenizer, on text
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: str | None = None  # chapter 22
    # Whether the next token is always the argmax: temperature 0 by definition, and top_k 1 at
    # any temperature (only the most likely token survives the filter). Derived, not given.
    is_greedy: bool = field(init=False, repr=False, compare=False)
    # Whether any of the chapter 21 adjustments is on. Derived, not given.
    adjusts_logits: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._validate()
        self._validate_adjustments()
        object.__setattr__(self, "is_greedy", self.temperature == 0.0 or self.top_k == 1)
        object.__setattr__(self, "adjusts_logits", bool(
            self.logit_bias or self.min_tokens or self.repetition_penalty != 1.0
            or self.frequency_penalty or self.presence_penalty))


    def _validate(self) -> None:
        """Reject impossible values here, at the edge, with a message that names the field,
        the value and what is allowed; deeper code can then trust every field."""
        if self.grammar is not None and not isinstance(self.grammar, str):  # chapter 22
            _invalid("grammar", self.grammar, "None or a grammar's text (minisgl.grammar)")
        _check_real("temperature", self.temperature)
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            _invalid("temperature", self.temperature, "a finite number >= 0 (0 means greedy)")

        check_int("top_k", self.top_k, error=TypeError)
        if not (self.top_k == -1 or self.top_k >= 1):
            _invalid("top_k", self.top_k, "-1 (no top-k filter) or an integer >= 1")

        _check_real("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:  # also rejects NaN: every comparison with NaN fails
            _invalid("top_p", self.top_p, "a number in (0, 1] (1 means no top-p filter)")

        _check_real("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            _invalid("min_p", self.min_p, "a number in [0, 1] (0 means no min-p filter)")

        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

        check_int("max_tokens", self.max_tokens, error=TypeError)
        if self.max_tokens < 1:
            _invalid("max_tokens", self.max_tokens, "an integer >= 1")

        # Accept any iterable of ids (a list from JSON, a set) but store a tuple, so the
        # frozen dataclass stays hashable and nobody can mutate it behind our back.
        given = self.stop_token_ids
        if isinstance(given, (str, bytes)) or not isinstance(given, Iterable):
            raise TypeError(f"stop_token_ids must be a sequence of token ids, got {given!r}")
        stop_ids = tuple(given)
        bad = [t for t in stop_ids if not is_int(t) or t < 0]
        if bad:
            _invalid("stop_token_ids", given, f"a sequence of integers >= 0 ({bad[0]!r} is not)")
        object.__setattr__(self, "stop_token_ids", stop_ids)

        if self.seed is not None:
            check_int("seed", self.seed, error=TypeError)
            if not 0 <= self.seed <= _MAX_SEED:
                _invalid("seed", self.seed, f"None or an integer in [0, {_MAX_SEED}]")

        # An empty stop string would match at once, before any text: a bug.
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if isinstance(stop, bytes) or not isinstance(stop, Iterable):
            raise TypeError(f"stop must be a string or a sequence of strings, got {self.stop!r}")
        stop = tuple(stop)
        for text in stop:
            if not isinstance(text, str) or not text:
                _invalid("stop", self.stop, f"a sequence of non-empty strings ({text!r} is not)")
        object.__setattr__(self, "stop", stop)


    def _validate_adjustments(self) -> None:
        """:meth:`_validate` for the logit adjustments (chapter 21)."""
        given = self.logit_bias
        pairs = tuple(given.items()) if isinstance(given, Mapping) else tuple(given)
        for pair in pairs:
            token, bias = pair if isinstance(pair, tuple) and len(pair) == 2 else (None, None)
            if not (is_int(token) and token >= 0 and is_number(bias) and -100 <= bias <= 100):
                _invalid("logit_bias", given, "token id -> bias pairs, each id an integer >= 0 "
                                              f"and each bias in [-100, 100] ({pair!r} is not)")
        object.__setattr__(self, "logit_bias",
                           tuple(sorted((int(t), float(b)) for t, b in pairs)))
        check_int("min_tokens", self.min_tokens, error=TypeError)
        if self.min_tokens < 0:  # above max_tokens: no stop token at all, as max_tokens ends it
            _invalid("min_tokens", self.min_tokens, "an integer >= 0")
        _check_real("repetition_penalty", self.repetition_penalty)
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            _invalid("repetition_penalty", self.repetition_penalty, "a number > 0 (1 is off)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                check_int(name, value, error=TypeError)
                if not 0 <= value <= MAX_TOP_LOGPROBS:
                    _invalid(name, value, f"None or an integer in [0, {MAX_TOP_LOGPROBS}]")
        for name in ("frequency_penalty", "presence_penalty"):
            _check_real(name, getattr(self, name))
            if not -2.0 <= getattr(self, name) <= 2.0:
                _invalid(name, getattr(self, name), "a number in [-2, 2] (0 is off)")


def _check_real(field: str, value: object) -> None:
    if not is_number(value):
        raise TypeError(f"{field} must be a number, got {value!r} ({type(value).__name__})")


def _invalid(field: str, value: object, allowed: str) -> None:
    raise ValueError(f"{field} must be {allowed}, got {value!r}")


# --------------------------------------------------------------------------------------------
# Requests and batches
# --------------------------------------------------------------------------------------------

Phase = Literal["prefill", "decode"]
PHASES: tuple[Phase, ...] = ("prefill", "decode")


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's log-probability, and the most likely tokens in its place (``(id,
    logprob)``, most likely first), as :attr:`SamplingParams.logprobs` asks (chapter 21)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(eq=False)  # identity, not field equality: two requests with equal fields are two
class Req:
    """One request on its way through the engine.

    A request's tokens are its prompt followed by what it has generated so far. The KV pool
    holds keys and values for the first ``cached_len`` of them; the remaining ``new_len``
    tokens are what the next forward pass must compute. After a prefill that is exactly one
    token (the last sampled one, whose K/V nobody has computed yet), so every later pass is a
    one-token decode step.

    A sampled token is *in flight* from the moment the engine writes it into its
    token pool on the device until the host reads it and appends it to ``output_ids``. It
    counts in the request's length (the next step feeds it) but not in ``output_ids``.

    Attributes:
        uid: the caller's id for the request (unique among running requests).
        prompt_ids: the prompt's token ids (at least one).
        params: how to sample and when to stop.
        output_ids: tokens generated so far and read by the host, in order.
        table_row: the request's row of the page table while it holds one (set by the engine
            on admission), else None.
        cached_len: leading tokens whose K/V are stored in the pool.
        generator: the request's own random generator when ``params.seed`` is set (made by the
            engine on the engine's device), else None.
        finish_reason: None while running; "stop" (EOS or a stop token) or "length"
            (``max_tokens`` reached) once finished.
        in_flight: tokens sampled on the device that the host has not read yet.
        output_logprobs: with ``params.logprobs`` set, one entry per token of ``output_ids``.
        prompt_logprobs: with ``params.prompt_logprobs`` set, one entry per prompt token from
            the second on, filled as the prompt's chunks are computed.
        grammar: with ``params.grammar`` set, the request's place in its grammar (a
            :class:`~minisgl.grammar.states.GrammarState`, made by the scheduler; chapter 22).
    """

    uid: int
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    output_ids: list[int] = field(default_factory=list)
    table_row: int | None = None
    cached_len: int = 0
    generator: torch.Generator | None = field(default=None, repr=False)
    finish_reason: FinishReason | None = None
    in_flight: int = 0
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)  # chapter 21
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # chapter 21
    grammar: Any = field(default=None, repr=False)  # chapter 22

    def __post_init__(self) -> None:
        # Accept any sequence of ids, or a 1-D tensor; store a plain list of ints.
        raw = self.prompt_ids
        ids = raw.tolist() if hasattr(raw, "tolist") else list(raw)
        if not ids:
            raise ValueError(f"request {self.uid}: the prompt must hold at least one token")
        bad = [t for t in ids if not is_int(t) or t < 0]
        if bad:
            raise ValueError(f"request {self.uid}: token ids must be integers >= 0, got {bad[:4]}")
        self.prompt_ids = [int(t) for t in ids]
        if not isinstance(self.params, SamplingParams):
            raise TypeError(f"request {self.uid}: params must be SamplingParams, "
                            f"got {type(self.params).__name__}")

    @property
    def token_ids(self) -> list[int]:
        """Prompt and output, in order: the sequence the model continues, as the host has it."""
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """Tokens in the sequence so far, in flight included; the next pass leaves this many
        in the pool."""
        return len(self.prompt_ids) + len(self.output_ids) + self.in_flight

    @property
    def new_len(self) -> int:
        """Tokens the next forward pass computes: those without K/V in the pool yet."""
        return self.num_tokens - self.cached_len

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def append_token(self, token_id: int,
                     eos_token_ids: Sequence[int] = ()) -> FinishReason | None:
        """Record a sampled token and decide whether the request is done.

        A stop token always ends the request, an end-of-sequence token ends it unless
        ``ignore_eos``, and reaching ``max_tokens`` ends it. The stopping token is kept in
        ``output_ids``. Returns the finish reason, or None to keep going.

        When a token is in flight, this is that token reaching the host: it moves
        from ``in_flight`` to ``output_ids``, and the length does not change.
        """
        if self.finish_reason is not None:
            raise RuntimeError(f"request {self.uid} already finished ({self.finish_reason}); "
                               "it cannot take another token")
        self.output_ids.append(int(token_id))
        if self.in_flight:
            self.in_flight -= 1
        if token_id in self.params.stop_token_ids:
            self.finish_reason = "stop"
        elif not self.params.ignore_eos and token_id in eos_token_ids:
            self.finish_reason = "stop"
        elif len(self.output_ids) >= self.params.max_tokens:
            self.finish_reason = "length"
        return self.finish_reason

    def __repr__(self) -> str:
        return (f"Req(uid={self.uid}, tokens={self.num_tokens}, cached={self.cached_len}, "
                f"row={self.table_row}, finished={self.finish_reason})")


@dataclass
class Batch:
    """The requests of one forward pass, and its phase.

    ``"prefill"``: each request brings one or more new tokens (a whole prompt, or what is left
    of it after a cached prefix). ``"decode"``: each request brings exactly the one token it
    sampled last, after a cached past. The phase decides which attention kernel runs, and only
    decode batches can be replayed as CUDA graphs, because their shape depends on the number of
    requests alone.

    ``chunk_lens`` lets a pass compute only the first ``chunk_lens[i]`` of request ``i``'s
    uncomputed tokens instead of all of them (chunked prefill splits long prompts this way);
    None means all of them.

    The lengths a step needs are fixed when the batch is formed, because :meth:`advance` moves
    each request's ``cached_len`` on after the launch: ``cached_lens``, ``new_lens`` (what each
    request computes) and ``completes`` (whether that is everything it had left). Only a request
    that completes samples its next token; a prompt cut by chunked prefill samples nothing
    meaningful. With ``rows`` these are what an attention backend reads of the batch.
    """

    reqs: list[Req]
    phase: Phase
    chunk_lens: list[int] | None = None
    new_lens: list[int] = field(init=False, repr=False)  # tokens each request computes
    completes: list[bool] = field(init=False, repr=False)  # it computes all it had left
    num_tokens: int = field(init=False, repr=False)  # sum(new_lens): the model's input length
    cached_lens: list[int] = field(init=False, repr=False)  # each request's, before the pass
    size: int = field(init=False, repr=False)  # requests
    is_prefill: bool = field(init=False, repr=False)
    is_decode: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.reqs = list(self.reqs)
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {self.phase!r}")
        if not self.reqs:
            raise ValueError("a batch needs at least one request")
        if len({id(r) for r in self.reqs}) != len(self.reqs):
            raise ValueError("a request appears twice in one batch")
        left = [req.new_len for req in self.reqs]  # what each has left to compute
        for req, n in zip(self.reqs, left):
            if req.finish_reason is not None:
                raise ValueError(f"request {req.uid} has finished ({req.finish_reason}); "
                                 "it cannot run again")
            if n < 1:
                raise ValueError(f"request {req.uid} has nothing to compute "
                                 f"(cached_len {req.cached_len} = num_tokens {req.num_tokens})")
            if self.phase == "decode" and (n != 1 or req.cached_len == 0):
                raise ValueError(f"request {req.uid} cannot decode: a decode step needs exactly "
                                 f"one new token after a cached past, it has {n} new "
                                 f"after {req.cached_len} cached (prefill it first)")
        if self.chunk_lens is not None:
            self.chunk_lens = list(self.chunk_lens)
            if len(self.chunk_lens) != len(self.reqs):
                raise ValueError(f"chunk_lens has {len(self.chunk_lens)} entries for "
                                 f"{len(self.reqs)} requests")
            for req, n, most in zip(self.reqs, self.chunk_lens, left):
                if not 1 <= n <= most:
                    raise ValueError(f"request {req.uid}: a chunk of {n} tokens must be "
                                     f"between 1 and its {most} uncomputed tokens")
        self.new_lens = left if self.chunk_lens is None else list(self.chunk_lens)
        self.completes = [n == m for n, m in zip(self.new_lens, left)]
        self.num_tokens = sum(self.new_lens)
        self.cached_lens = [req.cached_len for req in self.reqs]
        self.size = len(self.reqs)
        self.is_prefill, self.is_decode = self.phase == "prefill", self.phase == "decode"

    @property
    def rows(self) -> list[int | None]:
        """Each request's page-table row (rows are handed out when pages are reserved)."""
        return [req.table_row for req in self.reqs]

    def advance(self) -> None:
        """Move every request past this batch's forward pass, once it has been launched.

        The K/V of the tokens it fed are in the pool now, so ``cached_len`` moves past them;
        a request that computed all it had left sampled its next token, which is *in flight*
        until the host appends it (:meth:`Req.append_token`). Whoever runs the batch (the
        scheduler, or a chapter's loop) calls this: the engine only computes.
        """
        for req, computed, complete in zip(self.reqs, self.new_lens, self.completes):
            req.cached_len += computed
            req.in_flight += complete
