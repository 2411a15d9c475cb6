"""Chapter 12: overlap scheduling changes when the host reads tokens, never which tokens.

Every end-to-end test runs the same workload with overlap on and off and compares the outputs
token for token, checking the scheduler's bookkeeping after every step. On a CPU nothing runs
asynchronously, but the overlapped code path (input ids gathered from the token pool, tokens in
flight, results processed one step late, zombies) runs all the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from minisgl.core import Batch, Req, SamplingParams
from minisgl.llm import LLM
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.overlap import InFlight
from minisgl.scheduler.scheduler import Scheduler, StepResult

from conftest import decode_without_waiting

PAGE_SIZE = 4
BUDGETS = {"small": 7, "large": 48}  # prompt tokens per prefill step
NUM_REQS = 18


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """One CPU thread: the tiny model's operations are too small for a second one to pay off."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_scheduler(model_dir: Path, overlap: bool | None, **options: object) -> Scheduler:
    settings: dict[str, object] = {"device": "cpu", "page_size": PAGE_SIZE, "num_pages": 64,
                                   "max_running_reqs": 8}
    return Scheduler(SchedulerConfig(model_dir, overlap=overlap,
                                            **{**settings, **options}))


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2048, (n,), generator=generator).tolist() for n in lengths]


def workload() -> tuple[list[Req], list[int]]:
    """18 requests arriving over 14 steps: greedy and seeded sampling, half sharing a prompt
    head (for the radix cache), lengths of 1 to 9 new tokens, some with stop tokens."""
    generator = torch.Generator().manual_seed(5)
    lengths = torch.randint(2, 30, (NUM_REQS,), generator=generator).tolist()
    prompts = random_prompts(lengths, seed=5)
    shared = random_prompts([13], seed=6)[0]
    for i in range(0, NUM_REQS, 2):
        prompts[i] = shared + prompts[i]
    new_tokens = torch.randint(1, 10, (NUM_REQS,), generator=generator).tolist()
    arrivals = sorted(torch.randint(0, 15, (NUM_REQS,), generator=generator).tolist())
    reqs = []
    for i, (prompt, n) in enumerate(zip(prompts, new_tokens)):
        if i % 3 == 0:
            params = SamplingParams(max_tokens=n, temperature=0.8, top_k=50, seed=100 + i,
                                    ignore_eos=True)
        else:
            params = SamplingParams(max_tokens=n, ignore_eos=True)
        reqs.append(Req(i, prompt, params))
    return reqs, arrivals


def run(scheduler: Scheduler, reqs: list[Req], arrivals: list[int]) -> list[StepResult]:
    """Add ``reqs[i]`` before step ``arrivals[i]``; step until all finish, checking the
    bookkeeping after every step and that every page is back at the end."""
    results: list[StepResult] = []
    step = 0
    while step <= max(arrivals) or scheduler.has_work:
        for req, arrival in zip(reqs, arrivals):
            if arrival == step:
                scheduler.add(req)
        results.append(scheduler.step())
        scheduler.check_integrity()
        step += 1
        assert step < 2000, "the run does not end"
    assert all(req.is_finished for req in reqs), "a request did not finish"
    assert not any(req.in_flight for req in reqs), "a token was left in flight"
    cache = scheduler.cache
    prefix = cache.prefix_cache
    assert cache.pages.num_free + prefix.num_evictable_pages == cache.num_pages, \
        "a page leaked"
    assert prefix.num_locked_pages == 0, "a finished request left its prefix locked"
    assert cache.num_admitted == 0 and scheduler.engine.pages.num_free_rows == \
        scheduler.config.max_running_reqs, "a row leaked"
    return results


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> list[tuple[list[int], str | None]]:
    """The workload's outputs without overlap, naive cache, no chunking."""
    reqs, arrivals = workload()
    run(make_scheduler(tiny_model_dir, overlap=False), reqs, arrivals)
    return [(req.output_ids, req.finish_reason) for req in reqs]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("chunked", [False, True], ids=["unchunked", "chunked"])
@pytest.mark.parametrize("budget", sorted(BUDGETS), ids=str)
@pytest.mark.parametrize("cache", ["naive", "radix"])
def test_overlap_changes_no_token(tiny_model_dir: Path, cache: str, budget: str, chunked: bool,
                                  overlap: bool,
                                  reference: list[tuple[list[int], str | None]]) -> None:
    scheduler = make_scheduler(tiny_model_dir, overlap=overlap, prefix_cache=cache,
                               chunked_prefill=chunked, max_prefill_tokens=BUDGETS[budget])
    reqs, arrivals = workload()
    run(scheduler, reqs, arrivals)
    for req, (tokens, reason) in zip(reqs, reference):
        assert req.output_ids == tokens, f"request {req.uid}: other tokens"
        assert req.finish_reason == reason, f"request {req.uid}: other finish reason"


def stop_workload(reference: list[list[int]]) -> list[Req]:
    """Requests that stop on a token they sample mid-answer (so they are already in the next
    batch when the host learns it), on EOS, and on ``max_tokens``."""
    reqs = []
    prompts = random_prompts([9, 14, 5, 20, 11, 7], seed=21)
    for i, prompt in enumerate(prompts):
        stop_at = reference[i][2 + i % 3]
        if i % 3 == 0:
            params = SamplingParams(max_tokens=12, stop_token_ids=(stop_at,))
        elif i % 3 == 1:
            params = SamplingParams(max_tokens=12)  # EOS, patched below
        else:
            params = SamplingParams(max_tokens=3 + i, ignore_eos=True)
        reqs.append(Req(i, prompt, params))
    return reqs


@pytest.mark.parametrize("cache", ["naive", "radix"])
def test_requests_finishing_while_in_the_next_batch(tiny_model_dir: Path, cache: str) -> None:
    """A stop token or EOS sampled in step N is read only after step N+1 ran the request once
    more: that token is dropped, and its pages come back once step N+1 is processed."""
    prompts = random_prompts([9, 14, 5, 20, 11, 7], seed=21)
    probe = make_scheduler(tiny_model_dir, overlap=False)
    free_run = [Req(i, p, SamplingParams(max_tokens=12, ignore_eos=True))
                for i, p in enumerate(prompts)]
    run(probe, free_run, [0] * len(free_run))
    free_tokens = [req.output_ids for req in free_run]

    outputs = {}
    for overlap in (False, True):
        scheduler = make_scheduler(tiny_model_dir, overlap=overlap, prefix_cache=cache)
        reqs = stop_workload(free_tokens)
        # The EOS case: declare a token the request samples mid-answer to be the model's EOS.
        eos = free_tokens[1][4]
        scheduler.eos_token_ids = (eos,)
        run(scheduler, reqs, [0, 0, 1, 1, 2, 2])
        outputs[overlap] = [(req.output_ids, req.finish_reason) for req in reqs]
    assert outputs[True] == outputs[False]
    stopped = [reason for _, reason in outputs[True]]
    assert "stop" in stopped and "length" in stopped, "the workload must stop both ways"
    # Each stopping request ends exactly at its first stop token.
    for (tokens, reason), req in zip(outputs[True], stop_workload(free_tokens)):
        if reason == "stop":
            assert tokens[:-1] == free_tokens[req.uid][:len(tokens) - 1]


def test_a_stopped_request_was_run_once_more_and_its_token_dropped(tiny_model_dir: Path) -> None:
    """Watch the zombie: it is in the batch launched after the step it stopped in, holds its
    pages until that batch is processed, and its output ends at the stop token."""
    prompt = random_prompts([10], seed=3)[0]
    probe = make_scheduler(tiny_model_dir, overlap=False)
    free = Req(0, prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    run(probe, [free], [0])
    stop = free.output_ids[2]
    first = free.output_ids.index(stop)
    scheduler = make_scheduler(tiny_model_dir, overlap=True)
    req = Req(0, prompt, SamplingParams(max_tokens=8, stop_token_ids=(stop,)))
    results = run(scheduler, [req], [0])
    assert req.output_ids == free.output_ids[:first + 1]
    assert req.finish_reason == "stop"
    # Prefill + first+1 decode steps sample the tokens; one more ran for nothing.
    launched = [r for r in results if r.phase is not None]
    assert len(launched) == first + 2, [r.phase for r in results]
    # The host learns of the stop in the step that launched the extra run: the request is in
    # that step's batch and in its finished list at once; the last step only drains it.
    reporting = [r for r in results if r.finished]
    assert len(reporting) == 1 and reporting[0].finished == (req,)
    assert reporting[0].uids == (0,) and reporting[0].phase == "decode"
    assert results[-1].phase is None and results[-1].finished == ()


def test_the_switch(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``overlap`` is a config field: None means on unless MINISGL_DISABLE_OVERLAP is set, and
    the config holds the resolved value; anything but a bool or None is refused."""
    monkeypatch.setenv("MINISGL_DISABLE_OVERLAP", "1")
    assert SchedulerConfig(tiny_model_dir).overlap is False
    assert make_scheduler(tiny_model_dir, overlap=None).overlap is False
    assert make_scheduler(tiny_model_dir, overlap=True).overlap is True
    monkeypatch.delenv("MINISGL_DISABLE_OVERLAP")
    assert SchedulerConfig(tiny_model_dir).overlap is True
    assert make_scheduler(tiny_model_dir, overlap=None).overlap is True
    assert make_scheduler(tiny_model_dir, overlap=False).overlap is False
    with pytest.raises(TypeError, match="overlap"):
        SchedulerConfig(tiny_model_dir, overlap="yes")  # type: ignore[arg-type]


def test_llm_runs_overlapped_and_the_switch_changes_no_token(tiny_model_dir: Path) -> None:
    """``LLM`` runs on the overlap scheduler; ``overlap=False`` is the ablation, and an idle
    scheduler's ``overlap`` may be switched between two runs on one engine."""
    prompts = random_prompts([9, 14, 5, 20], seed=11)
    params = [SamplingParams(max_tokens=6 + i, ignore_eos=True) for i in range(4)]
    settings = {"device": "cpu", "page_size": PAGE_SIZE, "num_pages": 64, "max_running_reqs": 8}
    llm = LLM(tiny_model_dir, overlap=True, **settings)
    assert isinstance(llm.scheduler, Scheduler) and llm.scheduler.overlap
    overlapped = [out["token_ids"] for out in llm.generate(prompts, params)]
    assert not llm.scheduler.has_work
    llm.scheduler.overlap = False
    assert [out["token_ids"] for out in llm.generate(prompts, params)] == overlapped
    sync = LLM(tiny_model_dir, overlap=False, **settings)
    assert sync.scheduler.overlap is False
    assert [out["token_ids"] for out in sync.generate(prompts, params)] == overlapped
    assert [len(tokens) for tokens in overlapped] == [6, 7, 8, 9]


@pytest.mark.gpu
def test_an_overlapped_decode_step_never_waits_for_the_device(tiny_model_dir: Path) -> None:
    """On CUDA the host plans and launches batch N+1 without a single synchronising call
    (PyTorch's sync debug mode turns one into an error): it blocks only on the event recorded
    after batch N's tokens were copied. The tokens are those of the synchronous loop."""
    def run_all(overlap: bool, check_steps: int) -> list[list[int]]:
        config = SchedulerConfig(tiny_model_dir, device="cuda", overlap=overlap, num_pages=512,
                                 max_running_reqs=8)
        scheduler = Scheduler(config)
        reqs = [Req(i, prompt, SamplingParams(max_tokens=20, ignore_eos=True,
                                              **({"temperature": 0.8, "top_k": 20, "seed": i}
                                                 if i % 2 else {})))
                for i, prompt in enumerate(random_prompts([9, 14, 5, 20, 11, 7], seed=4))]
        for req in reqs:
            scheduler.add(req)
        decode_without_waiting(scheduler, check_steps)
        while scheduler.has_work:
            scheduler.step()
        return [req.output_ids for req in reqs]

    assert run_all(overlap=True, check_steps=8) == run_all(overlap=False, check_steps=0)


def test_abort_while_in_flight(tiny_model_dir: Path) -> None:
    """A request aborted while its sample is in flight loses that sample and every page."""
    scheduler = make_scheduler(tiny_model_dir, overlap=True)
    reqs = [Req(i, p, SamplingParams(max_tokens=10, ignore_eos=True))
            for i, p in enumerate(random_prompts([6, 8, 5], seed=9))]
    for req in reqs:
        scheduler.add(req)
    scheduler.step()  # prefill launched
    scheduler.step()  # decode launched, prefill processed
    dropped = scheduler.abort(1)
    assert dropped is reqs[1] and dropped.in_flight == 0
    scheduler.check_integrity()
    kept = len(dropped.output_ids)
    while scheduler.has_work:
        scheduler.step()
        scheduler.check_integrity()
    assert len(dropped.output_ids) == kept and not dropped.is_finished
    assert all(len(reqs[i].output_ids) == 10 for i in (0, 2))
    assert scheduler.cache.pages.num_free == scheduler.cache.num_pages


def assert_pool_holds_every_token(scheduler: Scheduler) -> None:
    """Every admitted request's row of the token pool starts with the tokens the host has read
    (a request between two chunks of its prompt: the chunks computed so far)."""
    pool = scheduler.engine.token_pool.ids
    for req in scheduler.admitted_reqs():
        known = req.token_ids[:req.cached_len] if req.cached_len < len(req.prompt_ids) \
            else req.token_ids
        on_device = pool[req.table_row, :len(known)].tolist()
        assert on_device == known, f"request {req.uid}: the pool holds other tokens"


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_the_token_pool_holds_what_the_host_read(tiny_model_dir: Path, overlap: bool) -> None:
    """After every step, each running request's row of the pool equals its prompt and the
    outputs read so far, and nothing else stands in ``output_ids``: a token the host has not
    read is counted in ``in_flight`` only, at most one per request between two steps."""
    scheduler = make_scheduler(tiny_model_dir, overlap=overlap, chunked_prefill=True,
                               max_prefill_tokens=BUDGETS["small"])
    reqs, arrivals = workload()
    step = 0
    while step <= max(arrivals) or scheduler.has_work:
        for req, arrival in zip(reqs, arrivals):
            if arrival == step:
                scheduler.add(req)
        scheduler.step()
        scheduler.check_integrity()
        assert_pool_holds_every_token(scheduler)
        assert all(req.in_flight <= (1 if overlap else 0) for req in reqs)
        step += 1
    assert all(req.is_finished and req.in_flight == 0 for req in reqs)


def test_a_launch_reads_no_token_value_on_the_host(tiny_model_dir: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """From scheduling to launch the host reads no token value: not the pool, not a step's
    input ids, not a step's samples. It reads the batch launched the step before, and only
    after launching the next one."""
    scheduler = make_scheduler(tiny_model_dir, overlap=True)
    engine, pool = scheduler.engine, scheduler.engine.token_pool
    holding_tokens = {pool.ids.untyped_storage().data_ptr()}  # storages of token values
    # The tensors themselves are kept, so that no freed address is reused by another tensor
    # (which would then count as holding token values).
    kept: list[torch.Tensor] = []
    events: list[str] = []
    launching = False

    def refuse_during_launch(name: str) -> Callable[..., object]:
        real = getattr(torch.Tensor, name)

        def guarded(self: torch.Tensor, *args: object, **kwargs: object) -> object:
            if launching and self.untyped_storage().data_ptr() in holding_tokens:
                raise AssertionError(f"Tensor.{name} read token values during a launch")
            return real(self, *args, **kwargs)
        return guarded

    for name in ("tolist", "item", "__bool__", "__int__", "__index__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse_during_launch(name))

    def recorded(function: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: object, **kwargs: object) -> Any:
            result = function(*args, **kwargs)  # tokens, or (tokens, logprobs): chapter 21
            tokens = result[0] if isinstance(result, tuple) else result
            holding_tokens.add(tokens.untyped_storage().data_ptr())
            kept.append(tokens)
            return result
        return call

    monkeypatch.setattr(pool, "input_ids", recorded(pool.input_ids))
    monkeypatch.setattr(engine, "forward", recorded(engine.forward))
    forward, read = scheduler._launch, scheduler._read

    def watched_forward(batch: Batch) -> InFlight:
        nonlocal launching
        launching = True
        try:
            return forward(batch)
        finally:
            launching = False
            events.append("launch")

    def watched_read(flight: InFlight) -> list[Req]:
        events.append("read")
        return read(flight)

    monkeypatch.setattr(scheduler, "_launch", watched_forward)
    monkeypatch.setattr(scheduler, "_read", watched_read)
    reqs = [Req(i, p, SamplingParams(max_tokens=5, ignore_eos=True))
            for i, p in enumerate(random_prompts([6, 9], seed=2))]
    for req in reqs:
        scheduler.add(req)
    while scheduler.has_work:
        scheduler.step()
    # Every step after the first launches its batch, then reads the one before; the last
    # step launches nothing and reads the last batch.
    assert events == ["launch"] + ["launch", "read"] * 4 + ["read"]
    assert [len(req.output_ids) for req in reqs] == [5, 5]


class Cycle:
    """An object that refers to itself: only the garbage collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_a_frozen_heap_is_left_out_of_collections_until_the_block_ends() -> None:
    import gc
    import weakref

    from minisgl.utils.heap import frozen_heap

    old = Cycle()
    old_ref = weakref.ref(old)
    del old
    with frozen_heap():
        young = Cycle()
        young_ref = weakref.ref(young)
        del young
        with frozen_heap():  # nested: the inner block neither freezes nor unfreezes
            pass
        assert gc.get_freeze_count() > 0
        gc.collect()
        assert young_ref() is None, "what the block allocates is collected as usual"
        assert old_ref() is not None, "the heap alive at the start is not scanned"
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert old_ref() is None, "handed back at the end: an old cycle is freed afterwards"


def test_generate_steps_with_the_start_up_heap_frozen(tiny_model_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    frozen: list[int] = []
    step = Scheduler.step

    def counting_step(self: Scheduler) -> StepResult:
        frozen.append(gc.get_freeze_count())
        return step(self)

    monkeypatch.setattr(Scheduler, "step", counting_step)
    llm = LLM(tiny_model_dir, device="cpu", num_pages=64, max_running_reqs=2)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert frozen and min(frozen) > 0
    assert gc.get_freeze_count() == 0
