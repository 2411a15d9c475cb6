"""Small helpers that turn user-facing strings into torch devices and dtypes, and share the CPU.

The command line, the ``LLM`` class and the examples all accept ``--device auto|cpu|cuda`` and
``--dtype auto|float32|bfloat16|float16``. These functions are the one place where those
strings are checked and given a meaning, so every entry point rejects a typo the same way.

:func:`configure_cpu_threads` is the one place that decides how many threads torch may use in
a process. Left alone, torch starts a thread per core in *every* process; the server runs four
processes, and a laptop always has something else running, so the threads would fight over
the cores and each small operation would wait for the slowest of them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Literal

import torch

from minisgl.env import read_env
from minisgl.utils.logger import get_logger

logger = get_logger(__name__)

DEVICE_CHOICES = ("auto", "cpu", "cuda")
DTYPE_CHOICES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                          "float16": torch.float16}
# Spellings that configs and users also write for the same three dtypes.
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                  "half": "float16"}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """Turn ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` into a ``torch.device``.

    ``"auto"`` picks the first CUDA GPU when one is visible and the CPU otherwise. Asking for
    CUDA on a machine without it is an error rather than a silent fallback, because the user
    would otherwise measure the wrong thing.
    """
    device = str(device)  # a torch.device prints as "cuda:1"
    name = device.strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available here; "
                             "use --device cpu (or auto)")
        resolved = torch.device(name)
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} requested but only "
                             f"{torch.cuda.device_count()} CUDA device(s) are visible")
        return resolved
    raise ValueError(f"unknown device {device!r}; expected one of {', '.join(DEVICE_CHOICES)} "
                     "(or cuda:N)")


def resolve_dtype(dtype: str | torch.dtype = "auto",
                  device: str | torch.device = "cpu") -> torch.dtype:
    """Turn ``"auto"``, ``"float32"``, ``"bfloat16"`` or ``"float16"`` into a ``torch.dtype``.

    ``"auto"`` means float32 on the CPU (exact comparisons with the reference, and CPUs are not
    faster in half precision) and bfloat16 on CUDA (half the memory traffic, the format the
    released checkpoints were trained in).
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPE_CHOICES.values():
            raise ValueError(f"unsupported dtype {dtype}; expected one of "
                             f"{', '.join(DTYPE_CHOICES)}")
        return dtype
    name = dtype.strip().lower()
    name = _DTYPE_ALIASES.get(name, name)
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name in DTYPE_CHOICES:
        return DTYPE_CHOICES[name]
    raise ValueError(f"unknown dtype {dtype!r}; expected one of auto, {', '.join(DTYPE_CHOICES)}")


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Temporarily make ``dtype`` the dtype of newly created floating-point tensors.

    Building a model inside ``with torch.device(d), default_dtype(t):`` allocates every
    parameter directly on ``d`` in ``t``: no float32 copy on the CPU that is then converted.
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``, copied without the host waiting for the device's queue.

    From ordinary (pageable) memory the driver may first wait for every kernel queued before
    the copy, which would make the host take turns with the device again. So on a GPU the
    array is staged in pinned memory, from which the copy runs asynchronously; PyTorch keeps
    that staging buffer until the copy has run. On a CPU the tensor is returned as it is.
    """
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


ThreadRole = Literal["model", "helper"]
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "<quota> <period>" or "max ..."


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by a container's CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = CGROUP_CPU_MAX.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(quota) // int(period)))
    except (OSError, ValueError):  # no cgroup v2 file, or one we cannot read: no quota
        pass
    return max(1, cores)


def choose_cpu_threads(role: ThreadRole, environ: Mapping[str, str] | None = None,
                       cores: int | None = None, processes: int = 1) -> tuple[int, str]:
    """How many torch threads a process of ``role`` should use, and why (for the log).

    - ``"helper"`` (the server's tokenizer, detokenizer and API processes, the shell): one.
      They tokenize and route messages; a thread per core would only compete with the model;
    - ``"model"`` (the process that runs the model): ``MINISGL_CPU_THREADS`` if set, else
      ``OMP_NUM_THREADS`` if set, else one less than the usable cores, at least one. The core
      left over is for everything else: the helpers, the client, the browser the reader has
      open. A parallel step waits for its slowest thread, so a thread that has to share its
      core with another busy process slows every step down; one thread fewer costs little.
      With ``processes`` model processes (the ranks of tensor parallelism) they split those
      cores between them.
    """
    if role not in ("model", "helper"):
        raise ValueError(f"unknown thread role {role!r}; expected 'model' or 'helper'")
    environ = os.environ if environ is None else environ
    if role == "helper":
        return 1, "a helper process: one thread"
    chosen = read_env(environ).cpu_threads
    if chosen:
        return chosen, "MINISGL_CPU_THREADS"
    omp = environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) >= 1:
        return int(omp), "OMP_NUM_THREADS"
    cores = usable_cores() if cores is None else cores
    why = f"{cores} usable core(s), one left for the other processes"
    if processes > 1:
        why += f", the rest shared by {processes} ranks"
    return max(1, (cores - 1) // processes), why


def configure_cpu_threads(role: ThreadRole = "model", processes: int = 1) -> int:
    """Set this process's torch threads for ``role`` (:func:`choose_cpu_threads`) and log it.

    Entry points call it once, before any work: the scheduler process, ``LLM``, the launcher
    and the shell, every example.
    """
    threads, why = choose_cpu_threads(role, processes=processes)
    torch.set_num_threads(threads)
    level = "info" if role == "model" else "debug"
    getattr(logger, level)("CPU threads: %d (%s; MINISGL_CPU_THREADS or OMP_NUM_THREADS "
                           "sets it)", threads, why)
    return threads
