"""Tests for the KV-budget exercise: they are its specification."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kv_budget import kv_bytes_per_token, max_requests_in_budget, max_tokens_in_budget

from minisgl.models.config import ModelConfig

BASE = {"model_type": "test", "vocab_size": 1000, "intermediate_size": 128,
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 4096}
CONFIGS = {
    # Qwen3-0.6B's published shape: 16 query heads share 8 KV heads, head_dim 128 (not 1024/16)
    "qwen3-0.6b": {**BASE, "hidden_size": 1024, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128},
    "multi-head": {**BASE, "hidden_size": 512, "num_hidden_layers": 6, "num_attention_heads": 8},
    "multi-query": {**BASE, "hidden_size": 512, "num_hidden_layers": 3, "num_attention_heads": 8,
                    "num_key_value_heads": 1},
    "gqa-8-groups": {**BASE, "hidden_size": 4096, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8},
}
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 2**30


def config(name: str) -> dict:
    """The config.json of a shape, as a checkpoint stores it."""
    return dict(CONFIGS[name])


def engine_bytes(raw: dict, dtype: str) -> int:
    """What the engine makes of the same dict (the tests may call it; your file may not)."""
    return ModelConfig.from_dict(raw).kv_bytes_per_token(dtype)


@pytest.mark.parametrize("dtype", list(BYTES))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_kv_bytes_per_token_matches_the_engine(name, dtype) -> None:
    expected = engine_bytes(config(name), dtype)
    got = kv_bytes_per_token(config(name), dtype)
    assert got == expected, f"{name} in {dtype}: expected {expected:,} bytes per token, got {got:,}"


def test_qwen3_0_6b_costs_112_kib_per_token_in_bf16() -> None:
    got = kv_bytes_per_token(config("qwen3-0.6b"), "bfloat16")
    assert got == 114_688, (f"2 (K and V) x 28 layers x 8 KV heads x 128 x 2 bytes = 114,688; "
                            f"got {got:,}. Did you use the 16 query heads, or hidden_size / heads?")


def test_query_heads_do_not_count() -> None:
    gqa = {**CONFIGS["multi-head"], "num_key_value_heads": 2}
    mha = config("multi-head")
    ratio = kv_bytes_per_token(mha, "float32") / kv_bytes_per_token(gqa, "float32")
    assert ratio == 4, f"8 KV heads instead of 2 must cost exactly 4x as much, got {ratio}x"


def test_tiny_model(tiny_model_dir: Path) -> None:
    tiny = json.loads((tiny_model_dir / "config.json").read_text(encoding="utf-8"))
    got = kv_bytes_per_token(tiny, "float32")
    assert got == 2 * 4 * 2 * 64 * 4 == 4096, f"tiny-qwen3 in float32: expected 4,096, got {got:,}"


def test_keys_an_older_config_leaves_out() -> None:
    mha = config("multi-head")  # no num_key_value_heads: every query head is a KV head
    assert kv_bytes_per_token(mha, "float32") == 2 * 6 * 8 * (512 // 8) * 4
    explicit = {**mha, "num_key_value_heads": 8, "head_dim": 64}
    assert kv_bytes_per_token(explicit, "float32") == kv_bytes_per_token(mha, "float32")
    null_dim = {**CONFIGS["qwen3-0.6b"], "head_dim": None}  # null: hidden_size / heads = 64
    got = kv_bytes_per_token(null_dim, "bfloat16")
    assert got == engine_bytes(null_dim, "bfloat16") == 2 * 28 * 8 * 64 * 2, (
        f"head_dim null means hidden_size // num_attention_heads; got {got:,}")


def test_the_head_dim_a_config_gives_wins_over_the_division() -> None:
    got = kv_bytes_per_token(config("qwen3-0.6b"), "bfloat16")
    assert got == 2 * 28 * 8 * 128 * 2, "Qwen3-0.6B's head_dim is 128, not 1024 / 16 = 64"


def test_unknown_dtype_is_rejected_by_name() -> None:
    with pytest.raises(ValueError, match="int8"):
        kv_bytes_per_token(config("multi-head"), "int8")


def test_budget_of_exact_pages() -> None:
    per_token = 114_688
    got = max_tokens_in_budget(config("qwen3-0.6b"), "bfloat16", 10 * 16 * per_token, page_size=16)
    assert got == 160, f"a budget of exactly 10 pages of 16 tokens holds 160 tokens, got {got}"


def test_a_partial_page_is_not_allocated() -> None:
    per_token = 114_688
    budget = 10 * 16 * per_token + 15 * per_token  # 10 pages and 15/16 of another
    got = max_tokens_in_budget(config("qwen3-0.6b"), "bfloat16", budget, page_size=16)
    assert got == 160, f"only whole pages count: expected 160 tokens, got {got}"


def test_page_size_one_is_plain_division() -> None:
    cfg = config("gqa-8-groups")
    per_token = 2 * 32 * 8 * 128 * 2
    assert max_tokens_in_budget(cfg, "bfloat16", 3 * GIB) == 3 * GIB // per_token
    assert max_tokens_in_budget(cfg, "bfloat16", per_token - 1) == 0, "less than a token: 0"


def test_eight_gib_for_qwen3_0_6b_in_pages_of_16() -> None:
    got = max_tokens_in_budget(config("qwen3-0.6b"), "bfloat16", 8 * GIB, page_size=16)
    assert got == 74_896, (f"8 GiB / (16 x 114,688 bytes) = 4,681 whole pages = 74,896 tokens, "
                           f"got {got:,}")


def test_requests_round_up_to_whole_pages() -> None:
    cfg = config("multi-query")
    per_token = 2 * 3 * 1 * 64 * 4  # 1,536 bytes in float32
    budget = 100 * 16 * per_token  # 100 pages of 16 tokens
    assert max_requests_in_budget(cfg, "float32", budget, 16, 16) == 100
    got = max_requests_in_budget(cfg, "float32", budget, 16, 17)
    assert got == 50, f"17 tokens need 2 pages of 16, so 100 pages serve 50 requests, got {got}"
    assert max_requests_in_budget(cfg, "float32", budget, 1, 17) == 1600 // 17


@pytest.mark.parametrize("kwargs, name", [
    ({"budget_bytes": -1, "page_size": 16, "tokens_per_request": 8}, "budget_bytes"),
    ({"budget_bytes": GIB, "page_size": 0, "tokens_per_request": 8}, "page_size"),
    ({"budget_bytes": GIB, "page_size": 16, "tokens_per_request": 0}, "tokens_per_request"),
])
def test_bad_arguments_are_named(kwargs, name) -> None:
    with pytest.raises(ValueError, match=name):
        max_requests_in_budget(config("multi-head"), "float32", **kwargs)
    if name != "tokens_per_request":
        with pytest.raises(ValueError, match=name):
            max_tokens_in_budget(config("multi-head"), "float32", kwargs["budget_bytes"],
                                 kwargs["page_size"])
