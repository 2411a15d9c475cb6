"""Chapter 19: the benchmarks' own arithmetic, and figures that follow from their data.

Without a model: percentiles, goodput on a case worked out by hand, the Poisson arrivals' mean
rate, the workloads (shared-prefix prompts share exactly their system prompt; a ShareGPT file
is read as its first exchanges). With the tiny model on the CPU: the prefill tokens a radix
cache saves on the shared-prefix workload are exactly the predicted ones, the ablations count
every token they asked for, the online benchmark keeps its concurrency cap and computes goodput
from its own per-request numbers, the plots are redrawn byte for byte from the JSON, and the
host-step benchmark times whole decode batches without running the model.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import subprocess
import sys
from collections.abc import Callable
from typing import Any
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
SMALL_ABLATIONS = ["--num-requests", "6", "--min-len", "6", "--max-len", "16",
                   "--num-prefixes", "2", "--prefix-len", "30", "--short-requests", "3",
                   "--long-requests", "2", "--long-len", "120", "--chunk-size", "40"]


@pytest.fixture(scope="module")
def measure(repo_script: Callable[[str], ModuleType]) -> ModuleType:
    return repo_script("benchmark/measure.py")


@pytest.fixture(scope="module")
def workloads(repo_script: Callable[[str], ModuleType]) -> ModuleType:
    return repo_script("benchmark/workloads.py")


@pytest.fixture(scope="module")
def offline(repo_script: Callable[[str], ModuleType]) -> ModuleType:
    return repo_script("benchmark/offline.py")


@pytest.fixture(scope="module")
def plots(repo_script: Callable[[str], ModuleType]) -> ModuleType:
    return repo_script("benchmark/plots.py")


# =========================================================================== arithmetic
def test_percentiles_interpolate_between_ranks(measure: ModuleType) -> None:
    np = pytest.importorskip("numpy")
    values = [0.4, 0.1, 0.3, 0.2, 5.0]
    for q in (0, 10, 50, 90, 99, 100):
        assert measure.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    summary = measure.summarize(values, scale=1e3)
    assert summary["p50"] == pytest.approx(300.0) and summary["max"] == pytest.approx(5000.0)
    assert summary["mean"] == pytest.approx(1200.0)
    # The median is the middle sample, blind to the outlier; p99 lies between the two largest
    # samples, 96% of the way to the outlier: (5 - 1) * 0.99 = 3.96 ranks.
    assert summary["p99"] == pytest.approx(400.0 + 0.96 * (5000.0 - 400.0))
    assert measure.summarize([]) is None


def test_goodput_counts_only_requests_that_meet_every_objective(measure: ModuleType) -> None:
    objectives = measure.parse_objectives("ttft=200,tpot=20")
    assert (objectives.ttft_ms, objectives.tpot_ms, objectives.e2e_ms) == (200.0, 20.0, None)
    completed = [
        (0.100, 0.010, 1.0),  # meets both
        (0.300, 0.010, 1.0),  # first token too late
        (0.150, 0.030, 3.0),  # too slow afterwards
        (0.150, None, 0.15),  # one token only: no TPOT, meets the TPOT bound
        (0.200, 0.020, 2.0),  # exactly at both bounds: met
    ]
    # Six requests were sent; the sixth failed and meets nothing. The run took 4 s.
    result = measure.goodput(completed, 6, objectives, duration_s=4.0)
    assert result == {"met": 3, "fraction": 0.5, "per_s": 0.75}
    # Without objectives every completed request counts; a failed one still does not.
    assert measure.goodput(completed, 6, measure.Objectives(), 4.0)["met"] == 5


def test_objectives_are_parsed_strictly(measure: ModuleType) -> None:
    assert measure.parse_objectives("none") == measure.Objectives()
    assert measure.parse_objectives("E2E=1500").e2e_ms == 1500.0
    for bad in ("ttft", "latency=5", "ttft=-1", "ttft=fast", "ttft=1,ttft=2", "tpot=inf"):
        with pytest.raises(ValueError):
            measure.parse_objectives(bad)


def test_poisson_arrivals_keep_their_mean_rate(workloads: ModuleType) -> None:
    for rate in (2.0, 50.0):
        times = workloads.poisson_arrivals(4000, rate, seed=3)
        observed = (len(times) - 1) / times[-1]
        assert observed == pytest.approx(rate, rel=0.05), f"asked {rate}/s, got {observed}/s"
        if rate > 2.0:
            continue
        # Poisson: the count in a window of one second has variance equal to its mean (checked
        # where there are enough windows: about 2,000 of them at 2 requests a second).
        counts = [0] * math.floor(times[-1])  # whole seconds only: the last one is cut short
        for t in times:
            if t < len(counts):
                counts[int(t)] += 1
        mean = sum(counts) / len(counts)
        variance = sum((c - mean) ** 2 for c in counts) / len(counts)
        assert variance == pytest.approx(mean, rel=0.15)


def test_shared_prefix_prompts_share_exactly_their_system_prompt(workloads: ModuleType) -> None:
    load = workloads.make_shared_prefix(10, 3, 40, (5, 12), (4, 8), seed=1)
    prompts = load.prompts(vocab_size=64, round_index=0)
    assert [len(p) for p in prompts] == load.input_lens
    assert all(40 + 5 <= n <= 40 + 12 for n in load.input_lens)
    assert list(load.groups) == [i % 3 for i in range(10)]
    for i, a in enumerate(prompts):
        for j, b in enumerate(prompts[:i]):
            common = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a),
                                                                                   len(b)))
            assert common == (40 if load.groups[i] == load.groups[j] else 0), (i, j)
    # 10 requests over 3 system prompts: 7 of them reuse 40 tokens, or 36 in pages of 6.
    assert load.predicted_prefill_savings() == 7 * 40
    assert load.predicted_prefill_savings(page_size=6) == 7 * 36
    assert load.first_of_each_group() == [0, 1, 2]
    assert prompts != load.prompts(vocab_size=64, round_index=1), "each round draws anew"
    assert workloads.make_workload(4, (5, 9), (1, 2), 0).predicted_prefill_savings() == 0


def test_a_sharegpt_file_gives_its_first_exchanges(workloads: ModuleType,
                                                   tmp_path: Path) -> None:
    def conversation(*turns: tuple[str, str]) -> dict:
        return {"id": "x", "conversations": [{"from": f, "value": v} for f, v in turns]}

    data = [conversation(("human", "a b c"), ("gpt", "d e")),
            conversation(("gpt", "hello"), ("human", "x y"), ("gpt", "z")),
            conversation(("human", "only a question")),
            {"no": "conversations"},
            conversation(("human", "one two three four five six"), ("gpt", "seven"))]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))

    def encode(text: str) -> list[int]:
        return [len(word) for word in text.split()]

    load = workloads.load_sharegpt(path, encode, num_requests=2, seed=0, max_input=5)
    assert load.kind == "sharegpt"
    pairs = sorted(zip(map(tuple, load.prompts(100, 0)), load.output_lens))
    assert pairs == [((1, 1), 1), ((1, 1, 1), 2)], "the six-word prompt is over max_input"
    assert load.prompts(100, 0) == load.prompts(100, 7), "a dataset is the same every round"
    with pytest.raises(ValueError, match="fewer than the 3 requests"):
        workloads.load_sharegpt(path, encode, num_requests=3, seed=0, max_input=5)


# =========================================================================== the tiny model
@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 4])
def test_the_radix_cache_saves_the_predicted_prefill_tokens(
        offline: ModuleType, workloads: ModuleType, tiny_model_dir: Path,
        page_size: int) -> None:
    from minisgl.core import Req, SamplingParams
    from minisgl.llm import LLM

    load = workloads.make_shared_prefix(9, 3, 30, (3, 10), (2, 5), seed=0)
    prompts = load.prompts(vocab_size=256, round_index=0)
    seeds = load.first_of_each_group()
    saved = {}
    for cache in ("radix", "naive"):
        llm = LLM(str(tiny_model_dir), device="cpu", prefix_cache=cache, page_size=page_size)

        def reqs(indices: list[int]) -> list[Req]:
            return [Req(i, prompts[i], SamplingParams(max_tokens=load.output_lens[i],
                                                      ignore_eos=True)) for i in indices]

        trace = offline.run_traced(llm.scheduler, [
            (None, reqs(seeds)), (None, reqs([i for i in range(9) if i not in seeds]))])
        assert trace.prompt_tokens == sum(load.input_lens)
        assert sorted(len(t) for t in trace.token_s.values()) == sorted(load.output_lens)
        saved[cache] = trace.prompt_tokens - trace.prefill_tokens
    assert saved == {"radix": load.predicted_prefill_savings(page_size), "naive": 0}
    assert saved["radix"] == 6 * (30 // page_size * page_size)


@pytest.fixture(scope="module")
def ablations(offline: ModuleType, tiny_model_dir: Path,
              tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, str]:
    """The JSON report, its path, and what the run printed."""
    out = tmp_path_factory.mktemp("ablations") / "ablations.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        offline.main(["--model", str(tiny_model_dir), "--device", "cpu", "--ablations", "all",
                      "--systems", "minisgl", "--no-progress", *SMALL_ABLATIONS,
                      "--out", str(out)])
    return json.loads(out.read_text()), out, printed.getvalue()


@pytest.mark.slow
def test_every_ablation_arm_counts_the_tokens_it_asked_for(
        ablations: tuple[dict, Path, str], workloads: ModuleType) -> None:
    report = ablations[0]
    arms = {(name, label): r for r in report["results"] for name, label in r["arms"].items()}
    assert set(arms) == {
        ("cuda-graph", "graphs on"), ("cuda-graph", "graphs off"), ("overlap", "overlap on"),
        ("overlap", "overlap off"), ("fused", "fused on"), ("fused", "fused off"),
        ("prefix-cache", "radix"), ("prefix-cache", "naive"),
        ("chunked-prefill", "chunked"), ("chunked-prefill", "unchunked")}
    base = arms[("cuda-graph", "graphs on")]
    assert base is arms[("overlap", "overlap on")] is arms[("fused", "fused on")], \
        "the base arm is one measurement, read by three ablations"
    random_load = workloads.make_workload(6, (6, 16), (6, 16), seed=0)
    shared = workloads.make_shared_prefix(6, 2, 30, (6, 16), (6, 16), seed=0)
    for r in report["results"]:
        assert r["output_lens_ok"], r["arms"]
        assert r["tok_per_s"] == pytest.approx(r["output_tokens"] / r["wall_s"])
        assert r["saved_tokens"] == r["prompt_tokens"] - r["prefill_tokens"]
        if r["workload"] == "random":
            assert r["output_tokens"] == sum(random_load.output_lens)
            assert r["prompt_tokens"] == r["prefill_tokens"] == sum(random_load.input_lens)
        if r["workload"] == "shared-prefix":
            assert r["output_tokens"] == sum(shared.output_lens)
            assert r["prompt_tokens"] == sum(shared.input_lens)
    assert arms[("prefix-cache", "radix")]["saved_tokens"] == \
        arms[("prefix-cache", "radix")]["predicted_saving"] == shared.predicted_prefill_savings()
    assert arms[("prefix-cache", "naive")]["saved_tokens"] == 0
    chunked, whole = arms[("chunked-prefill", "chunked")], arms[("chunked-prefill", "unchunked")]
    # 3 short requests of 16 tokens out, 2 long prompts of 8; the same work either way.
    assert chunked["output_tokens"] == whole["output_tokens"] == 3 * 16 + 2 * 8
    assert chunked["engine"]["chunked_prefill"] and not whole["engine"]["chunked_prefill"]
    assert chunked["ttft_ms"] is not None and chunked["itl_ms"] is not None


@pytest.fixture(scope="module")
def online_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("online") / "online.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmark" / "online.py"), "--model", str(tiny_model_dir),
         "--device", "cpu", "--workload", "shared-prefix", "--num-prefixes", "2",
         "--prefix-len", "24", "--rates", "20,inf", "--num-requests", "8", "--min-input", "2",
         "--max-input", "8", "--min-output", "2", "--max-output", "10",
         "--max-concurrency", "2", "--goodput", "ttft=2000,tpot=100", "--warmup-requests", "1",
         "--no-progress", "--out", str(out)],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_the_online_benchmark_keeps_its_cap_and_computes_goodput_from_its_requests(
        online_run: dict, measure: ModuleType) -> None:
    objectives = measure.Objectives(ttft_ms=2000.0, tpot_ms=100.0)
    assert online_run["workload"]["kind"] == "shared-prefix"
    for result in online_run["results"]:
        requests = result["requests"]
        assert result["errors"] == 0
        assert [r["completion_tokens"] for r in requests] == [r["output_len"] for r in requests]
        assert result["output_tokens"] == sum(r["output_len"] for r in requests)
        # Never more than two requests between their send and the end of their stream.
        events = sorted([(r["sent_s"], 1) for r in requests]
                        + [(r["sent_s"] + r["e2e_s"], -1) for r in requests],
                        key=lambda e: (e[0], e[1]))
        in_flight = peak = 0
        for _, step in events:
            in_flight += step
            peak = max(peak, in_flight)
        assert peak <= 2, f"{peak} requests in flight under --max-concurrency 2"
        met = sum(objectives.met(r["ttft_s"], r["tpot_s"], r["e2e_s"]) for r in requests)
        assert result["goodput"]["met"] == met
        assert result["goodput"]["per_s"] == pytest.approx(met / result["duration_s"])


@pytest.mark.slow
def test_plots_are_redrawn_byte_for_byte_from_the_json(
        plots: ModuleType, ablations: tuple[dict, Path, str], online_run: dict,
        tmp_path: Path) -> None:
    online_path = tmp_path / "online.json"
    online_path.write_text(json.dumps(online_run))
    first = plots.write_figures(online_path, ablations[1], tmp_path / "a")
    again = plots.write_figures(online_path, ablations[1], tmp_path / "b")
    assert [p.name for p in first] == [p.name for p in again] == [
        "ch19_latency_throughput.svg", "ch19_ttft_by_rate.svg", "ch19_tpot_by_rate.svg",
        "ch19_itl_cdf.svg", "ch19_ablations.svg"]
    for a, b in zip(first, again):
        assert a.read_bytes() == b.read_bytes(), f"{a.name} differs between two drawings"
    # The figures carry the data: one marker per rate and percentile, one bar per arm.
    ttft = (tmp_path / "a" / "ch19_ttft_by_rate.svg").read_text()
    assert ttft.count("<circle") == 2 * len(online_run["results"])
    bars = (tmp_path / "a" / "ch19_ablations.svg").read_text()
    arms = sum(len(r["arms"]) for r in ablations[0]["results"])
    assert bars.count("<rect") - 1 == arms, "one bar per arm (and the background)"
    # A changed number changes the figure.
    online_run["results"][0]["ttft_ms"]["p50"] *= 2
    online_path.write_text(json.dumps(online_run))
    changed = plots.write_figures(online_path, None, tmp_path / "c")
    assert (tmp_path / "c" / "ch19_ttft_by_rate.svg").read_bytes() != \
        (tmp_path / "a" / "ch19_ttft_by_rate.svg").read_bytes()
    assert len(changed) == 4


@pytest.mark.slow
def test_the_ablations_figure_reads_the_same_bars_from_a_recording_of_the_run(
        plots: ModuleType, ablations: tuple[dict, Path, str]) -> None:
    report, _, printed = ablations
    from_json, from_print = plots.ablation_panels(report), plots.printed_ablation_panels(printed)
    assert [(title, [arm for arm, _ in bars]) for title, bars in from_print] == \
        [(title, [arm for arm, _ in bars]) for title, bars in from_json]
    for (_, printed_bars), (_, bars) in zip(from_print, from_json):  # printed to 0.1
        assert [v for _, v in printed_bars] == pytest.approx([v for _, v in bars], abs=0.051)


def test_the_moe_paths_agree_and_count_the_experts_they_read(
        repo_script: Callable[[str], ModuleType], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    # Only the config is read: the benchmark draws its own weights.
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_tiny_model.py"), "--arch",
                    "qwen3-moe", "--no-weights", "--out", str(tmp_path)],
                   check=True, cwd=ROOT, capture_output=True)
    moe_paths = repo_script("benchmark/moe_paths.py")
    config = json.loads((tmp_path / "config.json").read_text())
    rows = moe_paths.main(["--model", str(tmp_path), "--device", "cpu", "--dtype", "float32",
                           "--tokens", "1,3,64", "--repeats", "1"])
    assert [r["tokens"] for r in rows] == [1, 3, 64]
    top_k, num_experts = config["num_experts_per_tok"], config["num_experts"]
    assert rows[0]["experts_hit"] == top_k  # one token visits exactly top_k distinct experts
    assert all(top_k <= r["experts_hit"] <= min(num_experts, r["tokens"] * top_k) for r in rows)
    for r in rows:  # float32 on a CPU: the grouped path sums what the loop sums
        assert set(r["errors"]) == {"grouped"} and r["errors"]["grouped"] < 1e-5, r
        assert r["reference_ms"] > 0 and r["grouped_ms"] > 0
    assert "grouped ms" in capsys.readouterr().out


@pytest.mark.slow
def test_the_offline_benchmark_runs_tensor_parallel_ranks_and_stops_them(
        offline: ModuleType, tiny_model_dir: Path, tmp_path: Path) -> None:
    import psutil

    def workers() -> set[int]:
        # Ranks start as spawned interpreters; multiprocessing's resource tracker (also a
        # child, and meant to outlive them) does not run spawn_main.
        return {p.pid for p in psutil.Process().children(recursive=True)
                if "spawn_main" in " ".join(p.cmdline())}

    before = workers()
    out = tmp_path / "tp.json"
    offline.main(["--model", str(tiny_model_dir), "--device", "cpu", "--tp", "2",
                  "--systems", "minisgl", "--minisgl-configs", "overlap+radix",
                  "--num-requests", "5", "--min-len", "4", "--max-len", "12", "--no-progress",
                  "--out", str(out)])
    (result,) = json.loads(out.read_text())["results"]
    assert result["output_lens_ok"] and result["output_tokens"] == result["computed_tokens"]
    assert workers() - before == set(), "rank 1 outlived the benchmark"


def test_decode_latency_subtracts_the_prefill_run(repo_script: Callable[[str], ModuleType]) -> None:
    """A fake LLM whose request costs 30 ms plus 4 ms per token: 4 ms per decode step."""
    import time

    latency = repo_script("benchmark/decode_latency.py")

    class FakeLLM:
        def generate(self, prompts: list[list[int]], params: object) -> None:
            time.sleep(0.030 + 0.004 * params.max_tokens)

    steps = latency.decode_step_ms(FakeLLM(), [1, 2, 3], max_tokens=11, repeats=2)
    assert len(steps) == 2
    assert all(3.5 < ms < 6.0 for ms in steps), steps


def test_the_host_step_benchmark_times_whole_decode_batches_without_the_model(
        repo_script: Callable[[str], ModuleType], tiny_model_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every timed step is a decode step of the whole batch, staged as a graph replay stages
    it; the engine's own run (the model and attention) never runs; nothing is left behind."""
    from minisgl.attention import fi
    from minisgl.engine.engine import Engine

    host_step = repo_script("benchmark/host_step.py")
    staged: list[int] = []
    real_arrays = fi.page_arrays

    def stage(table: object, layout: Any) -> dict:
        staged.append(layout.size)
        return real_arrays(table, layout)

    def device_work(self: Engine, batch: object, use_graph: bool = True) -> None:
        raise AssertionError("the model ran")

    monkeypatch.setattr(fi, "page_arrays", stage)
    monkeypatch.setattr(Engine, "logits", device_work)
    times = host_step.host_step_ms(str(tiny_model_dir), batch_size=5, context_len=20, steps=4)
    assert len(times) == 4 and all(t > 0 for t in times)
    assert staged == [5] * 5  # the four timed steps, and the last, where every request finishes


def test_the_host_step_benchmark_runs_the_offline_workload_without_the_model(
        repo_script: Callable[[str], ModuleType], tiny_model_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every request of offline.py's workload gets exactly its drawn number of tokens, and the
    engine's own run never happens."""
    from minisgl.engine.engine import Engine

    host_step = repo_script("benchmark/host_step.py")
    offline = repo_script("benchmark/offline.py")

    def device_work(self: Engine, batch: object, use_graph: bool = True) -> None:
        raise AssertionError("the model ran")

    monkeypatch.setattr(Engine, "logits", device_work)
    seconds, outputs = host_step.offline_host_seconds(str(tiny_model_dir), num_requests=6,
                                                      min_len=4, max_len=12, seed=3)
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    workload = offline.make_workload(6, 4, 12, 3, vocab_size=vocab)
    assert seconds > 0
    assert [len(ids) for ids in outputs] == workload.output_lens
