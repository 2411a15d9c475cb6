"""The Tour page shows real output: ``tools/tour.py`` still produces it, and it still holds.

One run of ``python tools/tour.py --record`` (into a temporary file, never over the committed
recording) starts the server on the book's small trained model, sends one chat request
streamed and once more through the ``openai`` client, reads ``/v1/models``, ``/metrics`` and
the log, and stops the server with SIGINT. The tests read that recording the way the page's
reader does:

- the SSE stream is well formed, ends with ``data: [DONE]``, and the model ended its turn
  itself (finish reason ``stop``, well before ``max_tokens``);
- the streamed text equals the text of the same request not streamed (and of the offline
  ``LLM``), and the token counts agree everywhere they are shown;
- after the requests, every gauge of ``/metrics`` is back to zero (no live request, no KV page
  held), and the counters say two requests, both finished;
- the log names each request's uid, the same uid as the response ids;
- the server stopped on SIGINT with exit code 130 and no process left;
- and the committed ``docs/recorded/tour-cpu/`` says what a fresh run says, line for line
  (log lines of different processes may interleave in any order, so a block of log lines is
  compared as a set), so the page cannot drift from the code.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "docs" / "recorded" / "tour-cpu"
TOUR_TIMEOUT_S = 600
LOG_LINE = "[<time> "
STALE = ("docs/recorded/tour-cpu/ is out of date: re-record it with "
         "`python tools/tour.py --record`")


def sections(directory: Path) -> dict[str, list[str]]:
    """The recording's sections (the files the page includes), by name; the first line of
    intro.txt, the machine it was recorded on, is kept apart as the section "machine"."""
    found = {path.stem: path.read_text(encoding="utf-8").splitlines()
             for path in sorted(directory.glob("*.txt"))}
    assert "intro" in found, f"{directory} has no intro.txt"
    found["machine"], found["intro"] = found["intro"][:1], found["intro"][1:]
    return found


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One run of the tour: its recording, its sections and its server's process ids."""
    tmp = tmp_path_factory.mktemp("tour")
    out, pids = tmp / "tour-cpu", tmp / "pids.json"
    proc = subprocess.run([sys.executable, "tools/tour.py", "--record", "--out", str(out),
                           "--pids-file", str(pids)], cwd=ROOT, capture_output=True,
                          text=True, timeout=TOUR_TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = sections(out)
    text = "\n".join(line for lines in found.values() for line in lines)
    return {"text": text, "sections": found, "pids": json.loads(pids.read_text()),
            "stdout": proc.stdout}


def sse_payloads(lines: list[str]) -> list[str]:
    """The ``data:`` payloads of the curl section's stream, checking its framing on the way:
    every event is one ``data:`` line followed by one blank line."""
    start = next(i for i, line in enumerate(lines) if line.startswith("data: "))
    end = max(i for i, line in enumerate(lines) if line.startswith("data: "))
    stream = lines[start:end + 2]
    payloads = []
    for i in range(0, len(stream), 2):
        event, blank = stream[i], stream[i + 1]
        assert event.startswith("data: ") and blank == "", f"a malformed event: {stream[i:i + 2]}"
        payloads.append(event[len("data: "):])
    return payloads


def openai_body(lines: list[str]) -> dict:
    start = lines.index("{")
    end = lines.index("}", start)
    return json.loads("\n".join(lines[start:end + 1]).replace("<created>", "0"))


def metrics_table(lines: list[str]) -> dict[str, tuple[int, int]]:
    table = {}
    for line in lines:
        match = re.fullmatch(r"  (minisgl_\w+)\s+(\d+)\s+(\d+)", line)
        if match:
            table[match[1]] = (int(match[2]), int(match[3]))
    return table


def test_the_stream_is_well_formed_and_ends_with_done(fresh: dict) -> None:
    payloads = sse_payloads(fresh["sections"]["curl"])
    assert payloads[-1] == "[DONE]", f"the stream ends with {payloads[-1]!r}"
    chunks = [json.loads(p.replace("<created>", "0")) for p in payloads[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop", "the reply did not end itself"
    assert {c["id"] for c in chunks} == {"chatcmpl-<id>"}, "one response, one (random) id"


def test_streamed_and_whole_answers_are_the_same_text_and_token_counts(fresh: dict) -> None:
    found = fresh["sections"]
    chunks = [json.loads(p.replace("<created>", "0")) for p in sse_payloads(found["curl"])[:-1]]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    body = openai_body(found["openai"])
    assert body["id"] == "chatcmpl-<id>" and body["object"] == "chat.completion"
    log = "\n".join(found["log"])
    usage = body["usage"]
    finish = body["choices"][0]["finish_reason"]
    for uid in (0, 1):  # the access log pairs each response with its request's uid
        assert re.search(rf"POST /v1/chat/completions 200 uid={uid} "
                         rf"prompt_tokens={usage['prompt_tokens']} "
                         rf"completion_tokens={usage['completion_tokens']} finish={finish} "
                         r"id=chatcmpl-<id>", log), log
    assert body["choices"][0]["message"]["content"] == streamed
    assert "the same text as the stream's deltas joined: True" in found["openai"]
    prompt_ids = re.search(r"(\d+) token ids: \[", "\n".join(found["tokenizer"]))
    assert prompt_ids and usage["prompt_tokens"] == int(prompt_ids[1]), (
        "the usage does not count the tokens the chat template makes")
    # One chunk per token after the role's: the end token's chunk carries the finish reason.
    request = json.loads(re.search(r"-d '(\{.*\})'", "\n".join(found["curl"]))[1])
    assert usage["completion_tokens"] == len(chunks) - 1 < request["max_tokens"]
    assert "  the same as the server's text: True" in found["offline_chat"]
    # The page says each token became one piece of the stream (no character spans two).
    pieces = re.search(r"each token decoded alone: (\[.*\])$", "\n".join(found["offline_chat"]),
                       re.MULTILINE)
    deltas = [c["choices"][0]["delta"]["content"] for c in chunks[1:-1]]
    assert pieces and ast.literal_eval(pieces[1]) == [*deltas, "<|im_end|>"]


def test_metrics_are_back_to_zero_after_the_requests(fresh: dict) -> None:
    table = metrics_table(fresh["sections"]["metrics"])
    reply_tokens = openai_body(fresh["sections"]["openai"])["usage"]["completion_tokens"]
    gauges = ["minisgl_running_requests", "minisgl_waiting_requests", "minisgl_kv_pages_in_use",
              "minisgl_detokenizer_live_states", "minisgl_frontend_live_requests",
              "minisgl_frontend_buffered_replies"]
    for name in gauges:
        assert table[name] == (0, 0), f"{name} before/after: {table[name]}"
    assert table["minisgl_frontend_requests_total"] == (0, 2)
    assert table["minisgl_frontend_finished_total"] == (0, 2)
    assert table["minisgl_generation_tokens_total"] == (0, 2 * reply_tokens)
    assert table["minisgl_frontend_aborted_total"] == table["minisgl_frontend_failed_total"] \
        == (0, 0)


def test_the_log_names_each_request_by_the_uid_in_its_response_id(fresh: dict) -> None:
    lines = [line for line in fresh["sections"]["log"] if line.startswith(LOG_LINE)]
    n = openai_body(fresh["sections"]["openai"])["usage"]["completion_tokens"]
    for uid in (0, 1):
        finished = f"request {uid} finished (stop) after {n} token(s)"
        assert any(finished in line for line in lines), lines


def test_the_server_stopped_on_sigint_and_left_no_process(fresh: dict) -> None:
    stop = fresh["sections"]["stop"]
    assert any(line.startswith("the server exited with code 130 ") for line in stop), stop
    assert "processes left: 0 of 5" in stop, stop
    assert any(line.endswith("stopped 3 worker process(es)") for line in stop), stop
    assert not any("Traceback" in line for line in stop)
    left = []
    for pid in fresh["pids"]:  # a few seconds later, checked from outside the tour too
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.NoSuchProcess:
            pass
    assert not left, f"processes of the server still run: {left}"


def test_the_run_is_normalised_and_printed_as_recorded(fresh: dict) -> None:
    found, text = fresh["sections"], fresh["text"]
    assert found["machine"][0].startswith("# recorded on CPU ")
    assert found["intro"][0] == "$ python tools/tour.py"
    assert "<pid>" in text and "<port>" in text and "<created>" in text
    assert not re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d", text), "a clock time was left in"
    assert not re.search(r"\(pid \d+\)|:\d{4,5}/", text), "a pid or a port was left in"
    # What was printed is the sections, each in one piece: nothing printed is left out.
    stdout = fresh["stdout"].splitlines()
    recorded = [lines for name, lines in found.items() if name != "machine"]
    assert sorted(stdout) == sorted(line for lines in recorded for line in lines), (
        "stdout and the recording differ")
    printed = "\n".join(stdout) + "\n"
    for lines in recorded:
        assert "\n".join(lines) + "\n" in printed, f"a section is printed in pieces: {lines[:2]}"


def comparable(lines: list[str]) -> list[object]:
    """A section's lines, where a run of log lines becomes the sorted list of them, since
    processes write their lines in whatever order they run."""
    out: list[object] = []
    block: list[str] = []
    for line in lines:
        if line.startswith(LOG_LINE):
            block.append(line)
            continue
        if block:
            out.append(sorted(block))
            block = []
        out.append(line)
    if block:
        out.append(sorted(block))
    return out


def test_the_committed_recording_matches_a_fresh_run(fresh: dict) -> None:
    assert COMMITTED.is_dir(), f"{COMMITTED.relative_to(ROOT)} is missing; {STALE}"
    recorded, now = sections(COMMITTED), fresh["sections"]
    assert sorted(recorded) == sorted(now), f"{STALE} (its sections differ)"
    for name in sorted(set(now) - {"machine"}):
        old, new = comparable(recorded[name]), comparable(now[name])
        for i, (was, is_) in enumerate(zip(old, new)):
            assert was == is_, (f"{STALE}\n  {name}.txt item {i} recorded: {was!r}\n"
                                f"  {name}.txt item {i} now:      {is_!r}")
        assert len(old) == len(new), f"{STALE} ({name}.txt: {len(old)} items vs {len(new)})"
