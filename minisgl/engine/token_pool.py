"""The token pool: every running request's token ids, kept on the engine's device.

One ``[max_running_reqs, max_seq_len + 1]`` integer tensor, indexed like the page table by a
request's row and a token's position. Prompt tokens are written from the host as the passes that
feed them are prepared; each sample is written on the device right after sampling; a pass's
input ids are gathered from it at positions the host computes from lengths alone. So a step can
be launched before the host has read the token the step before sampled, which is what overlap
scheduling needs. Chapter 12 tells the story.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minisgl.core import Batch, Req
from minisgl.utils.torch_utils import host_to_device


class TokenPool:
    """The token ids of every request holding a page-table row, on the device.

    Args:
        num_rows: rows of the page table (``max_running_reqs``).
        max_seq_len: the longest sequence one request may reach. A row has one column more:
            a request at that length still samples a last token, which is written but never
            fed.
        device: the engine's device.
    """

    def __init__(self, num_rows: int, max_seq_len: int, device: torch.device) -> None:
        self.row_len = max_seq_len + 1
        # int64, as the sampler writes and the embedding reads: no conversion on either side.
        self.ids = torch.zeros(num_rows, self.row_len, dtype=torch.int64, device=device)
        self._flat = self.ids.view(-1)  # (row, position) is flat index row * row_len + position

    def input_ids(self, batch: Batch) -> torch.Tensor:
        """The ``[T]`` ids ``batch`` feeds, packed request after request, gathered on the device.

        The prompt tokens among them are written into the pool first, from the host's lists;
        every other one is a token some earlier pass sampled and wrote here. All three index
        lists travel in one copy to the device that the host does not wait for.
        """
        dst: list[int] = []     # where the prompt tokens fed now go
        prompt: list[int] = []  # their values
        src: list[int] = []     # where every fed token is read from
        for req, n in zip(batch.reqs, batch.new_lens):
            row = req.table_row * self.row_len  # the engine checked that every request has one
            start, end = req.cached_len, req.cached_len + n
            src += range(row + start, row + end)
            prompt_end = min(end, len(req.prompt_ids))
            if start < prompt_end:
                dst += range(row + start, row + prompt_end)
                prompt += req.prompt_ids[start:prompt_end]
        k = len(dst)
        lists = host_to_device(torch.tensor(dst + prompt + src, dtype=torch.int64), self.ids.device)
        if k:
            self._flat[lists[:k]] = lists[k:2 * k]
        return self._flat[lists[2 * k:]]

    def store_samples(self, batch: Batch, tokens: torch.Tensor) -> None:
        """Write ``tokens`` (``[B]``, on the device) after each request's fed tokens.

        Call it before the requests' lengths move on. A request that feeds only part of what it
        has left (a prompt cut by chunked prefill) sampled nothing meaningful: its token is
        skipped.
        """
        picks = [i for i, complete in enumerate(batch.completes) if complete]
        if not picks:
            return
        dst = [batch.reqs[i].table_row * self.row_len + batch.reqs[i].num_tokens for i in picks]
        lists = host_to_device(torch.tensor(dst + picks, dtype=torch.int64), self.ids.device)
        # On the pool's device already, unless a caller sampled from logits it moved to the host.
        tokens = tokens.to(self.ids.device, non_blocking=True)
        self._flat[lists[:len(dst)]] = tokens[lists[len(dst):]]

    def store_rows(self, reqs: Sequence[Req], starts: Sequence[int], counts: Sequence[int],
                   tokens: torch.Tensor) -> None:
        """Write the first ``counts[i]`` of row ``i`` of ``tokens`` (``[B, n]``, on the device)
        at positions ``starts[i]`` on of ``reqs[i]``'s row, in one copy of indices to the device
        (chapter 23: the tokens of a verdict, written before the host has read them).

        Any of them past what a request goes on to keep are never fed: a request's positions
        past its length are written again before a pass reads them.
        """
        dst: list[int] = []  # where each token goes
        src: list[int] = []  # where it is in ``tokens``, flattened
        width = tokens.shape[1]
        for i, (req, start, count) in enumerate(zip(reqs, starts, counts, strict=True)):
            row = req.table_row * self.row_len
            dst += range(row + start, row + start + count)
            src += range(i * width, i * width + count)
        if dst:
            lists = host_to_device(torch.tensor(dst + src, dtype=torch.int64), self.ids.device)
            self._flat[lists[:len(dst)]] = tokens.reshape(-1)[lists[len(dst):]]
