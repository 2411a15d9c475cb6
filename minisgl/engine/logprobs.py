"""The log-probability of each sampled token, and of the most likely tokens in its place; and,
for a request that asks, of each of its prompt's tokens.

They are *raw*: the log-softmax of the model's float32 logits, before ``logit_bias``, the
penalties, temperature and the filters change them (vLLM's default, and what a client
comparing against ``transformers`` expects). Each kind leaves the device as one tensor per
step: a row per token, its logprob, then the ``k`` best logprobs and their token ids (exact as
float32 up to 2**24, far above any vocabulary). A prompt's logprobs need the logits of every
prompt position, not only the last: the engine scores those rows too. Chapter 21 tells the
story.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.core import Batch, TokenLogprobs
from minisgl.utils.torch_utils import host_to_device


@dataclass(frozen=True)
class PromptRows:
    """The prompt tokens a prefill batch scores for their logprobs: row ``rows[j]`` of the
    packed input predicts ``targets[j]``, token ``positions[j]`` of request ``owners[j]``
    (its index in the batch)."""

    rows: list[int]
    targets: list[int]
    owners: list[int]
    positions: list[int]

    @classmethod
    def of(cls, batch: Batch) -> PromptRows | None:
        """The rows ``batch``'s requests ask for; None when none asks."""
        rows, targets, owners, positions = [], [], [], []
        offset = 0
        for i, (req, cached, n) in enumerate(zip(batch.reqs, batch.cached_lens, batch.new_lens)):
            if batch.is_prefill and req.params.prompt_logprobs is not None:
                # The logits at position p predict token p + 1, while that is a prompt token.
                for p in range(cached, min(cached + n, len(req.prompt_ids) - 1)):
                    rows.append(offset + p - cached)
                    targets.append(req.prompt_ids[p + 1])
                    owners.append(i)
                    positions.append(p + 1)
            offset += n
        return cls(rows, targets, owners, positions) if rows else None


@dataclass(frozen=True)
class StepLogprobs:
    """What a step's requests asked for, on the device: :func:`batch_logprobs`' tensors."""

    sampled: torch.Tensor | None  # a row per request that asks, in batch order
    sampled_rows: list[int]  # the batch index of each row of ``sampled``
    prompt: torch.Tensor | None  # a row per entry of ``prompt_rows``
    prompt_rows: PromptRows | None

    def to_host(self) -> StepLogprobs:
        """The same, on their way to the host without the host waiting (into pinned memory).
        Read them once a copy queued after these has arrived, such as the step's tokens'."""
        sampled, prompt = (None if t is None else t.to("cpu", non_blocking=True)
                           for t in (self.sampled, self.prompt))
        return StepLogprobs(sampled, self.sampled_rows, prompt, self.prompt_rows)


def batch_logprobs(logits: torch.Tensor, tokens: torch.Tensor, batch: Batch,
                   prompt: PromptRows | None = None,
                   prompt_logits: torch.Tensor | None = None) -> StepLogprobs | None:
    """The logprobs ``batch``'s requests ask for (None when none asks): of each sampled token
    (``logits``, ``[B, V]``), and of the prompt tokens ``prompt`` names (``prompt_logits``,
    a row each)."""
    rows = [i for i, req in enumerate(batch.reqs) if req.params.logprobs is not None]
    if not rows and prompt is None:
        return None
    sampled = None
    if rows:
        index = host_to_device(torch.tensor(rows), logits.device)
        k = max(batch.reqs[i].params.logprobs for i in rows)
        sampled = _packed(logits[index], tokens[index], k)
    packed_prompt = None
    if prompt is not None:
        assert prompt_logits is not None and prompt_logits.shape[0] == len(prompt.rows)
        targets = host_to_device(torch.tensor(prompt.targets), prompt_logits.device)
        k = max(batch.reqs[i].params.prompt_logprobs for i in set(prompt.owners))
        packed_prompt = _packed(prompt_logits, targets, k)
    return StepLogprobs(sampled, rows, packed_prompt, prompt)


def _packed(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> torch.Tensor:
    """``[R, 1 + 2k]``: each row's logprob of ``chosen``, then its ``k`` best and their ids."""
    raw = torch.log_softmax(logits.float(), dim=-1)
    picked = raw.gather(1, chosen[:, None])
    if k == 0:
        return picked
    top = raw.topk(k, dim=-1)
    return torch.cat([picked, top.values, top.indices.float()], dim=1)


def _unpacked(row: list[float], asked: int) -> TokenLogprobs:
    k = (len(row) - 1) // 2
    return TokenLogprobs(row[0], tuple((int(t), v) for v, t in zip(row[1:1 + k], row[1 + k:]))
                         [:asked])


def unpack_logprobs(step: StepLogprobs | None, batch: Batch
                    ) -> tuple[dict[int, TokenLogprobs], dict[int, list[TokenLogprobs]]]:
    """On the host: each sampled token's logprobs by its request's index in ``batch``, and
    each request's prompt logprobs of this step (in position order), by the same index."""
    if step is None:
        return {}, {}
    sampled: dict[int, TokenLogprobs] = {}
    if step.sampled is not None:
        for i, row in zip(step.sampled_rows, step.sampled.tolist(), strict=True):
            sampled[i] = _unpacked(row, batch.reqs[i].params.logprobs)
    prompt: dict[int, list[TokenLogprobs]] = {}
    if step.prompt is not None and step.prompt_rows is not None:
        for i, row in zip(step.prompt_rows.owners, step.prompt.tolist(), strict=True):
            asked = batch.reqs[i].params.prompt_logprobs
            prompt.setdefault(i, []).append(_unpacked(row, asked))
    return sampled, prompt
