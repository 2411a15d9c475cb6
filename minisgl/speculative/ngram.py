"""Prompt lookup: propose the tokens that followed the last time the text ended like this.

Summaries, code edits and answers that quote their context repeat long runs of the prompt. If
the request's last ``n`` tokens occurred earlier in its history, the tokens that followed them
then are a good guess for what follows now, and the guess costs no model at all.

The search is stateless: one vectorised compare of the history against its last token, then a
check of the few candidates found. Nothing is kept between steps, so there is nothing to bring up
to date when tokens are rolled back or a request is preempted, and for a history of 32k tokens
the compare reads 256 KB, a few tens of microseconds, far below a decode step. The cost that
remains is turning a Python list into an array; a caller that proposes every step keeps its
history in a :class:`TokenHistory`, which grows in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def propose_ngram(history: Sequence[int] | np.ndarray | torch.Tensor | TokenHistory, k: int,
                  max_ngram: int = 4, min_ngram: int = 1) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the history's tail.

    The tail tried is the last ``n`` tokens, for ``n`` from ``max_ngram`` down to
    ``min_ngram``: a longer match is better evidence, so it wins over a more recent shorter one;
    among matches of the same length the most recent wins (the text nearby is the best guide).

    Args:
        history: the request's tokens so far (prompt, then output): a list, a 1-D array or
            tensor, or a :class:`TokenHistory`.
        k: the most tokens to propose.
        max_ngram: the longest tail tried.
        min_ngram: the shortest tail accepted as a match (>= 1).

    Returns:
        The proposed tokens, between 1 and ``k`` of them, or ``[]`` when no tail of at least
        ``min_ngram`` tokens occurred before.
    """
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    tokens = _as_array(history)
    size = len(tokens)
    if k == 0 or size < min_ngram + 1:  # a match needs an earlier occurrence and a token after it
        return []
    # Candidates: every earlier position that holds the last token and has a token after it.
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    if len(ends) == 0:
        return []
    # For each candidate, how many tokens (up to max_ngram) agree going backwards.
    length = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, min(max_ngram, size - 1)):
        inside = ends - back >= 0
        alive &= inside
        alive[inside] &= tokens[ends[inside] - back] == tokens[size - 1 - back]
        length += alive
    best = length.max()
    if best < min_ngram:
        return []
    end = ends[np.flatnonzero(length == best)[-1]]  # the most recent of the longest
    return tokens[end + 1 : end + 1 + k].tolist()


class TokenHistory:
    """A request's tokens in a numpy array that grows in place (amortised doubling).

    For proposing every step without converting the whole history from a list each time.
    ``truncate`` drops tokens, for when rejected tokens are rolled back.
    """

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self._buffer = np.empty(max(16, 2 * len(tokens)), dtype=np.int64)
        self._size = 0
        self.extend(tokens)

    def __len__(self) -> int:
        return self._size

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens``."""
        end = self._size + len(tokens)
        if end > len(self._buffer):
            grown = np.empty(max(end, 2 * len(self._buffer)), dtype=np.int64)
            grown[: self._size] = self._buffer[: self._size]
            self._buffer = grown
        self._buffer[self._size : end] = tokens
        self._size = end

    def truncate(self, size: int) -> None:
        """Keep only the first ``size`` tokens."""
        if not 0 <= size <= self._size:
            raise ValueError(f"cannot truncate {self._size} tokens to {size}")
        self._size = size

    @property
    def tokens(self) -> np.ndarray:
        """The tokens, a view (valid until the next ``extend``)."""
        return self._buffer[: self._size]


def _as_array(history: Sequence[int] | np.ndarray | torch.Tensor | TokenHistory) -> np.ndarray:
    if isinstance(history, TokenHistory):
        return history.tokens
    if isinstance(history, torch.Tensor):
        history = history.cpu().numpy()
    tokens = np.asarray(history, dtype=np.int64)
    if tokens.ndim != 1:
        raise ValueError(f"the history must be 1-D, got shape {tokens.shape}")
    return tokens
