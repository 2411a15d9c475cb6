"""Tests for the batch-metadata exercise: they are its specification.

The expected values come from the engine: a real page table holding the same rows, chapter 6's
torch backend preparing the batch (positions, out_loc, last_indices) and the FlashInfer
backend's page arrays, which are host code and run without a GPU. Then the engine is put out of
reach and your functions run on the same plain lists.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import pytest
import torch
from batch_metadata import new_token_fields, page_arrays

from minisgl.attention import fi
from minisgl.attention.base import BaseAttnBackend, layout_of
from minisgl.attention.torch_native import TorchNativeBackend
from minisgl.kvcache import MHAKVPool
from minisgl.kvcache.page_table import PageTable

Span = tuple[int, int, int]
NEW_TOKEN_KEYS = ("positions", "out_loc", "last_indices")
PAGE_KEYS = ("qo_indptr", "page_indptr", "page_indices", "last_page_len")


def engine(spans: Sequence[Span], page_rows: Mapping[int, Sequence[int]],
           page_size: int) -> dict[str, list[int]]:
    """What the engine's backends compute for this batch over a real page table."""
    num_pages = max((p for pages in page_rows.values() for p in pages), default=0) + 1
    pool = MHAKVPool(1, 1, 8, num_pages, page_size, torch.float32, "cpu")
    width = max((len(pages) for pages in page_rows.values()), default=1) or 1
    table = PageTable(max(page_rows) + 1, width, page_size=page_size)
    for _ in range(max(page_rows) + 1):
        table.alloc_row()
    for row, pages in page_rows.items():
        table.append_pages(row, list(pages))
    rows, cached, new = (list(column) for column in zip(*spans))
    layout = layout_of(rows, cached, new)
    meta = TorchNativeBackend(pool, table, num_qo_heads=1).prepare(layout)
    arrays = fi.page_arrays(table, layout)
    return {
        "positions": meta.positions.tolist(), "out_loc": meta.out_loc.tolist(),
        "last_indices": meta.last_indices.tolist(),
        "qo_indptr": arrays["qo_indptr"].tolist(), "page_indptr": arrays["page_indptr"].tolist(),
        "page_indices": arrays["page_indices"].tolist(),
        "last_page_len": arrays["last_page_lens"].tolist(),
    }


def refuse(*args: object, **kwargs: object) -> None:
    raise AssertionError("build the arrays from the lists you were given: the engine's page "
                         "table and backends are not for this exercise")


@contextmanager
def engine_out_of_reach() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(PageTable, "__init__", refuse)
        mp.setattr(BaseAttnBackend, "prepare", refuse)
        mp.setattr(fi, "page_arrays", refuse)
        yield


def yours(spans: Sequence[Span], page_rows: Mapping[int, Sequence[int]],
          page_size: int) -> dict[str, list[int]]:
    with engine_out_of_reach():
        fields = new_token_fields(spans, page_rows, page_size)
        arrays = page_arrays(spans, page_rows, page_size)
    for name, got, keys in (("new_token_fields", fields, NEW_TOKEN_KEYS),
                            ("page_arrays", arrays, PAGE_KEYS)):
        assert isinstance(got, dict) and set(got) == set(keys), (
            f"{name} must return a dict with the keys {list(keys)}, got {got!r}")
    return {k: [int(x) for x in v] for k, v in {**fields, **arrays}.items()}


def check(spans: Sequence[Span], page_rows: Mapping[int, Sequence[int]], page_size: int,
          keys: Sequence[str] = NEW_TOKEN_KEYS + PAGE_KEYS) -> None:
    expected = engine(spans, page_rows, page_size)
    got = yours(spans, page_rows, page_size)
    for key in keys:
        assert got[key] == expected[key], (
            f"batch spans={list(spans)} (row, cached, new), page_rows={dict(page_rows)}, "
            f"page_size={page_size}: {key} expected {expected[key]}, got {got[key]}")


EXAMPLE = ([(2, 5, 3), (0, 0, 2), (1, 9, 1)], {2: [6, 0, 3], 0: [4], 1: [1, 7, 5, 2]}, 4)


def test_the_readme_example() -> None:
    check(*EXAMPLE)


def test_a_fresh_prompt_starts_at_position_zero() -> None:
    check([(0, 0, 7)], {0: [3, 1]}, 4)


def test_positions_continue_after_the_cached_prefix() -> None:
    check([(0, 6, 3)], {0: [5, 1, 7]}, 4, keys=("positions", "out_loc"))


def test_a_decode_batch_brings_one_token_per_request() -> None:
    check([(0, 16, 1), (1, 3, 1), (2, 31, 1)], {0: [9, 2], 1: [4], 2: [0, 8]}, 16)


def test_a_prefix_ending_on_a_page_boundary_leaves_a_full_last_page() -> None:
    check([(0, 4, 4)], {0: [2, 5]}, 4, keys=("out_loc", "page_indptr", "last_page_len"))


def test_rows_are_not_the_order_of_the_requests() -> None:
    check([(3, 2, 2), (0, 0, 3), (2, 5, 1)], {3: [1], 0: [6], 2: [0, 4], 1: [7]}, 4)


def test_pages_beyond_a_requests_tokens_are_not_listed() -> None:
    check([(0, 0, 3), (1, 4, 1)], {0: [5, 2, 7], 1: [1, 3, 6]}, 4,
          keys=("page_indptr", "page_indices", "last_page_len"))


def test_page_size_one_gives_one_page_per_token() -> None:
    check([(1, 2, 2), (0, 0, 1)], {1: [9, 4, 7, 0], 0: [3]}, 1)


@pytest.mark.parametrize("fn", [new_token_fields, page_arrays], ids=lambda f: f.__name__)
def test_a_row_short_of_pages_is_refused(fn) -> None:
    spans, page_rows = [(0, 0, 2), (1, 6, 3)], {0: [0], 1: [1, 2]}  # row 1 needs 3 pages of 4
    with pytest.raises(ValueError):  # what the engine does with the same batch
        engine(spans, page_rows, 4)
    with engine_out_of_reach(), pytest.raises(ValueError) as err:
        fn(spans, page_rows, 4)
    assert "1" in str(err.value), f"the message should name row 1: {err.value}"


def random_batch(rng: random.Random, page_size: int) -> tuple[list[Span], dict[int, list[int]]]:
    num_reqs = rng.randint(1, 6)
    rows = rng.sample(range(8), num_reqs)
    free = list(range(64))
    rng.shuffle(free)
    spans, page_rows = [], {}
    for row in rows:
        cached = rng.choice([0, 0, rng.randint(1, 40), page_size * rng.randint(1, 3)])
        new = rng.choice([1, rng.randint(1, 20)])
        needed = -(-(cached + new) // page_size)
        extra = rng.choice([0, 0, 1])
        if needed + extra > len(free):
            continue
        spans.append((row, cached, new))
        page_rows[row] = [free.pop() for _ in range(needed + extra)]
    return spans, page_rows


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_random_batches_match_the_engine(page_size: int) -> None:
    rng = random.Random(page_size)
    for _ in range(100):
        spans, page_rows = random_batch(rng, page_size)
        if spans:
            check(spans, page_rows, page_size)
