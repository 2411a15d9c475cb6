"""Chapter 4: sampling parameters, the batched sampler and the one-sequence generation loop.

The sampler tests run on random logits and need no model. The generation tests load the tiny
model and compare greedy decoding, with and without the KV cache, token for token against
``transformers``.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from minisgl.core import SamplingParams
from minisgl.engine import sample as sample_module
from minisgl.engine.sample import (
    SamplingTensors,
    compute_probs,
    filter_probs,
    make_generator,
    sample_batch,
)
from minisgl.models.base import BaseLLMModel

VOCAB = 64


def random_logits(rows: int, vocab: int = VOCAB, scale: float = 3.0, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=generator) * scale


def nucleus_reference(probs: list[float], top_p: float) -> tuple[set[int], float]:
    """The nucleus of one row computed independently, in float64 Python: the smallest set of
    most likely tokens whose mass reaches top_p. Also returns how far top_p is from the
    nearest cumulative sum, so a test can refuse a case that rounding could flip."""
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    nucleus: set[int] = set()
    mass = 0.0
    margin = math.inf
    for token in order:
        nucleus.add(token)
        mass += probs[token]
        margin = min(margin, abs(mass - top_p))
        if mass >= top_p:
            break
    return nucleus, margin


def draw_many(logits: torch.Tensor, params: SamplingParams, draws: int) -> torch.Tensor:
    """``draws`` samples for each row of ``logits``, drawn in one batched call: [draws, B]."""
    rows = logits.shape[0]
    batch = logits.repeat(draws, 1)
    tokens = sample_batch(batch, [params] * (rows * draws))
    return tokens.view(draws, rows)


# --------------------------------------------------------------------------------------------
# SamplingParams validation
# --------------------------------------------------------------------------------------------


def test_defaults_are_greedy_and_valid() -> None:
    params = SamplingParams()
    assert params.is_greedy
    assert (params.top_k, params.top_p, params.min_p) == (-1, 1.0, 0.0)
    assert params.stop_token_ids == () and params.seed is None


def test_top_k_1_counts_as_greedy_at_any_temperature() -> None:
    assert SamplingParams(temperature=5.0, top_k=1).is_greedy
    assert not SamplingParams(temperature=5.0, top_k=2).is_greedy


def test_stop_token_ids_are_stored_as_a_tuple() -> None:
    assert SamplingParams(stop_token_ids=[3, 7]).stop_token_ids == (3, 7)


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("temperature", -0.5, ValueError),
        ("temperature", float("nan"), ValueError),
        ("temperature", float("inf"), ValueError),
        ("temperature", "0.7", TypeError),
        ("temperature", True, TypeError),
        ("top_k", 0, ValueError),
        ("top_k", -2, ValueError),
        ("top_k", 2.5, TypeError),
        ("top_k", True, TypeError),
        ("top_p", 0.0, ValueError),
        ("top_p", 1.5, ValueError),
        ("top_p", -0.1, ValueError),
        ("top_p", float("nan"), ValueError),
        ("top_p", None, TypeError),
        ("min_p", -0.1, ValueError),
        ("min_p", 1.01, ValueError),
        ("min_p", "0", TypeError),
        ("max_tokens", 0, ValueError),
        ("max_tokens", -5, ValueError),
        ("max_tokens", 3.0, TypeError),
        ("max_tokens", True, TypeError),
        ("ignore_eos", 1, TypeError),
        ("stop_token_ids", [1, -1], ValueError),
        ("stop_token_ids", [1, "2"], ValueError),
        ("stop_token_ids", "12", TypeError),
        ("stop_token_ids", 5, TypeError),
        ("seed", -1, ValueError),
        ("seed", 2**64, ValueError),
        ("seed", 1.0, TypeError),
        ("seed", "42", TypeError),
    ],
)
def test_invalid_parameter_is_rejected_with_a_clear_message(
    field: str, value: object, error: type[Exception]
) -> None:
    with pytest.raises(error) as excinfo:
        SamplingParams(**{field: value})
    message = str(excinfo.value)
    assert field in message, f"the message should name the field: {message!r}"
    assert repr(value) in message, f"the message should show the bad value: {message!r}"


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("temperature", -1.0, ">= 0"),
        ("top_k", 0, ">= 1"),
        ("top_p", 0.0, "(0, 1]"),
        ("min_p", 2.0, "[0, 1]"),
        ("max_tokens", 0, ">= 1"),
    ],
)
def test_value_error_states_the_allowed_range(field: str, value: object, allowed: str) -> None:
    with pytest.raises(ValueError, match=re.escape(allowed)):
        SamplingParams(**{field: value})


def test_boundary_values_are_accepted() -> None:
    SamplingParams(temperature=0.0, top_k=1, top_p=1.0, min_p=1.0, max_tokens=1, seed=0)
    SamplingParams(top_p=1e-6, min_p=0.0, seed=2**64 - 1, stop_token_ids=(0,))


# --------------------------------------------------------------------------------------------
# The sampler
# --------------------------------------------------------------------------------------------


def test_greedy_rows_take_the_argmax() -> None:
    logits = random_logits(8)
    tokens = sample_batch(logits, [SamplingParams()] * 8)
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_all_greedy_batch_never_computes_a_softmax(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("greedy rows must not compute a softmax")

    monkeypatch.setattr(sample_module, "temperature_softmax", forbidden)
    logits = random_logits(4)
    params = [SamplingParams(), SamplingParams(temperature=3.0, top_k=1)] * 2
    assert torch.equal(sample_batch(logits, params), logits.argmax(dim=-1))


def test_top_k_1_is_greedy_even_at_high_temperature() -> None:
    logits = random_logits(16, scale=0.5)  # a flat distribution: sampling would wander
    params = SamplingParams(temperature=10.0, top_k=1, seed=1)
    assert torch.equal(sample_batch(logits, [params] * 16), logits.argmax(dim=-1))
    # The filter itself, not only the is_greedy shortcut, leaves a one-hot at the argmax.
    args = SamplingTensors.from_params([params] * 16, VOCAB, logits.device)
    probs = filter_probs(torch.softmax(logits / 10.0, dim=-1), args)
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), VOCAB).float())


def test_the_filters_to_run_are_chosen_from_the_parameters() -> None:
    """Which filters run is read off the SamplingParams on the host (asking the tensors would
    make a GPU host wait); skipping the ones no row asked for changes nothing."""
    def tensors(*params: SamplingParams) -> SamplingTensors:
        return SamplingTensors.from_params(params, VOCAB, torch.device("cpu"))

    plain = tensors(SamplingParams(temperature=1.0), SamplingParams(temperature=0.5))
    assert (plain.needs_sort, plain.needs_min_p) == (False, False)
    assert tensors(SamplingParams(temperature=1.0, top_k=VOCAB + 5)).needs_sort is False, \
        "a top_k of the whole vocabulary keeps everything: no sort"
    assert tensors(SamplingParams(temperature=1.0, top_k=5)).needs_sort
    assert tensors(SamplingParams(temperature=1.0, top_p=0.9)).needs_sort
    assert tensors(SamplingParams(temperature=1.0, min_p=0.1)).needs_min_p
    probs = torch.softmax(random_logits(2), dim=-1)
    forced = SamplingTensors(plain.temperatures, plain.top_k, plain.top_p, plain.min_p)
    assert forced.needs_sort and forced.needs_min_p, "built by hand, every filter runs"
    assert torch.equal(filter_probs(probs, plain), filter_probs(probs, forced))


def test_temperature_alone_gives_the_scaled_softmax() -> None:
    logits = random_logits(3)
    params = [SamplingParams(temperature=t) for t in (0.5, 1.0, 2.0)]
    expected = torch.stack(
        [torch.softmax(logits[i] / t, -1) for i, t in enumerate((0.5, 1.0, 2.0))]
    )
    torch.testing.assert_close(compute_probs(logits, params), expected)


def test_compute_probs_rows_sum_to_one_with_zeros_where_filtered() -> None:
    logits = random_logits(5)
    params = [
        SamplingParams(),
        SamplingParams(temperature=1.0, top_k=7),
        SamplingParams(temperature=0.8, top_p=0.6),
        SamplingParams(temperature=1.2, min_p=0.1),
        SamplingParams(temperature=1.0, top_k=20, top_p=0.9, min_p=0.05),
    ]
    probs = compute_probs(logits, params)
    torch.testing.assert_close(probs.sum(-1), torch.ones(5))
    assert int((probs[0] > 0).sum()) == 1, "a greedy row is one-hot"
    assert int((probs[1] > 0).sum()) == 7, "top_k=7 keeps exactly 7 tokens"
    assert bool((probs[:, :].argmax(-1) == logits.argmax(-1)).all()), "the best token survives"


def test_same_seed_gives_the_same_tokens_and_another_seed_differs() -> None:
    logits = random_logits(1, scale=1.0)
    params = SamplingParams(temperature=1.0, seed=1234)

    def run(seed: int) -> list[int]:
        generator = make_generator(seed, "cpu")
        return [int(sample_batch(logits, [params], [generator])) for _ in range(40)]

    assert run(1234) == run(1234)
    assert run(1234) != run(4321), "two seeds drew the same 40 tokens from a flat distribution"


def test_seed_without_explicit_generator_is_reproducible() -> None:
    logits = random_logits(6, scale=1.0)
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(6)]
    assert torch.equal(sample_batch(logits, params), sample_batch(logits, params))


def test_seeded_row_does_not_depend_on_the_rest_of_the_batch() -> None:
    logits = random_logits(4, scale=1.0)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=77)
    alone_generator = make_generator(77, "cpu")
    alone = [int(sample_batch(logits[2:3], [seeded], [alone_generator])) for _ in range(8)]

    # The same row at position 2, among greedy, unseeded and other seeded rows.
    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(),
        seeded,
        SamplingParams(temperature=2.0, top_k=5, seed=5),
    ]
    generators = [None, None, make_generator(77, "cpu"), make_generator(5, "cpu")]
    in_batch = [int(sample_batch(logits, params, generators)[2]) for _ in range(8)]
    assert in_batch == alone, "a seeded row drew different tokens once other rows joined it"


def test_per_row_parameters_in_one_batch_behave_like_each_row_alone() -> None:
    logits = random_logits(6)
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.7, seed=1),
        SamplingParams(temperature=1.0, top_k=4, seed=2),
        SamplingParams(temperature=1.3, top_p=0.7, seed=3),
        SamplingParams(temperature=1.0, min_p=0.2, seed=4),
        SamplingParams(temperature=0.9, top_k=10, top_p=0.8, min_p=0.05, seed=5),
    ]
    batch_probs = compute_probs(logits, params)
    batch_tokens = sample_batch(logits, params)
    for row, p in enumerate(params):
        torch.testing.assert_close(batch_probs[row], compute_probs(logits[row : row + 1], [p])[0])
        assert int(batch_tokens[row]) == int(sample_batch(logits[row : row + 1], [p])[0])


def test_top_p_never_draws_outside_the_nucleus() -> None:
    logits = random_logits(4, scale=2.0, seed=3)
    for top_p in (0.3, 0.6, 0.9):
        params = SamplingParams(temperature=1.0, top_p=top_p)
        probs = torch.softmax(logits.double(), dim=-1)
        tokens = draw_many(logits, params, draws=500)
        for row in range(logits.shape[0]):
            nucleus, margin = nucleus_reference(probs[row].tolist(), top_p)
            assert margin > 1e-4, "test case too close to a rounding boundary; pick other logits"
            drawn = set(tokens[:, row].tolist())
            assert drawn <= nucleus, f"top_p={top_p}: drew {sorted(drawn - nucleus)} outside"
            support = set(
                torch.nonzero(compute_probs(logits[row : row + 1], [params])[0]).flatten().tolist()
            )
            assert support == nucleus, (
                f"top_p={top_p}: kept {sorted(support)}, nucleus {sorted(nucleus)}"
            )


def test_top_p_always_keeps_the_top_token() -> None:
    logits = random_logits(8, scale=5.0)
    params = SamplingParams(temperature=1.0, top_p=1e-6)
    assert torch.equal(draw_many(logits, params, draws=20), logits.argmax(-1).expand(20, 8))


def test_top_k_draws_only_from_the_k_best() -> None:
    logits = random_logits(4, scale=1.0)
    for k in (1, 3, 10):
        tokens = draw_many(logits, SamplingParams(temperature=1.5, top_k=k), draws=400)
        best = logits.topk(k, dim=-1).indices
        for row in range(4):
            drawn = set(tokens[:, row].tolist())
            assert drawn <= set(best[row].tolist()), f"top_k={k} drew outside the {k} best"
        if k > 1:
            assert len(set(tokens[:, 0].tolist())) > 1, "top_k > 1 should not always draw one token"


def test_top_k_then_top_p_uses_the_mass_that_top_k_left() -> None:
    # Probabilities 0.4, 0.3, 0.2, 0.1: top_k=2 leaves 0.4 and 0.3, that is 4/7 = 0.571 and
    # 3/7 of the remaining mass. top_p=0.6 needs both; top_p=0.5 is reached by the first
    # alone. (On the unfiltered probabilities top_p=0.5 would have kept two tokens.)
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    probs = compute_probs(logits, [SamplingParams(temperature=1.0, top_k=2, top_p=0.6)])
    torch.testing.assert_close(probs, torch.tensor([[4 / 7, 3 / 7, 0.0, 0.0]]))
    probs = compute_probs(logits, [SamplingParams(temperature=1.0, top_k=2, top_p=0.5)])
    torch.testing.assert_close(probs, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_min_p_keeps_tokens_relative_to_the_most_likely_one() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08], [0.25, 0.25, 0.25, 0.25]]))
    params = SamplingParams(temperature=1.0, min_p=0.2)  # thresholds 0.1 and 0.05
    probs = compute_probs(logits, [params, params])
    assert (probs[0] > 0).tolist() == [True, True, True, False]
    assert (probs[1] > 0).tolist() == [True, True, True, True], "a flat row keeps everything"
    tokens = draw_many(logits, params, draws=300)
    assert 3 not in set(tokens[:, 0].tolist())


def test_sampling_frequencies_match_the_filtered_distribution() -> None:
    # The exponential race must be an exact sampler, not just stay in the support.
    logits = random_logits(1, vocab=8, scale=1.0, seed=5)
    params = SamplingParams(temperature=1.0, top_k=6)  # unseeded: rows draw independently
    torch.manual_seed(11)
    expected = compute_probs(logits, [params])[0]
    draws = 20_000
    tokens = sample_batch(logits.expand(draws, 8), [params] * draws)
    observed = torch.bincount(tokens, minlength=8).float() / draws
    assert float((observed - expected).abs().max()) < 0.02, f"{observed} vs {expected}"


def test_batch_size_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="2 SamplingParams for 3 rows"):
        sample_batch(random_logits(3), [SamplingParams()] * 2)


# --------------------------------------------------------------------------------------------
# The contiguous KV cache as an attention backend
# --------------------------------------------------------------------------------------------


def test_contiguous_cache_step_by_step_equals_dense_attention_over_everything() -> None:
    from minisgl.engine.simple_loop import ContiguousKVCache
    from minisgl.layers.attention import DenseCausalAttention

    generator = torch.Generator().manual_seed(0)
    seq, hq, hkv, dim, layers = 9, 4, 2, 16, 2
    q, k, v = (torch.randn(layers, seq, h, dim, generator=generator) for h in (hq, hkv, hkv))
    cache = ContiguousKVCache(layers, hkv, dim, max_len=seq, dtype=torch.float32, device="cpu")
    outputs = []
    for start, end in [(0, 5), (5, 6), (6, 7), (7, 9)]:  # a prefill, two decodes, a 2-token step
        outputs.append(
            torch.stack(
                [
                    cache.forward(q[i, start:end], k[i, start:end], v[i, start:end], layer_id=i)
                    for i in range(layers)
                ]
            )
        )
        cache.advance(end - start)
    stepwise = torch.cat(outputs, dim=1)
    dense = torch.stack(
        [DenseCausalAttention().forward(q[i], k[i], v[i], i) for i in range(layers)]
    )
    torch.testing.assert_close(stepwise, dense)


def test_contiguous_cache_refuses_to_overflow() -> None:
    from minisgl.engine.simple_loop import ContiguousKVCache

    cache = ContiguousKVCache(1, 1, 8, max_len=3, dtype=torch.float32, device="cpu")
    q = k = v = torch.zeros(4, 1, 8)
    with pytest.raises(ValueError, match="holds 3 tokens"):
        cache.forward(q, k, v, layer_id=0)


# --------------------------------------------------------------------------------------------
# The generation loop on the tiny model, against transformers
# --------------------------------------------------------------------------------------------

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "Hello! How are you today?",
    "东京是日本的首都",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox jumps over the lazy dog.",
    "a",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: Any) -> list[list[int]]:
    return [tokenizer.encode(prompt) for prompt in PROMPTS]


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> BaseLLMModel:
    from minisgl.models import load_model

    return load_model(tiny_model_dir, device="cpu", dtype="float32", progress=False)


@pytest.fixture(scope="module")
def reference_greedy(tiny_model_dir: Path, prompt_ids: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuation of every prompt, EOS disabled so all run 32 tokens."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    config = GenerationConfig(
        # [], not None: None falls back to the checkpoint's generation_config.json
        max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[], pad_token_id=0
    )
    outputs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            input_ids = torch.tensor([ids])
            out = hf_model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
            )
            outputs.append(out[0, len(ids) :].tolist())
    return outputs


@pytest.mark.parametrize("use_cache", [True, False], ids=["kv_cache", "no_cache"])
def test_greedy_generation_matches_transformers(
    model, prompt_ids, reference_greedy, use_cache: bool
) -> None:
    from minisgl.engine.simple_loop import generate

    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    assert len({tuple(r) for r in reference_greedy}) == len(PROMPTS), "prompts should differ"
    for prompt, ids, expected in zip(PROMPTS, prompt_ids, reference_greedy, strict=True):
        result = generate(model, ids, params, use_cache=use_cache)
        assert result.token_ids == expected, f"prompt {prompt!r}: tokens differ from transformers"
        assert result.finish_reason == "length"


def test_seeded_sampling_is_the_same_with_and_without_the_cache(
    model: BaseLLMModel, prompt_ids: list[list[int]]
) -> None:
    from minisgl.engine.simple_loop import generate

    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, ignore_eos=True, seed=7)
    cached = generate(model, prompt_ids[0], params, use_cache=True)
    uncached = generate(model, prompt_ids[0], params, use_cache=False)
    assert cached.token_ids == uncached.token_ids


def test_seeded_generation_repeats_and_another_seed_differs(
    model: BaseLLMModel, prompt_ids: list[list[int]]
) -> None:
    from minisgl.engine.simple_loop import generate

    def run(seed: int) -> list[int]:
        params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=seed)
        return generate(model, prompt_ids[1], params).token_ids

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_sampled_generation_steps_through_the_random_stream(
    model: BaseLLMModel, prompt_ids: list[list[int]]
) -> None:
    # One generator per request, advanced each step: a flat distribution must not produce
    # the same token at every step the way re-seeding each step would.
    from minisgl.engine.simple_loop import generate

    params = SamplingParams(temperature=2.0, max_tokens=16, ignore_eos=True, seed=0)
    assert len(set(generate(model, prompt_ids[0], params).token_ids)) > 4


def test_max_tokens_finishes_with_length(
    model: BaseLLMModel, prompt_ids: list[list[int]], reference_greedy: list[list[int]]
) -> None:
    from minisgl.engine.simple_loop import generate

    result = generate(model, prompt_ids[0], SamplingParams(max_tokens=5, ignore_eos=True))
    assert result.token_ids == reference_greedy[0][:5]
    assert result.finish_reason == "length"


def test_eos_finishes_with_stop_and_is_included(
    model: BaseLLMModel, prompt_ids: list[list[int]], reference_greedy: list[list[int]]
) -> None:
    from minisgl.engine.simple_loop import generate

    expected = reference_greedy[2]
    eos = expected[6]
    cut = expected.index(eos) + 1  # the first time the "EOS" appears
    result = generate(model, prompt_ids[2], SamplingParams(max_tokens=32), eos_token_ids=[eos])
    assert result.token_ids == expected[:cut]
    assert result.finish_reason == "stop"


def test_ignore_eos_keeps_generating(
    model: BaseLLMModel, prompt_ids: list[list[int]], reference_greedy: list[list[int]]
) -> None:
    from minisgl.engine.simple_loop import generate

    eos = reference_greedy[2][0]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    result = generate(model, prompt_ids[2], params, eos_token_ids=[eos])
    assert result.token_ids == reference_greedy[2][:10]
    assert result.finish_reason == "length"


def test_stop_token_ids_finish_with_stop_even_when_eos_is_ignored(
    model: BaseLLMModel, prompt_ids: list[list[int]], reference_greedy: list[list[int]]
) -> None:
    from minisgl.engine.simple_loop import generate

    expected = reference_greedy[3]
    stop = expected[4]
    cut = expected.index(stop) + 1
    params = SamplingParams(max_tokens=32, ignore_eos=True, stop_token_ids=[stop])
    for use_cache in (True, False):
        result = generate(model, prompt_ids[3], params, use_cache=use_cache)
        assert result.token_ids == expected[:cut]
        assert result.finish_reason == "stop"


def test_default_eos_ids_come_from_the_model_config(
    model: BaseLLMModel, prompt_ids: list[list[int]], reference_greedy: list[list[int]]
) -> None:
    import dataclasses

    from minisgl.engine.simple_loop import generate

    expected = reference_greedy[4]
    original = model.config
    model.config = dataclasses.replace(original, eos_token_ids=(expected[3],))
    try:
        result = generate(model, prompt_ids[4], SamplingParams(max_tokens=32))
    finally:
        model.config = original
    assert result.token_ids == expected[: expected.index(expected[3]) + 1]
    assert result.finish_reason == "stop"


def test_empty_prompt_is_rejected(model: BaseLLMModel) -> None:
    from minisgl.engine.simple_loop import generate

    with pytest.raises(ValueError, match="prompt_ids is empty"):
        generate(model, [], SamplingParams())


def test_too_long_a_request_is_rejected(model: BaseLLMModel) -> None:
    from minisgl.engine.simple_loop import generate

    limit = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"the model has {limit}"):
        generate(model, [1, 2, 3], SamplingParams(max_tokens=limit))


# --------------------------------------------------------------------------------------------
# On a GPU, in bfloat16
# --------------------------------------------------------------------------------------------

# bf16 keeps 8 bits of mantissa: a logit of 9 is stored to within 0.03, and four layers of
# rounding add up. transformers' own bf16 logits differ from its float32 ones by up to about
# 3% of the largest logit on the tiny model, so that is the scale of disagreement to allow.
BF16_RELATIVE_TOLERANCE = 0.04  # times the largest |logit| of the sequence


@pytest.mark.gpu
def test_greedy_with_cache_on_cuda_bf16_follows_transformers(
    tiny_model_dir: Path, prompt_ids: list[list[int]]
) -> None:
    """In bf16 two correct implementations round differently, so a near-tie may break either
    way and the sequences may part. Instead of identical tokens this demands, per prompt:
    our prompt logits agree with transformers' within the tolerance, and every token we pick
    is within the tolerance of transformers' best logit at that step (transformers scoring the
    sequence we generated), and most picks are exactly its argmax."""
    from transformers import AutoModelForCausalLM

    from minisgl.engine.simple_loop import generate
    from minisgl.models import load_model

    model = load_model(tiny_model_dir, device="cuda", dtype="bfloat16", progress=False)
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    hf_model = hf_model.to("cuda").eval()
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    with torch.inference_mode():
        for prompt, ids in zip(PROMPTS, prompt_ids, strict=True):
            generated = generate(model, ids, params).token_ids
            sequence = torch.tensor([ids + generated], device="cuda")
            reference = hf_model(sequence).logits[0].float()  # [len, vocab]
            tolerance = BF16_RELATIVE_TOLERANCE * float(reference.abs().max())
            ours = model(sequence[0], torch.arange(sequence.shape[1], device="cuda"))
            error = float((ours - reference).abs().max())
            assert error < tolerance, f"{prompt!r}: logits differ by {error:.3f} > {tolerance:.3f}"

            steps = reference[len(ids) - 1 : -1]  # the logits that chose each generated token
            chosen = steps.gather(1, torch.tensor(generated, device="cuda")[:, None])[:, 0]
            gap = steps.max(dim=-1).values - chosen
            assert float(gap.max()) < tolerance, (
                f"{prompt!r}: picked a token {float(gap.max()):.3f} below transformers' best"
            )
            exact = int((gap == 0).sum())
            assert exact >= 0.75 * NEW_TOKENS, f"{prompt!r}: only {exact} picks are the argmax"
