"""The tokenizer and detokenizer processes.

Both are thin loops around the pure logic of ``tokenize.py`` and ``detokenize.py``: bind an
inbox, load the checkpoint's tokenizer, report ready, then take every message that has arrived,
handle it and send the results on in one frame::

    API server  --TokenizeRequest, AbortRequest-----> tokenizer
    tokenizer   --UserRequest, AbortRequest---------> scheduler
    scheduler   --DetokenizeRequest, AbortRequest---> detokenizer
    detokenizer --UserReply-------------------------> API server
    detokenizer --AbortRequest (a stop string)------> scheduler

There may be several tokenizers (the API server sends request ``uid`` to tokenizer
``uid % N``, so an abort always follows its own request), and there is one detokenizer: it
holds every request's text state.

Each function is a process's main: it returns when the process gets SIGTERM or SIGINT, after
closing its sockets.
"""

from __future__ import annotations

import multiprocessing

import zmq

from minisgl.message import (
    AbortRequest,
    BackendMessage,
    DetokenizerMessage,
    FrontendMessage,
    TokenizeRequest,
    TokenizerMessage,
)
from minisgl.tokenizer.detokenize import DetokenizeManager
from minisgl.tokenizer.tokenize import TokenizeManager, load_tokenizer
from minisgl.utils.logger import get_logger
from minisgl.utils.counters import SharedCounters
from minisgl.utils.processes import ShutdownRequested, ShutdownSignals, reporting_readiness
from minisgl.utils.queues import ZmqPullQueue, ZmqPushQueue

logger = get_logger(__name__)

# What the detokenizer publishes after each frame: requests whose text state it keeps.
DETOKENIZER_COUNTERS = ("live_states",)


def detokenizer_counters() -> SharedCounters:
    """Counters for :func:`run_detokenizer`'s ``stats`` argument."""
    return SharedCounters(DETOKENIZER_COUNTERS)


def _close(*queues: ZmqPullQueue | ZmqPushQueue | None) -> None:
    """Close the queues that were opened, then the process's ZMQ context."""
    for queue in queues:
        if queue is not None:
            queue.close()  # linger 0: frames not handed over yet are dropped
    zmq.Context.instance().term()


def run_tokenizer(model_path: str, inbox: str, scheduler_addr: str,
                  ready: multiprocessing.Queue | None = None,
                  name: str = "tokenizer-0") -> None:
    """A tokenizer process: prompts in from the API server, token ids out to the scheduler.

    Args:
        model_path: the checkpoint whose tokenizer (and chat template) to use.
        inbox: the address this process binds, where the API server sends
            :class:`TokenizeRequest` and :class:`AbortRequest` messages.
        scheduler_addr: the scheduler's inbox.
        ready: a queue from :func:`~minisgl.utils.processes.new_ready_queue`, or None.
        name: this tokenizer's name in readiness reports and errors.
    """
    signals = ShutdownSignals()
    receive = send = None
    try:
        with signals.interruptible(), reporting_readiness(ready, name):
            manager = TokenizeManager(load_tokenizer(model_path))
            receive = ZmqPullQueue(inbox, TokenizerMessage, bind=True)
            send = ZmqPushQueue(scheduler_addr, BackendMessage, bind=False)
        while not signals.requested:
            messages = [signals.receive(receive)]  # sleeps until a message (or a signal) comes
            out: list[BackendMessage] = []
            for message in messages + receive.drain():
                if isinstance(message, AbortRequest):
                    out.append(message)  # forwarded unchanged, behind its request
                elif isinstance(message, TokenizeRequest):
                    try:
                        out.append(manager.tokenize(message))
                    except ValueError as exc:  # chapter 16 answers the client with the error
                        logger.error("request %d dropped: %s", message.uid, exc)
            send.put_many(out)
    except ShutdownRequested:
        pass
    finally:
        _close(receive, send)
    logger.info("%s stopped", name)


def run_detokenizer(model_path: str, inbox: str, frontend_addr: str,
                    ready: multiprocessing.Queue | None = None,
                    stats: SharedCounters | None = None,
                    scheduler_addr: str | None = None) -> None:
    """The detokenizer process: tokens in from the scheduler, text out to the API server.

    Args:
        model_path: the checkpoint whose tokenizer to decode with.
        inbox: the address this process binds, where the scheduler sends
            :class:`~minisgl.message.DetokenizeRequest` and :class:`AbortRequest` messages.
        frontend_addr: the API server's inbox, for the :class:`~minisgl.message.UserReply`
            messages.
        ready: a queue from :func:`~minisgl.utils.processes.new_ready_queue`, or None.
        stats: counters named :data:`DETOKENIZER_COUNTERS` to publish, or None.
        scheduler_addr: the scheduler's inbox, to stop a request that a stop string ended;
            None leaves such requests running to their end (their extra tokens are dropped).
    """
    signals = ShutdownSignals()
    receive = send = abort = None
    try:
        with signals.interruptible(), reporting_readiness(ready, "detokenizer"):
            manager = DetokenizeManager(load_tokenizer(model_path))
            receive = ZmqPullQueue(inbox, DetokenizerMessage, bind=True)
            send = ZmqPushQueue(frontend_addr, FrontendMessage, bind=False)
            if scheduler_addr is not None:
                abort = ZmqPushQueue(scheduler_addr, BackendMessage, bind=False)
        while not signals.requested:
            messages = [signals.receive(receive)]  # sleeps until a message (or a signal) comes
            replies, aborts = manager.process(messages + receive.drain())
            send.put_many(replies)
            if abort is not None:
                abort.put_many(aborts)
            if stats is not None:
                stats.update(live_states=manager.num_live)
    except ShutdownRequested:
        pass
    finally:
        _close(receive, send, abort)
    logger.info("detokenizer stopped")
