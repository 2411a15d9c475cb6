"""The mixture-of-experts computation written the obvious way: one expert at a time.

For each expert, gather the tokens routed to it, run its gated MLP on them, scale each row by
that token's routing weight and add it into the token's output. It is slow (a Python loop over
every expert, and a host synchronisation per expert to learn how many tokens it got), but each
step is plain PyTorch, so it is the reference the faster paths are compared with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl.layers import silu_and_mul
from minisgl.moe.router import Routing


def moe_reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  routing: Routing) -> torch.Tensor:
    """``sum_k weight[t, k] * expert_{id[t, k]}(x[t])`` for every token ``t``.

    ``x`` is [T, hidden], ``gate_up`` [E, 2 * inter, hidden] (each expert's gate rows above its
    up rows), ``down`` [E, hidden, inter]. The sum is kept in float32 and rounded once.
    """
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(gate_up.shape[0]):
        tokens, slots = torch.where(routing.expert_ids == expert)
        if tokens.numel() == 0:
            continue  # no token chose this expert: its weights are not even read
        hidden = silu_and_mul(F.linear(x[tokens], gate_up[expert]))
        y = F.linear(hidden, down[expert]).float() * routing.weights[tokens, slots, None]
        out.index_add_(0, tokens, y)
    return out.to(x.dtype)
