"""The tensor-parallel process group: how ranks find each other and what they send each other.

The layers read two numbers (``TPInfo``) and call one hook (``all_reduce``); this module makes
them real with ``torch.distributed``: a rendezvous at ``tcp://127.0.0.1:PORT`` that fails as
soon as a rank has exited (:mod:`.peers`), gloo on the CPU and NCCL on GPUs (rank ``r`` on
``cuda:r``), the sum the layers need, and the two the engine needs (:func:`min_over_ranks` for
the KV budget, :func:`broadcast_from_rank0` for the sampled tokens). It sits below ``layers``:
it knows tensors and processes, not models or requests. Chapter 17 tells the story.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from minisgl.distributed.info import TPInfo, get_tp_info, set_all_reduce, set_tp_info
from minisgl.distributed.peers import check_not_aborted, rendezvous, stop_watching, watch_peers
from minisgl.utils.checks import check_int
from minisgl.utils.logger import get_logger

logger = get_logger(__name__)

# A rank that waits longer than this in the rendezvous or in one collective gives up with an
# error instead of hanging for ever (a peer alive but stuck for good). A peer that exits is not
# waited for: the watch of peers.py aborts the group at once.
COLLECTIVE_TIMEOUT_S = 600.0


def free_loopback_address() -> str:
    """``tcp://127.0.0.1:PORT`` with a port nobody listens on now (rank 0 binds it a moment
    later). Every rank runs on this machine: loopback keeps the group off the network."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def device_for_rank(device: torch.device, rank: int, size: int) -> torch.device:
    """The device rank ``rank`` of ``size`` computes on: the CPU for every rank, or GPU ``rank``.

    Raises:
        ValueError: more ranks than visible GPUs, or a GPU index given with more than one rank
            (each rank takes its own GPU: ``cuda``, not ``cuda:N``).
    """
    if device.type != "cuda":
        return device
    if size == 1:  # NCCL binds a rank to one numbered GPU: "cuda" means the current one
        return device if device.index is not None else torch.device(
            "cuda", torch.cuda.current_device())
    if device.index is not None:
        raise ValueError(f"device {device} names one GPU, but {size} tensor-parallel ranks need "
                         f"one GPU each: pass device 'cuda' (rank r uses cuda:r)")
    visible = torch.cuda.device_count()
    if size > visible:
        raise ValueError(f"tensor parallelism over {size} ranks needs {size} GPUs; "
                         f"{visible} visible here (CUDA_VISIBLE_DEVICES decides which)")
    return torch.device("cuda", rank)


def check_tp_size(size: int, *, num_qo_heads: int, num_kv_heads: int, intermediate_size: int,
                  vocab_size: int) -> None:
    """Refuse a rank count that the model's shapes cannot be split over, naming the shape.

    Query heads and the MLP's width must divide evenly; KV heads either divide or are fewer
    than the ranks, which must then be a multiple of them (each KV head is copied to a run of
    ranks). The vocabulary never needs to divide: its last block is padded.
    """
    check_int("tp", size, at_least=1)
    problems = []
    if num_qo_heads % size:
        problems.append(f"its {num_qo_heads} attention heads")
    if intermediate_size % size:
        problems.append(f"its MLP width of {intermediate_size}")
    if num_kv_heads % size and size % num_kv_heads:
        problems.append(f"its {num_kv_heads} KV heads (nor is {size} a multiple of them)")
    if size > vocab_size:
        problems.append(f"its vocabulary of {vocab_size}")
    if problems:
        raise ValueError(f"tp={size} cannot split this model: {size} does not divide "
                         f"{' or '.join(problems)}; a tp that divides {num_qo_heads} "
                         "(and the MLP width) works")


def init_tp_group(rank: int, size: int, device: torch.device, init_address: str) -> TPInfo:
    """Join the group of ``size`` ranks as ``rank``; set this process's ``TPInfo`` and
    register the all-reduce the layers call. Blocks until every rank has joined.

    ``device`` is this rank's (from :func:`device_for_rank`); it picks the backend: NCCL for a
    GPU, gloo for the CPU.
    """
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a tensor-parallel group; "
                           "call destroy_tp_group() first")
    info = TPInfo(rank=rank, size=size)  # checks 0 <= rank < size
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL binds each rank's communicator to its GPU
    # Our own rendezvous, not torch's: it gives up at once when a rank exits before joining.
    store, pids = rendezvous(rank, size, init_address, COLLECTIVE_TIMEOUT_S)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
                            **({"device_id": device} if device.type == "cuda" else {}))
    watch_peers(pids, rank)  # from now on a rank that exits aborts the group
    set_tp_info(rank, size)
    set_all_reduce(_sum_over_ranks)
    # One collective now: a broken group fails here, at start-up, and NCCL sets up its
    # communicator before any CUDA graph could try to capture that.
    if min_over_ranks(rank) != 0:
        raise RuntimeError("the tensor-parallel group does not add up: rank 0 is missing")
    logger.info("rank %d of %d joined the tensor-parallel group (%s on %s)", rank, size,
                backend, device)
    return info


def _sum_over_ranks(x: torch.Tensor) -> torch.Tensor:
    """The layers' all-reduce: ``x`` summed element-wise over the ranks, in place."""
    x = x.contiguous()  # collectives need one flat block of memory (x itself if it is one)
    check_not_aborted()
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def destroy_tp_group() -> None:
    """Leave the group; this process is a single rank again (``TPInfo(0, 1)``, no hook)."""
    stop_watching()
    if dist.is_initialized():
        dist.destroy_process_group()
    set_all_reduce(None)
    set_tp_info(0, 1)


def min_over_ranks(value: int) -> int:
    """The smallest ``value`` any rank passed (every rank must call it)."""
    if get_tp_info().size == 1:
        return value
    # NCCL reduces on this rank's GPU (init_tp_group made it the current one), gloo on the CPU
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.int64, device=device)
    check_not_aborted()
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def broadcast_from_rank0(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``x`` on every rank (in place; every rank passes a tensor of the same shape)."""
    if get_tp_info().size > 1:
        check_not_aborted()
        dist.broadcast(x, src=0)
    return x
