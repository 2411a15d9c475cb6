"""Tests for the chunk-plan exercise: they are its specification.

Small cases worked by hand first, then random queues checked against the rules (the budget, the
order, every token computed once), then chapter 10's real scheduler (tiny model, CPU): the
prefill steps it runs must be your plan, chunk for chunk.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from chunk_plan import Chunk, plan_chunks

from minisgl.core import Req, SamplingParams


def as_tuples(plan: list[list[Chunk]]) -> list[list[tuple[int, int, int]]]:
    return [[tuple(chunk) for chunk in step] for step in plan]


# ---------------------------------------------------------------------------------------------
# small cases


def test_the_readme_example() -> None:
    assert as_tuples(plan_chunks([5, 12, 2, 6], budget=8)) == [
        [(0, 0, 5), (1, 0, 3)],
        [(1, 3, 11)],
        [(1, 11, 12), (2, 0, 2), (3, 0, 5)],
        [(3, 5, 6)],
    ]


def test_an_empty_queue_needs_no_step() -> None:
    assert plan_chunks([], budget=8) == []


def test_prompts_that_fit_together_share_one_step() -> None:
    assert as_tuples(plan_chunks([3, 4, 1], budget=8)) == [[(0, 0, 3), (1, 0, 4), (2, 0, 1)]]


def test_a_prompt_of_exactly_the_budget_fills_one_step() -> None:
    assert as_tuples(plan_chunks([8, 2], budget=8)) == [[(0, 0, 8)], [(1, 0, 2)]], (
        "a full step ends there; the next prompt starts the next step")


def test_a_long_prompt_is_cut_into_budget_sized_chunks() -> None:
    assert as_tuples(plan_chunks([20], budget=8)) == [[(0, 0, 8)], [(0, 8, 16)], [(0, 16, 20)]]


def test_short_prompts_are_cut_too_when_the_step_is_nearly_full() -> None:
    assert as_tuples(plan_chunks([6, 6, 6], budget=8)) == [
        [(0, 0, 6), (1, 0, 2)], [(1, 2, 6), (2, 0, 4)], [(2, 4, 6)]], (
        "a step takes the head of the next prompt rather than leave its budget unused")


def test_a_budget_of_one_computes_one_token_per_step() -> None:
    assert as_tuples(plan_chunks([2, 1], budget=1)) == [[(0, 0, 1)], [(0, 1, 2)], [(1, 0, 1)]]


def test_chunks_are_chunk_tuples_with_a_length() -> None:
    (step,) = plan_chunks([3], budget=5)
    assert isinstance(step[0], Chunk) and step[0].length == 3


@pytest.mark.parametrize(("prompt_lens", "budget", "match"), [
    ([4, 5], 0, "budget"),
    ([4, 5], -3, "budget"),
    ([4, 0, 5], 8, "prompt 1"),
])
def test_bad_inputs_are_rejected(prompt_lens: list[int], budget: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_chunks(prompt_lens, budget)


# ---------------------------------------------------------------------------------------------
# random queues against the rules


def check_rules(prompt_lens: list[int], budget: int, plan: list[list[Chunk]]) -> None:
    where = f"prompts {prompt_lens}, budget {budget}"
    flat = [chunk for step in plan for chunk in step]
    assert all(step for step in plan), f"{where}: an empty step"
    for n, step in enumerate(plan):
        used = sum(chunk.length for chunk in step)
        assert used <= budget, f"{where}: step {n} computes {used} tokens"
        if n < len(plan) - 1:
            assert used == budget, f"{where}: step {n} leaves budget unused with work waiting"
    assert all(chunk.length >= 1 for chunk in flat), f"{where}: an empty chunk"
    # In order: the chunks, read one after the other, walk through prompt 0, then 1, ...
    expected_index, expected_start = 0, 0
    for chunk in flat:
        if expected_start == prompt_lens[expected_index]:
            expected_index, expected_start = expected_index + 1, 0
        assert (chunk.index, chunk.start) == (expected_index, expected_start), (
            f"{where}: got {chunk}, expected a chunk of prompt {expected_index} starting at "
            f"token {expected_start} (first come, first served; each token once)")
        assert chunk.end <= prompt_lens[chunk.index], f"{where}: {chunk} runs past its prompt"
        expected_start = chunk.end
    if prompt_lens:
        assert (expected_index, expected_start) == (len(prompt_lens) - 1, prompt_lens[-1]), (
            f"{where}: not every token is computed")
    total = sum(prompt_lens)
    assert len(plan) == -(-total // budget), f"{where}: {total} tokens need exactly " \
                                             f"{-(-total // budget)} full steps"


def test_random_queues_obey_every_rule() -> None:
    rng = random.Random(0)
    for _ in range(300):
        prompt_lens = [rng.randint(1, 40) for _ in range(rng.randint(0, 8))]
        budget = rng.choice([1, 2, 3, 7, 8, 16, 50])
        check_rules(prompt_lens, budget, plan_chunks(prompt_lens, budget))


# ---------------------------------------------------------------------------------------------
# against chapter 10's scheduler


def scheduler_chunks(model_dir: Path, prompt_lens: list[int], budget: int,
                     max_tokens: int) -> list[list[tuple[int, int, int]]]:
    """The prefill steps chapter 10's scheduler runs for these prompts, all queued at once,
    as (index, start, end) chunks. Rows and pages are plentiful, so only the budget matters."""
    pytest.importorskip("torch", reason="runs chapter 10's scheduler, which needs PyTorch "
                                        "(not in the browser): the local judge runs this test")
    from minisgl.scheduler.config import SchedulerConfig
    from minisgl.scheduler.scheduler import Scheduler

    scheduler = Scheduler(SchedulerConfig(model_dir, device="cpu", page_size=4, num_pages=256,
                                          max_running_reqs=len(prompt_lens),
                                          max_prefill_tokens=budget, chunked_prefill=True))
    rng = random.Random(sum(prompt_lens))
    for uid, n in enumerate(prompt_lens):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        scheduler.add(Req(uid, [rng.randrange(2048) for _ in range(n)], params))
    done = [0] * len(prompt_lens)
    steps = []
    while scheduler.has_work:
        result = scheduler.step()
        if result.phase == "prefill":
            step = []
            for uid, n in zip(result.uids, result.new_lens):
                step.append((uid, done[uid], done[uid] + n))
                done[uid] += n
            steps.append(step)
        assert result.step < 500
    return steps


@pytest.mark.parametrize(("prompt_lens", "budget", "max_tokens"), [
    ([5, 12, 2, 6], 8, 1),           # the README's example; each request ends on its first token
    ([3, 40, 9, 1, 17, 6], 7, 3),    # running requests decode between the chunks
    ([30, 2, 2, 25], 16, 2),
])
def test_your_plan_is_the_schedulers(tiny_model_dir: Path, prompt_lens: list[int], budget: int,
                                     max_tokens: int) -> None:
    expected = scheduler_chunks(tiny_model_dir, prompt_lens, budget, max_tokens)
    assert as_tuples(plan_chunks(prompt_lens, budget)) == expected, (
        f"prompts {prompt_lens}, budget {budget}: the scheduler's prefill steps were {expected}")
