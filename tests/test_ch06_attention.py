"""Chapter 6: paged attention backends against a dense reference.

Every check has the same shape. Requests of different lengths are given pages scattered over
the pool; the tokens they had before this pass (a cached prefix, earlier decode steps) are
already stored there. A backend then runs one forward pass of new tokens for all of them at
once, and each request's output must equal what plain causal attention over that request's
whole sequence gives for its new tokens. On the CPU, in float32, the torch backend must agree
to 1e-5; on a GPU, FlashInfer must agree in bfloat16 within the tolerance stated below.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from minisgl.attention import (
    BatchLayout,
    TorchNativeBackend,
    create_attention_backend,
    layout_of,
    resolve_attention_backend,
    total_lens,
)
from minisgl.attention.base import BaseAttnBackend
from minisgl.attention.base import pad_batch
from minisgl.attention.fi import import_flashinfer, page_arrays
from minisgl.attention.utils import indptr_of
from minisgl.kvcache import MHAKVPool
from minisgl.layers.attention import DenseCausalAttention, use_attention_backend
from minisgl.models import load_model
from minisgl.kvcache.page_table import PageTable, pages_for

PAGE_SIZES = [1, 16]
HQ, HKV, HEAD_DIM = 4, 2, 64  # the tiny model's shape: FlashInfer's kernels are compiled once
NUM_LAYERS = 2
# (cached_len, new_len) per request: empty and non-empty prefixes, prefixes that end inside a
# page and on a page boundary, single-token prompts, chunks that cross several pages.
PREFILL_CASE = [(0, 7), (5, 1), (17, 9), (0, 1), (32, 16), (3, 20)]
DECODE_CASE = [(6, 1), (0, 1), (15, 1), (16, 1), (40, 1)]
CPU_TOLERANCE = 1e-5
# bfloat16 keeps 8 bits of mantissa: an output of size x is rounded by up to x / 256, and a
# fused kernel also rounds the softmax probabilities to bfloat16 before the P @ V product. So
# |out - ref| <= BF16_ATOL + BF16_RTOL * |ref| elementwise: a few roundings, in relative terms.
BF16_ATOL, BF16_RTOL = 1e-2, 2e-2


# ---------------------------------------------------------------------------------------------
# A scenario: a pool, a page table, requests with their whole sequences' q/k/v


@dataclass
class Scenario:
    pool: MHAKVPool
    table: PageTable
    layout: BatchLayout
    k: list[list[torch.Tensor]]  # [layer][request] -> [total_len, HKV, D]
    v: list[list[torch.Tensor]]
    qs: list[list[torch.Tensor]]  # [layer][request] -> [total_len, HQ, D]

    def new_tokens(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The packed q/k/v of this pass's new tokens, as the model would hand them over."""
        cached = self.layout.cached_lens
        cat = lambda ts: torch.cat([t[c:] for t, c in zip(ts, cached)])
        return cat(self.qs[layer]), cat(self.k[layer]), cat(self.v[layer])

    def reference(self, layer: int) -> torch.Tensor:
        """Dense causal attention over each whole sequence, the new tokens' rows, packed."""
        dense = DenseCausalAttention()
        outs = [dense.forward(q, k, v, layer)[c:] for q, k, v, c in
                zip(self.qs[layer], self.k[layer], self.v[layer], self.layout.cached_lens)]
        return torch.cat(outs)


def make_scenario(case: list[tuple[int, int]], page_size: int, *, is_decode: bool = False,
                  dtype: torch.dtype = torch.float32, device: str = "cpu",
                  num_qo_heads: int = HQ, seed: int = 0) -> Scenario:
    generator = torch.Generator().manual_seed(seed)
    total = [c + n for c, n in case]
    max_pages = pages_for(max(total), page_size) + 1
    num_pages = sum(pages_for(t, page_size) for t in total) + 8
    pool = MHAKVPool(NUM_LAYERS, HKV, HEAD_DIM, num_pages, page_size, dtype, device)
    table = PageTable(len(case) + 2, max_pages, page_size=page_size, device=device)
    # Hand out the pages in a shuffled order, so no request's pages are contiguous or ordered.
    free = torch.randperm(num_pages, generator=generator).tolist()
    rows = [table.alloc_row() for _ in case][::-1]  # request i is not row i
    for row, n in zip(rows, total):
        need = table.pages_needed(row, n)
        table.append_pages(row, [free.pop() for _ in range(need)])

    def rand(t: int, heads: int) -> torch.Tensor:
        return torch.randn(t, heads, HEAD_DIM, generator=generator).to(device, dtype)

    qs = [[rand(t, num_qo_heads) for t in total] for _ in range(NUM_LAYERS)]
    ks = [[rand(t, HKV) for t in total] for _ in range(NUM_LAYERS)]
    vs = [[rand(t, HKV) for t in total] for _ in range(NUM_LAYERS)]
    # The past: earlier passes stored the cached tokens' K/V.
    for layer in range(NUM_LAYERS):
        for row, (cached, _), k, v in zip(rows, case, ks[layer], vs[layer]):
            if cached:
                pool.store_kv(k[:cached], v[:cached], table.token_slots(row, 0, cached), layer)
    layout = layout_of(rows, [c for c, _ in case], [n for _, n in case], is_decode=is_decode)
    return Scenario(pool, table, layout, ks, vs, qs)


def run_backend(backend: BaseAttnBackend, scenario: Scenario) -> list[float]:
    """Prepare once, run every layer; max |output - reference| per layer.

    Raises AssertionError when a bfloat16 output leaves the BF16_ATOL/BF16_RTOL band.
    """
    backend.prepare(scenario.layout)
    errors = []
    for layer in range(NUM_LAYERS):
        q, k, v = scenario.new_tokens(layer)
        out = backend.forward(q, k, v, layer)
        assert out.shape == q.shape and out.dtype == q.dtype
        reference = scenario.reference(layer).float()
        errors.append((out.float() - reference).abs().max().item())
        if out.dtype == torch.bfloat16:
            assert_bf16_close(out, reference, f"layer {layer}")
    return errors


def assert_bf16_close(out: torch.Tensor, reference: torch.Tensor, what: str) -> None:
    diff = (out.float() - reference.float()).abs()
    excess = diff - (BF16_ATOL + BF16_RTOL * reference.float().abs())
    assert excess.max().item() <= 0, (f"{what}: |out - ref| exceeds {BF16_ATOL} + {BF16_RTOL} "
                                      f"* |ref| (max |out - ref| = {diff.max().item():.3e})")


# ---------------------------------------------------------------------------------------------
# The helpers of attention/utils.py


def test_indptr_is_the_running_sum_with_a_leading_zero() -> None:
    assert indptr_of([3, 1, 4]) == [0, 3, 4, 8]
    assert indptr_of([]) == [0]


@pytest.mark.parametrize("tokens, pages, last", [(1, 1, 1), (16, 1, 16), (17, 2, 1), (40, 3, 8)])
def test_pages_and_last_page_length(tokens: int, pages: int, last: int) -> None:
    assert pages_for(tokens, 16) == pages
    table = PageTable(1, 3, page_size=16)
    row = table.alloc_row()
    table.append_pages(row, [4, 5, 6][:pages])
    arrays = page_arrays(table, layout_of([row], [0], [tokens]))
    assert arrays["page_indptr"].tolist() == [0, pages]
    assert arrays["last_page_lens"].tolist() == [last]


def test_the_decode_slot_table_holds_each_request_s_slots_and_masks_the_padding() -> None:
    scenario = make_scenario([(1, 1), (5, 1), (2, 1)], page_size=4, is_decode=True)
    backend = TorchNativeBackend(scenario.pool, scenario.table, HQ)
    meta = backend.prepare(scenario.layout)
    totals = total_lens(scenario.layout)
    assert meta.slot_valid.tolist() == [[j < t for j in range(max(totals))] for t in totals]
    for i, (row, total) in enumerate(zip(scenario.layout.rows, totals)):
        slots = scenario.table.token_slots(row, 0, total).tolist()
        assert meta.slot_table[i, :total].tolist() == slots, f"request {i}'s slots, in order"
        assert set(meta.slot_table[i, total:].tolist()) <= {slots[0]}, "padding: position 0"


def test_page_arrays_read_each_rows_first_pages() -> None:
    table = PageTable(3, 4, page_size=16)
    a, b = table.alloc_row(), table.alloc_row()
    table.append_pages(a, [9, 2, 7])
    table.append_pages(b, [5])
    arrays = page_arrays(table, layout_of([b, a], [0, 20], [1, 3]))  # 1 and 23 tokens
    assert arrays["page_indices"].tolist() == [5, 9, 2]
    assert arrays["page_indptr"].tolist() == [0, 1, 3]
    assert arrays["last_page_lens"].tolist() == [1, 7]
    assert arrays["qo_indptr"].tolist() == [0, 1, 4]


# ---------------------------------------------------------------------------------------------
# The batch description and the backend's contract


def test_layout_counts_tokens_and_exposes_per_request_lists() -> None:
    layout = layout_of([4, 1], [10, 0], [3, 5])
    assert (layout.size, layout.num_tokens) == (2, 8)
    assert total_lens(layout) == [13, 5]


@pytest.mark.parametrize("spans, is_decode, message", [
    ([], False, "at least one request"),
    ([(0, 0, 0)], False, "new_len 0 >= 1"),
    ([(0, -1, 2)], False, "cached_len -1 must be >= 0"),
    ([(0, 4, 2)], True, "exactly 1 in a decode batch"),
    ([(3, 0, 2), (3, 5, 1)], False, "more than once"),
])
def test_layout_rejects_impossible_batches(spans: list[tuple[int, int, int]], is_decode: bool,
                                           message: str) -> None:
    rows, cached, new = ([list(c) for c in zip(*spans)] if spans else ([], [], []))
    with pytest.raises(ValueError, match=message):
        layout_of(rows, cached, new, is_decode=is_decode)


def test_prepare_computes_slots_positions_and_last_token_indices() -> None:
    s = make_scenario([(3, 2), (0, 4)], page_size=4)
    meta = TorchNativeBackend(s.pool, s.table, HQ).prepare(s.layout)
    (row_a, row_b) = s.layout.rows
    expected_slots = torch.cat([s.table.token_slots(row_a, 3, 5), s.table.token_slots(row_b, 0, 4)])
    assert meta.out_loc.tolist() == expected_slots.tolist()
    assert meta.positions.tolist() == [3, 4, 0, 1, 2, 3]
    assert meta.last_indices.tolist() == [1, 5]


def test_forward_stores_the_new_keys_and_values_in_the_pool() -> None:
    s = make_scenario(PREFILL_CASE, page_size=16)
    backend = TorchNativeBackend(s.pool, s.table, HQ)
    meta = backend.prepare(s.layout)
    q, k, v = s.new_tokens(1)
    backend.forward(q, k, v, 1)
    stored_k, stored_v = s.pool.gather_kv(meta.out_loc, 1)
    assert torch.equal(stored_k, k) and torch.equal(stored_v, v)


def test_forward_before_prepare_is_an_error() -> None:
    s = make_scenario([(0, 3)], page_size=1)
    with pytest.raises(RuntimeError, match="call prepare"):
        TorchNativeBackend(s.pool, s.table, HQ).forward(*s.new_tokens(0), 0)
    with pytest.raises(RuntimeError, match="call prepare"):
        TorchNativeBackend(s.pool, s.table, HQ).metadata


def test_forward_with_a_different_token_count_is_an_error() -> None:
    s = make_scenario([(0, 3)], page_size=1)
    backend = TorchNativeBackend(s.pool, s.table, HQ)
    backend.prepare(s.layout)
    q, k, v = s.new_tokens(0)
    with pytest.raises(ValueError, match="prepared batch has 3"):
        backend.forward(q[:2], k[:2], v[:2], 0)


def test_prepare_rejects_tokens_beyond_the_rows_pages() -> None:
    s = make_scenario([(0, 3)], page_size=1)
    (row,) = s.layout.rows
    with pytest.raises(ValueError, match="outside row"):
        TorchNativeBackend(s.pool, s.table, HQ).prepare(layout_of([row], [3], [1]))


def test_backend_rejects_a_page_table_with_another_page_size() -> None:
    pool = MHAKVPool(1, HKV, HEAD_DIM, 4, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="page"):
        TorchNativeBackend(pool, PageTable(2, 2, page_size=1), HQ)


def test_torch_backend_has_no_cuda_graph_hooks() -> None:
    s = make_scenario([(0, 3)], page_size=1)
    with pytest.raises(NotImplementedError, match="CUDA graphs"):
        TorchNativeBackend(s.pool, s.table, HQ).enable_cuda_graphs([4])


# ---------------------------------------------------------------------------------------------
# Torch-native paged attention = the dense reference (CPU, float32)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_torch_ragged_prefill_with_cached_prefixes_equals_dense(page_size: int) -> None:
    s = make_scenario(PREFILL_CASE, page_size)
    errors = run_backend(TorchNativeBackend(s.pool, s.table, HQ), s)
    assert max(errors) <= CPU_TOLERANCE, f"max |paged - dense| per layer: {errors}"


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_torch_decode_equals_dense(page_size: int) -> None:
    s = make_scenario(DECODE_CASE, page_size, is_decode=True)
    errors = run_backend(TorchNativeBackend(s.pool, s.table, HQ), s)
    assert max(errors) <= CPU_TOLERANCE, f"max |paged - dense| per layer: {errors}"


@pytest.mark.parametrize("num_qo_heads", [2, 8])
def test_torch_backend_handles_mha_and_wider_gqa_groups(num_qo_heads: int) -> None:
    for case, is_decode in ((PREFILL_CASE, False), (DECODE_CASE, True)):
        s = make_scenario(case, 16, is_decode=is_decode, num_qo_heads=num_qo_heads)
        errors = run_backend(TorchNativeBackend(s.pool, s.table, num_qo_heads), s)
        assert max(errors) <= CPU_TOLERANCE, f"group {num_qo_heads // HKV}: {errors}"


def test_decode_batch_gives_the_same_result_through_the_prefill_path() -> None:
    decode = make_scenario(DECODE_CASE, 16, is_decode=True)
    as_prefill = make_scenario(DECODE_CASE, 16, is_decode=False)
    backend_a = TorchNativeBackend(decode.pool, decode.table, HQ)
    backend_b = TorchNativeBackend(as_prefill.pool, as_prefill.table, HQ)
    backend_a.prepare(decode.layout)
    backend_b.prepare(as_prefill.layout)
    out_a = backend_a.forward(*decode.new_tokens(0), 0)
    out_b = backend_b.forward(*as_prefill.new_tokens(0), 0)
    assert (out_a - out_b).abs().max().item() <= CPU_TOLERANCE


# ---------------------------------------------------------------------------------------------
# The whole tiny model through the paged backend


def paged_model_run(model, prompts: list[list[int]], page_size: int,
                    backend_name: str = "torch"
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
    """Prefill every prompt in two chunks, then decode one greedy token, all batched.

    Returns the logits of every prompt token (per prompt), the decode step's logits and the
    tokens that step was fed.
    """
    config = model.config
    weight = next(model.parameters())
    device, dtype = weight.device, weight.dtype
    longest = max(len(p) for p in prompts) + 1
    pool = MHAKVPool.from_config(config, 8 * len(prompts) * pages_for(longest, page_size),
                                 page_size, dtype, device)
    table = PageTable(len(prompts), pages_for(longest, page_size), page_size=page_size,
                      device=device)
    backend = create_attention_backend(backend_name, pool, table, config.num_qo_heads)
    next_page = iter(range(pool.num_pages - 1, -1, -1))  # from the top: not in row order
    rows = [table.alloc_row() for _ in prompts]
    for row in rows:
        table.append_pages(row, [next(next_page) for _ in range(table.pages_needed(row, longest))])

    def run(layout: BatchLayout, tokens: list[int], all_rows: bool) -> torch.Tensor:
        meta = backend.prepare(layout)
        with use_attention_backend(backend), torch.no_grad():
            ids = torch.tensor(tokens, device=device)
            return model.forward(ids, meta.positions, None if all_rows else meta.last_indices)

    # First pass: the first half of each prompt. Second pass: the rest, over a cached prefix.
    split = [max(1, len(p) // 2) for p in prompts]
    first = run(layout_of(rows, [0] * len(prompts), split),
                [t for p, s in zip(prompts, split) for t in p[:s]], all_rows=True)
    rest = [(r, s, len(p) - s) for r, s, p in zip(rows, split, prompts) if len(p) > s]
    second = run(layout_of(*[list(column) for column in zip(*rest)]),
                 [t for p, s in zip(prompts, split) for t in p[s:]], all_rows=True)
    per_prompt, a, b = [], 0, 0
    for p, s in zip(prompts, split):
        chunks = [first[a:a + s]]
        a += s
        if len(p) > s:
            chunks.append(second[b:b + len(p) - s])
            b += len(p) - s
        per_prompt.append(torch.cat(chunks))
    next_tokens = [int(logits[-1].argmax()) for logits in per_prompt]
    decode = run(layout_of(rows, [len(p) for p in prompts], [1] * len(prompts), is_decode=True),
                 next_tokens, all_rows=False)
    return per_prompt, list(decode), next_tokens


def dense_model_run(model, prompts: list[list[int]], next_tokens: list[int]
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The same logits, one prompt at a time, with chapter 3's dense attention."""
    device = next(model.parameters()).device
    prompt_logits, decode_logits = [], []
    with torch.no_grad():
        for prompt, token in zip(prompts, next_tokens):
            logits = model.forward(torch.tensor(prompt, device=device),
                                   torch.arange(len(prompt), device=device))
            prompt_logits.append(logits)
            seq = prompt + [token]  # the token the paged run decoded (bf16 may break ties)
            decode_logits.append(model.forward(torch.tensor(seq, device=device),
                                               torch.arange(len(seq), device=device))[-1])
    return prompt_logits, decode_logits


def model_errors(model, page_size: int,
                 backend_name: str = "torch") -> tuple[float, float, float]:
    """Max |paged - dense| logits for prompt tokens and for a decode step; max |dense logit|."""
    generator = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompts = [torch.randint(vocab, (n,), generator=generator).tolist() for n in (9, 1, 23, 16)]
    paged, paged_decode, next_tokens = paged_model_run(model, prompts, page_size, backend_name)
    dense, dense_decode = dense_model_run(model, prompts, next_tokens)
    prefill_err = max((a - b).abs().max().item() for a, b in zip(paged, dense))
    decode_err = max((a - b).abs().max().item() for a, b in zip(paged_decode, dense_decode))
    return prefill_err, decode_err, max(d.abs().max().item() for d in dense)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_tiny_qwen3_batched_paged_forward_equals_per_prompt_dense(tiny_model_dir: Path,
                                                                   page_size: int) -> None:
    model = load_model(tiny_model_dir, device="cpu", dtype="float32", progress=False)
    prefill_err, decode_err, _ = model_errors(model, page_size)
    assert prefill_err <= 1e-4 and decode_err <= 1e-4, \
        f"max |logits paged - dense|: prefill {prefill_err:.2e}, decode {decode_err:.2e}"


# ---------------------------------------------------------------------------------------------
# Choosing a backend


def test_auto_on_cpu_is_the_torch_backend() -> None:
    assert resolve_attention_backend("auto", torch.device("cpu"), torch.float32, 64) == "torch"
    s = make_scenario([(0, 3)], page_size=1)
    assert isinstance(create_attention_backend("auto", s.pool, s.table, HQ), TorchNativeBackend)


def test_flashinfer_on_cpu_is_a_clear_error() -> None:
    s = make_scenario([(0, 3)], page_size=1)
    with pytest.raises(ValueError, match="needs a CUDA device.*torch backend"):
        create_attention_backend("flashinfer", s.pool, s.table, HQ)


def test_unknown_backend_name_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown attention backend 'fa'.*auto, torch, flashinfer"):
        resolve_attention_backend("fa", torch.device("cpu"), torch.float32, 64)


def test_missing_flashinfer_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` fail
    with pytest.raises(ImportError, match="pip install"):
        import_flashinfer()


# ---------------------------------------------------------------------------------------------
# GPU: torch-native on CUDA, FlashInfer prefill/decode and its CUDA-graph decode


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_backend_on_cuda_equals_dense(page_size: int, dtype: torch.dtype) -> None:
    for case, is_decode in ((PREFILL_CASE, False), (DECODE_CASE, True)):
        s = make_scenario(case, page_size, is_decode=is_decode, dtype=dtype, device="cuda")
        errors = run_backend(TorchNativeBackend(s.pool, s.table, HQ), s)  # checks bf16 itself
        if dtype == torch.float32:
            assert max(errors) <= 1e-4, f"decode={is_decode}: {errors}"


def flashinfer_backend(s: Scenario, num_qo_heads: int = HQ) -> BaseAttnBackend:
    pytest.importorskip("flashinfer", reason="flashinfer-python is not installed")
    return create_attention_backend("flashinfer", s.pool, s.table, num_qo_heads)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_flashinfer_prefill_equals_dense_in_bf16(page_size: int) -> None:
    s = make_scenario(PREFILL_CASE, page_size, dtype=torch.bfloat16, device="cuda")
    errors = run_backend(flashinfer_backend(s), s)
    print(f"flashinfer prefill, page size {page_size}: max err {max(errors):.3e}")


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("num_qo_heads", [HQ, 4 * HKV * 2], ids=["group2", "group8-tensor-cores"])
def test_flashinfer_decode_equals_dense_in_bf16(page_size: int, num_qo_heads: int) -> None:
    s = make_scenario(DECODE_CASE, page_size, is_decode=True, dtype=torch.bfloat16,
                      device="cuda", num_qo_heads=num_qo_heads)
    errors = run_backend(flashinfer_backend(s, num_qo_heads), s)
    print(f"flashinfer decode, page size {page_size}, {num_qo_heads} q heads: "
          f"max err {max(errors):.3e}")


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_flashinfer_cuda_graph_decode_replays_a_smaller_padded_batch(page_size: int) -> None:
    check_graph_decode_replay(page_size, DECODE_CASE[:3], 4)  # three requests, one padding entry


def check_graph_decode_replay(page_size: int, case: list[tuple[int, int]], graph_bs: int) -> None:
    """Capture a decode of ``graph_bs`` entries, replay it for ``case``: equal to the same call
    made eagerly, and within bf16 of the unpadded eager decode and of dense attention."""
    s = make_scenario(case, page_size, is_decode=True, dtype=torch.bfloat16, device="cuda")
    backend = flashinfer_backend(s)
    used = set(s.table.page_ids[s.table.page_ids >= 0].tolist())
    pad_row = s.table.alloc_row()  # the padding row: one page no request owns
    s.table.append_pages(pad_row, [next(p for p in range(s.pool.num_pages) if p not in used)])
    num_reqs = len(case)
    backend.enable_cuda_graphs([graph_bs])
    fields = torch.zeros(3 * graph_bs, dtype=torch.int64, device="cuda")  # fixed, as the engine's
    static_q = torch.zeros(graph_bs, HQ, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    static_k = torch.zeros(graph_bs, HKV, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    static_v = torch.zeros_like(static_k)
    backend.prepare(pad_batch(None, graph_bs, pad_row), out=fields)
    backend.forward(static_q, static_k, static_v, 0)  # warm up (and compile) outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = backend.forward(static_q, static_k, static_v, 0)

    meta = backend.prepare(pad_batch(s.layout, graph_bs, pad_row), out=fields)
    assert meta.out_loc.data_ptr() == fields[graph_bs:].data_ptr(), "read where captured"
    assert meta.positions.tolist()[num_reqs:] == [0] * (graph_bs - num_reqs)
    q, k, v = s.new_tokens(0)
    static_q[:num_reqs], static_k[:num_reqs], static_v[:num_reqs] = q, k, v
    graph.replay()
    replayed = static_out[:num_reqs].clone()
    same_plan = backend.forward(static_q, static_k, static_v, 0)[:num_reqs]  # eager, same buffers

    backend.prepare(s.layout)
    eager = backend.forward(q, k, v, 0)  # the ordinary decode wrapper, no padding
    err_same_plan = (replayed.float() - same_plan.float()).abs().max().item()
    err_eager = (replayed.float() - eager.float()).abs().max().item()
    err_dense = (replayed.float() - s.reference(0).float()).abs().max().item()
    print(f"flashinfer graph decode, page size {page_size}: vs eager same plan "
          f"{err_same_plan:.3e}, vs eager {err_eager:.3e}, vs dense {err_dense:.3e}")
    assert err_same_plan == 0.0, "a replayed graph must compute what the same call does eagerly"
    # The graph's wrapper may split long sequences differently from the eager one, which
    # changes the order of the bfloat16 partial sums, so only the tolerance is promised.
    assert_bf16_close(replayed, eager, "replay vs eager")
    assert_bf16_close(replayed, s.reference(0), "replay vs dense")


@pytest.mark.gpu
@pytest.mark.parametrize("backend_name", ["torch", "flashinfer"])
def test_tiny_qwen3_on_cuda_bf16_paged_logits_match_dense(tiny_model_dir: Path,
                                                          backend_name: str) -> None:
    if backend_name == "flashinfer":
        pytest.importorskip("flashinfer", reason="flashinfer-python is not installed")
    model = load_model(tiny_model_dir, device="cuda", dtype="bfloat16", progress=False)
    prefill_err, decode_err, scale = model_errors(model, 16, backend_name)
    print(f"tiny-qwen3 bf16 {backend_name}: max |logit diff| prefill {prefill_err:.3e}, "
          f"decode {decode_err:.3e} (max |logit| {scale:.2f})")
    # Both sides run the whole model in bfloat16: the attention outputs differ by rounding,
    # which the following layers carry on. Near the largest logit one bfloat16 step is
    # scale / 128 or so; allow a few of them.
    assert max(prefill_err, decode_err) <= 0.04 * scale
