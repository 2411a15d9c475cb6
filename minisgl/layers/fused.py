"""On CUDA, one FlashInfer kernel for each of the layers' small operations.

The layers of this package are written in PyTorch: that code runs on any device, matches
``transformers`` bit for bit in float32, and stays the reference. On a GPU, though, every
PyTorch operation is a kernel of its own, with a launch and a full pass over memory: in bfloat16
RMSNorm is eight kernels (cast, square, mean, add eps, rsqrt, multiply, cast back, scale), RoPE
twenty, the residual add and SiLU-and-multiply three more: 56 per Qwen3 decoder layer, on
tensors so small in a decode step that the kernel count, not the bytes, sets the time.
FlashInfer has one kernel for each operation, which reads its inputs once and writes its
outputs once: six per layer.

This module decides whether those kernels can take a given call and wraps them thinly, so a
layer reads::

    if fused.can_rmsnorm(x, self.weight, residual):
        return fused.rmsnorm(x, self.weight, self.eps, residual)
    ...                                       # the PyTorch code, unchanged

The decision looks at tensor metadata only (device, dtype, shapes, strides, alignment), never
at values, so it costs no host-device synchronisation and a CUDA graph can capture either path.
``flashinfer`` is imported at the first CUDA tensor, not with this module, so everything runs on
machines without it. Each kernel is tried once on a tiny input the first time a call could use
it (FlashInfer may compile it then); a failure turns that kernel off for the process, with one
warning, and its layer runs the PyTorch code instead of crashing. float32 stays on PyTorch:
FlashInfer builds these kernels for float16 and bfloat16 only.

Two of the kernels work in place (the residual-add norm and RoPE). Their layers return the
input tensors, overwritten; callers must use the returned tensors and not reuse the inputs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import NamedTuple

import torch

from minisgl.utils.logger import get_logger

logger = get_logger(__name__)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)  # what the kernels are instantiated for
ROPE_HEAD_DIMS = (64, 128, 256, 512)  # head sizes the rotary kernel is specialised for
ALIGN_BYTES = 16  # the kernels move 16 bytes per load and store
OPS = ("rmsnorm", "fused_add_rmsnorm", "rope", "silu_and_mul", "qk_prologue", "gemv")

_enabled = True
_kernels: SimpleNamespace | None = None
_import_error: str | None = None  # why flashinfer could not be imported, once tried
_import_tried = False
_op_errors: dict[str, str | None] = {}  # op -> None (works) or why it was turned off
_logged: set[str] = set()


def _log_once(key: str, level: int, message: str, *args: object) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.log(level, message, *args)


def available(x: torch.Tensor) -> bool:
    """True when ``x`` may go through FlashInfer: on CUDA, float16/bfloat16, flashinfer present.

    The per-operation checks (:func:`can_rmsnorm`, :func:`can_rope`, :func:`can_silu_and_mul`)
    start here and add what their kernel needs of shapes and strides.
    """
    if not (_enabled and x.is_cuda):
        return False
    if x.dtype not in SUPPORTED_DTYPES:
        _log_once(f"dtype-{x.dtype}", logging.DEBUG, "fused kernels: FlashInfer's norm, RoPE and "
                  "activation kernels do not take %s; those run as PyTorch code", x.dtype)
        return False
    return _load() is not None


def _load() -> SimpleNamespace | None:
    """Import FlashInfer's kernels once; None (logged at debug level) when that fails."""
    global _kernels, _import_error, _import_tried
    if not _import_tried:
        _import_tried = True
        try:
            from flashinfer.activation import silu_and_mul
            from flashinfer.norm import fused_add_rmsnorm, rmsnorm
            from flashinfer.rope import apply_rope_with_cos_sin_cache_inplace
        except Exception as exc:  # noqa: BLE001 - ImportError, or a broken install
            _import_error = f"{type(exc).__name__}: {exc}"
            logger.debug("fused kernels: flashinfer is not importable (%s); norms, RoPE and "
                         "SiLU run as PyTorch code", _import_error)
        else:
            _kernels = SimpleNamespace(
                rmsnorm=rmsnorm, fused_add_rmsnorm=fused_add_rmsnorm,
                rope=apply_rope_with_cos_sin_cache_inplace, silu_and_mul=silu_and_mul)
    return _kernels


def _ready(op: str, like: torch.Tensor) -> bool:
    """Whether kernel ``op`` works, trying it on a tiny input the first time.

    The trial builds or loads the kernel and catches what fails at that point (a compiler or
    library missing on this machine). It is never run inside a CUDA-graph capture: a call that
    comes first there takes the PyTorch path (the engine's warm-up run precedes its captures).
    """
    if op not in _op_errors:
        if torch.cuda.is_current_stream_capturing():
            return False
        try:
            _TRIALS[op](like.device, like.dtype)
        except Exception as exc:  # noqa: BLE001 - whatever fails, fall back to PyTorch
            _op_errors[op] = f"{type(exc).__name__}: {exc}"
            logger.warning("fused kernels: %s failed a first trial (%s); it runs "
                           "as PyTorch code from now on", op, _op_errors[op])
        else:
            _op_errors[op] = None
    return _op_errors[op] is None


def _aligned(t: torch.Tensor) -> bool:
    """Last dimension contiguous, and every row/head starting on a 16-byte boundary."""
    if t.stride(-1) != 1 or t.data_ptr() % ALIGN_BYTES != 0:
        return False
    return all(s * t.element_size() % ALIGN_BYTES == 0 for s in t.stride()[:-1])


def _same_place(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.device == b.device


# ------------------------------------------------------------------------------- RMSNorm

def can_rmsnorm(x: torch.Tensor, weight: torch.Tensor,
                residual: torch.Tensor | None = None) -> bool:
    """Whether :func:`rmsnorm` can take this call.

    Plain form: ``x`` [T, hidden] or [T, heads, head_dim] (qk-norm; any row and head strides,
    so the q and k slices of the fused qkv output need no copy). Residual form: ``x`` and
    ``residual`` two distinct [T, hidden] tensors.
    """
    if not available(x) or x.numel() == 0 or not _same_place(x, weight):
        return False
    if weight.shape != (x.shape[-1],) or not _aligned(weight) or not _aligned(x):
        return False
    if residual is None:
        return x.dim() in (2, 3) and _ready("rmsnorm", x)
    return (x.dim() == 2 and residual.shape == x.shape and _same_place(x, residual)
            and _aligned(residual) and residual.data_ptr() != x.data_ptr()
            and _ready("fused_add_rmsnorm", x))


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            residual: torch.Tensor | None = None
            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm as one kernel: :meth:`RMSNorm.forward <minisgl.layers.norm.RMSNorm.forward>`.

    The plain form writes a new tensor. The residual form works IN PLACE: ``residual``
    becomes ``x + residual``, then ``x`` becomes its normalised value; both are returned.
    """
    assert _kernels is not None, "call can_rmsnorm() first"
    if residual is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        return _kernels.rmsnorm(x, weight, eps=eps, out=out)
    _kernels.fused_add_rmsnorm(x, residual, weight, eps=eps)
    return x, residual


# --------------------------------------------------------------------------------- RoPE

def can_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
             cos_sin_cache: torch.Tensor, head_dim: int) -> bool:
    """Whether :func:`rope_inplace` can take this call.

    The kernel exists for head sizes 64, 128, 256 and 512; it reads ``cos_sin_cache``
    [max_position, rotary_dim] in float32, cos in the first half of a row and sin in the second,
    and moves features in vectors of ``max(16 bytes, head_dim / 32)``, so a partial rotation
    (``rotary_dim < head_dim``) must cover whole vectors in each half.
    """
    if not available(q) or not _same_place(q, k) or q.shape[0] == 0:
        return False
    if head_dim not in ROPE_HEAD_DIMS:
        return False
    vector = max(ALIGN_BYTES // q.element_size(), head_dim // 32)
    if cos_sin_cache.dim() != 2 or (cos_sin_cache.shape[1] // 2) % vector != 0:
        return False
    if (cos_sin_cache.dtype != torch.float32 or cos_sin_cache.device != q.device
            or not cos_sin_cache.is_contiguous()):
        return False
    if (positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64)
            or positions.device != q.device or not positions.is_contiguous()
            or not q.shape[0] == k.shape[0] == positions.shape[0]):
        return False
    if not (_heads_aligned(q, head_dim) and _heads_aligned(k, head_dim)):
        return False
    return _ready("rope", q)


def _heads_aligned(t: torch.Tensor, head_dim: int) -> bool:
    """``t`` seen as [T, heads, head_dim] (as the kernel sees it) is aligned."""
    if t.stride(-1) != 1 or t.shape[-1] % head_dim != 0:
        return False
    try:
        return _aligned(t.view(t.shape[0], -1, head_dim))
    except RuntimeError:  # a layout that cannot be viewed per head without a copy
        return False


def rope_inplace(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 cos_sin_cache: torch.Tensor, head_dim: int) -> None:
    """Rotate ``q`` and ``k`` ([T, H*D] or [T, H, D]) IN PLACE, pairs (i, i + rotary_dim/2)."""
    assert _kernels is not None, "call can_rope() first"
    # is_neox=True is the "rotate half" pairing of Llama/Qwen checkpoints; False would pair
    # neighbours (2i, 2i + 1).
    _kernels.rope(positions, q, k, head_dim, cos_sin_cache, is_neox=True)


# ------------------------------------------------------------------------ SiLU and multiply

def can_silu_and_mul(x: torch.Tensor) -> bool:
    """Whether :func:`silu_and_mul` can take ``x`` [..., 2 * d]: contiguous, whole vectors in d."""
    if not available(x) or x.numel() == 0 or not x.is_contiguous():
        return False
    if x.data_ptr() % ALIGN_BYTES != 0:
        return False
    if (x.shape[-1] // 2) % (ALIGN_BYTES // x.element_size()) != 0:
        return False
    return _ready("silu_and_mul", x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` as one kernel, into a new tensor."""
    assert _kernels is not None, "call can_silu_and_mul() first"
    return _kernels.silu_and_mul(x)


# ------------------------------------------------- qk-norm, RoPE and the K/V store together

def can_qk_prologue(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                    head_dim: int, norm_weights: tuple[torch.Tensor, torch.Tensor] | None
                    ) -> bool:
    """Whether :func:`qk_prologue` can take an attention layer's call.

    The Triton kernel of :mod:`minisgl.layers.qk_prologue` rotates whole heads of a
    power-of-two size (``cos_sin_cache`` [max_position, head_dim], float32) and reads each qkv
    row with unit stride.
    """
    if not (_enabled and qkv.is_cuda and qkv.dtype in SUPPORTED_DTYPES) or qkv.shape[0] == 0:
        return False
    if head_dim & (head_dim - 1) or head_dim < 32 or qkv.dim() != 2 or qkv.stride(1) != 1:
        return False
    if (cos_sin_cache.shape[1] != head_dim or cos_sin_cache.dtype != torch.float32
            or not cos_sin_cache.is_contiguous() or cos_sin_cache.device != qkv.device):
        return False
    if (positions.dim() != 1 or positions.shape[0] != qkv.shape[0]
            or not positions.is_contiguous() or positions.device != qkv.device):
        return False
    if norm_weights is not None and any(not _same_place(w, qkv) or w.shape != (head_dim,)
                                        or not w.is_contiguous() for w in norm_weights):
        return False
    return _ready("qk_prologue", qkv)


class KVDestination(NamedTuple):
    """Where a backend with a KV pool wants one layer's new keys, values and queries.

    The keys and values go into the layer's caches at the tokens' slots. The queries go to
    row ``t`` for token ``t``, unless the backend's kernel reads them in rows of its own: a
    decode batch cut into pieces (:mod:`minisgl.attention.pieces`) reads a request's query
    once per piece, so ``query_rows`` says which rows each token fills.
    """

    k_cache: torch.Tensor  # [slots, Hkv, head_dim]
    v_cache: torch.Tensor
    loc: torch.Tensor  # [T] int64: each new token's slot
    # [T + 1] int32: token t's query fills rows query_rows[t] .. query_rows[t + 1] - 1
    query_rows: torch.Tensor | None = None
    num_query_rows: int = 0  # the rows the attention kernel reads, with query_rows


def can_store_into(k_cache: torch.Tensor, v_cache: torch.Tensor, head_dim: int) -> bool:
    """Whether :func:`qk_prologue` can write into these caches: ``[slots, heads, head_dim]``,
    unit-stride heads, the same slot stride for keys and values."""
    return all(t.is_cuda and t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == head_dim
               and t.stride(0) == k_cache.stride(0) for t in (k_cache, v_cache))


def qk_prologue(qkv: torch.Tensor, positions: torch.Tensor, num_qo_heads: int,
                num_kv_heads: int, head_dim: int, cos_sin_cache: torch.Tensor,
                norm_weights: tuple[torch.Tensor, torch.Tensor] | None, eps: float,
                kv_dst: KVDestination | None
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Split ``qkv``, normalise and rotate q and k, and put k and v where they go: one kernel.

    With ``kv_dst`` the keys and values are written into the pool, the queries into the rows
    it names, and ``(q, None, None)`` is returned; without it the keys and values come back
    as new ``[T, num_kv_heads, head_dim]`` tensors.
    """
    from minisgl.layers.qk_prologue import qk_prologue as launch

    q_weight, k_weight = norm_weights if norm_weights is not None else (None, None)
    if kv_dst is not None:
        q = launch(qkv, positions, num_qo_heads, num_kv_heads, head_dim, cos_sin_cache,
                   q_weight, k_weight, eps, kv_dst.k_cache, kv_dst.v_cache, kv_dst.loc,
                   kv_dst.query_rows, kv_dst.num_query_rows)
        return q, None, None
    shape = (qkv.shape[0], num_kv_heads, head_dim)
    k = torch.empty(shape, dtype=qkv.dtype, device=qkv.device)
    v = torch.empty(shape, dtype=qkv.dtype, device=qkv.device)
    q = launch(qkv, positions, num_qo_heads, num_kv_heads, head_dim, cos_sin_cache, q_weight,
               k_weight, eps, k, v, None)
    return q, k, v


def can_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`gemv` can take ``x @ weight.T``: one row (a batch-1 decode step) on a GPU,
    in 16 bits, both operands contiguous. Larger batches stay with cuBLAS, which is as fast or
    faster from two rows on."""
    if not (_enabled and x.is_cuda and x.dim() == 2 and x.shape[0] == 1):
        return False
    if not (_same_place(x, weight) and x.dtype in SUPPORTED_DTYPES and weight.dim() == 2
            and x.shape[1] == weight.shape[1] and x.is_contiguous() and weight.is_contiguous()):
        return False
    return _ready("gemv", x)


def gemv(x: torch.Tensor, weight: torch.Tensor,
         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ weight.T`` for one row, as one Triton kernel (:mod:`minisgl.layers.gemv`)."""
    from minisgl.layers.gemv import gemv as launch

    return launch(x, weight, out_dtype)


def can_mm_float32(x: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether cuBLAS can write ``x @ W.T`` in float32 from 16-bit operands on this GPU
    (``torch.mm``'s ``out_dtype``, which older versions of torch lack)."""
    if not (_enabled and x.is_cuda and x.dim() == 2 and x.dtype in SUPPORTED_DTYPES):
        return False
    return out_dtype == torch.float32 and _ready("mm_float32", x)


# ---------------------------------------------------------------------- trials and switches

def _trial_rmsnorm(device: torch.device, dtype: torch.dtype) -> None:
    assert _kernels is not None
    weight = torch.ones(64, dtype=dtype, device=device)
    for shape in ((2, 64), (2, 2, 64)):  # the hidden-state and the per-head (qk-norm) forms
        x = torch.zeros(shape, dtype=dtype, device=device)
        _kernels.rmsnorm(x, weight, eps=1e-6, out=torch.empty_like(x))


def _trial_fused_add_rmsnorm(device: torch.device, dtype: torch.dtype) -> None:
    assert _kernels is not None
    x, residual = torch.zeros(2, 2, 64, dtype=dtype, device=device).unbind(0)
    _kernels.fused_add_rmsnorm(x, residual, torch.ones(64, dtype=dtype, device=device), eps=1e-6)


def _trial_rope(device: torch.device, dtype: torch.dtype) -> None:
    assert _kernels is not None
    q = torch.zeros(2, 2 * 64, dtype=dtype, device=device)
    k = torch.zeros(2, 64, dtype=dtype, device=device)
    cache = torch.zeros(4, 64, dtype=torch.float32, device=device)
    positions = torch.zeros(2, dtype=torch.int64, device=device)
    _kernels.rope(positions, q, k, 64, cache, is_neox=True)


def _trial_silu_and_mul(device: torch.device, dtype: torch.dtype) -> None:
    assert _kernels is not None
    _kernels.silu_and_mul(torch.zeros(2, 128, dtype=dtype, device=device))


def _trial_qk_prologue(device: torch.device, dtype: torch.dtype) -> None:
    from minisgl.layers.qk_prologue import qk_prologue as launch

    qkv = torch.zeros(2, 3 * 64, dtype=dtype, device=device)
    cache = torch.zeros(4, 64, dtype=torch.float32, device=device)
    positions = torch.zeros(2, dtype=torch.int64, device=device)
    weight = torch.ones(64, dtype=dtype, device=device)
    k, v = torch.empty(2, 2, 1, 64, dtype=dtype, device=device).unbind(0)
    for norm_weight in (weight, None):  # with qk-norm (Qwen3) and without (Llama, Qwen2)
        launch(qkv, positions, 1, 1, 64, cache, norm_weight, norm_weight, 1e-6, k, v, None)


def _trial_gemv(device: torch.device, dtype: torch.dtype) -> None:
    from minisgl.layers.gemv import gemv as launch

    launch(torch.zeros(1, 64, dtype=dtype, device=device),
           torch.zeros(3, 64, dtype=dtype, device=device))


def _trial_mm_float32(device: torch.device, dtype: torch.dtype) -> None:
    x = torch.zeros(2, 64, dtype=dtype, device=device)
    torch.mm(x, torch.zeros(3, 64, dtype=dtype, device=device).t(), out_dtype=torch.float32)


_TRIALS: dict[str, Callable[[torch.device, torch.dtype], None]] = {
    "rmsnorm": _trial_rmsnorm,
    "fused_add_rmsnorm": _trial_fused_add_rmsnorm,
    "rope": _trial_rope,
    "silu_and_mul": _trial_silu_and_mul,
    "qk_prologue": _trial_qk_prologue,
    "gemv": _trial_gemv,
    "mm_float32": _trial_mm_float32,
}


def kernel_status() -> dict[str, str]:
    """Each operation's state: "on", "not tried yet", or why it runs as PyTorch code."""
    if _import_tried and _kernels is None:
        return {op: f"flashinfer not importable ({_import_error})" for op in OPS}
    status = {}
    for op in OPS:
        if op not in _op_errors:
            status[op] = "not tried yet"
        else:
            error = _op_errors[op]
            status[op] = "on" if error is None else f"off ({error})"
    return status


@contextlib.contextmanager
def use_fused(enabled: bool) -> Iterator[None]:
    """Turn the fused kernels on or off inside the ``with`` block (process-wide).

    ``use_fused(False)`` runs the PyTorch code on CUDA too: the reference the GPU tests compare
    the kernels with, and a way to measure what the kernels save.
    """
    global _enabled
    previous, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = previous
