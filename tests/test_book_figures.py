"""The figures a chapter page derives from a recorded output, recomputed from that recording.

A page reads its recording line by line and does arithmetic on it ("the prompts take
2,048 − 936 = 1,112 pages"). When the example changes and is recorded again, these tests fail
until the page's figures are brought up to date.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def recording(name: str) -> str:
    """The text of `docs/recorded/<name>.txt`."""
    return (ROOT / "docs" / "recorded" / f"{name}.txt").read_text(encoding="utf-8")


def page(chapter: str) -> str:
    """The chapter page `chapters/<chapter>_*.md`, with line breaks turned into spaces so a
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
    engine.reserve(req)
    req.append_token(engine.forward(Batch([req], "prefill")).tolist()[0])
    engine.reserve(req)

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
