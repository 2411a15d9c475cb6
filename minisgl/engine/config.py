"""The engine's settings, checked once, where they come in.

An :class:`EngineConfig` says which checkpoint to run, where, in which dtype and with which
attention backend, how the paged KV cache is shaped and sized, how many requests may run at
once, and whether decode steps are captured as CUDA graphs. Every value is checked
when the config is made, with an error that names the field, the value and what is allowed, so
a typo in a flag fails at start-up instead of deep inside a forward pass.

Values that depend on the machine (``device="cuda"`` on a machine without CUDA, a memory budget
too small for one page) are checked by the engine when it starts, because only then are they
known.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

import torch

from minisgl.attention import ATTENTION_BACKENDS
from minisgl.env import read_env
from minisgl.utils.checks import check_int, is_number
from minisgl.utils.torch_utils import DEVICE_CHOICES, resolve_dtype

# Upstream mini-sglang and SGLang capture decode graphs up to 256 requests on large GPUs:
# beyond that a decode step is long enough that the launch overhead a graph saves is noise.
DEFAULT_CUDA_GRAPH_MAX_BS = 256


@dataclass(frozen=True)
class EngineConfig:
    """Everything :class:`~minisgl.engine.engine.Engine` needs to start.

    Attributes:
        model_path: a checkpoint directory (or a hub id, resolved by ``load_model``).
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        dtype: ``auto`` (float32 on CPU, bfloat16 on CUDA), ``float32``, ``bfloat16`` or
            ``float16``: the model's weights and activations, and the KV pool.
        attention_backend: ``auto``, ``torch`` or ``flashinfer``.
        page_size: token slots per KV page. 1 (the default, as upstream) lets a prefix cache
            share any prefix; larger pages make the page table shorter.
        memory_fraction: CUDA only: the share of the GPU memory left free *after the model is
            loaded* that the KV pool takes. The rest is headroom for activations, the
            attention backend's workspace and CUDA graphs.
        cpu_kv_memory: CPU only: bytes for the KV pool. A CPU has no free-memory query worth
            trusting (the OS would swap before refusing), so the budget is a setting; ``None``
            reads ``MINISGL_CPU_KV_MEMORY`` (default 256 MiB).
        num_pages: a fixed number of KV pages, overriding both budgets (tests and small runs).
        max_running_reqs: page-table rows: the most requests that hold KV pages at once.
        max_seq_len: the longest sequence (prompt + output) one request may reach; ``None``
            means the model's ``max_position_embeddings``. The engine lowers it to what the
            pool can hold.
        cuda_graph: capture decode steps as CUDA graphs where possible (a CUDA
            device and an attention backend that supports it). False runs every step eagerly.
        cuda_graph_max_bs: the largest decode batch replayed as a graph; bigger
            batches run eagerly. ``None`` means ``min(max_decode_entries, 256)``: the
            running requests, or more entries where a scheduler speculates (chapter 23).
        cuda_graph_batch_sizes: the exact batch sizes to capture, overriding the
            default list built from ``cuda_graph_max_bs``.
        fixed_plans: FlashInfer only: decode plans that depend on the batch size alone, so a
            captured size is planned once (a draft model's engine, chapter 23; see
            :class:`~minisgl.attention.fi.FlashInferBackend`).
    """

    model_path: str | os.PathLike[str]
    device: str | torch.device = "auto"
    dtype: str | torch.dtype = "auto"
    attention_backend: str = "auto"
    page_size: int = 1
    memory_fraction: float = 0.9
    cpu_kv_memory: int | None = None
    num_pages: int | None = None
    max_running_reqs: int = 256
    max_seq_len: int | None = None
    # CUDA graphs
    cuda_graph: bool = True
    cuda_graph_max_bs: int | None = None
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    fixed_plans: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.model_path, (str, os.PathLike)) or not str(self.model_path):
            raise ValueError(f"model_path must be a checkpoint directory or hub id, "
                             f"got {self.model_path!r}")
        _check_choice("device", str(self.device), DEVICE_CHOICES, allow_cuda_index=True)
        resolve_dtype(self.dtype)  # raises a ValueError naming the bad dtype and the choices
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if not (is_number(self.memory_fraction) and math.isfinite(self.memory_fraction)
                and 0 < self.memory_fraction < 1):
            raise ValueError(f"memory_fraction must be a number in (0, 1), the share of free "
                             f"GPU memory the KV cache takes; got {self.memory_fraction!r}")
        if self.cpu_kv_memory is None:  # the environment is read once, here, at the edge
            object.__setattr__(self, "cpu_kv_memory", read_env().cpu_kv_memory)
        for name in ("page_size", "cpu_kv_memory", "max_running_reqs"):
            check_int(name, getattr(self, name), at_least=1)
        for name in ("num_pages", "max_seq_len", "cuda_graph_max_bs"):  # None: worked out later
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), at_least=1)
        for name in ("cuda_graph", "fixed_plans"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.cuda_graph_batch_sizes is not None:
            sizes = tuple(self.cuda_graph_batch_sizes)
            if not sizes:
                raise ValueError("cuda_graph_batch_sizes must name at least one batch size; "
                                 "to turn graphs off set cuda_graph=False")
            for size in sizes:
                check_int("cuda_graph_batch_sizes entry", size, at_least=1)
            object.__setattr__(self, "cuda_graph_batch_sizes", tuple(sorted(set(sizes))))
            if self.cuda_graph_batch_sizes[-1] > self.max_running_reqs:
                raise ValueError(f"cuda_graph_batch_sizes {list(self.cuda_graph_batch_sizes)} "
                                 f"go beyond max_running_reqs ({self.max_running_reqs}): a "
                                 "decode batch never has more requests than that")

    @property
    def graph_max_bs(self) -> int:
        """The largest decode batch a CUDA graph is captured for."""
        if self.cuda_graph_batch_sizes is not None:
            return self.cuda_graph_batch_sizes[-1]
        return min(self.cuda_graph_max_bs or DEFAULT_CUDA_GRAPH_MAX_BS, self.max_decode_entries)

    @property
    def max_decode_entries(self) -> int:
        """The most entries a decode-shaped pass has: one per running request."""
        return self.max_running_reqs


def _check_choice(name: str, value: object, choices: tuple[str, ...],
                  allow_cuda_index: bool = False) -> None:
    text = value.strip().lower() if isinstance(value, str) else ""
    if text not in choices and not (allow_cuda_index and re.fullmatch(r"cuda:\d+", text)):
        extra = " (or cuda:N)" if allow_cuda_index else ""
        raise ValueError(f"{name} must be one of {', '.join(choices)}{extra}; got {value!r}")
