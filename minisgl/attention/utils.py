"""Small helpers that describe a ragged batch as flat arrays.

A batch of requests of different lengths is stored *packed*: the tokens of request 0, then
those of request 1, and so on, with no padding between them. What tells the requests apart is
an *indptr* ("index pointer") array of ``B + 1`` offsets: request ``i`` owns the entries
``indptr[i] .. indptr[i + 1] - 1``. Every attention kernel that takes ragged batches speaks
this language, FlashInfer's included, so the backends build their per-batch metadata out of
these few functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minisgl.kvcache.page_table import PageTable, expand_ranges
from minisgl.utils.torch_utils import host_to_device


def indptr_of(lengths: Sequence[int]) -> list[int]:
    """Offsets of a packed ragged array: ``[0, l0, l0 + l1, ...]`` (``len(lengths) + 1`` items).

    >>> indptr_of([3, 1, 4])
    [0, 3, 4, 8]
    """
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    return offsets


def indptr_tensor(lengths: Sequence[int]) -> torch.Tensor:
    """:func:`indptr_of` as an int32 tensor on the host, the form FlashInfer's ``plan`` reads."""
    return torch.tensor(indptr_of(lengths), dtype=torch.int32)


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages that ``num_tokens`` tokens occupy (the last one may be partly filled)."""
    return -(-num_tokens // page_size)  # ceiling division


def last_page_len(num_tokens: int, page_size: int) -> int:
    """Tokens in the last of those pages: between 1 and ``page_size`` for a non-empty sequence."""
    return num_tokens - (pages_for(num_tokens, page_size) - 1) * page_size


def gather_page_ids(page_table: PageTable, rows: Sequence[int],
                    num_pages: Sequence[int]) -> torch.Tensor:
    """The first ``num_pages[i]`` page ids of row ``rows[i]``, requests concatenated.

    This is the ``indices`` array of a paged-attention kernel: with the page indptr built from
    ``num_pages`` it says, for each request, which pages of the pool hold its tokens, in order.
    Row ``r``'s entries start at ``r * width`` of the flattened table, so request ``i`` wants
    the ``num_pages[i]`` entries from ``rows[i] * width`` on: two numbers per request cross to
    the device, the index of every entry is expanded there (:func:`expand_ranges`), and one
    lookup reads them all, however many requests and pages.
    """
    if not rows:
        return torch.empty(0, dtype=torch.int32, device=page_table.device)
    width = page_table.max_pages_per_req
    spans = torch.tensor([[row * width for row in rows], list(num_pages)], dtype=torch.int64)
    spans = host_to_device(spans, page_table.device)
    entries, _ = expand_ranges(spans[0], spans[1], total=sum(num_pages))
    return page_table.page_ids.view(-1)[entries]


def padded_index(lengths: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn a packed ragged array into a padded ``[B, max_len]`` view of it.

    Returns ``(index, valid)``: ``index[i, j]`` is the packed position of element ``j`` of
    request ``i``, and ``valid[i, j]`` says whether that element exists (``j < lengths[i]``).
    Padding entries repeat the request's first element, so ``index`` is always a legal index
    and the padding only needs to be masked, never special-cased.
    """
    starts = torch.tensor(indptr_of(lengths)[:-1], dtype=torch.int64)
    lens = torch.tensor(list(lengths), dtype=torch.int64)
    columns = torch.arange(int(lens.max()), dtype=torch.int64)
    valid = columns[None, :] < lens[:, None]
    index = starts[:, None] + torch.where(valid, columns[None, :], 0)
    return index, valid
