"""Chapter 8: CUDA graphs for decode steps.

On a CPU: the list of captured batch sizes, the padding of a batch to the next captured size
(pure functions), and a runner that is cleanly off (on a CPU, with the flag, with a backend that
cannot be captured) while the engine keeps working. On a GPU: a replayed decode step computes
exactly what the same kernels launched one by one compute, and what the eager step computes
within bf16 rounding, for batch sizes that need padding and sizes that do not, on the tiny
model and on the Qwen3-0.6B-shaped model if ``models/qwen3-0.6b-like`` exists.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from minisgl.attention import TorchNativeBackend, pad_batch
from minisgl.core import Batch, Req, SamplingParams
from minisgl.engine.config import EngineConfig
from minisgl.engine.engine import Engine
from minisgl.engine.graph import (
    GraphRunner,
    capture_batch_sizes,
    cuda_graph_disabled_reason,
    default_capture_sizes,
    padded_batch_size,
)
from minisgl.kvcache import MHAKVPool, RequestPages
from minisgl.kvcache.page_table import PageTable

QWEN3_06B_LIKE = Path(__file__).resolve().parent.parent / "models" / "qwen3-0.6b-like"

# --------------------------------------------------------------------------------------------
# Which sizes are captured, and which one a batch replays
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("max_bs", "sizes"), [
    (1, [1]), (2, [1, 2]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]), (20, [1, 2, 4, 8, 16, 20]),
    (24, [1, 2, 4, 8, 16, 24]),
])
def test_default_capture_sizes_small_powers_then_multiples_of_8(max_bs: int,
                                                                sizes: list[int]) -> None:
    assert default_capture_sizes(max_bs) == sizes


def test_default_capture_sizes_up_to_256() -> None:
    sizes = default_capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256
    assert sizes == sorted(set(sizes)) and len(sizes) == 35
    assert all(s % 8 == 0 for s in sizes[3:])


@pytest.mark.parametrize(("batch_size", "graph_size"), [
    (1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, 16), (17, 24), (250, 256), (256, 256),
    (257, None),  # larger than every graph: runs eagerly
])
def test_a_batch_replays_the_smallest_captured_size_that_holds_it(batch_size: int,
                                                                  graph_size: int | None) -> None:
    assert padded_batch_size(batch_size, default_capture_sizes(256)) == graph_size


def test_padding_works_with_any_sorted_list() -> None:
    assert [padded_batch_size(b, [1, 8, 64]) for b in (1, 2, 8, 9, 64, 65)] == [1, 8, 8, 64, 64,
                                                                              None]


def test_sizes_below_one_are_errors() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        padded_batch_size(0, [1, 2])
    with pytest.raises(ValueError, match="max_batch_size"):
        default_capture_sizes(0)


@pytest.mark.parametrize(("options", "sizes"), [
    ({}, default_capture_sizes(256)),
    ({"max_running_reqs": 12}, [1, 2, 4, 8, 12]),
    ({"cuda_graph_max_bs": 20}, [1, 2, 4, 8, 16, 20]),
    ({"cuda_graph_batch_sizes": [64, 1, 8, 8]}, [1, 8, 64]),
])
def test_capture_batch_sizes_come_from_the_config(options: dict, sizes: list[int]) -> None:
    assert capture_batch_sizes(EngineConfig("m", **options)) == sizes


def test_config_rejects_graph_sizes_beyond_the_running_requests() -> None:
    with pytest.raises(ValueError, match="max_running_reqs"):
        EngineConfig("m", max_running_reqs=8, cuda_graph_batch_sizes=[1, 16])


# --------------------------------------------------------------------------------------------
# Off, cleanly
# --------------------------------------------------------------------------------------------


def test_disabled_reason_names_the_flag_the_device_and_the_backend() -> None:
    cuda = torch.device("cuda")
    assert "cuda_graph setting" in cuda_graph_disabled_reason(False, cuda, "flashinfer")
    assert "needs a CUDA GPU" in cuda_graph_disabled_reason(True, torch.device("cpu"),
                                                             "flashinfer")
    assert "torch attention backend" in cuda_graph_disabled_reason(True, cuda, "torch")
    assert cuda_graph_disabled_reason(True, cuda, "flashinfer") is None


def test_padding_entries_are_one_token_at_position_0_of_the_padding_row() -> None:
    """A padded decode batch is the batch's requests, then padding entries that the backend
    prepares like any other: one token in the padding row's one page."""
    pages = RequestPages(16, 4, 64, page_size=4)
    pad_row = pages.padding_row()
    reqs = [Req(i, [1] * (3 + 4 * i)) for i in range(2)]
    for req in reqs:
        pages.reserve(req)
        req.cached_len = req.num_tokens - 1
    padded = pad_batch(Batch(reqs, "decode"), 4, pad_row)
    assert padded.rows == [reqs[0].table_row, reqs[1].table_row, pad_row, pad_row]
    assert (padded.cached_lens, padded.new_lens) == ([2, 6, 0, 0], [1] * 4)
    pool = MHAKVPool(1, 1, 8, 16, 4, torch.float32, "cpu")  # 16 pages of 4 tokens
    meta = TorchNativeBackend(pool, pages.table, 1).prepare(padded)
    pad_slot = int(pages.table.row_pages(pad_row)[0]) * 4
    assert meta.positions.tolist() == [2, 6, 0, 0]
    assert meta.out_loc.tolist()[2:] == [pad_slot, pad_slot]
    assert pages.num_free_rows == 1 and pages.num_used == 1 + 1 + 2  # the padding row's page


def test_a_disabled_runner_replays_nothing() -> None:
    runner = GraphRunner.disabled("testing")
    assert not runner.enabled and runner.max_batch_size == 0
    assert "disabled: testing" in repr(runner)


@pytest.fixture(scope="module")
def cpu_engine(tiny_model_dir: Path) -> Engine:
    return Engine(EngineConfig(tiny_model_dir, device="cpu", num_pages=256, max_running_reqs=4))


def decode_batch(engine: Engine, prompts: list[list[int]], max_tokens: int = 8) -> list[Req]:
    """Requests prefilled (in one batch), with pages reserved for their first decode step."""
    reqs = [Req(i, p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            for i, p in enumerate(prompts)]
    for req in reqs:
        engine.pages.reserve(req)
    batch = Batch(reqs, "prefill")
    tokens = engine.forward(batch).tolist()
    batch.advance()
    for req, token in zip(reqs, tokens):
        req.append_token(token)
        engine.pages.reserve(req)
    return reqs


def test_on_cpu_graphs_are_off_and_the_engine_still_decodes(cpu_engine: Engine) -> None:
    runner = cpu_engine.graph_runner
    assert isinstance(runner, GraphRunner) and not runner.enabled
    assert "cpu" in runner.disabled_reason
    assert cpu_engine.pages.num_free == cpu_engine.kv_budget.num_pages, "no pad page taken"
    reqs = decode_batch(cpu_engine, [[1, 2, 3], [4, 5]])
    batch = Batch(reqs, "decode")
    assert runner.size_for(batch) is None
    with pytest.raises(ValueError, match="no captured graph"):
        cpu_engine.replay(batch, cpu_engine.input_ids(batch))
    tokens = cpu_engine.forward(batch)  # eager, as if nothing happened
    assert tokens.shape == (2,)
    for req in reqs:
        cpu_engine.pages.release(req)


def test_the_model_writes_its_logits_into_out_as_a_replay_needs(cpu_engine: Engine) -> None:
    """``out=``: the LM head's product lands in the given memory (a graph's fixed logits), the
    same logits the model returns without it, and that memory is what comes back."""
    model, vocab = cpu_engine.model, cpu_engine.model_config.vocab_size
    ids, positions = torch.tensor([5, 7, 11]), torch.tensor([0, 1, 2])
    fixed = torch.full((4, vocab), float("nan"))
    written = model.forward(ids, positions, out=fixed[:3])
    assert written.data_ptr() == fixed.data_ptr()
    torch.testing.assert_close(fixed[:3], model.forward(ids, positions), rtol=0, atol=0)
    assert fixed[3].isnan().all(), "nothing past the rows asked for"


def test_the_flag_turns_graphs_off_and_says_so(tiny_model_dir: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("minisgl")
    logger.addHandler(caplog.handler)  # minisgl's loggers do not propagate to the root
    try:
        with caplog.at_level(logging.INFO, logger="minisgl"):
            engine = Engine(EngineConfig(tiny_model_dir, device="cpu", num_pages=16,
                                         max_running_reqs=2, cuda_graph=False))
    finally:
        logger.removeHandler(caplog.handler)
    assert not engine.graph_runner.enabled
    assert "CUDA graphs: off (turned off by the cuda_graph setting)" in caplog.text


def random_decode_batches(table: PageTable, steps: int, seed: int
                          ) -> Iterator[tuple[list[int], dict[int, int], int]]:
    """Decode steps over ``table``: rows grow a token a step, finish and are reused. Yields
    ``(rows, lens, batch_size)``: a batch of rows, every row's stored tokens, a graph size."""
    rng = random.Random(seed)
    next_page, lens = 0, {}  # row -> tokens whose K/V are stored
    for _ in range(steps):
        for row in [r for r in lens if rng.random() < 0.15]:  # finished: the row is reused
            table.free_row(row)
            del lens[row]
        while len(lens) < table.max_reqs and rng.random() < 0.5:
            lens[table.alloc_row()] = rng.randrange(1, 30)
        for row in lens:  # decode one more token: pages for positions 0 .. lens[row]
            need = table.pages_needed(row, lens[row] + 1)
            table.append_pages(row, list(range(next_page, next_page + need)))
            next_page += need
        if lens:
            rows = rng.sample(sorted(lens), rng.randint(1, len(lens)))
            yield rows, lens, rng.randint(len(rows), table.max_reqs + 2)


# --------------------------------------------------------------------------------------------
# On a GPU: replay against eager
# --------------------------------------------------------------------------------------------

# bf16: the eager step runs the batch unpadded, with the non-graph decode plan, so its matrix
# shapes and its attention split may differ from the graph's; rounding then differs by a few
# bf16 steps of the largest logit (chapters 4 and 6 measured about that much).
BF16_RELATIVE_TOLERANCE = 0.04
CAPTURED = (1, 2, 4, 8, 16)


def graph_engine(model_dir: Path, page_size: int, sizes: tuple[int, ...] = CAPTURED) -> Engine:
    pytest.importorskip("flashinfer", reason="flashinfer-python is not installed")
    engine = Engine(EngineConfig(model_dir, device="cuda", dtype="bfloat16",
                                 attention_backend="flashinfer", page_size=page_size,
                                 num_pages=8192 // page_size, max_running_reqs=max(32, *sizes),
                                 cuda_graph_batch_sizes=sizes))
    assert engine.graph_runner.enabled, engine.graph_runner.disabled_reason
    return engine


def ragged_prompts(count: int, vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (count,), generator=generator).tolist()
    return [torch.randint(vocab_size, (n,), generator=generator).tolist() for n in lengths]


def check_replay_against_eager(engine: Engine, batch_sizes: list[int], steps: int = 3) -> None:
    """For each batch size: prefill, then ``steps`` decode steps, each computed three ways."""
    runner = engine.graph_runner
    for bs in batch_sizes:
        reqs = decode_batch(engine, ragged_prompts(bs, engine.model_config.vocab_size, seed=bs),
                            max_tokens=steps + 2)
        for step in range(steps):
            for req in reqs:
                engine.pages.reserve(req)
            batch = Batch(reqs, "decode")
            ids = engine.input_ids(batch)
            assert runner.size_for(batch) is not None
            eager = engine.logits(batch, use_graph=False).clone()
            launched = engine.replay(batch, ids, launched=True).clone()
            replayed = engine.replay(batch, ids).clone()
            assert replayed.shape == eager.shape == (bs, engine.model_config.vocab_size)
            # A graph replays the recorded kernels on the same buffers: bit for bit the same.
            assert torch.equal(replayed, launched), f"batch {bs}, step {step}: replay differs"
            tolerance = BF16_RELATIVE_TOLERANCE * float(eager.abs().max())
            error = float((replayed - eager).abs().max())
            assert error <= tolerance, f"batch {bs}, step {step}: {error:.3f} > {tolerance:.3f}"
            assert torch.equal(engine.logits(batch), replayed), "the engine replays by default"
            tokens = engine.forward(batch).tolist()
            batch.advance()
            for req, token in zip(reqs, tokens):
                req.append_token(token)
        for req in reqs:
            engine.pages.release(req)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_tiny_replay_equals_eager_for_exact_and_padded_batches(tiny_model_dir: Path,
                                                               page_size: int) -> None:
    engine = graph_engine(tiny_model_dir, page_size)
    assert engine.pages.num_used == 1, "one page is kept for the padding entries"
    check_replay_against_eager(engine, [1, 3, 8, 13])  # 3 -> 4 and 13 -> 16 are padded
    assert engine.pages.num_free == engine.kv_budget.num_pages - 1


@pytest.mark.gpu
def test_qwen3_0_6b_like_replay_equals_eager() -> None:
    if not (QWEN3_06B_LIKE / "config.json").is_file():
        pytest.skip("models/qwen3-0.6b-like is missing: "
                    "python tools/make_tiny_model.py --like qwen3-0.6b --out models/qwen3-0.6b-like")
    engine = graph_engine(QWEN3_06B_LIKE, page_size=16, sizes=(1, 4, 8))
    check_replay_against_eager(engine, [1, 3, 8], steps=2)


@pytest.mark.gpu
def test_greedy_decoding_with_graphs_follows_eager(tiny_model_dir: Path) -> None:
    """Twelve greedy steps of a padded batch of 5, with and without graphs: the same tokens,
    except where a near tie (within the tolerance) lets rounding pick the other one."""
    engine = graph_engine(tiny_model_dir, page_size=16)
    prompts = ragged_prompts(5, engine.model_config.vocab_size, seed=7)
    runs = {}
    for use_graph in (False, True):
        reqs = decode_batch(engine, prompts, max_tokens=13)
        logits = []
        while not reqs[0].is_finished:
            for req in reqs:
                engine.pages.reserve(req)
            batch = Batch(reqs, "decode")
            step_logits = engine.logits(batch, use_graph=use_graph).clone()
            logits.append(step_logits)
            tokens = engine.sample(batch, step_logits).tolist()
            batch.advance()
            for req, token in zip(reqs, tokens):
                req.append_token(token)
        runs[use_graph] = ([r.output_ids for r in reqs], torch.stack(logits, dim=1))
        for req in reqs:
            engine.pages.release(req)
    (eager_tokens, eager_logits), (graph_tokens, _) = runs[False], runs[True]
    for i in range(len(prompts)):
        tolerance = BF16_RELATIVE_TOLERANCE * float(eager_logits[i].abs().max())
        for step, (a, b) in enumerate(zip(eager_tokens[i][1:], graph_tokens[i][1:])):
            if a != b:  # only a near tie may flip, and after it the sequences part ways
                gap = float((eager_logits[i, step, a] - eager_logits[i, step, b]).abs())
                assert gap <= tolerance, f"request {i} step {step}: {a} vs {b}, gap {gap:.3f}"
                break


@pytest.mark.gpu
def test_batches_the_graphs_cannot_serve_run_eagerly(tiny_model_dir: Path) -> None:
    engine = graph_engine(tiny_model_dir, page_size=16, sizes=(1, 2))
    runner = engine.graph_runner
    prefill = [Req(0, [1, 2, 3])]
    engine.pages.reserve(prefill[0])
    assert runner.size_for(Batch(prefill, "prefill")) is None
    engine.pages.release(prefill[0])
    reqs = decode_batch(engine, [[1, 2], [3, 4, 5], [6]])
    assert runner.size_for(Batch(reqs, "decode")) is None, "3 requests exceed the largest graph (2)"
    assert engine.forward(Batch(reqs, "decode")).shape == (3,)
    for req in reqs:
        engine.pages.release(req)


def allocations() -> int:
    """CUDA allocations the caching allocator has made so far (a counter that only grows)."""
    return torch.cuda.memory_stats()["allocation.all.allocated"]


@pytest.mark.gpu
@pytest.mark.parametrize("num_reqs", [1, 3])  # 3 replays the graph of 4: a padded batch
def test_a_replayed_decode_step_allocates_nothing(tiny_model_dir: Path, num_reqs: int) -> None:
    """Around the replay path (the batch written into the fixed buffers, the plan, the graph),
    40 decode steps allocate no CUDA memory, across page boundaries (page size 16)."""
    engine = graph_engine(tiny_model_dir, page_size=16)
    runner = engine.graph_runner
    reqs = decode_batch(engine, ragged_prompts(num_reqs, engine.model_config.vocab_size, seed=3),
                        max_tokens=50)
    before = allocations()
    torch.empty(1, device="cuda")
    assert allocations() == before + 1, "the counter must see an allocation"
    new_allocations = []
    for step in range(45):
        for req in reqs:
            engine.pages.reserve(req)
        batch = Batch(reqs, "decode")
        ids = engine.input_ids(batch)
        assert runner.size_for(batch) is not None
        before = allocations()
        logits = engine.replay(batch, ids)
        if step >= 5:  # after a warm-up
            new_allocations.append(allocations() - before)
        tokens = engine.sample(batch, logits).tolist()
        batch.advance()
        for req, token in zip(reqs, tokens):
            req.append_token(token)
    assert new_allocations == [0] * 40, new_allocations
    for req in reqs:
        engine.pages.release(req)
