"""Speculative decoding: the verification rules, the prompt-lookup proposer, and the engine.

The greedy rule on constructed cases, exact; the sampling rule statistically: whatever the draft
proposes, the first token emitted is distributed as the target's ``p`` and a guess is kept with
probability ``sum min(p, q)``, each within a bound derived from the number of trials, a bound that
two deliberately wrong rules fail. Then prompt lookup.
"""

from __future__ import annotations


from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SHAKESPEARE_DIR

from minisgl.core import Batch, Req, SamplingParams
from minisgl.kvcache.allocator import OutOfPagesError
from minisgl.kvcache.request_pages import RequestPages
from minisgl.scheduler.config import SchedulerConfig, Speculation
from minisgl.scheduler.scheduler import Scheduler
from minisgl.speculative.accept import PAD, accept_greedy, accept_sampled
from minisgl.speculative.ngram import TokenHistory, propose_ngram


def t(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


# --------------------------------------------------------------------------- the greedy rule
def test_greedy_keeps_every_matching_guess_and_adds_the_bonus() -> None:
    v = accept_greedy(t([[5, 6, 7]]), t([[5, 6, 7, 8]]))
    assert v.accepted.tolist() == [3] and v.to_lists() == [[5, 6, 7, 8]]


def test_greedy_first_guess_wrong_emits_the_targets_token_only() -> None:
    v = accept_greedy(t([[9, 6, 7]]), t([[5, 6, 7, 8]]))
    assert v.accepted.tolist() == [0] and v.tokens.tolist() == [[5, PAD, PAD, PAD]]


def test_greedy_stops_at_the_first_mismatch_even_if_later_guesses_match() -> None:
    v = accept_greedy(t([[5, 0, 7]]), t([[5, 6, 7, 8]]))
    assert v.accepted.tolist() == [1] and v.to_lists() == [[5, 6]]


def test_greedy_rows_with_fewer_or_no_proposals() -> None:
    drafts = t([[5, 6, 7], [5, 6, 99], [99, 99, 99], [5, 6, 7]])
    targets = t([[5, 6, 7, 8], [5, 6, 1, 2], [3, 4, 4, 4], [5, 6, 0, 0]])
    v = accept_greedy(drafts, targets, torch.tensor([3, 2, 0, 1]))
    # row 1: two proposals, both right: the bonus is the target's token at position 2
    # row 2: nothing proposed: exactly the target's next token, as without speculation
    assert v.accepted.tolist() == [3, 2, 0, 1]
    assert v.to_lists() == [[5, 6, 7, 8], [5, 6, 1], [3], [5, 6]]
    assert v.emitted.tolist() == [4, 3, 1, 2]


def test_greedy_with_k_zero_is_plain_decoding() -> None:
    v = accept_greedy(torch.zeros(2, 0, dtype=torch.int64), t([[4], [2]]))
    assert v.to_lists() == [[4], [2]]


def test_shapes_that_do_not_fit_are_refused() -> None:
    with pytest.raises(ValueError, match="k \\+ 1"):
        accept_greedy(t([[1, 2]]), t([[1, 2]]))


def test_sampling_with_one_hot_targets_is_the_greedy_rule() -> None:
    gen = torch.Generator().manual_seed(0)
    drafts = t([[5, 6, 7], [5, 1, 7], [2, 2, PAD]])  # row 2 proposed two tokens
    targets = t([[5, 6, 7, 8], [5, 6, 7, 8], [3, 4, 4, 4]])
    one_hot = torch.nn.functional.one_hot(targets, 10).float()
    q = torch.softmax(torch.randn(3, 3, 10, generator=gen), dim=-1)
    for draft_probs in (None, q):
        v = accept_sampled(drafts, draft_probs, one_hot, torch.tensor([3, 3, 2]), gen)
        assert v.to_lists() == [[5, 6, 7, 8], [5, 6], [3]]


# ------------------------------------------------------- the sampling rule keeps p exactly
N = 200_000
Z = 5.5  # a normal deviation this large has probability 4e-8: the bound never fails by chance
PAIRS = {  # name: (p, q) on a vocabulary of 5
    "different": ([0.1, 0.2, 0.3, 0.4, 0.0], [0.4, 0.3, 0.2, 0.05, 0.05]),
    "q one-hot (prompt lookup)": ([0.5, 0.2, 0.2, 0.1, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0]),
    "q one-hot where p is 0": ([0.5, 0.2, 0.2, 0.1, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]),
    "q without mass where p has": ([0.3, 0.3, 0.2, 0.1, 0.1], [0.0, 0.5, 0.5, 0.0, 0.0]),
    "p without mass where q has": ([0.0, 0.0, 0.6, 0.4, 0.0], [0.3, 0.3, 0.2, 0.1, 0.1]),
    "equal": ([0.2, 0.2, 0.2, 0.2, 0.2], [0.2, 0.2, 0.2, 0.2, 0.2]),
}


def bound(prob: float | torch.Tensor, n: int = N) -> float | torch.Tensor:
    """How far a frequency over ``n`` trials may stray from ``prob``: ``Z`` binomial standard
    deviations (0 where prob is 0 or 1: such an outcome must never or always happen)."""
    return Z * (prob * (1 - prob) / n) ** 0.5 + 1e-12


def trials(p: list[float], q: list[float], k: int, seed: int
           ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, bool]:
    """N independent rows: k guesses drawn from q (one-hot q: always its token), the same p at
    every position."""
    gen = torch.Generator().manual_seed(seed)
    p_t, q_t = torch.tensor(p), torch.tensor(q)
    drafts = torch.multinomial(q_t, N * k, replacement=True, generator=gen).view(N, k)
    one_hot = bool((q_t == 1).any())
    draft_probs = None if one_hot else q_t.expand(N, k, 5)
    return drafts, draft_probs, p_t.expand(N, k + 1, 5), p_t, one_hot


def frequencies(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=5).double() / len(tokens)


@pytest.mark.parametrize("name", PAIRS)
def test_the_first_token_is_distributed_as_the_target_and_acceptance_is_sum_min(name) -> None:
    p, q = PAIRS[name]
    drafts, draft_probs, target_probs, p_t, _ = trials(p, q, 1, seed=1)
    v = accept_sampled(drafts, draft_probs, target_probs,
                       generator=torch.Generator().manual_seed(2))
    deviation = (frequencies(v.tokens[:, 0]) - p_t.double()).abs()
    assert (deviation <= bound(p_t.double())).all(), deviation
    alpha = sum(min(a, b) for a, b in zip(p, q))
    rate = v.accepted.double().mean().item()
    assert abs(rate - alpha) <= bound(alpha), (rate, alpha)


@pytest.mark.parametrize("name", ["different", "q one-hot (prompt lookup)"])
def test_each_later_token_is_distributed_as_the_target_too(name) -> None:
    # With the same p at every position the emitted text must be independent draws from p: the
    # token at position j, among rows that got that far, is again distributed as p.
    p, q = PAIRS[name]
    drafts, draft_probs, target_probs, p_t, _ = trials(p, q, 3, seed=3)
    v = accept_sampled(drafts, draft_probs, target_probs,
                       generator=torch.Generator().manual_seed(4))
    for j in range(4):
        reached = v.tokens[:, j][v.accepted >= j]
        deviation = (frequencies(reached) - p_t.double()).abs()
        assert (deviation <= bound(p_t.double(), len(reached))).all(), (j, deviation)


def always_accept(drafts: torch.Tensor, p_t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return drafts[:, 0]


def resample_from_p(drafts: torch.Tensor, p_t: torch.Tensor, gen: torch.Generator,
                    q_t: torch.Tensor) -> torch.Tensor:
    """Accept with min(1, p/q) but, on rejection, draw from p instead of the residual."""
    x = drafts[:, 0]
    keep = torch.rand(len(x), generator=gen) * q_t[x] < p_t[x]
    return torch.where(keep, x, torch.multinomial(p_t, len(x), replacement=True, generator=gen))


@pytest.mark.parametrize("name", ["different", "q one-hot (prompt lookup)",
                                  "q without mass where p has"])
def test_wrong_rules_fail_the_same_bound(name) -> None:
    p, q = PAIRS[name]
    drafts, _, _, p_t, _ = trials(p, q, 1, seed=5)
    gen = torch.Generator().manual_seed(6)
    wrong = [always_accept(drafts, p_t, gen), resample_from_p(drafts, p_t, gen, torch.tensor(q))]
    for first in wrong:
        deviation = (frequencies(first) - p_t.double()).abs()
        assert (deviation > bound(p_t.double())).any(), deviation


def test_a_row_with_its_own_generator_does_not_depend_on_the_batch() -> None:
    gen = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(3, 4, 50, generator=gen), dim=-1)
    q = torch.softmax(torch.randn(3, 3, 50, generator=gen), dim=-1)
    drafts = torch.randint(0, 50, (3, 3), generator=gen)
    alone = accept_sampled(drafts[1:2], q[1:2], p[1:2],
                           generator=[torch.Generator().manual_seed(11)])
    batch = accept_sampled(drafts, q, p, generator=[None, torch.Generator().manual_seed(11), None])
    assert batch.to_lists()[1] == alone.to_lists()[0]


def test_no_proposals_samples_from_the_target_at_the_first_position() -> None:
    p = torch.tensor([[[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]]).expand(1000, 2, 3)
    drafts = torch.zeros(1000, 1, dtype=torch.int64)
    v = accept_sampled(drafts, None, p, torch.zeros(1000, dtype=torch.int64),
                       torch.Generator().manual_seed(0))
    assert (v.accepted == 0).all() and (v.tokens[:, 0] == 1).all() and (v.tokens[:, 1] == PAD).all()


# ----------------------------------------------------------------------------- prompt lookup
def test_lookup_proposes_what_followed_the_latest_occurrence() -> None:
    history = [1, 2, 3, 4, 9, 2, 3, 5, 6, 2, 3]
    assert propose_ngram(history, k=2, max_ngram=2) == [5, 6]


def test_lookup_prefers_a_longer_match_over_a_more_recent_one() -> None:
    history = [7, 2, 3, 4, 0, 2, 3, 5, 7, 2, 3]  # "7 2 3" occurred at the start, "2 3" later
    assert propose_ngram(history, k=2, max_ngram=3) == [4, 0]
    assert propose_ngram(history, k=2, max_ngram=2) == [5, 7]


def test_lookup_caps_at_k_and_at_the_end_of_the_history() -> None:
    history = [1, 2, 3, 4, 5, 6, 1, 2]
    assert propose_ngram(history, k=3) == [3, 4, 5]
    assert propose_ngram([5, 5], k=4) == [5]  # the continuation runs into the end


def test_lookup_without_a_match_proposes_nothing() -> None:
    assert propose_ngram([1, 2, 3, 4], k=3) == []
    assert propose_ngram([1, 2, 3, 1, 9, 3], k=3, min_ngram=2) == []  # only "3" recurs
    assert propose_ngram([4, 2, 3, 1, 2, 3], k=3, min_ngram=2) == [1, 2, 3]


def test_lookup_on_histories_shorter_than_the_ngram() -> None:
    assert propose_ngram([], k=3) == []
    assert propose_ngram([8], k=3) == []
    assert propose_ngram([8, 8], k=3, max_ngram=5) == [8]
    assert propose_ngram([8, 8], k=3, min_ngram=2) == []


def test_lookup_takes_arrays_tensors_and_a_growing_history() -> None:
    history = [1, 2, 3, 4, 1, 2]
    grown = TokenHistory(history[:3])
    grown.extend(history[3:])
    for form in (np.array(history), torch.tensor(history), grown):
        assert propose_ngram(form, k=2) == [3, 4]
    grown.extend([3, 9])
    grown.truncate(6)
    assert propose_ngram(grown, k=2) == [3, 4]


def test_lookup_matches_a_brute_force_search() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        history = rng.integers(0, 4, rng.integers(0, 30)).tolist()
        assert propose_ngram(history, k=3, max_ngram=3) == brute_force(history, 3, 3, 1)


def brute_force(history: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if len(history) <= n:
            continue
        tail = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start:start + n] == tail:
                return history[start + n:start + n + k]
    return []


def test_lookup_on_a_long_history_is_fast() -> None:
    import time
    history = TokenHistory(np.random.default_rng(1).integers(0, 1000, 50_000).tolist())
    start = time.perf_counter()
    for _ in range(20):
        propose_ngram(history, k=4)
    assert (time.perf_counter() - start) / 20 < 0.01


# --------------------------------------------------------------------------- in the engine
# Speculative decode steps through the scheduler: the trained tiny model is the target; the
# drafts are prompt lookup and a model cut from it (its first two layers and its head), which
# agrees often but not always, so rejections and roll-backs happen in every run.

PROMPTS = [
    "To be, or not to be, that is the question:",
    "ROMEO. But soft, what light through yonder window breaks?",
    "First Citizen. Before we proceed any further, hear me speak.",
    "KING. Now is the winter of our discontent made glorious summer",
    "O",
    "HAMLET. HAMLET. HAMLET. HAMLET. HAMLET.",
]


@pytest.fixture(scope="module")
def cut_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-shakespeare's first two layers, embedding, final norm and head: a draft that
    shares the tokenizer and agrees with the whole model only part of the time."""
    from cut_model import cut_layers

    return cut_layers(SHAKESPEARE_DIR, 2, tmp_path_factory.mktemp("draft"))


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(SHAKESPEARE_DIR)


def run_all(reqs: list[Req], speculative: str | None, **config) -> Scheduler:
    """Run ``reqs`` to the end on a CPU scheduler, checking the bookkeeping every step."""
    scheduler = Scheduler(SchedulerConfig(SHAKESPEARE_DIR, device="cpu", num_pages=4096,
                                          max_running_reqs=8, speculative=speculative,
                                          overlap=False, **config))
    for req in reqs:
        scheduler.add(req)
    while scheduler.has_work:
        scheduler.step()
        scheduler.check_integrity()
    assert all(req.is_finished for req in reqs)
    return scheduler


def fresh(prompts_ids: list[list[int]], params: list[SamplingParams]) -> list[Req]:
    return [Req(i, ids, p) for i, (ids, p) in enumerate(zip(prompts_ids, params))]


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS]


def mixed_params(n: int) -> list[SamplingParams]:
    """Different lengths, so requests finish at different steps and batches change."""
    return [SamplingParams(max_tokens=12 + 7 * i, ignore_eos=i % 2 == 0) for i in range(n)]


@pytest.fixture(scope="module")
def plain_outputs(prompt_ids) -> list[list[int]]:
    reqs = fresh(prompt_ids, mixed_params(len(prompt_ids)))
    run_all(reqs, None)
    return [req.output_ids for req in reqs]


def assert_kept_some_and_returned_everything(scheduler: Scheduler) -> None:
    """After a run: some guesses kept and some rejected, every page of every request back,
    and the draft's copies of them and their pages too."""
    speculator = scheduler.speculator
    assert 0 < speculator.num_accepted < speculator.num_proposed
    assert scheduler.cache.pages_in_use == 0
    if speculator.draft is not None:
        assert speculator.draft.num_copies == 0
        assert speculator.draft.engine.pages.num_used == 0


@pytest.mark.parametrize("proposer", ["ngram", "ngram,k=1", "draft", "draft,k=6"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_output_is_token_identical_and_every_page_returns(
        proposer, page_size, prompt_ids, plain_outputs, cut_draft) -> None:
    spec = proposer.replace("draft", f"draft={cut_draft}")
    reqs = fresh(prompt_ids, mixed_params(len(prompt_ids)))
    scheduler = run_all(reqs, spec, page_size=page_size)
    assert [req.output_ids for req in reqs] == plain_outputs
    assert_kept_some_and_returned_everything(scheduler)


def test_pages_reserved_ahead_stay_until_shrink_lets_them_go() -> None:
    """A pass launched before the verdict is read feeds up to ``ahead`` tokens past a request's
    end: ``reserve(..., ahead=)`` maps their pages, all or nothing, within ``max_seq_len``, and
    ``shrink(req, ahead)`` keeps them until a plain ``shrink`` gives them back."""
    pages = RequestPages(num_pages=6, max_reqs=2, max_seq_len=24, page_size=4)
    req = Req(0, [1] * 5)
    assert pages.reserve(req, ahead=4) == 3  # 9 tokens: 3 pages
    assert pages.shrink(req, 4) == 0 and pages.pages_held(req) == 3
    other = Req(1, [1] * 9)
    with pytest.raises(OutOfPagesError):  # 9 + 4 tokens need 4 pages, 3 are free
        pages.reserve(other, ahead=4)
    assert other.table_row is None and pages.num_free == 3  # nothing was taken
    with pytest.raises(ValueError, match="max_seq_len"):
        pages.reserve(req, ahead=20)
    assert pages.shrink(req) == 1 and pages.pages_held(req) == 2


@pytest.mark.parametrize("proposer", ["ngram,k=4", "draft,k=4", "draft,k=6"])
def test_requests_speculate_up_to_the_longest_sequence(proposer, prompt_ids, cut_draft) -> None:
    """Requests whose ``max_tokens`` ends them exactly at ``max_seq_len``: near it a request
    makes fewer guesses (what is left of ``max_tokens`` caps them) and a draft none (its
    ``k + 1`` steps must fit), and the same tokens come out to the last position."""
    max_seq_len = 48
    params = [SamplingParams(max_tokens=max_seq_len - len(ids), ignore_eos=True)
              for ids in prompt_ids]
    plain = fresh(prompt_ids, params)
    run_all(plain, None, max_seq_len=max_seq_len)
    reqs = fresh(prompt_ids, params)
    scheduler = run_all(reqs, proposer.replace("draft", f"draft={cut_draft}"),
                        max_seq_len=max_seq_len)
    assert [req.output_ids for req in reqs] == [req.output_ids for req in plain]
    assert all(req.num_tokens == max_seq_len for req in reqs)
    assert_kept_some_and_returned_everything(scheduler)


def test_a_speculative_step_makes_several_tokens(prompt_ids, cut_draft) -> None:
    """With a draft that is the target itself every guess is kept: k + 1 tokens a step."""
    req = Req(0, prompt_ids[0], SamplingParams(max_tokens=21, ignore_eos=True))
    scheduler = run_all([req], f"draft={SHAKESPEARE_DIR},k=4")
    assert scheduler.num_steps == 1 + 4  # a prefill, then 5 + 5 + 5 + 5 tokens after its first
    assert scheduler.speculator.num_accepted == scheduler.speculator.num_proposed == 16


def test_the_token_pool_holds_every_token_a_speculating_request_took(
        prompt_ids, cut_draft) -> None:
    """The verify pass reads the guesses from the proposer, not the token pool; after the
    verdict the pool must still hold each request's tokens, kept guesses included, as it does
    for a request decoding one token a step."""
    scheduler = Scheduler(SchedulerConfig(SHAKESPEARE_DIR, device="cpu", num_pages=4096,
                                          max_running_reqs=8, overlap=False,
                                          speculative=f"draft={cut_draft},k=4"))
    reqs = fresh(prompt_ids[:3], [SamplingParams(max_tokens=40, ignore_eos=True)] * 3)
    for req in reqs:
        scheduler.add(req)
    pool, checked = scheduler.engine.token_pool, 0
    while scheduler.has_work:
        scheduler.step()
        for req in reqs:
            if not req.is_finished and req.output_ids:
                held = pool.ids[req.table_row, : req.num_tokens].tolist()
                assert held == req.token_ids, f"request {req.uid} after step {scheduler.num_steps}"
                checked += 1
    assert checked >= 6 and scheduler.speculator.num_accepted > 0


def test_the_radix_cache_is_given_only_kept_tokens(prompt_ids, cut_draft) -> None:
    """Requests that speculated leave their pages to the radix cache; new requests that
    continue those sequences reuse them, and must decode exactly as from a cold cache: K/V
    that a rejected guess wrote never reaches the cache."""
    def continuations(reqs: list[Req]) -> list[Req]:
        return fresh([req.token_ids[:-1] for req in reqs],
                     [SamplingParams(max_tokens=10, ignore_eos=True) for _ in reqs])

    first = fresh(prompt_ids, mixed_params(len(prompt_ids)))
    scheduler = run_all(first, f"draft={cut_draft}", prefix_cache="radix")
    warm = continuations(first)
    for req in warm:
        scheduler.add(req)
    while scheduler.has_work:
        scheduler.step()
        scheduler.check_integrity()
    assert sum(req.cached_len for req in warm) > 0
    cold = continuations(first)
    run_all(cold, None)
    assert [r.output_ids for r in warm] == [r.output_ids for r in cold]
    cache = scheduler.cache.prefix_cache
    for req in first:  # and nothing past a request's real tokens is cached
        wrong = req.prompt_ids + [(t + 1) % 4000 for t in req.output_ids]
        assert len(cache.match_prefix(wrong).pages) <= len(req.prompt_ids)


def test_requests_that_cannot_guess_decode_beside_those_that_do(prompt_ids, cut_draft) -> None:
    params = mixed_params(len(prompt_ids))
    params[1] = SamplingParams(max_tokens=20, logprobs=2, ignore_eos=True)
    params[2] = SamplingParams(max_tokens=20, repetition_penalty=1.3, ignore_eos=True)
    plain = fresh(prompt_ids, params)
    run_all(plain, None)
    reqs = fresh(prompt_ids, params)
    run_all(reqs, f"draft={cut_draft}")
    assert [r.output_ids for r in reqs] == [r.output_ids for r in plain]
    assert len(reqs[1].output_logprobs) == len(reqs[1].output_ids) == 20


def test_an_end_of_sequence_among_kept_guesses_ends_the_request_there(prompt_ids) -> None:
    """The target is its own draft, so every guess is kept; the end-of-sequence token must
    still end the request at exactly the step decoding one token at a time ends it."""
    plain = fresh(prompt_ids, [SamplingParams(max_tokens=200) for _ in prompt_ids])
    run_all(plain, None)
    stopped = [r for r in plain if r.finish_reason == "stop"]
    assert stopped, "no prompt ends with end-of-sequence within 200 tokens: pick others"
    reqs = fresh(prompt_ids, [SamplingParams(max_tokens=200) for _ in prompt_ids])
    run_all(reqs, f"draft={SHAKESPEARE_DIR},k=5")
    assert [(r.output_ids, r.finish_reason) for r in reqs] == [
        (r.output_ids, r.finish_reason) for r in plain]


def test_sampled_requests_are_reproducible_with_a_seed_and_valid(prompt_ids, cut_draft) -> None:
    params = [SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
              for i in range(len(prompt_ids))]
    first, second = fresh(prompt_ids, params), fresh(prompt_ids, params)
    run_all(first, f"draft={cut_draft}")
    run_all(second, f"draft={cut_draft}")
    assert [r.output_ids for r in first] == [r.output_ids for r in second]
    assert all(len(r.output_ids) == 30 for r in first)


@pytest.mark.parametrize("text", ["", "draft", "draft=", "lookup", "ngram,k=0", "ngram,k=x",
                                  "ngram,n=3"])
def test_a_bad_setting_is_refused_naming_the_forms(text) -> None:
    with pytest.raises(ValueError, match="ngram or draft=PATH"):
        SchedulerConfig(SHAKESPEARE_DIR, device="cpu", speculative=text)


def test_a_speculating_engine_has_graphs_for_every_entry_a_verify_pass_feeds() -> None:
    """A verify pass feeds k + 1 decode entries per request: at batch 1 with k = 4 that is 5
    entries, which graphs sized for the requests alone (1) would leave to run eagerly."""
    from minisgl.engine.graph import capture_batch_sizes, padded_batch_size

    def sizes(**settings) -> list[int]:
        return capture_batch_sizes(SchedulerConfig(SHAKESPEARE_DIR, device="cpu", **settings))

    assert sizes(max_running_reqs=1) == [1]
    assert sizes(max_running_reqs=1, speculative="ngram") == [1, 2, 4, 5]
    assert padded_batch_size(8 * 7, sizes(max_running_reqs=8, speculative="ngram,k=6")) == 56
    assert sizes(max_running_reqs=128, speculative="ngram")[-1] == 256  # the cap stays
    assert sizes(max_running_reqs=8, speculative="ngram", cuda_graph_max_bs=16)[-1] == 16


def test_speculation_with_overlap_asked_for_is_refused() -> None:
    with pytest.raises(ValueError, match="exclude each other"):
        SchedulerConfig(SHAKESPEARE_DIR, device="cpu", speculative="ngram", overlap=True)
    assert SchedulerConfig(SHAKESPEARE_DIR, device="cpu", speculative="ngram").overlap is False


def test_the_speculative_setting_parses_and_a_bad_one_is_refused() -> None:
    assert Speculation.parse("draft=a/b,k=7") == Speculation(draft="a/b", k=7, ahead=True)
    assert Speculation.parse("draft=a/b, ahead=off, k=2") == Speculation("a/b", 2, False)
    assert Speculation.parse("ngram") == Speculation(None, 4, True)
    for bad in ("draft=", "eagle", "ngram,k=0", "ngram,k=two", "draft=a,ahead=no",
                "ngram,depth=2"):
        with pytest.raises(ValueError, match="speculative must be"):
            Speculation.parse(bad)


def test_a_draft_with_another_vocabulary_is_refused(tiny_model_dir) -> None:
    with pytest.raises(ValueError, match="share the target's tokenizer"):
        Scheduler(SchedulerConfig(SHAKESPEARE_DIR, device="cpu", num_pages=64,
                                  speculative=f"draft={tiny_model_dir}"))


# ------------------------------------------------------------- the verify pass, decode-shaped
def prefilled(engine, prompts: list[list[int]]) -> list[Req]:
    """Requests prefilled on ``engine``, each with its first sample read, to feed next."""
    reqs = [Req(i, ids, SamplingParams(max_tokens=64, ignore_eos=True))
            for i, ids in enumerate(prompts)]
    engine.pages.reserve(*reqs)
    prefill = Batch(reqs, "prefill")
    first = engine.forward(prefill).tolist()
    prefill.advance()
    for req, token in zip(reqs, first):
        req.append_token(token)
    return reqs


def fed_batch(engine, prompts: list[list[int]], guesses: list[list[int]]) -> Batch:
    """Requests prefilled on ``engine``, each sampled once, that then feed that sample and
    their ``guesses`` in one prefill-phase batch, as a speculative step sets it up."""
    reqs = prefilled(engine, prompts)
    for req, guessed in zip(reqs, guesses):
        engine.token_pool.store_rows([req], [req.num_tokens], [len(guessed)],
                                     torch.tensor([guessed], dtype=torch.int64,
                                                  device=engine.device))
        req.in_flight = len(guessed)
    engine.pages.reserve(*reqs)
    return Batch(reqs, "prefill")


def prefill_shaped_logits(engine, batch: Batch) -> torch.Tensor:
    """Every fed token's logits from one eager prefill-shaped pass: the reference."""
    logits = engine.logits(batch, use_graph=False, extra_rows=list(range(batch.num_tokens)))
    return logits[batch.size:]


# On a GPU the graphs need FlashInfer, which runs in bfloat16: there the pass and the reference
# round differently, so logits agree to bfloat16's precision (8 bits of mantissa; four of its
# steps at the largest logit's scale) and argmaxes where the top two are further apart than that.
BF16_REL_TOL = 2.0 ** -6


def bf16_tol(logits: torch.Tensor) -> float:
    """What bfloat16 rounding may move logits of this scale by."""
    return BF16_REL_TOL * logits.abs().max().item()


def clear_rows(reference: torch.Tensor, tol: float) -> list[bool]:
    """Which rows of ``reference`` have their top logit ahead of the second by more than
    ``2 * tol``, what rounding on both sides may close: there the argmax must not change."""
    top2 = reference.topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1] > 2 * tol).tolist()


def assert_argmaxes_agree(ours: torch.Tensor, reference: torch.Tensor,
                          rows: list[bool]) -> None:
    """``ours`` and ``reference`` pick the same token in every row that ``rows`` marks."""
    assert [a for a, c in zip(ours.argmax(-1).tolist(), rows) if c] == \
        [a for a, c in zip(reference.argmax(-1).tolist(), rows) if c]


@pytest.mark.parametrize("device", [pytest.param("cpu"),
                                    pytest.param("cuda", marks=pytest.mark.gpu)])
def test_each_fed_token_decoding_as_an_entry_scores_as_a_prefill_would(
        device, prompt_ids) -> None:
    """The verify pass feeds each request's tokens as decode entries on its page-table row
    (``EachTokenDecodes``): every row of logits must equal the causal prefill's over the same
    tokens, for requests with several guesses, one and none in one batch, and the K/V it
    stored must be the prefill's. On a GPU the pass is a replay of a captured decode graph."""
    from minisgl.engine.config import EngineConfig
    from minisgl.engine.engine import Engine
    from minisgl.engine.verify import EachTokenDecodes

    dtype = "bfloat16" if device == "cuda" else "float32"
    engine = Engine(EngineConfig(SHAKESPEARE_DIR, device=device, dtype=dtype,
                                 num_pages=1024, max_running_reqs=8))
    guesses = [[11, 12, 13], [], [21, 22]]
    batch = fed_batch(engine, prompt_ids[:3], guesses)
    layout = EachTokenDecodes.of(batch)
    assert layout.size == batch.num_tokens == 4 + 1 + 3
    assert layout.cached_lens[:4] == list(range(batch.cached_lens[0], batch.cached_lens[0] + 4))
    graph_size = engine.graph_runner.size_for(layout)
    assert (graph_size is not None) == (device == "cuda"), "a GPU replays a decode graph here"
    ours = engine.layout_logits(layout, engine.input_ids(batch)).clone()  # float32 logits
    stored = stored_kv(engine, layout)
    reference = prefill_shaped_logits(engine, batch)  # it stores the same tokens' K/V again
    tol = 1e-4 if device == "cpu" else bf16_tol(reference)
    torch.testing.assert_close(ours, reference, rtol=tol, atol=tol)
    if device == "cpu":  # float32 on both sides: every argmax
        clear = [True] * len(reference)
    else:
        clear = clear_rows(reference, tol)
        assert sum(clear) >= len(clear) // 2, "too few rows with a clear argmax to compare"
    assert_argmaxes_agree(ours, reference, clear)
    torch.testing.assert_close(stored, stored_kv(engine, layout), rtol=tol, atol=tol)


# ------------------------------------------------------------------ the draft's steps, as one
@pytest.mark.parametrize("device", [pytest.param("cpu"),
                                    pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_draft_steps_launched_as_one_write_what_one_step_at_a_time_writes(
        device, prompt_ids) -> None:
    """``DraftSteps`` runs k + 1 greedy decode steps with no host work between them (on a GPU,
    one graph replay). Its tokens, the requests' lengths afterwards and the K/V it stored must
    be those of the same steps run one ``engine.forward`` at a time, each sample read back."""
    from minisgl.engine.config import EngineConfig
    from minisgl.engine.draft_steps import DraftSteps
    from minisgl.engine.engine import Engine
    from minisgl.engine.verify import EachTokenDecodes

    steps = 5
    dtype = "bfloat16" if device == "cuda" else "float32"
    # configured as a draft's engine is (DraftModel): its graphs are DraftSteps'
    engine = Engine(EngineConfig(SHAKESPEARE_DIR, device=device, dtype=dtype,
                                 num_pages=2048, max_running_reqs=8, fixed_plans=True,
                                 cuda_graph_batch_sizes=(1,)))
    chained = DraftSteps(engine, steps)
    assert chained.graphs.enabled == (device == "cuda")
    # and one long context: a plan made at capture must hold for any length
    prompts = prompt_ids[:3] + [sum(prompt_ids, [])[:-1] * 5]
    ours = prefilled(engine, prompts)
    tokens = chained.run(Batch(ours, "decode")).T.tolist()
    theirs = prefilled(engine, prompts)
    expected: list[list[int]] = [[] for _ in theirs]
    for _ in range(steps):
        batch = Batch(theirs, "decode")
        engine.pages.reserve(*theirs)
        sampled = engine.forward(batch).tolist()
        batch.advance()
        for req, token, out in zip(theirs, sampled, expected):
            req.append_token(token)
            out.append(token)
    assert tokens == expected
    # the same cached lengths; the samples in flight, where the others were read
    assert [(r.cached_len, r.in_flight) for r in ours] == [(r.cached_len, steps) for r in theirs]
    fed = lambda reqs: EachTokenDecodes(  # noqa: E731  (every position the steps fed)
        [r.table_row for r in reqs for _ in range(steps)],
        [r.cached_len - steps + j for r in reqs for j in range(steps)],
        [1] * steps * len(reqs), steps * len(reqs), steps * len(reqs))
    torch.testing.assert_close(stored_kv(engine, fed(ours)), stored_kv(engine, fed(theirs)),
                               rtol=0, atol=0)


def assert_replays_score_as_eager_steps(engine, reqs: list[Req], steps: int) -> None:
    """``steps`` greedy decode steps of ``reqs``, each scored eagerly and by a graph replay:
    the two within bfloat16 rounding, the same argmax wherever the eager one is clear."""
    for _ in range(steps):
        batch = Batch(reqs, "decode")
        engine.pages.reserve(*reqs)
        eager = engine.logits(batch, use_graph=False).clone()
        replayed = engine.logits(batch).clone()
        tol = bf16_tol(eager)
        torch.testing.assert_close(replayed, eager, rtol=tol, atol=tol)
        assert_argmaxes_agree(replayed, eager, clear_rows(eager, tol))
        sampled = eager.argmax(-1, keepdim=True)  # [B, 1]
        engine.token_pool.store_rows(reqs, [r.num_tokens for r in reqs], [1] * len(reqs),
                                     sampled)
        batch.advance()
        for req, token in zip(reqs, sampled.view(-1).tolist()):
            req.append_token(token)


@pytest.mark.gpu
def test_a_fixed_plans_engine_replays_growing_batches_without_planning_again(
        prompt_ids) -> None:
    """With ``fixed_plans`` a captured size's plan holds for any lengths, so a replay writes
    the page arrays and plans nothing (the host's FlashInfer ``plan()`` is skipped). Decode
    steps of a short and a long context, graph against eager, must sample the same tokens
    and score within bfloat16 rounding, with ``plan()`` called at capture only."""
    from minisgl.engine.config import EngineConfig
    from minisgl.engine.engine import Engine

    engine = Engine(EngineConfig(SHAKESPEARE_DIR, device="cuda", dtype="bfloat16",
                                 num_pages=2048, max_running_reqs=2, fixed_plans=True,
                                 cuda_graph_batch_sizes=(2,)))
    wrapper = engine.attn_backend._graph_wrappers[2][0]
    plans = []
    original_plan = wrapper.plan

    def counted_plan(*args, **kwargs):
        plans.append(1)
        return original_plan(*args, **kwargs)

    wrapper.plan = counted_plan
    assert_replays_score_as_eager_steps(
        engine, prefilled(engine, [prompt_ids[0], sum(prompt_ids, [])[:-1] * 4]), steps=6)
    assert plans == [], "a replay of a fixed-plans engine planned again"


@pytest.mark.gpu
def test_a_fixed_plans_engine_made_after_another_was_dropped_replays_as_it_runs_eagerly(
        prompt_ids) -> None:
    """With fixed plans a captured batch's kernel reads a work list that ``plan()`` fills only
    in part; the rest comes from pinned host memory, which a dropped engine leaves full of its
    plans (``clear_plan_staging``). Measured on an H100 without it: an illegal memory access
    while the second engine captured. Made after another engine was dropped, a fixed-plans
    engine must capture, and its replays must score as its eager steps do."""
    import gc

    from minisgl.engine.config import EngineConfig
    from minisgl.engine.engine import Engine

    dropped = Engine(EngineConfig(SHAKESPEARE_DIR, device="cuda", dtype="bfloat16",
                                  num_pages=1024, max_running_reqs=8))
    assert dropped.graph_runner.enabled
    del dropped
    gc.collect()
    engine = Engine(EngineConfig(SHAKESPEARE_DIR, device="cuda", dtype="bfloat16",
                                 num_pages=2048, max_running_reqs=8, fixed_plans=True,
                                 cuda_graph_batch_sizes=(1,)))
    assert_replays_score_as_eager_steps(engine, prefilled(engine, prompt_ids[:1]), steps=4)


@pytest.mark.gpu
def test_chained_draft_steps_refuse_an_engine_whose_plans_depend_on_lengths() -> None:
    """The chained steps' graphs replay plans made once, at capture. On a GPU the engine's
    default decode plan splits each request's keys by length, so a plan made for the padding
    would be wrong at longer contexts (measured: other tokens from 150 tokens of context on):
    such an engine is refused, naming the setting that fixes it."""
    from minisgl.engine.config import EngineConfig
    from minisgl.engine.draft_steps import DraftSteps
    from minisgl.engine.engine import Engine

    engine = Engine(EngineConfig(SHAKESPEARE_DIR, device="cuda", dtype="bfloat16",
                                 num_pages=256, max_running_reqs=2))
    with pytest.raises(ValueError, match="fixed_plans=True"):
        DraftSteps(engine, 3)


@pytest.mark.parametrize("page_size", [1, 4])
def test_every_chained_steps_inputs_computed_at_once_are_what_each_step_plans(
        prompt_ids, page_size) -> None:
    """``step_arrays`` computes the inputs of all k + 1 chained steps in one pass, for the one
    copy ``DraftSteps`` makes of them. Row j must be what planning step j alone gives: the
    positions, slots and last indices of ``prepare`` and FlashInfer's page arrays, for a batch
    of requests of different lengths padded to a captured size (padding stays put)."""
    from minisgl.attention import layout_of, pad_batch
    from minisgl.attention.fi import page_arrays
    from minisgl.engine.config import EngineConfig
    from minisgl.engine.draft_steps import step_arrays
    from minisgl.engine.engine import Engine

    steps, size = 5, 8
    engine = Engine(EngineConfig(SHAKESPEARE_DIR, device="cpu", page_size=page_size,
                                 num_pages=512, max_running_reqs=size))
    pad_row = engine.pages.padding_row()
    reqs = prefilled(engine, [prompt_ids[0][:9], prompt_ids[1][:4], prompt_ids[2][:13]])
    table = engine.pages.table
    first = Batch(reqs, "decode")
    with pytest.raises(ValueError, match="reserve every step's pages"):
        step_arrays(table, pad_batch(first, size, pad_row), len(reqs), steps)
    for req in reqs:  # as DraftSteps.run: every step's token counted in flight
        req.in_flight += steps - 1
    engine.pages.reserve(*reqs)
    arrays = step_arrays(table, pad_batch(first, size, pad_row), len(reqs), steps)
    for j in range(steps):
        layout = pad_batch(layout_of(first.rows, [n + j for n in first.cached_lens],
                                     [1] * len(reqs), is_decode=True), size, pad_row)
        ends = [c + 1 for c in layout.cached_lens]
        positions, slots = table.locate(layout.rows, layout.cached_lens, ends)
        assert arrays["fields"][j].tolist() == [*positions, *slots, *range(size)]
        planned = page_arrays(table, layout)
        indptr = arrays["indptr"][j]
        assert indptr.tolist() == planned["page_indptr"].tolist()
        assert arrays["last_page_lens"][j].tolist() == planned["last_page_lens"].tolist()
        assert (arrays["page_ids"][j, : indptr[-1]].tolist()
                == planned["page_indices"].tolist())


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(4))
def test_chained_steps_inputs_computed_on_the_device_equal_those_computed_on_the_host(
        page_size, seed) -> None:
    """Steps launched ahead of the verdict compute their inputs on the device from each
    entry's first position (``device_step_arrays``, shapes fixed for a graph). On random
    padded batches of rows with scattered pages, every array must equal ``step_arrays``'
    from the same table: the packed page ids up to ``indptr[j, -1]``, zeros after."""
    from minisgl.attention import layout_of, pad_batch
    from minisgl.engine.draft_steps import device_step_arrays, step_arrays
    from minisgl.kvcache.page_table import PageTable, pages_for

    rng = np.random.default_rng(seed)
    steps, size, real, width = 5, 8, int(rng.integers(1, 8)), 160
    table = PageTable(16, width, page_size=page_size)
    pad_row = table.alloc_row()
    table.append_pages(pad_row, [999])
    free_pages = rng.permutation(2000).tolist()  # a row's pages are anywhere in the pool
    rows, cached = [], []
    for _ in range(real):
        row, length = table.alloc_row(), int(rng.integers(1, 150))
        needed = pages_for(length + steps, page_size)
        table.append_pages(row, [free_pages.pop() for _ in range(needed)])
        rows.append(row)
        cached.append(length)
    layout = pad_batch(layout_of(rows, cached, [1] * real, is_decode=True), size, pad_row)
    expected = step_arrays(table, layout, real, steps)
    # past a row's pages: whatever an earlier round left there (never to be read)
    row_pages = torch.from_numpy(np.where(table.page_ids[layout.rows] < 0, 777,
                                          table.page_ids[layout.rows]))
    got = device_step_arrays(torch.tensor(layout.cached_lens), torch.arange(size) < real,
                             row_pages, page_size, steps, capacity=size * width)
    for name in ("fields", "indptr", "last_page_lens"):
        assert got[name].tolist() == expected[name].tolist(), name
    for j in range(steps):
        n = int(expected["indptr"][j, -1])
        assert got["page_ids"][j, :n].tolist() == expected["page_ids"][j, :n].tolist()
        assert not got["page_ids"][j, n:].any()


@pytest.mark.gpu
def test_on_cuda_the_draft_guesses_without_waiting_for_the_device(prompt_ids, cut_draft) -> None:
    """A round's guessing is launched, not waited for. With the device kept busy for about a
    second by work queued first, ``propose`` returns while it is still busy, both ways: taking
    the guesses of steps launched ahead of the last verdict (the copies' lengths are settled
    on the host), and, guessing again from the same tokens, bringing the copies up to date,
    reserving pages, loading and launching k + 1 steps."""
    import time

    scheduler = Scheduler(SchedulerConfig(SHAKESPEARE_DIR, device="cuda", dtype="bfloat16",
                                          num_pages=4096, max_running_reqs=8, overlap=False,
                                          speculative=f"draft={cut_draft},k=4"))
    reqs = fresh(prompt_ids[:3], [SamplingParams(max_tokens=48, ignore_eos=True)] * 3)
    for req in reqs:
        scheduler.add(req)
    for _ in range(4):  # the prefill, then rounds: every copy exists and has guessed ahead
        scheduler.step()
    draft = scheduler.speculator.draft
    assert draft.num_copies == 3 and not any(r.is_finished for r in reqs)
    assert draft.rounds_ahead >= 2
    for ahead in (True, False):
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # GPU clock cycles: about a second at 2 GHz
        start = time.perf_counter()
        guesses = scheduler.speculator.propose(reqs)
        seconds = time.perf_counter() - start
        still_busy = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        assert still_busy and seconds < 0.25, f"propose ({ahead=}) took {seconds:.3f} s"
        assert guesses.tokens.is_cuda and guesses.counts == [4, 4, 4]
        draft._read_last_guesses()  # before the next sleep: the device is done with them


def test_draft_steps_without_pages_for_every_step_leave_the_requests_as_they_were(
        prompt_ids) -> None:
    from minisgl.engine.config import EngineConfig
    from minisgl.engine.draft_steps import DraftSteps
    from minisgl.engine.engine import Engine
    from minisgl.kvcache import OutOfPagesError

    engine = Engine(EngineConfig(SHAKESPEARE_DIR, device="cpu", page_size=4, num_pages=8,
                                 max_running_reqs=2))
    # 16 tokens in 4 pages and 12 in 3: one page is free, and 8 steps need two more
    req, _ = prefilled(engine, [prompt_ids[0][:15], prompt_ids[1][:11]])
    before = (req.cached_len, req.in_flight, engine.pages.num_free)
    with pytest.raises(OutOfPagesError):
        DraftSteps(engine, 8).run(Batch([req], "decode"))
    assert (req.cached_len, req.in_flight, engine.pages.num_free) == before


def test_draft_steps_refuse_a_request_whose_last_token_the_host_has_not_read(
        prompt_ids) -> None:
    """The chained steps take their first input from the host: a sample still in flight
    (on the device only) cannot be fed, and nothing is reserved or moved."""
    from minisgl.engine.config import EngineConfig
    from minisgl.engine.draft_steps import DraftSteps
    from minisgl.engine.engine import Engine

    engine = Engine(EngineConfig(SHAKESPEARE_DIR, device="cpu", num_pages=256,
                                 max_running_reqs=2))
    req = Req(0, prompt_ids[0][:8], SamplingParams(max_tokens=16, ignore_eos=True))
    engine.pages.reserve(req)
    prefill = Batch([req], "prefill")
    engine.forward(prefill)
    prefill.advance()
    req.in_flight = 1  # sampled, not read
    before = (req.cached_len, req.in_flight, engine.pages.num_free)
    with pytest.raises(ValueError, match="none may be in flight"):
        DraftSteps(engine, 3).run(Batch([req], "decode"))
    assert (req.cached_len, req.in_flight, engine.pages.num_free) == before


def stored_kv(engine, layout) -> torch.Tensor:
    """The K and V every layer holds for the layout's new tokens, stacked."""
    ends = [c + n for c, n in zip(layout.cached_lens, layout.new_lens)]
    _, slots = engine.pages.table.locate(layout.rows, layout.cached_lens, ends)
    slots = torch.from_numpy(slots).to(engine.device)
    return torch.stack([torch.stack([k[slots], v[slots]]) for k, v in (
        engine.kv_pool.kv_cache(layer) for layer in range(engine.kv_pool.num_layers))]).clone()


def greedy_slack(engine, prompt: list[int], output: list[int]) -> list[float]:
    """How far below the best logit each token of ``output`` lies, the whole text scored in one
    eager prefill on ``engine``, each row's gap divided by what bfloat16 may move that row."""
    req = Req(0, prompt + output[:-1], SamplingParams(max_tokens=1, ignore_eos=True))
    engine.pages.reserve(req)
    batch = Batch([req], "prefill")
    rows = prefill_shaped_logits(engine, batch)[len(prompt) - 1:]
    engine.pages.release(req)
    chosen = rows.gather(1, torch.tensor(output, device=rows.device)[:, None])[:, 0]
    return ((rows.max(-1).values - chosen) / (2 * BF16_REL_TOL * rows.abs().amax(-1))).tolist()


@pytest.mark.gpu
def test_on_cuda_greedy_speculation_follows_plain_decoding_through_graphs(
        prompt_ids, cut_draft) -> None:
    """On a GPU, through captured graphs (the verify pass and the draft's steps replay decode
    graphs), in bfloat16: every token speculation writes is the model's greedy choice given
    the text before it, within what bfloat16's rounding may move a logit. (Plain decoding's
    texts themselves are no reference past a near tie: another batch shape may round to the
    other token, and from there the texts part.) The criterion is checked on plain decoding
    too, and at least one output must match plain decoding's whole."""
    def run(speculative: str | None) -> tuple[list[Req], Scheduler]:
        scheduler = Scheduler(SchedulerConfig(SHAKESPEARE_DIR, device="cuda", dtype="bfloat16",
                                              num_pages=4096, max_running_reqs=8,
                                              speculative=speculative, overlap=False))
        replayed = []
        replay = scheduler.engine.replay
        scheduler.engine.replay = lambda *a, **kw: replayed.append(1) or replay(*a, **kw)
        reqs = fresh(prompt_ids, mixed_params(len(prompt_ids)))
        for req in reqs:
            scheduler.add(req)
        while scheduler.has_work:
            scheduler.step()
            scheduler.check_integrity()
        assert scheduler.cache.pages_in_use == 0
        assert replayed, "nothing replayed a CUDA graph"
        return reqs, scheduler

    from minisgl.engine.config import EngineConfig
    from minisgl.engine.engine import Engine

    scorer = Engine(EngineConfig(SHAKESPEARE_DIR, device="cuda", dtype="bfloat16",
                                 num_pages=1024, max_running_reqs=8, cuda_graph=False))
    plain, _ = run(None)
    for spec in (None, f"draft={cut_draft},k=4", f"draft={cut_draft},k=4,ahead=off", "ngram"):
        reqs, scheduler = (plain, None) if spec is None else run(spec)
        for req in reqs:
            slack = greedy_slack(scorer, req.prompt_ids, req.output_ids)
            assert max(slack) <= 1.0, (spec, req.uid, [round(x, 2) for x in slack])
        if spec is not None:
            assert scheduler.speculator.num_accepted > 0
            assert any(ours.output_ids == theirs.output_ids for ours, theirs in zip(reqs, plain))
        draft = None if spec is None else scheduler.speculator.draft
        if draft is not None:  # most rounds launched ahead (unless turned off); the copies
            # and pages all went back
            if scheduler.speculator.launches_ahead:
                assert draft.rounds_ahead > scheduler.num_steps // 2
                assert scheduler.speculator.rounds_verified_ahead > 0
            else:
                assert draft.rounds_ahead == 0 == scheduler.speculator.rounds_verified_ahead
            assert draft.num_copies == 0
            assert draft.engine.pages.num_used == 1  # the graphs' padding row's, for good


@pytest.mark.gpu
@pytest.mark.parametrize("k", [3, 6])
def test_on_cuda_verify_passes_launched_ahead_write_the_models_greedy_text(
        k, prompt_ids, cut_draft) -> None:
    """At batch 1 nearly every verify pass is launched from the device's verdict before the
    host reads it (VerifyAhead): its inputs, positions and page arrays computed there. Every
    token it keeps must still be the target's greedy choice after the text before it, the
    bookkeeping must agree with itself every step, and every page must come back, also after a
    request that ends at an end-of-sequence token while a pass is launched for it."""
    from minisgl.engine.config import EngineConfig
    from minisgl.engine.engine import Engine

    scheduler = Scheduler(SchedulerConfig(SHAKESPEARE_DIR, device="cuda", dtype="bfloat16",
                                          num_pages=4096, max_running_reqs=8, overlap=False,
                                          speculative=f"draft={cut_draft},k={k}"))
    speculator = scheduler.speculator
    assert speculator.ahead is not None
    scorer = Engine(EngineConfig(SHAKESPEARE_DIR, device="cuda", dtype="bfloat16",
                                 num_pages=1024, max_running_reqs=8, cuda_graph=False))
    for i, ids in enumerate(prompt_ids[:3]):
        req = Req(i, ids, SamplingParams(max_tokens=60 + 7 * i, ignore_eos=i != 2))
        before = (scheduler.num_steps, speculator.rounds_verified_ahead)
        scheduler.add(req)
        while scheduler.has_work:
            scheduler.step()
            scheduler.check_integrity()
        rounds = scheduler.num_steps - before[0] - 1  # the prefill, then rounds
        assert speculator.rounds_verified_ahead - before[1] >= rounds // 2, (rounds, i)
        slack = greedy_slack(scorer, req.prompt_ids, req.output_ids)
        assert max(slack) <= 1.0, (i, [round(x, 2) for x in slack])
        assert scheduler.cache.pages_in_use == 0
    assert 0 < speculator.num_accepted < speculator.num_proposed


@pytest.mark.parametrize("device", [pytest.param("cpu"),
                                    pytest.param("cuda", marks=pytest.mark.gpu)])
def test_each_rounds_guesses_are_the_drafts_greedy_continuation_of_the_confirmed_text(
        device, prompt_ids, cut_draft) -> None:
    """Exactness alone cannot see a draft that guesses from the wrong text: the target rejects
    its guesses and decodes on, only slower. So every round's guesses are scored here by the
    draft itself, in one eager prefill over the request's confirmed tokens and the guesses:
    each must be the draft's greedy choice after the text before it (within bfloat16's
    rounding on a GPU). Partial acceptance happens in most rounds (a two-layer draft), so the
    copies are cut back, and on a GPU most rounds are launched ahead from the verdict."""
    from minisgl.engine.config import EngineConfig
    from minisgl.engine.engine import Engine

    dtype = "bfloat16" if device == "cuda" else "float32"
    scheduler = Scheduler(SchedulerConfig(SHAKESPEARE_DIR, device=device, dtype=dtype,
                                          num_pages=4096, max_running_reqs=8, overlap=False,
                                          speculative=f"draft={cut_draft},k=4"))
    rounds: list[tuple[list[list[int]], torch.Tensor, list[int]]] = []
    propose = scheduler.speculator.propose

    def recorded(reqs):
        guesses = propose(reqs)  # a copy on the device, in stream order: no wait, no race
        rounds.append(([list(r.token_ids) for r in reqs], guesses.tokens.clone(),
                       list(guesses.counts)))
        return guesses

    scheduler.speculator.propose = recorded
    reqs = fresh(prompt_ids, mixed_params(len(prompt_ids)))
    for req in reqs:
        scheduler.add(req)
    while scheduler.has_work:
        scheduler.step()
    speculator = scheduler.speculator
    assert 0 < speculator.num_accepted < speculator.num_proposed
    if device == "cuda":
        assert speculator.draft.rounds_ahead > scheduler.num_steps // 2
    scorer = Engine(EngineConfig(cut_draft, device=device, dtype=dtype, num_pages=1024,
                                 max_running_reqs=8, cuda_graph=False))
    scored = 0
    for confirmed, tokens, counts in rounds:
        for text, row, count in zip(confirmed, tokens.tolist(), counts):
            if count:
                slack = greedy_slack(scorer, text, row[:count])
                assert max(slack) <= 1.0, (len(text), row[:count], [round(x, 2) for x in slack])
                scored += 1
    assert scored >= 20


# --------------------------------------------------------------------------- through the server
def test_the_server_speculates_with_the_same_greedy_answers(
        shakespeare_server, cut_draft, tmp_path) -> None:
    """``--speculative`` through the openai client, whole and streamed: the same text as the
    server that decodes one token a step, and ``/metrics`` counts the guesses."""
    import httpx
    import openai
    from server_process import ServerProcess, parse_metrics

    def answers(url: str) -> list[str]:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        out = []
        for prompt in PROMPTS[:4]:
            out.append(client.completions.create(model="m", prompt=prompt, max_tokens=24,
                                                 temperature=0).choices[0].text)
            stream = client.completions.create(model="m", prompt=prompt, max_tokens=24,
                                               temperature=0, stream=True)
            out.append("".join(chunk.choices[0].text for chunk in stream if chunk.choices))
        return out

    expected = answers(shakespeare_server.url)
    with ServerProcess(SHAKESPEARE_DIR, device="cpu", log_path=tmp_path / "server.log",
                       args=("--served-model-name", "m",
                             "--speculative", f"draft={cut_draft},k=3")) as spec:
        assert answers(spec.url) == expected
        metrics = parse_metrics(httpx.get(spec.url + "/metrics").text)
    proposed = metrics["minisgl_spec_proposed_tokens_total"]
    accepted = metrics["minisgl_spec_accepted_tokens_total"]
    assert 0 < accepted < proposed, metrics


def test_the_speedup_benchmark_compares_each_proposer_with_plain_decoding(repo_script) -> None:
    """benchmark/speculative.py's plumbing on the CPU: every row's tokens equal plain
    decoding's (its speedups mean something only on a GPU, with a target worth speeding up)."""
    bench = repo_script("benchmark/speculative.py")
    table = bench.main(["--model", str(SHAKESPEARE_DIR), "--device", "cpu", "--batch-sizes",
                        "1", "3", "--max-tokens", "12", "--repeats", "1", "--warmup", "0",
                        "--speculative",
                        f"draft={SHAKESPEARE_DIR},k=3", "ngram"])
    assert set(table) == {"plain", f"draft={SHAKESPEARE_DIR},k=3", "ngram"}
    for setting in ("ngram", f"draft={SHAKESPEARE_DIR},k=3"):
        assert all(row["agreeing_share"] == 1.0 for row in table[setting].values())
    assert all(row["kept"] == 1.0 for row in table[f"draft={SHAKESPEARE_DIR},k=3"].values())
    for setting in ("ngram", f"draft={SHAKESPEARE_DIR},k=3"):  # guessing is part of a round
        assert all(0 < row["guess_ms"] < row["round_ms"] for row in table[setting].values())
    batches = bench.batches_of(3, 20)  # batch 1 measures every prompt, not the first alone
    assert [len(b) for b in batches] == [3] * 7
    given = sum(batches, [])
    assert given[:20] == bench.held_out_prompts(20) and len(set(given)) == 20
    assert bench.agreeing_share([[1, 2, 3], [4, 5]], [[1, 2, 9], [4, 5]]) == 4 / 5
    assert bench.agreeing_share([[7, 2, 3]], [[1, 2, 3]]) == 0.0
