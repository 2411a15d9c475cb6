"""The disconnect race: the bookkeeping that frees every request's state exactly once.

Three processes hold a request (the API server's frontend, the scheduler, the detokenizer),
and messages between them cross: a client leaves while its last reply is on the way, an abort
reaches the scheduler after the request finished. Write the handlers of :class:`Frontend`,
:class:`Scheduler` and :class:`Detokenizer`; the message types and :class:`Ledger` are given.
See README.md; `python practice/judge.py ch16_disconnect_race` checks your work.
"""

from __future__ import annotations

from dataclasses import dataclass, field


# ----------------------------------------------------------------- given: the messages
@dataclass(frozen=True)
class Request:
    """frontend -> scheduler: generate ``max_tokens`` tokens for ``uid``."""

    uid: int
    max_tokens: int


@dataclass(frozen=True)
class Abort:
    """frontend -> scheduler (the client left), or scheduler -> detokenizer (it dropped uid)."""

    uid: int


@dataclass(frozen=True)
class Token:
    """scheduler -> detokenizer: the ``index``-th token of ``uid`` (0, 1, 2, ...)."""

    uid: int
    index: int
    finished: bool


@dataclass(frozen=True)
class Reply:
    """detokenizer -> frontend: the text of one token; ``finished`` on the last one."""

    uid: int
    text: str
    finished: bool


# ----------------------------------------------------------------- given: the ledger
@dataclass
class Ledger:
    """Records what each process holds, and what reached each client.

    ``hold(process, uid)`` when a process creates its state for a request, ``free(process,
    uid)`` when it forgets it. Holding twice, or freeing what is not held, raises at once.
    """

    held: dict[str, set[int]] = field(default_factory=lambda: {
        "frontend": set(), "scheduler": set(), "detokenizer": set()})
    freed: dict[str, list[int]] = field(default_factory=lambda: {
        "frontend": [], "scheduler": [], "detokenizer": []})
    delivered: dict[int, list[str]] = field(default_factory=dict)  # uid -> texts its client got

    def hold(self, process: str, uid: int) -> None:
        if uid in self.held[process]:
            raise AssertionError(f"the {process} created a state for uid {uid} it already holds")
        self.held[process].add(uid)

    def free(self, process: str, uid: int) -> None:
        if uid not in self.held[process]:
            raise AssertionError(f"the {process} freed uid {uid}, which it does not hold "
                                 f"(freed before: {uid in self.freed[process]})")
        self.held[process].remove(uid)
        self.freed[process].append(uid)

    def deliver(self, uid: int, text: str) -> None:
        self.delivered.setdefault(uid, []).append(text)


# ----------------------------------------------------------------- yours
class Frontend:
    """The API server's side: one open entry per request whose client still waits."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.open: set[int] = set()

    def submit(self, uid: int, max_tokens: int) -> Request:
        """A client asks for ``max_tokens`` tokens: open its entry, return what to send."""
        raise NotImplementedError("submit: open the entry, hold it in the ledger, return the "
                                  "Request")

    def on_reply(self, reply: Reply) -> None:
        """A reply arrives: hand it to its client, or drop it if nobody waits for it."""
        raise NotImplementedError("on_reply: deliver to an open uid (free it on the last "
                                  "reply); drop a reply nobody waits for")

    def client_left(self, uid: int) -> Abort | None:
        """The client hung up: forget it; return the abort to send, if the request may run."""
        raise NotImplementedError("client_left: free an open entry and return Abort(uid); "
                                  "otherwise nothing")


class Scheduler:
    """The scheduler's side: the requests that are running, and how many tokens each has."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.running: dict[int, tuple[int, int]] = {}  # uid -> (tokens so far, max_tokens)

    def on_message(self, message: Request | Abort) -> list[Token | Abort]:
        """A request or an abort from the frontend; return what goes to the detokenizer."""
        raise NotImplementedError("on_message: admit a Request; an Abort drops a running "
                                  "request and is passed on, and does nothing otherwise")

    def step(self) -> list[Token]:
        """One token for every running request, in uid order; a finished one is freed."""
        raise NotImplementedError("step: a Token per running request, finished on its "
                                  "max_tokens-th; free the finished ones")


class Detokenizer:
    """The detokenizer's side: one state per request from its first token to its last word."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.states: set[int] = set()

    def on_message(self, message: Token | Abort) -> list[Reply]:
        """A token or a forwarded abort from the scheduler; return what goes to the frontend."""
        raise NotImplementedError("on_message: a state from a uid's first token to its last "
                                  "token or its abort; a Reply 't<index>' per token")
