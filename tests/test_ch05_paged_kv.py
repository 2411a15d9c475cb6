"""Chapter 5: the page allocator, the page table and the KV pool.

The allocator must never hand a page to two owners and must get every page back; the page
table must map every token of every live request to its own slot; what is stored through that
mapping must read back unchanged, for 1-token pages and for 16-token pages alike.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minisgl.kvcache import MHAKVPool, OutOfPagesError, PageAllocator
from minisgl.models.config import ModelConfig
from minisgl.kvcache.page_table import NO_PAGE, PageTable, expand_ranges

PAGE_SIZES = [1, 4, 16]


# ---------------------------------------------------------------------------------------------
# The allocator


def test_alloc_hands_out_every_page_exactly_once() -> None:
    alloc = PageAllocator(10)
    pages = alloc.alloc(3) + alloc.alloc(0) + alloc.alloc(7)
    assert sorted(pages) == list(range(10))
    assert alloc.num_free == 0 and alloc.num_used == 10


def test_alloc_beyond_capacity_raises_and_changes_nothing() -> None:
    alloc = PageAllocator(8)
    held = alloc.alloc(5)
    with pytest.raises(OutOfPagesError, match="asked for 4 KV page.*only 3 are free") as info:
        alloc.alloc(4)
    assert (info.value.requested, info.value.free) == (4, 3)
    assert alloc.num_free == 3, "a failed alloc must not take any page"
    assert sorted(held + alloc.alloc(3)) == list(range(8))


def test_free_then_alloc_reuses_the_freed_pages() -> None:
    alloc = PageAllocator(6)
    alloc.alloc(6)
    alloc.free([4, 1])
    assert alloc.alloc(2) == [4, 1]


@pytest.mark.parametrize("bad, reason", [
    ([2, 2], "more than once"),
    ([5], "already free"),
    ([6], "not in 0..5"),
    ([-1], "not in 0..5"),
    ([1.0], "not in 0..5"),
])
def test_free_rejects_bad_ids_and_changes_nothing(bad: list, reason: str) -> None:
    alloc = PageAllocator(6)
    alloc.alloc(5)  # pages 0..4 in use, 5 free
    with pytest.raises(ValueError, match=reason):
        alloc.free([0, *bad])
    assert alloc.num_free == 1, "a rejected free must not return any page, not even the good ones"
    assert not alloc.is_free(0)


def test_double_free_raises() -> None:
    alloc = PageAllocator(4)
    pages = alloc.alloc(2)
    alloc.free(pages)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(pages)


@pytest.mark.parametrize("n", [-1, 1.5, True])
def test_alloc_rejects_a_bad_count(n: object) -> None:
    with pytest.raises(ValueError, match="integer"):
        PageAllocator(4).alloc(n)  # type: ignore[arg-type]


def test_random_alloc_free_sequence_keeps_every_page_accounted_for() -> None:
    rng = random.Random(1234)
    alloc = PageAllocator(64)
    owners: dict[int, list[int]] = {}
    for step in range(2000):
        if owners and rng.random() < 0.45:
            alloc.free(owners.pop(rng.choice(list(owners))))
        else:
            n = rng.randint(0, 12)
            if n > alloc.num_free:
                with pytest.raises(OutOfPagesError):
                    alloc.alloc(n)
            else:
                owners[step] = alloc.alloc(n)
        live = [p for pages in owners.values() for p in pages]
        assert len(live) == len(set(live)), f"step {step}: a page was handed out twice"
        assert alloc.num_free + len(live) == 64, f"step {step}: a page went missing"
    for pages in owners.values():
        alloc.free(pages)
    assert alloc.num_free == 64 and sorted(alloc.alloc(64)) == list(range(64))


# ---------------------------------------------------------------------------------------------
# The page table


def test_slot_of_a_token_is_its_page_times_page_size_plus_its_offset() -> None:
    table = PageTable(max_reqs=2, max_pages_per_req=4, page_size=4)
    row = table.alloc_row()
    table.append_pages(row, [7, 2, 5])
    assert table.token_slots(row, 0, 11).tolist() == [28, 29, 30, 31, 8, 9, 10, 11, 20, 21, 22]
    assert table.token_slots(row, 5, 9).tolist() == [9, 10, 11, 20]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_batch_token_slots_equals_the_formula_for_ragged_requests(page_size: int) -> None:
    rng = random.Random(page_size)
    alloc = PageAllocator(200)
    table = PageTable(max_reqs=6, max_pages_per_req=40, page_size=page_size)
    rows, starts, ends = [], [], []
    for _ in range(6):
        row, length = table.alloc_row(), rng.randint(1, 30)
        table.append_pages(row, alloc.alloc(table.pages_needed(row, length)))
        rows.append(row)
        starts.append(rng.randint(0, length))
        ends.append(length)
    expected = []
    for row, start, end in zip(rows, starts, ends):
        pages = table.row_pages(row).tolist()
        expected += [pages[pos // page_size] * page_size + pos % page_size
                     for pos in range(start, end)]
    got = table.batch_token_slots(rows, starts, ends)
    assert got.dtype == torch.int64
    assert got.tolist() == expected


def test_token_slots_refuses_positions_beyond_the_rows_pages() -> None:
    table = PageTable(max_reqs=2, max_pages_per_req=4, page_size=16)
    row = table.alloc_row()
    table.append_pages(row, [3])
    table.token_slots(row, 0, 16)
    with pytest.raises(ValueError, match="outside row 0, which maps tokens 0..16"):
        table.token_slots(row, 0, 17)


def test_pages_needed_asks_for_one_page_every_page_size_tokens() -> None:
    alloc = PageAllocator(16)
    table = PageTable(max_reqs=1, max_pages_per_req=16, page_size=4)
    row = table.alloc_row()
    asked = []
    for length in range(1, 14):  # decode one token at a time
        need = table.pages_needed(row, length)
        asked.append(need)
        table.append_pages(row, alloc.alloc(need))
    assert asked == [1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1]
    assert table.pages_needed(row, 3) == 0, "shrinking never asks for pages"
    with pytest.raises(ValueError, match="exceed the 64 that one request can hold"):
        table.pages_needed(row, 65)


def test_rows_grow_in_place_and_a_freed_row_reads_as_no_page() -> None:
    """Appended pages land after the row's own, rows apart from each other, and a freed row
    reads as NO_PAGE again."""
    table = PageTable(max_reqs=3, max_pages_per_req=4, page_size=2)
    a, b = table.alloc_row(), table.alloc_row()
    table.append_pages(a, [7])
    table.append_pages(b, [3, 4])
    table.append_pages(a, [1])
    assert table.page_ids.tolist() == [[7, 1, -1, -1], [3, 4, -1, -1], [-1, -1, -1, -1]]
    table.append_pages(b, [9])
    assert table.free_row(a) == [7, 1], "free_row returns the row's pages"
    assert table.page_ids[a].tolist() == [NO_PAGE] * 4
    assert table.row_pages(b).tolist() == [3, 4, 9]


def test_expand_ranges_matches_a_loop() -> None:
    starts, counts = [5, 0, 9, 3], [3, 0, 2, 4]
    values, owner = expand_ranges(np.array(starts), np.array(counts))
    assert values.tolist() == [s + k for s, n in zip(starts, counts) for k in range(n)]
    assert owner.tolist() == [i for i, n in enumerate(counts) for _ in range(n)]


def test_slots_follow_the_rows_through_reuse() -> None:
    """Through rows growing, freed and handed to the next request, every slot is
    page * page_size + offset of its own row."""
    table = PageTable(6, 20, page_size=4)
    rng = random.Random(0)
    next_page = 0
    held: list[int] = []
    for _ in range(200):
        if held and rng.random() < 0.2:  # a request finishes; its row goes to the next one
            table.free_row(held.pop(rng.randrange(len(held))))
        if len(held) < 6 and rng.random() < 0.5:
            held.append(table.alloc_row())
        for row in held:
            grow = min(rng.choice([0, 0, 1, 3]), 20 - table.num_pages(row))
            table.append_pages(row, list(range(next_page, next_page + grow)))
            next_page += grow
        rows = [row for row in held if table.num_pages(row)]
        if not rows:
            continue
        positions = [rng.randrange(table.num_pages(row) * 4) for row in rows]
        expected = [table.row_pages(row).tolist()[p // 4] * 4 + p % 4
                    for row, p in zip(rows, positions)]
        assert table.batch_token_slots(rows, positions, [p + 1 for p in positions]).tolist() \
            == expected


def test_extend_rows_is_append_pages_row_by_row() -> None:
    """Several rows grown in one call hold what one append per row gives them; an
    overflowing row leaves every row as it was."""
    one, many = PageTable(4, 6, page_size=2), PageTable(4, 6, page_size=2)
    rows = [one.alloc_row() for _ in range(4)]
    assert rows == [many.alloc_row() for _ in range(4)]
    rng = random.Random(0)
    next_page = 0
    for _ in range(5):
        counts = [rng.randint(0, 6 - one.num_pages(row)) for row in rows]
        pages = list(range(next_page, next_page + sum(counts)))
        next_page += sum(counts)
        taken = 0
        for row, count in zip(rows, counts):
            one.append_pages(row, pages[taken: taken + count])
            taken += count
        many.extend_rows(rows, counts, pages)
        assert many.page_ids.tolist() == one.page_ids.tolist()
        assert [many.num_pages(r) for r in rows] == [one.num_pages(r) for r in rows]
    full = max(rows, key=many.num_pages)
    before = many.page_ids.tolist()
    with pytest.raises(ValueError, match="exceed its 6 entries"):
        many.extend_rows([r for r in rows if r != full] + [full], [0] * 3 + [7], [0] * 7)
    assert many.page_ids.tolist() == before


def test_append_pages_refuses_to_overflow_a_row() -> None:
    table = PageTable(max_reqs=1, max_pages_per_req=2, page_size=1)
    row = table.alloc_row()
    with pytest.raises(ValueError, match="exceed its 2 entries"):
        table.append_pages(row, [0, 1, 2])
    assert table.num_pages(row) == 0


def test_a_freed_row_comes_back_empty_for_the_next_request() -> None:
    table = PageTable(max_reqs=2, max_pages_per_req=3, page_size=16)
    first, second = table.alloc_row(), table.alloc_row()
    assert (first, second) == (0, 1)
    with pytest.raises(RuntimeError, match="all 2 page table rows are in use"):
        table.alloc_row()
    table.append_pages(first, [9, 4])
    assert table.free_row(first) == [9, 4], "free_row returns the pages for the allocator"
    assert table.num_free_rows == 1
    reused = table.alloc_row()
    assert reused == first
    assert table.num_pages(reused) == 0
    assert table.page_ids[reused].tolist() == [NO_PAGE] * 3
    with pytest.raises(ValueError, match="not a row in use"):
        table.free_row(5)


# ---------------------------------------------------------------------------------------------
# The pool


def make_pool(page_size: int, num_pages: int = 64, dtype: torch.dtype = torch.float32,
              device: str = "cpu") -> MHAKVPool:
    return MHAKVPool(num_layers=3, num_kv_heads=2, head_dim=8, num_pages=num_pages,
                     page_size=page_size, dtype=dtype, device=device)


def test_pool_layout_is_one_row_per_token_slot() -> None:
    pool = make_pool(page_size=16, num_pages=5)
    assert pool.kv_cache(2)[0].shape == (80, 2, 8) and pool.kv_cache(0)[1].shape == (80, 2, 8)
    assert pool.num_slots == 80
    assert pool.num_bytes == 2 * 3 * 80 * 2 * 8 * 4
    k_pages, _ = pool.kv_pages(1)
    assert k_pages.shape == (5, 16, 2, 8)
    pool.store_kv(torch.ones(1, 2, 8), torch.ones(1, 2, 8), torch.tensor([3 * 16 + 5]), 1)
    assert k_pages[3, 5].eq(1).all() and k_pages.sum() == 16, "slot 53 is page 3, offset 5"


def round_trip(page_size: int, device: str, dtype: torch.dtype, seed: int = 0) -> None:
    """Ragged requests, random K/V stored through the page table and read back equal."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    pool = make_pool(page_size, num_pages=400 // page_size + 8, dtype=dtype, device=device)
    alloc = PageAllocator(pool.num_pages)
    table = PageTable(max_reqs=8, max_pages_per_req=64, page_size=page_size, device=device)
    lengths = {}
    for _ in range(6):  # some requests start, some finish, so pages get reused out of order
        row = table.alloc_row()
        lengths[row] = rng.randint(1, 60)
        table.append_pages(row, alloc.alloc(table.pages_needed(row, lengths[row])))
        if rng.random() < 0.3:
            alloc.free(table.free_row(row))
            del lengths[row]
    rows = list(lengths)
    out_loc = table.batch_token_slots(rows, [0] * len(rows), [lengths[r] for r in rows])
    assert len(set(out_loc.tolist())) == len(out_loc), "two live tokens share a slot"
    written = {}
    for layer in range(pool.num_layers):
        k = torch.randn(len(out_loc), 2, 8, generator=generator).to(device, dtype)
        v = torch.randn(len(out_loc), 2, 8, generator=generator).to(device, dtype)
        pool.store_kv(k, v, out_loc, layer)
        written[layer] = (k, v)
    offset = 0
    for row in rows:
        slots = table.token_slots(row, 0, lengths[row])
        for layer in range(pool.num_layers):
            k, v = pool.gather_kv(slots, layer)
            assert torch.equal(k, written[layer][0][offset : offset + lengths[row]])
            assert torch.equal(v, written[layer][1][offset : offset + lengths[row]])
        offset += lengths[row]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_store_then_gather_returns_what_was_written(page_size: int) -> None:
    for seed in range(3):
        round_trip(page_size, "cpu", torch.float32, seed)


def test_store_kv_casts_to_the_pool_dtype() -> None:
    pool = make_pool(page_size=1, dtype=torch.bfloat16)
    k = torch.randn(3, 2, 8)
    pool.store_kv(k, -k, torch.tensor([5, 0, 9]), 0)
    k_back, v_back = pool.gather_kv(torch.tensor([5, 0, 9]), 0)
    assert k_back.dtype == torch.bfloat16
    assert torch.equal(k_back, k.to(torch.bfloat16)) and torch.equal(v_back, -k.to(torch.bfloat16))


def test_store_kv_rejects_mismatched_lengths() -> None:
    pool = make_pool(page_size=1)
    with pytest.raises(ValueError, match="must agree on the number of tokens"):
        pool.store_kv(torch.zeros(3, 2, 8), torch.zeros(3, 2, 8), torch.tensor([0, 1]), 0)


@pytest.mark.parametrize("page_size", [1, 16])
def test_pool_sized_from_a_budget_matches_kv_bytes_per_token(tiny_model_dir, page_size: int
                                                             ) -> None:
    config = ModelConfig.from_pretrained(tiny_model_dir)
    per_token = config.kv_bytes_per_token(torch.float32)
    budget = 3 * 2**20 + 12345
    num_pages = MHAKVPool.num_pages_for_budget(budget, config, page_size, torch.float32)
    page_bytes = page_size * per_token
    assert num_pages * page_bytes <= budget < (num_pages + 1) * page_bytes
    pool = MHAKVPool.from_config(config, num_pages, page_size, torch.float32, "cpu")
    assert pool.bytes_per_token == per_token
    assert pool.num_bytes == num_pages * page_bytes
    assert pool.kv_cache(config.num_layers - 1)[0].shape == (
        num_pages * page_size, config.num_kv_heads, config.head_dim)


def test_pool_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="page_size must be an integer >= 1, got 0"):
        make_pool(page_size=0)
    with pytest.raises(ValueError, match="budget_bytes"):
        MHAKVPool.num_pages_for_budget(-1, None, 1, torch.float32)  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_store_then_gather_on_cuda_in_bfloat16(page_size: int) -> None:
    round_trip(page_size, "cuda", torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# Property: requests that start, grow and finish in any order never share a slot


class PagedRequests(RuleBasedStateMachine):
    """Requests start, grow by a few tokens and finish in an order hypothesis chooses."""

    NUM_PAGES, MAX_REQS, PAGE_SIZE = 24, 5, 4

    def __init__(self) -> None:
        super().__init__()
        self.alloc = PageAllocator(self.NUM_PAGES)
        self.table = PageTable(self.MAX_REQS, 8, page_size=self.PAGE_SIZE)
        self.lengths: dict[int, int] = {}  # row -> tokens

    @precondition(lambda self: self.table.num_free_rows > 0)
    @rule()
    def start(self) -> None:
        self.lengths[self.table.alloc_row()] = 0

    @precondition(lambda self: bool(self.lengths))
    @rule(data=st.data(), grow=st.integers(1, 12))
    def grow(self, data: st.DataObject, grow: int) -> None:
        row = data.draw(st.sampled_from(sorted(self.lengths)))
        new_length = min(self.lengths[row] + grow, self.table.max_tokens_per_req)
        need = self.table.pages_needed(row, new_length)
        free_before = self.alloc.num_free
        try:
            pages = self.alloc.alloc(need)
        except OutOfPagesError:
            assert need > free_before and self.alloc.num_free == free_before
            return
        self.table.append_pages(row, pages)
        self.lengths[row] = new_length

    @precondition(lambda self: bool(self.lengths))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        row = data.draw(st.sampled_from(sorted(self.lengths)))
        self.alloc.free(self.table.free_row(row))
        del self.lengths[row]

    @invariant()
    def every_page_has_exactly_one_owner(self) -> None:
        held = [p for row in self.lengths for p in self.table.row_pages(row).tolist()]
        assert len(held) == len(set(held))
        assert self.alloc.num_free + len(held) == self.NUM_PAGES
        assert not any(self.alloc.is_free(p) for p in held)

    @invariant()
    def live_tokens_have_distinct_slots(self) -> None:
        rows = sorted(self.lengths)
        slots = self.table.batch_token_slots(rows, [0] * len(rows),
                                             [self.lengths[r] for r in rows]).tolist()
        assert len(slots) == sum(self.lengths.values()) == len(set(slots))

    def teardown(self) -> None:
        for row in list(self.lengths):
            self.alloc.free(self.table.free_row(row))
        assert self.alloc.num_free == self.NUM_PAGES, "every page returns once all requests end"


PagedRequests.TestCase.settings = settings(max_examples=60, stateful_step_count=30,
                                           deadline=None)
test_paged_requests_never_share_a_slot = PagedRequests.TestCase
