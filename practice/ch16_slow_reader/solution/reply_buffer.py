"""One request's undelivered replies, bounded, with the clock of a slow reader.

Write the four methods of :class:`ReplyBuffer` (and its check in ``__post_init__``). See
README.md for the rules; `python practice/judge.py ch16_slow_reader` checks your work.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from minisgl.message import UserReply


@dataclass
class ReplyBuffer:
    """One request's replies that its reader has not taken yet: at most ``capacity``.

    Attributes:
        capacity: the most replies held.
        replies: the replies not taken yet, oldest first.
        event: set while there are replies to take.
        behind_since: when the oldest reply not taken yet arrived; None when there is none.
        finished: the request's last reply has arrived (or the server ended the request).
        failed: the server ended the request with an error (:meth:`fail`).
    """

    capacity: int
    replies: deque[UserReply] = field(default_factory=deque)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    behind_since: float | None = None
    finished: bool = False
    failed: bool = False

    @property
    def full(self) -> bool:
        """Whether the next :meth:`push` would find no room (given: the frontend asks it)."""
        return len(self.replies) >= self.capacity

    def __post_init__(self) -> None:
        if isinstance(self.capacity, bool) or not isinstance(self.capacity, int) \
                or self.capacity < 1:
            raise ValueError(f"a reply buffer holds at least 1 reply, got {self.capacity!r}")

    def push(self, reply: UserReply, now: float) -> bool:
        """Keep ``reply`` and wake the reader; False (nothing kept) when the buffer is full."""
        if self.full:
            return False
        if not self.replies:
            self.behind_since = now
        self.replies.append(reply)
        self.finished = self.finished or reply.finished
        self.event.set()
        return True

    def take(self) -> list[UserReply]:
        """Every reply not taken yet, oldest first; the reader has caught up."""
        batch = list(self.replies)
        self.replies.clear()
        self.behind_since = None
        self.event.clear()
        return batch

    def lag(self, now: float) -> float:
        """Seconds the oldest reply not taken yet has waited (0.0 when there is none)."""
        return 0.0 if self.behind_since is None else max(0.0, now - self.behind_since)

    def fail(self, reply: UserReply, now: float) -> None:
        """End the request with ``reply`` (an error): drop what is buffered, keep the error
        alone for the reader, and wake it."""
        self.replies.clear()
        self.replies.append(reply)
        self.behind_since = now
        self.finished = self.failed = True
        self.event.set()
