"""How much KV cache a model needs, and how much fits in a memory budget.

Write the three functions below from the config's fields. See README.md for the rules.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def kv_bytes_per_token(config: Mapping[str, Any], dtype: str) -> int:
    """Bytes of KV cache that one token occupies, over all layers, keys and values.

    Args:
        config: the model's config.json, as ``json.load`` returns it.
        dtype: the cache's element type: ``"float32"``, ``"bfloat16"`` or ``"float16"``.

    Raises:
        ValueError: for any other dtype, naming it.
    """
    raise NotImplementedError(
        "kv_bytes_per_token: count K and V of every KV head in every layer; README.md says "
        "which keys a config may leave out")


def max_tokens_in_budget(config: Mapping[str, Any], dtype: str, budget_bytes: int,
                         page_size: int = 1) -> int:
    """How many tokens of KV cache fit in ``budget_bytes`` when memory comes in whole pages.

    A page holds the KV of ``page_size`` tokens; only whole pages are allocated, so the answer
    is a multiple of ``page_size``.

    Raises:
        ValueError: if ``budget_bytes`` is negative or ``page_size`` is smaller than 1.
    """
    raise NotImplementedError("max_tokens_in_budget: count whole pages, then tokens")


def max_requests_in_budget(config: Mapping[str, Any], dtype: str, budget_bytes: int, page_size: int,
                           tokens_per_request: int) -> int:
    """How many requests of ``tokens_per_request`` tokens each can hold their KV at once.

    Pages are never shared between requests, so each request needs its token count rounded up
    to whole pages.

    Raises:
        ValueError: if ``tokens_per_request`` is smaller than 1 (and as above for the rest).
    """
    raise NotImplementedError("max_requests_in_budget: pages per request, rounded up")
