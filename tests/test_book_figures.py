"""The figures a chapter page derives from a recorded output, recomputed from that recording.

A page reads its recording line by line and does arithmetic on it ("12,418 = 4,096 × 3 + 130
bytes"). When an example changes and is recorded again, these tests fail until the page's
figures are brought up to date.
"""
from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Callable
from decimal import ROUND_HALF_UP, Decimal
from fractions import Fraction
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def recording(name: str) -> str:
    """The text of `docs/recorded/<name>.txt`."""
    return (ROOT / "docs" / "recorded" / f"{name}.txt").read_text(encoding="utf-8")


def page(chapter: str) -> str:
    """The chapter page `chapters/<chapter>_*.md`, its line breaks turned into spaces so a
    figure the page wraps over two lines is still found."""
    (path,) = (ROOT / "chapters").glob(f"{chapter}_*.md")
    return " ".join(path.read_text(encoding="utf-8").split())


def labelled(name: str) -> dict[str, list[str]]:
    """A recording's lines, keyed by their label: the text before the first run of two or more
    spaces (or before `=`), with the values after it split on such runs.

    `"KV bytes per token, fp32      4,096      229,376"` -> `{"KV bytes per token, fp32":
    ["4,096", "229,376"]}`; `"  MINISGL_LOG_LEVEL = 'INFO'"` -> `{"MINISGL_LOG_LEVEL": ["'INFO'"]}`.
    The whole text is under the key `""`.
    """
    text = (ROOT / "docs" / "recorded" / f"{name}.txt").read_text(encoding="utf-8")
    lines: dict[str, list[str]] = {"": [text]}
    for line in text.splitlines():
        parts = [p for p in re.split(r"\s{2,}|\s=\s", line.strip()) if p]
        if len(parts) > 1:
            lines.setdefault(parts[0], parts[1:])
    return lines


def leading_number(text: str) -> float:
    """`"4,096"`, `"16.0 MiB"`, `"1.79e-06"` -> the number at the start."""
    match = re.match(r"-?[\d,]*\.?\d+(?:e[+-]?\d+)?", text.strip())
    assert match, f"no number at the start of {text!r}"
    return float(match.group().replace(",", ""))


def found(text: str, pattern: str, flags: int = 0) -> tuple[str, ...]:
    """The groups the first match of `pattern` in `text` captures, as printed."""
    m = re.search(pattern, text, flags)
    assert m, f"{pattern!r} not found in the recording"
    return m.groups()


def number(text: str, pattern: str) -> int:
    """The integer the first group of `pattern` captures in `text` (commas allowed)."""
    return int(found(text, pattern)[0].replace(",", ""))


def assert_on_page(chapter: str, *figures: str) -> None:
    text = page(chapter)
    missing = [f for f in figures if f not in text]
    assert not missing, f"{chapter}'s page does not state {missing}, which its recording gives"


def rows(text: str, pattern: str) -> list[re.Match[str]]:
    """Every line of ``text`` that matches ``pattern`` from its start."""
    return [m for m in (re.match(pattern, line) for line in text.splitlines()) if m]


# --------------------------------------------------------------------------- chapters 1-4
def test_ch01_kv_figures() -> None:
    rec = labelled("ch01_config-cpu")
    text = page("ch01")
    tiny_fp32, qwen_fp32 = (int(leading_number(v)) for v in rec["KV bytes per token, fp32"])
    tiny_bf16, qwen_bf16 = (int(leading_number(v)) for v in rec["KV bytes per token, bf16"])
    assert (tiny_bf16, qwen_bf16) == (tiny_fp32 // 2, qwen_fp32 // 2)
    assert f"{tiny_fp32:,} and {qwen_fp32:,} bytes per token in float32" in text
    assert f"({tiny_bf16:,} and {qwen_bf16:,})" in text

    # the 4,096-token context, with and without GQA
    qwen_context = leading_number(rec["4096-token context, bf16"][1])
    assert qwen_context == 4096 * qwen_bf16 / 2**20
    without_gqa = leading_number(rec["without GQA, bf16"][1])
    assert without_gqa == 2 * qwen_context
    assert f"costs Qwen3-0.6B {qwen_context:.0f} MiB in bfloat16" in text
    assert f"the {without_gqa:.0f} MiB it would cost" in text

    # one sequence at the full trained length
    max_positions = int(leading_number(rec["max positions"][1]))
    full = max_positions * qwen_bf16 / 2**30
    assert f"{max_positions:,} × {qwen_bf16:,} bytes = {full:g} GiB" in text

    # the default CPU budget in tiny-qwen3 tokens
    budget = int(leading_number(rec["MINISGL_CPU_KV_MEMORY"][0]))
    tokens = budget // tiny_fp32
    assert f"holds {tokens:,} tokens of tiny-qwen3 in fp32" in rec[""][0]
    assert f"{budget:,} bytes divided by {tiny_fp32:,} bytes per token holds {tokens:,}" in text


def test_ch02_layer_differences() -> None:
    rec = labelled("ch02_layers-cpu")
    text = page("ch02")
    diffs = {label: leading_number(values[-1]) for label, values in rec.items()
             if values and re.fullmatch(r"\d\.\d\de[+-]\d\d", values[-1])}
    exact = [label for label, diff in diffs.items() if diff == 0]
    inexact = {label: diff for label, diff in diffs.items() if diff != 0}
    assert len(diffs) == 13, f"expected 13 comparisons, read {sorted(diffs)}"
    assert len(exact) == 12 and "thirteen comparisons" in text and "twelve come out bit" in text
    (label, diff), = inexact.items()
    assert label.startswith("RowParallelLinear, 2 ranks")
    assert f"reads {diff:.2e}" in text
    # "under four units in the last place" for outputs of about 5: float32 spacing in [4, 8)
    ulp = 2.0 ** (2 - 23)
    assert f"{ulp:.1e}".replace("e-0", "e-") in text and diff / ulp < 4


def test_ch03_logits_figures() -> None:
    rec = labelled("ch03_qwen3-cpu")
    text = page("ch03")
    params = re.search(r"([\d,]+) parameters", rec[""][0]).group(1)
    assert f"**{params}**" in text, "the table's total is the recorded parameter count"
    rows, vocab = map(int, re.search(r"logits \((\d+), (\d+)\)", rec[""][0]).groups())
    prompt = re.search(r"-> (\d+) tokens", rec[""][0]).group(1)
    assert int(prompt) == rows and f"The prompt is {rows} tokens" in text
    assert f"the {rows * vocab:,} differences" in text
    absolute, relative = re.search(r"max abs diff (\S+), relative (\S+)", rec[""][0]).groups()
    assert f"is {absolute};" in text and f"that is {relative}," in text


def test_ch04_sampling_and_cache_figures() -> None:
    rec = labelled("ch04_generate-cpu")
    text = page("ch04")
    whole = rec[""][0]
    first_step = {m.group(1).strip(): (int(m.group(2)), float(m.group(3)))
                  for m in re.finditer(r"^  (\S.*?)\s+kept\s+(\d+)\s+p\(top\) (\S+)", whole, re.M)}
    kept_t1, top_t1 = first_step["temperature 1.0"]
    assert f"keeps all {kept_t1:,} tokens, the best at {top_t1}" in text
    assert f"sharpens that best to {first_step['temperature 0.3'][1]}" in text
    kept_k, top_k = first_step["top-k 5"]
    assert f"{top_t1} / {top_k:.4f} ≈ {round(100 * top_t1 / top_k)}%" in text
    kept_p, top_p = first_step["top-p 0.5"]
    assert round(top_p / top_t1) == 2
    assert f"keeps {kept_p}, its best at {top_p}, twice {top_t1}" in text
    kept_min_p, _ = first_step["min-p 0.2"]
    assert f"keeps the {kept_min_p} tokens above 0.2 × {top_t1} = {0.2 * top_t1:.4f}" in text

    # the settings that share the seed part where a filter removed the token the noise favoured
    runs = [list(map(int, re.findall(r"\d+", m.group(1))))
            for m in re.finditer(r"ids \[([\d, ]+)\]", whole)]
    _greedy, t1, _t03, topk, topp = runs[:5]
    shared = next(i for i, (a, b) in enumerate(zip(t1, topp)) if a != b)
    assert shared == 5 and f"same five tokens ({', '.join(map(str, t1[:5]))})" in text
    assert f"the nucleus lacked {t1[5]}" in text
    assert topk[1] != t1[1] and f"where {t1[1]} was not among the five best" in text
    assert all(run[0] == t1[0] for run in runs[1:]) and f"starts with {t1[0]}" in text

    # token passes with and without the cache, and the measured speed-up
    prompt = int(re.search(r"-> (\d+) tokens", whole).group(1))
    new = int(re.search(r"greedy, (\d+) new tokens", whole).group(1))
    without = new * prompt + new * (new - 1) // 2
    with_cache = prompt + new - 1
    passes = f"**{without:,}** against **{with_cache:,}**, {without // with_cache} times fewer"
    assert passes in text
    slow = leading_number(rec["no cache (re-run every token)"][0])
    fast = leading_number(rec["contiguous KV cache"][0])
    assert f"speed-up: {fast / slow:.1f}x" in whole
    assert f"{fast / slow:.1f} times faster: {slow} tokens per second without, {fast} with" in text


# --------------------------------------------------------------------------- chapter 5
def ch05_free_pages(page_size: int) -> list[int]:
    """The four 'free pages' counts of one page size's story in chapter 5's recording."""
    text = recording("ch05_paged_kv-cpu")
    block = text.split(f"page size {page_size}:")[1].split("\n\n")[0]
    return [int(n) for n in re.findall(r"free pages\s+(\d+) /", block)]


def test_ch05_pages_taken_and_returned_follow_from_the_free_counts() -> None:
    text = recording("ch05_paged_kv-cpu")
    slots = number(text, r"= ([\d,]+) token slots")
    arrive, finish, newcomers, decoded = ch05_free_pages(1)
    small = ch05_free_pages(16)
    assert_on_page(
        "ch05",
        f"{slots:,} − {arrive} = {slots - arrive:,} pages",
        f"{finish:,} − {arrive} = {finish - arrive}",
        f"{finish:,} − {newcomers} = {finish - newcomers}",
        f"leaving {decoded}",
        f"128 − {small[0]} = {128 - small[0]}",
        f"{small[1] - small[0]} come back",
        f"newcomers take {small[1] - small[2]}",
    )


def test_ch05_memory_table_and_worked_slot_follow_from_the_rows() -> None:
    text = recording("ch05_paged_kv-cpu")
    rows = re.findall(r"row\s+\d+\s+(r\d+)\s+(\d+) tokens\s+\[([\d ]+)\]", text)
    live_tokens = sum(int(n) for _, n, _ in rows)
    held_16 = sum(16 * len(pages.split()) for _, _, pages in rows)
    reserved = 512 * len(rows)
    assert live_tokens == number(text, r"\(([\d,]+) tokens\)")
    assert_on_page(
        "ch05",
        f"hold {live_tokens:,} tokens",
        f"{reserved:,} slots, {reserved - live_tokens:,} of them ({round(100 * (reserved - live_tokens) / reserved)}%)",
        f"16-token pages hold {held_16:,}",
        f"the {held_16 - live_tokens} idle slots",
    )
    # The page's worked slots: r9's positions 100 and 130.
    pages = [int(p) for p in next(p for name, _, p in rows if name == "r9").split()]
    first, last = (pages[100 // 16], 100 % 16), (pages[130 // 16], 130 % 16)
    assert_on_page(
        "ch05",
        f"[{' '.join(map(str, pages))}]",
        f"page {first[0]}, offset {first[1]}: slot {first[0]} × 16 + {first[1]} = "
        f"{first[0] * 16 + first[1]}",
        f"page {last[0]} at offset {last[1]}: slot {last[0] * 16 + last[1]:,}",
    )


# --------------------------------------------------------------------------- chapter 6
def ch06_batch(text: str) -> tuple[list[tuple[int, int, int]], dict[int, list[int]], int]:
    """The (row, cached, new) spans, each row's pages and the page size the recording prints."""
    head = re.search(r"one batch, (\d+)-token pages: \(row, cached, new\) = (.*)", text)
    assert head, "the recording has no 'one batch' line"
    spans = [tuple(map(int, s)) for s in re.findall(r"\((\d+), (\d+), (\d+)\)", head.group(2))]
    rows = {int(r): [int(p) for p in pages.split(", ")]
            for r, pages in re.findall(r"row (\d+) pages \[([\d, ]+)\]", text)}
    return spans, rows, int(head.group(1))  # type: ignore[return-value]


def printed(text: str, name: str) -> list[int]:
    m = re.search(rf"^\s*{name}\s+\[([\d, ]+)\]", text, re.M)
    assert m, f"the recording has no {name} line"
    return [int(x) for x in m.group(1).split(", ")]


def test_ch06_metadata_follows_from_the_batch_and_the_page_states_it() -> None:
    for tag in ("cpu", "cuda"):
        text = recording(f"ch06_attention-{tag}")
        spans, rows, page_size = ch06_batch(text)
        positions, out_loc, last, pages, last_len = [], [], [], [], []
        for row, cached, new in spans:
            total = cached + new
            mine = rows[row][: -(-total // page_size)]
            for pos in range(cached, total):
                positions.append(pos)
                out_loc.append(mine[pos // page_size] * page_size + pos % page_size)
            last.append(len(positions) - 1)
            pages.append(mine)
            last_len.append(total - (len(mine) - 1) * page_size)

        def indptr(lengths: list[int]) -> list[int]:
            return [sum(lengths[:i]) for i in range(len(lengths) + 1)]

        derived = {
            "positions": positions, "out_loc": out_loc, "last_indices": last,
            "qo_indptr": indptr([n for _, _, n in spans]),
            "kv_indptr": indptr([c + n for _, c, n in spans]),
            "page_indptr": indptr([len(p) for p in pages]),
            "page_indices": [x for p in pages for x in p], "last_page_len": last_len,
        }
        for name, value in derived.items():
            assert printed(text, name) == value, f"{tag}: {name} is not what the batch gives"
    news = [n for _, _, n in spans]
    assert_on_page(
        "ch06",
        f"`{' + '.join(map(str, news))} = {sum(news)}` tokens",
        f"slots {rows[0][1]} × 16 + 4 = {out_loc[0]} to {out_loc[news[0] - 1]}",
        f"{out_loc[news[0]]} to {out_loc[news[0] + news[1] - 1]}",
        f"slot {out_loc[-1]}",
        f"`qo_indptr = {derived['qo_indptr']}`",
        f"`kv_indptr {derived['kv_indptr']}`",
        f"indptr = {derived['page_indptr']}",
        f"indices = {derived['page_indices']}",
        f"last_page_len = {derived['last_page_len']}",
        f"− 1 = {last}`",
    )


def test_ch06_errors_on_the_page_are_the_recorded_ones() -> None:
    cpu, cuda = recording("ch06_attention-cpu"), recording("ch06_attention-cuda")
    torch16 = re.search(r"torch\s+16\s+(\S+)\s+(\S+)\s+(\S+)", cpu)
    torch1 = re.search(r"torch\s+1\s+(\S+)\s+(\S+)\s+(\S+)", cpu)
    fi16 = re.search(r"flashinfer\s+16\s+(\S+)\s+(\S+)\s+(\S+)", cuda)
    model = re.search(r"torch\s+max \|logits paged - dense\| = (\S+), same greedy token at "
                      r"(\d+)/(\d+)", cpu)
    fi_model = re.search(r"flashinfer\s+max \|logits paged - dense\| = (\S+), same greedy token "
                         r"at (\d+)/(\d+)", cuda)
    largest = re.search(r"largest \|logit\| (\S+);", cuda)
    assert torch16 and torch1 and fi16 and model and fi_model and largest
    assert_on_page(
        "ch06",
        f"{torch1.group(2)} with cached prefixes",
        f"{torch1.group(3)} and {torch16.group(3)} for decode",
        f"within {model.group(1)} of per-prompt",
        f"all {model.group(3)} positions",
        f"FlashInfer is {fi16.group(1)} off",
        f"within {fi_model.group(1)} of the dense run's",
        f"largest logit of {largest.group(1)}",
        f"{fi_model.group(2)} of {fi_model.group(3)} positions",
    )


# --------------------------------------------------------------------------- chapter 7
def test_ch07_budget_table_follows_from_both_recordings() -> None:
    for tag in ("cpu", "cuda"):
        text = recording(f"ch07_engine-{tag}")
        budget = number(text, r"budget\s+([\d,]+) bytes")
        token = number(text, r"one token .* = ([\d,]+) bytes")
        page_bytes = number(text, r"one page\s+\d+ tokens = ([\d,]+) bytes")
        pages = number(text, r"pages\s+[\d,]+ // [\d,]+ = ([\d,]+)")
        pool = number(text, r"pool\s+([\d,]+) pages")
        assert pages == budget // page_bytes, f"{tag}: pages are not budget // page bytes"
        cap = 256 * -(-4096 // 4) + 1
        assert pool == min(pages, cap), f"{tag}: the pool is not the budget capped at {cap:,}"
        assert_on_page("ch07", f"{budget:,}", f"{token:,} bytes", f"{page_bytes:,} bytes",
                       f"{pages:,}", f"{pool:,} pages, {pool * 4:,} tokens")
    cpu_budget = number(recording("ch07_engine-cpu"), r"budget\s+([\d,]+) bytes")
    assert_on_page("ch07", f"{cpu_budget:,} // 16,384 = {cpu_budget // 16384:,} pages")


def test_ch07_pages_used_follow_from_the_prompts() -> None:
    text = recording("ch07_engine-cpu")
    prompts = [int(n) for n in re.findall(r"(\d+) tokens", text.split("prompts:")[1].split("(")[0])]
    steps = re.findall(r"^\s+(\d+)\s+(?:prefill|decode).*?(\d+) \(\+(\d+)\)$", text, re.M)
    assert len(steps) == 9, "the recording should show a prefill and eight decode steps"
    for step, used, _ in steps:
        tokens = [n + int(step) for n in prompts]  # step k feeds the k-th sampled token
        assert int(used) == sum(-(-n // 4) for n in tokens), f"step {step}: pages used"
    first = [-(-n // 4) for n in prompts]
    last = [n + 8 for n in prompts]
    assert_on_page(
        "ch07",
        f"{' + '.join(map(str, first))} = {sum(first)} pages",
        f"{int(steps[-1][1])} pages for {sum(last)} tokens",
        f"step 8 ({', '.join(map(str, last))})",
    )


# --------------------------------------------------------------------------- chapter 8
def test_ch08_timing_table_follows_from_the_recording() -> None:
    text = recording("ch08_cuda_graph-cuda-qwen3-0.6b-like")
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x\s+yes\s+(\S+)\s+(\d+)/(\d+)$",
                      text, re.M)
    assert [int(r[0]) for r in rows] == [1, 8, 64, 256], "the recording's batch sizes changed"
    for batch, eager, graph, speedup, diff, same, total in rows:
        assert f"{float(eager) / float(graph):.1f}" == speedup, f"batch {batch}: speed-up"
        assert same == total == batch and float(diff) == 0.0, f"batch {batch}: eager differs"
        assert_on_page("ch08", f"| {batch} | {eager} | {graph} | "
                               f"{float(eager) - float(graph):.2f} | {speedup}× |")
    eager = {int(r[0]): float(r[1]) for r in rows}
    graph = {int(r[0]): float(r[2]) for r in rows}
    growth = graph[256] - graph[1]
    assert_on_page(
        "ch08",
        f"{eager[8]} ms at batch 8", f"{eager[256]} ms, at batch 256",
        f"(+{eager[256] - eager[8]:.2f} ms)",
        f"{graph[256]} − {graph[1]} = {growth:.2f} ms",
        f"at most {1e3 * growth / 255:.1f} µs per added request",
        re.search(r"captured batch sizes \[[\d, ]+\] in [\d.]+ s", text).group(0),  # type: ignore[union-attr]
    )


def test_ch08_operation_count_on_the_page(tiny_model_dir: Path) -> None:
    """Exercise 1's count: PyTorch operations of one decode forward of tiny-qwen3 on a CPU."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from minisgl.core import Batch, Req, SamplingParams
    from minisgl.engine.config import EngineConfig
    from minisgl.engine.engine import Engine

    class Count(TorchDispatchMode):
        """Counts every operation the dispatcher sees while it is active."""

        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.n += 1
            return func(*args, **(kwargs or {}))

    engine = Engine(EngineConfig(str(tiny_model_dir), device="cpu", dtype="float32",
                                 num_pages=64, cuda_graph=False))
    req = Req(0, list(range(1, 17)), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.pages.reserve(req)
    prefill = Batch([req], "prefill")
    token = engine.forward(prefill).tolist()[0]
    prefill.advance()
    req.append_token(token)
    engine.pages.reserve(req)

    def counted(module: torch.nn.Module) -> Count:
        """Count the operations of every later call of `module`."""
        mode, forward = Count(), module.forward

        def forward_counted(*args: object, **kwargs: object) -> object:
            with mode:
                return forward(*args, **kwargs)

        module.forward = forward_counted  # type: ignore[method-assign]
        return mode

    whole = counted(engine.model)
    layer = counted(engine.model.model.layers[1])
    engine.forward(Batch([req], "decode"))
    layers = len(engine.model.model.layers)
    outside = whole.n - layers * layer.n
    assert_on_page("ch08", f"issues **{whole.n} operations**, {layer.n} per decoder layer and "
                           f"{outside} outside them",
                   f"{outside} + 28 × {layer.n} = {outside + 28 * layer.n:,}")


def test_ch08_padding_share_of_the_default_list() -> None:
    from minisgl.engine.graph import default_capture_sizes, padded_batch_size

    sizes = default_capture_sizes(256)
    shares = [(padded_batch_size(b, sizes) - b) / padded_batch_size(b, sizes)
              for b in range(1, 257)]
    worst = max(range(1, 257), key=lambda b: shares[b - 1])
    assert_on_page("ch08", f"{len(sizes)} sizes", f"average {100 * sum(shares) / 256:.1f}% padding",
                   f"{worst} requests in the graph of {padded_batch_size(worst, sizes)}")


# --------------------------------------------------------------------------------------------
# Chapter 9: continuous batching


def test_ch09_static_and_continuous_batching_of_the_worked_example() -> None:
    """The table of the worked example: eight requests, four slots, decode steps only."""
    wants = dict(zip("ABCDEFGH", (2, 12, 4, 6, 3, 8, 5, 2)))
    static_finish, start = {}, 0
    for group in ("ABCD", "EFGH"):
        for r in group:
            static_finish[r] = start + wants[r]
        start += max(wants[r] for r in group)
    continuous_finish: dict[str, int] = {}
    slots: dict[str, int] = {}  # request -> the step its first token comes
    queue, step = list(wants), 0
    while queue or slots:
        step += 1
        for r in [r for r in slots if slots[r] + wants[r] - 1 < step]:
            continuous_finish[r] = slots.pop(r) + wants[r] - 1
        while queue and len(slots) < 4:
            slots[queue.pop(0)] = step
    assert (start, max(continuous_finish.values())) == (20, 12)
    assert sum(wants.values()) == 42
    assert (round(100 * 42 / (4 * 20)), round(100 * 42 / (4 * 12))) == (52, 88)
    assert sum(static_finish.values()) / 8 == 11.25
    assert round(sum(continuous_finish.values()) / 8, 1) == 7.4


def test_ch09_worst_cases_and_promises_of_the_recording() -> None:
    text = recording("ch09_batching-cpu")
    page_size = int(re.search(r"pages x (\d+) tokens", text).group(1))
    worst = {}
    for m in rows(text, r"\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)(\s|$)"):
        uid, _, prompt, max_tokens, pages = map(int, m.groups()[:5])
        assert pages == math.ceil((prompt + max_tokens - 1) / page_size), f"request {uid}"
        worst[uid] = pages
    assert (worst[2], worst[3]) == (5, 6)  # 12 + 8 - 1 = 19 tokens, 14 + 8 - 1 = 21
    # Promised = every running request's worst case, after every step.
    running: set[int] = set()
    steps = rows(text, r"\s+(\d+)\s+(\+[\d,]+)?\s*(prefill|decode)\s+\[([\d, ]*)\]"
                       r"\s+(\d+)\s+(\d+)\s+(\d+)/16 \[[\d, ]*\]\s*(.*)$")
    assert len(steps) == 20
    for m in steps:
        step, batch = int(m.group(1)), {int(u) for u in m.group(4).split(",")}
        running |= batch
        running -= {int(u) for u in re.findall(r"(\d+):", m.group(8))}
        assert int(m.group(7)) == sum(worst[u] for u in running), f"step {step}"
        if step == 10:
            assert running == {3, 4, 5} and int(m.group(7)) == 6 + 5 + 3
    assert "pages in use after the run: 0 of 16" in text


# --------------------------------------------------------------------------------------------
# Chapter 10: chunked prefill


def test_ch10_chunks_largest_step_and_longest_gap_of_the_recording() -> None:
    text = recording("ch10_chunked-cpu")
    table = rows(text, r"\s+(\d+) (prefill|decode)\s+(\d+)\s+[#.]+\s+(.*)$")
    tokens = [int(m.group(3)) for m in table]
    prompts = {int(u): int(n) for u, n in re.findall(r"(\d+): (\d+)@\d+", text)}
    assert re.findall(r"3 \+(\d+) \(\d+/70\)", text) == ["14", "16", "16", "16", "8"]
    # The steps at which each request gets a token: a decode, or the chunk that ends its prompt.
    token_steps: dict[int, list[int]] = {}
    for step, m in enumerate(table):
        rest = m.group(4)
        if m.group(2) == "decode":
            got = [int(u) for u in rest.split("decode")[1].split()]
        else:
            got = [int(u) for u, done in re.findall(r"(\d+) \+\d+ \((\d+)/\d+\)", rest)
                   if int(done) == prompts[int(u)]]
        for uid in got:
            token_steps.setdefault(uid, []).append(step)
    longest = max(sum(tokens[a + 1: b + 1]) for s in token_steps.values() for a, b in zip(s, s[1:]))
    keys = r"steps|largest step \(tokens\)|longest gap between 2 tokens"
    summary = {key: (int(a), int(b))
               for key, a, b in re.findall(rf"^({keys})\s+(\d+)\s+(\d+)", text, re.M)}
    assert summary["steps"][0] == len(table) == 19
    assert summary["largest step (tokens)"][0] == max(tokens) == 16
    assert summary["longest gap between 2 tokens"][0] == longest == 16 + 4
    # Unchunked, request 0 waits through the prefills of requests 2, 3 and 4, then a decode
    # step of the five requests that have arrived by then.
    assert summary["largest step (tokens)"][1] == prompts[3] == 70
    assert summary["longest gap between 2 tokens"][1] == prompts[2] + prompts[3] + prompts[4] + 5
    assert "outputs equal to the unchunked run: 6 of 6 requests" in text


# --------------------------------------------------------------------------------------------
# Chapter 11: the radix cache


def test_ch11_saving_tree_and_pages_of_the_recording() -> None:
    text = recording("ch11_radix-cpu")
    table = [tuple(map(int, m.groups())) for m in rows(text, r"\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)$")]
    system, page_size = 30, int(re.search(r"pages of (\d+) tokens", text).group(1))
    shared = system // page_size * page_size
    assert shared == 28
    computed = [radix for _, _, _, radix in table]
    assert computed == [table[0][1]] + [prompt - shared for _, prompt, _, _ in table[1:]]
    naive, radix = sum(r[2] for r in table), sum(r[3] for r in table)
    assert (naive, radix, naive - radix) == (316, 120, 196) == (naive, radix, shared * 7)
    assert f"saved: {naive - radix} tokens ({round(100 * (naive - radix) / naive)}%)" in text
    # The tree: every node's pages, "… N more" included, and its last-use tick.
    nodes = re.findall(r"pages \[([\d, ]+)(?:, … (\d+) more)?\]\s+used @(\d+)", text)
    sizes = [len(p.split(",")) + int(more or 0) for p, more, _ in nodes]
    assert sizes == [7, 2, 3, 3, 3, 3, 4, 4, 4] and sum(sizes) == 7 + 2 + 3 * 4 + 4 * 3 == 33
    ticks = [int(t) for _, _, t in nodes]
    assert ticks[0] == 16 and ticks[1] == 2 and ticks[2:] == list(range(10, 17))
    assert "pages: 31 free + 33 cached = 64; 0 locked" in text
    assert "outputs identical with both caches: True" in text


# --------------------------------------------------------------------------------------------
# Chapter 12: overlap scheduling


def test_ch12_steps_and_decode_tokens_of_the_cpu_recording() -> None:
    text = recording("ch12_overlap-cpu")
    batch = r"(pre [\d,]+|dec [\d,*]+|-)"
    timeline = rows(text, rf"\s+(\d+) {batch}\s+{batch}\s+(\S+)$")
    launched = [m.group(2) for m in timeline]
    forward_passes = sum(b != "-" for b in launched)
    decode_tokens = sum(len(b.split()[1].split(",")) for b in launched if b.startswith("dec"))
    outputs = [int(n) for n in re.findall(r"request \d+: (\d+) tokens", text)]
    summary = {key: (int(a), int(b)) for key, a, b in re.findall(
        r"^(steps|forward passes|decode tokens computed)\s+(\d+)\s+(\d+)$", text, re.M)}
    assert summary["steps"] == (13, len(timeline)) == (13, 14)
    assert summary["forward passes"] == (forward_passes, forward_passes) == (13, 13)
    # Synchronous: every output but the prefill's first; overlapped: one dropped token more.
    assert summary["decode tokens computed"] == (sum(outputs) - 6, decode_tokens) == (26, 27)
    assert sum(outputs) == 32


def test_ch12_and_ch15_leave_the_finished_engines_gpu_figures_to_chapter_19() -> None:
    """Chapter 19's GPU runs measure later code than chapter 12's or 15's checkpoint:
    those pages point there and quote none of its figures (the sweep below checks every figure
    they state against their own recordings)."""
    offline = ch19_offline_tok_s()
    online = [float(x) for x in re.findall(r"^rate \S+ [^:]*: .* ([\d.]+) output tok/s",
                                           recording("ch19_online-cuda"), re.M)]
    assert len(online) == 5
    for chapter, figures in (("ch12", [f"{int(offline + 0.5):,}"]),
                             ("ch15", [f"{max(online):,}"])):
        text = " ".join(page(chapter).split())
        assert "[chapter 19](ch19_bench.md)" in text.lower()
        quoted = [f for f in figures if f in text]
        assert not quoted, f"{chapter} quotes chapter 19's {quoted}"


def test_tok_s_figures_of_two_workloads_each_name_theirs() -> None:
    """11,804 tok/s (the ablations' workload, on the H200) and 12,375 (the standard offline
    workload, on an H100) never stand alone."""
    ablations = recording("ch19_ablations-cuda")
    n, low, high = (int(g) for g in re.search(
        r"random: (\d+) requests, prompts and outputs uniform in \[(\d+), (\d+)\]",
        ablations).groups())
    full, = _floats("ch19_ablations-cuda", r"^cuda-graph \[graphs on\]: .* = ([\d.]+) tok/s")
    offline = ch19_offline_tok_s()
    full, offline = int(full + 0.5), int(offline + 0.5)  # the page rounds half up
    short = f"{n} requests of {low} to {high} tokens"
    assert_on_page("ch19", f"{n} requests, prompts and outputs of {low} to {high} tokens (27,358 "
                           f"output tokens). The full engine on this workload: {full:,} tok/s",
                   f"{offline:,} tok/s on this workload (the ablations' {full:,} are on {short}, "
                   f"on the H200)",
                   f"ablations' {short}: {full:,} tok/s",
                   f"on an H100, 256 requests of 100 to 1,024 tokens: {offline:,} tok/s")
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert f"{short}) runs at {full:,} output tokens/s" in readme


# --------------------------------------------------------------------------- chapter 13
def ch13_size(text: str, label: str) -> tuple[int, int]:
    """(msgpack, pickle) bytes of one row of chapter 13's size table."""
    m = re.search(rf"^\s*{re.escape(label)}\s+(\d+)\s+(\d+)$", text, re.M)
    assert m, f"no size row {label!r} in chapter 13's recording"
    return int(m.group(1)), int(m.group(2))


def test_ch13_frame_sizes_are_the_serializers_and_the_recordings() -> None:
    from minisgl.message import DetokenizeRequest, dumps

    text = recording("ch13_messages-cpu")
    # Fields later chapters add are left off the wire at their defaults, so today's serializer
    # still gives chapter 13's size; pickle, which writes every field, is read from the recording.
    ours = len(dumps(DetokenizeRequest(uid=0, next_token=1234)))
    assert ours == 1 + 9 + 18 + 5 + 14 == 47, ours  # the page's byte table
    assert ch13_size(text, "DetokenizeRequest (mid-stream)") == (ours, 120)
    assert ch13_size(text, "UserReply (mid-stream)") == (38, 112)
    assert ch13_size(text, "DetokenizeRequest (last token)")[0] == 130
    assert_on_page("ch13", "47 bytes", "pickle needs 120", "47 against 120", "38 against 112")


def test_ch13_a_long_prompt_is_three_bytes_an_id() -> None:
    from minisgl.core import SamplingParams
    from minisgl.message import UserRequest, dumps

    text = recording("ch13_messages-cpu")
    ours, theirs = ch13_size(text, "UserRequest (4096 prompt tokens)")
    request = UserRequest(0, list(range(1000, 1000 + 4096)), SamplingParams(max_tokens=8))
    header = len(dumps(UserRequest(0, [], SamplingParams(max_tokens=8))))
    assert ours == 4096 * 3 + 130 == 12_418, ours
    assert len(dumps(request)) - header == 4096 * 3 + 2  # 3 bytes an id, a 3-byte array header
    assert_on_page("ch13", "12,418 = 4,096 × 3 + 130", f"pickle's {theirs:,}")


def test_ch13_exercise_one_frame_of_large_ids() -> None:
    from minisgl.message import DetokenizeRequest, dumps

    one = DetokenizeRequest(uid=70_000, next_token=151_000)
    assert len(dumps(one)) == 53
    assert len(dumps([one] * 256)) == 256 * 53 + 3 == 13_571
    assert_on_page("ch13", "= 53", "256 × 53 + 3 = 13,571")


def test_ch13_round_trip_usages() -> None:
    text = recording("ch13_messages-cpu")
    assert "uid 0: prompt [11, 12, 13, 14] -> [14, 13, 12]  finish length, usage 4+3" in text
    assert "uid 1: prompt [21, 22, 23] -> [23, 22]  finish stop, usage 3+2" in text
    assert "fake-scheduler exited with code 0" in text
    assert_on_page("ch13", "usage 4+3", "usage 3+2", "Exit code 0")


# --------------------------------------------------------------------------- chapter 14
def ch14_requests(text: str) -> dict[int, tuple[int, str, int, int, str]]:
    """Requests 1 to 3 of chapter 14's recording: uid -> (replies, finish, prompt tokens,
    completion tokens, the text as Python wrote it), each checked equal to LLM.generate's."""
    found = re.findall(r"request (\d) \(.*?\): (\d+) replies, finish (\w+), usage (\d+)\+(\d+)\n"
                       r" +(.*?)  equal to LLM.generate: (\w+)", text)
    assert [f[0] for f in found] == ["1", "2", "3"], found
    assert all(f[-1] == "True" for f in found), "a reply differs from LLM.generate's"
    return {int(f[0]): (int(f[1]), f[2], int(f[3]), int(f[4]), f[5]) for f in found}


def test_ch14_prompt_tokens_add_up_over_the_four_requests() -> None:
    from minisgl.tokenizer.tokenize import load_tokenizer

    text = recording("ch14_tokenizer-cpu")
    requests = ch14_requests(text)
    prompts = [requests[uid][2] for uid in (1, 2, 3)]
    total = number(text, r"'prompt_tokens': (\d+)")
    chat_ids = number(text, r"(\d+) token ids; equal to transformers")
    assert prompts[1] == chat_ids  # the worker renders the chat as part 1 does
    fourth = total - sum(prompts)  # request 4 was aborted: its usage is never printed
    model = re.search(r"^model: (\S+),", text, re.M).group(1)
    assert fourth == len(load_tokenizer(ROOT / model).encode("Tell me a long story."))
    first, chat, third = prompts
    assert_on_page("ch14", f"`prompt_tokens` is {total}: {first} + {chat} + {third} for requests "
                           f"1 to 3, and {fourth} for request 4", f"{chat_ids} ids, equal to",
                   f"the same {chat_ids} prompt ids as part 1", f"on a CPU, {Path(model).name}")


def test_ch14_stop_string_and_window_counts() -> None:
    import ast

    text = recording("ch14_tokenizer-cpu")
    window = number(text, r"is (\d+) tokens\n")
    assert "pieces joined == full decode: True" in text
    m = re.search(r"the stop string '(.*?)' in '(.*?)' \((\d+) tokens\)\n  pieces: (\[.*\])\n"
                  r"  finish_reason 'stop' after (\d+) tokens, usage (\d+)\+(\d+)", text)
    assert m, "no stop-string part in chapter 14's recording"
    stop, fed = (ast.literal_eval(f"'{g}'") for g in m.group(1, 2))
    fed_tokens, received, prompt, completion = (int(g) for g in m.group(3, 5, 6, 7))
    pieces = ast.literal_eval(m.group(4))
    later = number(text, r"the (\d+) later tokens are dropped")
    assert "".join(pieces) == fed[:fed.index(stop)]  # the answer, the stop string left out
    assert len(pieces) == received == completion and received + later == fed_tokens
    last_text = max(i for i, piece in enumerate(pieces) if piece)
    empty = len(pieces) - 1 - last_text  # the stop string's tokens: held, then dropped
    words = {1: "one", 2: "two", 3: "three", 4: "four"}
    assert_on_page("ch14", f"the {window} pieces joined",
                   f"{received} replies, the last {words[empty]} empty",
                   f"usage {prompt}+{completion}", f"the {later} later tokens")


def test_ch14_pipeline_replies_and_the_stop_string() -> None:
    text = recording("ch14_tokenizer-cpu")
    requests = ch14_requests(text)
    for replies, _, _, completion, _ in requests.values():
        assert replies == completion  # one reply per token, a stop token's included
    stop = re.search(r"request 3 \(text, stop '(.*?)'\)", text).group(1)
    (r1, f1, p1, c1, _), (r2, f2, p2, c2, _), (r3, f3, p3, c3, sent) = (
        requests[uid] for uid in (1, 2, 3))
    assert (f1, f3) == ("length", "stop")
    # the page's whitespace is collapsed before figures are looked for, so the quote's is too
    assert_on_page("ch14", f"`{f1}` with {r1} replies", f"usage {p1}+{c1}", f"usage {p2}+{c2}",
                   f"finish `{f2}`", f"stop string `'{stop}'`", " ".join(f"sent `{sent}`".split()),
                   f"held `'{stop[:2]}'`", f"`{f3}`, usage {p3}+{c3}")


# --------------------------------------------------------------------------- chapter 15
def ch15_stream(text: str) -> tuple[int, int, int, int]:
    """(prompt, completion, total, chunks) of a chapter 15 recording's first chat."""
    m = re.search(r"usage (\d+) \+ (\d+) = (\d+) tokens", text)
    assert m, "no usage line in chapter 15's recording"
    chunks = number(text, r"chat, streamed: (\d+) chunks")
    return int(m.group(1)), int(m.group(2)), int(m.group(3)), chunks


def test_ch15_usage_and_chunks_on_the_cpu() -> None:
    prompt, completion, total, chunks = ch15_stream(recording("ch15_server-cpu"))
    pieces = number(recording("ch15_server-cpu"), r"a role, (\d+) pieces of text")
    assert prompt + completion == total
    assert chunks == 1 + pieces + 1  # the role, one piece per token of text, the finish
    assert_on_page("ch15", f"usage {prompt} + {completion} = {total}", f"{chunks} chunks",
                   f"{pieces} pieces of text")


def test_ch15_usage_and_chunks_on_the_h200() -> None:
    text = recording("ch15_server-cuda-qwen3-0.6b-like")
    prompt, completion, total, chunks = ch15_stream(text)
    pieces = number(text, r"a role, (\d+) pieces of text")
    assert prompt + completion == total and completion == 16
    assert chunks == 1 + pieces + 1 and pieces == 12
    assert_on_page("ch15", "16 tokens came as 12 pieces of text")


def test_ch15_exit_status() -> None:
    assert "exited with code 143; processes left behind: 0" in recording("ch15_server-cpu")
    assert_on_page("ch15", "143 (128 + 15)", "(ch19_bench.md)'s online benchmark")


# --------------------------------------------------------------------------- chapter 16
def test_ch16_every_scene_ends_with_nothing_held() -> None:
    text = recording("ch16_lifecycle-cpu")
    zero = "frontend 0, buffered 0, detokenizer 0, running 0, waiting 0, KV pages 0"
    # idle, and after each of scenes 1 to 4
    assert text.count(zero) == 5, text
    assert "requests aborted so far: 2" in text
    limit = number(text, r"for a model with a context of (\d+)")
    prompt = number(text, r"a prompt of (\d+) tokens")
    assert prompt > limit and (prompt, limit) == (5000, 4096)
    assert "stream=False  HTTP 400" in text and "stream=True   HTTP 400" in text
    assert "never more than 64 replies held for it: True" in text
    assert "the server exited with code 143; processes left behind: 0" in text
    assert_on_page("ch16", "5,000 tokens against the tiny model's 4,096-token context",
                   "its 64 replies", "second abort", "143 (128 + 15)")
    assert "10.3 s" not in page("ch16"), "chapter 16 quotes a time no current recording gives"


# --------------------------------------------------------------------------- chapter 17
def in_words(n: int) -> str:
    """A small count as the pages spell it in prose: `8` -> `"eight"`."""
    words = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
             "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
             "seventeen", "eighteen", "nineteen", "twenty")
    assert 0 <= n < len(words), f"no word for {n}"
    return words[n]


def test_ch17_what_each_rank_holds_of_the_tiny_model() -> None:
    text = recording("ch17_tp-cpu")
    ranks = {int(m.group(1)): [int(g) for g in m.groups()[1:]] for m in rows(
        text, r"\s+(\d+)\s+(\d+)\.\.(\d+)\s+(\d+)\.\.(\d+)\s+(\d+)\.\.(\d+)\s+(\d+)\.\.(\d+)\s+"
              r"(\d+)$")}
    whole = re.search(r"\(whole model: (\d+) q heads, (\d+) kv heads, (\d+) mlp cols, (\d+) "
                      r"vocab rows, (\d+) KV bytes/token in float32\)", text)
    assert sorted(ranks) == [0, 1] and whole, "the recording's split table changed shape"
    q, kv, mlp, vocab, kv_bytes = (int(g) for g in whole.groups())
    (q0, q1, kv0, kv1, m0, m1, v0, v1, rank_kv), second = ranks[0], ranks[1]
    assert q0 == m0 == v0 == kv0 == kv1 == 0  # rank 0 starts every range, with one KV head
    # rank 1 holds the rest of every range, and each rank's KV is half the model's
    assert second[:8] == [q1 + 1, q - 1, kv1 + 1, kv - 1, m1 + 1, mlp - 1, v1 + 1, vocab - 1]
    assert second[8] == rank_kv and 2 * rank_kv == kv_bytes
    assert_on_page(
        "ch17",
        f"Rank 0 holds query heads {q0} and {q1}, KV head {kv0}, the first {m1 + 1} of the MLP's "
        f"{mlp} columns and vocabulary rows {v0} to {v1:,}; rank 1 the rest",
        f"Each rank's KV costs {rank_kv:,} bytes per token, half of the whole model's "
        f"{kv_bytes:,}",
        # the table's tiny-model column, whole model and each of 2 ranks
        f"| query heads (Qwen3-0.6B / tiny) | 16 / {q} | 8 / {q1 - q0 + 1} |",
        f"| KV heads | 8 / {kv} | 4 / {kv1 - kv0 + 1} |",
        f"| MLP width | 3,072 / {mlp} | 1,536 / {m1 - m0 + 1} |",
        f"| vocabulary rows | 151,936 / {vocab:,} | 75,968 / {v1 - v0 + 1:,} |",
        f"/ {kv_bytes:,} (fp32) | 57,344 / {rank_kv:,} |",
    )


def test_ch17_same_outputs_and_half_the_page_at_tp2() -> None:
    text = recording("ch17_tp-cpu")
    prompts = number(text, r"(\d+) prompts, \d+ greedy tokens each")
    tokens = number(text, r"\d+ prompts, (\d+) greedy tokens each")
    same = [m.group(1) for m in rows(text, r".*\d+, \.\.\.\s+(yes|no)$")]
    assert same == ["yes"] * prompts
    assert f"identical outputs: {prompts} of {prompts}" in text
    pools = {int(tp): (int(n), int(b)) for tp, n, b in re.findall(
        r"KV pool, TP=(\d): (\d+) pages x (\d+) B per rank", text)}
    kv_bytes = number(text, r"(\d+) KV bytes/token")
    (pages1, bytes1), (pages2, bytes2) = pools[1], pools[2]
    assert pages1 == pages2 and 2 * bytes2 == bytes1
    assert_on_page(
        "ch17",
        f"Then {in_words(prompts)} prompts, {in_words(tokens)} greedy tokens each",
        f"all {in_words(prompts)} outputs are the same at TP=2 as at TP=1",
        f"the same {pages1} pages of {bytes1 // kv_bytes} tokens",
        f"a TP=2 page is {bytes2:,} bytes per rank, half a TP=1 page",
    )


def test_ch17_time_of_the_batch_at_both_sizes() -> None:
    tp1, tp2 = found(recording("ch17_tp-cpu"), r"time for the batch: TP=1 ([\d.]+) s, "
                                               r"TP=2 ([\d.]+) s")
    assert float(tp2) > float(tp1), "the page says halving the tiny model's matrices does not pay"
    assert_on_page("ch17", f"TP=2 took {tp2} s to TP=1's {tp1} s")


# --------------------------------------------------------------------------- chapter 18
def test_ch20_moe_paths_on_the_h200() -> None:
    rows = {}
    for line in recording("ch20_moe_paths-cuda").splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) == 8 and cells[0].isdigit():
            rows[int(cells[0])] = cells
    ms = {t: {name: float(c[i]) if c[i] != "-" else None
              for i, name in ((2, "floor"), (3, "reference"), (4, "grouped"), (5, "fused"),
                              (6, "graph"))} for t, c in rows.items()}
    # Eagerly the two fast paths are never a third apart; captured, the fused one wins at every T.
    assert all(max(m["grouped"], m["fused"]) / min(m["grouped"], m["fused"]) < 4 / 3
               for m in ms.values())
    assert all(m["graph"] < m["grouped"] for m in ms.values())
    assert round(ms[1]["grouped"] / ms[1]["graph"]) == 4
    errors = [float(e) for c in rows.values() for e in c[7].split(",")]
    assert_on_page("ch20", f"{ms[1]['grouped']:.3f}", f"{ms[1]['fused']:.3f}",
                   f"{ms[1]['floor']:.3f}", f"{ms[1]['graph']:.3f}", f"{ms[8192]['graph']:.3f}",
                   f"{ms[8192]['grouped']:.3f}",
                   f"within {math.ceil(max(errors) * 1000) / 10:.1f}%")
    # The reference loop's slowness, against each faster path separately.
    for path, against in (("grouped", "the eager grouped multiply"),
                          ("fused", "the eager fused kernels"),
                          ("graph", "the captured fused path")):
        slow = [m["reference"] / m[path] for m in ms.values() if m["reference"]]
        assert_on_page("ch20", f"{round(min(slow))} to {round(max(slow))} times slower than "
                               f"{against}")


def test_ch18_hbm_floor_states_which_bandwidth_it_divides_by() -> None:
    text = recording("ch18_models-cpu")
    sheet_ms = float(re.search(r"HBM floor at 4\.8 TB/s, batch 1, sparse: ([\d.]+) ms", text)[1])
    assert_on_page("ch18", "4.8 TB/s of the H200's data sheet", f"{sheet_ms:.2f} ms at the 4.8 TB/s")


def test_ch18_every_family_matches_and_the_tiny_moe_mixes_layers() -> None:
    text = recording("ch18_models-cpu")
    families = re.findall(r"^(\S+): (\w+) -> (\w+), [\d,]+ parameters", text, re.M)
    continuations = rows(text, r"\s+'.*'\s+-> .*(transformers \w+, server \w+)$")
    assert [f[0] for f in families] == ["llama", "qwen2", "qwen3", "qwen3-moe"]
    assert all(config == built for _, config, built in families)
    assert len(continuations) == 3 * len(families)
    assert all(m.group(1) == "transformers same, server same" for m in continuations)
    assert "every family the same as transformers and through the server: True" in text
    experts, per_token, dense = found(
        text, r"(\d+) experts, (\d+) per token; sparse layers \[[\d, ]+\], dense layers \[(\d+)\]")
    assert_on_page("ch18", f"the tiny Qwen3-MoE has {experts} experts, {per_token} per token, and "
                           f"layer {dense} listed in `mlp_only_layers`",
                   "each is the same as `transformers`' continuation and the same through the "
                   "server")


def test_ch18_qwen3_30b_bytes_and_experts_touched() -> None:
    text = recording("ch18_models-cpu")
    experts, top_k = (int(g) for g in found(text, r"(\d+) experts, (\d+) per token, "
                                                  r"moe_intermediate"))
    total, = _floats("ch18_models-cpu", r"all weights:\s+([\d.]+) GB")
    active, share = _floats("ch18_models-cpu", r"read per decode token:\s+([\d.]+) GB \(([\d.]+)% ")
    dense_ms, = _floats("ch18_models-cpu", r"dense, every expert read: ([\d.]+) ms per step")
    touched = {int(b): float(n) for b, n in re.findall(
        r"batch\s+(\d+): about\s+([\d.]+) of \d+ experts read", text)}
    # the page's formula is the recording's: 128 (1 - (1 - 8/128)^B)
    assert all(abs(experts * (1 - (1 - top_k / experts) ** b) - n) < 0.05
               for b, n in touched.items())
    assert round(100 * active / total) == round(share)
    assert_on_page(
        "ch18",
        f"stores {total} GB of bfloat16 weights, but a decode token at batch 1 reads {active} GB "
        f"of them, {round(share)}%",
        f"against {dense_ms:.1f} ms if every expert were read",
        f"Each token picks {top_k} of {experts} experts",
        f"`{experts} (1 - (1 - {top_k}/{experts})^B)` experts per layer: {touched[1]:.0f} at "
        f"batch 1, {touched[16]:.0f} at batch 16, {touched[64]:.0f} at batch 64",
        f"{active} GB of Qwen3-30B-A3B's {total} GB",
    )


# --------------------------------------------------------------------------- chapter 19
def test_ch19_decode_step_profile_and_latency_on_the_h200() -> None:
    rec = recording("ch19_profile-cuda")
    busy = [(float(m.group(1)), int(m.group(2)))
            for m in re.finditer(r"device busy ([\d.]+) ms in (\d+) kernels", rec)]
    family_row = r"^  ([A-Za-z][\w +/-]*?)\s{2,}\d+\s+([\d.]+)\s+[\d.]+%$"
    one, many = ({m.group(1).strip(): float(m.group(2))
                  for m in re.finditer(family_row, block, re.M)}
                 for block in rec.split("batch 128"))
    latency = float(re.search(r": ([\d.]+) ms per step",
                              recording("ch19_decode_latency-cuda")).group(1))
    assert busy[0][1] == busy[1][1], "the same kernels at both batch sizes"
    assert_on_page("ch19", f"busy {busy[0][0]:.2f} ms of a step, in {busy[0][1]:,} kernels",
                   f"| matrix products | {one['GEMMs']:.0f} |",
                   f"| attention | {one['attention']:.0f} |",
                   f"| elementwise arithmetic | {one['other']:,.0f} |",
                   f"| copies and indexing | {one['copies and indexing']:.0f} |",
                   f"The matrix products take {one['GEMMs']:.0f} µs",
                   f"{latency:.2f} ms a step", f"lane is {busy[1][0]:.2f} ms, in the same "
                   f"{busy[1][1]:,} kernels", f"attention {many['attention'] / 1000:.2f} ms")


def test_ch19_host_step_on_the_cpu() -> None:
    rows = {int(m.group(1)): (float(m.group(2)), float(m.group(3))) for m in re.finditer(
        r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)$", recording("ch19_host_step-cpu"), re.M)}
    ms, per_request = rows[128]
    lane = float(re.findall(r"device busy ([\d.]+) ms", recording("ch19_profile-cuda"))[1])
    assert round(lane / ms) == 11, "the page calls the host's share an eleventh of the lane"
    assert_on_page("ch19", f"costs the host {ms:.2f} ms, {per_request:.1f} µs a request",
                   f"an eleventh of the device's {lane:.2f} ms")


def half_up(text: str, places: int = 0) -> Decimal:
    """A figure the recording prints (`"3858.5"`) rounded as the pages round it, half up
    (`Decimal("3859")`), where Python's `round` and format would round half to even."""
    return Decimal(text.replace(",", "")).quantize(Decimal(1).scaleb(-places), ROUND_HALF_UP)


def ch19_transformers_tok_s() -> float:
    """`transformers`' tok/s beside chapter 19's ablations, on their random workload."""
    hf, = _floats("ch19_ablations-cuda", r"\[transformers\]: \d+ output tokens in [\d.]+ s = "
                                         r"([\d.]+) tok/s")
    return hf


def ch19_offline_tok_s() -> float:
    """Chapter 19's engine (overlap, radix) on the standard offline workload."""
    tok_s, = _floats("ch19_offline_bench-cuda", r"^minisgl \(overlap, radix\): .* = ([\d.]+) tok/s")
    return tok_s


def ch19_arm(arm: str) -> dict[str, str]:
    """One arm of chapter 19's ablations, e.g. `"graphs off"`: its tok/s, prompt tokens
    computed and offered, TTFT p50 and p99 and ITL p50, p99 and max, as printed."""
    m = re.search(rf"^[\w-]+ \[{re.escape(arm)}\]: \d+ output tokens in [\d.]+ s = ([\d.]+) tok/s; "
                  r"(\d+) of (\d+) prompt tokens computed, \d+ decode steps;.*TTFT p50/p99 "
                  r"([\d.]+)/([\d.]+) ms; ITL p50/p99/max ([\d.]+)/([\d.]+)/([\d.]+) ms",
                  recording("ch19_ablations-cuda"), re.M)
    assert m, f"no arm {arm!r} in chapter 19's ablations"
    keys = ("tok_s", "computed", "prompt", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "itl_max")
    return dict(zip(keys, m.groups()))


def test_ch19_each_feature_switched_off_alone() -> None:
    full, graphs, overlap, fused = (ch19_arm(a) for a in ("graphs on", "graphs off",
                                                          "overlap off", "fused off"))
    hf = ch19_transformers_tok_s()
    tok_s = float(full["tok_s"])
    slower = {name: tok_s / float(arm["tok_s"])
              for name, arm in (("graphs", graphs), ("overlap", overlap), ("fused", fused))}
    noise = abs(1 - slower["fused"])
    assert noise < 0.01, "this chapter's code has no fused kernels: both arms run the same engine"
    assert_on_page(
        "ch19",
        f"measured twice: {noise:.1%} is noise",
        f"Without CUDA graphs, {half_up(graphs['tok_s']):,} ({slower['graphs']:.1f}× slower), the "
        f"median token gap up from {full['itl_p50']} to {graphs['itl_p50']} ms",
        f"Without overlap, {half_up(overlap['tok_s']):,} ({slower['overlap']:.2f}×)",
        f"Without fused kernels, {half_up(fused['tok_s']):,} ({slower['fused']:.2f}×)",
        f"on one padded batch: {hf} tok/s, {tok_s / hf:.1f} times slower",
        # "How to explain it" and the summary round to one decimal, transformers to a whole
        f"graphs {slower['graphs']:.1f}×, overlap {slower['overlap']:.1f}×, fused kernels "
        f"{slower['fused']:.1f}× (none exist yet)",
        f"{slower['graphs']:.1f}× less without graphs, {slower['overlap']:.1f}× without overlap, "
        f"{round(tok_s / hf)}× less with `transformers`",
    )


def test_ch19_prefix_cache_saves_exactly_the_predicted_tokens() -> None:
    text = recording("ch19_ablations-cuda")
    requests, prompts, prefix = (int(g) for g in found(
        text, r"shared-prefix: (\d+) requests over (\d+) system prompts of (\d+) tokens"))
    base, radix, naive = ch19_arm("graphs on"), ch19_arm("radix"), ch19_arm("naive")
    suffixes, total, computed = int(base["prompt"]), int(radix["prompt"]), int(radix["computed"])
    saved, predicted = (int(g) for g in found(text, r"saved (\d+) \(predicted (\d+)\)"))
    assert total == int(naive["computed"]) == suffixes + requests * prefix
    assert computed == suffixes + prompts * prefix
    assert saved == predicted == total - computed == (requests - prompts) * prefix
    assert_on_page(
        "ch19",
        f"The same {suffixes:,} suffix tokens behind {prompts} system prompts of {prefix:,}: "
        f"{total:,} prompt tokens. The radix cache computes {computed:,} (the seeds' {prompts} × "
        f"{prefix:,} and the suffixes): the saving, {saved:,}, is exactly ({requests} − "
        f"{prompts}) × {prefix:,}. TTFT p50 falls from {naive['ttft_p50']} to "
        f"{radix['ttft_p50']} ms (p99 {half_up(naive['ttft_p99'])} to "
        f"{half_up(radix['ttft_p99'])})",
        f"queue behind {saved:,} more prompt tokens",
        f"radix arm's TTFT p99 ({half_up(radix['ttft_p99'])} ms) still exceed the base arm's on "
        f"the random workload ({base['ttft_p99']} ms)",
        f"radix TTFT {half_up(radix['ttft_p50'])} against {half_up(naive['ttft_p50'])} ms",
    )


def test_ch19_chunked_prefill_against_unchunked() -> None:
    text = recording("ch19_ablations-cuda")
    short, out, long, long_len, after, every, budget = (int(g) for g in found(
        text, r"short-long: (\d+) short requests \(prompts in \[\d+, \d+\], (\d+) tokens out\), "
              r"joined by (\d+) prompts of (\d+) tokens after (\d+) decode steps and every (\d+) "
              r"after; prefill budget (\d+) tokens a step"))
    chunked, unchunked = ch19_arm("chunked"), ch19_arm("unchunked")
    cost = 1 - float(chunked["tok_s"]) / float(unchunked["tok_s"])
    halved = float(unchunked["itl_max"]) / float(chunked["itl_max"])
    assert round(halved) == 2, "the summary says chunking halves the longest gap"
    assert float(chunked["itl_p99"]) < float(unchunked["itl_p99"])
    assert_on_page("ch19", "chunking halves the longest gap")
    assert_on_page(
        "ch19",
        f"{short} short requests decode {out} tokens while {long} prompts of {long_len:,} tokens "
        f"join, after {after} decode steps and every {every} after; both arms have a "
        f"{budget:,}-token budget",
        f"ITL p99 is {unchunked['itl_p99']} ms, the largest gap {unchunked['itl_max']}. Chunked, "
        f"{in_words(long_len // budget)} steps with decoding between them: "
        f"{chunked['itl_p99']} and {chunked['itl_max']} ms",
        f"the long prompts' TTFT p50, {chunked['ttft_p50']} ms instead of "
        f"{unchunked['ttft_p50']}, and {round(100 * cost)}% of throughput",
    )


def ch19_online_rows() -> dict[str, list[str]]:
    """Chapter 19's online summary table: rate -> requests, errors, duration, req/s, output
    tok/s, TTFT p50/p90/p99, TPOT p50/p90/p99, ITL p50/p90/p99, E2E p50/p99, good req/s."""
    table = rows(recording("ch19_online-cuda"), r"\s+(\d+|inf)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+"
                                                r"([\d.]+)\s+([\d.]+)\s+([\d./]+)\s+([\d./]+)\s+"
                                                r"([\d./]+)\s+([\d./]+)\s+([\d.]+)$")
    return {m.group(1): [v for g in m.groups()[1:] for v in g.split("/")] for m in table}


def test_ch19_online_curve_as_the_page_reads_it() -> None:
    text = recording("ch19_online-cuda")
    table = ch19_online_rows()
    assert list(table) == ["8", "16", "32", "64", "inf"]
    ttft = {rate: r[5:8] for rate, r in table.items()}
    tpot = {rate: r[8:11] for rate, r in table.items()}
    itl = {rate: r[11:14] for rate, r in table.items()}
    n, low, high, out_low, out_high = (int(g) for g in found(
        text, r"workload: (\d+) requests per rate .* prompts uniform in \[(\d+), (\d+)\] tokens, "
              r"outputs in \[(\d+), (\d+)\]"))
    assert (low, high) == (out_low, out_high)
    # no request waited for a slot, at any rate
    assert re.findall(r"waiting max (\d+)", text) == ["0"] * 5
    assert min(table, key=lambda rate: float(table[rate][2])) == "inf", "all at once ends fastest"
    bound_ttft, bound_tpot = found(text, r"goodput objectives: TTFT <= (\d+) ms and TPOT <= "
                                         r"(\d+) ms")
    met = dict(zip(table, re.findall(r"goodput: (\d+) of (\d+) requests met", text)))
    missed = {rate: int(of) - int(m) for rate, (m, of) in met.items() if m != of}
    assert missed == {"32": 1}, "all but one request, at 32 req/s, met the default objectives"
    assert "WARNING" not in text
    poisson = [rate for rate in table if rate != "inf"]
    assert max(poisson, key=lambda rate: float(ttft[rate][2])) == "16"
    itl_p99 = [float(itl[rate][2]) for rate in poisson]
    assert_on_page(
        "ch19",
        f"{n} requests per rate, prompts and outputs of {low} to {high} tokens",
        f"TTFT p50 grows from {half_up(ttft['8'][0])} to {half_up(ttft['32'][0])} ms between 8 "
        f"and 32 req/s, TPOT from {tpot['8'][0]} to {tpot['32'][0]} ms",
        f"The TTFT p99 is {half_up(ttft['16'][2])} ms at 16 req/s and {half_up(ttft['64'][2])} "
        f"at 64",
        f"(TPOT {tpot['inf'][0]} ms, {half_up(table['inf'][4]):,} tok/s), while everyone pays "
        f"the prefill in TTFT ({half_up(ttft['inf'][0])} ms)",
        f"The ITL p99, {half_up(str(min(itl_p99)))} to {half_up(str(max(itl_p99)))} ms under "
        f"Poisson arrivals and {itl['inf'][2]} ms all at once",
        f"All but one request (at 32 req/s) met the default objectives (TTFT ≤ {bound_ttft} ms, "
        f"TPOT ≤ {bound_tpot} ms)",
    )


def test_ch19_goodput_under_tight_objectives_from_the_json(
        repo_script: Callable[[str], ModuleType]) -> None:
    measure = repo_script("benchmark/measure.py")
    run = json.loads((ROOT / "docs" / "recorded" / "ch19_online-cuda.json").read_text("utf-8"))
    ttft, tpot = found(page("ch19"), r"Tighter ones, TTFT ≤ (\d+) ms and TPOT ≤ (\d+) ms, read "
                                     r"from the same JSON")
    objectives = measure.parse_objectives(f"ttft={ttft},tpot={tpot}")
    table = ch19_online_rows()
    per_s, met = {}, {}
    for result in run["results"]:
        rate = "inf" if result["rate"] == "inf" else f"{result['rate']:g}"
        done = [(r["ttft_s"], r["tpot_s"], r["e2e_s"]) for r in result["requests"]
                if r["error"] is None]
        good = measure.goodput(done, result["num_requests"], objectives, result["duration_s"])
        assert f"{result['request_throughput']:.2f}" == table[rate][3], f"rate {rate}: req/s"
        per_s[rate], met[rate] = good["per_s"], good["met"]
        assert_on_page("ch19", f"| {rate} | {table[rate][3]} | {good['met']} of "
                               f"{result['num_requests']} | {good['per_s']:.2f} |")
    # goodput peaks at 64 req/s and collapses when everything arrives at once
    assert max(per_s, key=per_s.__getitem__) == "64"
    assert met["inf"] == 1 and per_s["inf"] < per_s["8"]
    assert_on_page("ch19", "goodput peaks at 64 req/s and collapses when everything arrives",
                   f"every request but one then waits longer than {ttft} ms")


Kernels = dict[str, tuple[int, float]]


def ch19_profile(batch: int) -> tuple[str, Kernels, Kernels]:
    """One batch size's part of chapter 19's profile: its text, and its kernel families and
    kernels as name -> (calls, µs per step)."""
    block = recording("ch19_profile-cuda").split(f"\nbatch {batch} (")[1].split("\nbatch ")[0]
    families, kernels = (
        {m.group(1): (int(m.group(2)), float(m.group(3))) for m in rows(
            part, r"\s+(.*?)\s+(\d+)\s+([\d.]+)\s+[\d.]+%$")}
        for part in block.split("kernel family (device)")[1].split("host operator")[0]
        .split("kernel (device)"))
    return block, families, kernels


def ch19_kernel(kernels: Kernels, piece: str) -> float:
    """The µs per step of the one kernel whose name holds `piece`."""
    (us,) = [us for name, (_, us) in kernels.items() if piece in name]
    return us


def test_ch19_batch_1_step_against_its_floor() -> None:
    block, families, kernels = ch19_profile(1)
    floor, weights, kv = _floats("ch19_profile-cuda", r"^batch 1 \(.* HBM floor ([\d.]+) ms "
                                                      r"\(weights (\d+) MiB \+ KV (\d+) MiB\)")
    graph, = _floats("ch19_profile-cuda", r"^batch 1 \(.*step graph ([\d.]+) ms")
    bandwidth, = _floats("ch19_profile-cuda", r"device copy bandwidth: (\d+) GB/s")
    busy, count = (float(g) for g in found(block, r"device busy ([\d.]+) ms in (\d+) kernels"))
    latency, = _floats("ch19_decode_latency-cuda", r": ([\d.]+) ms per step")
    layers = [calls for name, (calls, _) in kernels.items() if "BatchDecode" in name][0]
    assert set(families) == {"other", "GEMMs", "copies and indexing", "attention"}, \
        "plain PyTorch, cuBLAS and FlashInfer's attention: no fused kernel families"
    gemm_calls, gemm_us = families["GEMMs"]
    small_calls = families["other"][0] + families["copies and indexing"][0]
    small_us = families["other"][1] + families["copies and indexing"][1]
    assert round(3 * small_us / (busy * 1e3)) == 2, "two thirds of the busy time"
    decode = ch19_kernel(kernels, "BatchDecode")
    merge = families["attention"][1] - decode  # the merge kernel, the family's other half
    weights_ms = weights * 2**20 / (bandwidth * 1e9) * 1e3
    assert round(gemm_us / 1e3 / weights_ms) == 3, "three times"
    assert round(latency / (latency - busy)) == 8, "the device idles an eighth of the step"
    assert_on_page(
        "ch19",
        f"The floor is the weights ({weights:,.0f} MiB) and one context's KV ({kv:.0f} MiB): "
        f"{floor:.2f} ms",
        f"in {count:,.0f} kernels, about {count / layers:.0f} a layer",
        f"the decode kernel ({decode:.0f}) and the merge of its split parts ({merge:.0f})",
        f"| elementwise arithmetic | {families['other'][1]:,.0f} | "
        f"{families['other'][0]:,} kernels",
        f"| matrix products | {gemm_us:.0f} | {gemm_calls} cuBLAS kernels",
        f"| copies and indexing | {families['copies and indexing'][1]:.0f} | "
        f"{families['copies and indexing'][0]} kernels",
        f"two thirds of the busy time, {small_us / small_calls:.1f} µs apiece",
        f"three times the weights' {weights_ms:.2f} ms",
        f"the {gemm_calls} kernels average {gemm_us / gemm_calls:.0f} µs",
        f"Attention reads {kv * 2**20 / layers / 1e6:.1f} MB a layer in "
        f"{families['attention'][1] / layers:.0f} µs",
        f"The graph step is {graph} ms on the host clock",
        f"{latency:.2f} ms a step, against the device's {busy:.2f}",
        f"At batch 1: {kv * 2**20 / 1e9:.2f} + {weights * 2**20 / 1e9:.2f} GB, so {floor:.2f} ms",
    )


def test_ch19_batch_128_step_against_its_floor() -> None:
    block, families, kernels = ch19_profile(128)
    contexts, floor, weights, kv = _floats(
        "ch19_profile-cuda", r"^batch 128 \((\d+) context tokens\): .* HBM floor ([\d.]+) ms "
                             r"\(weights (\d+) MiB \+ KV (\d+) MiB\)")
    bandwidth, = _floats("ch19_profile-cuda", r"device copy bandwidth: (\d+) GB/s")
    busy = float(found(block, r"device busy ([\d.]+) ms")[0])
    layers = [calls for name, (calls, _) in kernels.items() if "BatchDecode" in name][0]
    per_token = layers * 2 * 8 * 128 * 2  # the page's K and V of 8 heads of 128, bfloat16
    assert abs(kv * 2**20 / contexts - per_token) < 2**19 / contexts, "KV bytes per token"
    attention, share = (float(g) for g in found(
        block, r"^  attention\s+\d+\s+([\d.]+)\s+([\d.]+)%", re.M))
    decode = ch19_kernel(kernels, "BatchDecode")
    merge = attention - decode
    gemm = families["GEMMs"][1] / 1e3
    rest = busy - attention / 1e3 - gemm
    assert abs(rest * 1e3 - families["other"][1] - families["copies and indexing"][1]) < 1
    kv_gb, weights_gb = kv * 2**20 / 1e9, weights * 2**20 / 1e9
    rate = kv * 2**20 / (decode * 1e-6)
    assert rate / (bandwidth * 1e9) > 0.9, "attention reads near the copy bandwidth"
    weights_ms = weights * 2**20 / (bandwidth * 1e9) * 1e3
    spare = round(gemm, 2) - round(weights_ms, 2)
    assert_on_page(
        "ch19",
        f"about {contexts / 128:,.0f} tokens, at {per_token:,} bytes of KV each ({layers} layers "
        f"× 2 × 8 heads × 128 × 2 bytes): {kv_gb:.1f} GB a step, against {weights_gb:.2f} GB of "
        f"weights. The floor is {floor:.2f} ms",
        f"attention {attention / 1e3:.2f} ms ({share:.0f}%), its decode kernel reading "
        f"{kv_gb:.1f} GB in {decode / 1e3:.2f} ms, {rate / 1e12:.1f} TB/s, near the copy "
        f"bandwidth, and {merge / 1e3:.2f} ms more to merge its pieces; matrix products "
        f"{gemm:.2f} ms (the weights need {weights_ms:.2f}); the elementwise and copy kernels "
        f"{rest:.2f} ms",
        f"The lane is within {math.ceil(10 * busy / floor) / 10} times its floor",
        f"128 contexts hold {kv_gb:.1f} GB against {weights_gb:.2f} GB of weights",
        f"At most {gemm:.2f} − {weights_ms:.2f} = {spare:.2f} ms ({weights_gb:.2f} GB at full "
        f"bandwidth is {weights_ms:.2f} ms): {100 * spare / busy:.0f}% of the {busy:.2f} ms "
        f"device lane",
    )


def test_ch19_whole_engine_against_the_floor() -> None:
    name = "ch19_offline_bench-cuda"
    assert "NVIDIA H100" in recording(name).splitlines()[0]
    tok_s, decode, floor, share = _floats(
        name, r"^minisgl \(overlap, radix\): .* = ([\d.]+) tok/s; .* decode steps "
              r"([\d.]+) s .* HBM floor ([\d.]+) s = ([\d.]+)%")
    sync, = _floats(name, r"^minisgl \(sync, radix\): .* = ([\d.]+) tok/s")
    ablation = float(ch19_arm("graphs on")["tok_s"]) / float(ch19_arm("overlap off")["tok_s"])
    overlap = tok_s / sync
    assert_on_page(
        "ch19",
        f"Without overlap, {half_up(str(sync)):,} ({overlap:.2f}×; {ablation:.2f}× in the "
        f"ablations)",
        f"The floor is {share}% of the decode steps' time, {floor:.2f} s against {decode}",
        f"{share}% of the floor, overlap {overlap:.2f}×",
    )


# --------------------------------------------------------------------------- chapter 20
def _kernel_steps() -> dict[str, dict[str, float]]:
    """Chapter 20's ablation, row name -> kernels, device ms, decode ms, tok/s, floor %."""
    table = {}
    for m in rows(recording("ch20_kernel_steps-cuda"),
                  r"(plain|\+ \w+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)\s+([\d.]+)%"):
        kernels, device, _, decode, tok_s, floor = (float(g) for g in m.groups()[1:])
        table[m[1]] = {"kernels": kernels, "device": device, "decode": decode,
                       "tok_s": tok_s, "floor": floor}
    return table


def test_readme_quotes_chapter_19s_ablations_and_chapter_20s_table() -> None:
    """The README's performance figures, each from the recording of the checkpoint it names."""
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    full = float(ch19_arm("graphs on")["tok_s"])
    hf = ch19_transformers_tok_s()
    t = _kernel_steps()
    plain, last = t["plain"], t[list(t)[-1]]  # every kernel on
    assert "NVIDIA H200" in recording("ch19_ablations-cuda").splitlines()[0]
    assert "NVIDIA H100" in recording("ch20_kernel_steps-cuda").splitlines()[0]
    for figure in (f"On an NVIDIA H200, at chapter 19's checkpoint",
                   f"runs at {half_up(str(full)):,} output tokens/s, {round(full / hf)}× "
                   f"`transformers`'",
                   f"a batch-1 decode step from {half_up(str(plain['decode']), 2)} to "
                   f"{half_up(str(last['decode']), 2)} ms",
                   f"from {plain['floor']:.0f}% to {last['floor']:.0f}% of the time needed",
                   "once per step, on an H100"):
        assert figure in readme, figure


def test_ch20_ablation_counts_and_times() -> None:
    t = _kernel_steps()
    assert list(t) == ["plain", "+ flashinfer", "+ qk_prologue", "+ gemv", "+ gated",
                       "+ normed", "+ pieces", "+ moe", "+ pdl"]
    k = {name: int(row["kernels"]) for name, row in t.items()}
    assert k["+ flashinfer"] - k["+ qk_prologue"] == 112, "the prologue saves 4 kernels a layer"
    assert (k["+ gemv"], k["+ gated"], k["+ normed"]) == (298, 270, 214)
    assert k["+ normed"] == k["+ pieces"] == k["+ moe"] == k["+ pdl"]
    same = [t[name] for name in ("+ normed", "+ pieces", "+ moe")]
    decode = [row["decode"] for row in same]
    device = [row["device"] for row in same]
    floor_ms = float(found(page("ch20"), r"This GPU's floor is ([\d.]+) ms")[0])
    floors = [row["floor"] for row in list(t.values())[3:]]  # from the row kernel on
    assert_on_page(
        "ch20",
        f"{k['plain']:,} kernels and {t['plain']['device']:.3f} ms of device time become "
        f"{k['+ flashinfer']} and {t['+ flashinfer']['device']:.3f} ms",
        f"Measured: {k['+ flashinfer']} kernels become {k['+ qk_prologue']}, and the device time "
        f"falls from {t['+ flashinfer']['device']:.3f} to {t['+ qk_prologue']['device']:.3f} ms",
        f"counts {k['+ gemv']} kernels; device time falls from "
        f"{t['+ qk_prologue']['device']:.3f} to {t['+ gemv']['device']:.3f} ms",
        f"so measured, at {t['+ gated']['device']:.3f} and {t['+ normed']['device']:.3f} ms",
        f"device time rose from {t['+ moe']['device']:.3f} to {t['+ pdl']['device']:.3f} ms",
        f"the decode time fell from {t['+ moe']['decode']:.3f} to {t['+ pdl']['decode']:.3f} ms",
        f"batch 1 fell from {t['plain']['device']:.3f} to {t['+ normed']['device']:.3f} ms",
        f"rose from {t['plain']['floor']}% to {min(floors):.0f}–{max(floors):.0f}% from the row "
        f"kernel on",
        f"spread from {min(decode):.3f} to {max(decode):.3f} ms",
        f"the device time, {min(device):.3f} to {max(device):.3f} ms, is the steady measure",
        f"moved from {t['+ normed']['tok_s']:,.0f} to {t['+ pieces']['tok_s']:,.0f} tok/s",
        f"the device now runs at {100 * floor_ms / t['+ normed']['device']:.0f}% of it, the "
        f"plain layers ran at {100 * floor_ms / t['plain']['device']:.0f}%",
    )
    assert t["+ pdl"]["device"] > t["+ moe"]["device"], "pdl would now pay: turn it on"
    weights_mib, kv_mib, bandwidth = (float(g.replace(",", "")) for g in found(
        page("ch20"), r"\(([\d,]+) MiB of weights and ([\d,]+) MiB of KV at ([\d,]+) GB/s\)"))
    assert abs((weights_mib + kv_mib) * 2**20 / (bandwidth * 1e9) * 1e3 - floor_ms) < 0.005
    assert f"copy bandwidth {bandwidth:.0f} GB/s" in recording("ch20_gemv_tiling-cuda")


def test_ch20_pieces_do_not_pay() -> None:
    ratios = []
    for name in ("ch20_pieces_cutover-cuda", "ch20_pieces_cutover_mixed-cuda"):
        for m in rows(recording(name), r"\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x$"):
            never, cut, ratio = float(m[2]), float(m[3]), float(m[4])
            assert abs(never / cut - ratio) < 0.006
            ratios.append(ratio)
    assert len(ratios) == 15
    assert "cut-over: from batch 192" in recording("ch20_pieces_cutover_mixed-cuda")
    assert_on_page("ch20", f"The ratios wander between {min(ratios):.2f} and {max(ratios):.2f}")


def test_ch20_row_kernel_tilings() -> None:
    text = recording("ch20_gemv_tiling-cuda")
    products = {}
    for m in rows(text, r"(\w+)(?: \(\w+\))?\s+\d+ x \d+\s+\((\d+, \d+, \d+)\)\s+([\d.]+)\s+(\d+)\s+\((.*)"):
        fastest = float(re.match(r"\d+, \d+, \d+\) ([\d.]+) us", m[5])[1])
        products[m[1]] = (float(m[3]), int(m[4]), fastest)
    assert len(products) == 5
    layers = [v for name, v in products.items() if name != "lm_head"]
    rates = [rate for _, rate, _ in layers]
    assert_on_page(
        "ch20",
        f"The LM head streams at {products['lm_head'][1]:,} GB/s",
        f"reach {min(rates):,} to {max(rates):,} GB/s",
        f"no tiling saves more than {max(us - fast for us, _, fast in layers):.1f} µs on one",
    )


# --------------------------------------------------------------------------- chapter 21
def signed(figure: str) -> str:
    """A negative figure as the pages typeset it: `"-12.6650"` -> `"−12.6650"`."""
    return figure.replace("-", "−")


def test_ch21_sampler_cost_on_the_h200() -> None:
    top_p = "sampled (temperature 1, top-p 0.9)"
    greedy1, sampled1 = _sampler_ms("greedy", 1), _sampler_ms(top_p, 1)
    greedy128, sampled128 = _sampler_ms("greedy", 128), _sampler_ms(top_p, 128)
    more = {option: _sampler_ms(f"sampled + {option}", 1) - sampled1
            for option in ("penalties", "logit_bias (8 tokens)", "logprobs (top 5)")}
    at_128 = {f"{_sampler_ms(f'sampled + {option}', 128) - sampled128:.1f}"
              for option in ("penalties", "logprobs (top 5)")}
    assert len(at_128) == 1, f"penalties and logprobs no longer cost about the same: {at_128}"
    assert_on_page(
        "ch21",
        f"a greedy step at batch 1 takes {greedy1:.2f} ms and top-p sampling adds "
        f"{sampled1 - greedy1:.2f} ms; penalties add {more['penalties']:.2f} ms more, the bias "
        f"{more['logit_bias (8 tokens)']:.2f} ms, logprobs {more['logprobs (top 5)']:.2f} ms",
        f"At batch 128 sampling takes the {greedy128:.1f} ms greedy step to {sampled128:.1f} ms, "
        f"and penalties and logprobs add about {at_128.pop()} ms each",
    )


def ch21_part1() -> dict[str, tuple[str, dict[str, int]]]:
    """Part 1 of chapter 21's CPU recording: each setting -> (its text, the tokens it used
    twice or more with their counts)."""
    settings = re.findall(r"^  (\S.*)\n    (['\"].*['\"])\n    repeated: (\{.*\})$",
                          recording("ch21_sampling-cpu"), re.M)
    return {label: (ast.literal_eval(said), ast.literal_eval(repeated))
            for label, said, repeated in settings}


def test_ch21_penalties_bias_and_min_tokens() -> None:
    text = recording("ch21_sampling-cpu")
    part1 = ch21_part1()
    assert len(part1) == 5, sorted(part1)
    tokens = number(text, r"greedy, (\d+) tokens after")
    _, plain = part1["plain"]
    times = {1: "once", 2: "twice"}
    repetition = next(label for label in part1 if label.startswith("repetition_penalty="))
    assert part1[repetition][1] == {}, "the repetition penalty no longer stops every repeat"
    strength = {name: next(label.split("=")[1] for label in part1
                           if label.startswith(f"{name}_penalty="))
                for name in ("frequency", "presence")}
    assert strength["frequency"] == strength["presence"]
    frequency = part1[f"frequency_penalty={strength['frequency']}"]
    presence = part1[f"presence_penalty={strength['presence']}"]
    assert frequency == presence, "the two penalties no longer give one and the same text"
    (last, count), = frequency[1].items()
    assert count == 2 and frequency[0].endswith(last), "a repeat before the last token"
    bias_label = next(label for label in part1 if label.startswith("logit_bias="))
    token_id, bias, banned = found(bias_label, r"^logit_bias=\{(\d+): (-?\d+)\} \('(.*)'\)")
    biased, biased_repeats = part1[bias_label]
    assert banned not in biased
    stopped = number(text, r"plain: (\d+) tokens, 'stop'")
    least, ran = (int(g) for g in found(text, r"\{'min_tokens': (\d+)\}: (\d+) tokens, 'length'"))
    assert ran == tokens
    assert_on_page(
        "ch21",
        f"says `{' sir'!r}` {in_words(plain[' sir'])} times and `'LEONATO'` "
        f"{times[plain['LEONATO']]}",
        f"With `{repetition}` no token repeats in {tokens}",
        f"The frequency and presence penalties at {strength['frequency']} give one and the same "
        f"text",
        f"no token reaches a count of {count} before the last one (`{last!r}`)",
        f"A bias of {signed(bias)} on `{banned!r}` (id {token_id}) removes it, and `' gentleman'` "
        f"comes {in_words(biased_repeats[' gentleman'])} times instead",
        f"the answer stops at {stopped} tokens; with `min_tokens={least}` it runs to {ran}",
    )


def test_ch21_n_choices_compute_and_hold_the_prompt_once() -> None:
    text = recording("ch21_sampling-cpu")
    prompt, each = (int(g) for g in found(text, r"n choices of one (\d+)-token prompt, (\d+) "
                                                r"tokens each"))
    one, one_pages = (int(g) for g in found(text, r"n=1: prompt tokens each prefill computed "
                                                  r"\[(\d+)\]; KV pages held at most (\d+)"))
    m = re.search(r"n=3: prompt tokens each prefill computed \[([\d, ]+)\]; KV pages held at most "
                  r"(\d+) \(unshared: 3 x (\d+) = (\d+)\)", text)
    assert m, "no n=3 line in chapter 21's recording"
    computed = [int(n) for n in m.group(1).split(", ")]
    three_pages, unshared = int(m.group(2)), int(m.group(4))
    stored = each - 1  # the last sample is never stored
    assert one == prompt and one_pages == prompt + stored
    assert three_pages == prompt + 3 * stored and unshared == 3 * one_pages
    usage = re.search(r"usage: (\d+) prompt tokens \(counted once\), (\d+) completion tokens; "
                      r"the same texts as offline: True", text)
    assert usage and (int(usage.group(1)), int(usage.group(2))) == (prompt, 3 * each)
    assert_on_page(
        "ch21",
        f"One choice of the {prompt}-token prompt computes {one} tokens and holds at most "
        f"{one_pages} pages ({prompt} for the prompt, {stored} for the stored outputs",
        f"Three choices compute {computed[0]}, {computed[1]} and {computed[2]} tokens and hold at "
        f"most {three_pages} pages, {prompt} + 3 × {stored}, against {unshared} for three separate "
        f"copies",
        "The server's `n=3` choices are the offline ones; the usage counts the prompt once",
    )


def test_ch21_logprobs_are_raw_and_loglikelihoods_sum() -> None:
    text = recording("ch21_sampling-cpu")
    greedy = rows(text, r"\s+'(.*?)'\s+(-[\d.]+)\s+best 3: ('.*)$")
    assert len(greedy) == 4
    assert all(m.group(3).startswith(f"'{m.group(1)}' {m.group(2)},") for m in greedy), \
        "a greedy token is not the first of its best three"
    forced, best = found(text, r"forces '!': logprob (-[\d.]+), best 3: (.*)$", re.M)
    reference, = found(text, r"transformers' log_softmax there: .*'!' (-[\d.]+)")
    assert forced == reference and best == greedy[0].group(3)
    sums = {}
    for ending in ("Romeo", "Juliet"):
        a, b, total = found(text, rf"' {ending}\?': .*\[(-[\d.]+), (-[\d.]+)\], sum (-[\d.]+)")
        assert abs(float(a) + float(b) - float(total)) < 2e-4
        sums[ending] = total
    assert_on_page(
        "ch21",
        f"with the logprob {signed(forced)}, exactly `transformers`' log-softmax there",
        "Its best three are the unbiased request's",
        f"`' Romeo?'` sums to {signed(sums['Romeo'])} against {signed(sums['Juliet'])} for "
        f"`' Juliet?'`",
    )


# --------------------------------------------------------------------------- chapter 22
def test_ch22_tokens_the_automaton_allows() -> None:
    text = recording("ch22_structured-cpu")
    vocab = number(text, r"over the model's ([\d,]+) tokens")
    allowed = {after: (int(n), said) for after, n, said in re.findall(
        r"after '(.*?)'\s+state\s+\d+:\s+(\d+) tokens allowed, (.*)$", text, re.M)}
    start, quote, digits, one_digit, closed = (allowed[a] for a in (
        "", '{"', '{"age": ', '{"age": 4', '{"age": 42}'))
    assert start[1] == "e.g. '{'"
    assert set(re.findall(r"'(\w+)'", quote[1])) == {"a", "ag", "age"} and quote[0] == 3
    assert closed[1].endswith("only the ends of sequence, as the state accepts")
    assert one_digit[0] == digits[0] + 1, "a written digit adds the closing brace"
    assert_on_page(
        "ch22",
        f"over the trained tiny model's {vocab:,} tokens. At the start {in_words(start[0])} token "
        f"is allowed, `{{`; after `{{\"age\": ` the {in_words(digits[0])} digits; after "
        f"`{{\"age\": 4` {in_words(one_digit[0])} tokens, the digits and `}}`; after the closing "
        f"brace only the {in_words(closed[0])} end-of-sequence tokens",
        "after `{\"` the tokens `a`, `ag` and `age`",
        f"after the colon and its space the {in_words(digits[0])} digits",
        f"nothing is left but the {in_words(closed[0])} end-of-sequence tokens",
    )


def test_ch22_constrained_answers_parse_and_stop() -> None:
    text = recording("ch22_structured-cpu")
    assert "parses as JSON: False" in text, "the free answer is no longer refused by a parser"
    answer, _, finish = found(text, r"with schema: '(.*)' \((\d+) tokens, finish (\w+)\)\n\s+"
                                    r"parses and validates against the schema")
    properties = list(json.loads(answer))
    assert re.search(r"json_schema \(strict\): '.*', validates", text)
    raw = re.search(r"json_object \(\d+ tokens, finish 'stop'\): ('.*'), parses: True", text)
    assert raw, "no json_object line in chapter 22's recording"
    pairs = json.loads(ast.literal_eval(raw.group(1)), object_pairs_hook=list)
    keys = [k for k, _ in pairs]
    assert len(set(keys)) < len(keys) and all(not v.strip() for _, v in pairs), \
        "the json_object answer no longer repeats keys with whitespace strings"
    reason, name, arguments = found(text, r"tools, tool_choice='required': finish_reason "
                                          r"'(\w+)', (\w+)\((\{.*?\})\)")
    (argument,) = json.loads(arguments)
    assert_on_page(
        "ch22",
        f"writes an object with the {in_words(len(properties))} properties in order",
        f"stops by itself with `\"{finish}\"`",
        "fills the grammar's bounds with repeated keys and whitespace strings, valid JSON",
        f"the answer is a call to `{name}` with a `{argument}` that validates against the tool's "
        f"parameters, under `finish_reason \"{reason}\"`",
    )


def test_ch22_what_constraints_cost() -> None:
    text = recording("ch22_structured_cost-cuda")
    mask_us = number(text, r"one mask row: (\d+) us")
    runs = {(int(share), overlap): (int(tokens), float(free_rate), float(rate), float(ratio))
            for share, overlap, tokens, rate, free_rate, ratio in re.findall(
                r"^\s+(\d+)%\s+(on|off)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", text, re.M)}
    assert len(runs) == 6, f"chapter 22's cost table has {len(runs)} of its six runs"
    for tokens, free_rate, rate, ratio in runs.values():
        assert abs(rate / free_rate - ratio) <= 0.005, "a ratio is not tok/s over free tok/s"

    def loss(share: int, overlap: str) -> str:
        return f"{round(100 * (1 - runs[share, overlap][3]))}%"

    half, full_on, full_off = runs[50, "on"], runs[100, "on"], runs[100, "off"]
    assert_on_page(
        "ch22",
        f"the fully constrained run writes {full_on[0]:,} tokens where the free one would "
        f"write {runs[0, 'on'][0]:,}",
        f"At 50% the batch loses {loss(50, 'on')} with overlap on ({half[2]:,.1f} against "
        f"{half[1]:,.1f} tok/s) and {loss(50, 'off')} with it off",
        f"the cost is {loss(100, 'on')} with overlap on against {loss(100, 'off')} with it off",
        f"the free run gains {full_on[1] / full_off[1]:.2f}× from overlap at these lengths "
        f"({full_on[1]:,.1f} against {full_off[1]:,.1f} tok/s), the constrained run "
        f"{full_on[2] / full_off[2]:.2f}×",
        f"the mask itself, {mask_us} µs of host time a row",
    )


# --------------------------------------------------------------------------- chapter 23
def test_ch23_acceptance_rule_over_four_tokens() -> None:
    text = recording("ch23_speculative-cpu")
    trials = number(text, r"([\d,]+) trials of one guess")

    def line(label: str) -> list[Fraction]:
        m = re.search(rf"^  {label}\s+([\d.]+(?:\s+[\d.]+)*)", text, re.M)
        assert m, f"no {label!r} line in chapter 23's recording"
        return [Fraction(v) for v in m.group(1).split()]

    p, q = line(r"p \(target\)"), line(r"q \(draft\)")
    first, residual = line("first token"), line("residual")
    kept, recorded_accept = _floats("ch23_speculative-cpu", r"kept\s+([\d.]+)\s+\(sum of min\(p, "
                                                           r"q\) = ([\d.]+)\)")
    mins = [min(a, b) for a, b in zip(p, q)]
    accept = sum(mins)
    assert float(accept) == recorded_accept
    excess = [max(Fraction(0), a - b) for a, b in zip(p, q)]
    assert residual == [e / sum(excess) for e in excess]
    # "within sampling noise": four standard deviations of the trials' share
    assert abs(kept - accept) < 4 * math.sqrt(accept * (1 - accept) / trials)
    assert all(abs(f - a) < 4 * math.sqrt(a * (1 - a) / trials) for f, a in zip(first, p))
    assert p[0] == mins[0] + (1 - accept) * residual[0], "token 0 comes out as p(0)"

    def listed(values: list[Fraction]) -> str:
        return "[" + ", ".join(f"{float(v):g}" for v in values) + "]"

    assert trials == 100_000, "the page says a hundred thousand guesses"
    assert_on_page(
        "ch23",
        f"`p = {listed(p)}` and `q = {listed(q)}`",
        f"Token 0 is proposed {float(100 * q[0]):g}% of the time and always kept: "
        f"{float(mins[0]):g}",
        f"`Σ min(p, q) = {' + '.join(f'{float(m):g}' for m in mins)} = {float(accept):g}`, so a "
        f"rejection happens {float(100 * (1 - accept)):g}% of the time",
        f"`max(0, p − q) = {listed(excess)}`, normalised, is `{listed(residual)}`",
        f"{float(mins[0]):g} + {float(1 - accept):g} × {float(residual[0]):g} = "
        f"{float(p[0]):g}, which is `p(0)`",
        "a hundred thousand guesses drawn from `q`",
        f"`q` proposed token {q.index(Fraction(1, 2))} half the time",
        f"The residual line is the worked example's `{listed(residual)}`",
    )


def test_ch23_prompt_lookup_on_the_worked_history() -> None:
    text = recording("ch23_speculative-cpu")
    history, tail, proposed = (found(text, pattern)[0].split(", ") for pattern in (
        r"history \[([\d, ]+)\]", r"its tail \[([\d, ]+)\] occurred at the start",
        r"proposes \[([\d, ]+)\], the four tokens"))
    assert history[:len(tail)] == tail == history[-len(tail):]
    assert proposed == history[len(tail):len(tail) + len(proposed)]
    assert_on_page("ch23", f"With history `{' '.join(history)}` the tail `{' '.join(tail)}` "
                           f"occurred at the start, followed by `{' '.join(proposed)}`")


def test_ch23_passes_guesses_and_kept_tokens_of_each_proposer() -> None:
    text = recording("ch23_speculative-cpu")
    prompts, tokens = (int(g) for g in found(text, r"offline, (\d+) prompts, (\d+) greedy tokens"))
    table = {m.group(1): m.groups()[1:] for m in rows(
        text, r"\s+(off|ngram|draft)\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+(\w+)\s+(\d+)$")}
    assert list(table) == ["off", "ngram", "draft"]
    assert all(same == "True" and pages == "0" for *_, same, pages in table.values())
    passes = {name: int(row[0]) for name, row in table.items()}
    for name, (_, _, _, per_pass, _, _) in table.items():
        # the prefill makes each request's first token; every other one comes from a pass
        assert f"{(tokens - 1) / passes[name]:.2f}" == per_pass, name
    draft_layers = number(text, r"draft: its first (\d+) layers")
    config = json.loads((ROOT / "models" / "tiny-shakespeare" / "config.json").read_text("utf-8"))
    assert Fraction(draft_layers, config["num_hidden_layers"]) == Fraction(2, 3)
    _, ngram_guesses, ngram_kept, *_ = table["ngram"]
    _, draft_guesses, draft_kept, *_ = table["draft"]
    assert_on_page(
        "ch23",
        f"Part 3 runs the same {in_words(prompts)} prompts {in_words(len(table))} times",
        f"the model's own first {in_words(draft_layers)} layers",
        f"Prompt lookup guessed {ngram_guesses} tokens and the target kept {ngram_kept}",
        f"{passes['ngram']} passes instead of {passes['off']}",
        f"The draft guessed {draft_guesses}, and the {draft_kept} it got right cut the passes "
        f"to {passes['draft']}",
        "the cut draft costs two thirds of the target",
    )


def test_ch23_server_answers_begin_as_the_offline_text() -> None:
    from minisgl.tokenizer.tokenize import load_tokenizer

    text = recording("ch23_speculative-cpu")
    offline = ast.literal_eval(found(text, r"first prompt: (\".*\"|'.*')$", re.M)[0])
    served = [ast.literal_eval(m.group(1)) for m in rows(text, r"\s+'.*'\.\.\. -> (\".*\"|'.*')$")]
    assert served and served[0].startswith(offline)
    tokenizer = load_tokenizer(ROOT / "models" / "tiny-shakespeare")
    (count,) = {len(tokenizer.encode(answer)) for answer in served}
    spec, = found(text, r"the server, (--speculative \S+), through")
    assert "same text both times: True" in text
    assert_on_page(
        "ch23",
        f"the server started with `{spec}`",
        f"begin as part 3's texts do (the same greedy tokens, {count} of them)",
        "two runs give the same text",
    )


def test_ch23_speculation_on_the_gpu_pays_at_batch_1_and_stops_paying() -> None:
    text = recording("ch23_speculative_bench-cuda")
    assert "NVIDIA H100" in text.splitlines()[0]
    plain = {int(m[1]): (float(m[2]), float(m[3]))
             for m in rows(text, r"\(none\)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+1\.00x")}
    spec = {(m[1], int(m[2])): (float(m[3]), float(m[4]), float(m[5]), float(m[7]))
            for m in rows(text, r"draft=\S+,(k=\d+(?:,ahead=off)?)\s+(\d+)\s+([\d.]+)\s+"
                                r"([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x")}
    assert sorted(plain) == [1, 8, 32, 128]
    assert sorted(spec) == sorted((s, b) for s in ("k=6", "k=8", "k=6,ahead=off") for b in plain)
    for (setting, size), (tok_s, _, _, speedup) in spec.items():
        assert abs(tok_s / plain[size][0] - speedup) < 0.006, (setting, size)  # the column's rule
    tok_s, kept, round_ms, speedup = spec["k=6", 1]
    assert speedup >= 1.8 and spec["k=8", 1][3] >= 1.8, "at least 1.8x at batch 1 with the draft"
    per_round = 1 + 6 * kept
    predicted = float(found(text, r"k=6: ([\d.]+) tokens/round")[0])
    assert f"{per_round:.1f}" == f"{predicted:.1f}", "the distiller's prediction, as the page says"
    stops = min(size for (setting, size), row in spec.items() if setting == "k=6" and row[3] < 1)
    assert all(spec["k=6", size][3] > 1 for size in plain if size < stops)

    def times(value: float) -> str:
        return f"{value:.2f}×"

    assert_on_page(
        "ch23",
        f"At batch 1 a plain step takes {plain[1][1]:.3f} ms. A round with *k* = 6 takes "
        f"{round_ms:.3f} ms",
        f"the target keeps {kept:.2f} of the guesses: {per_round:.1f} tokens a round",
        f"That would be {per_round / (round_ms / plain[1][1]):.1f}×",
        f"the rest: {times(speedup)} (*k* = 8: {times(spec['k=8', 1][3])})",
        f"the next draft steps: {times(spec['k=6,ahead=off', 1][3])}",
        f"Batch 8 still gains, {times(spec['k=6', 8][3])}; at batch {stops} speculation costs, "
        f"{times(spec['k=6', stops][3])}",
        f"{times(speedup)} at batch 1 with a distilled two-layer draft, a loss from batch "
        f"{stops} on",
    )

# --------------------------------------------------------------------------- chapter 9 onwards
# From chapter 9 on, every measured figure a page states in its prose (a time, a rate, a size, a
# share, written with a decimal point or a thousands separator) must be a number of a recording
# the page includes (ms and µs, GB and MB read as one), or one the page derives from them or from
# a constant it names, listed in DERIVED with the arithmetic that gives it. So a page never quotes
# another chapter's run: its figures are those of its own checkpoint. The chapters are found
# from their pages, so a chapter written later (20) is covered the day its page lands. Answers
# and code blocks are left out: they work through the reader's own numbers.
FIRST_SWEPT = 9
MEASURED = re.compile(
    r"(?<![\w.,/-])(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d+)\s?"
    r"(ms|µs|s|tok/s|tokens/s|(?:output )?tokens a second|GB/s|TB/s|req/s|GB|MB|GiB|MiB|%)"
    r"(?![\w/])")


def included_recordings(text: str) -> list[str]:
    """The names of the recordings a page includes, `docs/recorded/<name>.txt`."""
    return re.findall(r'--8<-- "docs/recorded/([^"]+)\.txt"', text)


def prose_outside_answers(text: str) -> str:
    """A page's prose without code blocks and collapsed (`???`) blocks, on one line."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    kept, in_block = [], False
    for line in text.splitlines():
        if re.match(r"\s*\?\?\?\+? ", line):
            in_block = True
            continue
        if in_block and (line.startswith("    ") or not line.strip()):
            continue
        in_block = False
        kept.append(line)
    return " ".join(" ".join(kept).split())


def recorded_values(names: list[str]) -> set[float]:
    values: set[float] = set()
    for name in names:
        for m in re.findall(r"\d[\d,]*(?:\.\d+)?(?:e[+-]?\d+)?", recording(name)):
            value = float(m.replace(",", ""))
            values |= {value, value / 1000, value * 1000}
    return values


def decimals(figure: str) -> int:
    return len(figure.split(".")[1]) if "." in figure else 0


def _floats(name: str, pattern: str) -> tuple[float, ...]:
    return tuple(float(g.replace(",", "")) for g in found(recording(name), pattern, re.M))


def _sampler_ms(config: str, batch: int) -> float:
    return _floats("ch21_sampler_cost-cuda",
                   rf"^{re.escape(config)}\s+{batch}\s+([\d.]+)")[0]


def _ch19_batch128_gb(part: str) -> float:
    weights, kv = _floats("ch19_profile-cuda", r"^batch 128 .*\(weights (\d+) MiB \+ KV (\d+) MiB\)")
    return {"weights": weights, "kv": kv}[part] * 2**20 / 1e9


def _ch19_batch128_decode_tb_s() -> float:
    _, _, kernels = ch19_profile(128)
    return _ch19_batch128_gb("kv") * 1e9 / (ch19_kernel(kernels, "BatchDecode") * 1e-6) / 1e12


def _ch19_batch128_rest_ms() -> float:
    block, families, _ = ch19_profile(128)
    busy = float(found(block, r"device busy ([\d.]+) ms")[0])
    return busy - (families["attention"][1] + families["GEMMs"][1]) / 1e3


def _ch19_batch1(field: str) -> float:
    """Chapter 19's batch-1 profile, the step chapter 20 starts from."""
    floor, weights = _floats("ch19_profile-cuda", r"^batch 1 .*HBM floor ([\d.]+) ms \(weights "
                                                  r"(\d+) MiB")
    busy, = _floats("ch19_profile-cuda", r"device busy ([\d.]+) ms in 1819 kernels")
    bandwidth, = _floats("ch19_profile-cuda", r"copy bandwidth: (\d+) GB/s")
    return {"floor": floor, "weights": weights, "busy_us": busy * 1e3,
            "bandwidth": bandwidth}[field]


def _ch20_h100_floor_ms() -> float:
    """Chapter 20's GPU: the weights and 1,024 tokens of KV at its measured copy bandwidth."""
    bandwidth, = _floats("ch20_gemv_tiling-cuda", r"copy bandwidth (\d+) GB/s")
    kv_mib = 1024 * 28 * 2 * 8 * 128 * 2 / 2**20  # Qwen3-0.6B: 28 layers, 8 KV heads of 128
    return (_ch19_batch1("weights") + kv_mib) * 2**20 / (bandwidth * 1e9) * 1e3


# figure on the page -> how it follows from the recordings the page includes
H200_BF16_PEAK_FLOPS = 989e12  # the data sheet's dense bfloat16 peak, as chapters 9 and 10 state


def _prefill_ms_at_peak(tflop: float) -> float:
    return tflop * 1e12 / H200_BF16_PEAK_FLOPS * 1e3


def _watchdog_interval_s() -> float:
    source = (ROOT / "minisgl" / "server" / "frontend.py").read_text(encoding="utf-8")
    interval, = found(source, r"interval = min\(([\d.]+), self\.slow_reader_timeout_s / 4\)")
    return float(interval)


DERIVED: dict[str, dict[str, object]] = {
    "ch09": {"7.3 ms": lambda: _prefill_ms_at_peak(2 * 440e6 * 8192 / 1e12)},
    "ch10": {"1.8 ms": lambda: _prefill_ms_at_peak(1.8), "7.3 ms": lambda: _prefill_ms_at_peak(7.2)},
    "ch16": {"0.25 s": _watchdog_interval_s},  # the watchdog's interval, a constant of the code
    "ch20": {  # chapter 19's batch-1 step, read again; this chapter's GPU's floor
        "0.31 ms": lambda: _ch19_batch1("floor"),
        "1,137 MiB": lambda: _ch19_batch1("weights"),
        "4,250 GB/s": lambda: _ch19_batch1("bandwidth"),
        "3,502 µs": lambda: _ch19_batch1("busy_us"),
        "296.75 MiB": lambda: 151_936 * 1_024 * 2 / 2**20,  # the LM head in bfloat16
        "15.8 GB": lambda: _ch19_batch128_gb("kv"),
        "0.43 ms": _ch20_h100_floor_ms,
    },
    "ch19": {
        "15.8 GB": lambda: _ch19_batch128_gb("kv"),  # the profile's MiB in GB
        "1.19 GB": lambda: _ch19_batch128_gb("weights"),
        "3.8 TB/s": lambda: _ch19_batch128_decode_tb_s(),  # the KV over the decode kernel's time
        "3.23 ms": lambda: _ch19_batch128_rest_ms(),  # the lane less attention and products
    },
    "ch21": {  # each adjustment's cost over plain top-p sampling
        "0.44 ms": lambda: _sampler_ms("sampled + penalties", 1)
        - _sampler_ms("sampled (temperature 1, top-p 0.9)", 1),
        "0.27 ms": lambda: _sampler_ms("sampled + logit_bias (8 tokens)", 1)
        - _sampler_ms("sampled (temperature 1, top-p 0.9)", 1),
        "0.17 ms": lambda: _sampler_ms("sampled + logprobs (top 5)", 1)
        - _sampler_ms("sampled (temperature 1, top-p 0.9)", 1),
        "0.8 ms": lambda: max(_sampler_ms(c, 128) for c in ("sampled + penalties",
                                                            "sampled + logprobs (top 5)"))
        - _sampler_ms("sampled (temperature 1, top-p 0.9)", 128),
    },
}

SWEPT = sorted(p for p in (ROOT / "chapters").glob("ch*_*.md")
               if int(p.name[2:4]) >= FIRST_SWEPT)


def test_every_chapter_from_9_on_is_swept() -> None:
    """The sweep finds the written chapters from their pages: 9 to 19 and 21 to 23 today."""
    found = {p.name[:4] for p in SWEPT}
    assert {f"ch{n:02d}" for n in [*range(9, 20), 21, 22, 23]} <= found
    assert set(DERIVED) <= found, f"DERIVED names a chapter with no page: {set(DERIVED) - found}"


@pytest.mark.parametrize("path", SWEPT, ids=[p.name[:4] for p in SWEPT])
def test_every_measured_figure_is_in_the_pages_recordings(path: Path) -> None:
    chapter = path.name[:4]
    text = path.read_text(encoding="utf-8")
    values = recorded_values(included_recordings(text))
    derived = DERIVED.get(chapter, {})
    prose = prose_outside_answers(text)
    unrecorded = []
    for m in MEASURED.finditer(prose):
        figure, value = m.group(0), float(m.group(1).replace(",", ""))
        tolerance = 0.5 * 10 ** -decimals(m.group(1)) + 1e-9
        if figure in derived or any(abs(v - value) <= tolerance for v in values):
            continue
        unrecorded.append(f"{figure!r} in '…{prose[max(0, m.start() - 60):m.end() + 20]}…'")
    assert not unrecorded, (f"{chapter} states figures none of its recordings "
                            f"{included_recordings(text)} gives; record them, or list the "
                            f"arithmetic in DERIVED:\n" + "\n".join(unrecorded))
    for figure, compute in derived.items():
        assert figure in prose, f"DERIVED lists {figure!r}, which {chapter} no longer states"
        number_part = figure.split()[0].replace(",", "")
        assert abs(compute() - float(number_part)) <= 0.5 * 10 ** -decimals(number_part) + 1e-6, (
            f"{chapter}'s {figure!r} is not what its recordings give: {compute():.4f}")


# --------------------------------------------------------------------------- the home page
def home_page() -> str:
    return " ".join((ROOT / "docs" / "index.md").read_text(encoding="utf-8").split())


def test_home_page_reading_time_follows_from_the_chapters_word_count() -> None:
    """Words counted as the chapter check counts them: prose, code fences left out."""
    words = sum(len(re.findall(r"\w+", re.sub(r"```.*?```", "", p.read_text(encoding="utf-8"),
                                              flags=re.S)))
                for p in (ROOT / "chapters").glob("ch*_*.md"))
    text = home_page()
    stated = number(text, r"about ([\d,]+) words of prose")
    assert abs(stated - words) <= 0.08 * words, (
        f"the home page says about {stated:,} words; the chapters hold {words:,}")
    rate = number(text, r"reading at (\d+) words a minute")
    hours = {"four": 4, "four and a half": 4.5, "five": 5, "five and a half": 5.5, "six": 6,
             "six and a half": 6.5, "seven": 7}[re.search(r"some ([a-z ]+?) hours", text)[1]]
    assert abs(hours - stated / rate / 60) <= 0.25, f"{stated:,} words at {rate} a minute"


def test_home_page_names_the_gpu_of_every_chapter_with_a_gpu_recording() -> None:
    """Each chapter that includes a CUDA recording is named on the home page beside the GPU
    its recordings' headers name."""
    text = home_page()
    named = re.search(r"pages of chapters ([\d, and]+) were measured on one NVIDIA H200(?:, "
                      r"those of chapters? ([\d, and]+) on one NVIDIA H100)?", text)
    assert named, "the home page no longer says which chapters' figures need which GPU"
    stated = {"H200": {int(n) for n in re.findall(r"\d+", named[1])},
              "H100": {int(n) for n in re.findall(r"\d+", named[2] or "")}}
    measured: dict[str, set[int]] = {"H200": set(), "H100": set()}
    for path in (ROOT / "chapters").glob("ch*_*.md"):
        included = re.findall(r'--8<-- "(docs/recorded/[^"]*cuda[^"]*)"',
                              path.read_text(encoding="utf-8"))
        gpus = {gpu for rel in included for gpu in ("H100", "H200")
                if f"NVIDIA {gpu}" in (ROOT / rel).read_text(encoding="utf-8").splitlines()[0]}
        assert gpus or not included, f"{path.name}: a CUDA recording names no GPU it was made on"
        for gpu in gpus:
            measured[gpu].add(int(path.name[2:4]))
    assert measured == stated, (f"the home page names {stated}; the chapters' GPU recordings "
                                f"were made on {measured}")
