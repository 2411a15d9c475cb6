"""GPU kernels for the calls of the layers and the attention backend (chapter 20).

Each module holds a kernel beside the plain computation it replaces, and says which:
``flashinfer_ops`` (RMSNorm, RoPE, SiLU-and-multiply), ``gemv`` (one row times a matrix,
with a layer's add-and-norm or the MLP's activation folded into its read, and float32 logits),
``qk_prologue`` (qk-norm, RoPE and the K/V store), ``pieces`` (decode in pieces and their
merge), ``moe`` (the mixture of experts). :data:`KERNELS` answers the layers' seam,
:mod:`minisgl.layers.fast`, which uses it whenever this package is there; :func:`use_fused`
turns the kernels on and off, all of them or step by step (``trials.STEPS``). Everything
imports without a GPU or Triton; a kernel runs only where its ``can_*`` check says so.
"""

from __future__ import annotations

from minisgl.kernel import flashinfer_ops, gemv, moe, pieces, qk_prologue
from minisgl.kernel.trials import op_status, use_fused

OPS = (*flashinfer_ops.OPS, "qk_prologue", "gemv", "pdl")


class Kernels:
    """The kernels' answers to :class:`minisgl.layers.fast.FastPaths`."""

    rmsnorm = staticmethod(flashinfer_ops.rmsnorm)
    rope_inplace = staticmethod(flashinfer_ops.rope_inplace)
    silu_and_mul = staticmethod(flashinfer_ops.silu_and_mul)
    matmul = staticmethod(gemv.matmul)
    gated_matmul = staticmethod(gemv.gated_matmul)
    normed_matmul = staticmethod(gemv.normed_matmul)
    can_qk_prologue = staticmethod(qk_prologue.can_qk_prologue)
    qk_prologue = staticmethod(qk_prologue.qk_prologue)
    can_moe = staticmethod(moe.fused_available)
    moe = staticmethod(moe.moe_fused)
    decode_pieces = staticmethod(pieces.num_decode_pieces)
    cut_into_pieces = staticmethod(pieces.cut_into_pieces)
    merge_pieces = staticmethod(pieces.merge_pieces)


KERNELS = Kernels()


def kernel_status() -> dict[str, str]:
    """Each kernel's state: "on", "not tried yet", or why it runs as PyTorch code."""
    if flashinfer_ops.import_error is not None:
        return {op: f"flashinfer not importable ({flashinfer_ops.import_error})" for op in OPS}
    return {op: op_status(op) for op in OPS}


__all__ = ["KERNELS", "Kernels", "kernel_status", "use_fused"]
