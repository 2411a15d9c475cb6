"""Tests for the admission exercise: they are its specification.

Small cases worked by hand first, then random queues checked against the rules, then chapter 9's
real scheduler (tiny model, CPU): at every step, your choice must be the batch it forms.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from admission import choose_admissions, worst_case_pages

from minisgl.core import Req, SamplingParams


def req(uid: int, prompt_len: int, max_tokens: int) -> Req:
    return Req(uid, [1] * prompt_len, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


# ---------------------------------------------------------------------------------------------
# worst_case_pages


@pytest.mark.parametrize(("prompt_len", "max_tokens", "page_size", "pages"), [
    (5, 4, 4, 2),    # 5 + 3 = 8 tokens: exactly two pages
    (5, 5, 4, 3),    # 9 tokens: a third, partly filled page
    (1, 1, 1, 1),    # a one-token prompt, one output: only the prompt is stored
    (16, 1, 16, 1),
    (16, 2, 16, 2),
    (7, 10, 1, 16),
])
def test_worst_case_pages(prompt_len: int, max_tokens: int, page_size: int, pages: int) -> None:
    assert worst_case_pages(prompt_len, max_tokens, page_size) == pages, (
        f"prompt {prompt_len}, max_tokens {max_tokens}, page_size {page_size}: the prompt and "
        "every output but the last are stored, in whole pages")


# ---------------------------------------------------------------------------------------------
# choose_admissions, rule by rule


def choose(waiting: list[Req], free_pages: int = 100, free_rows: int = 100,
           token_budget: int = 1000, page_size: int = 4) -> list[int]:
    return choose_admissions(waiting, free_pages=free_pages, free_rows=free_rows,
                             token_budget=token_budget, page_size=page_size)


def test_the_readme_example() -> None:
    waiting = [req(0, 8, 9), req(1, 6, 3), req(2, 10, 2), req(3, 2, 2)]
    assert choose(waiting, free_pages=10, free_rows=3, token_budget=20) == [0, 1]


def test_an_empty_queue_admits_nothing() -> None:
    assert choose([]) == []


def test_everyone_fits_when_there_is_room() -> None:
    assert choose([req(5, 3, 3), req(2, 4, 4), req(9, 1, 1)]) == [5, 2, 9], (
        "uids in queue order")


def test_no_more_requests_than_free_rows() -> None:
    assert choose([req(i, 2, 2) for i in range(5)], free_rows=3) == [0, 1, 2]
    assert choose([req(0, 2, 2)], free_rows=0) == [], "no row, no admission"


def test_pages_add_up_across_the_batch() -> None:
    # each needs 3 pages (4 + 8 = 12 tokens); 8 free pages take two of them
    assert choose([req(i, 4, 9) for i in range(4)], free_pages=8) == [0, 1]


def test_pages_count_the_worst_case_not_just_the_prompt() -> None:
    # a 4-token prompt fits in one page, but with 20 outputs it may need 6
    assert choose([req(0, 4, 21)], free_pages=5) == [], (
        "admitted on its prompt alone, it would run out of pages while decoding")


def test_a_request_too_big_for_the_pool_is_not_admitted_even_first() -> None:
    assert choose([req(0, 40, 2)], free_pages=5, token_budget=1000) == []


def test_the_token_budget_limits_the_batch() -> None:
    assert choose([req(i, 6, 2) for i in range(4)], token_budget=13) == [0, 1]


def test_the_first_request_may_exceed_the_token_budget_alone() -> None:
    assert choose([req(0, 30, 2), req(1, 1, 2)], token_budget=16) == [0], (
        "a prompt longer than the budget runs in a batch of its own")


def test_a_long_prompt_behind_others_waits_for_the_next_batch() -> None:
    assert choose([req(0, 4, 2), req(1, 30, 2)], token_budget=16) == [0]


def test_first_come_first_served_no_skipping() -> None:
    # request 1 does not fit the pages left; request 2 would, but it must not overtake
    assert choose([req(0, 4, 5), req(1, 20, 5), req(2, 1, 1)], free_pages=5) == [0], (
        "stop at the first request that does not fit")


# ---------------------------------------------------------------------------------------------
# random queues against the rules


def test_random_queues_obey_every_rule() -> None:
    rng = random.Random(0)
    for trial in range(300):
        page_size = rng.choice([1, 4, 16])
        waiting = [req(i, rng.randint(1, 40), rng.randint(1, 30))
                   for i in range(rng.randint(0, 8))]
        free_pages, free_rows = rng.randint(0, 20), rng.randint(0, 6)
        budget = rng.randint(1, 64)
        got = choose(waiting, free_pages, free_rows, budget, page_size)
        where = f"trial {trial}: got {got}"
        assert got == [r.uid for r in waiting[:len(got)]], f"{where}: not a prefix of the queue"
        taken = waiting[:len(got)]
        pages = [worst_case_pages(len(r.prompt_ids), r.params.max_tokens, page_size)
                 for r in waiting]
        assert len(got) <= free_rows, f"{where}: more requests than rows"
        assert sum(pages[:len(got)]) <= free_pages, f"{where}: more pages than free"
        tokens = sum(len(r.prompt_ids) for r in taken)
        assert tokens <= budget or len(got) == 1, f"{where}: over the token budget"
        if len(got) < len(waiting):  # the next one really did not fit
            nxt = waiting[len(got)]
            fits = (len(got) + 1 <= free_rows
                    and sum(pages[:len(got) + 1]) <= free_pages
                    and (not got or tokens + len(nxt.prompt_ids) <= budget))
            assert not fits, f"{where}: request {nxt.uid} fits but was left waiting"


# ---------------------------------------------------------------------------------------------
# against chapter 9's scheduler


def test_your_choices_are_the_schedulers(tiny_model_dir: Path) -> None:
    """A small pool (16 pages of 4 tokens), a budget of 24 prompt tokens, at most 4 requests at
    once, requests arriving over ten steps: before every step your function is given the
    scheduler's queue and budget, and must pick the batch the scheduler then runs (or nothing,
    when the scheduler runs a decode step instead)."""
    pytest.importorskip("torch", reason="runs chapter 9's scheduler, which needs PyTorch "
                                        "(not in the browser): the local judge runs this test")
    from minisgl.scheduler.config import SchedulerConfig
    from minisgl.scheduler.scheduler import Scheduler

    scheduler = Scheduler(SchedulerConfig(tiny_model_dir, device="cpu", page_size=4,
                                          num_pages=16, max_running_reqs=4,
                                          max_prefill_tokens=24))
    rng = random.Random(1)
    arrivals = {step: [] for step in range(10)}
    for uid in range(12):
        prompt = [rng.randrange(2048) for _ in range(rng.randint(2, 20))]
        params = SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True)
        arrivals[rng.randrange(10)].append(Req(uid, prompt, params))

    step, prefills = 0, 0
    while step < 10 or scheduler.has_work:
        for new in arrivals.get(step, []):
            scheduler.add(new)
        budget = scheduler.prefill_budget()
        expected = choose_admissions(list(scheduler.prefill.waiting), free_pages=budget.pages,
                                     free_rows=budget.rows, token_budget=budget.tokens,
                                     page_size=4)
        result = scheduler.step()
        if result.phase == "prefill":
            prefills += 1
            assert expected == list(result.uids), (
                f"step {step}: the scheduler admitted {list(result.uids)}, you chose {expected}")
        else:
            assert expected == [], (
                f"step {step}: the scheduler could admit nobody, you chose {expected}")
        step += 1
        assert step < 500
    assert prefills >= 4
