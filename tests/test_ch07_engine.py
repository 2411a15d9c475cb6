"""Chapter 7: requests, batches and the engine.

The data types are tested on their own. The engine is tested on the tiny model: prompts of
different lengths prefilled together and decoded together must give exactly the tokens each
prompt gives alone, and exactly what ``transformers`` generates greedily (CPU, float32). The KV
budget must come from the CPU setting (or, on a GPU, from free memory times the fraction), and
every page must come back when the requests are released.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from minisgl.core import Batch, Req, SamplingParams
from minisgl.engine.config import EngineConfig
from minisgl.engine.engine import Engine, plan_kv_budget
from minisgl.kvcache import OutOfPagesError, RequestPages
from minisgl.models.config import ModelConfig

# Prompt lengths: a one-token prompt, short ones, one that spans several 4-token pages.
PROMPT_LENS = [1, 5, 12, 23]
DECODE_STEPS = 16
PAGE_SIZE = 4


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab_size, (n,), generator=generator).tolist() for n in lengths]


def greedy(max_tokens: int = DECODE_STEPS + 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def run_to_completion(engine: Engine, reqs: list[Req]) -> list[list[int]]:
    """Prefill all requests in one batch, then decode the unfinished ones together; release."""
    phase = "prefill"
    while live := [r for r in reqs if not r.is_finished]:
        for req in live:
            engine.pages.reserve(req)
        batch = Batch(live, phase)
        tokens = engine.forward(batch).tolist()
        batch.advance()
        for req, token in zip(live, tokens, strict=True):
            req.append_token(token, engine.eos_token_ids)
        phase = "decode"
    for req in reqs:
        engine.pages.release(req)
    return [r.output_ids for r in reqs]


def batched_and_alone(engine: Engine, prompts: list[list[int]],
                      params: SamplingParams) -> tuple[list[list[int]], list[list[int]]]:
    batched = run_to_completion(engine, [Req(i, p, params) for i, p in enumerate(prompts)])
    alone = [run_to_completion(engine, [Req(i, p, params)])[0] for i, p in enumerate(prompts)]
    return batched, alone


def hf_greedy(model_dir: Path, prompts: list[list[int]], new_tokens: int,
              device: str = "cpu") -> list[list[int]]:
    """transformers' greedy continuation of each prompt (EOS off), one prompt at a time."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    outputs = []
    with torch.inference_mode():
        for ids in prompts:
            input_ids = torch.tensor([ids], device=device)
            out = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                    generation_config=config)
            outputs.append(out[0, len(ids):].tolist())
    return outputs


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    """The tiny model on CPU in float32, 4-token pages, a small fixed pool."""
    return Engine(EngineConfig(tiny_model_dir, device="cpu", page_size=PAGE_SIZE,
                               num_pages=512, max_running_reqs=8))


@pytest.fixture(scope="module")
def prompts(engine: Engine) -> list[list[int]]:
    return random_prompts(PROMPT_LENS, engine.model_config.vocab_size)


@pytest.fixture(autouse=True)
def all_pages_return(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test that used the shared engine must leave every page and row free."""
    yield
    if "engine" in request.fixturenames:
        engine: Engine = request.getfixturevalue("engine")
        assert engine.pages.num_free == engine.kv_budget.num_pages, "pages leaked"
        assert engine.pages.num_free_rows == engine.config.max_running_reqs, "rows leaked"


# --------------------------------------------------------------------------------------------
# Req and Batch
# --------------------------------------------------------------------------------------------


def test_a_new_request_has_its_whole_prompt_to_compute() -> None:
    req = Req(7, [5, 6, 7], greedy())
    assert (req.num_tokens, req.cached_len, req.new_len) == (3, 0, 3)
    assert req.token_ids[req.cached_len:] == [5, 6, 7] and req.table_row is None


def test_after_prefill_only_the_sampled_token_is_new() -> None:
    req = Req(0, [5, 6, 7], greedy())
    req.cached_len = 3  # what Batch.advance does after the prefill
    req.append_token(42)
    assert req.token_ids == [5, 6, 7, 42]
    assert (req.new_len, req.token_ids[req.cached_len:]) == (1, [42])


@pytest.mark.parametrize(("params", "tokens", "reason"), [
    (SamplingParams(max_tokens=2), [9, 9], "length"),
    (SamplingParams(max_tokens=9), [9, 2], "stop"),  # 2 is the EOS below
    (SamplingParams(max_tokens=3, ignore_eos=True), [2, 2, 2], "length"),
    (SamplingParams(max_tokens=9, ignore_eos=True, stop_token_ids=[4]), [2, 4], "stop"),
])
def test_append_token_finishes_on_length_eos_and_stop_tokens(
        params: SamplingParams, tokens: list[int], reason: str) -> None:
    req = Req(0, [1], params)
    reasons = [req.append_token(t, eos_token_ids=[2]) for t in tokens]
    assert reasons[:-1] == [None] * (len(tokens) - 1)
    assert reasons[-1] == reason and req.finish_reason == reason
    assert req.output_ids == tokens, "the stopping token is kept"


def test_a_finished_request_takes_no_more_tokens() -> None:
    req = Req(0, [1], SamplingParams(max_tokens=1))
    req.append_token(3)
    with pytest.raises(RuntimeError, match="already finished"):
        req.append_token(4)


@pytest.mark.parametrize("prompt", [[], [3, -1]])
def test_request_rejects_empty_or_negative_prompts(prompt: list[int]) -> None:
    with pytest.raises(ValueError, match="request 3"):
        Req(3, prompt)


def fed_ids(engine: Engine, batch: Batch) -> list[int]:
    """The input ids the engine packs for ``batch`` (its requests hold pages meanwhile)."""
    for req in batch.reqs:
        engine.pages.reserve(req)
    try:
        return engine.input_ids(batch).tolist()
    finally:
        for req in batch.reqs:
            engine.pages.release(req)


def test_batch_counts_and_packs_the_new_tokens(engine: Engine) -> None:
    a, b = Req(0, [1, 2, 3]), Req(1, [4])
    batch = Batch([a, b], "prefill")
    assert (batch.size, batch.num_tokens, batch.is_prefill) == (2, 4, True)
    assert fed_ids(engine, batch) == [1, 2, 3, 4]


def test_decode_batch_rejects_a_request_that_was_not_prefilled() -> None:
    with pytest.raises(ValueError, match="prefill it first"):
        Batch([Req(0, [1, 2, 3])], "decode")


@pytest.mark.parametrize(("make", "match"), [
    (lambda r: Batch([], "prefill"), "at least one request"),
    (lambda r: Batch([r], "extend"), "phase must be one of"),
    (lambda r: Batch([r, r], "prefill"), "twice"),
])
def test_batch_rejects_impossible_batches(make, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make(Req(0, [1, 2]))


def test_chunk_lens_feed_only_the_first_tokens_of_a_request(engine: Engine) -> None:
    a, b = Req(0, [1, 2, 3, 4, 5]), Req(1, [6, 7])
    batch = Batch([a, b], "prefill", chunk_lens=[3, 2])
    assert (batch.new_lens, batch.num_tokens) == ([3, 2], 5)
    assert fed_ids(engine, batch) == [1, 2, 3, 6, 7]
    with pytest.raises(ValueError, match="between 1 and its 2 uncomputed"):
        Batch([a, b], "prefill", chunk_lens=[3, 3])


def test_batch_rejects_a_finished_request() -> None:
    req = Req(0, [1], SamplingParams(max_tokens=1))
    req.append_token(5)
    with pytest.raises(ValueError, match="has finished"):
        Batch([req], "prefill")


# --------------------------------------------------------------------------------------------
# EngineConfig
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value"), [
    ("device", "gpu"), ("dtype", "fp8"), ("attention_backend", "flash"), ("page_size", 0),
    ("memory_fraction", 1.5), ("memory_fraction", 0), ("cpu_kv_memory", 0), ("num_pages", -1),
    ("max_running_reqs", 0), ("max_seq_len", 0), ("cuda_graph", "yes"),
    ("cuda_graph_max_bs", 0), ("cuda_graph_batch_sizes", ()), ("page_size", True),
])
def test_engine_config_rejects_bad_values_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError) as info:
        EngineConfig("models/tiny-qwen3", **{field: value})
    assert field in str(info.value)


def test_cpu_kv_memory_defaults_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINISGL_CPU_KV_MEMORY", "3MiB")
    assert EngineConfig("m").cpu_kv_memory == 3 * 2**20
    assert EngineConfig("m", cpu_kv_memory=1000).cpu_kv_memory == 1000


# --------------------------------------------------------------------------------------------
# The KV budget
# --------------------------------------------------------------------------------------------


def test_plan_kv_budget_takes_the_whole_pages_that_fit(tiny_model_dir: Path) -> None:
    config = ModelConfig.from_pretrained(tiny_model_dir)
    per_page = config.kv_bytes_per_token(torch.float32) * 16
    budget = plan_kv_budget(10 * per_page + per_page - 1, "test", config, torch.float32, 16,
                            max_useful_pages=1000)
    assert (budget.num_pages, budget.bytes_per_page) == (10, per_page)
    assert budget.pool_bytes <= budget.budget_bytes and not budget.capped


def test_plan_kv_budget_never_exceeds_what_the_page_table_can_use(tiny_model_dir: Path) -> None:
    config = ModelConfig.from_pretrained(tiny_model_dir)
    budget = plan_kv_budget(2**30, "test", config, torch.float32, 16, max_useful_pages=33)
    assert budget.num_pages == 33 and budget.capped


def test_a_budget_below_one_page_is_a_clear_error(tiny_model_dir: Path) -> None:
    config = ModelConfig.from_pretrained(tiny_model_dir)
    with pytest.raises(ValueError, match="does not hold one page"):
        plan_kv_budget(100, "test", config, torch.float32, 16, max_useful_pages=33)


def test_on_cpu_the_pool_is_sized_from_the_cpu_kv_memory_flag(tiny_model_dir: Path) -> None:
    budget_bytes = 5 * 2**20
    engine = Engine(EngineConfig(tiny_model_dir, device="cpu", page_size=16,
                                 cpu_kv_memory=budget_bytes, max_running_reqs=4))
    per_token = engine.model_config.kv_bytes_per_token(torch.float32)
    assert engine.kv_budget.budget_bytes == budget_bytes
    assert engine.kv_budget.num_pages == budget_bytes // (16 * per_token)  # 80 pages
    assert engine.kv_pool.num_pages == engine.pages.num_pages == engine.kv_budget.num_pages
    assert engine.kv_pool.num_bytes <= budget_bytes
    assert engine.max_seq_len == min(engine.model_config.max_position_embeddings,
                                     engine.kv_budget.num_tokens)


def test_the_engine_logs_its_kv_budget(tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
                                       ) -> None:
    logger = logging.getLogger("minisgl")
    logger.addHandler(caplog.handler)  # minisgl's loggers do not propagate to the root
    try:
        with caplog.at_level(logging.INFO, logger="minisgl"):
            Engine(EngineConfig(tiny_model_dir, device="cpu", cpu_kv_memory=2**20,
                                max_running_reqs=2))
    finally:
        logger.removeHandler(caplog.handler)
    assert "KV budget: cpu_kv_memory" in caplog.text
    assert "256 pages x 1 tokens = 256 tokens x 4096 bytes" in caplog.text


# --------------------------------------------------------------------------------------------
# Pages for requests
# --------------------------------------------------------------------------------------------


def test_reserve_maps_the_prompt_and_a_new_page_every_page_size_steps(engine: Engine) -> None:
    req = Req(0, list(range(1, 6)), greedy(max_tokens=20))  # 5 tokens: two 4-token pages
    assert engine.pages.pages_needed(req) == 2
    assert engine.pages.reserve(req) == 2 and req.table_row is not None
    grew = []
    for step in range(8):
        req.cached_len = req.num_tokens  # as if a forward pass had run
        req.append_token(1)
        grew.append(engine.pages.reserve(req))
    # tokens 6..13: a new page when token 9 and token 13 arrive
    assert grew == [0, 0, 0, 1, 0, 0, 0, 1]
    assert engine.pages.release(req) == 4 and req.table_row is None


def test_reserve_is_all_or_nothing_when_pages_run_out(tiny_model_dir: Path) -> None:
    engine = Engine(EngineConfig(tiny_model_dir, device="cpu", page_size=4, num_pages=3,
                                 max_running_reqs=2))
    small, large = Req(0, [1] * 8), Req(1, [1] * 8)
    engine.pages.reserve(small)  # 2 of the 3 pages
    with pytest.raises(OutOfPagesError):
        engine.pages.reserve(large)
    assert large.table_row is None and engine.pages.num_free_rows == 1
    assert engine.pages.num_free == 1
    engine.pages.release(small)
    engine.pages.reserve(large)  # now it fits
    engine.pages.release(large)
    assert engine.pages.num_free == 3


def test_a_row_that_cannot_grow_keeps_the_pages_it_had() -> None:
    pages = RequestPages(num_pages=4, max_reqs=2, max_seq_len=32, page_size=4)
    req = Req(0, [1] * 6)
    assert pages.reserve(req) == 2
    before = pages.table.row_pages(req.table_row).tolist()
    req.cached_len = 6
    for _ in range(11):  # 17 tokens: 5 pages, one more than the pool has
        req.append_token(1)
    with pytest.raises(OutOfPagesError):
        pages.reserve(req)
    assert pages.table.row_pages(req.table_row).tolist() == before
    assert pages.num_free == 2 and pages.pages_held(req) == 2
    pages.release(req)


def test_no_free_row_means_no_pages_are_taken() -> None:
    pages = RequestPages(num_pages=8, max_reqs=1, max_seq_len=16, page_size=4)
    first, second = Req(0, [1] * 3), Req(1, [1] * 3)
    pages.reserve(first)
    with pytest.raises(RuntimeError, match="rows are in use"):
        pages.reserve(second)
    assert second.table_row is None and pages.num_free == 7


def test_release_returns_every_page_and_the_row() -> None:
    pages = RequestPages(num_pages=16, max_reqs=3, max_seq_len=40, page_size=4)
    reqs = [Req(i, [1] * n) for i, n in enumerate([1, 9, 13])]  # 1 + 3 + 4 pages
    taken = [pages.reserve(req) for req in reqs]
    assert taken == [pages.pages_held(req) for req in reqs] == [1, 3, 4]
    assert pages.num_free == 16 - 8 and pages.num_used == 8 and pages.num_free_rows == 0
    mapped = [p for req in reqs for p in pages.table.row_pages(req.table_row).tolist()]
    assert len(set(mapped)) == 8, "two rows map the same page"
    assert pages.release(reqs[1]) == 3 and reqs[1].table_row is None
    assert pages.num_free == 11 and pages.num_free_rows == 1
    with pytest.raises(ValueError, match="holds no page-table row"):
        pages.release(reqs[1])  # a second release would free its pages twice
    for req in (reqs[0], reqs[2]):
        pages.release(req)
    assert pages.num_free == 16 and pages.num_free_rows == 3


def test_a_row_can_start_with_pages_someone_else_holds() -> None:
    """A prefix cache lends a new row its pages: they are mapped, not allocated; closing the
    row hands every page back to the caller, and only what it frees becomes free."""
    pages = RequestPages(num_pages=8, max_reqs=2, max_seq_len=32, page_size=4)
    owner = Req(0, [1] * 8)
    pages.reserve(owner)
    prefix = pages.close_row(owner)  # now held by "the cache", not by a row
    assert len(prefix) == 2 and pages.num_free == 6
    borrower = Req(1, [1] * 10)  # 8 tokens of that prefix, 2 of its own
    pages.open_row(borrower, prefix)
    assert pages.pages_needed(borrower) == 1 and pages.reserve(borrower) == 1
    row = pages.table.row_pages(borrower.table_row).tolist()
    assert row[:2] == prefix and pages.num_free == 5
    with pytest.raises(ValueError, match="already"):
        pages.open_row(borrower)
    assert pages.close_row(borrower) == row
    pages.free_pages(row)  # the cache frees its prefix too
    assert pages.num_free == 8


def test_counts_agree_with_the_rows_under_random_traffic() -> None:
    rng = random.Random(0)
    pages = RequestPages(num_pages=40, max_reqs=6, max_seq_len=48, page_size=4)
    running: list[Req] = []
    for uid in range(300):
        if running and (rng.random() < 0.4 or pages.num_free_rows == 0):
            pages.release(running.pop(rng.randrange(len(running))))
        req = Req(uid, [1] * rng.randint(1, 48))
        free_before = pages.num_free
        try:
            got = pages.reserve(req)
        except OutOfPagesError:
            assert req.table_row is None and pages.num_free == free_before
        else:
            assert got == free_before - pages.num_free == pages.pages_held(req)
            running.append(req)
        held = sum(pages.pages_held(r) for r in running)
        assert pages.num_free + held == pages.num_pages
        assert pages.num_free_rows == 6 - len(running)
    for req in running:
        pages.release(req)
    assert pages.num_free == 40


def test_a_seeded_request_gets_its_generator_when_it_first_runs(engine: Engine) -> None:
    req = Req(0, [3, 1, 4], SamplingParams(temperature=1.0, seed=7, max_tokens=2))
    engine.pages.reserve(req)
    assert req.generator is None, "pages are not a request's random stream"
    engine.forward(Batch([req], "prefill"))
    assert req.generator is not None
    engine.pages.release(req)


def test_a_request_longer_than_max_seq_len_is_refused(tiny_model_dir: Path) -> None:
    engine = Engine(EngineConfig(tiny_model_dir, device="cpu", num_pages=64, max_seq_len=10,
                                 max_running_reqs=2))
    with pytest.raises(ValueError, match="max_seq_len=10"):
        engine.pages.reserve(Req(0, [1] * 11))


def test_running_a_request_without_pages_is_an_error(engine: Engine) -> None:
    with pytest.raises(ValueError, match="call engine.pages.reserve"):
        engine.forward(Batch([Req(0, [1, 2])], "prefill"))


def test_forward_leaves_the_lengths_to_the_caller_and_advance_moves_them(engine: Engine
                                                                          ) -> None:
    req = Req(0, [3, 1, 4, 1, 5], greedy())
    engine.pages.reserve(req)
    batch = Batch([req], "prefill")
    next_token = engine.forward(batch)
    assert next_token.shape == (1,) and req.cached_len == 0, "the engine only computes"
    batch.advance()
    assert req.cached_len == 5
    req.append_token(int(next_token[0]))
    assert req.new_len == 1 and req.token_ids == [3, 1, 4, 1, 5, int(next_token[0])]
    engine.pages.release(req)


# --------------------------------------------------------------------------------------------
# The engine against one-at-a-time and against transformers
# --------------------------------------------------------------------------------------------


def test_batched_equals_one_at_a_time_equals_transformers(
        engine: Engine, prompts: list[list[int]], tiny_model_dir: Path) -> None:
    """Four prompts of 1, 5, 12 and 23 tokens, prefilled in one batch, decoded together for
    16 steps: the same tokens as each prompt alone, and as transformers' greedy search."""
    batched, alone = batched_and_alone(engine, prompts, greedy())
    reference = hf_greedy(tiny_model_dir, prompts, DECODE_STEPS + 1)
    for i, prompt in enumerate(prompts):
        assert batched[i] == alone[i], f"prompt of {len(prompt)} tokens: batch changed it"
        assert batched[i] == reference[i], f"prompt of {len(prompt)} tokens: not transformers'"
    assert len({tuple(t) for t in batched}) == len(prompts), "the prompts should differ"


@pytest.mark.parametrize("page_size", [1, 16])
def test_batched_equals_one_at_a_time_for_other_page_sizes(tiny_model_dir: Path,
                                                           page_size: int) -> None:
    engine = Engine(EngineConfig(tiny_model_dir, device="cpu", page_size=page_size,
                                 num_pages=2048 // page_size, max_running_reqs=4))
    prompts = random_prompts([3, 17, 9], engine.model_config.vocab_size, seed=1)
    batched, alone = batched_and_alone(engine, prompts, greedy(max_tokens=6))
    assert batched == alone
    assert engine.pages.num_free == engine.kv_budget.num_pages


def test_each_request_samples_with_its_own_params_and_seed(engine: Engine,
                                                           prompts: list[list[int]]) -> None:
    """A seeded sampled request gives the same tokens alone and beside a greedy one: its
    generator belongs to it, not to the batch."""
    sampled = SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=8)
    mixed = run_to_completion(engine, [Req(0, prompts[1], greedy(8)),
                                       Req(1, prompts[2], sampled)])
    alone_sampled = run_to_completion(engine, [Req(1, prompts[2], sampled)])[0]
    alone_greedy = run_to_completion(engine, [Req(0, prompts[1], greedy(8))])[0]
    assert mixed == [alone_greedy, alone_sampled]


def test_a_prompt_computed_in_chunks_continues_like_one_computed_at_once(
        engine: Engine, prompts: list[list[int]]) -> None:
    """Chapter 10's chunked prefill, by hand: 23 prompt tokens as 8 + 8 + 7, beside a request
    that decodes meanwhile, give the same tokens as the whole prompt in one pass."""
    whole = run_to_completion(engine, [Req(0, prompts[3], greedy(6))])[0]
    chunked, other = Req(0, prompts[3], greedy(6)), Req(1, prompts[1], greedy(6))
    engine.pages.reserve(chunked)
    engine.pages.reserve(other)
    for size in (8, 8):  # the samples of a partial prompt mean nothing: dropped
        batch = Batch([chunked], "prefill", chunk_lens=[size])
        engine.forward(batch)
        batch.advance()
    assert (chunked.cached_len, chunked.new_len, chunked.output_ids) == (16, 7, [])
    batch = Batch([chunked, other], "prefill")  # the last chunk, and the other request
    tokens = engine.forward(batch).tolist()
    batch.advance()
    chunked.append_token(tokens[0])
    other.append_token(tokens[1])
    assert run_to_completion(engine, [chunked, other])[0] == whole


def test_every_page_and_row_returns_after_release(engine: Engine,
                                                  prompts: list[list[int]]) -> None:
    reqs = [Req(i, p, greedy(5)) for i, p in enumerate(prompts)]
    for req in reqs:
        engine.pages.reserve(req)
    assert engine.pages.num_free < engine.kv_budget.num_pages
    run_to_completion(engine, reqs)
    assert engine.pages.num_free == engine.kv_budget.num_pages
    assert engine.pages.num_free_rows == engine.config.max_running_reqs


# The calls the chapter's table of one decode step names, as (file under minisgl/, function).
DECODE_STEP_CALLS = [
    ("kvcache/request_pages.py", "RequestPages.reserve"), ("core.py", "Batch.__post_init__"),
    ("engine/engine.py", "Engine.forward"), ("engine/engine.py", "Engine.logits"),
    ("attention/base.py", "BaseAttnBackend.prepare"), ("kvcache/page_table.py", "PageTable.locate"),
    ("attention/base.py", "BaseAttnBackend.forward"), ("kvcache/mha_pool.py", "MHAKVPool.store_kv"),
    ("engine/engine.py", "Engine.sample"), ("engine/sample.py", "sample_batch"),
    ("core.py", "Batch.advance"), ("core.py", "Req.append_token"),
]


def test_one_decode_step_runs_through_the_calls_of_the_chapter_s_table(engine: Engine,
                                                                      prompts: list[list[int]]
                                                                      ) -> None:
    """The page's table of a decode step is what a step runs: every call it names is made, in
    that order, and the step stays within 40 functions outside the model's layers."""
    import os
    import sys

    import minisgl
    root = os.path.dirname(minisgl.__file__) + os.sep
    reqs = [Req(i, p, greedy()) for i, p in enumerate(prompts[:3])]

    def step(phase: str) -> None:
        engine.pages.reserve(*reqs)
        batch = Batch(reqs, phase)
        tokens = engine.forward(batch).tolist()
        batch.advance()
        for req, token in zip(reqs, tokens):
            req.append_token(token)

    calls: list[tuple[str, str]] = []

    def record(frame, event, arg):  # noqa: ANN001, ANN202 (sys.setprofile's signature)
        path = frame.f_code.co_filename
        if event == "call" and path.startswith(root) and "<" not in frame.f_code.co_qualname:
            calls.append((path[len(root):], frame.f_code.co_qualname))

    try:
        step("prefill")
        sys.setprofile(record)
        step("decode")
    finally:
        sys.setprofile(None)
        for req in reqs:
            engine.pages.release(req)
    first_call = {call: calls.index(call) for call in dict.fromkeys(calls)}
    missing = [call for call in DECODE_STEP_CALLS if call not in first_call]
    assert not missing, f"the step never called {missing}"
    order = [first_call[call] for call in DECODE_STEP_CALLS]
    assert order == sorted(order), "the calls come in another order than the table's"
    engine_side = {call for call in first_call
                   if call[0].split("/")[0] not in ("layers", "models", "moe")}
    assert len(engine_side) <= 40, sorted(engine_side)


# --------------------------------------------------------------------------------------------
# On a GPU
# --------------------------------------------------------------------------------------------

# bf16 keeps 8 bits of mantissa: two correct implementations round differently, and four
# layers of that differ by up to a few percent of the largest logit (chapter 4 measured it).
BF16_RELATIVE_TOLERANCE = 0.04


def greedy_with_logits(engine: Engine, prompts: list[list[int]],
                       steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens of each prompt, all in one batch, with the logits each token came from."""
    reqs = [Req(i, p, greedy(steps)) for i, p in enumerate(prompts)]
    logits: list[list[torch.Tensor]] = [[] for _ in reqs]
    phase = "prefill"
    while live := [r for r in reqs if not r.is_finished]:
        for req in live:
            engine.pages.reserve(req)
        batch = Batch(live, phase)
        step_logits = engine.logits(batch).float().cpu()
        tokens = engine.sample(batch, step_logits).tolist()
        batch.advance()
        for req, row, token in zip(live, step_logits, tokens, strict=True):
            req.append_token(token)
            logits[req.uid].append(row)
        phase = "decode"
    for req in reqs:
        engine.pages.release(req)
    return [r.output_ids for r in reqs], [torch.stack(rows) for rows in logits]


def assert_same_or_near_tie(tokens_a: list[int], tokens_b: list[int], logits_a: torch.Tensor,
                            tolerance: float, what: str) -> None:
    """Two greedy runs in bf16 must agree until, at most, a step where the two tokens they
    chose score within the tolerance of each other (a near tie rounding can flip)."""
    for step, (a, b) in enumerate(zip(tokens_a, tokens_b, strict=True)):
        if a != b:
            gap = float((logits_a[step, a] - logits_a[step, b]).abs())
            assert gap <= tolerance, f"{what}: step {step} picked {a} vs {b}, {gap:.3f} apart"
            return


@pytest.mark.gpu
def test_on_cuda_the_pool_fits_the_fraction_of_free_memory(tiny_model_dir: Path) -> None:
    fraction = 0.05
    # Many rows, so the page table could use more than the budget buys (no cap).
    engine = Engine(EngineConfig(tiny_model_dir, device="cuda", page_size=16,
                                 memory_fraction=fraction, max_running_reqs=4096,
                                 cuda_graph=False))
    budget = engine.kv_budget
    total = torch.cuda.get_device_properties(engine.device).total_memory
    assert budget.free_bytes is not None and 0 < budget.free_bytes <= total
    assert budget.budget_bytes == int(fraction * budget.free_bytes)
    assert not budget.capped
    assert budget.budget_bytes - budget.bytes_per_page < engine.kv_pool.num_bytes
    assert engine.kv_pool.num_bytes <= budget.budget_bytes
    free_now = torch.cuda.mem_get_info(engine.device)[0]
    # The pool, the page table and the attention workspace came out of the free memory.
    assert free_now <= budget.free_bytes - engine.kv_pool.num_bytes + 64 * 2**20


@pytest.mark.gpu
def test_on_cuda_float32_batched_equals_one_at_a_time_equals_transformers(
        tiny_model_dir: Path) -> None:
    engine = Engine(EngineConfig(tiny_model_dir, device="cuda", dtype="float32", page_size=4,
                                 num_pages=512, max_running_reqs=8))
    prompts = random_prompts(PROMPT_LENS, engine.model_config.vocab_size)
    batched, alone = batched_and_alone(engine, prompts, greedy())
    reference = hf_greedy(tiny_model_dir, prompts, DECODE_STEPS + 1, device="cuda")
    assert batched == alone
    assert batched == reference


@pytest.mark.gpu
def test_on_cuda_bf16_batched_matches_one_at_a_time_and_transformers(
        tiny_model_dir: Path) -> None:
    """bf16 with the default attention backend (FlashInfer where installed). Batched and
    one-at-a-time runs give the same tokens unless a near tie flips one; every token is one
    that transformers, scoring the same sequence, rates within the tolerance of its best."""
    from transformers import AutoModelForCausalLM

    engine = Engine(EngineConfig(tiny_model_dir, device="cuda", dtype="bfloat16", page_size=16,
                                 num_pages=512, max_running_reqs=8, cuda_graph=False))
    prompts = random_prompts(PROMPT_LENS, engine.model_config.vocab_size)
    steps = DECODE_STEPS + 1
    batched, batched_logits = greedy_with_logits(engine, prompts, steps)
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    hf_model = hf_model.to("cuda").eval()
    identical = 0
    for i, prompt in enumerate(prompts):
        alone, alone_logits = greedy_with_logits(engine, [prompt], steps)
        tolerance = BF16_RELATIVE_TOLERANCE * float(batched_logits[i].abs().max())
        prefill_gap = float((batched_logits[i][0] - alone_logits[0][0]).abs().max())
        assert prefill_gap <= tolerance, f"prompt {i}: prefill logits differ by {prefill_gap}"
        assert_same_or_near_tie(batched[i], alone[0], batched_logits[i], tolerance,
                                f"prompt {i} batched vs alone")
        identical += batched[i] == alone[0]

        sequence = torch.tensor([prompt + batched[i]], device="cuda")
        with torch.inference_mode():
            reference = hf_model(sequence).logits[0, len(prompt) - 1:-1].float().cpu()
        error = float((batched_logits[i] - reference).abs().max())
        assert error <= tolerance, f"prompt {i}: logits {error:.3f} from transformers'"
        chosen = reference.gather(1, torch.tensor(batched[i])[:, None])[:, 0]
        gap = float((reference.max(dim=-1).values - chosen).max())
        assert gap <= tolerance, f"prompt {i}: picked a token {gap:.3f} below transformers' best"
    print(f"bf16 {engine.attn_backend.name}: {identical}/{len(prompts)} prompts identical "
          "batched and alone")
    assert engine.pages.num_free == engine.kv_budget.num_pages
