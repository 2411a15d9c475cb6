"""Decode attention in pieces of equal length, so that no long context holds up a step.

A decode kernel runs thread blocks of one request and one KV head: with mixed lengths the step
lasts as long as the longest request, and FlashInfer's plan splits long contexts only as far as
one wave of blocks allows, which leaves a large batch almost unsplit. So each request's pages
are cut into *pieces* of at most one common length (flash-decoding's split, made before the
kernel), each piece a request of its own that reads its query from a row of its own (the
layers' ``QueryRows``, filled by the qk prologue). Softmax over a request's keys is then one
exact merge of its pieces' outputs, weighted by ``2 ** (lse - max lse)`` (FlashInfer writes
base-2 log-sum-exps). Turned on (``use_fused``'s step ``pieces``; off by default, as it did not
pay when measured in chapter 20), it replaces the plain one-entry-per-request decode of
:class:`~minisgl.attention.fi.FlashInferBackend` (the tests hold the merge in PyTorch).
:func:`num_decode_pieces` decides, :func:`cut_into_pieces` describes the pieces (numpy,
on the host, once per step), :func:`merge_pieces` merges on the device, once per layer.
"""

from __future__ import annotations

import numpy as np
import torch

from minisgl.kernel.trials import enabled
from minisgl.kernel.triton_compat import tl, triton

Pieces = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # what cut_into_pieces returns

# From this many requests a decode batch is cut into pieces: below it FlashInfer's own split of
# long contexts keeps every block busy. See num_decode_pieces.
PIECES_MIN_BATCH = 65
PIECES_PER_REQUEST = 4  # a batch of B requests becomes at most 4 * B pieces


def num_decode_pieces(batch_size: int) -> int:
    """How many pieces a decode batch of ``batch_size`` requests is cut into; 0 for none.

    FlashInfer's decode plan sizes its work to one wave of thread blocks, cutting long contexts
    into as many pieces as the wave holds. A few requests leave room to cut finely; from about
    65 there is little left, and the longest request decides the step. From there the batch is
    cut here, into ``PIECES_PER_REQUEST`` pieces a request on average, merged after the kernel.
    """
    if not enabled("pieces") or batch_size < PIECES_MIN_BATCH:
        return 0
    return PIECES_PER_REQUEST * batch_size


def piece_length(num_pages: np.ndarray, max_pieces: int) -> int:
    """The shortest piece, in pages, that cuts requests of ``num_pages`` pages into at most
    ``max_pieces`` pieces in all.

    Shorter pieces balance the blocks better; ``max_pieces`` bounds the kernel's batch (and, in
    a captured graph, is the batch: pieces left over are spares that cost a block each, so the
    cut uses as many as it can). A binary search over the length, each probe one vectorised
    count: a few microseconds of host time.
    """
    if max_pieces < len(num_pages):
        raise ValueError(f"{len(num_pages)} requests cannot fit in {max_pieces} pieces")
    low, high = 1, int(num_pages.max(initial=1))
    while low < high:
        mid = (low + high) // 2
        if int((-(-num_pages // mid)).sum()) <= max_pieces:
            high = mid
        else:
            low = mid + 1
    return low


def cut_into_pieces(num_pages: np.ndarray, last_page_lens: np.ndarray, page_size: int,
                    max_pieces: int) -> Pieces:
    """Cut each request's pages into runs of at most :func:`piece_length` pages, in order.

    A piece is a slice of its request's pages, so the kernel's page ids stay the requests' own,
    concatenated; only the boundaries between them change.

    Args:
        num_pages: ``[B]`` pages per request, each at least 1.
        last_page_lens: ``[B]`` tokens in each request's last page.
        page_size: tokens per page (every page but a request's last is full).
        max_pieces: the most pieces in all.

    Returns:
        ``(piece_pages, piece_last_lens, owners, piece_indptr)``: pages and last-page length of
        each piece (``[P]``), the request each piece belongs to (``[P]``), and request ``i``'s
        pieces as ``piece_indptr[i] .. piece_indptr[i + 1] - 1`` (``[B + 1]``).

    >>> pages, last, owners, indptr = cut_into_pieces(np.array([5, 2]), np.array([3, 1]), 4, 4)
    >>> pages.tolist(), last.tolist(), owners.tolist(), indptr.tolist()
    ([2, 2, 1, 2], [4, 4, 3, 1], [0, 0, 0, 1], [0, 3, 4])
    """
    piece = piece_length(num_pages, max_pieces)
    counts = -(-num_pages // piece)
    piece_indptr = np.zeros(len(num_pages) + 1, dtype=np.int64)
    np.cumsum(counts, out=piece_indptr[1:])
    owners = np.repeat(np.arange(len(num_pages)), counts)
    nth = np.arange(int(piece_indptr[-1])) - piece_indptr[owners]  # the piece's rank in its request
    piece_pages = np.minimum(piece, num_pages[owners] - nth * piece)
    is_last = nth == counts[owners] - 1
    piece_last_lens = np.where(is_last, last_page_lens[owners], page_size)
    return piece_pages, piece_last_lens, owners, piece_indptr


if triton is not None:
    @triton.jit
    def _merge_pieces_kernel(out_ptr, lse_ptr, piece_indptr_ptr, merged_ptr,
                             NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
        req = tl.program_id(0)
        head = tl.program_id(1)
        first = tl.load(piece_indptr_ptr + req)
        end = tl.load(piece_indptr_ptr + req + 1)
        dims = tl.arange(0, HEAD_DIM)
        # A running softmax over the pieces: rescale what was summed whenever the max grows.
        running_max = tl.full([], float("-inf"), tl.float32)
        weight_sum = tl.full([], 0.0, tl.float32)
        acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
        for p in range(first, end):
            row = (p * NUM_HEADS + head).to(tl.int64)  # int64 before the head_dim multiply
            lse = tl.load(lse_ptr + row)
            out = tl.load(out_ptr + row * HEAD_DIM + dims).to(tl.float32)
            new_max = tl.maximum(running_max, lse)
            rescale = tl.exp2(running_max - new_max)
            weight = tl.exp2(lse - new_max)
            acc = acc * rescale + weight * out
            weight_sum = weight_sum * rescale + weight
            running_max = new_max
        dest = (req.to(tl.int64) * NUM_HEADS + head) * HEAD_DIM + dims
        tl.store(merged_ptr + dest, (acc / weight_sum).to(merged_ptr.dtype.element_ty))


def merge_pieces(out: torch.Tensor, lse: torch.Tensor, piece_indptr: torch.Tensor) -> torch.Tensor:
    """Each request's attention output from its pieces' (one Triton kernel).

    Args:
        out: ``[P, H, D]`` attention output of every piece, as if it were a request.
        lse: ``[P, H]`` float32 base-2 log-sum-exp of each piece's scores.
        piece_indptr: ``[B + 1]`` int32 or int64 on the device: request ``i``'s pieces are rows
            ``piece_indptr[i] .. piece_indptr[i + 1] - 1``. Rows past ``piece_indptr[B]`` are
            ignored (a captured graph's spare pieces).

    Returns:
        ``[B, H, D]`` in ``out``'s dtype.
    """
    assert triton is not None, "merge_pieces runs on a CUDA device, where Triton is"
    num_pieces, num_heads, head_dim = out.shape
    num_reqs = piece_indptr.shape[0] - 1
    merged = torch.empty(num_reqs, num_heads, head_dim, dtype=out.dtype, device=out.device)
    _merge_pieces_kernel[(num_reqs, num_heads)](out, lse, piece_indptr, merged,
                                                NUM_HEADS=num_heads, HEAD_DIM=head_dim,
                                                num_warps=1)
    return merged

