"""Tests for the ragged-batch inputs exercise: they are its specification.

The first tests use small batches worked out by hand. The last ones build the same batch in
chapter 7's engine (on the tiny model, on the CPU) and compare: your arrays must equal the
engine's, and the model fed with your arrays must give the engine's logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from positions import build_last_indices, build_positions, pack_input_ids

from minisgl.core import Batch, Req, SamplingParams
from minisgl.engine.config import EngineConfig
from minisgl.engine.engine import Engine
from minisgl.layers.attention import use_attention_backend

# ---------------------------------------------------------------------------------------------
# Worked by hand


def test_the_readme_example() -> None:
    cached, new = [0, 5, 4], [3, 1, 2]
    assert build_positions(cached, new).tolist() == [0, 1, 2, 5, 4, 5]
    assert build_last_indices(new).tolist() == [2, 3, 5]


def test_pack_input_ids_skips_each_requests_cached_tokens() -> None:
    token_ids = [[11, 12, 13], [21, 22, 23, 24, 25, 26], [31, 32, 33, 34, 35, 36]]
    packed = pack_input_ids(token_ids, [0, 5, 4])
    assert packed.tolist() == [11, 12, 13, 26, 35, 36], (
        "request i contributes token_ids[i][cached_lens[i]:], requests in batch order")


def test_a_fresh_prefill_batch_starts_every_request_at_position_0() -> None:
    assert build_positions([0, 0, 0], [2, 1, 3]).tolist() == [0, 1, 0, 0, 1, 2]
    assert build_last_indices([2, 1, 3]).tolist() == [1, 2, 5]


def test_a_decode_batch_has_one_token_per_request_at_its_cached_length() -> None:
    assert build_positions([7, 1, 30], [1, 1, 1]).tolist() == [7, 1, 30]
    assert build_last_indices([1, 1, 1]).tolist() == [0, 1, 2], (
        "in a decode batch every row is some request's last token")


def test_a_single_one_token_prompt() -> None:
    assert build_positions([0], [1]).tolist() == [0]
    assert build_last_indices([1]).tolist() == [0]
    assert pack_input_ids([[42]], [0]).tolist() == [42]


def test_results_are_1d_int64_tensors() -> None:
    for tensor in (pack_input_ids([[1, 2], [3]], [0, 0]), build_positions([0, 2], [2, 1]),
                   build_last_indices([2, 1])):
        assert isinstance(tensor, torch.Tensor) and tensor.dim() == 1
        assert tensor.dtype == torch.int64, f"expected int64 (what torch indexes with), got {tensor.dtype}"


@pytest.mark.parametrize(("cached", "new"), [([0, 1], [1]), ([0], [0]), ([3, 0], [2, -1])])
def test_mismatched_or_empty_requests_are_errors(cached: list[int], new: list[int]) -> None:
    with pytest.raises(ValueError):
        build_positions(cached, new)


# ---------------------------------------------------------------------------------------------
# Against the engine


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    return Engine(EngineConfig(tiny_model_dir, device="cpu", page_size=4, num_pages=256,
                               max_running_reqs=8))


def mixed_batch(engine: Engine) -> Batch:
    """A request that is decoding, one whose first 6 tokens are cached, and a fresh prompt."""
    generator = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(engine.model_config.vocab_size, (n,), generator=generator).tolist()

    params = SamplingParams(max_tokens=4, ignore_eos=True)
    decoding, chunked, fresh = (Req(0, prompt(9), params), Req(1, prompt(13), params),
                                Req(2, prompt(5), params))
    for req in (decoding, chunked, fresh):
        engine.pages.reserve(req)
    batch = Batch([decoding], "prefill")
    token = engine.forward(batch)
    batch.advance()
    decoding.append_token(int(token[0]))
    # The first 6 tokens of the second prompt are computed ahead, as a chunked prefill would.
    batch = Batch([chunked], "prefill", chunk_lens=[6])
    engine.forward(batch)
    batch.advance()
    for req in (decoding, chunked, fresh):
        engine.pages.reserve(req)
    return Batch([decoding, chunked, fresh], "prefill")


def test_your_arrays_equal_the_engines(engine: Engine) -> None:
    batch = mixed_batch(engine)
    try:
        input_ids = engine.input_ids(batch)
        meta = engine.attn_backend.prepare(batch)
        cached = [r.cached_len for r in batch.reqs]
        new = [r.new_len for r in batch.reqs]
        assert (cached, new) == ([9, 6, 0], [1, 7, 5])
        assert pack_input_ids([r.token_ids for r in batch.reqs], cached).tolist() == \
            input_ids.tolist(), "packed token ids differ from the engine's"
        assert build_positions(cached, new).tolist() == meta.positions.tolist(), \
            "positions differ from the engine's"
        assert build_last_indices(new).tolist() == meta.last_indices.tolist(), \
            "last-token indices differ from the engine's"
    finally:
        for req in batch.reqs:
            engine.pages.release(req)


def test_the_model_fed_your_arrays_gives_the_engines_logits(engine: Engine) -> None:
    batch = mixed_batch(engine)
    try:
        expected = engine.logits(batch)
        cached = [r.cached_len for r in batch.reqs]
        new = [r.new_len for r in batch.reqs]
        engine.attn_backend.prepare(batch)  # the slots to store K/V in
        with use_attention_backend(engine.attn_backend), torch.no_grad():
            logits = engine.model.forward(
                pack_input_ids([r.token_ids for r in batch.reqs], cached),
                build_positions(cached, new), build_last_indices(new))
        assert logits.shape == expected.shape, "one row of logits per request"
        assert torch.allclose(logits, expected, atol=1e-5), "the logits differ from the engine's"
    finally:
        for req in batch.reqs:
            engine.pages.release(req)
