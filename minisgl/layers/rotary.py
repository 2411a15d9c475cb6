"""Rotary position embeddings (RoPE) and the scalings that stretch them to longer contexts.

RoPE encodes a token's position by *rotating* its query and key vectors: the ``rotary_dim``
features are read as ``rotary_dim / 2`` pairs, and pair ``i`` of a token at position ``p`` is
turned by the angle ``p * inv_freq[i]``. A dot product of two rotated vectors then depends only
on the *difference* of their positions, which is what attention needs. The frequencies fall
geometrically, ``inv_freq[i] = base ** (-2i / rotary_dim)``: the first pairs spin fast (local
order), the last ones slowly (long range).

A model trained on contexts of length ``L`` has never seen angles beyond ``L * inv_freq``.
The scaling methods (``linear``, ``llama3``, ``yarn``) change ``inv_freq`` (and, for YaRN, the
magnitude of cos/sin) so a longer context maps onto angles the model knows. They run once, at
construction; the forward pass is the same for all of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from . import fast


def default_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    """The unscaled RoPE frequencies ``base ** (-2i / rotary_dim)``, in float32."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
    return 1.0 / (base ** exponents)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to queries and keys, reading cos/sin from a table built once.

    The table holds ``cos`` and ``sin`` of ``position * inv_freq`` for every position below
    ``max_position``: a lookup per token at run time instead of recomputing trigonometry in
    every layer. It is a buffer (moves with ``.to(device)``) that is not saved with the weights.
    """

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, inv_freq: torch.Tensor,
                 attention_scaling: float = 1.0) -> None:
        super().__init__()
        # rotary_dim is even and at most head_dim: ModelConfig checked it, where the config enters
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        positions = torch.arange(max_position, dtype=torch.float32)
        angles = positions[:, None] * inv_freq.float()[None, :]  # [max_position, rotary_dim/2]
        # Always float32, whatever the model's dtype: angles reach thousands of radians, and
        # bfloat16 (8 significant bits) cannot even tell position 4000 from 4001.
        # YaRN's attention_scaling multiplies both cos and sin, i.e. it lengthens q and k.
        # One row per position, cos in its first half and sin in its second: the layout
        # FlashInfer's RoPE kernel reads (see forward), so both paths share one table.
        cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1) * attention_scaling
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [T, H, head_dim] by the per-token angles in ``cos``/``sin`` [T, 1, d/2]."""
        rot, passthrough = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        # Pairs are (feature i, feature i + rotary_dim/2): the "half split" layout that
        # Hugging Face Llama/Qwen checkpoints are trained with (not adjacent pairs 2i, 2i+1).
        # The arithmetic runs in float32 and is rounded to x's dtype once, at the end.
        x1, x2 = rot.float().chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        if passthrough.shape[-1] == 0:
            return rotated
        return torch.cat((rotated, passthrough), dim=-1)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``q`` and ``k`` rotated to their tokens' ``positions`` ([T] integers).

        ``q`` and ``k`` may be [T, H*head_dim] or [T, H, head_dim] (with different H for q and
        k under grouped-query attention); the results have the input shapes. Positions must be
        below ``max_position``. A kernel behind :mod:`~minisgl.layers.fast` may rotate both in
        place and return ``q`` and ``k`` themselves, so use the returned tensors.
        """
        if fast.paths.rope_inplace(positions, q, k, self.cos_sin_cache, self.head_dim):
            return q, k
        # [T, 1, rotary_dim/2] each, shared by the heads: one lookup of the table per token
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        q_rot = self._rotate(q.view(q.shape[0], -1, self.head_dim), cos, sin)
        k_rot = self._rotate(k.view(k.shape[0], -1, self.head_dim), cos, sin)
        return q_rot.view(q.shape), k_rot.view(k.shape)


# --- scalings: each says how much of its frequency every pair keeps -------------------------
# 1 keeps ``inv_freq``, 0 divides it by ``factor``, and between the two get_rope blends linearly.

Scaled = tuple[torch.Tensor | float, float]  # (the kept share per pair, attention_scaling)


def _linear_scaling(rotary_dim: int, base: float, params: Mapping[str, Any]) -> Scaled:
    """Position interpolation: no pair keeps its frequency (positions squeezed by ``factor``)."""
    return 0.0, 1.0


def _llama3_scaling(rotary_dim: int, base: float, params: Mapping[str, Any]) -> Scaled:
    """Llama 3.1's scaling: slow down only the low frequencies, and blend in between.

    A pair whose wavelength (``2*pi / inv_freq`` tokens) is short compared with the original
    context already saw every angle in training: keep it. One whose wavelength exceeds the
    original context never completed a turn: divide its frequency by ``factor``. Between
    ``orig / high_freq_factor`` and ``orig / low_freq_factor`` tokens, interpolate linearly.
    """
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    original_max = params["original_max_position_embeddings"]

    wavelength = 2 * math.pi / default_inv_freq(rotary_dim, base)
    if low_freq_factor == high_freq_factor:  # no blending band: a hard switch
        return (wavelength < original_max / high_freq_factor).float(), 1.0
    # Clamping covers both outer bands: the short wavelengths keep all, the long ones none.
    smooth = (original_max / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    return smooth.clamp(0.0, 1.0), 1.0


def _yarn_scaling(rotary_dim: int, base: float, params: Mapping[str, Any]) -> Scaled:
    """YaRN: interpolate slow pairs, keep fast ones, ramp in between; and sharpen attention.

    The ramp is measured in rotations over the original context: pairs that turn more than
    ``beta_fast`` times keep their frequency, pairs that turn fewer than ``beta_slow`` times are
    divided by ``factor``. Stretching the context also flattens attention scores, so cos and sin
    are multiplied by ``attention_factor`` (``0.1 * ln(factor) + 1`` unless given).
    """
    original_max = params["original_max_position_embeddings"]
    factor = params["factor"]
    beta_fast = params.get("beta_fast") or 32.0
    beta_slow = params.get("beta_slow") or 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

    def dim_for_rotations(num_rotations: float) -> float:
        # The feature index whose pair turns num_rotations times over original_max tokens.
        return (rotary_dim * math.log(original_max / (num_rotations * 2 * math.pi))
                / (2 * math.log(base)))

    low = max(math.floor(dim_for_rotations(beta_fast)), 0)
    high = min(math.ceil(dim_for_rotations(beta_slow)), rotary_dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp

    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return 1 - ramp, float(attention_factor)  # the fast pairs at the start keep all


_SCALINGS: dict[str, Callable[[int, float, Mapping[str, Any]], Scaled]] = {
    "linear": _linear_scaling,
    "llama3": _llama3_scaling,
    "yarn": _yarn_scaling,
}


def get_rope(head_dim: int, rotary_dim: int, max_position: int, base: float,
             rope_scaling: Mapping[str, Any] | None = None) -> RotaryEmbedding:
    """Build the :class:`RotaryEmbedding` a config describes.

    ``rope_scaling`` is the checkpoint's ``rope_scaling`` (or ``rope_parameters``) dict, or
    ``None``. Its ``rope_type`` (older configs: ``type``) picks the scaling; unknown keys such
    as ``rope_theta`` are ignored. The table is built on the current default device.
    """
    scaling = dict(rope_scaling or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        inv_freq, attention_scaling = default_inv_freq(rotary_dim, base), 1.0
    elif rope_type in _SCALINGS:
        # As in transformers: a missing original context length means "the one in the config".
        params = {"original_max_position_embeddings": max_position, **scaling}
        try:
            kept, attention_scaling = _SCALINGS[rope_type](rotary_dim, base, params)
            factor = params["factor"]
        except KeyError as missing:
            raise ValueError(f"rope_scaling of type {rope_type!r} lacks the key {missing}; "
                             f"got {scaling}") from None
        inv_freq = default_inv_freq(rotary_dim, base)
        inv_freq = inv_freq / factor * (1 - kept) + inv_freq * kept
    else:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, "
                         f"{', '.join(_SCALINGS)}")
    return RotaryEmbedding(head_dim, rotary_dim, max_position, inv_freq, attention_scaling)
