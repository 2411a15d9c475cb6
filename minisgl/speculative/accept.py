"""Verifying proposed tokens: how many to keep, and the one token the target adds.

A proposer (a draft model, or prompt lookup) guesses up to ``k`` tokens per request; the target
model scores all of them in one pass over ``k + 1`` positions. Position ``j`` of that pass is the
target's distribution for the token after the first ``j`` guesses. Verification keeps the
longest acceptable prefix of the guesses and then emits one token of the target's own: the
correction at the first rejected guess, or a *bonus* after the last guess when all were kept.
So every request gains between 1 and ``k + 1`` tokens per target pass, never 0.

Both rules work on the whole batch at once; the only loops are over positions hidden inside
tensor operations and, for requests with their own generator, over those rows' random draws.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

PAD = -1  # what fills a row of ``Verdict.tokens`` after its emitted tokens


@dataclass
class Verdict:
    """The outcome of verifying a batch of proposals.

    Attributes:
        accepted: ``[B]`` int64, how many of each row's proposed tokens were kept.
        tokens: ``[B, k + 1]`` int64, each row's emitted tokens, ``accepted + 1`` of them (the
            kept proposals, then the target's correction or bonus token), padded with ``PAD``.
    """

    accepted: torch.Tensor
    tokens: torch.Tensor

    @property
    def emitted(self) -> torch.Tensor:
        """``[B]`` int64, how many tokens each row emits: ``accepted + 1``."""
        return self.accepted + 1

    def packed(self) -> torch.Tensor:
        """``[B, k + 2]``: each row's count of kept tokens, then its tokens; what the host
        reads, in one copy (:func:`unpack`)."""
        return torch.cat([self.accepted[:, None], self.tokens], dim=1)

    def to_lists(self) -> list[list[int]]:
        """Each row's emitted tokens as a list (one copy to the host: the host waits once)."""
        return unpack(self.packed().tolist())


def unpack(rows: list[list[int]]) -> list[list[int]]:
    """Each row's emitted tokens, from the rows of :meth:`Verdict.packed`."""
    return [row[1: row[0] + 2] for row in rows]


def accept_greedy(draft_tokens: torch.Tensor, target_tokens: torch.Tensor,
                  num_proposed: torch.Tensor | None = None) -> Verdict:
    """The greedy rule: keep guesses while each equals the target's argmax.

    The emitted tokens are then exactly the target's argmax at positions ``0 .. accepted``
    (the kept guesses equal them by construction), so the output is token for token what
    decoding without speculation produces.

    Args:
        draft_tokens: ``[B, k]`` int64 proposed tokens (anything past a row's count is ignored).
        target_tokens: ``[B, k + 1]`` int64, the target's argmax at each verified position
            (``target_logits.argmax(-1)``: no softmax needed).
        num_proposed: ``[B]`` int64, how many tokens each row proposed (``0 .. k``); None: ``k``.

    Returns:
        The :class:`Verdict`.
    """
    k = _check_shapes(draft_tokens, target_tokens.shape[:2])
    ok = (draft_tokens == target_tokens[:, :k]) & _proposed_mask(draft_tokens, num_proposed)
    accepted = _prefix_length(ok)
    positions = torch.arange(k + 1, device=draft_tokens.device)
    tokens = target_tokens.masked_fill(positions[None, :] > accepted[:, None], PAD)
    return Verdict(accepted, tokens)


def accept_sampled(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                   target_probs: torch.Tensor, num_proposed: torch.Tensor | None = None,
                   generator: torch.Generator | Sequence[torch.Generator | None] | None = None
                   ) -> Verdict:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): exact for any proposer.

    At each position a guess ``x`` drawn from the draft's ``q`` is kept with probability
    ``min(1, p(x) / q(x))``; at the first rejection a token is drawn from the residual
    ``norm(max(0, p - q))``; when every guess is kept, a bonus token is drawn from ``p`` at the
    next position. Why this is exactly ``p``: token ``y`` comes out either as an accepted guess,
    with probability ``q(y) * min(1, p(y)/q(y)) = min(p(y), q(y))``, or after a rejection (which
    happens with probability ``1 - sum min(p, q) = sum max(0, p - q)``) from the residual, with
    probability ``max(0, p(y) - q(y))``. The two add up to ``p(y)``. A deterministic proposer
    (prompt lookup) is a one-hot ``q``: keep ``x`` with probability ``p(x)``, else draw from
    ``p`` with ``x`` removed, renormalised. A greedy row (one-hot ``p``) comes out greedy.

    Args:
        draft_tokens: ``[B, k]`` int64 proposed tokens (anything past a row's count is ignored).
        draft_probs: ``[B, k, V]`` the draft's distribution each guess was drawn from, or None
            for a deterministic proposer (one-hot at each guess).
        target_probs: ``[B, k + 1, V]`` the distributions the target samples from at each
            position, after temperature, top-k/top-p and the rest.
        num_proposed: ``[B]`` int64, how many tokens each row proposed (``0 .. k``); None: ``k``.
        generator: one generator for the whole batch, or one entry per row (that request's own
            generator, or None for the global stream), or None.

    Returns:
        The :class:`Verdict`.
    """
    k = _check_shapes(draft_tokens, target_probs.shape[:2])
    if draft_probs is not None and draft_probs.shape[:2] != draft_tokens.shape:
        raise ValueError(f"draft_probs {tuple(draft_probs.shape)} do not match the draft tokens "
                         f"{tuple(draft_tokens.shape)}")
    batch, vocab = draft_tokens.shape[0], target_probs.shape[-1]
    uniforms, noise = _random_draws(batch, k, vocab, target_probs, generator)

    # Keep a guess when u < p(x) / q(x), written u * q(x) < p(x): no division, and a guess the
    # target gives probability 0 is never kept (not even when u = 0). Positions past a row's
    # proposals may hold padding (say -1): read token 0 there instead, and never keep it.
    proposed = _proposed_mask(draft_tokens, num_proposed)
    draft_tokens = draft_tokens.masked_fill(~proposed, 0)
    index = draft_tokens.unsqueeze(-1)
    p_x = target_probs[:, :k].gather(-1, index).squeeze(-1).float()
    q_x = (torch.ones_like(p_x) if draft_probs is None
           else draft_probs.gather(-1, index).squeeze(-1).float())
    accepted = _prefix_length((uniforms * q_x < p_x) & proposed)

    # The last token comes from position j = accepted: the residual if the guess there was
    # rejected, the target's own distribution if there was no guess left (the bonus).
    rows = torch.arange(batch, device=draft_tokens.device)
    p_j = target_probs[rows, accepted].float()
    weights = p_j
    if k > 0:
        guess = accepted.clamp(max=k - 1)
        q_j = (torch.zeros_like(p_j).scatter_(-1, draft_tokens[rows, guess, None], 1.0)
               if draft_probs is None else draft_probs[rows, guess].float())
        rejected = proposed[rows, guess] & (accepted < k)
        residual = (p_j - q_j).clamp(min=0.0)
        # A residual with no mass means p == q up to rounding, where a rejection has probability
        # 0; if rounding made one happen anyway, p itself is the right distribution.
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_j)
        weights = torch.where(rejected[:, None], residual, p_j)
    last = (weights / noise).argmax(dim=-1)  # an exponential race: draws from weights / sum

    positions = torch.arange(k + 1, device=draft_tokens.device)
    tokens = torch.cat([draft_tokens, last[:, None]], dim=1) if k else last[:, None]
    tokens = tokens.scatter(1, accepted[:, None], last[:, None])
    tokens = tokens.masked_fill(positions[None, :] > accepted[:, None], PAD)
    return Verdict(accepted, tokens)


def _check_shapes(draft_tokens: torch.Tensor, target_shape: torch.Size) -> int:
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [batch, k], got {tuple(draft_tokens.shape)}")
    batch, k = draft_tokens.shape
    if tuple(target_shape) != (batch, k + 1):
        raise ValueError(f"the target must cover k + 1 = {k + 1} positions of {batch} rows, got "
                         f"{tuple(target_shape)}")
    return k


def _proposed_mask(draft_tokens: torch.Tensor, num_proposed: torch.Tensor | None) -> torch.Tensor:
    """``[B, k]`` bool: which positions hold a real proposal."""
    batch, k = draft_tokens.shape
    if num_proposed is None:
        return torch.ones(batch, k, dtype=torch.bool, device=draft_tokens.device)
    if num_proposed.shape != (batch,):
        raise ValueError(f"num_proposed must be [{batch}], got {tuple(num_proposed.shape)}")
    positions = torch.arange(k, device=draft_tokens.device)
    return positions[None, :] < num_proposed.to(draft_tokens.device)[:, None]


def _prefix_length(ok: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64: how many leading entries of each row of ``ok`` are True."""
    return ok.long().cumprod(dim=1).sum(dim=1)


def _random_draws(batch: int, k: int, vocab: int, like: torch.Tensor,
                  generator: torch.Generator | Sequence[torch.Generator | None] | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: ``k`` uniforms in [0, 1) for the accept tests, and ``vocab`` exponentials for
    drawing the last token. A row with its own generator draws only from it, so its tokens do
    not depend on the rest of the batch."""
    device = like.device
    single = generator if isinstance(generator, torch.Generator) or generator is None else None
    uniforms = torch.rand(batch, k, device=device, generator=single)
    noise = torch.empty(batch, vocab, device=device).exponential_(generator=single)
    if single is None and generator is not None:
        if len(generator) != batch:
            raise ValueError(f"got {len(generator)} generators for {batch} rows")
        for row, own in enumerate(generator):
            if own is not None:
                uniforms[row] = torch.rand(k, device=device, generator=own)
                noise[row].exponential_(generator=own)
    # An exponential draw can be exactly 0: keep a zero weight at exactly 0, never 0/0.
    return uniforms, noise.clamp_(min=torch.finfo(noise.dtype).tiny)
