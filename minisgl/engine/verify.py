"""The target's side of speculative decoding: one pass that scores every guess (chapter 23).

A decoding request normally feeds one token, its last sample, and gets the logits of the one
after. Give it ``g`` guesses of the tokens that follow and it can feed ``1 + g`` tokens in the
same pass, a prefill-shaped step over its cached past, and get ``1 + g`` rows of logits: row
``j`` is the target's distribution after the last sample and the first ``j`` guesses. Reading
the weights once then checks every guess, and :mod:`minisgl.speculative.accept` decides how
many to keep.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from minisgl.core import Batch
from minisgl.engine.sample import compute_probs, make_generator
from minisgl.speculative.accept import PAD, Verdict, accept_greedy, accept_sampled
from minisgl.utils.torch_utils import host_to_device

if TYPE_CHECKING:  # engine.py does not import this module: no cycle at run time
    from minisgl.engine.engine import Engine


@torch.no_grad()
def verify(engine: Engine, batch: Batch, guesses: Sequence[Sequence[int]]) -> Verdict:
    """Score each request's last token and its guesses in one pass, and keep what passes.

    Args:
        engine: the target's engine.
        batch: a prefill-phase batch in which request ``i`` feeds ``1 + len(guesses[i])``
            tokens after its cached past: its last sample, then its guesses, already in the
            token pool (the caller wrote them there and counted them in the request's length).
        guesses: each request's proposed tokens (any may be empty).

    Returns:
        The :class:`~minisgl.speculative.accept.Verdict`, on the device. A greedy request
        keeps a guess while it equals the target's argmax; a sampled one by the rejection
        rule, so its tokens follow exactly the distribution decoding without guesses draws from.
    """
    size = batch.size
    k = max(map(len, guesses), default=0)
    if [1 + len(g) for g in guesses] != batch.new_lens:
        raise ValueError(f"each request must feed its last token and its guesses: it feeds "
                         f"{batch.new_lens}, the guesses need {[1 + len(g) for g in guesses]}")
    # The engine scores each request's last fed token (row i), then any rows asked for: here
    # every other fed token, so row j of request i is found at a known index.
    starts = [0, *itertools.accumulate(batch.new_lens)][:-1]
    extra = [start + j for start, n in zip(starts, batch.new_lens) for j in range(n - 1)]
    logits = engine.logits(batch, use_graph=False, extra_rows=extra)
    index, first_extra = [], size
    for i, n in enumerate(batch.new_lens):
        rows = list(range(first_extra, first_extra + n - 1)) + [i]
        first_extra += n - 1
        index.append(rows + [i] * (k + 1 - n))  # past its guesses: a row never read
    device = logits.device
    per_position = logits[host_to_device(torch.tensor(index), device)]  # [B, k + 1, V]
    proposed = host_to_device(torch.tensor([list(g) + [PAD] * (k - len(g)) for g in guesses],
                                           dtype=torch.int64).view(size, k), device)
    num_proposed = host_to_device(torch.tensor([len(g) for g in guesses]), device)
    reqs = batch.reqs
    if all(req.params.is_greedy for req in reqs):  # no softmax needed: argmax decides
        return accept_greedy(proposed, per_position.argmax(dim=-1), num_proposed)
    for req in reqs:  # a seeded request's own stream starts at its first sample
        if req.params.seed is not None and req.generator is None:
            req.generator = make_generator(req.params.seed, device)
    params = [req.params for req in reqs for _ in range(k + 1)]
    probs = compute_probs(per_position.flatten(0, 1), params).view(size, k + 1, -1)
    return accept_sampled(proposed, None, probs, num_proposed, [req.generator for req in reqs])
