"""The logit adjustments of OpenAI's and vLLM's sampling APIs, per request, for a whole batch.

``logit_bias`` adds a constant to chosen tokens; ``min_tokens`` masks the stop tokens until a
request has generated enough; the repetition, frequency and presence penalties push down the
tokens a request has already used. They run on the float32 logits of the rows that ask for any,
in vLLM's order, before temperature and the filters of :mod:`~minisgl.engine.sample`. The
tokens a request has used are read from the token pool on the device, where the token still in
flight under overlap is already written; the prompt's come from the host, because a prefix
taken from the radix cache was never written to the request's row. Chapter 21 tells the story.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minisgl.core import Batch
from minisgl.engine.token_pool import TokenPool
from minisgl.utils.torch_utils import host_to_device


def adjust_logits(logits: torch.Tensor, batch: Batch, token_pool: TokenPool,
                  eos_token_ids: Sequence[int]) -> torch.Tensor:
    """``batch``'s ``[B, V]`` logits with each request's adjustments applied (a new tensor;
    rows that ask for none are copied unchanged). Call it before the lengths move on."""
    rows = [i for i, req in enumerate(batch.reqs) if req.params.adjusts_logits]
    adjusted = logits.float().clone()  # not in place: a graph's logits are its fixed memory
    if not rows:
        return adjusted
    reqs = [batch.reqs[i] for i in rows]
    vocab_size = logits.shape[-1]
    row_ids = _ids(rows, adjusted)  # a list as an index would be copied from pageable memory
    sub = adjusted[row_ids]
    # logit_bias, and min_tokens' ban on stop tokens: (row, token) pairs from the host
    bias = [(r, t, b) for r, req in enumerate(reqs) for t, b in req.params.logit_bias
            if t < vocab_size]
    if bias:
        r, t, b = (list(column) for column in zip(*bias))
        sub.index_put_((_ids(r, sub), _ids(t, sub)), _column(b, sub)[:, 0], accumulate=True)
    banned = [(r, t) for r, req in enumerate(reqs)
              if req.num_tokens - len(req.prompt_ids) < req.params.min_tokens
              for t in {*req.params.stop_token_ids, *eos_token_ids} if t < vocab_size]
    if banned:
        r, t = (list(column) for column in zip(*banned))
        # values made on the device: a Python scalar would be copied from the host, a sync
        sub.index_put_((_ids(r, sub), _ids(t, sub)), sub.new_full((len(r),), float("-inf")))
    if any(req.params.repetition_penalty != 1.0 or req.params.frequency_penalty
           or req.params.presence_penalty for req in reqs):
        sub = _penalize(sub, reqs, token_pool)
    adjusted[row_ids] = sub
    return adjusted


def _penalize(logits: torch.Tensor, reqs: Sequence, token_pool: TokenPool) -> torch.Tensor:
    """The penalties over ``logits`` (``[R, V]``, one row per request of ``reqs``).

    Output counts come from the token pool: positions ``len(prompt) .. num_tokens - 1`` of the
    request's row. Repetition also looks at the prompt (as ``transformers`` and vLLM do), whose
    tokens are sent from the host.
    """
    out_pos: list[int] = []  # flat pool indices of every output token so far
    out_row: list[int] = []
    for r, req in enumerate(reqs):
        base, start = req.table_row * token_pool.row_len, len(req.prompt_ids)
        out_pos += range(base + start, base + req.num_tokens)
        out_row += [r] * (req.num_tokens - start)
    counts = torch.zeros_like(logits)
    if out_pos:
        tokens = token_pool.ids.view(-1)[_ids(out_pos, logits)]
        ones = torch.ones(len(out_pos), dtype=counts.dtype, device=counts.device)
        counts.index_put_((_ids(out_row, logits), tokens), ones, accumulate=True)
    params = [req.params for req in reqs]
    repetition = [p.repetition_penalty for p in params]
    if any(value != 1.0 for value in repetition):
        seen = counts > 0
        prompt_row = [r for r, req in enumerate(reqs) for _ in req.prompt_ids]
        prompt_ids = [t for req in reqs for t in req.prompt_ids]
        seen.index_put_((_ids(prompt_row, logits), _ids(prompt_ids, logits)),
                        seen.new_ones(len(prompt_ids)))
        factor = _column(repetition, logits)
        scaled = torch.where(logits > 0, logits / factor, logits * factor)
        logits = torch.where(seen, scaled, logits)
    frequency = _column([p.frequency_penalty for p in params], logits)
    presence = _column([p.presence_penalty for p in params], logits)
    return logits - frequency * counts - presence * (counts > 0)


def _ids(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return host_to_device(torch.tensor(values, dtype=torch.int64), like.device)


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return host_to_device(torch.tensor(values, dtype=torch.float32), like.device)[:, None]
