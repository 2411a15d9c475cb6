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

import numpy as np
import torch


def indptr_of(lengths: Sequence[int]) -> list[int]:
    """Offsets of a packed ragged array: ``[0, l0, l0 + l1, ...]`` (``len(lengths) + 1`` items).

    >>> indptr_of([3, 1, 4])
    [0, 3, 4, 8]
    """
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    return offsets


def indptr_tensor(lengths: Sequence[int] | np.ndarray) -> torch.Tensor:
    """:func:`indptr_of` as an int32 tensor on the host, the form FlashInfer's ``plan`` reads
    (one numpy running sum, however long the batch)."""
    indptr = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=indptr[1:])
    return torch.from_numpy(indptr)
