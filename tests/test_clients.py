"""Chapter 21's API through the clients people point at an OpenAI-compatible server.

lm-eval, guidellm, the ``openai`` client, langchain-openai and litellm run unchanged against
``python -m minisgl --device cpu`` serving the trained tiny model; each comes with the ``dev``
extra. What they receive is checked, not only that they finish: lm-eval's loglikelihoods
against ``transformers``, its generations against the server's own greedy text, guidellm's
report for errors, and the penalties the ``openai`` client sends against the offline engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from minisgl.core import SamplingParams

from conftest import ROOT

MODEL_DIR = ROOT / "models" / "tiny-shakespeare"
TASKS = ROOT / "tests" / "data" / "lmeval"  # two small lm-eval tasks and their questions
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "LITELLM_LOCAL_MODEL_COST_MAP": "True"}  # litellm would fetch its price list


@pytest.fixture(scope="module")
def server(shakespeare_server: Any) -> Any:
    return shakespeare_server


@pytest.fixture(scope="module")
def hf() -> Any:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    return model.eval(), transformers.AutoTokenizer.from_pretrained(MODEL_DIR)


def run_client(args: list[str], cwd: Path, tmp_path: Path) -> str:
    """Run a client's command line with this interpreter, offline; its output, or a failure
    that shows it."""
    env = {**os.environ, **OFFLINE, "HF_HOME": str(tmp_path / "hf")}
    done = subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=600)
    assert done.returncode == 0, f"{args[0]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def errors_in(report: Any) -> list[str]:
    """Every error a client's JSON report records, wherever it nests them."""
    if isinstance(report, dict):
        found = [str(report["error"])] if report.get("error") else []
        return found + [e for value in report.values() for e in errors_in(value)]
    if isinstance(report, list):
        return [e for value in report for e in errors_in(value)]
    return []


def loglikelihood(hf: Any, context: str, continuation: str) -> float:
    """What lm-eval asks for, computed with transformers: the continuation's log-probability
    given the context, split into tokens as lm-eval splits them."""
    model, tokenizer = hf
    whole = tokenizer.encode(context + continuation)
    start = len(tokenizer.encode(context))
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), dim=-1)
    return sum(float(logprobs[p - 1, whole[p]]) for p in range(start, len(whole)))


def test_lm_eval_scores_multiple_choice_and_generates_until_a_stop(
        server: Any, hf: Any, tmp_path: Path) -> None:
    """lm-eval's ``local-completions``: the multiple-choice task sends echo + logprobs +
    max_tokens 1 and sums the prompt logprobs of each choice; the generation task sends stop
    strings. Every summed loglikelihood equals transformers' within 1e-3, and every
    generation is the server's greedy text for that prompt."""
    pytest.importorskip("lm_eval")
    openai = pytest.importorskip("openai")
    model_args = (f"model=m,base_url={server.url}/v1/completions,tokenizer={MODEL_DIR},"
                  "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1")
    run_client(["lm_eval", "--model", "local-completions", "--model_args", model_args,
                "--include_path", ".", "--tasks", "tinymc,tinygen",
                "--output_path", str(tmp_path / "out"), "--log_samples"], TASKS, tmp_path)
    samples = {task: [json.loads(line) for path in (tmp_path / "out").rglob(f"samples_{task}_*")
                      for line in path.read_text().splitlines()]
               for task in ("tinymc", "tinygen")}
    questions = (TASKS / "data.jsonl").read_text().splitlines()
    assert len(samples["tinymc"]) == len(samples["tinygen"]) == len(questions)
    for sample in samples["tinymc"]:
        doc = sample["doc"]
        for choice, (got, _) in zip(doc["choices"], sample["filtered_resps"], strict=True):
            expected = loglikelihood(hf, doc["question"], " " + choice)
            assert abs(float(got) - expected) < 1e-3, (doc["question"], choice, got, expected)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    for sample in samples["tinygen"]:
        direct = client.completions.create(model="m", prompt=sample["doc"]["question"],
                                           max_tokens=8, temperature=0, stop=["\n"])
        assert sample["filtered_resps"][0] == direct.choices[0].text


def test_guidellm_default_streaming_run_has_no_errors(server: Any, tmp_path: Path) -> None:
    """guidellm streams with ``stream_options: {include_usage, continuous_usage_stats}``;
    20 requests, every one successful, and the output tokens it counted are those asked for."""
    pytest.importorskip("guidellm")
    report = tmp_path / "guidellm.json"
    run_client(["guidellm", "run", "--backend", f"kind=openai_http,target={server.url}",
                "--profile", "kind=synchronous", "--constraint", "kind=max_requests,count=20",
                "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
                "--tokenizer", f"kind=huggingface_auto,model={MODEL_DIR}",
                "--output", f"kind=json,path={report}", "--disable-console-interactive"],
               tmp_path, tmp_path)
    results = json.loads(report.read_text())
    metrics = results["benchmarks"][0]["metrics"]
    # guidellm exits 0 when a request errors; its report keeps each request's error
    assert metrics["request_totals"] == {"successful": 20, "errored": 0, "incomplete": 0,
                                         "total": 20}, errors_in(results)
    assert metrics["output_token_count"]["successful"]["total_sum"] == 20 * 16


def test_openai_client_penalties_and_logit_bias_are_the_engines(server: Any, hf: Any) -> None:
    """The fields the openai client sends reach the sampler as the offline engine takes them:
    the served text equals ``LLM.generate`` with the same SamplingParams, and a bias of 100
    forces its token."""
    openai = pytest.importorskip("openai")
    from minisgl.llm import LLM

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    tokenizer = hf[1]
    the = tokenizer.encode(" the")[0]
    prompt = "ROMEO:\nO"
    asks = [{"presence_penalty": 0.8, "frequency_penalty": 1.1},
            {"logit_bias": {str(the): 5}},
            {"frequency_penalty": 0.5, "logit_bias": {str(the): -100}}]
    llm = LLM(MODEL_DIR, device="cpu")
    for ask in asks:
        served = client.completions.create(model="m", prompt=prompt, max_tokens=12,
                                           temperature=0, **ask)
        params = SamplingParams(max_tokens=12, **{k: v for k, v in ask.items()
                                                  if k != "logit_bias"},
                                logit_bias={int(t): b for t, b in ask.get("logit_bias",
                                                                          {}).items()})
        assert served.choices[0].text == llm.generate([prompt], params)[0]["text"], ask
    forced = client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0,
                                       logit_bias={str(the): 100})
    assert forced.choices[0].text == tokenizer.decode([the] * 4)


def test_langchain_chat_model_returns_logprobs(server: Any) -> None:
    """``ChatOpenAI(...).invoke(..., logprobs=True)``: an entry per generated token, the
    end-of-sequence token that ended the reply included (it is counted in the usage and has
    a logprob, as lm-eval's loglikelihood expects of echo), so the entries spell the reply
    and then that token."""
    langchain_openai = pytest.importorskip("langchain_openai")
    chat = langchain_openai.ChatOpenAI(base_url=f"{server.url}/v1", api_key="none", model="m",
                                       max_tokens=8, temperature=0)
    reply = chat.invoke("Speak, friend", logprobs=True)
    entries = reply.response_metadata["logprobs"]["content"]
    assert reply.response_metadata["finish_reason"] == "stop", "the test wants an ending"
    assert len(entries) == reply.response_metadata["token_usage"]["completion_tokens"]
    assert "".join(entry["token"] for entry in entries) == reply.content + "<|im_end|>"
    assert all(entry["logprob"] <= 0 for entry in entries)


def test_litellm_completion_takes_n_and_top_logprobs(server: Any) -> None:
    """litellm's OpenAI route with n=2 and top_logprobs=2, seeded: two choices, each token with
    its two best alternatives, the same on a second call."""
    for name, value in OFFLINE.items():
        os.environ.setdefault(name, value)
    litellm = pytest.importorskip("litellm")
    ask = dict(model="openai/m", api_base=f"{server.url}/v1", api_key="none",
               messages=[{"role": "user", "content": "Speak"}], n=2, logprobs=True,
               top_logprobs=2, max_tokens=6, temperature=1.0, seed=4)
    first, again = (litellm.completion(**ask) for _ in range(2))
    assert [c.index for c in first.choices] == [0, 1]
    for choice in first.choices:
        content = choice.logprobs["content"] if isinstance(choice.logprobs, dict) \
            else choice.logprobs.content
        assert content and all(len(_field(e, "top_logprobs")) == 2 for e in content)
    assert [c.message.content for c in first.choices] == [c.message.content
                                                          for c in again.choices]


def _field(entry: Any, name: str) -> Any:
    return entry[name] if isinstance(entry, dict) else getattr(entry, name)
