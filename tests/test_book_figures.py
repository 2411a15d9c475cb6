"""Figures the chapter pages derive from recorded outputs, recomputed from the recordings.

A page reads numbers off a recording (`docs/recorded/*.txt`) and does arithmetic with them. When
the recording is made again, these tests say which of the page's figures no longer hold.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def recorded(name: str) -> str:
    """The text of the recording `docs/recorded/<name>`."""
    return (ROOT / "docs" / "recorded" / name).read_text(encoding="utf-8")


def page(stem: str) -> str:
    """The text of the chapter page `chapters/<stem>.md`."""
    return (ROOT / "chapters" / f"{stem}.md").read_text(encoding="utf-8")


def rows(text: str, pattern: str) -> list[re.Match[str]]:
    """Every line of ``text`` that matches ``pattern`` from its start."""
    return [m for m in (re.match(pattern, line) for line in text.splitlines()) if m]


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
    text = recorded("ch09_batching-cpu.txt")
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
    text = recorded("ch10_chunked-cpu.txt")
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
    text = recorded("ch11_radix-cpu.txt")
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
    text = recorded("ch12_overlap-cpu.txt")
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


def test_ch12_gpu_summary_line_matches_the_offline_benchmark() -> None:
    text = recorded("offline_bench-cuda.txt")
    table = {m.group(1).strip(): m for m in rows(
        text, r"(minisgl \(\w+, \w+\)|transformers \(padded batches of 256\))\s+\d+\s+\d+\s+"
              r"([\d.]+)\s+([\d.]+)\s+([\d.]+)x\s+([\d.]+%|-)")}
    overlap, sync = table["minisgl (overlap, radix)"], table["minisgl (sync, radix)"]
    tok_s, sync_tok_s = float(overlap.group(3)), float(sync.group(3))
    transformers = float(table["transformers (padded batches of 256)"].group(3))
    line = " ".join(page("ch12_overlap").split())
    assert f"generates {round(tok_s):,} tokens/s" in line
    assert f"{tok_s / transformers:.1f}× transformers' batched `generate`" in line
    assert f"{overlap.group(5)} of the time needed to read the weights and KV once" in line
    assert f"overlap is worth {tok_s / sync_tok_s:.2f}× ({round(sync_tok_s):,}" in line
