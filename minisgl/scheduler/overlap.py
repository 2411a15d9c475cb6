"""Overlap scheduling: a launched batch whose tokens the host reads one step later.

With ``SchedulerConfig.overlap`` the scheduler launches batch N+1 before it reads batch N's
tokens, so the host plans while the device computes. It can, because the engine feeds every
step from its token pool on the device, and a request's length counts the tokens in flight
(``Req.in_flight``). This module holds the two things the loop needs: the batch in flight, and
the copy of its tokens to the host, which must never make the host wait. Chapter 12 tells the
story: zombies, retiring requests and why a single blocking copy undoes it all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.core import Batch
from minisgl.engine.logprobs import StepLogprobs


@dataclass
class InFlight:
    """A launched batch whose sampled tokens the host has not read yet.

    Attributes:
        batch: the batch (its ``completes`` says which requests sampled a real token).
        host_tokens: the ``[B]`` sampled ids on their way to the host.
        ready: on CUDA, an event recorded after that copy; None on a CPU.
        logprobs: what :func:`~minisgl.engine.logprobs.batch_logprobs` returned (chapter 21).
    """

    batch: Batch
    host_tokens: torch.Tensor
    ready: torch.cuda.Event | None
    logprobs: StepLogprobs | None = None


class HostTokens:
    """Two pinned host buffers, used in turn, that a batch's tokens are copied into.

    Pinned (page-locked) memory is what lets the copy run without the host waiting for it, and
    it is slow to allocate, so the buffers are made once. Two suffice: the batch launched now
    copies into one while the host reads the other's. On a CPU nothing is copied.
    """

    def __init__(self, device: torch.device, max_batch_size: int) -> None:
        self._buffers: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        if device.type == "cuda":
            self._buffers = [(torch.empty(max_batch_size, dtype=torch.int64, pin_memory=True),
                              torch.cuda.Event()) for _ in range(2)]
        self._launches = 0

    def copy(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start copying ``tokens`` to the host; the host view and the event that says it is
        there (on a CPU: the tokens themselves and None)."""
        if not self._buffers:
            return tokens, None
        buffer, ready = self._buffers[self._launches % 2]
        self._launches += 1
        host = buffer[: tokens.shape[0]].copy_(tokens, non_blocking=True)
        ready.record()
        return host, ready
