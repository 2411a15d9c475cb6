"""One scheduler per rank: every rank runs the same scheduler on the same inputs.

Under tensor parallelism every forward pass needs every rank, in step, with the same batch in
the same pages. Instead of shipping batches, rank 0 (the only rank that talks to the outside)
passes each accepted request, each abort and each step on to the other ranks
(:class:`RankFollowers`, the ``followers`` of rank 0's :class:`Scheduler`); a follower repeats
them (:func:`run_tp_follower`). The scheduler is deterministic, every rank's pool has the same
pages, and rank 0's sampled tokens are broadcast, so every decision agrees. A rank whose step
fails exits (:class:`RankFailed`) rather than risk pairing mismatched collectives. Chapter 17
tells the story.
"""

from __future__ import annotations

import multiprocessing
import os
from dataclasses import dataclass

from minisgl.core import Req
from minisgl.distributed.group import (check_tp_size, destroy_tp_group, device_for_rank,
                                       free_loopback_address, init_tp_group)
from minisgl.distributed.peers import failure_reason, group_aborted
from minisgl.message import AbortRequest, Message, UserRequest
from minisgl.models.config import ModelConfig
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.scheduler import Scheduler
from minisgl.utils.counters import SharedCounters
from minisgl.utils.heap import frozen_heap
from minisgl.utils.processes import reporting_readiness, worker_process
from minisgl.utils.queues import ZmqPullQueue, ZmqPushQueue, ipc_address
from minisgl.utils.torch_utils import configure_cpu_threads, resolve_device

class FollowerMessage(Message, family=True):
    """Everything a follower rank receives from rank 0."""


@dataclass(frozen=True)
class RankInput(FollowerMessage):
    """A request rank 0 accepted, or an abort it applied: the follower does the same."""

    message: UserRequest | AbortRequest


@dataclass(frozen=True)
class RankStep(FollowerMessage):
    """Run one step now; ``step`` is rank 0's count of steps before this one."""

    step: int


class RankFailed(BaseException):
    """A step failed on a tensor-parallel rank: this rank cannot go on in step with the others.

    A BaseException, so that the scheduler loop's "fail the step's requests and serve on" (which
    catches ``Exception``) lets it through and the process exits.
    """


@dataclass(frozen=True)
class TPLaunch:
    """What every rank needs to join one tensor-parallel group (picklable: spawn passes it).

    Attributes:
        size: the number of ranks.
        init_address: ``tcp://127.0.0.1:PORT`` where rank 0 listens for the others.
        follower_addrs: the queue rank ``r > 0`` reads its inputs from is ``follower_addrs[r-1]``.
    """

    size: int
    init_address: str
    follower_addrs: tuple[str, ...]

    @classmethod
    def new(cls, size: int) -> TPLaunch:
        """Fresh addresses for a group of ``size`` ranks on this machine."""
        return cls(size, free_loopback_address(),
                   tuple(ipc_address(f"rank{r}") for r in range(1, size)))


def check_tp(model_path: str | os.PathLike[str], size: int) -> None:
    """Refuse, before any process starts, a rank count the checkpoint cannot be split over."""
    config = ModelConfig.from_pretrained(model_path)
    check_tp_size(size, num_qo_heads=config.num_qo_heads, num_kv_heads=config.num_kv_heads,
                  intermediate_size=config.intermediate_size, vocab_size=config.vocab_size)


def join_group(config: SchedulerConfig, launch: TPLaunch, rank: int) -> None:
    """This process becomes rank ``rank`` (before its engine is built: layers read TPInfo)."""
    device = device_for_rank(resolve_device(config.device), rank, launch.size)
    init_tp_group(rank, launch.size, device, launch.init_address)


class RankFollowers:
    """Rank 0's link to the other ranks: the scheduler's ``followers`` under tensor parallelism.

    The leader is a plain :class:`Scheduler` built with this object; every input it accepts,
    every abort and every step also goes, in order, to every follower rank.
    """

    def __init__(self, launch: TPLaunch) -> None:
        self._queues = [ZmqPushQueue(addr, FollowerMessage, bind=False)
                        for addr in launch.follower_addrs]

    def added(self, req: Req) -> None:
        self._tell(RankInput(UserRequest(req.uid, list(req.prompt_ids), req.params)))

    def aborted(self, uid: int) -> None:
        self._tell(RankInput(AbortRequest(uid)))

    def stepping(self, step: int) -> None:
        self._tell(RankStep(step))

    def failed(self, step: int, exc: Exception) -> BaseException:
        return RankFailed(f"step {step} failed on rank 0: {failure_reason(exc)}")

    def _tell(self, message: FollowerMessage) -> None:
        if group_aborted():  # a rank has exited: a queue nobody reads would block once full
            return
        for queue in self._queues:
            queue.put(message)

    def close(self) -> None:
        """Close the queues to the followers and leave the group (they stop on their own
        signal, or when their next collective finds rank 0 gone)."""
        for queue in self._queues:
            queue.close()
        destroy_tp_group()


def start_leader(config: SchedulerConfig, launch: TPLaunch) -> Scheduler:
    """Become rank 0 and build its scheduler; returns once every rank has joined the group."""
    followers = RankFollowers(launch)
    try:
        join_group(config, launch, rank=0)
        return Scheduler(config, followers=followers)
    except BaseException:
        followers.close()
        raise


def run_tp_follower(config: SchedulerConfig, launch: TPLaunch, rank: int,
                    ready: multiprocessing.Queue,
                    stats: SharedCounters | None = None) -> None:
    """Rank ``rank`` (> 0): repeat rank 0's inputs and steps until SIGTERM or SIGINT (or until
    the parent dies).

    Args:
        config: the same settings rank 0 has.
        launch: the group's addresses.
        rank: this rank, in ``[1, launch.size)``.
        ready: the launcher's readiness queue.
        stats: counters named by :func:`follower_counters` for this rank, or None.
    """
    configure_cpu_threads("model", processes=launch.size)  # the ranks share the cores
    name = f"scheduler-rank{rank}"
    with worker_process(name) as signals:
        try:
            with signals.interruptible(), reporting_readiness(ready, name):
                inbox = ZmqPullQueue(launch.follower_addrs[rank - 1], FollowerMessage, bind=True)
                join_group(config, launch, rank)
                scheduler = Scheduler(config)
            with frozen_heap():  # as the leader's loop (scheduler/io.py)
                while not signals.requested:
                    for message in signals.receive(inbox):
                        if isinstance(message, RankInput):
                            apply_input(scheduler, message.message)
                        else:
                            follow_step(scheduler, message, rank)
                    if stats is not None:  # after an abort too: it frees pages without a step
                        stats.update(**scheduler.gauges(f"rank{rank}_"))
        finally:
            destroy_tp_group()


def follow_step(scheduler: Scheduler, message: RankStep, rank: int) -> None:
    """Run the step rank 0 runs, after checking that this rank is where rank 0 is."""
    if message.step != scheduler.num_steps or not scheduler.has_work:
        raise RankFailed(f"rank {rank} has run {scheduler.num_steps} steps and "
                         f"{'has' if scheduler.has_work else 'has no'} work; rank 0 asks for "
                         f"step {message.step}: the ranks no longer agree")
    try:
        scheduler.step()
    except Exception as exc:
        raise RankFailed(f"step {message.step} failed on rank {rank}: "
                         f"{failure_reason(exc)}") from exc


def apply_input(scheduler: Scheduler, message: UserRequest | AbortRequest) -> None:
    """Do what rank 0 did with ``message``: it accepted the request, or applied the abort."""
    if isinstance(message, UserRequest):
        scheduler.add(Req(message.uid, message.input_ids, message.sampling_params))
    else:
        scheduler.abort(message.uid)


def follower_counters(rank: int) -> SharedCounters:
    """The gauges follower ``rank`` publishes (``/metrics`` shows them as
    ``minisgl_rank{rank}_...``)."""
    return SharedCounters((f"rank{rank}_running", f"rank{rank}_waiting",
                           f"rank{rank}_kv_pages_in_use"))

