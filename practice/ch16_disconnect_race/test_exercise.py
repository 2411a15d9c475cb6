"""Tests for the disconnect-race exercise: they are its specification.

A small network carries the messages: three first-in first-out queues (frontend -> scheduler,
scheduler -> detokenizer, detokenizer -> frontend), as ZMQ keeps one sender's order on one
queue. A *trace* says what happens next: a client submits or leaves, the scheduler steps, or the
next message on one queue arrives. The README's example comes first, then each crossing alone,
then random traces. Every failure shows the trace, what was expected and what happened.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

import pytest
from race import Abort, Detokenizer, Frontend, Ledger, Reply, Request, Scheduler, Token

PROCESSES = ("frontend", "scheduler", "detokenizer")


@dataclass
class Network:
    """The three processes and the queues between them, driven one action at a time."""

    ledger: Ledger = field(default_factory=Ledger)
    trace: list[str] = field(default_factory=list)
    to_scheduler: deque = field(default_factory=deque)
    to_detokenizer: deque = field(default_factory=deque)
    to_frontend: deque = field(default_factory=deque)
    max_tokens: dict[int, int] = field(default_factory=dict)
    got_when_left: dict[int, int] = field(default_factory=dict)  # uid -> replies its client had
    aborted_in_scheduler: set[int] = field(default_factory=set)
    aborts_sent: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.frontend = Frontend(self.ledger)
        self.scheduler = Scheduler(self.ledger)
        self.detokenizer = Detokenizer(self.ledger)

    def where(self) -> str:
        return "after: " + ", ".join(self.trace)

    def submit(self, uid: int, max_tokens: int) -> None:
        self.trace.append(f"submit({uid}, {max_tokens})")
        self.max_tokens[uid] = max_tokens
        sent = self.frontend.submit(uid, max_tokens)
        assert sent == Request(uid, max_tokens), (
            f"{self.where()}\n  expected submit to return {Request(uid, max_tokens)}, got {sent!r}")
        self.to_scheduler.append(sent)

    def leave(self, uid: int) -> None:
        self.trace.append(f"leave({uid})")
        self.got_when_left[uid] = len(self.ledger.delivered.get(uid, []))
        abort = self.frontend.client_left(uid)
        if abort is not None:
            assert abort == Abort(uid), (
                f"{self.where()}\n  expected client_left to return {Abort(uid)} or None, "
                f"got {abort!r}")
            self.aborts_sent.append(uid)
            self.to_scheduler.append(abort)

    def step(self) -> None:
        self.trace.append("step")
        for token in self.scheduler.step():
            assert isinstance(token, Token), f"{self.where()}\n  step returned {token!r}"
            assert token.uid not in self.aborted_in_scheduler, (
                f"{self.where()}\n  the scheduler generated {token} for uid {token.uid} after "
                "the abort that dropped it")
            self.to_detokenizer.append(token)

    def deliver_to_scheduler(self) -> None:
        message = self.to_scheduler.popleft()
        self.trace.append(f"scheduler gets {message}")
        if isinstance(message, Abort):
            self.aborted_in_scheduler.add(message.uid)
        self.to_detokenizer.extend(self.scheduler.on_message(message))

    def deliver_to_detokenizer(self) -> None:
        message = self.to_detokenizer.popleft()
        self.trace.append(f"detokenizer gets {message}")
        self.to_frontend.extend(self.detokenizer.on_message(message))

    def deliver_to_frontend(self) -> None:
        message = self.to_frontend.popleft()
        self.trace.append(f"frontend gets {message}")
        self.frontend.on_reply(message)

    def settle(self) -> None:
        """Deliver everything and step until nothing is left to do."""
        for _ in range(10_000):
            if self.to_scheduler:
                self.deliver_to_scheduler()
            elif self.to_detokenizer:
                self.deliver_to_detokenizer()
            elif self.to_frontend:
                self.deliver_to_frontend()
            elif self.scheduler.running:
                self.step()
            else:
                return
        raise AssertionError(f"{self.where()}\n  the network never went quiet")

    def check(self) -> None:
        """Every state freed exactly once, every client served or cut off cleanly."""
        for process in PROCESSES:
            assert not self.ledger.held[process], (
                f"{self.where()}\n  expected the {process} to hold nothing once all is "
                f"delivered, it still holds uids {sorted(self.ledger.held[process])}")
            freed = self.ledger.freed[process]
            twice = sorted({uid for uid in freed if freed.count(uid) > 1})
            assert not twice, f"{self.where()}\n  the {process} freed uids {twice} twice"
        for uid, limit in self.max_tokens.items():
            for process in ("frontend", "scheduler"):
                assert uid in self.ledger.freed[process], (
                    f"{self.where()}\n  expected the {process} to free uid {uid} once; "
                    f"it freed {self.ledger.freed[process]}")
            got = self.ledger.delivered.get(uid, [])
            full = [f"t{i}" for i in range(limit)]
            if uid in self.got_when_left:
                assert got == full[: self.got_when_left[uid]], (
                    f"{self.where()}\n  uid {uid}'s client left after "
                    f"{self.got_when_left[uid]} replies: expected it to get "
                    f"{full[: self.got_when_left[uid]]}, it got {got}")
            else:
                assert got == full, (
                    f"{self.where()}\n  uid {uid}'s client stayed: expected {full}, got {got}")


def run(actions: list[tuple], settle: bool = True) -> Network:
    net = Network()
    for action, *args in actions:
        getattr(net, action)(*args)
    if settle:
        net.settle()
        net.check()
    return net


# ----------------------------------------------------------------- the README's example
EXAMPLE = [("submit", 0, 2), ("submit", 1, 3), ("deliver_to_scheduler",),
           ("deliver_to_scheduler",), ("step",), ("step",), ("leave", 0),
           ("deliver_to_scheduler",), ("deliver_to_detokenizer",), ("deliver_to_detokenizer",),
           ("deliver_to_frontend",), ("deliver_to_frontend",), ("leave", 1)]


def test_the_readme_example() -> None:
    net = run(EXAMPLE, settle=False)
    assert net.ledger.delivered == {1: ["t0"]}, (
        f"{net.where()}\n  expected {{1: ['t0']}} delivered, got {net.ledger.delivered}")
    assert net.aborts_sent == [0, 1], (
        f"{net.where()}\n  expected aborts for uids [0, 1], got {net.aborts_sent}")
    expected = {"frontend": set(), "scheduler": {1}, "detokenizer": {0, 1}}
    assert net.ledger.held == expected, (
        f"{net.where()}\n  expected {expected} (uid 0's last token is still on its way to the "
        f"detokenizer), got {net.ledger.held}")
    net.settle()
    net.check()
    assert net.ledger.freed == {"frontend": [0, 1], "scheduler": [0, 1],
                                "detokenizer": [0, 1]}, net.ledger.freed


# ----------------------------------------------------------------- each crossing alone
def test_a_request_that_finishes_frees_every_state_on_its_last_token() -> None:
    net = run([("submit", 4, 3)])
    assert net.ledger.delivered == {4: ["t0", "t1", "t2"]}
    assert net.aborts_sent == [], f"{net.where()}\n  expected no abort, got {net.aborts_sent}"


def test_a_reply_for_a_client_that_left_is_dropped() -> None:
    net = run([("submit", 2, 5), ("deliver_to_scheduler",), ("step",), ("step",),
               ("deliver_to_detokenizer",), ("deliver_to_frontend",), ("leave", 2)])
    assert net.ledger.delivered == {2: ["t0"]}, (
        f"{net.where()}\n  expected {{2: ['t0']}}: the replies after the client left are "
        f"dropped; got {net.ledger.delivered}")


def test_a_client_that_leaves_after_its_last_reply_sends_no_abort() -> None:
    net = run([("submit", 3, 1)])
    net.leave(3)
    assert net.aborts_sent == [], (
        f"{net.where()}\n  the request was over: expected no abort, got {net.aborts_sent}")


def test_an_abort_that_crosses_the_finish_frees_nothing_twice() -> None:
    # the last token leaves the scheduler; the client leaves before its reply arrives
    net = run([("submit", 5, 1), ("deliver_to_scheduler",), ("step",), ("leave", 5)])
    assert net.aborts_sent == [5], (
        f"{net.where()}\n  the frontend had not seen the end: expected the abort [5], "
        f"got {net.aborts_sent}")
    assert net.ledger.freed["scheduler"] == [5]


def test_an_abort_before_the_first_token_leaves_no_detokenizer_state() -> None:
    net = run([("submit", 6, 4), ("leave", 6)])
    assert net.ledger.freed["detokenizer"] == [], (
        f"{net.where()}\n  uid 6 never made a token: expected the detokenizer never to hold "
        f"or free it, it freed {net.ledger.freed['detokenizer']}")


def test_an_abort_while_running_is_passed_to_the_detokenizer() -> None:
    net = run([("submit", 7, 10), ("deliver_to_scheduler",), ("step",), ("leave", 7),
               ("deliver_to_scheduler",)], settle=False)
    assert list(net.to_detokenizer) == [Token(7, 0, False), Abort(7)], (
        f"{net.where()}\n  expected [Token(7, 0, False), Abort(7)] on the way to the "
        f"detokenizer, got {list(net.to_detokenizer)}")
    net.settle()
    net.check()


def test_leaving_twice_sends_one_abort() -> None:
    net = run([("submit", 8, 10), ("leave", 8), ("leave", 8)])
    assert net.aborts_sent == [8], f"{net.where()}\n  expected [8], got {net.aborts_sent}"


def test_replies_carry_the_token_text_and_the_end() -> None:
    detok = Detokenizer(Ledger())
    got = [detok.on_message(Token(1, 0, False)), detok.on_message(Token(1, 1, True))]
    expected = [[Reply(1, "t0", False)], [Reply(1, "t1", True)]]
    assert got == expected, f"expected {expected}, got {got}"


# ----------------------------------------------------------------- any interleaving
@pytest.mark.parametrize("seed", range(40))
def test_random_interleavings_free_every_state_exactly_once(seed: int) -> None:
    rng = random.Random(seed)
    net = Network()
    uids = list(range(rng.randint(1, 6)))
    to_submit = list(uids)
    leavers = set(rng.sample(uids, rng.randint(0, len(uids))))
    for _ in range(rng.randint(5, 60)):
        moves = ["step"]
        if to_submit:
            moves.append("submit")
        if leavers & set(net.max_tokens):
            moves.append("leave")
        for queue in ("to_scheduler", "to_detokenizer", "to_frontend"):
            if getattr(net, queue):
                moves.append(queue)
        move = rng.choice(moves)
        if move == "submit":
            net.submit(to_submit.pop(0), rng.randint(1, 5))
        elif move == "leave":
            uid = rng.choice(sorted(leavers & set(net.max_tokens)))
            leavers.discard(uid)
            net.leave(uid)
        elif move == "step":
            net.step()
        else:
            getattr(net, "deliver_" + move)()
    for uid in to_submit:
        net.submit(uid, rng.randint(1, 5))
    net.settle()
    net.check()
