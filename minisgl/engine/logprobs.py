"""The log-probability of each sampled token, and of the most likely tokens in its place.

They are *raw*: the log-softmax of the model's float32 logits, before ``logit_bias``, the
penalties, temperature and the filters change them (vLLM's default, and what a client
comparing against ``transformers`` expects). One tensor per step leaves the device: for each
request that asks, the sampled token's logprob, then its ``k`` best logprobs and their token
ids (exact as float32 up to 2**24, far above any vocabulary). Chapter 21 tells the story.
"""

from __future__ import annotations

import torch

from minisgl.core import Batch, TokenLogprobs


def batch_logprobs(logits: torch.Tensor, tokens: torch.Tensor, batch: Batch
                   ) -> torch.Tensor | None:
    """``[R, 1 + 2k]`` on the device, one row per request of ``batch`` whose ``logprobs`` is
    set, in batch order; None when no request asks. ``k`` is the largest ``logprobs`` asked."""
    rows = [i for i, req in enumerate(batch.reqs) if req.params.logprobs is not None]
    if not rows:
        return None
    index = torch.tensor(rows, device=logits.device)
    raw = torch.log_softmax(logits[index].float(), dim=-1)
    chosen = raw.gather(1, tokens[index][:, None])
    k = max(batch.reqs[i].params.logprobs for i in rows)
    if k == 0:
        return chosen
    top = raw.topk(k, dim=-1)
    return torch.cat([chosen, top.values, top.indices.float()], dim=1)


def unpack_logprobs(packed: torch.Tensor | None, batch: Batch) -> dict[int, TokenLogprobs]:
    """:func:`batch_logprobs`' rows, on the host, by the index of their request in ``batch``;
    each request keeps as many of the best as it asked for."""
    if packed is None:
        return {}
    values = packed.tolist()
    k = (packed.shape[1] - 1) // 2
    rows = [i for i, req in enumerate(batch.reqs) if req.params.logprobs is not None]
    out = {}
    for i, row in zip(rows, values, strict=True):
        asked = batch.reqs[i].params.logprobs
        top = tuple((int(t), v) for v, t in zip(row[1:1 + k], row[1 + k:]))[:asked]
        out[i] = TokenLogprobs(row[0], top)
    return out
