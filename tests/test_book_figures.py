"""The figures a chapter page derives from a recorded output, recomputed from that recording.

A page reads its recording line by line and does arithmetic on it ("12,418 = 4,096 × 3 + 130
bytes"). When an example changes and is recorded again, these tests fail until the page's
figures are brought up to date.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def recording(name: str) -> str:
    """The text of `docs/recorded/<name>.txt`."""
    return (ROOT / "docs" / "recorded" / f"{name}.txt").read_text(encoding="utf-8")


def page(chapter: str) -> str:
    """The chapter page `chapters/<chapter>_*.md`, its line breaks turned into spaces so a
    figure the page wraps over two lines is still found."""
    (path,) = (ROOT / "chapters").glob(f"{chapter}_*.md")
    return " ".join(path.read_text(encoding="utf-8").split())


def number(text: str, pattern: str) -> int:
    """The integer the first group of `pattern` captures in `text` (commas allowed)."""
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not found in the recording"
    return int(m.group(1).replace(",", ""))


def assert_on_page(chapter: str, *figures: str) -> None:
    text = page(chapter)
    missing = [f for f in figures if f not in text]
    assert not missing, f"{chapter}'s page does not state {missing}, which its recording gives"


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


def test_ch12_gpu_summary_line_matches_the_offline_benchmark() -> None:
    text = recording("offline_bench-cuda")
    table = {m.group(1).strip(): m for m in rows(
        text, r"(minisgl \(\w+, \w+\)|transformers \(padded batches of 256\))\s+\d+\s+\d+\s+"
              r"([\d.]+)\s+([\d.]+)\s+([\d.]+)x\s+([\d.]+%|-)")}
    overlap, sync = table["minisgl (overlap, radix)"], table["minisgl (sync, radix)"]
    tok_s, sync_tok_s = float(overlap.group(3)), float(sync.group(3))
    transformers = float(table["transformers (padded batches of 256)"].group(3))
    line = " ".join(page("ch12").split())
    assert f"generates {round(tok_s):,} tokens/s" in line
    assert f"{tok_s / transformers:.1f}× transformers' batched `generate`" in line
    assert f"{overlap.group(5)} of the time needed to read the weights and KV once" in line
    assert f"overlap is worth {tok_s / sync_tok_s:.2f}× ({round(sync_tok_s):,}" in line


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
def test_ch14_prompt_tokens_add_up_over_the_four_requests() -> None:
    text = recording("ch14_tokenizer-cpu")
    prompts = [number(text, rf"request {i} \(.*?\): \d+ replies, finish \w+, usage (\d+)\+")
               for i in (1, 2, 3)]
    total = number(text, r"'prompt_tokens': (\d+)")
    chat_ids = number(text, r"(\d+) token ids; equal to transformers")
    assert prompts[1] == chat_ids == 33
    assert prompts == [7, 33, 8] and total == 56
    fourth = total - sum(prompts)  # request 4 was aborted: its usage is never printed
    assert fourth == 8
    assert_on_page("ch14", f"`prompt_tokens` is {total}: 7 + 33 + 8 for requests 1 to 3, and "
                           f"{fourth} for request 4")


def test_ch14_stop_string_and_window_counts() -> None:
    text = recording("ch14_tokenizer-cpu")
    assert number(text, r"is (\d+) tokens\n") == 15
    assert "finish_reason 'stop' after 12 tokens, usage 5+12" in text
    assert "the 3 later tokens are dropped" in text
    pieces = re.search(r"pieces: (\[.*\])", text).group(1)
    assert pieces.count("'") // 2 == 12 and pieces.endswith("'', '']")
    assert "request 3 (text, stop '()yp'): 9 replies, finish stop, usage 8+9" in text
    assert_on_page("ch14", "the 15 pieces joined", "12 replies, the last two empty",
                   "usage 5+12", "usage 8+9", "the 3 later tokens")


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
    assert (prompt, completion, total) == (21, 16, 37) and prompt + completion == total
    assert chunks == 1 + pieces + 1 == 18 and pieces == completion
    assert_on_page("ch15", "usage 21 + 16 = 37", "18 chunks", "16 pieces of text")


def test_ch15_usage_and_chunks_on_the_h200() -> None:
    text = recording("ch15_server-cuda-qwen3-0.6b-like")
    prompt, completion, total, chunks = ch15_stream(text)
    pieces = number(text, r"a role, (\d+) pieces of text")
    assert prompt + completion == total and completion == 16
    assert chunks == 1 + pieces + 1 and pieces == 12
    assert_on_page("ch15", "16 tokens came as 12 pieces of text")


def test_ch15_exit_status_and_load_summary() -> None:
    assert "exited with code 143; processes left behind: 0" in recording("ch15_server-cpu")
    bench = recording("online_bench-cuda")
    rows = re.findall(r"^rate (\S+) [^:]*: (\d+) requests, (\d+) errors, [\d.]+ s: [\d.]+ req/s, "
                      r"([\d.]+) output tok/s", bench, re.M)
    assert [r[0] for r in rows] == ["4", "8", "16", "32", "64", "inf"]
    assert all(int(n) == 128 and int(err) == 0 for _, n, err, _ in rows)
    best = max(float(r[3]) for r in rows)
    assert best == 14860.8
    assert_on_page("ch15", "143 (128 + 15)", "128 streamed requests", "with 0 errors",
                   f"{best:,} output tokens a second", "ch19_bench.md")


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
