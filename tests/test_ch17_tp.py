"""Chapter 17: tensor parallelism, two ranks with gloo on a CPU (and NCCL on a GPU).

What these tests pin down, each on real processes (spawned ranks, one CPU thread each):

- the sharded layers: a column-parallel + row-parallel pair, the vocabulary-parallel embedding
  and LM head (over a vocabulary that does not divide by 2) each equal their unsharded layer;
- the model: logits at TP=2 within float32 tolerance of TP=1 and the same greedy tokens, on the
  tiny model and on a variant with one KV head (replicated on both ranks) and an odd vocabulary;
- the schedulers of both ranks take the same decision at every step and hold the same tokens,
  with seeded sampling, the radix cache and chunked prefill on, and the KV budget is the
  smallest any rank can hold;
- ``LLM(tp=2)`` gives ``LLM(tp=1)``'s and transformers' greedy tokens for 18 prompts through
  the overlapping scheduler (continuous batching, radix cache, chunked prefill); a follower
  out of step stops instead of hanging; a script holding ``LLM(tp=2)`` stopped by Ctrl-C or
  SIGTERM leaves no rank behind;
- the server at ``--tp 2``: the ``openai`` client gets ``--tp 1``'s text, streamed or not; a
  client that disconnects frees its pages on both ranks; SIGTERM leaves no process; a rank
  killed mid-request gives 503s and a server that still stops cleanly;
- bad rank counts are refused with the reason; on a GPU, the NCCL group at world size 1.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from minisgl.core import Req, SamplingParams
from minisgl.distributed.group import (
    check_tp_size,
    destroy_tp_group,
    device_for_rank,
    free_loopback_address,
    init_tp_group,
)
from minisgl.llm import LLM
from server_process import (  # tools/, see conftest.py
    ServerProcess,
    still_running,
    stream_in_thread,
)

RANK_TIMEOUT_S = 240.0
STARTUP_TIMEOUT_S = 240.0


# =========================================================================== running ranks
def _rank_main(fn: Callable[..., Any], rank: int, size: int, address: str, device: str,
               results: multiprocessing.Queue, args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    try:
        rank_device = device_for_rank(torch.device(device), rank, size)
        init_tp_group(rank, size, rank_device, address)
        # Plain pickle: tensors travel as bytes, not as shared memory that dies with the rank.
        results.put((rank, True, pickle.dumps(fn(rank, *args))))
    except BaseException:  # the parent shows the rank's traceback
        results.put((rank, False, traceback.format_exc()))
    finally:
        destroy_tp_group()


def run_ranks(fn: Callable[..., Any], size: int, *args: Any, device: str = "cpu") -> list[Any]:
    """``fn(rank, *args)`` on ``size`` spawned ranks of one group; their results, by rank."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    address = free_loopback_address()
    procs = [ctx.Process(target=_rank_main, args=(fn, rank, size, address, device, results, args),
                         daemon=True) for rank in range(size)]
    for proc in procs:
        proc.start()
    try:
        by_rank: dict[int, Any] = {}
        for _ in range(size):
            rank, ok, value = results.get(timeout=RANK_TIMEOUT_S)
            assert ok, f"rank {rank} failed:\n{value}"
            by_rank[rank] = pickle.loads(value)
        return [by_rank[rank] for rank in range(size)]
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


# =========================================================================== layers
def layer_weights() -> dict[str, torch.Tensor]:
    """Full (unsharded) weights, the same in every process: an MLP-shaped pair 16 -> 24 -> 16
    and an 11-row vocabulary table (11 does not divide by 2: the last block is padded)."""
    g = torch.Generator().manual_seed(17)
    return {"x": torch.randn(5, 16, generator=g), "up": torch.randn(24, 16, generator=g),
            "down": torch.randn(16, 24, generator=g), "down_bias": torch.randn(16, generator=g),
            "table": torch.randn(11, 16, generator=g), "ids": torch.tensor([0, 5, 6, 10, 3])}


def sharded_layer_outputs(rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    from minisgl.layers import (
        ColumnParallelLinear,
        ParallelLMHead,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    w = layer_weights()
    up, down = ColumnParallelLinear(16, 24), RowParallelLinear(24, 16, bias=True)
    up.load_weight(w["up"])
    down.load_weight(w["down"])
    down.load_weight(w["down_bias"], param_name="bias")
    embedding, head = VocabParallelEmbedding(11, 16), ParallelLMHead(11, 16)
    embedding.load_weight(w["table"])
    head.load_weight(w["table"])
    with torch.no_grad():
        return {"pair": down(up(w["x"])), "embedding": embedding(w["ids"]), "logits": head(w["x"]),
                "up_rows": up.weight.shape[0], "vocab_rows": embedding.weight.shape[0],
                "backend": dist.get_backend()}


def test_sharded_layers_equal_their_unsharded_layer() -> None:
    w = layer_weights()
    ranks = run_ranks(sharded_layer_outputs, 2)
    pair = F.linear(F.linear(w["x"], w["up"]), w["down"], w["down_bias"])
    for rank, out in enumerate(ranks):
        assert out["backend"] == "gloo", "ranks on a CPU talk through gloo"
        assert out["up_rows"] == 12 and out["vocab_rows"] == 6, "each rank holds half (padded)"
        torch.testing.assert_close(out["pair"], pair, rtol=1e-5, atol=1e-5,
                                   msg=f"rank {rank}: column + row parallel")
        torch.testing.assert_close(out["embedding"], F.embedding(w["ids"], w["table"]),
                                   rtol=0, atol=0, msg=f"rank {rank}: embedding")
        torch.testing.assert_close(out["logits"], F.linear(w["x"], w["table"]), rtol=1e-5,
                                   atol=1e-5, msg=f"rank {rank}: LM head")


# =========================================================================== the model
GREEDY_TOKENS = 8


def logits_and_greedy(rank: int, model_dir: str, prompt: list[int], device: str = "cpu"
                      ) -> dict[str, Any]:
    """The prompt's logits at every position, then greedy tokens (no cache: whole sequence)."""
    from minisgl.models import load_model

    model = load_model(model_dir, device, "float32", progress=False)
    on = next(model.parameters()).device  # under NCCL, "cuda" is this rank's GPU
    ids = list(prompt)
    with torch.no_grad():
        logits = model.forward(torch.tensor(ids, device=on), torch.arange(len(ids), device=on))
        for _ in range(GREEDY_TOKENS):
            last = model.forward(torch.tensor(ids, device=on), torch.arange(len(ids), device=on),
                                 torch.tensor([len(ids) - 1], device=on))
            ids.append(int(last.argmax(-1)))
    return {"logits": logits.cpu(), "tokens": ids[len(prompt):]}


@pytest.fixture(scope="module")
def one_kv_head_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with one KV head (fewer than 2 ranks: replicated) and 2,047 vocabulary
    rows (odd: the vocabulary blocks of 2 ranks are 1,024 and 1,023 rows)."""
    out = tmp_path_factory.mktemp("one-kv-head")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny_model_dir / name, out / name)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    head_dim, vocab = config["head_dim"], 2047
    config.update(num_key_value_heads=1, vocab_size=vocab)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights = load_file(tiny_model_dir / "model.safetensors")
    for name, tensor in weights.items():
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            weights[name] = tensor[:head_dim].clone()  # keep KV head 0
        elif name.endswith("embed_tokens.weight"):
            weights[name] = tensor[:vocab].clone()
    save_file(weights, out / "model.safetensors")
    return out


@pytest.mark.parametrize("variant", ["tiny", "one-kv-head"])
def test_model_logits_and_greedy_tokens_at_tp2_equal_tp1(
        variant: str, tiny_model_dir: Path, one_kv_head_model: Path) -> None:
    model_dir = str(tiny_model_dir if variant == "tiny" else one_kv_head_model)
    prompt = torch.randint(2000, (13,), generator=torch.Generator().manual_seed(3)).tolist()
    single = run_ranks(logits_and_greedy, 1, model_dir, prompt)[0]
    for rank, out in enumerate(run_ranks(logits_and_greedy, 2, model_dir, prompt)):
        torch.testing.assert_close(out["logits"], single["logits"], rtol=1e-4, atol=1e-4,
                                   msg=f"rank {rank}: logits at TP=2")
        assert out["tokens"] == single["tokens"], f"rank {rank}: greedy tokens"


# =========================================================================== two schedulers
def workload() -> list[tuple[int, Req]]:
    """(arrival step, request): 12 requests, half sharing a 10-token head (radix cache), some
    seeded-sampled, arriving over 6 steps."""
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(2000, (10,), generator=g).tolist()
    reqs = []
    for i in range(12):
        prompt = torch.randint(2000, (int(torch.randint(2, 20, (1,), generator=g)),),
                               generator=g).tolist()
        params = (SamplingParams(max_tokens=3 + i % 5, temperature=0.9, top_k=40, seed=i,
                                 ignore_eos=True) if i % 3 == 0
                  else SamplingParams(max_tokens=3 + i % 5, ignore_eos=True))
        reqs.append((i // 2, Req(i, shared + prompt if i % 2 else prompt, params)))
    return reqs


def scheduler_trace(rank: int, model_dir: str, num_pages: tuple[int, ...]) -> dict[str, Any]:
    """Run the workload on this rank's own scheduler; every step's decisions and the tokens."""
    from minisgl.scheduler.config import SchedulerConfig
    from minisgl.scheduler.scheduler import Scheduler

    scheduler = Scheduler(SchedulerConfig(
        model_dir, device="cpu", page_size=2, num_pages=num_pages[rank], max_running_reqs=6,
        prefix_cache="radix", chunked_prefill=True, max_prefill_tokens=9))
    arrivals = workload()
    steps = []
    while len(steps) < 6 or scheduler.has_work:
        for arrival, req in arrivals:
            if arrival == len(steps):
                scheduler.add(req)
        r = scheduler.step()
        steps.append((r.phase, r.uids, r.new_lens, r.new_pages, r.pages_in_use, r.waiting,
                      r.running, tuple(req.uid for req in r.finished)))
    return {"steps": steps, "tokens": [req.output_ids for _, req in arrivals],
            "num_pages": scheduler.engine.kv_budget.num_pages}


def test_both_ranks_take_every_decision_alike_and_hold_the_same_tokens(
        tiny_model_dir: Path) -> None:
    rank0, rank1 = run_ranks(scheduler_trace, 2, str(tiny_model_dir), (96, 80))
    assert rank0["num_pages"] == rank1["num_pages"] == 80, "the smallest budget of any rank"
    assert any(step[0] == "prefill" and any(step[2]) for step in rank0["steps"])
    assert rank0["steps"] == rank1["steps"], "the ranks' schedulers took different decisions"
    assert rank0["tokens"] == rank1["tokens"], "the ranks hold different tokens"
    single = run_ranks(scheduler_trace, 1, str(tiny_model_dir), (80,))[0]
    for (_, req), tp2, tp1 in zip(workload(), rank0["tokens"], single["tokens"]):
        if req.params.temperature == 0:
            assert tp2 == tp1, f"request {req.uid}: greedy tokens at TP=2 differ from TP=1"


# =========================================================================== LLM(tp=2)
LLM_OPTIONS = {"device": "cpu", "page_size": 4, "num_pages": 160, "max_running_reqs": 6,
               "prefix_cache": "radix", "chunked_prefill": True, "max_prefill_tokens": 24,
               "overlap": True}


def llm_prompts() -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(23)
    system = torch.randint(2000, (12,), generator=g).tolist()
    prompts = [system + torch.randint(2000, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 30, (18,), generator=g)]
    return prompts, torch.randint(1, 12, (18,), generator=g).tolist()


def test_llm_tp2_equals_tp1_and_transformers(tiny_model_dir: Path) -> None:
    """18 prompts sharing a 12-token head, 6 running at most, prompts cut into chunks of 24
    tokens: TP=2's greedy tokens are TP=1's and transformers', every one."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    prompts, new_tokens = llm_prompts()
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in new_tokens]
    with LLM(tiny_model_dir, tp=2, **LLM_OPTIONS) as llm:
        tp2 = [out["token_ids"] for out in llm.generate(prompts, params)]
    tp1 = [out["token_ids"] for out in LLM(tiny_model_dir, **LLM_OPTIONS).generate(prompts, params)]
    assert tp2 == tp1

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.inference_mode():
        for prompt, n, tokens in zip(prompts, new_tokens, tp2):
            ids = torch.tensor([prompt])
            config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)
            expected = hf_model.generate(ids, attention_mask=torch.ones_like(ids),
                                         generation_config=config)[0, len(prompt):].tolist()
            assert tokens == expected, f"prompt of {len(prompt)} tokens"


def test_a_follower_that_is_not_where_rank_0_is_stops_at_once() -> None:
    """A follower checks rank 0's step count (and that it has work) before it steps: a rank
    that missed an input would otherwise enter a collective the others never do, and hang."""
    from types import SimpleNamespace

    from minisgl.scheduler.tp import RankFailed, RankStep, follow_step

    stepped = []
    follower = SimpleNamespace(num_steps=4, has_work=True, step=lambda: stepped.append(1))
    follow_step(follower, RankStep(4), rank=1)
    assert stepped == [1]
    with pytest.raises(RankFailed, match="rank 1 has run 4 steps.*step 5"):
        follow_step(follower, RankStep(5), rank=1)
    with pytest.raises(RankFailed, match="has no work"):
        follow_step(SimpleNamespace(num_steps=4, has_work=False), RankStep(4), rank=1)
    assert stepped == [1], "a follower out of step must not step"


LLM_SCRIPT = """
import os, sys, time
from minisgl.llm import LLM
if __name__ == "__main__":
    llm = LLM(sys.argv[1], device="cpu", tp=2, num_pages=64)
    print(" ".join(str(p.pid) for p in llm._followers), flush=True)
    time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_script_holding_llm_tp2_stopped_by_a_signal_leaves_no_rank(
        sig: signal.Signals, tiny_model_dir: Path, tmp_path: Path) -> None:
    """Ctrl-C ends the script normally (its daemon ranks are stopped on the way out); SIGTERM
    ends it without clean-up, and the ranks notice their parent is gone."""
    script = tmp_path / "hold.py"
    script.write_text(LLM_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(script), str(tiny_model_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    try:
        line = proc.stdout.readline()
        followers = [psutil.Process(int(pid)) for pid in line.split()]
        assert len(followers) == 1, f"expected one follower rank, got {line!r}"
        proc.send_signal(sig)
        proc.wait(30)
        assert not still_running(followers, wait_s=15), "a follower rank outlived the script"
    finally:
        proc.kill()


# =========================================================================== refusals
def test_rank_counts_the_model_or_the_machine_cannot_take_are_refused(
        tiny_model_dir: Path) -> None:
    from minisgl.scheduler.tp import check_tp

    with pytest.raises(ValueError, match="tp=3 cannot split this model: 3 does not divide its 4 "
                                         "attention heads"):
        check_tp(tiny_model_dir, 3)
    with pytest.raises(ValueError, match="8 KV heads"):
        check_tp_size(3, num_qo_heads=24, num_kv_heads=8, intermediate_size=24, vocab_size=10)
    check_tp_size(4, num_qo_heads=16, num_kv_heads=2, intermediate_size=64, vocab_size=5)
    if torch.cuda.device_count() < 64:
        with pytest.raises(ValueError, match="over 64 ranks needs 64 GPUs"):
            device_for_rank(torch.device("cuda"), 0, 64)
    with pytest.raises(ValueError, match="one GPU each"):
        device_for_rank(torch.device("cuda", 1), 0, 2)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        init_tp_group(2, 2, torch.device("cpu"), free_loopback_address())
    with pytest.raises(ValueError, match="4 attention heads"):
        LLM(tiny_model_dir, device="cpu", tp=3)


def test_the_command_line_refuses_a_tp_the_model_cannot_take(
        tiny_model_dir: Path, capfd: pytest.CaptureFixture[str]) -> None:
    from minisgl.server.launch import main

    assert main(["--model", str(tiny_model_dir), "--device", "cpu", "--tp", "3"]) == 1
    assert "tp=3 cannot split this model: 3 does not divide its 4 attention heads" in \
        capfd.readouterr().err


# =========================================================================== the server
class Server(ServerProcess):
    def worker_pid(self, name: str) -> int:
        found = re.search(rf"{name} \(pid (\d+)\)", self.log_text())
        assert found, f"no pid for {name} in the log"
        return int(found.group(1))

    def wait_for(self, condition: Callable[[dict[str, int]], bool], timeout_s: float = 30
                 ) -> dict[str, int]:
        deadline = time.monotonic() + timeout_s
        while True:
            metrics = self.metrics()
            if condition(metrics):
                return metrics
            assert time.monotonic() < deadline, f"metrics never got there: {metrics}"
            time.sleep(0.05)


# 512 pages x 4 = 2,048 tokens: two 900-token streams run side by side.
SERVER_OPTIONS = ("--page-size", "4", "--num-pages", "512", "--shutdown-timeout", "1",
                  "--served-model-name", "tiny")


def start_server(model_dir: Path, log: Path, tp: int) -> Server:
    server = Server(model_dir, device="cpu", args=("--tp", str(tp), *SERVER_OPTIONS),
                    log_path=log, startup_timeout_s=STARTUP_TIMEOUT_S)
    server.start()
    return server


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
            request: pytest.FixtureRequest) -> dict[int, Server]:
    """A server at --tp 1 and one at --tp 2, started together."""
    logs = tmp_path_factory.mktemp("ch17")
    running = {tp: start_server(tiny_model_dir, logs / f"tp{tp}.log", tp) for tp in (1, 2)}
    for server in running.values():
        request.addfinalizer(server.stop)
    for server in running.values():
        server.wait_ready()
    return running


def openai_answers(url: str) -> list[str]:
    """Greedy answers through the openai client: completions and chat, streamed and not."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    answers = []
    for prompt in ("The tensor was split", "Two ranks walk into a bar"):
        kwargs: dict[str, Any] = {"model": "tiny", "max_tokens": 16, "temperature": 0}
        answers.append(client.completions.create(prompt=prompt, **kwargs).choices[0].text)
        answers.append("".join(chunk.choices[0].text for chunk in client.completions.create(
            prompt=prompt, stream=True, **kwargs)))
        messages = [{"role": "user", "content": prompt}]
        answers.append(client.chat.completions.create(
            messages=messages, **kwargs).choices[0].message.content)
        answers.append("".join(chunk.choices[0].delta.content or "" for chunk in
                               client.chat.completions.create(messages=messages, stream=True,
                                                              **kwargs)))
    return answers


@pytest.mark.slow
def test_server_at_tp2_answers_as_tp1(servers: dict[int, Server]) -> None:
    tp1, tp2 = openai_answers(servers[1].url), openai_answers(servers[2].url)
    assert tp2 == tp1
    assert all(answer for answer in tp2)
    assert tp2[0] == tp2[1] and tp2[2] == tp2[3], "streamed text differs from the whole"


# Rank 0's gauges, and rank 1's (published by its own scheduler process).
RANK_GAUGES = ("minisgl_kv_pages_in_use", "minisgl_running_requests",
               "minisgl_rank1_kv_pages_in_use", "minisgl_rank1_running")


@pytest.mark.slow
def test_a_client_that_disconnects_frees_its_pages_on_every_rank(
        servers: dict[int, Server]) -> None:
    server = servers[2]
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60, json={
            "prompt": "A long story", "max_tokens": 1000, "ignore_eos": True,
            "stream": True}) as response:
        lines = response.iter_lines()
        for _ in range(4):
            next(lines)
        busy = server.metrics()
        assert busy["minisgl_kv_pages_in_use"] > 0 and busy["minisgl_rank1_kv_pages_in_use"] > 0
        assert busy["minisgl_kv_pages_in_use"] == busy["minisgl_rank1_kv_pages_in_use"]
    # Leaving the block closes the connection: the request is aborted on every rank.
    server.wait_for(lambda m: all(m[name] == 0 for name in RANK_GAUGES))


def wait_until(condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


@pytest.mark.slow
def test_sigterm_stops_every_rank(servers: dict[int, Server]) -> None:
    """Runs last of the module servers' tests: it stops the --tp 2 server, busy."""
    server = servers[2]
    results: dict[int, list[str]] = {}
    thread = stream_in_thread(server.url, results, 0, max_tokens=900)
    server.wait_for(lambda m: m["minisgl_rank1_running"] == 1)
    ranks = [psutil.Process(server.worker_pid(name)) for name in ("scheduler",
                                                                  "scheduler-rank1")]
    assert server.stop(signal.SIGTERM, timeout_s=30) == 128 + signal.SIGTERM
    thread.join(10)
    assert results[0][-1] == "data: [DONE]", results[0][-2:]
    assert not server.left_behind, f"left behind: {[p.pid for p in server.left_behind]}"
    assert not any(rank.is_running() and rank.status() != psutil.STATUS_ZOMBIE
                   for rank in ranks)
    assert "stopped 4 worker process(es)" in server.log_text()


@pytest.mark.slow
def test_a_killed_rank_gives_503s_and_the_server_exits_on_its_own(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """Rank 1 killed mid-request: both waiting requests end with 503 (stream: an error
    event), a new one is refused with 503, rank 0's watch aborts the group (the path NCCL
    needs, driven here on gloo), and the server exits non-zero, all within seconds."""
    server = start_server(tiny_model_dir, tmp_path / "server.log", 2)
    try:
        server.wait_ready()
        results: dict[int, list[str]] = {}
        stream = stream_in_thread(server.url, results, 0, max_tokens=900)
        whole: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: whole.append(httpx.post(
            f"{server.url}/v1/completions", timeout=60, json={
                "prompt": "Wait for it", "max_tokens": 900, "ignore_eos": True})),
            daemon=True)
        waiter.start()
        server.wait_for(lambda m: m["minisgl_rank1_running"] == 2)
        # the stream has begun (a stream's headers wait for its first reply, chapter 16)
        wait_until(lambda: len(results.get(0, [])) > 0, timeout_s=30)
        server.workers()  # every worker noted in the server's family, for left_behind
        killed = time.monotonic()
        psutil.Process(server.worker_pid("scheduler-rank1")).kill()
        for thread in (stream, waiter):
            thread.join(15)
        assert time.monotonic() - killed < 10, "the requests waited for a dead rank"
        assert whole[0].status_code == 503, whole[0].text
        assert "scheduler" in whole[0].json()["error"]["message"]
        assert results[0][-1] == "data: [DONE]"
        assert json.loads(results[0][-2][len("data: "):])["error"]["code"] == "worker_died"
        refused = httpx.post(f"{server.url}/v1/completions", timeout=30,
                             json={"prompt": "anyone?", "max_tokens": 2})
        assert refused.status_code == 503
        server.proc.wait(15)
        exited_s = time.monotonic() - killed
        assert exited_s < 15, f"the server took {exited_s:.1f} s to exit"
        assert server.stop(None) == 1
        assert not server.left_behind, f"left behind: {[p.pid for p in server.left_behind]}"
        log = server.log_text()
        assert re.search(r"aborting the tensor-parallel group: rank 1 \(pid \d+\) has exited",
                         log), "rank 0's watch did not abort the group"
        assert "the server cannot serve without it, and stops" in log
    finally:
        server.stop()


# =========================================================================== faults at start-up
NO_GUARD_SCRIPT = """
import sys
from minisgl.llm import LLM
print("starting", flush=True)
LLM(sys.argv[1], device="cpu", tp=2, num_pages=64)
"""


def run_watching_descendants(cmd: list[str], timeout_s: float
                             ) -> tuple[subprocess.Popen[str], float, list[psutil.Process]]:
    """Run ``cmd``; seconds from its first line of output to its exit, and every process
    seen under it meanwhile."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    seen: dict[int, psutil.Process] = {}
    try:
        assert proc.stdout.readline().strip() == "starting"
        started = time.monotonic()
        while proc.poll() is None and time.monotonic() - started < timeout_s:
            try:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    seen.setdefault(child.pid, child)
            except psutil.Error:
                pass
            time.sleep(0.05)
        proc.wait(5)
        return proc, time.monotonic() - started, list(seen.values())
    finally:
        proc.kill()


@pytest.mark.slow
def test_a_script_without_the_main_guard_fails_at_once_naming_the_guard(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """The spawned rank imports the script again and would start a rank of its own: it exits
    instead, and LLM(tp=2) raises at once with the hint (not after the 600 s rendezvous)."""
    script = tmp_path / "no_guard.py"
    script.write_text(NO_GUARD_SCRIPT)
    proc, took_s, seen = run_watching_descendants(
        [sys.executable, str(script), str(tiny_model_dir)], timeout_s=60)
    err = proc.stderr.read()
    assert proc.returncode == 1
    assert took_s < 15, f"LLM(tp=2) took {took_s:.1f} s to fail"
    assert "WorkerFailed: worker minisgl-scheduler-rank1" in err
    assert "bootstrapping phase" in err and 'if __name__ == "__main__":' in err
    assert not still_running(seen, wait_s=5), "a process outlived the script"


def new_children(before: set[int]) -> list[psutil.Process]:
    """This process's spawned children that were not there before (the resource tracker is
    a child too, but no rank)."""
    found = []
    for child in psutil.Process().children():
        try:
            cmdline = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if child.pid not in before and "spawn_main" in cmdline:
            found.append(child)
    return found


def test_a_rank_killed_before_it_joins_fails_llm_at_once(tiny_model_dir: Path) -> None:
    from minisgl.utils.processes import WorkerFailed

    before = {child.pid for child in psutil.Process().children()}
    ranks: list[psutil.Process] = []

    def kill_rank1() -> None:  # as soon as it exists: long before it can join
        deadline = time.monotonic() + 30
        while not ranks and time.monotonic() < deadline:
            ranks.extend(new_children(before))
            time.sleep(0.01)
        for rank in ranks:
            rank.kill()

    killer = threading.Thread(target=kill_rank1, daemon=True)
    killer.start()
    started = time.monotonic()
    with pytest.raises(WorkerFailed, match="rank1 .* was killed by SIGKILL"):
        LLM(tiny_model_dir, tp=2, **LLM_OPTIONS)
    took_s = time.monotonic() - started
    killer.join(5)
    assert ranks, "rank 1 was never seen"
    assert took_s < 15, f"LLM(tp=2) took {took_s:.1f} s to fail"
    assert not still_running(ranks + new_children(before), wait_s=5)


def test_a_rank_killed_while_generating_fails_generate_at_once(tiny_model_dir: Path) -> None:
    """Rank 0 is this process: its collective with the dead rank fails (gloo's socket), its
    watch names the rank and how it ended, and closing the LLM leaves no process."""
    from minisgl.scheduler.tp import RankFailed

    llm = LLM(tiny_model_dir, tp=2, **LLM_OPTIONS)
    rank1 = psutil.Process(llm._followers[0].pid)
    try:
        killer = threading.Timer(1.0, rank1.kill)
        killer.start()
        started = time.monotonic()
        with pytest.raises(RankFailed, match=r"rank 1 \(pid \d+\) was killed by SIGKILL"):
            llm.generate([[1, 2, 3]] * 2, SamplingParams(max_tokens=600, ignore_eos=True))
        assert time.monotonic() - started < 15
    finally:
        llm.close()
    assert not still_running([rank1], wait_s=5)


# =========================================================================== NCCL
def nccl_sum_and_model(rank: int, model_dir: str) -> dict[str, Any]:
    import torch.distributed as dist

    from minisgl.distributed import all_reduce, get_tp_info

    device = torch.device("cuda", rank)
    x = torch.full((4,), float(rank + 1), device=device)
    summed = all_reduce(x).cpu()  # the hook the layers call, through NCCL
    out = logits_and_greedy(rank, model_dir, list(range(5, 18)), device="cuda")
    return {"backend": dist.get_backend(), "size": get_tp_info().size, "sum": summed,
            "tokens": out["tokens"]}


@pytest.mark.gpu
def test_the_nccl_group_at_world_size_1(tiny_model_dir: Path) -> None:
    """On one GPU: the group's backend is NCCL and the layers' all-reduce runs through it."""
    out = run_ranks(nccl_sum_and_model, 1, str(tiny_model_dir), device="cuda")[0]
    assert (out["backend"], out["size"]) == ("nccl", 1)
    assert out["sum"].tolist() == [1.0] * 4
    assert len(out["tokens"]) == GREEDY_TOKENS


def nccl_abort(rank: int) -> dict[str, Any]:
    """Abort the group as the watch does when a peer exits, then try a collective."""
    import time as clock

    import torch.distributed as dist

    from minisgl.distributed import all_reduce
    from minisgl.distributed.peers import PeerExited, abort_tp_group

    backend = dist.get_backend()
    x = torch.ones(4, device=torch.device("cuda", rank))
    all_reduce(x)
    torch.cuda.synchronize()
    abort_tp_group("rank 1 (pid 0) was killed by SIGKILL")  # as if a peer had died
    started = clock.monotonic()
    try:
        all_reduce(x)
        raised = ""
    except PeerExited as exc:
        raised = str(exc)
    return {"backend": backend, "raised": raised, "seconds": clock.monotonic() - started}


@pytest.mark.gpu
def test_an_aborted_nccl_group_refuses_the_next_collective_at_once() -> None:
    """The abort path a dead peer takes, under NCCL on one GPU: the communicator is aborted
    (ncclCommAbort) and the next collective raises naming the rank instead of waiting."""
    out = run_ranks(nccl_abort, 1, device="cuda")[0]
    assert out["backend"] == "nccl"
    assert "rank 1" in out["raised"] and out["seconds"] < 5


@pytest.mark.gpu
def test_the_nccl_group_on_every_gpu(tiny_model_dir: Path) -> None:
    """On N >= 2 GPUs: the sum over N ranks, and greedy tokens equal to one GPU's."""
    size = torch.cuda.device_count()
    if size < 2:
        pytest.skip("needs 2 CUDA GPUs; this machine has fewer")
    single = run_ranks(nccl_sum_and_model, 1, str(tiny_model_dir), device="cuda")[0]
    for out in run_ranks(nccl_sum_and_model, 2, str(tiny_model_dir), device="cuda"):
        assert out["sum"].tolist() == [3.0] * 4
        assert out["tokens"] == single["tokens"]
