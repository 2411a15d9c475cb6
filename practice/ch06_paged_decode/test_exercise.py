"""Tests for the paged decode exercise: they are its specification.

Requests get pages scattered over a real KV pool (chapter 5's pool and page table). Your
``paged_decode`` must give what the engine's torch backend gives for the same decode batch, and
what plain causal attention over each request's whole sequence gives for its last token.
"""

from __future__ import annotations

import pytest
import torch
from paged_decode import paged_decode

from minisgl.attention import TorchNativeBackend, layout_of
from minisgl.kvcache import MHAKVPool
from minisgl.layers.attention import DenseCausalAttention
from minisgl.scheduler.table import PageTable

HEAD_DIM = 16
LENGTHS = [5, 1, 17, 33, 16]  # tokens per request, the new one included


class DecodeBatch:
    """A pool holding every request's past, plus the new token's q/k/v of each request."""

    def __init__(self, lengths: list[int], page_size: int, num_qo_heads: int, num_kv_heads: int,
                 dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        pages_per_req = [-(-n // page_size) for n in lengths]
        num_pages = sum(pages_per_req) + 3
        self.pool = MHAKVPool(1, num_kv_heads, HEAD_DIM, num_pages, page_size, dtype, "cpu")
        self.table = PageTable(len(lengths), max(pages_per_req), page_size=page_size)
        free = torch.randperm(num_pages, generator=generator).tolist()  # scattered pages
        self.rows = [self.table.alloc_row() for _ in lengths][::-1]
        for row, n in zip(self.rows, pages_per_req):
            self.table.append_pages(row, [free.pop() for _ in range(n)])
        self.lengths = lengths
        rand = lambda t, h: torch.randn(t, h, HEAD_DIM, generator=generator).to(dtype)
        self.q = [rand(n, num_qo_heads) for n in lengths]  # whole sequences, for the reference
        self.k = [rand(n, num_kv_heads) for n in lengths]
        self.v = [rand(n, num_kv_heads) for n in lengths]
        for row, n, k, v in zip(self.rows, lengths, self.k, self.v):  # store every token's K/V
            self.pool.store_kv(k, v, self.table.token_slots(row, 0, n), 0)

    def new_q(self) -> torch.Tensor:
        return torch.stack([q[-1] for q in self.q])

    def slots(self) -> list[torch.Tensor]:
        return [self.table.token_slots(row, 0, n) for row, n in zip(self.rows, self.lengths)]

    def yours(self) -> torch.Tensor:
        return paged_decode(self.new_q(), self.pool.k_cache(0), self.pool.v_cache(0), self.slots())

    def engine(self) -> torch.Tensor:
        """The torch backend on the same batch (it re-stores the new K/V: same values)."""
        backend = TorchNativeBackend(self.pool, self.table, self.q[0].shape[1])
        backend.prepare(layout_of(self.rows, [n - 1 for n in self.lengths], [1] * len(self.rows),
                                  is_decode=True))
        return backend.forward(self.new_q(), torch.stack([k[-1] for k in self.k]),
                               torch.stack([v[-1] for v in self.v]), 0)

    def dense(self) -> torch.Tensor:
        """Causal attention over each whole sequence, its last row."""
        dense = DenseCausalAttention()
        rows = [dense.forward(q, k, v, 0)[-1] for q, k, v in zip(self.q, self.k, self.v)]
        return torch.stack(rows)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def test_output_has_the_shape_and_dtype_of_q() -> None:
    batch = DecodeBatch(LENGTHS, page_size=4, num_qo_heads=4, num_kv_heads=2)
    out = batch.yours()
    assert out.shape == batch.new_q().shape, f"expected [B, Hq, D] = {tuple(batch.new_q().shape)}"
    assert out.dtype == torch.float32


def test_a_one_token_request_returns_its_own_value() -> None:
    batch = DecodeBatch([1], page_size=1, num_qo_heads=2, num_kv_heads=2)
    expected = batch.v[0][0]  # one key: softmax gives it probability 1
    assert max_err(batch.yours()[0], expected) <= 1e-6, \
        "with a single key the output must be exactly that token's value vector"


@pytest.mark.parametrize("page_size", [1, 16])
def test_multi_head_attention_equals_the_dense_reference(page_size: int) -> None:
    batch = DecodeBatch(LENGTHS, page_size, num_qo_heads=2, num_kv_heads=2)
    err = max_err(batch.yours(), batch.dense())
    assert err <= 1e-5, (f"max |yours - dense| = {err:.2e}: check that you read each request's "
                         "keys through its own slots and scale the scores by 1/sqrt(head_dim)")


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("num_qo_heads", [4, 8])
def test_grouped_query_attention_equals_the_engine_and_the_dense_reference(
        page_size: int, num_qo_heads: int) -> None:
    batch = DecodeBatch(LENGTHS, page_size, num_qo_heads=num_qo_heads, num_kv_heads=2)
    yours = batch.yours()
    err_engine = max_err(yours, batch.engine())
    err_dense = max_err(yours, batch.dense())
    assert err_engine <= 1e-5, f"max |yours - TorchNativeBackend| = {err_engine:.2e}"
    assert err_dense <= 1e-5, f"max |yours - dense| = {err_dense:.2e}"


def test_query_head_h_reads_kv_head_h_over_group() -> None:
    batch = DecodeBatch([6], page_size=4, num_qo_heads=4, num_kv_heads=2)
    v_cache = batch.pool.v_cache(0)
    v_cache[:, 0] = 0.0  # KV head 0's values are all 0, KV head 1's all 1
    v_cache[:, 1] = 1.0
    out = paged_decode(batch.new_q(), batch.pool.k_cache(0), v_cache, batch.slots())
    means = out[0].mean(dim=-1).tolist()
    assert means == pytest.approx([0, 0, 1, 1], abs=1e-6), (
        f"per query head mean {means}: query heads 0,1 share KV head 0 and heads 2,3 share "
        "KV head 1 (head h reads KV head h // group, not h % num_kv_heads)")


def test_requests_do_not_see_each_others_keys() -> None:
    batch = DecodeBatch([3, 9], page_size=1, num_qo_heads=2, num_kv_heads=1)
    before = batch.yours()[0]
    slots = batch.slots()
    other = slots[1]
    batch.pool.k_cache(0)[other] += 5.0  # change only the second request's keys and values
    batch.pool.v_cache(0)[other] += 5.0
    after = paged_decode(batch.new_q(), batch.pool.k_cache(0), batch.pool.v_cache(0), slots)[0]
    assert max_err(before, after) <= 1e-6, \
        "request 0's output changed when only request 1's K/V did"


def test_bfloat16_inputs_give_bfloat16_close_to_the_float32_reference() -> None:
    batch = DecodeBatch(LENGTHS, page_size=16, num_qo_heads=4, num_kv_heads=2,
                        dtype=torch.bfloat16)
    out = batch.yours()
    assert out.dtype == torch.bfloat16, "return the dtype of q"
    err = max_err(out, batch.dense())  # the dense reference upcasts to float32 inside
    assert err <= 2e-2, f"max error {err:.2e}: compute scores and softmax in float32"


def test_the_cache_is_left_unchanged() -> None:
    batch = DecodeBatch(LENGTHS, page_size=4, num_qo_heads=4, num_kv_heads=2)
    k_before, v_before = batch.pool.k_cache(0).clone(), batch.pool.v_cache(0).clone()
    batch.yours()
    unchanged = (torch.equal(batch.pool.k_cache(0), k_before)
                 and torch.equal(batch.pool.v_cache(0), v_before))
    assert unchanged, "paged_decode must only read the cache"
