"""The figures a chapter page derives from a recorded output, recomputed from that recording.

A page reads its recording line by line and does arithmetic on it ("12,418 = 4,096 × 3 + 130
bytes"). When an example changes and is recorded again, these tests fail until the page's
figures are brought up to date.
"""
from __future__ import annotations

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
