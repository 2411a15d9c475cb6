"""The sampling API of chapter 21: logit_bias, min_tokens and the repetition, frequency and
presence penalties; logprobs, echo and n.

Against ``transformers`` where it has the same rule (``repetition_penalty``, ``sequence_bias``,
``min_new_tokens``), greedy, token for token; against a dense greedy loop over the
``transformers`` model for OpenAI's frequency and presence penalties, which it lacks. With and
without overlap scheduling (a token in flight is counted) and through a radix-cache hit (a
cached prompt is still penalized). Repository-level until chapter 21 is written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from minisgl.core import SamplingParams

from conftest import ROOT, decode_without_waiting

MAX_TOKENS = 24
PROMPTS = ["ROMEO: O", "JULIET:\nWhat light", "First Citizen:\nBefore we proceed"]


@pytest.fixture(scope="module")
def shakespeare_model_dir() -> Path:
    """The trained tiny model: its greedy text repeats and ends, so each rule shows."""
    path = ROOT / "models" / "tiny-shakespeare"
    assert (path / "model.safetensors").exists(), f"{path} is missing"
    return path


@pytest.fixture(scope="module")
def hf(shakespeare_model_dir: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(shakespeare_model_dir,
                                                              dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(shakespeare_model_dir)
    return model.eval(), tokenizer


def ours(model_dir: Path, params: SamplingParams, overlap: bool,
         prompts: list[str] = PROMPTS, repeat: int = 1, device: str = "cpu") -> list[list[int]]:
    from minisgl.llm import LLM

    llm = LLM(model_dir, device=device, dtype="float32", overlap=overlap, prefix_cache="radix")
    for _ in range(repeat):  # a second round reads every prompt from the radix cache
        outputs = llm.generate(prompts, params)
    return [out["token_ids"] for out in outputs]


def hf_greedy(hf: Any, prompt: str, **options: Any) -> list[int]:
    model, tokenizer = hf
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model.device)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, **options)
    return out[0, ids.shape[1]:].tolist()


def test_parameters_are_checked_at_the_edge() -> None:
    assert SamplingParams(logit_bias={7: 2, 3: -100}).logit_bias == ((3, -100.0), (7, 2.0))
    assert not SamplingParams().adjusts_logits
    assert SamplingParams(presence_penalty=0.5).adjusts_logits
    for bad, field in [({"logit_bias": {1: 101}}, "logit_bias"),
                       ({"logit_bias": {-1: 0}}, "logit_bias"),
                       ({"min_tokens": -1}, "min_tokens"),
                       ({"repetition_penalty": 0.0}, "repetition_penalty"),
                       ({"frequency_penalty": 2.5}, "frequency_penalty"),
                       ({"presence_penalty": float("nan")}, "presence_penalty")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**bad)


@pytest.mark.parametrize("overlap", [False, True])
def test_repetition_penalty_and_logit_bias_match_transformers(
        shakespeare_model_dir: Path, hf: Any, overlap: bool) -> None:
    the = hf[1].encode(" the")[0]
    cases = [({"repetition_penalty": 1.5}, {"repetition_penalty": 1.5}),
             ({"logit_bias": {the: 6.0}}, {"sequence_bias": {(the,): 6.0}})]
    plain = ours(shakespeare_model_dir, SamplingParams(max_tokens=MAX_TOKENS), overlap)
    for options, hf_options in cases:
        got = ours(shakespeare_model_dir, SamplingParams(max_tokens=MAX_TOKENS, **options),
                   overlap, repeat=2)
        assert got != plain, f"{options} changed nothing: the test would not see it"
        for prompt, tokens in zip(PROMPTS, got):
            assert tokens == hf_greedy(hf, prompt, **hf_options), (options, prompt)


def test_min_tokens_bans_the_end_of_sequence_as_min_new_tokens_does(
        shakespeare_model_dir: Path, hf: Any) -> None:
    plain = ours(shakespeare_model_dir, SamplingParams(max_tokens=MAX_TOKENS), False)
    early = [i for i, tokens in enumerate(plain) if len(tokens) < 12]
    assert early, "some prompt must end early on its own, or min_tokens is not exercised"
    got = ours(shakespeare_model_dir, SamplingParams(max_tokens=MAX_TOKENS, min_tokens=12), True)
    for i, (prompt, tokens) in enumerate(zip(PROMPTS, got)):
        assert tokens == hf_greedy(hf, prompt, min_new_tokens=12), prompt
        assert len(tokens) >= 12 or i not in early


def dense_penalized_greedy(hf: Any, prompt: str, frequency: float, presence: float) -> list[int]:
    """OpenAI's rule, step by step over the whole sequence: logits - frequency * count -
    presence * (count > 0), counts over the tokens generated so far; then the argmax."""
    model, tokenizer = hf
    ids = tokenizer(prompt, return_tensors="pt").input_ids[0].tolist()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    out: list[int] = []
    for _ in range(MAX_TOKENS):
        with torch.no_grad():
            logits = model(torch.tensor([ids + out])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(out, dtype=torch.int64),
                                minlength=logits.shape[0]).float()
        token = int((logits - frequency * counts - presence * (counts > 0)).argmax())
        out.append(token)
        if token in eos:
            break
    return out


@pytest.mark.parametrize("overlap", [False, True])
def test_frequency_and_presence_penalties_match_a_dense_reference(
        shakespeare_model_dir: Path, hf: Any, overlap: bool) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, frequency_penalty=1.2, presence_penalty=0.7)
    got = ours(shakespeare_model_dir, params, overlap)
    assert got != ours(shakespeare_model_dir, SamplingParams(max_tokens=MAX_TOKENS), overlap)
    for prompt, tokens in zip(PROMPTS, got):
        assert tokens == dense_penalized_greedy(hf, prompt, 1.2, 0.7), prompt


def test_a_request_without_adjustments_is_untouched_in_a_mixed_batch(
        shakespeare_model_dir: Path) -> None:
    from minisgl.core import Req
    from minisgl.scheduler.config import SchedulerConfig
    from minisgl.scheduler.scheduler import Scheduler

    penalized = SamplingParams(max_tokens=MAX_TOKENS, repetition_penalty=1.5)
    plain = ours(shakespeare_model_dir, SamplingParams(max_tokens=MAX_TOKENS), True)
    alone = ours(shakespeare_model_dir, penalized, True)
    changed = next(i for i in range(len(PROMPTS)) if alone[i] != plain[i])
    other = (changed + 1) % len(PROMPTS)
    scheduler = Scheduler(SchedulerConfig(shakespeare_model_dir, device="cpu", dtype="float32"))
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(shakespeare_model_dir)
    reqs = [Req(0, tokenizer.encode(PROMPTS[other]), SamplingParams(max_tokens=MAX_TOKENS)),
            Req(1, tokenizer.encode(PROMPTS[changed]), penalized)]
    for req in reqs:
        scheduler.add(req)
    while scheduler.has_work:
        scheduler.step()
        scheduler.check_integrity()
    assert [req.output_ids for req in reqs] == [plain[other], alone[changed]]


def test_the_server_takes_the_fields_and_refuses_bad_values_naming_them() -> None:
    from minisgl.server.protocol import APIError, ChatCompletionRequest, CompletionRequest

    body = CompletionRequest(prompt="x", logit_bias={"5": 3, "7": -100}, presence_penalty=0.5,
                             frequency_penalty=-1, repetition_penalty=1.2, min_tokens=3)
    params = body.sampling_params(None, 16)
    assert (params.logit_bias, params.presence_penalty, params.frequency_penalty,
            params.repetition_penalty, params.min_tokens) == (((5, 3.0), (7, -100.0)), 0.5,
                                                              -1.0, 1.2, 3)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    assert not chat.sampling_params(None, 16).adjusts_logits
    for bad, param in [({"logit_bias": {"a": 1}}, "logit_bias"),
                       ({"logit_bias": {"5": 101}}, "logit_bias"),
                       ({"presence_penalty": 3}, "presence_penalty"),
                       ({"repetition_penalty": 0}, "repetition_penalty"),
                       ({"min_tokens": -1}, "min_tokens")]:
        with pytest.raises(APIError) as refused:
            CompletionRequest(prompt="x", **bad).sampling_params(None, 16)
        assert refused.value.status_code == 400 and refused.value.param == param


def served_logprobs(model_dir: Path, params: SamplingParams, overlap: bool,
                    prompts: list[list[int]], device: str = "cpu",
                    dtype: str = "float32") -> list[Any]:
    """Each request's output ids and logprobs, run through the scheduler as LLM does."""
    from minisgl.core import Req
    from minisgl.scheduler.config import SchedulerConfig
    from minisgl.scheduler.scheduler import Scheduler

    scheduler = Scheduler(SchedulerConfig(model_dir, device=device, dtype=dtype,
                                          overlap=overlap, prefix_cache="radix"))
    reqs = [Req(i, prompt, params) for i, prompt in enumerate(prompts)]
    for req in reqs:
        scheduler.add(req)
    while scheduler.has_work:
        scheduler.step()
    return reqs


@pytest.mark.parametrize("overlap", [False, True])
def test_logprobs_are_transformers_log_softmax_of_the_raw_logits(
        shakespeare_model_dir: Path, hf: Any, overlap: bool) -> None:
    """Sampled at temperature 1 with a bias and a penalty: the logprobs are still those of the
    model's own logits, token by token, and the top ones are its k best, best first."""
    model, tokenizer = hf
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS, logprobs=3,
                            repetition_penalty=1.3, logit_bias={tokenizer.encode(" the")[0]: 4})
    for req in served_logprobs(shakespeare_model_dir, params, overlap, prompts):
        assert len(req.output_logprobs) == len(req.output_ids) > 0
        with torch.no_grad():
            logits = model(torch.tensor([req.prompt_ids + req.output_ids])).logits[0].float()
        reference = torch.log_softmax(logits, dim=-1)[len(req.prompt_ids) - 1:-1]
        for step, (token, got) in enumerate(zip(req.output_ids, req.output_logprobs)):
            expected = reference[step]
            assert abs(got.logprob - float(expected[token])) < 1e-4, (req.uid, step)
            best = expected.topk(3)
            assert [t for t, _ in got.top] == best.indices.tolist(), (req.uid, step)
            assert max(abs(v - float(e)) for (_, v), e in zip(got.top, best.values)) < 1e-4


def test_logprobs_zero_gives_the_sampled_token_only_and_none_gives_nothing(
        shakespeare_model_dir: Path) -> None:
    prompt = [[5, 6, 7], [8, 9]]
    with_zero, without = (served_logprobs(
        shakespeare_model_dir, SamplingParams(max_tokens=5, logprobs=k), True, prompt)
        for k in (0, None))
    assert all(entry.top == () for req in with_zero for entry in req.output_logprobs)
    assert [len(req.output_logprobs) for req in with_zero] == [5, 5]
    assert all(req.output_logprobs == [] for req in without)
    assert [r.output_ids for r in with_zero] == [r.output_ids for r in without]


def test_logprobs_travel_to_the_api_server_as_text(shakespeare_model_dir: Path) -> None:
    """Scheduler -> detokenizer -> API server: every token's message carries its logprobs,
    through the wire format, and the detokenizer writes each token id as its text."""
    from minisgl.core import TokenLogprobs
    from minisgl.message import DetokenizeRequest, TextLogprobs, UserReply, dumps, loads
    from minisgl.message import UserRequest
    from minisgl.scheduler.config import SchedulerConfig
    from minisgl.scheduler.io import SchedulerIO
    from minisgl.scheduler.scheduler import Scheduler
    from minisgl.tokenizer.detokenize import DetokenizeManager

    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(shakespeare_model_dir)
    io = SchedulerIO(Scheduler(SchedulerConfig(shakespeare_model_dir, device="cpu")))
    params = SamplingParams(max_tokens=6, logprobs=2)
    io.receive([UserRequest(3, tokenizer.encode(PROMPTS[0]), params),
                UserRequest(4, tokenizer.encode(PROMPTS[1]), SamplingParams(max_tokens=6))])
    messages: list[DetokenizeRequest] = []
    while io.scheduler.has_work:
        messages += io.step()
    mine = [m for m in messages if m.uid == 3]
    assert all(m.logprobs is None for m in messages if m.uid == 4)
    assert all(isinstance(m.logprobs, TokenLogprobs) and len(m.logprobs.top) == 2 for m in mine)
    detokenizer = DetokenizeManager(tokenizer)
    replies = [loads(dumps(detokenizer.detokenize(loads(dumps(m))))) for m in mine]
    assert all(isinstance(r, UserReply) and isinstance(r.logprobs, TextLogprobs) for r in replies)
    for message, reply in zip(mine, replies):
        assert reply.logprobs.token == tokenizer.decode([message.next_token])
        assert reply.logprobs.logprob == message.logprobs.logprob
        assert [t for t, _ in reply.logprobs.top] == [tokenizer.decode([t])
                                                      for t, _ in message.logprobs.top]


@pytest.fixture(scope="module")
def server(shakespeare_server: Any) -> Any:
    return shakespeare_server


def test_the_openai_client_gets_logprobs_equal_to_transformers(server: Any, hf: Any) -> None:
    """Chat and completions, whole and streamed, through the openai client: each token's
    logprob is transformers' log-softmax at its place, and the streamed ones equal the
    whole ones."""
    openai = pytest.importorskip("openai")
    model, tokenizer = hf
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    whole = client.completions.create(model="m", prompt=PROMPTS[2], max_tokens=8,
                                      temperature=0, logprobs=2)
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == whole.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    ids = tokenizer.encode(PROMPTS[2])
    out = tokenizer.encode(whole.choices[0].text)
    with torch.no_grad():
        logits = model(torch.tensor([ids + out])).logits[0].float()
    reference = torch.log_softmax(logits, dim=-1)[len(ids) - 1:-1]
    assert len(out) == 8, "the text must re-encode to the tokens generated"
    for step, token in enumerate(out):
        assert abs(lp.token_logprobs[step] - float(reference[step, token])) < 1e-3
        assert max(lp.top_logprobs[step].values()) == pytest.approx(
            float(reference[step].max()), abs=1e-3)
    streamed = list(client.completions.create(model="m", prompt=PROMPTS[2], max_tokens=8,
                                              temperature=0, logprobs=2, stream=True))
    assert [t for c in streamed if c.choices and c.choices[0].logprobs
            for t in c.choices[0].logprobs.token_logprobs] == lp.token_logprobs
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Speak"}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 6 and all(len(entry.top_logprobs) == 3 for entry in content)
    assert all(entry.top_logprobs[0].logprob >= entry.logprob - 1e-6 for entry in content)
    assert all(bytes(entry.bytes).decode() == entry.token for entry in content)
    plain = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Speak"}], max_tokens=6,
        temperature=0)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == chat.choices[0].message.content


def test_the_cost_benchmark_times_every_configuration(tiny_model_dir: Path) -> None:
    from conftest import load_repo_script

    bench = load_repo_script("benchmark/sampler_cost.py")
    rows = bench.main(["--model", str(tiny_model_dir), "--device", "cpu", "--batch-sizes",
                       "1,3", "--max-tokens", "3", "--repeats", "1"])
    assert [(r["config"], r["batch_size"]) for r in rows] == [
        (name, b) for b in (1, 3) for name in bench.CONFIGS]
    assert all(r["ms_per_step"] > 0 for r in rows)
    assert [r["over_greedy_ms"] for r in rows if r["config"] == "greedy"] == [0.0, 0.0]


@pytest.mark.parametrize("chunk", [None, 5])
def test_prompt_logprobs_are_transformers_log_softmax_through_chunks_and_the_cache(
        shakespeare_model_dir: Path, hf: Any, chunk: int | None) -> None:
    """Every prompt token but the first, given the ones before it; the same through chunked
    prefill and for a prompt the radix cache holds (it is computed again, not reused)."""
    from minisgl.core import Req
    from minisgl.scheduler.config import SchedulerConfig
    from minisgl.scheduler.scheduler import Scheduler

    model, tokenizer = hf
    options = {} if chunk is None else {"chunked_prefill": True, "max_prefill_tokens": chunk}
    scheduler = Scheduler(SchedulerConfig(shakespeare_model_dir, device="cpu", dtype="float32",
                                          prefix_cache="radix", **options))
    prompt = tokenizer.encode(PROMPTS[2] + " and the rest")
    runs = []
    for uid in range(3):  # the first fills the cache; the others would hit it
        asks = uid != 1
        req = Req(uid, prompt, SamplingParams(max_tokens=2, prompt_logprobs=2 if asks else None))
        scheduler.add(req)
        while scheduler.has_work:
            scheduler.step()
        runs.append(req)
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    for req in (runs[0], runs[2]):
        assert len(req.prompt_logprobs) == len(prompt) - 1
        for position, got in enumerate(req.prompt_logprobs, start=1):
            expected = reference[position - 1]
            assert abs(got.logprob - float(expected[prompt[position]])) < 1e-4, position
            assert [t for t, _ in got.top] == expected.topk(2).indices.tolist()
    assert runs[1].prompt_logprobs == []


def test_echo_returns_the_prompt_and_its_logprobs_as_lm_eval_asks(server: Any, hf: Any) -> None:
    """lm-eval's loglikelihood request (token ids, max_tokens 1, logprobs 1, echo): the
    prompt comes back before the completion, its first token's logprob null, the others
    transformers' log-softmax; without logprobs only the text is echoed; streamed alike."""
    model, tokenizer = hf
    ids = tokenizer.encode(PROMPTS[2])
    body = {"model": "m", "prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 1,
            "echo": True, "seed": 1234}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    choice = answer["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None and len(lp["top_logprobs"][1]) == 1
    prompt_text = tokenizer.decode(ids)
    assert choice["text"].startswith(prompt_text) and len(choice["text"]) > len(prompt_text)
    assert lp["text_offset"][:2] == [0, len(lp["tokens"][0])]
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for position in range(1, len(ids)):
        expected = float(reference[position - 1, ids[position]])
        assert abs(lp["token_logprobs"][position] - expected) < 1e-3, position
    assert abs(lp["token_logprobs"][-1] - float(reference[-1].max())) < 1e-3  # greedy
    plain = httpx.post(f"{server.url}/v1/completions", json={**body, "logprobs": None},
                       timeout=60).json()["choices"][0]
    assert plain["logprobs"] is None and plain["text"] == choice["text"]
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True},
                      timeout=60) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    streamed = [e["choices"][0] for e in events if e["choices"]]
    assert "".join(c["text"] for c in streamed) == choice["text"]
    assert [v for c in streamed if c["logprobs"] for v in c["logprobs"]["token_logprobs"]] \
        == lp["token_logprobs"]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_prompt_is_shared_from_its_prefill_on(tiny_model_dir: Path, overlap: bool) -> None:
    """A request with a running request's prompt reuses its pages at once (its prefill
    computes one token), outputs are unchanged, and no page leaks or is counted twice."""
    from minisgl.core import Req
    from minisgl.scheduler.config import SchedulerConfig
    from minisgl.scheduler.scheduler import Scheduler

    def run(prompts: list[list[int]], gap: int) -> tuple[list[list[int]], list[int]]:
        scheduler = Scheduler(SchedulerConfig(tiny_model_dir, device="cpu", overlap=overlap,
                                              prefix_cache="radix", page_size=4))
        reqs = [Req(i, p, SamplingParams(max_tokens=12, ignore_eos=True))
                for i, p in enumerate(prompts)]
        computed = []
        scheduler.add(reqs[0])
        for step in range(200):
            if step == gap:
                for req in reqs[1:]:
                    scheduler.add(req)
            if not scheduler.has_work and step > gap:
                break
            result = scheduler.step()
            scheduler.check_integrity()
            if result.phase == "prefill":
                computed += list(result.new_lens)
        return [r.output_ids for r in reqs], computed

    prompt = list(range(3, 30))  # 27 tokens: 6 whole pages of 4, and 3 more
    shared, computed = run([prompt, prompt, prompt + [40, 41]], gap=3)
    assert computed[0] == len(prompt) and max(computed[1:]) <= 4 + 2, computed
    alone = [run([p], gap=0)[0][0] for p in (prompt, prompt + [40, 41])]
    assert shared == [alone[0], alone[0], alone[1]]
    # The same prompt twice at once (n choices): the second waits one step, then shares.
    twins, computed = run([prompt, prompt], gap=0)
    assert computed == [len(prompt), 3] and twins == [alone[0]] * 2
    # Prompts that only share a prefix run in one batch, each computing it; the second's
    # copies are freed when the first has cached it (check_integrity: nothing leaks).
    together, computed = run([prompt, prompt + [40, 41]], gap=0)
    assert computed == [len(prompt), len(prompt) + 2] and together == alone


@pytest.mark.parametrize("overlap", [False, True])
def test_n_choices_hold_the_prompt_pages_once(tiny_model_dir: Path, overlap: bool) -> None:
    """n=4 choices of one prompt, as the server submits them (four requests, seeds s..s+3):
    at their peak they hold the prompt's whole pages once and a tail of their own each, not
    four copies of everything; and they take two prefill steps, the prompt's and one for the
    three others, which only compute its last part."""
    from minisgl.core import Req
    from minisgl.scheduler.config import SchedulerConfig
    from minisgl.scheduler.scheduler import Scheduler

    prompt, page_size = list(range(3, 30)), 4  # 6 whole pages of 4, and 3 tokens more

    def peak_pages(n: int) -> tuple[int, list[list[int]]]:
        scheduler = Scheduler(SchedulerConfig(tiny_model_dir, device="cpu", overlap=overlap,
                                              prefix_cache="radix", page_size=page_size))
        for j in range(n):
            scheduler.add(Req(j, prompt, SamplingParams(max_tokens=8, ignore_eos=True,
                                                        temperature=1.0, seed=5 + j)))
        peak, prefills = 0, []
        while scheduler.has_work:
            result = scheduler.step()
            scheduler.check_integrity()
            peak = max(peak, scheduler.cache.num_pages - scheduler.cache.pages.num_free)
            if result.phase == "prefill":
                prefills.append(list(result.new_lens))
        return peak, prefills

    (one, _), (four, prefills) = peak_pages(1), peak_pages(4)
    whole = len(prompt) // page_size
    assert four <= whole + 4 * (one - whole) < 4 * one, (one, four)
    assert prefills == [[len(prompt)], [len(prompt) - whole * page_size] * 3], prefills


def test_n_choices_are_indexed_seeded_and_count_the_prompt_once(server: Any) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    ask = dict(model="m", prompt=[PROMPTS[0], PROMPTS[1]], n=3, max_tokens=8,
               temperature=1.0, seed=11)
    first, again = (client.completions.create(**ask) for _ in range(2))
    assert [c.index for c in first.choices] == list(range(6))
    assert [c.text for c in first.choices] == [c.text for c in again.choices], "seeded"
    assert len({c.text for c in first.choices[:3]}) > 1, "three choices, three streams"
    single = client.completions.create(**{**ask, "n": 1, "prompt": PROMPTS[0]})
    assert single.choices[0].text == first.choices[0].text  # choice 0 keeps the seed
    one_prompt = client.completions.create(**{**ask, "n": 1, "prompt": PROMPTS[1],
                                              "max_tokens": 1})
    assert first.usage.prompt_tokens == single.usage.prompt_tokens + \
        one_prompt.usage.prompt_tokens, "each prompt counted once"
    chunks = list(client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Speak"}], n=2, max_tokens=6,
        temperature=1.0, seed=3, stream=True))
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    whole = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Speak"}], n=2, max_tokens=6,
        temperature=1.0, seed=3)
    assert [c.message.content for c in whole.choices] == [texts[0], texts[1]]


# --------------------------------------------------------------------------------------------
# On a GPU: CUDA graphs, bfloat16, and a step that must not wait for the device
# --------------------------------------------------------------------------------------------

def hf_on(model_dir: Path, dtype: torch.dtype) -> Any:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.to("cuda").eval(), transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.gpu
def test_on_cuda_float32_penalties_and_bias_match_transformers_through_graphs(
        shakespeare_model_dir: Path) -> None:
    """The adjustments run on the device around graph-replayed decode steps, overlapped."""
    hf32 = hf_on(shakespeare_model_dir, torch.float32)
    the = hf32[1].encode(" the")[0]
    cases = [({"repetition_penalty": 1.5}, {"repetition_penalty": 1.5}),
             ({"logit_bias": {the: 6.0}, "min_tokens": 12},
              {"sequence_bias": {(the,): 6.0}, "min_new_tokens": 12})]
    for options, hf_options in cases:
        got = ours(shakespeare_model_dir, SamplingParams(max_tokens=MAX_TOKENS, **options),
                   overlap=True, repeat=2, device="cuda")
        for prompt, tokens in zip(PROMPTS, got):
            assert tokens == hf_greedy(hf32, prompt, **hf_options), (options, prompt)


@pytest.mark.gpu
def test_on_cuda_bf16_logprobs_are_as_close_to_float32_as_transformers_bf16_is(
        shakespeare_model_dir: Path) -> None:
    """In bfloat16 the logits round, so the logprobs do too. Measured against transformers in
    float32 on the sequence we sampled, ours must be about as close as transformers' own
    bfloat16 run is (within 1.5 times its error, or 0.05 nats), for the sampled token and
    for every top alternative we name."""
    hf32, hf16 = hf_on(shakespeare_model_dir, torch.float32), hf_on(shakespeare_model_dir,
                                                                     torch.bfloat16)
    tokenizer = hf32[1]
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=MAX_TOKENS, logprobs=5,
                            presence_penalty=0.5, logit_bias={tokenizer.encode(" the")[0]: 3})
    for req in served_logprobs(shakespeare_model_dir, params, True, prompts, device="cuda",
                               dtype="bfloat16"):
        assert len(req.output_logprobs) == len(req.output_ids) > 0
        sequence = torch.tensor([req.prompt_ids + req.output_ids], device="cuda")
        with torch.no_grad():
            exact, rounded = (torch.log_softmax(m(sequence).logits[0].float(), dim=-1)
                              [len(req.prompt_ids) - 1:-1].cpu() for m in (hf32[0], hf16[0]))
        ids = torch.tensor([[tok] + [t for t, _ in entry.top]
                            for tok, entry in zip(req.output_ids, req.output_logprobs)])
        values = torch.tensor([[entry.logprob] + [v for _, v in entry.top]
                               for entry in req.output_logprobs])
        ours_error = float((values - exact.gather(1, ids)).abs().max())
        hf_error = float((rounded - exact).gather(1, ids).abs().max())
        assert ours_error <= max(0.05, 1.5 * hf_error), (req.uid, ours_error, hf_error)
        assert bool((values[:, 1:-1] >= values[:, 2:]).all()), "top alternatives best first"


@pytest.mark.gpu
def test_an_overlapped_step_with_every_adjustment_never_waits_for_the_device(
        shakespeare_model_dir: Path) -> None:
    """Penalties, logit_bias, min_tokens and logprobs add device work to a step, not a sync:
    under PyTorch's sync debug mode an overlapped decode step with all of them raises nothing,
    and its tokens and logprobs are those of the synchronous loop."""
    from minisgl.core import Req
    from minisgl.scheduler.config import SchedulerConfig
    from minisgl.scheduler.scheduler import Scheduler

    def run_all(overlap: bool, check_steps: int) -> list[tuple[list[int], list[float]]]:
        scheduler = Scheduler(SchedulerConfig(shakespeare_model_dir, device="cuda",
                                              overlap=overlap, max_running_reqs=8))
        options = [{}, {"repetition_penalty": 1.3, "logprobs": 2},
                   {"frequency_penalty": 0.8, "presence_penalty": 0.4, "min_tokens": 20},
                   {"logit_bias": {7: 5.0, 9: -100.0}, "logprobs": 0, "temperature": 0.8,
                    "seed": 3}]
        reqs = [Req(i, [5 + i, 17, 23, 9 + i], SamplingParams(max_tokens=20, **options[i % 4]))
                for i in range(8)]
        for req in reqs:
            scheduler.add(req)
        decode_without_waiting(scheduler, check_steps)
        while scheduler.has_work:
            scheduler.step()
        return [(req.output_ids, [e.logprob for e in req.output_logprobs]) for req in reqs]

    assert run_all(overlap=True, check_steps=8) == run_all(overlap=False, check_steps=0)
