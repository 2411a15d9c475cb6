"""Tests for the admission exercise: they are its specification.

Small cases worked by hand first: chapter 9's rule (no overtaking at all), then overtaking and
its bound, then random queues checked against the rules, then many batches in a row, where no
request may be overtaken more often than allowed; last, chapter 9's real scheduler (tiny model,
CPU): with no overtaking allowed, your choice must be the batch it forms at every step.
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
# choose_admissions, rule by rule


def choose(waiting: list[Req], free_pages: int = 100, free_rows: int = 100,
           token_budget: int = 1000, page_size: int = 4, overtaken: dict[int, int] | None = None,
           max_overtakes: int = 0) -> list[int]:
    """Chapter 9's rule by default: nobody may overtake anybody."""
    return choose_admissions(waiting, free_pages=free_pages, free_rows=free_rows,
                             token_budget=token_budget, page_size=page_size,
                             overtaken={} if overtaken is None else overtaken,
                             max_overtakes=max_overtakes)


README_QUEUE = [(0, 8, 9), (1, 6, 3), (2, 10, 2), (3, 2, 2)]


def readme(max_overtakes: int, overtaken: dict[int, int]) -> list[int]:
    return choose([req(*r) for r in README_QUEUE], free_pages=10, free_rows=3, token_budget=20,
                  overtaken=overtaken, max_overtakes=max_overtakes)


def test_the_readme_example_without_overtaking() -> None:
    overtaken: dict[int, int] = {}
    assert readme(0, overtaken) == [0, 1], "max_overtakes 0: first come, first served"
    assert overtaken == {}, "nobody went ahead of request 2, so it was not overtaken"


def test_the_readme_example_with_overtaking() -> None:
    overtaken: dict[int, int] = {}
    assert readme(2, overtaken) == [0, 1, 3], "request 3 fits where request 2 does not"
    assert overtaken == {2: 1}, "request 3 went ahead of request 2: once"


def test_the_readme_example_when_request_2_has_waited_enough() -> None:
    overtaken = {2: 2}
    assert readme(2, overtaken) == [0, 1], (
        "request 2 was overtaken twice already: nobody behind it goes first any more")
    assert overtaken == {2: 2}


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
# overtaking, and its bound


def test_a_request_that_does_not_fit_is_passed_over_while_it_may_be() -> None:
    overtaken: dict[int, int] = {}
    got = choose([req(0, 4, 5), req(1, 20, 5), req(2, 1, 1)], free_pages=5, overtaken=overtaken,
                 max_overtakes=1)
    assert got == [0, 2], "request 2 fits in the pages request 1 cannot use"
    assert overtaken == {1: 1}


def test_a_request_overtaken_enough_holds_the_queue() -> None:
    overtaken = {1: 1}
    got = choose([req(0, 4, 5), req(1, 20, 5), req(2, 1, 1)], free_pages=5, overtaken=overtaken,
                 max_overtakes=1)
    assert got == [0], "request 1 has been overtaken max_overtakes times: stop there"
    assert overtaken == {1: 1}


def test_one_batch_overtakes_a_request_once() -> None:
    overtaken: dict[int, int] = {}
    got = choose([req(0, 40, 2), req(1, 1, 2), req(2, 1, 2), req(3, 1, 2)], free_pages=5,
                 overtaken=overtaken, max_overtakes=5)
    assert got == [1, 2, 3]
    assert overtaken == {0: 1}, "three requests went ahead of request 0 in one batch: one more"


def test_only_requests_someone_went_ahead_of_count() -> None:
    overtaken: dict[int, int] = {}
    got = choose([req(0, 2, 2), req(1, 40, 10), req(2, 2, 2), req(3, 40, 10)], free_pages=12,
                 overtaken=overtaken, max_overtakes=3)
    assert got == [0, 2]
    assert overtaken == {1: 1}, "nobody behind request 3 was admitted: it was not overtaken"


def test_the_first_admission_may_exceed_the_token_budget_after_a_passed_request() -> None:
    got = choose([req(0, 8, 100), req(1, 30, 2), req(2, 4, 2)], free_pages=20, token_budget=16,
                 max_overtakes=1)
    assert got == [1], "request 1 is the batch's first admission: its length does not matter"


def test_an_admitted_request_leaves_the_count() -> None:
    overtaken = {0: 2, 7: 1}
    assert choose([req(0, 2, 2), req(1, 2, 2)], overtaken=overtaken, max_overtakes=3) == [0, 1]
    assert overtaken == {7: 1}, "request 0 is admitted: its count goes; others are kept"


def test_nothing_fits_nobody_is_overtaken() -> None:
    overtaken = {0: 1}
    assert choose([req(0, 40, 2), req(1, 40, 2)], free_pages=5, overtaken=overtaken,
                  max_overtakes=4) == []
    assert overtaken == {0: 1}


# ---------------------------------------------------------------------------------------------
# random queues against the rules


def test_random_queues_obey_every_rule() -> None:
    rng = random.Random(0)
    for trial in range(400):
        page_size = rng.choice([1, 4, 16])
        waiting = [req(i, rng.randint(1, 40), rng.randint(1, 30))
                   for i in range(rng.randint(0, 8))]
        free_pages, free_rows = rng.randint(0, 20), rng.randint(0, 6)
        budget, limit = rng.randint(1, 64), rng.randint(0, 3)
        before = {r.uid: rng.randint(0, limit) for r in waiting if rng.random() < 0.5}
        overtaken = dict(before)
        got = choose(waiting, free_pages, free_rows, budget, page_size, overtaken, limit)
        where = f"trial {trial}: got {got}"
        uids = [r.uid for r in waiting]
        assert got == [u for u in uids if u in got], f"{where}: not in queue order"
        # Replay the walk: every request either fits what is left and is admitted, or does
        # not fit and is passed over, or has been overtaken enough and ends the walk.
        rows, pages, tokens = free_rows, free_pages, budget
        admitted: list[int] = []
        passed: list[int] = []
        stopped_at = None
        for r in waiting:
            need = worst_case_pages(len(r.prompt_ids), r.params.max_tokens, page_size)
            fits = rows >= 1 and need <= pages and (not admitted or len(r.prompt_ids) <= tokens)
            if r.uid in got:
                assert fits, f"{where}: request {r.uid} was admitted but does not fit"
                admitted.append(r.uid)
                rows, pages, tokens = rows - 1, pages - need, tokens - len(r.prompt_ids)
            elif fits:
                raise AssertionError(f"{where}: request {r.uid} fits but was left waiting")
            elif before.get(r.uid, 0) >= limit:
                stopped_at = r.uid
                break
            else:
                passed.append(r.uid)
        assert admitted == got, f"{where}: a request behind request {stopped_at} was admitted"
        last = uids.index(got[-1]) if got else -1
        expected = {u: n for u, n in before.items() if u not in got}
        for u in passed:
            if uids.index(u) < last:
                expected[u] = expected.get(u, 0) + 1
        assert overtaken == expected, f"{where}: overtaken is {overtaken}, expected {expected}"


def test_no_request_is_overtaken_more_than_allowed() -> None:
    """Batch after batch on a small pool, requests finishing and new ones arriving: whatever the
    queue, no request is ever passed by more than max_overtakes batches."""
    for limit in (0, 1, 3):
        rng = random.Random(limit)
        running: list[tuple[int, int]] = []  # (pages it holds, steps left)
        waiting: list[Req] = []
        overtaken: dict[int, int] = {}
        passed_by: dict[int, int] = {}
        uid = 0
        for step in range(300):
            for _ in range(rng.choice([0, 1, 1, 2])):
                big = rng.random() < 0.2
                waiting.append(req(uid, rng.randint(20, 40) if big else rng.randint(1, 6),
                                   rng.randint(1, 8)))
                uid += 1
            free = 24 - sum(p for p, _ in running)
            got = choose(waiting, free_pages=free, free_rows=6 - len(running), token_budget=32,
                         overtaken=overtaken, max_overtakes=limit)
            position = {r.uid: i for i, r in enumerate(waiting)}
            if got:
                for r in waiting[:position[got[-1]]]:
                    if r.uid not in got:
                        passed_by[r.uid] = passed_by.get(r.uid, 0) + 1
                        assert passed_by[r.uid] <= limit, (
                            f"limit {limit}, step {step}: request {r.uid} was overtaken by "
                            f"{passed_by[r.uid]} batches")
            for r in waiting:
                if r.uid in got:
                    running.append((worst_case_pages(len(r.prompt_ids), r.params.max_tokens,
                                                     4), r.params.max_tokens))
            waiting = [r for r in waiting if r.uid not in got]
            running = [(p, left - 1) for p, left in running if left > 1]
        assert max(passed_by.values(), default=0) == limit, (
            f"limit {limit}: the run should reach the bound: {passed_by}")


# ---------------------------------------------------------------------------------------------
# against chapter 9's scheduler


def test_your_choices_are_the_schedulers(tiny_model_dir: Path) -> None:
    """A small pool (16 pages of 4 tokens), a budget of 24 prompt tokens, at most 4 requests at
    once, requests arriving over ten steps: before every step your function is given the
    scheduler's queue and budget, with no overtaking allowed (chapter 9's rule), and must pick
    the batch the scheduler then runs (or nothing, when the scheduler runs a decode step
    instead)."""
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
                                     page_size=4, overtaken={}, max_overtakes=0)
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
