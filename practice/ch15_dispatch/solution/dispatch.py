"""Routing replies by uid: the heart of the API server's FrontendManager.

Write the four methods of :class:`ReplyRouter`. See README.md for the rules;
`python practice/judge.py ch15_dispatch` checks your work.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from minisgl.message import UserReply


@dataclass
class Pending:
    """One request's state: replies not read yet, and the event that wakes its reader."""

    replies: list[UserReply] = field(default_factory=list)
    event: asyncio.Event = field(default_factory=asyncio.Event)


class ReplyRouter:
    """Hands each reply from the one inbox to the request (uid) it belongs to."""

    def __init__(self) -> None:
        self.pending: dict[int, Pending] = {}

    @property
    def num_open(self) -> int:
        """Requests whose replies are still awaited."""
        return len(self.pending)

    def open(self, uid: int) -> None:
        """Start waiting for request ``uid``'s replies (before the request is sent)."""
        if uid in self.pending:
            raise ValueError(f"request {uid} is already open")
        self.pending[uid] = Pending()

    def deliver(self, reply: UserReply) -> bool:
        """Keep ``reply`` for its request and wake that request's reader.

        Returns False (and drops the reply) when nobody waits for that uid.
        """
        pending = self.pending.get(reply.uid)
        if pending is None:
            return False
        pending.replies.append(reply)
        pending.event.set()
        return True

    async def replies(self, uid: int) -> AsyncIterator[UserReply]:
        """Request ``uid``'s replies in order, up to and including the finished one."""
        pending = self.pending[uid]
        try:
            while True:
                await pending.event.wait()
                pending.event.clear()  # before taking the buffer: a later reply sets it again
                batch, pending.replies = pending.replies, []
                for reply in batch:
                    yield reply
                    if reply.finished:
                        return
        finally:
            self.pending.pop(uid, None)

    def close(self, uid: int) -> None:
        """Stop waiting for ``uid`` (its client went away); later replies are dropped."""
        self.pending.pop(uid, None)
