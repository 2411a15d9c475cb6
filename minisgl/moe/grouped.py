"""Mixture of experts as two grouped matrix multiplies: tokens sorted by expert, then one call.

The per-expert loop launches two matrix multiplies per expert and synchronises with the host
for each. Here the ``T x top_k`` (token, expert) pairs are sorted by expert once, so the rows
of each expert sit next to each other; a *grouped* matrix multiply then multiplies row group
``e`` by expert ``e``'s weights, for every group, in one call. ``torch.nn.functional.grouped_mm``
does that on CUDA and, in float32, on the CPU; where it cannot take the tensors, the same
sorted groups are multiplied one slice at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minisgl.layers import silu_and_mul
from minisgl.moe.router import Routing

_GROUPED_MM_ALIGN_BYTES = 16  # grouped_mm wants every row stride to be a multiple of this


@dataclass(frozen=True)
class ExpertGroups:
    """The (token, expert) pairs of a batch, sorted so that each expert's rows are together.

    ``pair_ids`` [T * top_k]: positions in the flattened routing, expert by expert (tokens in
    order within an expert); ``token_ids``: the token of each of those rows; ``ends`` [E]: where
    each expert's rows end (a cumulative count; an expert with no rows ends where the previous
    one did).
    """

    pair_ids: torch.Tensor
    token_ids: torch.Tensor
    ends: torch.Tensor


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int) -> ExpertGroups:
    flat = expert_ids.flatten()
    pair_ids = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return ExpertGroups(pair_ids=pair_ids, token_ids=pair_ids // expert_ids.shape[1],
                        ends=torch.cumsum(counts, dim=0))


def _grouped_mm_fits(rows: torch.Tensor, weights: torch.Tensor) -> bool:
    if not hasattr(F, "grouped_mm") or rows.dtype != weights.dtype:
        return False
    if rows.device.type == "cpu" and rows.dtype != torch.float32:
        return False  # the CPU kernel is exact in float32 only; the loop is as good elsewhere
    item = rows.element_size()
    return all(n * item % _GROUPED_MM_ALIGN_BYTES == 0
               for n in (rows.shape[1], weights.shape[1], weights.shape[2]))


def grouped_linear(rows: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Row group ``e`` (rows ``ends[e-1]:ends[e]``) times ``weights[e].T``, for every ``e``.

    ``rows`` [N, in], ``weights`` [E, out, in] as the checkpoint stores them -> [N, out].
    """
    if _grouped_mm_fits(rows, weights):
        return F.grouped_mm(rows, weights.transpose(1, 2), offs=ends.to(torch.int32))
    out = rows.new_empty(rows.shape[0], weights.shape[1])
    start = 0
    for expert, end in enumerate(ends.tolist()):  # the sorted segment loop
        if end > start:
            out[start:end] = F.linear(rows[start:end], weights[expert])
        start = end
    return out


def moe_grouped(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                routing: Routing) -> torch.Tensor:
    """The same sum as :func:`~minisgl.moe.reference.moe_reference`, with the rows sorted once."""
    groups = sort_by_expert(routing.expert_ids, gate_up.shape[0])
    rows = x[groups.token_ids]  # each token copied once per expert it visits
    hidden = silu_and_mul(grouped_linear(rows, gate_up, groups.ends))
    y = grouped_linear(hidden, down, groups.ends).float()
    y *= routing.weights.flatten()[groups.pair_ids, None]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, groups.token_ids, y)  # each token sums its top_k rows
    return out.to(x.dtype)
