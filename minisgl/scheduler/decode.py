"""The running requests, and the decode batch they form on every decode step.

A request joins after its prefill and leaves the step it finishes or is aborted; a decode step
takes all of them. Because the set changes between steps, a batch never carries finished
requests nor waits for the slowest: continuous batching. Chapter 9 tells the story.
"""

from __future__ import annotations

from minisgl.core import Batch, Req


class DecodeManager:
    """The requests that have been prefilled and have not finished.

    ``running`` keeps them in the order they joined, so a decode batch lists its requests in a
    stable, readable order (the results do not depend on it).
    """

    def __init__(self) -> None:
        self.running: list[Req] = []

    def add(self, req: Req) -> None:
        """Start decoding a request that has just been prefilled."""
        assert not req.is_finished and req not in self.running, req
        self.running.append(req)

    def remove(self, uid: int) -> Req | None:
        """Stop decoding request ``uid`` (it finished, or was aborted); None if not running."""
        for i, req in enumerate(self.running):
            if req.uid == uid:
                return self.running.pop(i)
        return None

    def schedule(self) -> Batch | None:
        """Every running request, one new token each; None if none is running."""
        return Batch(self.running, "decode") if self.running else None
