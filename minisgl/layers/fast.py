"""The one seam through which the layers and the attention backend reach faster kernels.

The layers and backends are complete without it: plain PyTorch (and FlashInfer's attention)
that runs anywhere and is the reference. Each caller first offers its call to :data:`paths`,
and runs its own code when the answer is None, False or 0 ("no kernel takes this call").
:class:`PlainPaths`, the answer without ``minisgl/kernel/``, takes none. Chapter 20's package
``minisgl.kernel`` answers with GPU kernels, each beside the plain code it replaces; it is
used whenever it is there and a CUDA GPU is. :class:`KVDestination` and :class:`QueryRows` are what a fused
prologue and a decode cut into pieces exchange with the backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np
import torch

Pieces = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


@dataclass
class QueryRows:
    """A kernel that reads the queries in rows of its own: row ``r`` holds the query of token
    ``owners[r]``. A decode batch cut into pieces is one: each piece of a request is a row
    with the request's query."""

    owners: torch.Tensor  # [R] int32, device: the token whose query each row holds
    indptr: torch.Tensor  # [T + 1] int32, device: token t's rows are indptr[t] .. indptr[t+1]-1


class KVDestination(NamedTuple):
    """Where a backend with a KV pool wants one layer's new keys, values and queries.

    The keys and values go into the layer's caches at the tokens' slots; the queries to row
    ``t`` for token ``t``, or to the rows ``query_rows`` names when the kernel reads them so.
    The fields stay in this order: the qk prologue kernel unpacks them as its arguments.
    """

    k_cache: torch.Tensor  # [slots, Hkv, head_dim]
    v_cache: torch.Tensor
    loc: torch.Tensor  # [T] int64: each new token's slot
    # [T + 1] int32: token t's query fills rows query_rows[t] .. query_rows[t + 1] - 1
    query_rows: torch.Tensor | None = None
    num_query_rows: int = 0  # the rows the attention kernel reads, with query_rows


class FastPaths(Protocol):
    """The calls a kernel may take over. These bodies are the plain answers: none taken."""

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                residual: torch.Tensor | None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        return None  # RMSNorm.forward, in place with a residual

    def rope_inplace(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_dim: int) -> bool:
        return False  # RotaryEmbedding.forward, rotating q and k in place

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        return None

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None,
               out: torch.Tensor | None = None) -> torch.Tensor | None:
        return None  # x @ weight.T in out_dtype (into out, when given)

    def gated_matmul(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        return None  # (silu(gate) * up) @ weight.T for x = [gate | up]: the MLP's down_proj

    def normed_matmul(self, x: torch.Tensor, residual: torch.Tensor | None,
                      norm_weight: torch.Tensor, eps: float, weight: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None  # (rmsnorm(x + residual) @ weight.T, x + residual): see linear.normed_linear

    def can_qk_prologue(self, qkv: torch.Tensor, positions: torch.Tensor,
                        cos_sin_cache: torch.Tensor, head_dim: int,
                        norm_weights: tuple[torch.Tensor, torch.Tensor] | None) -> bool:
        return False  # split, qk-norm, RoPE (and the K/V store) of AttentionLayer as one kernel

    def qk_prologue(self, qkv: torch.Tensor, positions: torch.Tensor, num_qo_heads: int,
                    num_kv_heads: int, head_dim: int, cos_sin_cache: torch.Tensor,
                    norm_weights: tuple[torch.Tensor, torch.Tensor] | None, eps: float,
                    kv_dst: KVDestination | None
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        raise NotImplementedError("no qk prologue kernel: check can_qk_prologue first")

    def can_moe(self, x: torch.Tensor) -> bool:
        return False  # the mixture of experts of moe_grouped, as kernels

    def moe(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
            expert_ids: torch.Tensor, weights: torch.Tensor,
            silu_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError("no mixture-of-experts kernel: check can_moe first")

    def decode_pieces(self, batch_size: int) -> int:
        return 0  # how many pieces a decode batch is cut into; 0: one entry per request

    def cut_into_pieces(self, num_pages: np.ndarray, last_page_lens: np.ndarray,
                        page_size: int, num_pieces: int) -> Pieces:
        raise NotImplementedError("decode is cut into pieces only where decode_pieces says so")

    def merge_pieces(self, out: torch.Tensor, lse: torch.Tensor,
                     piece_indptr: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("decode is cut into pieces only where decode_pieces says so")


class PlainPaths(FastPaths):
    """The plain answers: every caller runs its own PyTorch code."""


def _kernels_or_plain() -> FastPaths:
    if not torch.cuda.is_available():  # every kernel needs a CUDA GPU: none would take a call
        return PlainPaths()
    try:
        from minisgl.kernel import KERNELS
    except ModuleNotFoundError as exc:
        if exc.name != "minisgl.kernel":
            raise  # the package is there but broken: say so, do not hide it
        return PlainPaths()
    return KERNELS


paths: FastPaths = _kernels_or_plain()
