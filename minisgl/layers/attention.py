"""Attention: the layer every model uses, and the backend seam that computes it.

The attention *layer* is the same in every chapter: split the fused qkv projection into
queries, keys and values, normalise them (Qwen3's qk-norm), rotate them (RoPE), and hand them
to the attention *backend*, which decides where keys and values live:

* :class:`DenseCausalAttention` treats the whole input as one sequence and keeps nothing: the
  model computes logits for a prompt, which is all a comparison with transformers needs;
* a contiguous KV cache (:class:`~minisgl.engine.simple_loop.ContiguousKVCache`) lets generation
  skip the past;
* the paged backends of :mod:`minisgl.attention` serve many sequences at once.

All of them implement :class:`AttentionBackend`, and :func:`use_attention_backend` selects the
one in effect, so the model code never changes when the backend does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn

from . import fast
from .fast import KVDestination
from .linear import QKVParallelLinear, RowParallelLinear
from .norm import RMSNorm
from .rotary import RotaryEmbedding


class AttentionBackend(Protocol):
    """Computes attention outputs from rotated queries, keys and values.

    ``q`` is [T, num_qo_heads, head_dim] and ``k``/``v`` are [T, num_kv_heads, head_dim] for the
    T tokens of this forward pass (local heads, under tensor parallelism); the result is
    [T, num_qo_heads, head_dim]. ``layer_id`` tells a caching backend which layer's cache to use.
    """

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int
    ) -> torch.Tensor: ...

    # The split form, for a layer whose kernel (minisgl.layers.fast) stores the new keys and
    # values itself on the way from the qkv projection.
    def kv_destination(self, layer_id: int, num_tokens: int) -> KVDestination | None:
        """Where the kernel may write this layer's new K/V and queries; None (this default):
        the backend keeps no pool there, so the layer hands them to :meth:`forward`."""
        return None

    def attend_stored(self, q: torch.Tensor, layer_id: int) -> torch.Tensor:
        """:meth:`forward` after the new K/V were written to :meth:`kv_destination`."""
        raise NotImplementedError(f"{type(self).__name__} names no KV destination")


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     num_cached: int = 0) -> torch.Tensor:
    """Attention of ``T`` new queries over ``num_cached`` earlier tokens plus themselves.

    ``q`` is [T, Hq, D], the queries of the tokens at positions ``num_cached .. num_cached+T-1``;
    ``k`` and ``v`` are [S, Hkv, D] for every token so far (``S = num_cached + T``). Returns
    [T, Hq, D] in the dtype of ``q``.
    """
    num_new, num_qo_heads, head_dim = q.shape
    # GQA: query head h reads KV head h // group. Repeating the KV heads makes the shapes
    # line up; a real kernel reads the shared head instead of copying it.
    group = num_qo_heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    # Scores and softmax in float32: a softmax over thousands of bfloat16 scores would lose
    # the small probabilities that still add up.
    scores = torch.einsum("thd,shd->hts", q.float(), k.float()) * head_dim**-0.5
    if num_new > 1:
        # New token i sits at position num_cached + i and may see keys 0 .. num_cached + i.
        # (A decode step's single token is the newest of all: it sees every key, no mask.)
        query_pos = num_cached + torch.arange(num_new, device=q.device)
        key_pos = torch.arange(k.shape[0], device=q.device)
        future = key_pos[None, :] > query_pos[:, None]
        scores.masked_fill_(future, float("-inf"))
    out = torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1), v.float())
    return out.to(q.dtype)


class DenseCausalAttention(AttentionBackend):
    """The reference backend: one sequence, causal mask, no cache.

    Token ``t`` attends to tokens ``0..t`` of the same forward pass: :func:`causal_attention`
    with nothing cached.
    """

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int
    ) -> torch.Tensor:
        return causal_attention(q, k, v)


# The backend in effect. A plain module variable rather than a thread-local: the model may run
# on a worker thread (the overlap scheduler's) and must see the backend the engine installed.
_current_backend: AttentionBackend = DenseCausalAttention()


def get_attention_backend() -> AttentionBackend:
    """The backend :class:`AttentionLayer` calls right now."""
    return _current_backend


@contextlib.contextmanager
def use_attention_backend(backend: AttentionBackend) -> Iterator[AttentionBackend]:
    """Run the ``with`` block's forward passes through ``backend``; restore the previous after."""
    global _current_backend
    previous, _current_backend = _current_backend, backend
    try:
        yield backend
    finally:
        _current_backend = previous


class AttentionLayer(nn.Module):
    """qkv_proj -> split -> qk-norm -> RoPE -> backend -> o_proj: a decoder layer's self_attn.

    Head counts are the model's (global) ones; the layer works on this rank's share, the share
    :class:`~minisgl.layers.linear.QKVParallelLinear` produces. With ``qk_norm_eps`` (Qwen3),
    ``q_norm``/``k_norm`` normalise each head's vector before the rotation. Module names are
    the checkpoints' (``self_attn.q_norm.weight``).
    """

    def __init__(self, layer_id: int, hidden_size: int, num_qo_heads: int, num_kv_heads: int,
                 head_dim: int, rope: RotaryEmbedding, *, qk_norm_eps: float | None = None,
                 qkv_bias: bool = False, o_bias: bool = False) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = head_dim
        self.qkv_proj = QKVParallelLinear(hidden_size, head_dim, num_qo_heads, num_kv_heads,
                                          bias=qkv_bias)
        self.num_qo_heads = self.qkv_proj.local_qo_heads  # this rank's heads from here on
        self.num_kv_heads = self.qkv_proj.local_kv_heads
        has_norm = qk_norm_eps is not None
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if has_norm else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if has_norm else None
        self.rope = rope
        self.o_proj = RowParallelLinear(num_qo_heads * head_dim, hidden_size, bias=o_bias)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x`` [T, hidden] and ``positions`` [T] -> attention output [T, hidden]."""
        return self.attend(self.qkv_proj(x), positions)

    def attend(self, qkv: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Everything after the qkv projection (whose output ``qkv`` is), for a caller that
        computed it together with the norm before it."""
        fast_out = self._fast_forward(qkv, positions)
        if fast_out is not None:
            return self.o_proj(fast_out)
        num_tokens = qkv.shape[0]
        q_size, kv_size = self.num_qo_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, self.num_qo_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            # RMSNorm over head_dim, one scale vector shared by all heads
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(positions, q, k)
        out = get_attention_backend().forward(q, k, v, self.layer_id)
        return self.o_proj(out.reshape(num_tokens, q_size))

    def _fast_forward(self, qkv: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The same steps with one kernel before attention, where :mod:`.fast` has one; None
        elsewhere. A backend with a KV pool names a :class:`~minisgl.layers.fast.KVDestination`
        (its caches of this layer, the new tokens' slots, the query rows its kernel reads): the
        kernel then writes the keys and values there itself, and the backend only attends.
        """
        has_norm = self.q_norm is not None and self.k_norm is not None
        weights = (self.q_norm.weight, self.k_norm.weight) if has_norm else None
        cos_sin = self.rope.cos_sin_cache
        if not fast.paths.can_qk_prologue(qkv, positions, cos_sin, self.head_dim, weights):
            return None
        backend = get_attention_backend()
        kv_dst = backend.kv_destination(self.layer_id, qkv.shape[0])
        eps = self.q_norm.eps if has_norm else 0.0
        q, k, v = fast.paths.qk_prologue(qkv, positions, self.num_qo_heads, self.num_kv_heads,
                                         self.head_dim, cos_sin, weights, eps, kv_dst)
        if k is None or v is None:  # stored where kv_dst said
            out = backend.attend_stored(q, self.layer_id)
        else:  # the caches did not suit the kernel: the backend stores k and v itself
            out = backend.forward(q, k, v, self.layer_id)
        return out.reshape(qkv.shape[0], self.num_qo_heads * self.head_dim)
