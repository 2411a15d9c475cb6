"""One scheduler per rank: rank 0 decides nothing alone, it only hears first.

Under tensor parallelism every rank holds a slice of every layer, so every forward pass needs
every rank, in step: the same requests, in the same batch, with their tokens in the same KV
pages (a page number is an index into each rank's own slice of the pool). Instead of one
scheduler that tells the others what to do each step, each rank runs its own copy of the
scheduler and they are kept identical by giving them identical inputs:

- only rank 0 talks to the outside (the tokenizers, the detokenizer, ``LLM``'s caller). Each
  request it accepts and each abort it applies is passed on, in order, to every other rank
  (:class:`TPLeaderScheduler`), over a ZMQ queue per follower;
- before each of its steps rank 0 sends a :class:`RankStep`; a follower runs one step when it
  gets one (:func:`run_tp_follower`), and checks that it counts the same steps;
- the scheduler is deterministic given its inputs, and every rank's KV pool has the same
  number of pages (the engine takes the smallest any rank can hold), so every rank admits,
  batches, pages and retires alike;
- rank 0 samples and broadcasts its tokens (``Engine.sample``), so the requests' outputs, and
  with them every later decision, agree too.

Only rank 0 replies. A follower publishes its own gauges (``rank1_kv_pages_in_use`` ...), so
``/metrics`` shows that every rank frees what it held.

A failed step cannot be answered and forgotten here, as ``scheduler.io`` does with one rank: the
ranks may have stopped at different collectives, and the next step would pair one rank's
all-reduce with another's broadcast. A rank whose step fails exits (:class:`RankFailed`); the
others' next collective then fails as well, and the API server, seeing its processes gone,
answers every waiting request with 503.
"""

from __future__ import annotations

import multiprocessing
import os
from dataclasses import dataclass

from minisgl.core import Req
from minisgl.distributed.group import (
    check_tp_size,
    destroy_tp_group,
    device_for_rank,
    free_loopback_address,
    init_tp_group,
)
from minisgl.distributed.peers import failure_reason, group_aborted
from minisgl.message import AbortRequest, BackendMessage, Message, UserRequest
from minisgl.models.config import ModelConfig
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.overlap import OverlapScheduler
from minisgl.scheduler.utils import StepResult
from minisgl.utils.logger import get_logger
from minisgl.utils.counters import SharedCounters
from minisgl.utils.heap import frozen_heap
from minisgl.utils.processes import ShutdownRequested, ShutdownSignals, reporting_readiness
from minisgl.utils.queues import ZmqPullQueue, ZmqPushQueue, close_queues, ipc_address
from minisgl.utils.torch_utils import configure_cpu_threads, resolve_device

logger = get_logger(__name__)


class FollowerMessage(Message, family=True):
    """Everything a follower rank receives from rank 0."""


@dataclass(frozen=True)
class RankInput(FollowerMessage):
    """A request rank 0 accepted, or an abort it applied: the follower does the same."""

    message: BackendMessage


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


class TPLeaderScheduler(OverlapScheduler):
    """Rank 0's scheduler: an :class:`OverlapScheduler` that repeats its inputs to the others.

    Whoever drives it (``LLM``, or the scheduler process's ``SchedulerIO``) uses it as any
    scheduler; every accepted ``add``, every ``abort`` and every ``step`` also goes, in order,
    to every follower rank.
    """

    def __init__(self, config: SchedulerConfig, launch: TPLaunch) -> None:
        self._followers = [ZmqPushQueue(addr, FollowerMessage, bind=False)
                           for addr in launch.follower_addrs]
        try:
            join_group(config, launch, rank=0)
            super().__init__(config)
        except BaseException:
            self.close()
            raise

    def add(self, req: Req) -> None:
        super().add(req)  # raises for a request it refuses: the followers never see it
        # The request as it came in: a follower's own add() makes the same adjustments.
        self._tell(RankInput(UserRequest(req.uid, list(req.prompt_ids), req.params)))

    def abort(self, uid: int) -> Req | None:
        dropped = super().abort(uid)
        self._tell(RankInput(AbortRequest(uid)))
        return dropped

    def step(self) -> StepResult:
        self._tell(RankStep(self.num_steps))
        try:
            return super().step()
        except Exception as exc:
            raise RankFailed(f"step {self.num_steps} failed on rank 0: "
                             f"{failure_reason(exc)}") from exc

    def _tell(self, message: FollowerMessage) -> None:
        if group_aborted():  # a rank has exited: a queue nobody reads would block once full
            return
        for queue in self._followers:
            queue.put(message)

    def close(self) -> None:
        """Close the queues to the followers and leave the group (they stop on their own
        signal, or when their next collective finds rank 0 gone)."""
        for queue in self._followers:
            queue.close()
        destroy_tp_group()


def run_tp_follower(config: SchedulerConfig, launch: TPLaunch, rank: int,
                    ready: multiprocessing.Queue | None = None,
                    stats: SharedCounters | None = None) -> None:
    """Rank ``rank`` (> 0): repeat rank 0's inputs and steps until SIGTERM or SIGINT (or until
    the parent dies).

    Args:
        config: the same settings rank 0 has.
        launch: the group's addresses.
        rank: this rank, in ``[1, launch.size)``.
        ready: the launcher's readiness queue, or None.
        stats: counters named by :func:`follower_counters` for this rank, or None.
    """
    configure_cpu_threads("model", processes=launch.size)  # the ranks share the cores
    signals = ShutdownSignals()
    inbox = None
    try:
        with signals.interruptible(), reporting_readiness(ready, f"scheduler-rank{rank}"):
            inbox = ZmqPullQueue(launch.follower_addrs[rank - 1], FollowerMessage, bind=True)
            join_group(config, launch, rank)
            scheduler = OverlapScheduler(config)
        with frozen_heap():  # as the leader's loop (scheduler/io.py)
            while not signals.requested:
                message = signals.receive(inbox)
                if isinstance(message, RankInput):
                    apply_input(scheduler, message.message)
                else:
                    follow_step(scheduler, message, rank)
                publish_follower(scheduler, stats, rank)  # an abort frees pages without a step
    except ShutdownRequested:
        pass
    finally:
        close_queues(inbox)
        destroy_tp_group()
    logger.info("scheduler rank %d stopped", rank)


def follow_step(scheduler: OverlapScheduler, message: RankStep, rank: int) -> None:
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


def apply_input(scheduler: OverlapScheduler, message: BackendMessage) -> None:
    """Do what rank 0 did with ``message``: it accepted the request, or applied the abort."""
    if isinstance(message, UserRequest):
        scheduler.add(Req(message.uid, message.input_ids, message.sampling_params))
    elif isinstance(message, AbortRequest):
        scheduler.abort(message.uid)
    else:
        raise TypeError(f"a follower rank cannot apply a {type(message).__name__}")


def follower_counters(rank: int) -> SharedCounters:
    """The gauges follower ``rank`` publishes (``/metrics`` shows them as
    ``minisgl_rank{rank}_...``)."""
    return SharedCounters((f"rank{rank}_running", f"rank{rank}_waiting",
                           f"rank{rank}_kv_pages_in_use"))


def publish_follower(scheduler: OverlapScheduler, stats: SharedCounters | None,
                     rank: int) -> None:
    if stats is None:
        return
    stats.update(**{
        f"rank{rank}_running": scheduler.num_running,
        f"rank{rank}_waiting": scheduler.num_waiting,
        f"rank{rank}_kv_pages_in_use": scheduler.cache.pages_held_by_requests,
    })
