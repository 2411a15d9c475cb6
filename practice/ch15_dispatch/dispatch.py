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
        raise NotImplementedError("open: a fresh Pending for uid; a uid already open is a "
                                  "ValueError")

    def deliver(self, reply: UserReply) -> bool:
        """Keep ``reply`` for its request and wake that request's reader.

        Returns False (and drops the reply) when nobody waits for that uid.
        """
        raise NotImplementedError("deliver: append to the uid's buffer and set its event")

    async def replies(self, uid: int) -> AsyncIterator[UserReply]:
        """Request ``uid``'s replies in order, up to and including the finished one."""
        raise NotImplementedError("replies: wait on the uid's event, take its whole buffer, "
                                  "yield it; free the state however the loop ends")
        yield  # unreachable: makes this function an async generator, as yours will be

    def close(self, uid: int) -> None:
        """Stop waiting for ``uid`` (its client went away); later replies are dropped."""
        raise NotImplementedError("close: forget the uid's state")
