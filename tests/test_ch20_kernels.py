"""The kernels of ``minisgl/kernel/``, each against the plain code it replaces.

On the CPU: the seam answers "no kernel" without the package and for CPU tensors, and the
host-side parts (cutting a decode batch into pieces, staging them for a graph, the merge's
PyTorch reference, laying out MoE rows) are checked exactly. On a GPU in bfloat16: every
kernel against its PyTorch reference (``use_fused(False)`` runs the PyTorch code on the same
GPU), in place where it works in place, inside CUDA graphs, and in whole engines. Shapes are
Qwen3-0.6B's; token counts those of a decode step (1 and 138 requests) and of a prefill (2,048).
The two paths round differently (the kernels once, PyTorch after each operation), so an
element may differ by |d| <= 1e-2 + 2e-2 |reference|.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_ch02_layers import (
    EPS,
    HEAD_DIM,
    HIDDEN,
    INTERMEDIATE,
    MAX_POSITION,
    NUM_KV_HEADS,
    NUM_QO_HEADS,
    ROPE_SCALINGS,
    THETA,
    T,
)
from test_ch06_attention import (
    DECODE_CASE,
    HKV,
    HQ,
    PAGE_SIZES,
    assert_bf16_close,
    check_graph_decode_replay,
    flashinfer_backend,
    make_scenario,
    run_backend,
)
from test_ch06_attention import HEAD_DIM as ATTN_HEAD_DIM
from test_ch08_cuda_graph import (
    BF16_RELATIVE_TOLERANCE,
    check_replay_against_eager,
    decode_batch,
    graph_engine,
    ragged_prompts,
    random_decode_batches,
)
from test_ch18_models import E, H, random_experts, rel_err, tiny_checkpoint

from minisgl.core import Batch
from minisgl.kernel import flashinfer_ops, gemv, kernel_status, pieces, qk_prologue, use_fused
from minisgl.kernel.moe import align_by_expert, moe_fused
from minisgl.kernel.pieces import (
    PIECES_MIN_BATCH,
    cut_into_pieces,
    merge_pieces,
    num_decode_pieces,
    piece_length,
)
from minisgl.kvcache.page_table import PageTable
from minisgl.layers import ReplicatedLinear, RMSNorm, fast, get_rope, silu_and_mul
from minisgl.layers.fast import KVDestination, PlainPaths
from minisgl.models import load_model
from minisgl.moe import route_topk, use_moe_impl
from minisgl.moe.reference import moe_reference
from minisgl.utils.torch_utils import default_dtype

ROOT = Path(__file__).resolve().parent.parent
# A decode batch large enough to be cut into pieces, with mixed lengths.
LARGE_DECODE_CASE = [((7 + 13 * i) % 90, 1) for i in range(PIECES_MIN_BATCH)]


# ------------------------------------------------------------------ the seam


def test_without_the_kernel_package_the_seam_takes_no_call() -> None:
    """With ``minisgl.kernel`` hidden, a fresh interpreter gets the plain answers everywhere,
    even where a CUDA GPU is (the probe says there is one)."""
    probe = ("import sys, torch; sys.modules['minisgl.kernel'] = None\n"
             "torch.cuda.is_available = lambda: True\n"
             "from minisgl.layers import fast\n"
             "print(type(fast.paths).__name__, fast.paths.decode_pieces(1000))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    assert out.stdout.split() == ["PlainPaths", "0"]


def test_the_kernels_answer_the_seam_where_a_gpu_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the package and a CUDA GPU the kernels answer; with no GPU the plain answers do,
    since no kernel could take a call."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert type(fast._kernels_or_plain()).__name__ == "Kernels"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert type(fast._kernels_or_plain()).__name__ == "PlainPaths"
    plain = PlainPaths()
    x = torch.randn(2, 8)
    assert plain.rmsnorm(x, torch.ones(8), EPS, None) is None and plain.matmul(x, x, None) is None
    assert plain.decode_pieces(10**6) == 0 and not plain.can_moe(x.bfloat16())


# ------------------------------------------------------------------ on the CPU


def test_fused_kernels_are_never_used_for_cpu_tensors() -> None:
    x = torch.randn(T, HIDDEN)
    norm = RMSNorm(HIDDEN, eps=EPS)
    norm.load_weight(torch.ones(HIDDEN))
    assert not flashinfer_ops.available(x) and not flashinfer_ops.available(x.bfloat16())
    assert not flashinfer_ops.can_rmsnorm(x, norm.weight, x.clone())
    assert not flashinfer_ops.can_silu_and_mul(torch.randn(T, 2 * INTERMEDIATE))
    assert not gemv.can_gemv(x[:1], torch.randn(8, HIDDEN))
    assert not gemv.can_gemv(x[:1].bfloat16(), torch.randn(8, HIDDEN).bfloat16())


@pytest.mark.parametrize("seed", range(20))
def test_piece_length_is_the_shortest_that_fits(seed: int) -> None:
    rng = np.random.default_rng(seed)
    num_pages = rng.integers(1, 200, size=rng.integers(1, 40))
    max_pieces = int(rng.integers(len(num_pages), 5 * len(num_pages) + 1))
    piece = piece_length(num_pages, max_pieces)
    pieces = lambda length: int((-(-num_pages // length)).sum())
    assert pieces(piece) <= max_pieces
    assert piece == 1 or pieces(piece - 1) > max_pieces


def test_piece_length_refuses_fewer_pieces_than_requests() -> None:
    with pytest.raises(ValueError, match="3 requests cannot fit in 2 pieces"):
        piece_length(np.array([4, 4, 4]), 2)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_pieces_cover_each_request_in_order_and_full_pages(page_size: int) -> None:
    rng = np.random.default_rng(page_size)
    tokens = rng.integers(1, 300, size=30)
    num_pages = -(-tokens // page_size)
    last = tokens - (num_pages - 1) * page_size
    piece = piece_length(num_pages, 4 * len(tokens))
    pages, piece_last, owners, piece_indptr = cut_into_pieces(num_pages, last, page_size, 4 * len(tokens))
    assert pages.max() <= piece and pages.min() >= 1
    for req in range(len(tokens)):
        mine = slice(piece_indptr[req], piece_indptr[req + 1])
        assert (owners[mine] == req).all()
        assert pages[mine].sum() == num_pages[req]
        # tokens: full pages, but for the request's own last page
        assert (pages[mine] - 1) @ np.full(len(pages[mine]), page_size) + piece_last[mine].sum() \
            == tokens[req]
        assert piece_last[mine][-1] == last[req]


@pytest.fixture
def pieces_on():
    """Decode in pieces, off by default (it did not pay when measured), on for the test."""
    from minisgl.kernel.trials import DEFAULT_STEPS

    with use_fused(DEFAULT_STEPS | {"pieces"}):
        yield


def test_decode_batches_are_cut_into_pieces_from_the_threshold_on(pieces_on) -> None:
    assert num_decode_pieces(PIECES_MIN_BATCH - 1) == 0
    assert num_decode_pieces(PIECES_MIN_BATCH) >= 2 * PIECES_MIN_BATCH


def merge_inputs(lens: list[int], piece: int, spare: int, seed: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, list[int], torch.Tensor]:
    """Each request's keys cut into pieces of ``piece`` keys, each piece attended alone (with
    its base-2 log-sum-exp), then ``spare`` rows no request owns; and attention over whole
    requests, the reference. Returns (out, lse, piece_indptr, reference) in float32."""
    generator = torch.Generator().manual_seed(seed)
    heads, dim = HQ, ATTN_HEAD_DIM
    q = torch.randn(len(lens), heads, dim, generator=generator)
    keys = [torch.randn(n, heads, dim, generator=generator) for n in lens]
    values = [torch.randn(n, heads, dim, generator=generator) for n in lens]

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.einsum("hd,nhd->hn", q, k) * dim**-0.5
        lse2 = torch.logsumexp(scores, dim=-1) / torch.log(torch.tensor(2.0))
        return torch.einsum("hn,nhd->hd", scores.softmax(-1), v), lse2

    outs, lses, piece_indptr = [], [], [0]
    for req, n in enumerate(lens):
        for start in range(0, n, piece):
            out, lse = attend(q[req], keys[req][start:start + piece],
                              values[req][start:start + piece])
            outs.append(out), lses.append(lse)
        piece_indptr.append(len(outs))
    out = torch.cat([torch.stack(outs), torch.randn(spare, heads, dim)])
    lse = torch.cat([torch.stack(lses), torch.full((spare, heads), 50.0)])
    reference = torch.stack([attend(q[r], keys[r], values[r])[0] for r in range(len(lens))])
    return out, lse, piece_indptr, reference


def merge_pieces_reference(out: torch.Tensor, lse: torch.Tensor,
                           piece_indptr: torch.Tensor) -> torch.Tensor:
    """``merge_pieces`` in PyTorch, the kernel's reference: a softmax over each request's
    pieces' log-sum-exps."""
    num_reqs = piece_indptr.shape[0] - 1
    merged = torch.empty(num_reqs, *out.shape[1:], dtype=out.dtype, device=out.device)
    for req, (first, end) in enumerate(zip(piece_indptr[:-1].tolist(),
                                           piece_indptr[1:].tolist())):
        lse_req = lse[first:end].float()  # [pieces, H]
        weights = torch.exp2(lse_req - lse_req.max(dim=0).values)
        weights = weights / weights.sum(dim=0)
        merged[req] = (weights[..., None] * out[first:end].float()).sum(dim=0).to(out.dtype)
    return merged


def test_the_merge_reference_equals_attention_over_whole_requests() -> None:
    out, lse, piece_indptr, reference = merge_inputs([1, 7, 40, 3, 129], piece=8, spare=3)
    merged = merge_pieces_reference(out, lse, torch.tensor(piece_indptr))
    assert (merged - reference).abs().max().item() <= 1e-5


@pytest.mark.parametrize("pieces_per_request", [1, 2, 4])
def test_replay_arrays_in_pieces_cover_each_request_once_in_order(
        pieces_per_request: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cut into pieces for a graph, the kernel's entries are runs of each request's pages: one
    request's runs, concatenated, are its pages in order, each run but the last made of full
    pages; and the entries left over, up to the graph's count, are spares of one token, which
    no request merges."""
    from minisgl.attention import layout_of
    from minisgl.attention.fi import piece_arrays
    from minisgl.kvcache.page_table import pages_for
    from minisgl.kernel import KERNELS
    from minisgl.layers import fast

    # The cut is host code (numpy): the kernels' answer runs here even without a GPU.
    monkeypatch.setattr(fast, "paths", KERNELS)
    size, width = 4, 12
    table = PageTable(6, width, page_size=size)
    for rows, lens, batch_size in random_decode_batches(table, 60, seed=1):
        num_pieces = pieces_per_request * len(rows) + (batch_size - len(rows))
        cached = [lens[row] for row in rows]
        arrays = piece_arrays(table, layout_of(rows, cached, [1] * len(rows), is_decode=True),
                              num_pieces, spares=True)
        num_pages = [pages_for(c + 1, size) for c in cached]
        pages = sum((table.row_pages(row)[:n].tolist() for row, n in zip(rows, num_pages)), [])
        last_lens = [c % size + 1 for c in cached]  # c + 1 tokens: the last page's share
        indices = arrays["page_indices"].tolist()
        indptr = arrays["page_indptr"].tolist()
        entry_last = arrays["last_page_lens"].tolist()
        owners = arrays["query_rows"].owners.tolist()
        piece_indptr = arrays["query_rows"].indptr.tolist()
        assert len(indptr) == num_pieces + 1 and len(owners) == num_pieces
        assert piece_indptr[0] == 0 and indptr[0] == 0
        start = 0
        for req in range(len(rows)):
            mine = range(piece_indptr[req], piece_indptr[req + 1])
            assert len(mine) >= 1 and all(owners[p] == req for p in mine)
            runs = [indices[indptr[p]: indptr[p + 1]] for p in mine]
            assert sum(runs, []) == pages[start: start + num_pages[req]]
            assert [entry_last[p] for p in mine] == [size] * (len(mine) - 1) + [last_lens[req]]
            start += num_pages[req]
        spares = range(piece_indptr[len(rows)], num_pieces)
        assert len(indices) == start + len(spares)
        assert all(indptr[p + 1] - indptr[p] == 1 and entry_last[p] == 1 for p in spares)
        for row in rows:
            lens[row] += 1


@pytest.mark.parametrize("num_tokens, top_k, block_m", [(1, 8, 16), (5, 2, 16), (200, 3, 64)])
def test_aligned_layout_puts_each_pair_once_in_a_block_of_its_expert(num_tokens: int, top_k: int,
                                                                       block_m: int) -> None:
    routing = route_topk(torch.randn(num_tokens, E, generator=torch.Generator().manual_seed(4)),
                         top_k, renormalize=True)
    aligned = align_by_expert(routing.expert_ids, E, block_m)
    num_pairs = num_tokens * top_k
    used = int(aligned.num_padded)
    rows = aligned.rows.tolist()
    real = [r for r in rows[:used] if r < num_pairs]
    assert sorted(real) == list(range(num_pairs))  # every pair exactly once
    assert all(r == num_pairs for r in rows[used:])  # nothing beyond the end
    flat = routing.expert_ids.flatten().tolist()
    for slot, pair in enumerate(rows[:used]):
        if pair < num_pairs:
            assert flat[pair] == aligned.block_expert[slot // block_m], "pair in a foreign block"
    assert used % block_m == 0 and aligned.block_expert[used // block_m:].eq(E).all()


# ------------------------------------------------------------------ on a GPU

BIG_HIDDEN, BIG_INTERMEDIATE, BIG_QO_HEADS, BIG_KV_HEADS, BIG_HEAD_DIM = 1024, 3072, 16, 8, 128


FUSED_TOKENS = [1, 138, 2048]


def assert_close_bf16(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    diff = (ours.float() - ref.float()).abs()
    excess = diff - (1e-2 + 2e-2 * ref.float().abs())
    assert excess.max().item() <= 0, (f"{what}: max |diff| {diff.max().item():.3e} "
                                      "above 1e-2 + 2e-2 |reference|")


def random_norm(size: int) -> RMSNorm:
    norm = RMSNorm(size, eps=EPS)
    norm.load_weight(1 + 0.1 * torch.randn(size))
    return norm


def split_qkv(qkv: torch.Tensor, num_qo: int, num_kv: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as the attention layer cuts them from the qkv output: strided per-head views."""
    q, k, _ = qkv.split([num_qo * head_dim, num_kv * head_dim, num_kv * head_dim], dim=-1)
    return q.view(-1, num_qo, head_dim), k.view(-1, num_kv, head_dim)


@pytest.fixture
def cuda_bf16() -> Iterator[None]:
    pytest.importorskip("flashinfer", reason="flashinfer-python is not installed")
    with torch.device("cuda"), default_dtype(torch.bfloat16), torch.inference_mode():
        yield


@pytest.mark.gpu
def test_fused_kernels_are_on_for_bfloat16_cuda_tensors(cuda_bf16: None) -> None:
    x = torch.randn(4, BIG_HIDDEN)
    norm = random_norm(BIG_HIDDEN)
    rope = get_rope(BIG_HEAD_DIM, BIG_HEAD_DIM, MAX_POSITION, THETA)
    q, k = torch.randn(4, BIG_QO_HEADS * BIG_HEAD_DIM), torch.randn(4, BIG_HEAD_DIM)
    positions = torch.arange(4)
    assert flashinfer_ops.available(x), kernel_status()
    assert flashinfer_ops.can_rmsnorm(x, norm.weight), kernel_status()
    assert flashinfer_ops.can_rmsnorm(x, norm.weight, x.clone()), kernel_status()
    assert flashinfer_ops.can_rope(positions, q, k, rope.cos_sin_cache, BIG_HEAD_DIM), kernel_status()
    assert flashinfer_ops.can_silu_and_mul(torch.randn(4, 2 * BIG_INTERMEDIATE)), kernel_status()
    qkv = torch.randn(4, (BIG_QO_HEADS + 2 * BIG_KV_HEADS) * BIG_HEAD_DIM)
    assert qk_prologue.can_qk_prologue(qkv, positions, rope.cos_sin_cache, BIG_HEAD_DIM,
                                 (norm.weight[:BIG_HEAD_DIM],) * 2), kernel_status()
    assert gemv.can_gemv(x[:1], torch.randn(8, BIG_HIDDEN)), kernel_status()
    assert gemv.can_mm_float32(x, torch.float32), kernel_status()
    # pdl has its own trial, run by the first graph that launches with it (tested below)
    assert {op: state for op, state in kernel_status().items() if op != "pdl"} == {
        op: "on" for op in kernel_status() if op != "pdl"}
    assert not flashinfer_ops.available(x.float()), "float32 has no FlashInfer kernel: PyTorch code"
    with use_fused(False):
        assert not flashinfer_ops.can_rmsnorm(x, norm.weight)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", FUSED_TOKENS)
def test_fused_rmsnorm_equals_the_pytorch_path_on_cuda(cuda_bf16: None, tokens: int) -> None:
    norm, q_norm = random_norm(BIG_HIDDEN), random_norm(BIG_HEAD_DIM)
    x = torch.randn(tokens, BIG_HIDDEN) * 3
    x_before = x.clone()
    assert flashinfer_ops.can_rmsnorm(x, norm.weight), kernel_status()
    out = norm(x)
    with use_fused(False):
        ref = norm(x)
    assert torch.equal(x, x_before), "the plain form returns a new tensor, its input untouched"
    assert_close_bf16(out, ref, f"rmsnorm, {tokens} tokens")
    # qk-norm: one scale per head_dim feature, on the q slice of a qkv output, not copied first.
    qkv = torch.randn(tokens, (BIG_QO_HEADS + 2 * BIG_KV_HEADS) * BIG_HEAD_DIM) * 3
    q, _ = split_qkv(qkv, BIG_QO_HEADS, BIG_KV_HEADS, BIG_HEAD_DIM)
    assert flashinfer_ops.can_rmsnorm(q, q_norm.weight), kernel_status()
    out = q_norm(q)
    with use_fused(False):
        ref = q_norm(q)
    assert_close_bf16(out, ref, f"qk-norm, {tokens} tokens")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", FUSED_TOKENS)
def test_fused_add_rmsnorm_equals_the_pytorch_path_in_place(cuda_bf16: None, tokens: int) -> None:
    norm = random_norm(BIG_HIDDEN)
    x, residual = torch.randn(tokens, BIG_HIDDEN) * 3, torch.randn(tokens, BIG_HIDDEN) * 3
    with use_fused(False):
        ref_normed, ref_sum = norm(x, residual)  # the PyTorch code leaves its inputs alone
    x_in, residual_in = x.clone(), residual.clone()
    assert flashinfer_ops.can_rmsnorm(x_in, norm.weight, residual_in), kernel_status()
    normed, new_residual = norm(x_in, residual_in)
    # One kernel, in place: the residual becomes the sum, x its normalised value.
    assert normed is x_in and new_residual is residual_in
    assert_close_bf16(new_residual, ref_sum, f"residual (x + residual), {tokens} tokens")
    assert_close_bf16(normed, ref_normed, f"norm(x + residual), {tokens} tokens")


ROPE_CASES = {  # name: (head_dim, rotary_dim, rope_scaling)
    **{name: (BIG_HEAD_DIM, BIG_HEAD_DIM, scaling) for name, scaling in ROPE_SCALINGS.items()},
    "partial-64-of-128": (BIG_HEAD_DIM, BIG_HEAD_DIM // 2, None),
    "tiny-head-64": (HEAD_DIM, HEAD_DIM, None),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_fused_rope_equals_the_pytorch_path_in_place(cuda_bf16: None, case: str) -> None:
    head_dim, rotary_dim, scaling = ROPE_CASES[case]
    rope = get_rope(head_dim, rotary_dim, MAX_POSITION, THETA, scaling)
    for tokens in FUSED_TOKENS:
        # int64 positions as the engine passes them; int32 works too.
        dtype = torch.int32 if tokens == 138 else torch.int64
        positions = torch.randint(0, MAX_POSITION, (tokens,), dtype=dtype)
        qkv = torch.randn(tokens, (BIG_QO_HEADS + 2 * BIG_KV_HEADS) * head_dim)
        qkv_before = qkv.clone()
        q, k = split_qkv(qkv, BIG_QO_HEADS, BIG_KV_HEADS, head_dim)
        with use_fused(False):
            q_ref, k_ref = rope(positions, q, k)
        assert torch.equal(qkv, qkv_before), "the PyTorch code leaves q and k alone"
        assert flashinfer_ops.can_rope(positions, q, k, rope.cos_sin_cache, head_dim), (
            case, kernel_status())
        q_out, k_out = rope(positions, q, k)
        assert q_out is q and k_out is k, "the kernel rotates q and k in place"
        assert_close_bf16(q_out, q_ref, f"{case}: q, {tokens} tokens")
        assert_close_bf16(k_out, k_ref, f"{case}: k, {tokens} tokens")
        v_start = (BIG_QO_HEADS + BIG_KV_HEADS) * head_dim
        assert torch.equal(qkv[:, v_start:], qkv_before[:, v_start:]), "v must be untouched"
        if rotary_dim < head_dim:  # the features past rotary_dim pass through unchanged
            q_before, _ = split_qkv(qkv_before, BIG_QO_HEADS, BIG_KV_HEADS, head_dim)
            assert torch.equal(q_out[..., rotary_dim:], q_before[..., rotary_dim:])
    # The flat [T, H * D] layout (no qk-norm) goes through the same kernel.
    q_flat, k_flat = torch.randn(8, 2 * head_dim), torch.randn(8, head_dim)
    positions = torch.arange(8)
    with use_fused(False):
        q_ref, k_ref = rope(positions, q_flat, k_flat)
    q_out, k_out = rope(positions, q_flat, k_flat)
    assert q_out.shape == (8, 2 * head_dim) and q_out is q_flat
    assert_close_bf16(q_out, q_ref, f"{case}: flat q")
    assert_close_bf16(k_out, k_ref, f"{case}: flat k")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", FUSED_TOKENS)
@pytest.mark.parametrize("into_pool", [False, True])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_prologue_equals_norm_rope_and_store(cuda_bf16: None, tokens: int, into_pool: bool,
                                                qk_norm: bool) -> None:
    """One Triton kernel against the qk-norm, RoPE and K/V scatter it replaces: FlashInfer's
    norm and rotation (each checked against the PyTorch code above), then an index store.
    Without qk-norm (Llama, Qwen2) it only rotates and stores."""
    q_norm, k_norm = random_norm(BIG_HEAD_DIM), random_norm(BIG_HEAD_DIM)
    rope = get_rope(BIG_HEAD_DIM, BIG_HEAD_DIM, MAX_POSITION, THETA)
    qkv = torch.randn(tokens, (BIG_QO_HEADS + 2 * BIG_KV_HEADS) * BIG_HEAD_DIM) * 3
    positions = torch.randint(0, MAX_POSITION, (tokens,))
    q, k = split_qkv(qkv, BIG_QO_HEADS, BIG_KV_HEADS, BIG_HEAD_DIM)
    if qk_norm:
        assert flashinfer_ops.can_rmsnorm(q, q_norm.weight) and flashinfer_ops.can_rmsnorm(k, k_norm.weight)
        q, k = q_norm(q), k_norm(k)
    else:
        # The rotation works in place: on copies (with one token the q and k views of the
        # single qkv row are contiguous already, so .contiguous() would not copy them).
        q, k = q.clone(), k.clone()
    assert flashinfer_ops.can_rope(positions, q, k, rope.cos_sin_cache, BIG_HEAD_DIM)
    ref_q, ref_k = rope(positions, q, k)
    ref_v = qkv[:, (BIG_QO_HEADS + BIG_KV_HEADS) * BIG_HEAD_DIM:].view(tokens, BIG_KV_HEADS, -1)
    weights = (q_norm.weight, k_norm.weight) if qk_norm else None
    assert qk_prologue.can_qk_prologue(qkv, positions, rope.cos_sin_cache, BIG_HEAD_DIM, weights)
    qkv_before = qkv.clone()
    if into_pool:  # the tokens' slots are scattered over a larger cache, as in a KV pool
        num_slots = 4 * tokens + 7
        k_cache = torch.zeros(num_slots, BIG_KV_HEADS, BIG_HEAD_DIM)
        v_cache = torch.zeros_like(k_cache)
        loc = torch.randperm(num_slots)[:tokens]
        assert qk_prologue.can_store_into(k_cache, v_cache, BIG_HEAD_DIM)
        out_q, none_k, none_v = qk_prologue.qk_prologue(
            qkv, positions, BIG_QO_HEADS, BIG_KV_HEADS, BIG_HEAD_DIM, rope.cos_sin_cache,
            weights, EPS, KVDestination(k_cache, v_cache, loc))
        assert none_k is None and none_v is None
        out_k, out_v = k_cache[loc], v_cache[loc]
        untouched = torch.ones(num_slots, dtype=torch.bool)
        untouched[loc] = False
        assert not k_cache[untouched].any() and not v_cache[untouched].any()
    else:
        out_q, out_k, out_v = qk_prologue.qk_prologue(
            qkv, positions, BIG_QO_HEADS, BIG_KV_HEADS, BIG_HEAD_DIM, rope.cos_sin_cache,
            weights, EPS, None)
    assert torch.equal(qkv, qkv_before), "the qkv output is read, not written"
    assert_close_per_head(out_q, ref_q.view(tokens, BIG_QO_HEADS, -1), f"q, {tokens} tokens")
    assert_close_per_head(out_k, ref_k.view(tokens, BIG_KV_HEADS, -1), f"k, {tokens} tokens")
    assert torch.equal(out_v, ref_v), "values are copied as they are"


@pytest.mark.gpu
def test_qk_prologue_writes_each_query_to_every_row_the_backend_names(cuda_bf16: None) -> None:
    """A decode batch cut into pieces reads a token's query once per piece. With
    ``query_rows`` the kernel writes each token's query to each of its rows (and nowhere
    else): the same values it writes to row t without them; keys and values are unchanged."""
    rope = get_rope(BIG_HEAD_DIM, BIG_HEAD_DIM, MAX_POSITION, THETA)
    weights = (random_norm(BIG_HEAD_DIM).weight, random_norm(BIG_HEAD_DIM).weight)
    rows_per_token = [1, 3, 2, 4, 1]
    tokens, spare_rows = len(rows_per_token), 2
    qkv = torch.randn(tokens, (BIG_QO_HEADS + 2 * BIG_KV_HEADS) * BIG_HEAD_DIM) * 3
    positions = torch.randint(0, MAX_POSITION, (tokens,))
    loc = torch.randperm(3 * tokens)[:tokens]
    indptr = torch.tensor([0] + rows_per_token, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    num_rows = int(indptr[-1]) + spare_rows
    outputs = []
    for rows in (None, indptr):
        caches = torch.zeros(2, 3 * tokens, BIG_KV_HEADS, BIG_HEAD_DIM).unbind(0)
        destination = KVDestination(*caches, loc, rows, num_rows if rows is not None else 0)
        q, _, _ = qk_prologue.qk_prologue(qkv, positions, BIG_QO_HEADS, BIG_KV_HEADS, BIG_HEAD_DIM,
                                    rope.cos_sin_cache, weights, EPS, destination)
        outputs.append((q, caches))
    (q_plain, caches_plain), (q_rows, caches_rows) = outputs
    assert q_plain.shape == (tokens, BIG_QO_HEADS, BIG_HEAD_DIM)
    assert q_rows.shape == (num_rows, BIG_QO_HEADS, BIG_HEAD_DIM)
    owners = torch.repeat_interleave(torch.arange(tokens), torch.tensor(rows_per_token))
    assert torch.equal(q_rows[: num_rows - spare_rows], q_plain[owners])
    assert all(torch.equal(a, b) for a, b in zip(caches_rows, caches_plain))


def assert_close_per_head(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """bf16 agreement of rotated heads. The norm rounds before the rotation, and a last-bit
    difference in its float32 sum can round one entry the other way: the rotation then moves
    that step of a large entry into a small one. So the bound scales with the head's largest
    entry, not with each entry (a wrong pairing, position or scale is off by far more)."""
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    diff = (ours.float() - ref.float()).abs()
    scale = ref.float().abs().amax(dim=-1, keepdim=True)
    excess = diff - (1e-2 + 2e-2 * scale)
    assert excess.max().item() <= 0, (f"{what}: max |diff| {diff.max().item():.3e} above "
                                      "1e-2 + 2e-2 |largest entry of the head|")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", FUSED_TOKENS)
def test_fused_silu_and_mul_equals_the_pytorch_path_on_cuda(cuda_bf16: None, tokens: int) -> None:
    for width in (BIG_INTERMEDIATE, INTERMEDIATE):
        x = torch.randn(tokens, 2 * width) * 3
        x_before = x.clone()
        assert flashinfer_ops.can_silu_and_mul(x), kernel_status()
        out = silu_and_mul(x)
        with use_fused(False):
            ref = silu_and_mul(x)
        assert torch.equal(x, x_before), "silu_and_mul returns a new tensor"
        assert_close_bf16(out, ref, f"silu_and_mul, {tokens} x {2 * width}")


@pytest.mark.gpu
def test_fused_kernels_replay_in_a_cuda_graph(cuda_bf16: None) -> None:
    """A CUDA graph captures the fused kernels and replays them on new inputs, bit for bit."""
    norm, q_norm, k_norm = random_norm(HIDDEN), random_norm(HEAD_DIM), random_norm(HEAD_DIM)
    rope = get_rope(HEAD_DIM, HEAD_DIM, MAX_POSITION, THETA)
    x, residual = torch.zeros(T, HIDDEN), torch.zeros(T, HIDDEN)
    qkv = torch.zeros(T, (NUM_QO_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM)
    gate_up = torch.zeros(T, 2 * INTERMEDIATE)
    positions = torch.zeros(T, dtype=torch.int64)

    def step() -> list[torch.Tensor]:
        # Clones first: the in-place kernels must not overwrite the graph's input buffers.
        normed, summed = norm(x.clone(), residual.clone())
        q, k = split_qkv(qkv, NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM)
        q, k = rope(positions, q_norm(q), k_norm(k))
        return [normed, summed, q, k, silu_and_mul(gate_up)]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm up: the kernels' first trial and any compilation happen here
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        captured = step()
    for seed in (1, 2):
        torch.manual_seed(seed)
        for buffer in (x, residual, qkv, gate_up):
            buffer.copy_(torch.randn(buffer.shape) * 3)
        positions.copy_(torch.randint(0, MAX_POSITION, (T,)))
        graph.replay()
        for replayed, eager in zip(captured, step()):
            assert torch.equal(replayed, eager), "a replay must equal the eager fused kernels"


@pytest.mark.gpu
@pytest.mark.parametrize("out_features, in_features", [
    (4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072),  # Qwen3-0.6B's four projections
    (37, 700), (151_936, 1024),  # ragged edges in both dimensions; an LM head past 2**31 bytes
])
def test_one_row_matmul_kernel_equals_cublas(cuda_bf16: None, out_features: int,
                                             in_features: int) -> None:
    """The batch-1 projection kernel against F.linear, each output within bf16's rounding of
    the same float32 sum; and a layer at batch 1 takes it, with or without bias."""
    x = torch.randn(1, in_features)
    weight = torch.randn(out_features, in_features) / in_features ** 0.5
    assert gemv.can_gemv(x, weight), kernel_status()
    assert_close_bf16(gemv.gemv(x, weight), F.linear(x, weight), f"{out_features}x{in_features}")
    strided = torch.randn(1, 2 * in_features)[:, ::2]  # one row whose elements are not adjacent
    for refused in (torch.randn(2, in_features), x.float(), strided):
        assert not gemv.can_gemv(refused, weight.to(refused.dtype)), tuple(refused.shape)
    layer = ReplicatedLinear(in_features, out_features, bias=True)
    layer.load_weight(weight)
    layer.load_weight(torch.randn(out_features), param_name="bias")
    with use_fused(False):
        expected = layer(x)
    assert_close_bf16(layer(x), expected, "a layer at batch 1")


def test_use_fused_turns_on_the_steps_it_names_and_refuses_unknown_ones() -> None:
    from minisgl.kernel.trials import DEFAULT_STEPS, STEPS, enabled

    def on() -> set[str]:
        return {step for step in STEPS if enabled(step)}

    assert on() == DEFAULT_STEPS == set(STEPS) - {"pieces", "pdl"}, "off: they did not pay"
    with use_fused(STEPS[:3]):
        assert on() == set(STEPS[:3])
        assert num_decode_pieces(10 * PIECES_MIN_BATCH) == 0, "pieces are off"
        with use_fused(False):
            assert on() == set()
        with use_fused(True):
            assert on() == DEFAULT_STEPS
        assert on() == set(STEPS[:3])
    assert on() == DEFAULT_STEPS
    with pytest.raises(ValueError, match="unknown kernel steps"):
        with use_fused({"gemv", "megakernel"}):
            pass


@pytest.mark.gpu
def test_each_step_of_the_row_kernel_is_switched_on_its_own(cuda_bf16: None) -> None:
    """The ablation's switches: the folded forms need their own step and the plain kernel's."""
    x, gate_up = torch.randn(1, 256), torch.randn(1, 512)
    weight, norm_weight = torch.randn(64, 256), torch.ones(256)
    with use_fused({"gemv"}):
        assert gemv.matmul(x, weight) is not None
        assert gemv.gated_matmul(gate_up, weight) is None
        assert gemv.normed_matmul(x, None, norm_weight, EPS, weight) is None
    with use_fused({"gated", "normed"}):  # without "gemv" there is no row kernel at all
        assert gemv.gated_matmul(gate_up, weight) is None
    with use_fused({"gemv", "gated", "normed"}):
        assert gemv.gated_matmul(gate_up, weight) is not None
        assert gemv.normed_matmul(x, None, norm_weight, EPS, weight) is not None


@pytest.mark.gpu
def test_row_kernels_launched_early_replay_a_dependent_chain_exactly(cuda_bf16: None) -> None:
    """With programmatic dependent launch each row kernel starts before the one it reads from
    has finished, and waits only before reading that one's output: a graph of kernels each
    reading the last one's output, replayed, equals the same chain launched plainly."""
    from minisgl.kernel.trials import DEFAULT_STEPS, op_status

    weights = [torch.randn(512 if i % 2 else 1024, 1024 if i % 2 else 512) / 30
               for i in range(12)]
    norm_weight = torch.ones(512)
    x = torch.zeros(1, 512)

    def chain() -> torch.Tensor:
        h, residual = x, None
        for i, w in enumerate(weights):
            if i % 2:
                h = gemv.gemv(h, w)
            else:
                h, residual = gemv.normed_gemv(h, residual, norm_weight, EPS, w)
        return h

    with use_fused(DEFAULT_STEPS | {"pdl"}):
        chain()  # the trial and compilation, outside the capture
        if op_status("pdl") != "on":
            pytest.skip(f"programmatic dependent launch is off here: {op_status('pdl')}")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            chain()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = chain()
    for seed in range(3):
        torch.manual_seed(seed)
        x.copy_(torch.randn(1, 512))
        graph.replay()
        with use_fused(DEFAULT_STEPS):
            expected = chain()
        assert torch.equal(captured, expected), f"seed {seed}: a launched-early chain differs"


@pytest.mark.gpu
@pytest.mark.parametrize("out_features, in_features", [(1024, 3072), (37, 700)])
def test_gated_row_matmul_equals_silu_and_mul_then_the_product(
        cuda_bf16: None, out_features: int, in_features: int) -> None:
    """The down projection with the MLP's activation folded into its read, against the two
    passes it replaces (the activation rounded to bf16 in between, as both round it)."""
    from minisgl.layers.linear import matmul

    gate_up = torch.randn(1, 2 * in_features)
    weight = torch.randn(out_features, in_features) / in_features ** 0.5
    assert gemv.can_gemv(gate_up, weight, gated=True), kernel_status()
    with use_fused(False):
        expected = F.linear(silu_and_mul(gate_up), weight)
    assert_close_bf16(gemv.gemv(gate_up, weight, gated=True), expected, "gated")
    assert_close_bf16(matmul(gate_up, weight, gated=True), expected, "matmul(gated=True)")
    assert not gemv.can_gemv(torch.randn(2, 2 * in_features), weight, gated=True)


@pytest.mark.gpu
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("out_features, in_features", [(4096, 1024), (6144, 1024), (37, 700)])
def test_normed_row_matmul_equals_add_norm_then_the_product(
        cuda_bf16: None, with_residual: bool, out_features: int, in_features: int) -> None:
    """A decoder layer's add-and-norm folded into the read of the projection after it, against
    the norm kernel's outputs and the product of what it wrote: the same new residual, the
    same product within bf16's rounding."""
    from minisgl.layers.linear import normed_linear

    norm = random_norm(in_features)
    layer = ReplicatedLinear(in_features, out_features)
    layer.load_weight(torch.randn(out_features, in_features) / in_features ** 0.5)
    x = torch.randn(1, in_features) * 3
    residual = torch.randn(1, in_features) * 3 if with_residual else None
    with use_fused(False):
        expected, expected_residual = normed_linear(norm, layer, x.clone(), (
            None if residual is None else residual.clone()))
    got, new_residual = normed_linear(norm, layer, x, residual)
    assert fast.paths.normed_matmul(x, residual, norm.weight, norm.eps, layer.weight) is not None
    assert_close_bf16(new_residual, expected_residual, "the new residual")
    # The plain path rounds the normed row to bf16 before the product; the kernel keeps it in
    # float32. Both are judged against the exact (float64) computation: the kernel may not be
    # further from it than the plain path, with room for the output's own rounding.
    h = x.double() + (0 if residual is None else residual.double())
    exact = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.double()
             ) @ layer.weight.double().T
    ours, plain = (got.double() - exact).abs().max(), (expected.double() - exact).abs().max()
    rounding = 2.0 ** -8 * exact.abs().max()
    assert ours <= plain + rounding, (f"the normed product is {ours:.3e} from exact, the plain "
                                      f"path {plain:.3e}")
    if residual is None:
        assert new_residual is x, "without a residual the input is the residual"


@pytest.mark.gpu
def test_a_batch_1_forward_with_folded_norms_follows_the_plain_model() -> None:
    """The dense model at one token a step through the one-row kernels (norms and activation
    folded into the products) against the same model with every kernel off."""
    model = load_model(tiny_checkpoint("qwen3"), device="cuda", dtype="bfloat16", progress=False)
    ids = torch.tensor([7], device="cuda")
    positions = torch.tensor([0], device="cuda")
    with torch.inference_mode():
        fused = model(ids, positions)
        with use_fused(False):
            ref = model(ids, positions)
    assert kernel_status()["gemv"] == "on", kernel_status()
    assert rel_err(fused, ref) <= 3e-2  # chapter 3's bf16 bound for a 4-layer model
    assert fused.argmax(-1).tolist() == ref.argmax(-1).tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 5, 128])
def test_lm_head_writes_float32_logits_without_rounding_them_to_16_bits(
        cuda_bf16: None, rows: int) -> None:
    """The LM head's logits come from the matrix kernel in float32 (the one-row kernel at batch
    1, cuBLAS above): within float32 summation error of the exact product of the bf16
    operands, closer than the bf16-rounded product that F.linear gives."""
    from minisgl.layers.linear import matmul

    vocab, hidden = 4099, 1024
    x = torch.randn(rows, hidden)
    weight = torch.randn(vocab, hidden) / hidden ** 0.5
    exact = x.double() @ weight.double().T
    logits = matmul(x, weight, out_dtype=torch.float32)
    assert logits.dtype == torch.float32 and logits.shape == (rows, vocab)
    error = float((logits.double() - exact).abs().max())
    rounded = float((F.linear(x, weight).double() - exact).abs().max())
    assert error < 1e-4 * float(exact.abs().max()) and error < rounded / 10, (error, rounded)


@pytest.mark.gpu
def test_merged_pieces_equal_attention_over_whole_requests() -> None:
    """merge_pieces against dense attention (and its PyTorch reference); spare rows past the
    last piece are ignored."""
    out, lse, piece_indptr, reference = merge_inputs([1, 7, 40, 3, 129], piece=8, spare=3)
    out, lse = out.to("cuda", torch.bfloat16), lse.cuda()
    indptr = torch.tensor(piece_indptr, dtype=torch.int32, device="cuda")
    merged = merge_pieces(out, lse, indptr)
    assert merged.shape == reference.shape and merged.dtype == torch.bfloat16
    assert_bf16_close(merged.cpu(), reference, "merged pieces vs whole requests")
    assert_bf16_close(merged, merge_pieces_reference(out, lse, indptr), "kernel vs reference")


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.usefixtures("pieces_on")
def test_flashinfer_decodes_a_large_batch_in_pieces_and_equals_dense(page_size: int) -> None:
    s = make_scenario(LARGE_DECODE_CASE, page_size, is_decode=True, dtype=torch.bfloat16,
                      device="cuda")
    backend = flashinfer_backend(s)
    errors = run_backend(backend, s)  # checks the bf16 band itself
    pieces = backend.metadata.query_rows
    assert pieces is not None and pieces.owners.numel() > len(LARGE_DECODE_CASE)
    small = make_scenario(DECODE_CASE, page_size, is_decode=True, dtype=torch.bfloat16,
                          device="cuda")
    small_backend = flashinfer_backend(small)
    run_backend(small_backend, small)
    assert small_backend.metadata.query_rows is None
    print(f"flashinfer decode of {len(LARGE_DECODE_CASE)} requests in "
          f"{pieces.owners.numel()} pieces, page size {page_size}: max err {max(errors):.3e}")


@pytest.mark.gpu
@pytest.mark.usefixtures("pieces_on")
def test_a_batch_in_pieces_names_a_query_row_per_piece_and_attends_from_them() -> None:
    """The split form a fused prologue uses: kv_destination names the rows the kernel reads
    (one per piece, token t's rows in order), and attend_stored over queries written there
    equals dense attention and the one-call forward."""
    s = make_scenario(LARGE_DECODE_CASE, 16, is_decode=True, dtype=torch.bfloat16,
                      device="cuda")
    backend = flashinfer_backend(s)
    backend.prepare(s.layout)
    q, k, v = s.new_tokens(0)
    destination = backend.kv_destination(0, q.shape[0])
    pieces = backend.metadata.query_rows
    assert pieces is not None and destination.query_rows is pieces.indptr
    rows_per_token = torch.diff(destination.query_rows.long())
    assert destination.num_query_rows == int(rows_per_token.sum()) > q.shape[0]
    owners = torch.repeat_interleave(torch.arange(q.shape[0], device="cuda"), rows_per_token)
    assert torch.equal(pieces.owners, owners)
    destination.k_cache[destination.loc] = k  # what the prologue kernel writes
    destination.v_cache[destination.loc] = v
    with pytest.raises(ValueError, match="query rows"):
        backend.attend_stored(q, 0)  # one row per token is not what the kernel reads
    stored = backend.attend_stored(q[owners], 0)
    assert stored.shape == q.shape
    assert_bf16_close(stored.float().cpu(), s.reference(0).float().cpu(), "attend_stored")
    assert torch.equal(stored, backend.forward(q, k, v, 0))


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.usefixtures("pieces_on")
def test_a_graph_of_pieces_replays_a_smaller_padded_batch(page_size: int) -> None:
    check_graph_decode_replay(page_size, LARGE_DECODE_CASE, PIECES_MIN_BATCH + 1)  # spares too


@pytest.mark.gpu
@pytest.mark.usefixtures("pieces_on")
def test_batches_cut_into_pieces_replay_and_equal_the_uncut_batch(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """From PIECES_MIN_BATCH requests the model's attention runs in pieces, the queries
    written to a row per piece by the prologue kernel: eager, replayed (a padded graph, with
    spare pieces) and against the same batch not cut."""
    sizes = (1, 2, 4, 8, 16, pieces.PIECES_MIN_BATCH + 7)
    engine = graph_engine(tiny_model_dir, page_size=16, sizes=sizes)
    check_replay_against_eager(engine, [pieces.PIECES_MIN_BATCH, pieces.PIECES_MIN_BATCH + 5], steps=2)
    num_reqs = pieces.PIECES_MIN_BATCH + 2
    reqs = decode_batch(engine, ragged_prompts(num_reqs, engine.model_config.vocab_size, seed=9))
    batch = Batch(reqs, "decode")
    cut = engine.logits(batch, use_graph=False).clone()
    assert engine.attn_backend.metadata.query_rows is not None
    monkeypatch.setattr(pieces, "PIECES_MIN_BATCH", 10**6)
    whole = engine.logits(batch, use_graph=False)
    assert engine.attn_backend.metadata.query_rows is None
    tolerance = BF16_RELATIVE_TOLERANCE * float(whole.abs().max())
    error = float((cut - whole).abs().max())
    assert error <= tolerance, f"{num_reqs} requests in pieces: {error:.3f} > {tolerance:.3f}"
    for req in reqs:
        engine.pages.release(req)


@pytest.mark.gpu
@pytest.mark.usefixtures("pieces_on")
def test_tensor_core_decode_is_never_cut_into_pieces_and_its_largest_graph_plans() -> None:
    """A GQA group of 8 (Qwen3-30B-A3B's) decodes on tensor cores, each request whole: eagerly,
    and in a captured batch of 256, whose plan fits FlashInfer's workspace (cut into 1,024
    pieces, the tensor-core plan asked for more scratch than the workspace holds)."""
    from minisgl.attention.base import pad_batch

    heads = 8 * HKV
    s = make_scenario(LARGE_DECODE_CASE, 16, is_decode=True, dtype=torch.bfloat16,
                      device="cuda", num_qo_heads=heads)
    backend = flashinfer_backend(s, num_qo_heads=heads)
    assert backend.use_tensor_cores and fast.paths.decode_pieces(256) > 0
    run_backend(backend, s)  # within bf16 of dense attention
    assert backend.metadata.query_rows is None
    used = set(s.table.page_ids[s.table.page_ids >= 0].tolist())
    pad_row = s.table.alloc_row()
    s.table.append_pages(pad_row, [next(p for p in range(s.pool.num_pages) if p not in used)])
    backend.enable_cuda_graphs([256])
    fields = torch.zeros(3 * 256, dtype=torch.int64, device="cuda")
    meta = backend.prepare(pad_batch(s.layout, 256, pad_row), out=fields)
    torch.cuda.synchronize()
    assert meta.query_rows is None


MOE_BF16_REL_TOL = 2e-2  # bf16 inputs and outputs, float32 sums: a few roundings of 2**-8


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens, top_k", [(1, 2), (8, 8), (300, 2), (1500, 3)])
def test_fused_equals_reference_in_bf16_inside_a_cuda_graph(num_tokens: int, top_k: int) -> None:
    gate_up, down = random_experts(dtype=torch.bfloat16, device="cuda")
    g = torch.Generator().manual_seed(num_tokens)

    def inputs() -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(num_tokens, H, generator=g).to("cuda", torch.bfloat16),
                torch.randn(num_tokens, E, generator=g).cuda())

    x, logits = inputs()

    def step() -> torch.Tensor:
        routing = route_topk(logits, top_k, renormalize=True)
        return moe_fused(x, gate_up, down, routing.expert_ids, routing.weights, silu_and_mul)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(2):  # replay on new inputs written into the captured tensors
        new_x, new_logits = inputs()
        x.copy_(new_x)
        logits.copy_(new_logits)
        graph.replay()
        routing = route_topk(new_logits, top_k, renormalize=True)
        ref = moe_reference(new_x.float(), gate_up.float(), down.float(), routing)
        err = rel_err(out, ref)
        assert err <= MOE_BF16_REL_TOL, f"fused vs reference: relative error {err:.2e}"


@pytest.mark.gpu
def test_the_moe_model_on_a_gpu_picks_the_fused_path_and_follows_the_reference() -> None:
    model = load_model(tiny_checkpoint("qwen3-moe"), device="cuda", dtype="bfloat16",
                       progress=False)
    ids = torch.arange(3, 60, device="cuda")
    positions = torch.arange(len(ids), device="cuda")
    with torch.inference_mode():
        fused = model(ids, positions)
        with use_moe_impl("reference"):
            ref = model(ids, positions)
    assert rel_err(fused, ref) <= 3e-2  # chapter 3's bf16 bound for a 4-layer model
    assert (fused.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_the_kernel_ablation_runs_a_row_per_step_on_the_cpu_too(tmp_path: Path) -> None:
    """benchmark/kernel_steps.py's plumbing: a row for the plain engine and one per step added,
    each with its latency and offline figures (on a CPU no kernel runs, so none is counted)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kernel_steps", ROOT / "benchmark" /
                                                  "kernel_steps.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "steps.json"
    rows = module.main(["--model", str(tiny_checkpoint("qwen3")), "--device", "cpu",
                        "--steps", "gemv,normed", "--context-len", "16", "--max-tokens", "4",
                        "--offline", "--num-requests", "4", "--min-len", "4", "--max-len", "8",
                        "--out", str(out)])
    assert [row["steps"] for row in rows] == [[], ["gemv"], ["gemv", "normed"]]
    assert json.loads(out.read_text()) == rows
    for row in rows:
        assert row["kernels_per_step"] == 0 and row["decode_ms"] > 0
        assert row["offline_tok_per_s"] > 0


def test_the_cut_over_is_where_pieces_win_from_then_on(tmp_path: Path) -> None:
    """benchmark/pieces_cutover.py: both engines time every size (on a CPU no piece is cut,
    only the plumbing runs), and the cut-over is the first size from which pieces always win."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pieces_cutover", ROOT / "benchmark" /
                                                  "pieces_cutover.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.cut_over({8: 2.0, 16: 3.0, 32: 5.0, 64: 9.0},
                           {8: 1.9, 16: 3.1, 32: 4.0, 64: 8.0}) == 32
    assert module.cut_over({8: 2.0, 16: 3.0}, {8: 1.0, 16: 3.5}) is None
    assert module.cut_over({8: 2.0, 16: 3.0}, {8: 1.0, 16: 2.5}) == 8
    lengths = module.context_lengths(64, 128, True, 0)
    assert min(lengths) >= 16 and max(lengths) <= 256 and len(set(lengths)) > 1
    out = tmp_path / "cutover.json"
    result = module.main(["--model", str(tiny_checkpoint("qwen3")), "--device", "cpu",
                          "--batch-sizes", "2,3", "--context-len", "8", "--steps", "2",
                          "--out", str(out)])
    assert set(result["no_pieces_ms"]) == set(result["pieces_ms"]) == {2, 3}
    assert json.loads(out.read_text())["cut_over"] == result["cut_over"]


def test_chapter_20s_example_runs_on_the_cpu() -> None:
    """examples/ch20_kernels.py, its last part cut to one step; the merge it shows is exact."""
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "ch20_kernels.py"),
                           "--model", str(tiny_checkpoint("qwen3")), "--steps", "gemv"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    merges = [line for line in done.stdout.splitlines() if line.startswith("pieces of")]
    assert len(merges) == 4 and all(float(line.rsplit("=", 1)[1]) < 1e-12 for line in merges)
    assert "+ gemv" in done.stdout
