"""Chapter 10: chunked prefill.

What these tests pin down:

- a workload of 18 mixed requests (short and long prompts, some longer than the budget, some
  sharing a prefix, arriving over time) gets exactly ``transformers``' greedy tokens (CPU,
  float32) with chunking off, with a small budget and with a large one: chunked == unchunked;
- no prefill step computes more tokens than the budget (every ``StepResult`` is checked), and
  the page-and-row bookkeeping holds after every step;
- chunks fill the budget in queue order, and the running requests decode between two chunks;
- a request between two chunks waits at the head of the queue holding its row and its pages,
  which stay put; aborting it there gives everything back at once;
- a seeded, sampled request draws the same tokens chunked or not.

The equivalence test is a grid: prefix cache x budget. Its cache axis is every prefix cache the
scheduler knows (chapter 11's radix cache joins by registering itself); a later chapter adds an
axis (overlap scheduling) with one more ``parametrize`` line and one more option.
"""

from __future__ import annotations

import dataclasses

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from minisgl.kvcache.page_table import pages_for
from minisgl.core import Req, SamplingParams
from minisgl.llm import LLM
from minisgl.scheduler.cache import PREFIX_CACHES
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.prefill import ChunkedPrefillBudget, is_mid_prefill
from minisgl.scheduler.scheduler import Scheduler, StepResult

PAGE_SIZE = 4
NUM_PAGES = 64
MAX_RUNNING = 8
BUDGETS = {"small": 7, "large": 48}  # tokens per step; 7 cuts chunks across page boundaries


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Run this module's forward passes on one CPU thread.

    The tiny model's operations are too small for a second thread to pay off, and on a busy
    machine each one waits for both threads to be scheduled: ten times slower, not faster.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# These tests describe the synchronous loop, which reads a batch's tokens in the step that
# launches it; from chapter 12 on the scheduler overlaps unless told otherwise.
SYNCHRONOUS = ({"overlap": False}
               if "overlap" in {f.name for f in dataclasses.fields(SchedulerConfig)} else {})


def make_scheduler(model_dir: Path, **options: object) -> Scheduler:
    settings: dict[str, object] = {"device": "cpu", "page_size": PAGE_SIZE,
                                   "num_pages": NUM_PAGES, "max_running_reqs": MAX_RUNNING}
    return Scheduler(SchedulerConfig(model_dir, **{**settings, **SYNCHRONOUS, **options}))


def chunked(model_dir: Path, budget: int, **options: object) -> Scheduler:
    return make_scheduler(model_dir, chunked_prefill=True, max_prefill_tokens=budget, **options)


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2048, (n,), generator=generator).tolist() for n in lengths]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def run(scheduler: Scheduler, reqs: list[Req], arrivals: list[int] | None = None,
        on_step: Callable[[StepResult], None] | None = None) -> list[StepResult]:
    """Add ``reqs[i]`` before step ``arrivals[i]`` (all at step 0 by default), step until all
    have finished, and check after every step that no prefill step went over the token budget
    (a decode step computes one token per running request, whatever the budget) and that no
    page or row is lost."""
    arrivals = arrivals or [0] * len(reqs)
    budget = scheduler.config.max_prefill_tokens
    results: list[StepResult] = []
    step = 0
    while step <= max(arrivals, default=0) or scheduler.has_work:
        for req, arrival in zip(reqs, arrivals):
            if arrival == step:
                scheduler.add(req)
        result = scheduler.step()
        scheduler.check_integrity()
        assert len(result.new_lens) == len(result.uids), result
        assert sum(result.new_lens) == result.num_tokens, result
        if scheduler.config.chunked_prefill and result.phase == "prefill":
            assert result.num_tokens <= budget, (
                f"step {result.step} ran {result.num_tokens} tokens, over the budget of {budget}")
        results.append(result)
        if on_step is not None:
            on_step(result)
        step += 1
        assert step < 2000, "the run does not end"
    assert all(req.is_finished for req in reqs)
    if scheduler.config.prefix_cache == "naive":  # a prefix cache may keep pages on purpose
        assert scheduler.cache.pages_in_use == 0, "pages leaked"
    return results


def prefills(results: list[StepResult]) -> list[list[tuple[int, int]]]:
    """Each prefill step as its (uid, tokens computed) pairs."""
    return [list(zip(r.uids, r.new_lens)) for r in results if r.phase == "prefill"]


# --------------------------------------------------------------------------------------------
# The mixed workload, and transformers' greedy tokens for it
# --------------------------------------------------------------------------------------------

SYSTEM_PROMPT = random_prompts([20], seed=99)[0]  # six requests start with it


def mixed_workload() -> tuple[list[list[int]], list[int], list[int]]:
    """18 requests: prompts of 4 to 90 tokens (five longer than the large budget, all but one
    longer than the small one), 1 to 8 new tokens each, arriving over the first 11 steps."""
    generator = torch.Generator().manual_seed(10)
    lengths = torch.randint(1, 40, (12,), generator=generator).tolist() + [55, 61, 90]
    lengths += [49, 3, 70]
    prompts = random_prompts(lengths, seed=10)
    for i in (2, 5, 8, 12, 15, 16):
        prompts[i] = SYSTEM_PROMPT + prompts[i]
    new_tokens = torch.randint(1, 9, (18,), generator=generator).tolist()
    arrivals = sorted(torch.randint(0, 12, (18,), generator=generator).tolist())
    return prompts, new_tokens, arrivals


def run_workload(scheduler: Scheduler) -> tuple[list[Req], list[StepResult]]:
    prompts, new_tokens, arrivals = mixed_workload()
    reqs = [Req(i, p, greedy(n)) for i, (p, n) in enumerate(zip(prompts, new_tokens))]
    return reqs, run(scheduler, reqs, arrivals)


@pytest.fixture(scope="module")
def unchunked_outputs(tiny_model_dir: Path) -> list[list[int]]:
    """The workload's tokens with chapter 9's scheduler: no chunking, one budget."""
    reqs, _ = run_workload(make_scheduler(tiny_model_dir, max_prefill_tokens=BUDGETS["large"]))
    return [req.output_ids for req in reqs]


@pytest.fixture(scope="module")
def transformers_check(tiny_model_dir: Path) -> Callable[[list[int], list[int]], None]:
    """Check that ``output`` is transformers' greedy continuation of ``prompt``.

    Greedy decoding means: every output token is the argmax of the model's logits after the
    prompt and the outputs before it. One causal forward pass of ``prompt + output`` yields all
    those logits at once, so a single pass per request checks the whole answer exactly (much
    faster than ``generate``, one token at a time).
    """
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)

    def check(prompt: list[int], output: list[int]) -> None:
        ids = torch.tensor([prompt + output])
        with torch.inference_mode():
            logits = hf_model(ids).logits[0, len(prompt) - 1:-1]
        expected = logits.argmax(dim=-1).tolist()
        assert output == expected, f"prompt of {len(prompt)} tokens: got {output}, " \
                                   f"transformers' greedy choice {expected}"
    return check


def test_the_unchunked_run_is_transformers_greedy(unchunked_outputs: list[list[int]],
                                                  transformers_check: Callable) -> None:
    prompts, new_tokens, _ = mixed_workload()
    assert [len(out) for out in unchunked_outputs] == new_tokens
    for prompt, output in zip(prompts, unchunked_outputs):
        transformers_check(prompt, output)


@pytest.mark.parametrize("budget", sorted(BUDGETS), ids=str)
@pytest.mark.parametrize("prefix_cache", sorted(PREFIX_CACHES))
def test_chunked_prefill_gives_transformers_greedy_tokens(
        tiny_model_dir: Path, prefix_cache: str, budget: str,
        unchunked_outputs: list[list[int]], transformers_check: Callable) -> None:
    """Every request of the mixed workload: the unchunked run's tokens, which are transformers'
    greedy tokens; no step over the budget (checked by ``run``)."""
    scheduler = chunked(tiny_model_dir, BUDGETS[budget], prefix_cache=prefix_cache)
    reqs, results = run_workload(scheduler)
    chunks = [uid for step in prefills(results) for uid, _ in step]
    assert any(chunks.count(req.uid) > 1 for req in reqs), "no prompt was cut: a weak test"
    for req, expected in zip(reqs, unchunked_outputs):
        assert req.output_ids == expected, f"request {req.uid} ({len(req.prompt_ids)} tokens)"
        transformers_check(req.prompt_ids, req.output_ids)


# --------------------------------------------------------------------------------------------
# The budget and how chunks fill it
# --------------------------------------------------------------------------------------------


def test_config_rejects_a_chunked_prefill_that_is_not_a_bool() -> None:
    with pytest.raises(TypeError, match="chunked_prefill must be True or False, got 'yes'"):
        SchedulerConfig("models/tiny-qwen3", chunked_prefill="yes")


def test_the_chunked_budget_cuts_tokens_but_never_rows_or_pages() -> None:
    budget = ChunkedPrefillBudget(tokens=10, pages=6, rows=2)
    assert budget.admits(new_tokens=30, pages=3, is_first=False), "cut, not refused"
    assert budget.chunk(30) == 10 and budget.chunk(4) == 4
    assert not budget.admits(new_tokens=1, pages=7, is_first=True), "pages never bend"
    budget.take(new_tokens=budget.chunk(30), pages=3)
    assert (budget.tokens, budget.pages, budget.rows) == (0, 3, 1)
    assert not budget.admits(new_tokens=1, pages=1, is_first=False), "no token left"


def test_chunks_fill_the_budget_in_queue_order(tiny_model_dir: Path) -> None:
    """Budget 16: two 6-token prompts, then a 30-token one cut 4 + 16 + 10, then a 6-token one
    that shares the last step with the end of the long prompt."""
    scheduler = chunked(tiny_model_dir, 16)
    reqs = [Req(i, p, greedy(4)) for i, p in enumerate(random_prompts([6, 6, 30, 6]))]
    results = run(scheduler, reqs)
    assert prefills(results) == [[(0, 6), (1, 6), (2, 4)], [(2, 16)], [(2, 10), (3, 6)]]
    assert [r.phase for r in results[:5]] == ["prefill", "decode", "prefill", "decode",
                                              "prefill"], "the running requests decode between"


def test_running_requests_decode_between_chunks(tiny_model_dir: Path, plain: Scheduler) -> None:
    """A 60-token prompt at budget 8 takes 8 chunks; the two requests already running get a
    token between every two of them, instead of waiting for the whole prompt."""
    scheduler = chunked(tiny_model_dir, 8)
    short = [Req(i, p, greedy(12)) for i, p in enumerate(random_prompts([3, 4], seed=1))]
    long = Req(9, random_prompts([60], seed=2)[0], greedy(3))
    results = run(scheduler, [*short, long], arrivals=[0, 0, 1])
    chunk_steps = [i for i, r in enumerate(results) if 9 in r.uids and r.phase == "prefill"]
    assert len(chunk_steps) == 8
    for before, after in itertools.pairwise(chunk_steps):
        between = results[before + 1:after]
        assert [r.phase for r in between] == ["decode"], "one decode step between two chunks"
        assert set(between[0].uids) == {0, 1}, "the long request is not decoding yet"
    for req in short:
        assert req.output_ids == run_alone(plain, req)


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path) -> Scheduler:
    """A scheduler without chunking, for requests that run alone."""
    return make_scheduler(tiny_model_dir)


def run_alone(scheduler: Scheduler, req: Req) -> list[int]:
    """The tokens ``req``'s prompt gets with nothing else around."""
    alone = Req(req.uid, req.prompt_ids, req.params)
    run(scheduler, [alone])
    return alone.output_ids


# --------------------------------------------------------------------------------------------
# A request between two chunks
# --------------------------------------------------------------------------------------------


def test_a_request_mid_prefill_holds_its_row_and_pages(tiny_model_dir: Path,
                                                       plain: Scheduler) -> None:
    scheduler = chunked(tiny_model_dir, 8)
    running = Req(0, random_prompts([5], seed=3)[0], greedy(10))
    long = Req(1, random_prompts([30], seed=4)[0], greedy(5))
    scheduler.add(running)
    scheduler.step()  # running is prefilled and decodes from now on
    scheduler.add(long)

    result = scheduler.step()
    assert (result.uids, result.new_lens) == ((1,), (8,)), "a first chunk of 8 tokens"
    assert is_mid_prefill(long) and long.cached_len == 8 and long.output_ids == []
    assert result.waiting == (1,) and result.running == (0,), "it waits, at the head"
    row = long.table_row
    pages = scheduler.engine.pages.table.row_pages(row).tolist()
    assert len(pages) >= pages_for(8, PAGE_SIZE), "pages for the chunk it computed"

    while long.cached_len < 30:  # decode, chunk, decode, chunk...
        scheduler.step()
        scheduler.check_integrity()
        assert long.table_row == row, "the same row all along"
        assert scheduler.engine.pages.table.row_pages(row).tolist()[:len(pages)] == pages, \
            "its pages stay put: the K/V of the chunks computed so far are in them"
        if long.cached_len < 30:
            assert long.output_ids == [], "a chunk's sample is thrown away"
    assert len(long.output_ids) == 1 and scheduler.num_running == 2
    run(scheduler, [])
    assert long.output_ids == run_alone(plain, long)


def test_a_request_mid_prefill_keeps_its_page_promise(tiny_model_dir: Path) -> None:
    """20 pages of 4 tokens. A 40-token prompt (worst case 11 pages) is cut at budget 8; a
    request whose worst case needs 10 more pages must wait while the cut one is unfinished."""
    scheduler = chunked(tiny_model_dir, 8, num_pages=20)
    long = Req(0, random_prompts([40], seed=5)[0], greedy(4))   # 43 tokens: 11 pages
    other = Req(1, random_prompts([36], seed=6)[0], greedy(4))  # 39 tokens: 10 pages
    scheduler.add(long)
    scheduler.add(other)
    result = scheduler.step()
    assert result.uids == (0,) and result.waiting == (0, 1)
    assert scheduler.prefill_budget().pages == 20 - 11, "its whole worst case stays promised"
    results = run(scheduler, [])
    long_done = next(r.step for r in results if long in r.finished)
    other_start = next(r.step for r in results if 1 in r.uids)
    assert other_start > long_done, "no pages for it until the cut request has finished"


def test_abort_mid_prefill_gives_everything_back(tiny_model_dir: Path, plain: Scheduler) -> None:
    scheduler = chunked(tiny_model_dir, 8)
    running = Req(0, random_prompts([6], seed=7)[0], greedy(8))
    long = Req(1, random_prompts([40], seed=8)[0], greedy(8))
    for req in (running, long):
        scheduler.add(req)
    scheduler.step()  # running whole + 2 tokens of long
    scheduler.step()  # running decodes
    scheduler.step()  # 8 more tokens of long
    assert is_mid_prefill(long) and long.cached_len == 10
    held = scheduler.cache.pages.pages_held(long)
    in_use = scheduler.cache.pages_in_use
    rows = scheduler.engine.pages.num_free_rows

    assert scheduler.abort(1) is long
    assert long.table_row is None and long.finish_reason is None and long.output_ids == []
    assert scheduler.cache.pages_in_use == in_use - held and held > 0
    assert scheduler.engine.pages.num_free_rows == rows + 1
    assert scheduler.num_waiting == 0
    scheduler.check_integrity()
    run(scheduler, [])
    assert scheduler.cache.pages_in_use == 0
    assert scheduler.engine.pages.num_free_rows == MAX_RUNNING
    assert running.output_ids == run_alone(plain, running)


def test_a_seeded_sampled_request_draws_the_same_tokens_chunked(tiny_model_dir: Path,
                                                               plain: Scheduler) -> None:
    """A chunk's sample is thrown away without moving the request's generator on: eight
    chunks, then the same eight sampled tokens as in one piece."""
    params = SamplingParams(temperature=1.0, top_k=50, max_tokens=8, ignore_eos=True, seed=11)
    req = Req(0, random_prompts([37], seed=9)[0], params)
    run(chunked(tiny_model_dir, 5), [req])
    assert req.output_ids == run_alone(plain, req)


def test_llm_takes_chunked_prefill_as_an_engine_option(tiny_model_dir: Path,
                                                       plain: Scheduler) -> None:
    llm = LLM(tiny_model_dir, device="cpu", page_size=PAGE_SIZE, num_pages=NUM_PAGES,
              chunked_prefill=True, max_prefill_tokens=6)
    prompts = random_prompts([3, 25, 9], seed=12)
    out = llm.generate(prompts, greedy(4))
    for prompt, completion in zip(prompts, out):
        assert completion["token_ids"] == run_alone(plain, Req(0, prompt, greedy(4)))
