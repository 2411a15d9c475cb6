"""Tests for the RMSNorm exercise: they are its specification."""

from __future__ import annotations

import pytest
import torch
from rmsnorm import add_rms_norm, rms_norm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from minisgl.layers import RMSNorm

ATOL = 1e-5


def reference(size: int, eps: float = 1e-6, seed: int = 0) -> Qwen3RMSNorm:
    torch.manual_seed(seed)
    norm = Qwen3RMSNorm(size, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(size))
    return norm


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("shape", [(5, 256), (5, 4, 64), (1, 1, 2, 32)])
def test_rms_norm_matches_qwen3_rmsnorm_over_the_last_dimension(shape: tuple[int, ...]) -> None:
    ref = reference(shape[-1])
    x = torch.randn(*shape) * 3
    out = rms_norm(x, ref.weight.detach(), ref.variance_epsilon)
    assert out.shape == x.shape, f"the result must keep x's shape {x.shape}, got {out.shape}"
    err = max_err(out, ref(x))
    assert err <= ATOL, f"max abs error {err:.2e} against Qwen3RMSNorm (normalise over dim -1)"


def test_rms_norm_uses_eps_inside_the_square_root() -> None:
    ref = reference(16, eps=0.5)
    x = torch.randn(3, 16) * 0.1  # small values: eps dominates, so where it goes matters
    err = max_err(rms_norm(x, ref.weight.detach(), 0.5), ref(x))
    assert err <= ATOL, "y = x / sqrt(mean(x**2) + eps) * weight"


def test_a_zero_vector_gives_zeros_not_nan() -> None:
    out = rms_norm(torch.zeros(2, 8), torch.ones(8), 1e-6)
    assert not torch.isnan(out).any(), "eps keeps the denominator away from zero"
    assert torch.equal(out, torch.zeros(2, 8))


def test_bfloat16_input_gives_bfloat16_output_matching_the_reference() -> None:
    ref = reference(512).to(torch.bfloat16)
    x = (torch.randn(6, 512) * 20).to(torch.bfloat16)
    out = rms_norm(x, ref.weight.detach(), ref.variance_epsilon)
    assert out.dtype == torch.bfloat16, f"output dtype must be x's (bfloat16), got {out.dtype}"
    # Same operations in the same order give the same bits; allow one bf16 rounding anyway.
    err = max_err(out, ref(x))
    assert err <= 2 ** -7 * ref(x).float().abs().max().item(), (
        f"error {err:.3e}: compute in float32, cast back to bfloat16, then multiply by weight")


def test_rms_norm_does_not_modify_its_input() -> None:
    x = torch.randn(4, 32)
    copy = x.clone()
    rms_norm(x, torch.ones(32), 1e-6)
    assert torch.equal(x, copy), "x was changed in place"


def test_add_rms_norm_returns_the_normalised_sum_and_the_sum() -> None:
    ref = reference(256)
    x, residual = torch.randn(7, 256), torch.randn(7, 256)
    result = add_rms_norm(x, residual, ref.weight.detach(), ref.variance_epsilon)
    assert isinstance(result, tuple) and len(result) == 2, "return (normed, summed)"
    normed, summed = result
    assert max_err(summed, x + residual) <= ATOL, "the second output is x + residual"
    assert max_err(normed, ref(x + residual)) <= ATOL, "the first output is rms_norm(x + residual)"


def test_both_forms_agree_with_the_engine_rmsnorm() -> None:
    ref = reference(128)
    layer = RMSNorm(128, eps=ref.variance_epsilon)
    layer.load_weight(ref.weight.detach())
    x, residual = torch.randn(3, 128), torch.randn(3, 128)
    w = ref.weight.detach()
    assert max_err(rms_norm(x, w, ref.variance_epsilon), layer(x)) <= ATOL
    ours, engine = add_rms_norm(x, residual, w, ref.variance_epsilon), layer(x, residual)
    assert max_err(ours[0], engine[0]) <= ATOL and max_err(ours[1], engine[1]) <= ATOL


def test_a_chain_of_pre_norm_blocks_matches_the_unfused_pattern() -> None:
    """Three residual blocks (a stand-in sub-layer), fused form vs. the textbook form."""
    torch.manual_seed(1)
    weights = [1 + 0.2 * torch.randn(64) for _ in range(3)]
    sublayer = torch.nn.Linear(64, 64)
    x = torch.randn(5, 64)
    with torch.no_grad():
        h = x  # textbook: h = h + f(norm(h))
        for w in weights:
            h = h + sublayer(rms_norm(h, w, 1e-6))
        out, residual = x, None  # fused: carry the sub-layer output and the residual apart
        for w in weights:
            if residual is None:
                normed, residual = rms_norm(out, w, 1e-6), out
            else:
                normed, residual = add_rms_norm(out, residual, w, 1e-6)
            out = sublayer(normed)
        assert max_err(out + residual, h) <= ATOL
