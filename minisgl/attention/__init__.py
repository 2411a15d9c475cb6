"""Attention backends: paged attention over the KV pool for batches of requests.

- ``base``: the batch description (:class:`BatchLayout`), the per-batch
  :class:`AttnMetadata` and :class:`BaseAttnBackend` (``prepare`` once per batch, ``forward``
  once per layer).
- ``torch_native``: :class:`TorchNativeBackend`, gathers the pages and attends in PyTorch; runs
  on CPU and GPU.
- ``fi``: ``FlashInferBackend``, FlashInfer's fused paged kernels (CUDA), with the fixed
  buffers CUDA-graph decode needs.
- ``utils``: indptr arrays and the other small pieces of a ragged batch's description.

:func:`create_attention_backend` picks one by name; ``"auto"`` takes FlashInfer where it can run
and the torch backend everywhere else.
"""

from __future__ import annotations

import importlib.util

import torch

from minisgl.attention.base import (AttnMetadata, BaseAttnBackend, BatchLayout, layout_of,
                                    pad_batch, total_lens)
from minisgl.attention.torch_native import TorchNativeBackend
from minisgl.kvcache.mha_pool import MHAKVPool
from minisgl.kvcache.page_table import PageTable
from minisgl.utils.logger import get_logger

logger = get_logger(__name__)

ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")


def resolve_attention_backend(name: str, device: torch.device, dtype: torch.dtype,
                              head_dim: int) -> str:
    """Turn ``"auto"``, ``"torch"`` or ``"flashinfer"`` into the backend that will run.

    ``"auto"`` chooses FlashInfer when the pool is on a GPU, FlashInfer is installed and it
    supports the dtype and head size; otherwise the torch backend, which runs everywhere.
    Naming ``"flashinfer"`` explicitly where it cannot run is an error, never a silent
    fallback: whoever asked for it would otherwise measure the wrong thing.
    """
    from minisgl.attention.fi import check_flashinfer_supports, import_flashinfer

    choice = name.strip().lower() if isinstance(name, str) else name
    if choice not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of "
                         f"{', '.join(ATTENTION_BACKENDS)}")
    if choice == "torch":
        return "torch"
    if choice == "flashinfer":
        check_flashinfer_supports(device, dtype, head_dim)
        import_flashinfer()  # fail here, with the install hint, rather than mid-construction
        return "flashinfer"
    try:  # auto
        check_flashinfer_supports(device, dtype, head_dim)
    except ValueError as why:
        if device.type == "cuda":  # on a CPU the torch backend is simply the only choice
            logger.info("attention backend: torch (%s)", why)
        return "torch"
    if importlib.util.find_spec("flashinfer") is None:
        logger.info("attention backend: torch (flashinfer is not installed)")
        return "torch"
    return "flashinfer"


def create_attention_backend(name: str, kv_pool: MHAKVPool, page_table: PageTable,
                             num_qo_heads: int, fixed_plans: bool = False) -> BaseAttnBackend:
    """Build the attention backend ``name`` (``auto``, ``torch`` or ``flashinfer``) over the pool.

    ``num_qo_heads`` is the number of query heads on this device (this rank's share under
    tensor parallelism); the KV head count and head size are read from the pool.
    ``fixed_plans`` is FlashInfer's (see ``FlashInferBackend``); the torch backend plans nothing.
    """
    if resolve_attention_backend(name, kv_pool.device, kv_pool.dtype, kv_pool.head_dim) == "torch":
        return TorchNativeBackend(kv_pool, page_table, num_qo_heads)
    from minisgl.attention.fi import FlashInferBackend  # imports flashinfer itself

    return FlashInferBackend(kv_pool, page_table, num_qo_heads, fixed_plans=fixed_plans)


__all__ = [
    "ATTENTION_BACKENDS", "AttnMetadata", "BaseAttnBackend", "BatchLayout", "TorchNativeBackend",
    "create_attention_backend", "layout_of", "pad_batch", "resolve_attention_backend",
    "total_lens",
]
