"""Tests for the RMSNorm exercise: they are its specification."""

from __future__ import annotations

import pytest
import torch
from rmsnorm import add_rms_norm_, rms_norm_heads
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from minisgl.layers import RMSNorm
from minisgl.utils.torch_utils import default_dtype

ATOL = 1e-5


def reference(size: int, eps: float = 1e-6, seed: int = 0) -> Qwen3RMSNorm:
    torch.manual_seed(seed)
    norm = Qwen3RMSNorm(size, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(size))
    return norm


def per_head(ref: Qwen3RMSNorm, x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """What Qwen3's q/k norm gives on x split into heads, flattened back."""
    with torch.no_grad():
        return ref(x.view(x.shape[0], -1, head_dim)).reshape(x.shape)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("tokens,heads,head_dim", [(5, 4, 64), (3, 2, 32), (1, 8, 16)])
def test_rms_norm_heads_matches_qwen3_rmsnorm_on_each_head(tokens: int, heads: int,
                                                           head_dim: int) -> None:
    ref = reference(head_dim)
    x = torch.randn(tokens, heads * head_dim) * 3
    out = rms_norm_heads(x, ref.weight.detach(), ref.variance_epsilon, head_dim)
    assert out.shape == x.shape, f"the result keeps x's flat shape {tuple(x.shape)}, got " \
                                 f"{tuple(out.shape)}"
    err = max_err(out, per_head(ref, x, head_dim))
    assert err <= ATOL, f"max abs error {err:.2e}: each head of {head_dim} numbers is " \
                        f"normalised by its own root mean square, not the whole row's"


def test_a_loud_head_does_not_change_its_neighbours() -> None:
    weight, head_dim = torch.ones(16), 16
    x = torch.randn(2, 3 * head_dim)
    loud = x.clone()
    loud[:, head_dim:2 * head_dim] *= 1000  # head 1 only
    before, after = (rms_norm_heads(t, weight, 1e-6, head_dim) for t in (x, loud))
    for h in (0, 2):
        cols = slice(h * head_dim, (h + 1) * head_dim)
        assert max_err(before[:, cols], after[:, cols]) <= ATOL, (
            f"scaling head 1 changed head {h}: the statistic must not mix heads")


def test_rms_norm_heads_uses_eps_inside_each_heads_square_root() -> None:
    ref = reference(8, eps=0.5)
    x = torch.randn(3, 4 * 8) * 0.1  # small values: eps dominates, so where it goes matters
    err = max_err(rms_norm_heads(x, ref.weight.detach(), 0.5, 8), per_head(ref, x, 8))
    assert err <= ATOL, "y = x / sqrt(mean(x**2) + eps) * weight, for each head"


def test_a_zero_head_gives_zeros_not_nan() -> None:
    x = torch.randn(2, 4 * 8)
    x[:, 8:16] = 0
    out = rms_norm_heads(x, torch.ones(8), 1e-6, 8)
    assert not torch.isnan(out).any(), "eps keeps the denominator away from zero"
    assert torch.equal(out[:, 8:16], torch.zeros(2, 8))


def test_a_head_dim_that_does_not_divide_the_row_is_refused() -> None:
    with pytest.raises(ValueError, match=r"(?s)(48.*40|40.*48)"):
        rms_norm_heads(torch.randn(2, 40), torch.ones(48), 1e-6, 48)


def test_bfloat16_heads_give_bfloat16_matching_the_reference() -> None:
    ref = reference(64).to(torch.bfloat16)
    x = (torch.randn(6, 4 * 64) * 20).to(torch.bfloat16)
    out = rms_norm_heads(x, ref.weight.detach(), ref.variance_epsilon, 64)
    assert out.dtype == torch.bfloat16, f"output dtype must be x's (bfloat16), got {out.dtype}"
    expected = per_head(ref, x, 64)
    err = max_err(out, expected)
    assert err <= 2 ** -7 * expected.float().abs().max().item(), (
        f"error {err:.3e}: compute in float32, cast back to bfloat16, then multiply by weight")


def test_rms_norm_heads_does_not_modify_its_input() -> None:
    x = torch.randn(4, 64)
    copy = x.clone()
    rms_norm_heads(x, torch.ones(32), 1e-6, 32)
    assert torch.equal(x, copy), "x was changed in place"


def test_add_rms_norm_returns_the_very_tensors_it_was_given() -> None:
    x, residual = torch.randn(7, 64), torch.randn(7, 64)
    result = add_rms_norm_(x, residual, torch.ones(64), 1e-6)
    assert isinstance(result, tuple) and len(result) == 2, "return (x, residual)"
    assert result[0] is x and result[1] is residual, (
        "the in-place form hands back the tensors it was given, overwritten, not new ones")


def test_add_rms_norm_writes_the_norm_into_x_and_the_sum_into_residual() -> None:
    ref = reference(256)
    x, residual = torch.randn(7, 256), torch.randn(7, 256)
    x0, r0 = x.clone(), residual.clone()
    add_rms_norm_(x, residual, ref.weight.detach(), ref.variance_epsilon)
    with torch.no_grad():
        expected_norm = ref(x0 + r0)
    assert max_err(residual, x0 + r0) <= ATOL, "residual must now hold x + residual"
    assert max_err(x, expected_norm) <= ATOL, "x must now hold rms_norm(x + residual)"


def test_the_in_place_form_agrees_with_the_engine_in_bfloat16() -> None:
    ref = reference(128)
    with default_dtype(torch.bfloat16):  # a bfloat16 model's norm: its weight in bfloat16 too
        layer = RMSNorm(128, eps=ref.variance_epsilon)
    layer.load_weight(ref.weight.detach().to(torch.bfloat16))
    x = (torch.randn(3, 128) * 4).to(torch.bfloat16)
    residual = (torch.randn(3, 128) * 4).to(torch.bfloat16)
    normed, summed = layer(x.clone(), residual.clone())
    ours = add_rms_norm_(x, residual, layer.weight, ref.variance_epsilon)
    assert torch.equal(ours[1], summed), "the sum is x + residual, in their dtype"
    assert torch.equal(ours[0], normed), "same operations in the same order give the same bits"


def test_a_chain_of_pre_norm_blocks_matches_the_unfused_pattern() -> None:
    """Three residual blocks (a stand-in sub-layer), in-place form vs. the textbook form."""
    torch.manual_seed(1)
    weights = [1 + 0.2 * torch.randn(64) for _ in range(3)]
    sublayer = torch.nn.Linear(64, 64)
    x = torch.randn(5, 64)

    def norm(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))

    with torch.no_grad():
        h = x.clone()  # textbook: h = h + f(norm(h))
        for w in weights:
            h = h + sublayer(norm(h, w))
        out, residual = x.clone(), torch.zeros(5, 64)  # the first residual add adds zero
        for w in weights:
            normed, residual = add_rms_norm_(out, residual, w, 1e-6)
            out = sublayer(normed)
        assert max_err(out + residual, h) <= 1e-4
