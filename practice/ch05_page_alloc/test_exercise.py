"""Tests for the page allocation exercise: they are its specification."""

from __future__ import annotations

import random

import pytest
import torch
from page_alloc import PageAllocator, token_slots

from minisgl.kvcache.allocator import OutOfPagesError
from minisgl.kvcache.allocator import PageAllocator as ReferenceAllocator  # for the page table
from minisgl.kvcache.page_table import PageTable

# ---------------------------------------------------------------------------------------------
# PageAllocator


def test_a_new_allocator_has_every_page_free() -> None:
    assert PageAllocator(7).num_free == 7


def test_alloc_hands_out_distinct_pages_of_the_pool() -> None:
    alloc = PageAllocator(10)
    pages = alloc.alloc(4) + alloc.alloc(6)
    assert sorted(pages) == list(range(10)), f"10 pages from a pool of 10 must be 0..9, got {pages}"
    assert alloc.num_free == 0


def test_alloc_zero_returns_an_empty_list() -> None:
    alloc = PageAllocator(3)
    assert list(alloc.alloc(0)) == []
    assert alloc.num_free == 3


def test_alloc_is_all_or_nothing() -> None:
    alloc = PageAllocator(5)
    held = alloc.alloc(3)
    with pytest.raises(OutOfPagesError):
        alloc.alloc(3)
    assert alloc.num_free == 2, "a failed alloc must not keep any page (all or nothing)"
    assert sorted(held + alloc.alloc(2)) == list(range(5)), "the two free pages are still there"


def test_out_of_pages_error_says_how_many_were_asked_and_free() -> None:
    alloc = PageAllocator(4)
    alloc.alloc(1)
    with pytest.raises(OutOfPagesError) as info:
        alloc.alloc(9)
    assert (info.value.requested, info.value.free) == (9, 3), \
        "raise OutOfPagesError(requested=n, free=<pages free>)"


def test_freed_pages_can_be_allocated_again() -> None:
    alloc = PageAllocator(4)
    first = alloc.alloc(4)
    alloc.free(first[:2])
    assert alloc.num_free == 2
    assert sorted(alloc.alloc(2)) == sorted(first[:2]), "only the freed pages are free"


def test_double_free_raises_and_changes_nothing() -> None:
    alloc = PageAllocator(4)
    pages = alloc.alloc(2)
    alloc.free(pages)
    with pytest.raises(ValueError):
        alloc.free(pages)
    assert alloc.num_free == 4, "a rejected free must leave the count as it was"


@pytest.mark.parametrize("bad", [[4], [-1], [0, 0]], ids=["too-large", "negative", "repeated"])
def test_free_rejects_bad_ids_before_changing_anything(bad: list[int]) -> None:
    alloc = PageAllocator(4)
    alloc.alloc(4)
    with pytest.raises(ValueError):
        alloc.free([1, *bad])
    assert alloc.num_free == 0, "check every id first: page 1 must not come back either"


def test_a_random_sequence_of_allocs_and_frees_keeps_every_page_accounted_for() -> None:
    rng = random.Random(5)
    alloc = PageAllocator(40)
    owners: list[list[int]] = []
    for step in range(1500):
        live = [p for pages in owners for p in pages]
        if owners and rng.random() < 0.45:
            alloc.free(owners.pop(rng.randrange(len(owners))))
        else:
            n = rng.randint(0, 9)
            if n > 40 - len(live):
                with pytest.raises(OutOfPagesError):
                    alloc.alloc(n)
            else:
                owners.append(list(alloc.alloc(n)))
        live = [p for pages in owners for p in pages]
        assert len(live) == len(set(live)), f"step {step}: a page is owned twice"
        assert all(0 <= p < 40 for p in live), f"step {step}: a page id is outside 0..39"
        assert alloc.num_free == 40 - len(live), \
            f"step {step}: num_free is {alloc.num_free}, expected {40 - len(live)}"
    for pages in owners:
        alloc.free(pages)
    assert alloc.num_free == 40, "every page comes back once every owner has freed its pages"


# ---------------------------------------------------------------------------------------------
# token_slots


def test_token_slots_of_one_request() -> None:
    page_ids = torch.tensor([[7, 2, 5, -1]], dtype=torch.int32)
    got = token_slots(page_ids, [0], [2], [10], page_size=4)
    assert got.tolist() == [30, 31, 8, 9, 10, 11, 20, 21], (
        "position p lives in page page_ids[row, p // 4], at offset p % 4 of it: "
        "slot = page * 4 + p % 4")


def test_token_slots_returns_int64() -> None:
    page_ids = torch.tensor([[3]], dtype=torch.int32)
    assert token_slots(page_ids, [0], [0], [1], page_size=1).dtype == torch.int64, \
        "return int64 (torch's index dtype), not the table's int32"


def test_token_slots_of_an_empty_batch() -> None:
    got = token_slots(torch.zeros(2, 2, dtype=torch.int32), [], [], [], page_size=16)
    assert got.numel() == 0


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_token_slots_matches_the_page_table_on_ragged_batches(page_size: int) -> None:
    rng = random.Random(page_size)
    alloc = ReferenceAllocator(400)
    table = PageTable(max_reqs=8, max_pages_per_req=64, page_size=page_size)
    lengths = {}
    for _ in range(8):
        row = table.alloc_row()
        lengths[row] = rng.randint(0, 90)
        table.append_pages(row, alloc.alloc(table.pages_needed(row, lengths[row])))
        if rng.random() < 0.25:  # some finish, so the next ones get scattered pages
            alloc.free(table.free_row(row))
            del lengths[row]
    rows = list(lengths)
    rng.shuffle(rows)
    starts = [rng.randint(0, lengths[r]) for r in rows]
    ends = [lengths[r] for r in rows]
    expected = table.batch_token_slots(rows, starts, ends)
    got = token_slots(torch.from_numpy(table.page_ids), rows, starts, ends, page_size)
    assert got.tolist() == expected.tolist(), (
        f"page_size={page_size}: slots differ from minisgl's PageTable.batch_token_slots "
        f"(rows {rows}, starts {starts}, ends {ends})")
