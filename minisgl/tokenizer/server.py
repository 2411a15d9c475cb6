"""The tokenizer and detokenizer processes.

Both are thin loops around ``tokenize.py`` and ``detokenize.py``: bind an inbox, load the
tokenizer, report ready, then handle every message that has arrived and send the results on in
one frame. Each function is a process's main and returns on SIGTERM or SIGINT. There may be
several tokenizers (request ``uid`` goes to tokenizer ``uid % N``, so an abort follows its own
request) and there is one detokenizer, which holds every request's text state. Neither worker
drops a request it cannot serve: it ends it with a :class:`~minisgl.message.RequestError`.
Chapter 14 tells the story; chapter 16 adds the errors.
"""

from __future__ import annotations

import multiprocessing

from minisgl.message import (AbortRequest, BackendMessage, DetokenizerMessage, FrontendMessage,
                             RequestError, TokenizeRequest, TokenizerMessage, UserRequest,
                             server_error)
from minisgl.tokenizer.detokenize import DetokenizeManager
from minisgl.tokenizer.tokenize import TokenizeManager, load_tokenizer
from minisgl.utils.logger import get_logger
from minisgl.utils.counters import SharedCounters
from minisgl.utils.processes import reporting_readiness, worker_process
from minisgl.utils.queues import ZmqPullQueue, ZmqPushQueue
from minisgl.utils.torch_utils import configure_cpu_threads

logger = get_logger(__name__)


def detokenizer_counters() -> SharedCounters:
    """Counters for :func:`run_detokenizer`'s ``stats`` argument: ``live_states``, the requests
    whose text state it keeps, published after each frame."""
    return SharedCounters(["live_states"])


def tokenize_or_fail(manager: TokenizeManager,
                     request: TokenizeRequest) -> UserRequest | AbortRequest:
    """The scheduler's request for ``request``, or an abort that carries why there is none.

    The abort goes the request's normal way, so the client gets an answer: HTTP 400 for a
    prompt the tokenizer rejects, 500 for a failure of the tokenizer's own.
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
                  ready: multiprocessing.Queue,
                  name: str = "tokenizer-0") -> None:
    """A tokenizer process: prompts in from the API server, token ids out to the scheduler.

    Args:
        model_path: the checkpoint whose tokenizer (and chat template) to use.
        inbox: the address this process binds, where the API server sends
            :class:`TokenizeRequest` and :class:`AbortRequest` messages.
        scheduler_addr: the scheduler's inbox.
        ready: a queue from :func:`~minisgl.utils.processes.new_ready_queue`.
        name: this tokenizer's name in readiness reports and errors.
    """
    configure_cpu_threads("helper")  # the cores are the scheduler's
    with worker_process(name) as signals:
        with signals.interruptible(), reporting_readiness(ready, name):
            manager = TokenizeManager(load_tokenizer(model_path))
            receive = ZmqPullQueue(inbox, TokenizerMessage, bind=True)
            send = ZmqPushQueue(scheduler_addr, BackendMessage, bind=False)
        while not signals.requested:
            messages = signals.receive(receive)  # sleeps until a message (or a signal) comes
            # an abort goes on unchanged, behind its request, in the same frame
            send.put_many([tokenize_or_fail(manager, m) if isinstance(m, TokenizeRequest) else m
                           for m in messages])


def run_detokenizer(model_path: str, inbox: str, frontend_addr: str, scheduler_addr: str,
                    ready: multiprocessing.Queue,
                    stats: SharedCounters) -> None:
    """The detokenizer process: tokens in from the scheduler, text out to the API server.

    Args:
        model_path: the checkpoint whose tokenizer to decode with.
        inbox: the address this process binds, where the scheduler sends
            :class:`~minisgl.message.DetokenizeRequest` and :class:`AbortRequest` messages.
        frontend_addr: the API server's inbox, for the :class:`~minisgl.message.UserReply`
            messages.
        scheduler_addr: the scheduler's inbox, to stop a request that a stop string ended.
        ready: a queue from :func:`~minisgl.utils.processes.new_ready_queue`.
        stats: counters from :func:`detokenizer_counters` to publish.
    """
    configure_cpu_threads("helper")
    with worker_process("detokenizer") as signals:
        with signals.interruptible(), reporting_readiness(ready, "detokenizer"):
            manager = DetokenizeManager(load_tokenizer(model_path))
            receive = ZmqPullQueue(inbox, DetokenizerMessage, bind=True)
            send = ZmqPushQueue(frontend_addr, FrontendMessage, bind=False)
            abort = ZmqPushQueue(scheduler_addr, BackendMessage, bind=False)
        while not signals.requested:
            # signals.receive sleeps until a message (or a signal) comes
            replies, aborts = manager.process(signals.receive(receive))
            send.put_many(replies)
            abort.put_many(aborts)
            stats.update(live_states=len(manager.states))
