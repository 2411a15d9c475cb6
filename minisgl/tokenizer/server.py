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
closing its sockets (or when its parent has died).

Neither worker drops a request it cannot serve. The tokenizer sends an
:class:`AbortRequest` carrying a :class:`~minisgl.message.RequestError` in its place; the
detokenizer turns such an abort, or an error of its own, into the request's last reply.
"""

from __future__ import annotations

import multiprocessing

from minisgl.message import (
    AbortRequest,
    BackendMessage,
    DetokenizerMessage,
    FrontendMessage,
    RequestError,
    TokenizeRequest,
    TokenizerMessage,
    UserRequest,
    server_error,
)
from minisgl.tokenizer.detokenize import DetokenizeManager
from minisgl.tokenizer.tokenize import TokenizeManager, load_tokenizer
from minisgl.utils.logger import get_logger
from minisgl.utils.counters import SharedCounters
from minisgl.utils.processes import ShutdownRequested, ShutdownSignals, reporting_readiness
from minisgl.utils.queues import ZmqPullQueue, ZmqPushQueue, close_queues
from minisgl.utils.torch_utils import configure_cpu_threads

logger = get_logger(__name__)

# What the detokenizer publishes after each frame: requests whose text state it keeps.
DETOKENIZER_COUNTERS = ("live_states",)


def detokenizer_counters() -> SharedCounters:
    """Counters for :func:`run_detokenizer`'s ``stats`` argument."""
    return SharedCounters(DETOKENIZER_COUNTERS)


def tokenize_or_fail(manager: TokenizeManager,
                     request: TokenizeRequest) -> UserRequest | AbortRequest:
    """The scheduler's request for ``request``, or an abort that carries why
    there is none.

    The abort goes the request's normal way (scheduler, detokenizer, API server), so the
    client gets an answer: HTTP 400 for a prompt the tokenizer rejects (no tokens, a
    conversation the chat template refuses), 500 for a failure of the tokenizer's own. The
    worker goes on with the next request either way.
    """
    param = "messages" if request.messages is not None else "prompt"
    try:
        return manager.tokenize(request)
    except ValueError as exc:
        logger.warning("request %d refused: %s", request.uid, exc)
        return AbortRequest(request.uid, error=RequestError(str(exc), param=param))
    except Exception as exc:  # a bug, or a tokenizer that raises something else
        logger.exception("request %d could not be tokenized", request.uid)
        return AbortRequest(request.uid, error=server_error("the tokenizer failed", exc))


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
    configure_cpu_threads("helper")  # the cores are the scheduler's
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
                    out.append(tokenize_or_fail(manager, message))
            send.put_many(out)
    except ShutdownRequested:
        pass
    finally:
        close_queues(receive, send)
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
    configure_cpu_threads("helper")
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
        close_queues(receive, send, abort)
    logger.info("detokenizer stopped")
