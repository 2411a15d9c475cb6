"""Chapter 9: the scheduler, continuous batching and the offline ``LLM``.

What these tests pin down:

- requests that arrive over time and share batches get exactly the tokens each gets alone, and
  exactly what ``transformers`` generates greedily (CPU, float32);
- a request finishes on EOS, on a stop token or at ``max_tokens``, with that reason recorded;
- every KV page and page-table row comes back after a run (checked after every test that used
  the shared scheduler, and after every step of the runs below);
- admission keeps its promises: a pool too small for all requests at once serves them all,
  never holding more than it has, with requests waiting their turn; rows and the per-step token
  budget are respected too;
- an aborted request, waiting or running, gives its pages back at once.
"""

from __future__ import annotations

import dataclasses

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from minisgl.core import Req, SamplingParams
from minisgl.kvcache import CacheHandle
from minisgl.kvcache.naive_cache import NaivePrefixCache
from minisgl.llm import LLM
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.prefill import PrefillBudget, lifetime_pages
from minisgl.scheduler.scheduler import Scheduler, StepResult

PAGE_SIZE = 4


# These tests describe the synchronous loop, which reads a batch's tokens in the step that
# launches it; from chapter 12 on the scheduler overlaps unless told otherwise.
SYNCHRONOUS = ({"overlap": False}
               if "overlap" in {f.name for f in dataclasses.fields(SchedulerConfig)} else {})


def make_scheduler(model_dir: Path, **options: object) -> Scheduler:
    settings: dict[str, object] = {"device": "cpu", "page_size": PAGE_SIZE, "num_pages": 256,
                                   "max_running_reqs": 8}
    return Scheduler(SchedulerConfig(model_dir, **{**settings, **SYNCHRONOUS, **options}))


def random_prompts(lengths: list[int], vocab_size: int = 2048, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab_size, (n,), generator=generator).tolist() for n in lengths]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def run(scheduler: Scheduler, reqs: list[Req], arrivals: list[int] | None = None,
        on_step: Callable[[StepResult], None] | None = None) -> list[StepResult]:
    """Add ``reqs[i]`` before step ``arrivals[i]`` (all at step 0 by default) and step until every
    request has finished, checking the page bookkeeping after every step."""
    arrivals = arrivals or [0] * len(reqs)
    results: list[StepResult] = []
    step = 0
    while step <= max(arrivals, default=0) or scheduler.has_work:
        for req, arrival in zip(reqs, arrivals):
            if arrival == step:
                scheduler.add(req)
        results.append(scheduler.step())
        scheduler.check_integrity()
        if on_step is not None:
            on_step(results[-1])
        step += 1
        assert step < 1000, "the run does not end"
    assert all(req.is_finished for req in reqs)
    return results


def alone(scheduler: Scheduler, prompt: list[int], params: SamplingParams) -> list[int]:
    """The tokens ``prompt`` gets with no other request around: sequential generation."""
    req = Req(10_000, prompt, params)
    run(scheduler, [req])
    return req.output_ids


@pytest.fixture(scope="module")
def scheduler(tiny_model_dir: Path) -> Scheduler:
    """The tiny model on CPU, float32, 4-token pages, a pool with room for everyone."""
    return make_scheduler(tiny_model_dir)


@pytest.fixture(autouse=True)
def nothing_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test that used the shared scheduler: no request, page or row is left over."""
    yield
    if "scheduler" in request.fixturenames:
        scheduler: Scheduler = request.getfixturevalue("scheduler")
        assert not scheduler.has_work, "requests left waiting or running"
        scheduler.check_integrity()
        assert scheduler.cache.pages_in_use == 0, "pages leaked"
        assert scheduler.engine.pages.num_free_rows == 8, "rows leaked"


# --------------------------------------------------------------------------------------------
# Settings, the naive prefix cache and the admission budget
# --------------------------------------------------------------------------------------------


def test_config_rejects_an_unknown_prefix_cache_and_lists_the_choices() -> None:
    with pytest.raises(ValueError, match=r"prefix_cache must be one of naive[^;]*; got 'lru'"):
        SchedulerConfig("models/tiny-qwen3", prefix_cache="lru")


@pytest.mark.parametrize("value", [0, -5, True, 2.5])
def test_config_rejects_a_bad_token_budget(value: object) -> None:
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        SchedulerConfig("models/tiny-qwen3", max_prefill_tokens=value)


def test_config_still_checks_the_engine_fields() -> None:
    with pytest.raises(ValueError, match="page_size"):
        SchedulerConfig("models/tiny-qwen3", page_size=0)


def test_the_naive_cache_matches_nothing_and_keeps_nothing() -> None:
    cache = NaivePrefixCache(page_size=4)
    match = cache.match_prefix(list(range(40)))
    assert (match.num_tokens, match.pages) == (0, [])
    cache.lock(match.handle)
    result = cache.insert(list(range(8)), [5, 9])
    assert (result.num_already_cached, result.handle.num_tokens) == (0, 0), "keeps nothing"
    cache.unlock(match.handle)
    assert cache.evict(3) == []
    assert (cache.num_evictable_pages, cache.num_locked_pages) == (0, 0)


def test_the_naive_cache_rejects_partial_pages_and_foreign_handles() -> None:
    cache = NaivePrefixCache(page_size=4)
    with pytest.raises(ValueError, match="whole pages"):
        cache.insert(list(range(6)), [1, 2])
    with pytest.raises(ValueError, match="empty handles"):
        cache.lock(CacheHandle(num_tokens=8))


def test_budget_rows_and_pages_are_hard_limits_tokens_bend_for_the_first_request() -> None:
    budget = PrefillBudget(tokens=10, pages=6, rows=2)
    assert budget.admits(new_tokens=30, pages=3, is_first=True), "a long prompt runs alone"
    assert not budget.admits(new_tokens=30, pages=3, is_first=False)
    assert not budget.admits(new_tokens=1, pages=7, is_first=True), "pages never bend"
    budget.take(new_tokens=8, pages=3)
    assert (budget.tokens, budget.pages, budget.rows) == (2, 3, 1)
    budget.take(new_tokens=1, pages=1)
    assert not budget.admits(new_tokens=1, pages=1, is_first=True), "no row left"


def test_lifetime_pages_count_the_prompt_and_all_but_the_last_output() -> None:
    req = Req(0, [1] * 5, SamplingParams(max_tokens=4))  # 5 + 4 - 1 = 8 tokens stored at most
    assert lifetime_pages(req, 4) == 2
    assert lifetime_pages(req, 1) == 8
    assert lifetime_pages(Req(0, [1] * 5, SamplingParams(max_tokens=5)), 4) == 3


# --------------------------------------------------------------------------------------------
# Continuous batching gives each request what it gets alone
# --------------------------------------------------------------------------------------------


def test_continuous_batching_equals_sequential(scheduler: Scheduler) -> None:
    """Eight requests of mixed lengths, arriving at steps 0 to 9, one of them sampled with a
    seed: each gets exactly the tokens it gets when it runs alone."""
    prompts = random_prompts([3, 11, 1, 17, 6, 9, 24, 2], seed=1)
    params = [greedy(n) for n in (9, 4, 12, 6, 1, 8, 5, 10)]
    params[5] = SamplingParams(temperature=0.9, top_k=40, seed=7, max_tokens=8)
    reqs = [Req(uid, prompt, p) for uid, (prompt, p) in enumerate(zip(prompts, params))]
    results = run(scheduler, reqs, arrivals=[0, 0, 0, 2, 3, 3, 5, 9])

    for req in reqs:
        assert len(req.output_ids) == req.params.max_tokens
        assert req.output_ids == alone(scheduler, req.prompt_ids, req.params), (
            f"request {req.uid}: batching changed its tokens")
    decode_sizes = {len(r.uids) for r in results if r.phase == "decode"}
    assert max(decode_sizes) >= 4 and min(decode_sizes) == 1, "the batch grew and shrank"


def test_requests_join_and_leave_the_decode_batch_every_step(scheduler: Scheduler) -> None:
    """A arrives with B, C two steps later; A finishes at its third token, the step it
    samples it, and is gone from the very next batch."""
    a, b, c = (Req(uid, p, greedy(n)) for uid, p, n in
               zip("abc", random_prompts([5, 3, 4], seed=2), (3, 6, 3)))
    results = run(scheduler, [a, b, c], arrivals=[0, 0, 2])
    assert [(r.phase, r.uids) for r in results] == [
        ("prefill", ("a", "b")),    # a and b: first token
        ("decode", ("a", "b")),     # second token
        ("prefill", ("c",)),        # c arrived: it is prefilled first, a and b wait a step
        ("decode", ("a", "b", "c")),  # a's third token: a finishes
        ("decode", ("b", "c")),     # c finishes
        ("decode", ("b",)),
        ("decode", ("b",)),         # b's sixth token
    ]
    assert [[req.uid for req in r.finished] for r in results] == [[], [], [], ["a"], ["c"], [],
                                                                  ["b"]]


def test_a_request_can_finish_on_its_first_token(scheduler: Scheduler) -> None:
    req = Req(0, random_prompts([7])[0], greedy(1))
    (result,) = run(scheduler, [req])
    assert result.phase == "prefill" and result.finished == (req,)
    assert req.finish_reason == "length" and len(req.output_ids) == 1
    assert result.pages_in_use == 0 and result.running == (), "its pages came back in that step"


# --------------------------------------------------------------------------------------------
# Finishing
# --------------------------------------------------------------------------------------------


def test_max_tokens_finishes_with_length(scheduler: Scheduler) -> None:
    reqs = [Req(i, p, greedy(n)) for i, (p, n) in enumerate(zip(random_prompts([4, 9]), (2, 7)))]
    run(scheduler, reqs)
    assert [(r.finish_reason, len(r.output_ids)) for r in reqs] == [("length", 2), ("length", 7)]


def test_a_stop_token_finishes_with_stop_and_is_kept(scheduler: Scheduler) -> None:
    prompt = random_prompts([6], seed=3)[0]
    free_run = alone(scheduler, prompt, greedy(10))
    index = next(i for i, t in enumerate(free_run) if i >= 2 and t not in free_run[:i])
    params = SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[free_run[index]])
    req, other = Req(0, prompt, params), Req(1, random_prompts([3])[0], greedy(10))
    run(scheduler, [req, other])
    assert req.finish_reason == "stop" and req.output_ids == free_run[:index + 1]
    assert other.finish_reason == "length", "the batch-mate is not stopped by another's token"


def test_eos_finishes_with_stop_unless_ignore_eos(scheduler: Scheduler,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny model's random weights never produce its real EOS, so one of the tokens it
    does produce plays the part."""
    prompt = random_prompts([8], seed=4)[0]
    free_run = alone(scheduler, prompt, greedy(10))
    index = next(i for i, t in enumerate(free_run) if i >= 1 and t not in free_run[:i])
    monkeypatch.setattr(scheduler, "eos_token_ids", (free_run[index],))
    stopped = Req(0, prompt, SamplingParams(max_tokens=10))
    ignoring = Req(1, prompt, SamplingParams(max_tokens=10, ignore_eos=True))
    run(scheduler, [stopped, ignoring])
    assert stopped.finish_reason == "stop" and stopped.output_ids == free_run[:index + 1]
    assert ignoring.finish_reason == "length" and ignoring.output_ids == free_run


# --------------------------------------------------------------------------------------------
# Pages and admission
# --------------------------------------------------------------------------------------------


def test_every_page_and_row_returns_after_the_run(scheduler: Scheduler) -> None:
    reqs = [Req(i, p, greedy(5 + i)) for i, p in enumerate(random_prompts([5, 13, 2, 30]))]
    peak = max(r.pages_in_use for r in run(scheduler, reqs))
    assert peak > 0
    assert scheduler.cache.pages_in_use == 0 and scheduler.engine.pages.num_free == 256
    assert scheduler.engine.pages.num_free_rows == scheduler.config.max_running_reqs


def test_a_pool_too_small_for_everyone_serves_everyone_in_turn(tiny_model_dir: Path,
                                                               scheduler: Scheduler) -> None:
    """12 pages of 4 tokens; six requests that need 4 or 5 pages each at worst (25 in all).
    At most three run at once, the others wait; every promise is kept, so no step runs out of
    pages, and every request gets the tokens it gets alone."""
    small = make_scheduler(tiny_model_dir, num_pages=12)
    prompts = random_prompts([9, 4, 12, 7, 10, 5], seed=5)
    reqs = [Req(i, p, greedy(n)) for i, (p, n) in enumerate(zip(prompts, (8, 12, 6, 10, 7, 9)))]
    worst = {req.uid: lifetime_pages(req, PAGE_SIZE) for req in reqs}
    assert sum(worst.values()) > 2 * 12, "the pool must be far too small for all at once"

    def check(result: StepResult) -> None:
        assert result.pages_in_use <= 12
        assert sum(worst[uid] for uid in result.running) <= 12, "admitted beyond the pool"

    results = run(small, reqs, on_step=check)
    assert max(len(r.running) for r in results) < len(reqs)
    assert any(r.waiting and r.running for r in results), "requests waited for pages"
    for req in reqs:
        assert req.output_ids == alone(scheduler, req.prompt_ids, req.params)
    assert small.cache.pages_in_use == 0


def test_admission_respects_max_running_reqs(tiny_model_dir: Path) -> None:
    small = make_scheduler(tiny_model_dir, max_running_reqs=2)
    reqs = [Req(i, p, greedy(4)) for i, p in enumerate(random_prompts([3, 5, 2, 6, 4]))]
    results = run(small, reqs)
    assert max(len(r.running) for r in results) == 2
    assert all(len(r.uids) <= 2 for r in results)


def test_a_prefill_batch_stays_within_the_token_budget(tiny_model_dir: Path) -> None:
    """A budget of 16 prompt tokens: 6-token prompts go two at a time; a 30-token prompt,
    longer than the budget, runs in a prefill of its own (chapter 10 will cut it up)."""
    small = make_scheduler(tiny_model_dir, max_prefill_tokens=16)
    reqs = [Req(i, p, greedy(3)) for i, p in enumerate(random_prompts([6, 6, 30, 6, 6, 6]))]
    prefills = [r for r in run(small, reqs) if r.phase == "prefill"]
    assert [r.uids for r in prefills] == [(0, 1), (2,), (3, 4), (5,)]
    assert all(r.num_tokens <= 16 or len(r.uids) == 1 for r in prefills)


# --------------------------------------------------------------------------------------------
# Adding and aborting requests
# --------------------------------------------------------------------------------------------


def test_add_rejects_a_uid_in_use_a_used_request_and_bad_prompts(scheduler: Scheduler) -> None:
    scheduler.add(Req(1, [5, 6]))
    try:
        with pytest.raises(ValueError, match="uid 1 is already"):
            scheduler.add(Req(1, [7]))
        used = Req(2, [5], greedy(1))
        used.append_token(3)
        with pytest.raises(ValueError, match="has run before"):
            scheduler.add(used)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            scheduler.add(Req(3, [1, 2048]))
        with pytest.raises(ValueError, match="longer than max_seq_len"):
            scheduler.add(Req(4, [1] * (scheduler.max_seq_len + 1)))
    finally:
        scheduler.abort(1)


def test_add_lowers_a_max_tokens_that_would_outgrow_max_seq_len(tiny_model_dir: Path) -> None:
    small = make_scheduler(tiny_model_dir, num_pages=5)  # 20 token slots
    req = Req(0, [1] * 15, greedy(100))
    small.add(req)
    assert req.params.max_tokens == 6  # 15 prompt + 5 stored outputs = 20; the 6th is not stored
    run(small, [])
    assert req.finish_reason == "length" and len(req.output_ids) == 6


def test_abort_a_waiting_request(tiny_model_dir: Path) -> None:
    small = make_scheduler(tiny_model_dir, num_pages=6)
    first, second = (Req(i, p, greedy(10)) for i, p in enumerate(random_prompts([8, 8])))
    small.add(first)
    small.add(second)
    result = small.step()
    assert result.uids == (0,) and result.waiting == (1,), "the second does not fit yet"
    in_use = small.cache.pages_in_use
    assert small.abort(1) is second
    assert small.cache.pages_in_use == in_use and small.num_waiting == 0
    run(small, [])
    assert second.output_ids == [] and second.finish_reason is None, "it never ran"
    assert first.finish_reason == "length" and small.cache.pages_in_use == 0


def test_abort_a_running_request_frees_its_pages_at_once(scheduler: Scheduler) -> None:
    prompts = random_prompts([9, 14, 5], seed=6)
    reqs = [Req(i, p, greedy(12)) for i, p in enumerate(prompts)]
    for req in reqs:
        scheduler.add(req)
    for _ in range(4):
        scheduler.step()
    held = scheduler.cache.pages.pages_held(reqs[1])
    in_use = scheduler.cache.pages_in_use
    assert scheduler.abort(1) is reqs[1] and held > 0
    assert scheduler.cache.pages_in_use == in_use - held
    assert reqs[1].table_row is None and scheduler.num_running == 2
    scheduler.check_integrity()
    run(scheduler, [])
    for req in (reqs[0], reqs[2]):
        assert req.output_ids == alone(scheduler, req.prompt_ids, req.params)


def test_abort_of_an_unknown_or_finished_request_returns_none(scheduler: Scheduler) -> None:
    req = Req(0, [4, 5, 6], greedy(2))
    run(scheduler, [req])
    assert scheduler.abort(0) is None and scheduler.abort(12345) is None


# --------------------------------------------------------------------------------------------
# The offline LLM
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    # 48 pages of 4 tokens: 16 requests do not all fit at once, so admission is exercised.
    return LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=48, max_running_reqs=8)


def test_generate_takes_strings_and_token_lists(llm: LLM) -> None:
    text = "The capital of France is"
    ids = llm.tokenizer.encode(text)
    out = llm.generate([text, ids, [7, 8, 9]], greedy(5))
    assert [set(o) for o in out] == [{"text", "token_ids", "finish_reason"}] * 3
    assert out[0]["token_ids"] == out[1]["token_ids"], "a string is its token ids"
    assert out[0]["text"] == llm.tokenizer.decode(out[0]["token_ids"])
    assert [o["finish_reason"] for o in out] == ["length"] * 3
    assert llm.generate(text, greedy(5)) == out[:1], "a single string is one prompt"


def test_generate_takes_one_params_or_one_per_prompt(llm: LLM) -> None:
    prompts = random_prompts([4, 6, 2], seed=7)
    shared = llm.generate(prompts, greedy(3))
    assert [len(o["token_ids"]) for o in shared] == [3, 3, 3]
    each = llm.generate(prompts, [greedy(1), greedy(3), greedy(6)])
    assert [len(o["token_ids"]) for o in each] == [1, 3, 6]
    assert each[1] == shared[1]
    assert len(llm.generate(prompts)[0]["token_ids"]) == SamplingParams().max_tokens


def test_generated_text_leaves_out_the_token_that_stopped_it(llm: LLM) -> None:
    prompt = random_prompts([5], seed=8)[0]
    free = llm.generate([prompt], greedy(8))[0]["token_ids"]
    stop = SamplingParams(max_tokens=8, stop_token_ids=[free[3]])
    out = llm.generate([prompt], stop)[0]
    assert out["finish_reason"] == "stop" and out["token_ids"][-1] == free[3]
    assert out["text"] == llm.tokenizer.decode(out["token_ids"][:-1])


@pytest.mark.parametrize(("prompts", "params", "error", "match"), [
    ([[1, 2], [3]], [greedy(2)], ValueError, "1 entries for 2 prompts"),
    ([1, 2, 3], None, TypeError, r"\[\[1, 2, 3\]\]"),
    (["hello", ""], None, ValueError, "prompt 1 is empty"),
    ([[1, 2], 3.5], None, TypeError, "prompt 1 must be"),
])
def test_generate_rejects_bad_inputs(llm: LLM, prompts: object, params: object,
                                     error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        llm.generate(prompts, params)


def test_llm_rejects_an_unknown_engine_option(tiny_model_dir: Path) -> None:
    with pytest.raises(TypeError, match="unknown engine option.*page_sise.*page_size"):
        LLM(tiny_model_dir, device="cpu", page_sise=4)


def test_generate_matches_transformers_greedy(llm: LLM, tiny_model_dir: Path) -> None:
    """Twenty requests of 1 to 30 tokens with 1 to 12 new tokens each, batched continuously in
    a pool that holds only some of them at once: transformers' greedy tokens, every one."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    generator = torch.Generator().manual_seed(9)
    lengths = torch.randint(1, 31, (20,), generator=generator).tolist()
    new_tokens = torch.randint(1, 13, (20,), generator=generator).tolist()
    prompts = random_prompts(lengths, seed=9)
    outputs = llm.generate(prompts, [greedy(n) for n in new_tokens])

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.inference_mode():
        for prompt, n, out in zip(prompts, new_tokens, outputs):
            config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)
            ids = torch.tensor([prompt])
            expected = hf_model.generate(ids, attention_mask=torch.ones_like(ids),
                                         generation_config=config)[0, len(prompt):].tolist()
            assert out["token_ids"] == expected, f"prompt of {len(prompt)} tokens"
