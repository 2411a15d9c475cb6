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
        sub.index_put_((_ids(r, sub), _ids(t, sub)), _floats(b, sub), accumulate=True)
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

    Output counts come from the token pool, where a request's output tokens sit at positions
    ``len(prompt) .. num_tokens - 1`` of its row: they are gathered as one ``[R, longest]``
    block on the device, the unused tail of a shorter row weighing nothing, so the host sends
    three numbers a request rather than every position. Repetition also looks at the prompt
    (as ``transformers`` and vLLM do), whose tokens are sent from the host.
    """
    starts = [len(req.prompt_ids) for req in reqs]
    lengths = [req.num_tokens - start for req, start in zip(reqs, starts)]
    counts = torch.zeros_like(logits)
    if max(lengths) > 0:
        table_row, start, length = _ids([req.table_row for req in reqs] + starts + lengths,
                                        logits).view(3, -1)
        offsets = torch.arange(max(lengths), device=logits.device)[None, :]
        used = offsets < length[:, None]  # [R, longest]: which places hold an output token
        tokens = token_pool.ids[table_row[:, None], start[:, None] + offsets * used]
        counts.scatter_add_(1, tokens, used.to(counts.dtype))
    params = [req.params for req in reqs]
    repetition, frequency, presence = _floats(
        [[p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
         [p.presence_penalty for p in params]], logits)[:, :, None]
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = counts > 0
        prompt_row = [r for r, req in enumerate(reqs) for _ in req.prompt_ids]
        prompt_ids = [t for req in reqs for t in req.prompt_ids]
        seen.index_put_((_ids(prompt_row, logits), _ids(prompt_ids, logits)),
                        seen.new_ones(len(prompt_ids)))
        scaled = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, scaled, logits)
    return logits - frequency * counts - presence * (counts > 0)


def _ids(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return host_to_device(torch.tensor(values, dtype=torch.int64), like.device)


def _floats(values: list, like: torch.Tensor) -> torch.Tensor:
    return host_to_device(torch.tensor(values, dtype=torch.float32), like.device)
