"""The target's side of speculative decoding: one pass that scores every guess (chapter 23).

A decoding request normally feeds one token, its last sample, and gets the logits of the one
after. Give it ``g`` guesses of the tokens that follow and it can feed ``1 + g`` tokens in the
same pass and get ``1 + g`` rows of logits: row ``j`` is the target's distribution after the
last sample and the first ``j`` guesses. Reading the weights once then checks every guess, and
:mod:`minisgl.speculative.accept` decides how many to keep.

The pass is shaped as a decode step: every fed token is an entry of its own, on its request's
page-table row, that decodes after the tokens before it. Each layer stores the K/V of every
entry before any entry attends, so entry ``j`` sees the guesses before it and its own token,
as a causal prefill would; and a decode-shaped batch is one the CUDA graphs captured for
decoding replay (chapter 8), while a prefill-shaped one runs eagerly, a launch per kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from minisgl.core import Batch
from minisgl.engine.sample import compute_probs, make_generator
from minisgl.speculative.accept import PAD, Verdict, accept_greedy, accept_sampled
from minisgl.utils.torch_utils import host_to_device

if TYPE_CHECKING:  # engine.py does not import this module: no cycle at run time
    from minisgl.engine.engine import Engine


@dataclass(frozen=True)
class Guesses:
    """Each request's proposed tokens, on the target's device: row ``i`` of ``tokens`` holds
    ``counts[i]`` of them, and the rest of the row is ignored. A draft model's guesses are made
    on the device and stay there until the verdict is read: the host waits once a round.

    Attributes:
        tokens: ``[B, k]`` int64.
        counts: how many of each row are guesses (``0 .. k``).
    """

    tokens: torch.Tensor
    counts: list[int]

    @classmethod
    def from_lists(cls, guesses: Sequence[Sequence[int]], device: torch.device) -> Guesses:
        """Guesses made on the host (prompt lookup), in one copy to the device."""
        k = max(map(len, guesses), default=0)
        padded = [list(g) + [PAD] * (k - len(g)) for g in guesses]
        tokens = torch.tensor(padded, dtype=torch.int64).view(len(guesses), k)
        return cls(host_to_device(tokens, device), [len(g) for g in guesses])


@dataclass(frozen=True)
class EachTokenDecodes:
    """A batch's fed tokens as a decode-shaped :class:`~minisgl.attention.BatchLayout`.

    Token ``j`` of request ``i`` is an entry on ``i``'s page-table row with
    ``cached_lens[i] + j`` tokens before it and one new token: its K/V goes where the batch's
    would, and it attends over the same keys its row in a prefill would.
    """

    rows: list[int]
    cached_lens: list[int]
    new_lens: list[int]
    size: int
    num_tokens: int
    is_decode: bool = True

    @classmethod
    def of(cls, batch: Batch) -> EachTokenDecodes:
        rows: list[int] = []
        cached: list[int] = []
        for row, start, count in zip(batch.rows, batch.cached_lens, batch.new_lens):
            assert row is not None, "reserve the batch's pages before verifying it"
            rows += [row] * count
            cached += range(start, start + count)
        return cls(rows, cached, [1] * len(rows), len(rows), len(rows))


@torch.no_grad()
def verify(engine: Engine, batch: Batch, guesses: Guesses) -> Verdict:
    """Score each request's last token and its guesses in one pass, and keep what passes.

    Args:
        engine: the target's engine.
        batch: a prefill-phase batch in which request ``i`` feeds ``1 + guesses.counts[i]``
            tokens after its cached past: its last token, which the host has read, then its
            guesses, counted in its length (as tokens in flight) but not yet in the token pool:
            the pass reads them from ``guesses``, where the proposer left them.
        guesses: each request's proposed tokens (any may have none).

    Returns:
        The :class:`~minisgl.speculative.accept.Verdict`, on the device. A greedy request
        keeps a guess while it equals the target's argmax; a sampled one by the rejection
        rule, so its tokens follow exactly the distribution decoding without guesses draws from.
    """
    size, k = batch.size, guesses.tokens.shape[1]
    if [1 + n for n in guesses.counts] != batch.new_lens:
        raise ValueError(f"each request must feed its last token and its guesses: it feeds "
                         f"{batch.new_lens}, the guesses need {[1 + n for n in guesses.counts]}")
    # What the host knows crosses in one copy: each request's last token; where each fed token
    # is in the [B, 1 + k] rows of last token and guesses; the row of logits of each request's
    # position j (past its guesses, a row never read); and the counts.
    last = [(req.output_ids or req.prompt_ids)[-1] for req in batch.reqs]
    fed: list[int] = []
    rows: list[int] = []
    for i, n in enumerate(batch.new_lens):
        fed += range(i * (k + 1), i * (k + 1) + n)
        rows += [len(fed) - n + min(j, n - 1) for j in range(k + 1)]
    device = guesses.tokens.device
    lists = host_to_device(torch.tensor(last + fed + rows + guesses.counts), device)
    last_ids, fed_at, rows_at, num_proposed = lists.split([size, len(fed), len(rows), size])
    input_ids = torch.cat([last_ids[:, None], guesses.tokens], dim=1).view(-1)[fed_at]
    logits = engine.layout_logits(EachTokenDecodes.of(batch), input_ids)
    per_position = logits[rows_at.view(size, k + 1)]  # [B, k + 1, V]
    proposed = guesses.tokens
    reqs = batch.reqs
    if all(req.params.is_greedy for req in reqs):  # no softmax needed: argmax decides
        return accept_greedy(proposed, per_position.argmax(dim=-1), num_proposed)
    for req in reqs:  # a seeded request's own stream starts at its first sample
        if req.params.seed is not None and req.generator is None:
            req.generator = make_generator(req.params.seed, device)
    params = [req.params for req in reqs for _ in range(k + 1)]
    probs = compute_probs(per_position.flatten(0, 1), params).view(size, k + 1, -1)
    return accept_sampled(proposed, None, probs, num_proposed, [req.generator for req in reqs])
