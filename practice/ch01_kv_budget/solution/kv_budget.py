"""How much KV cache a model needs, and how much fits in a memory budget (reference solution)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

BYTES_PER_ELEMENT = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token(config: Mapping[str, Any], dtype: str) -> int:
    """Bytes of KV cache that one token occupies, over all layers, keys and values."""
    if dtype not in BYTES_PER_ELEMENT:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(BYTES_PER_ELEMENT)}")
    # One K vector and one V vector of head_dim numbers per KV head, in every layer. The
    # query heads do not appear: under GQA they share the KV heads.
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads  # absent: multi-head attention
    head_dim = config.get("head_dim") or config["hidden_size"] // heads  # absent or null
    per_layer = 2 * kv_heads * head_dim
    return config["num_hidden_layers"] * per_layer * BYTES_PER_ELEMENT[dtype]


def _check(budget_bytes: int, page_size: int) -> None:
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")


def max_tokens_in_budget(config: Mapping[str, Any], dtype: str, budget_bytes: int,
                         page_size: int = 1) -> int:
    """How many tokens of KV cache fit in ``budget_bytes`` when memory comes in whole pages."""
    _check(budget_bytes, page_size)
    page_bytes = page_size * kv_bytes_per_token(config, dtype)
    return budget_bytes // page_bytes * page_size


def max_requests_in_budget(config: Mapping[str, Any], dtype: str, budget_bytes: int, page_size: int,
                           tokens_per_request: int) -> int:
    """How many requests of ``tokens_per_request`` tokens each can hold their KV at once."""
    _check(budget_bytes, page_size)
    if tokens_per_request < 1:
        raise ValueError(f"tokens_per_request must be >= 1, got {tokens_per_request}")
    pages = max_tokens_in_budget(config, dtype, budget_bytes, page_size) // page_size
    pages_per_request = -(-tokens_per_request // page_size)  # ceiling division
    return pages // pages_per_request
