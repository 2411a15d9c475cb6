"""The engine's core data types.

For now this module holds one type, :class:`SamplingParams`: the per-request knobs that decide
how the next token is chosen from the model's logits and when generation stops. Everything that
turns logits into tokens (``minisgl.engine.sample``) and every loop that generates
(``minisgl.engine.simple_loop`` and, later, the scheduler) reads its decisions from here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from numbers import Integral, Real

# A torch.Generator accepts any seed that fits in an unsigned 64-bit integer.
_MAX_SEED = 2**64 - 1


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
    """

    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    ignore_eos: bool = False
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        self._validate()

    @property
    def is_greedy(self) -> bool:
        """True when the next token is always the argmax of the logits.

        Temperature 0 is greedy by definition. ``top_k == 1`` is greedy too, at any
        temperature: only the most likely token survives the filter.
        """
        return self.temperature == 0.0 or self.top_k == 1

    def _validate(self) -> None:
        """Reject impossible values here, at the edge, with a message that names the field,
        the value and what is allowed; deeper code can then trust every field."""
        _check_real("temperature", self.temperature)
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            _invalid("temperature", self.temperature, "a finite number >= 0 (0 means greedy)")

        _check_int("top_k", self.top_k)
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

        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            _invalid("max_tokens", self.max_tokens, "an integer >= 1")

        # Accept any iterable of ids (a list from JSON, a set) but store a tuple, so the
        # frozen dataclass stays hashable and nobody can mutate it behind our back.
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(
            self.stop_token_ids, Iterable
        ):
            raise TypeError(
                f"stop_token_ids must be a sequence of token ids, got {self.stop_token_ids!r}"
            )
        stop_ids = tuple(self.stop_token_ids)
        for token_id in stop_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, Integral) or token_id < 0:
                _invalid(
                    "stop_token_ids",
                    self.stop_token_ids,
                    f"a sequence of integers >= 0 ({token_id!r} is not)",
                )
        object.__setattr__(self, "stop_token_ids", stop_ids)

        if self.seed is not None:
            _check_int("seed", self.seed)
            if not 0 <= self.seed <= _MAX_SEED:
                _invalid("seed", self.seed, f"None or an integer in [0, {_MAX_SEED}]")


def _check_int(field: str, value: object) -> None:
    # bool is a subclass of int in Python; `top_k=True` is a bug, not a 1.
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{field} must be an integer, got {value!r} ({type(value).__name__})")


def _check_real(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{field} must be a number, got {value!r} ({type(value).__name__})")


def _invalid(field: str, value: object, allowed: str) -> None:
    raise ValueError(f"{field} must be {allowed}, got {value!r}")
