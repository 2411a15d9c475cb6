"""Chapter 19's figures, drawn as SVG from the benchmarks' recorded JSON.

Four figures: the latency-throughput curve and TTFT / TPOT percentiles against the request rate
(from ``online.py --out``), the distribution of the gaps between tokens at one rate, and one
bar chart per ablation (from ``offline.py --ablations ... --out``, or from a recording of the
table that run printed). The SVG is written by hand, a few elements per point, with every number
rounded to two decimals: the same data always gives the same bytes, so a test can redraw the
committed figures and compare them.

    python benchmark/plots.py --online docs/recorded/ch19_online-cuda.json \\
        --ablations docs/recorded/ch19_ablations-cuda.txt --out chapters/figures
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # offline.py, also when this file is imported by path
    sys.path.insert(0, str(HERE))
WIDTH, HEIGHT = 560, 320
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 40, 50  # margins around the plotting area
COLOURS = ("#1f6feb", "#d1242f", "#1a7f37", "#9a6700", "#8250df")
FONT = 'font-family="sans-serif" font-size="12"'


def fmt(x: float) -> str:
    """A coordinate, rounded so the output never depends on the last bits of a float."""
    text = f"{x:.2f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values covering [low, high]: steps of 1, 2 or 5 times a power of ten."""
    if high <= low:
        high = low + 1.0
    raw = (high - low) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(low / step) * step
    ticks = []
    value = first
    while value <= high + step * 1e-9:
        ticks.append(round(value, 10))
        value += step
    if ticks[-1] < high:
        ticks.append(round(value, 10))
    return ticks


def value_label(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def tick_label(value: float) -> str:
    return f"{value:g}" if abs(value) < 1e6 else f"{value:.1e}"


@dataclass
class Series:
    name: str
    points: list[tuple[float, float]]
    dashed: bool = False
    labels: Sequence[str] = ()  # a note beside each point, e.g. the request rate


class Canvas:
    """An SVG document: a title, axes and the marks drawn on them."""

    def __init__(self, title: str, width: int = WIDTH, height: int = HEIGHT) -> None:
        self.width, self.height = width, height
        self.parts = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}">',
            f'<rect width="{width}" height="{height}" fill="white"/>',
            f'<text x="{fmt(width / 2)}" y="22" text-anchor="middle" {FONT} '
            f'font-weight="bold">{escape(title)}</text>']

    def add(self, element: str) -> None:
        self.parts.append(element)

    def text(self, x: float, y: float, text: str, anchor: str = "middle",
             rotate: bool = False, size: int = 12) -> None:
        turn = f' transform="rotate(-90 {fmt(x)} {fmt(y)})"' if rotate else ""
        self.add(f'<text x="{fmt(x)}" y="{fmt(y)}" text-anchor="{anchor}" '
                 f'font-family="sans-serif" font-size="{size}"{turn}>{escape(text)}</text>')

    def line(self, x1: float, y1: float, x2: float, y2: float, colour: str = "#888",
             dashed: bool = False) -> None:
        dash = ' stroke-dasharray="4 3"' if dashed else ""
        self.add(f'<line x1="{fmt(x1)}" y1="{fmt(y1)}" x2="{fmt(x2)}" y2="{fmt(y2)}" '
                 f'stroke="{colour}"{dash}/>')

    def svg(self) -> str:
        return "\n".join(self.parts + ["</svg>"]) + "\n"


@dataclass
class Axis:
    """Maps data values to pixels, linearly or on a log10 scale."""

    low: float
    high: float
    start: float  # pixel of ``low``
    end: float  # pixel of ``high``
    log: bool = False

    def __call__(self, value: float) -> float:
        if self.log:
            value, low, high = math.log10(value), math.log10(self.low), math.log10(self.high)
        else:
            low, high = self.low, self.high
        return self.start + (value - low) / (high - low) * (self.end - self.start)


def line_chart(title: str, x_label: str, y_label: str, series: Sequence[Series],
               x_categories: Sequence[str] | None = None, log_x: bool = False) -> str:
    """Lines with markers. With ``x_categories`` the x values are indices of those labels."""
    canvas = Canvas(title)
    xs = [x for s in series for x, _ in s.points]
    ys = [y for s in series for _, y in s.points]
    y_ticks = nice_ticks(0.0, max(ys) if ys else 1.0)
    y_axis = Axis(y_ticks[0], y_ticks[-1], HEIGHT - BOTTOM, TOP)
    if x_categories is not None:
        x_axis = Axis(-0.5, len(x_categories) - 0.5, LEFT, WIDTH - RIGHT)
        x_ticks = [(float(i), label) for i, label in enumerate(x_categories)]
    elif log_x:
        low = 10 ** math.floor(math.log10(min(xs)))
        high = 10 ** math.ceil(math.log10(max(xs)))
        high = high * 10 if high == low else high
        x_axis = Axis(low, high, LEFT, WIDTH - RIGHT, log=True)
        x_ticks = [(10.0 ** k, tick_label(10.0 ** k)) for k in
                   range(round(math.log10(low)), round(math.log10(high)) + 1)]
    else:
        ticks = nice_ticks(0.0, max(xs) if xs else 1.0)
        x_axis = Axis(ticks[0], ticks[-1], LEFT, WIDTH - RIGHT)
        x_ticks = [(t, tick_label(t)) for t in ticks]
    draw_axes(canvas, x_axis, y_axis, x_ticks, [(t, tick_label(t)) for t in y_ticks],
              x_label, y_label)
    for k, s in enumerate(series):
        colour = COLOURS[k % len(COLOURS)]
        points = " ".join(f"{fmt(x_axis(x))},{fmt(y_axis(y))}" for x, y in s.points)
        dash = ' stroke-dasharray="5 3"' if s.dashed else ""
        canvas.add(f'<polyline points="{points}" fill="none" stroke="{colour}" '
                   f'stroke-width="2"{dash}/>')
        if len(s.points) <= 40:
            for x, y in s.points:
                canvas.add(f'<circle cx="{fmt(x_axis(x))}" cy="{fmt(y_axis(y))}" r="3" '
                           f'fill="{colour}"/>')
        for (x, y), note in zip(s.points, s.labels):
            canvas.text(x_axis(x) + 6, y_axis(y) + 16, note, anchor="start", size=10)
        legend_y = TOP + 4 + 16 * k
        canvas.line(LEFT + 12, legend_y, LEFT + 32, legend_y, colour, s.dashed)
        canvas.text(LEFT + 38, legend_y + 4, s.name, anchor="start")
    return canvas.svg()


def draw_axes(canvas: Canvas, x_axis: Axis, y_axis: Axis, x_ticks: Sequence[tuple[float, str]],
              y_ticks: Sequence[tuple[float, str]], x_label: str, y_label: str) -> None:
    bottom, top = HEIGHT - BOTTOM, TOP
    for value, label in y_ticks:
        y = y_axis(value)
        canvas.line(LEFT, y, WIDTH - RIGHT, y, "#e6e6e6")
        canvas.text(LEFT - 6, y + 4, label, anchor="end")
    for value, label in x_ticks:
        x = x_axis(value)
        canvas.line(x, bottom, x, bottom + 4)
        canvas.text(x, bottom + 17, label)
    canvas.line(LEFT, bottom, WIDTH - RIGHT, bottom, "#333")
    canvas.line(LEFT, bottom, LEFT, top, "#333")
    canvas.text((LEFT + WIDTH - RIGHT) / 2, HEIGHT - 12, x_label)
    canvas.text(18, (top + bottom) / 2, y_label, rotate=True)


def bar_panels(title: str, panels: Sequence[tuple[str, Sequence[tuple[str, float]]]]) -> str:
    """Horizontal bars, one panel per ablation, each scaled to its own largest value."""
    row, gap, label_w = 20, 26, 150
    height = TOP + sum(gap + row * len(bars) for _, bars in panels) + 10
    canvas = Canvas(title, height=height)
    y = TOP
    for name, bars in panels:
        canvas.text(LEFT - 60, y + 14, name, anchor="start", size=13)
        y += gap - 4
        top_value = max((v for _, v in bars), default=1.0) or 1.0
        for k, (label, value) in enumerate(bars):
            width = (WIDTH - RIGHT - 70 - label_w) * value / top_value
            canvas.text(label_w, y + 14, label, anchor="end")
            canvas.add(f'<rect x="{label_w + 6}" y="{fmt(y + 3)}" width="{fmt(width)}" '
                       f'height="{row - 6}" fill="{COLOURS[k % len(COLOURS)]}"/>')
            canvas.text(label_w + 12 + width, y + 14, value_label(value), anchor="start")
            y += row
        y += 4
    return canvas.svg()


# ----------------------------------------------------------------------------- the figures
def rate_labels(results: Sequence[dict[str, Any]]) -> list[str]:
    return [str(r["rate"]) if isinstance(r["rate"], str) else f"{r['rate']:g}" for r in results]


def latency_throughput(online: dict[str, Any]) -> str:
    """Median and p99 end-to-end latency against the output throughput each rate reached."""
    results = [r for r in online["results"] if r["e2e_s"] is not None]
    series = [Series(f"E2E {q}", [(r["output_throughput"], r["e2e_s"][q]) for r in results],
                     dashed=q == "p99",
                     labels=[f"{x} req/s" for x in rate_labels(results)] if q == "p50" else ())
              for q in ("p50", "p99")]
    return line_chart("Latency against throughput (one point per request rate)",
                      "output tokens per second", "end-to-end latency (s)", series)


def percentiles_by_rate(online: dict[str, Any], metric: str, title: str) -> str:
    """p50 and p99 of ``metric`` (``ttft_ms`` or ``tpot_ms``) at each request rate."""
    results = [r for r in online["results"] if r[metric] is not None]
    series = [Series(f"{q}", [(float(i), r[metric][q]) for i, r in enumerate(results)],
                     dashed=q == "p99") for q in ("p50", "p99")]
    return line_chart(title, "request rate (req/s; inf = all at once)",
                      metric.replace("_ms", "").upper() + " (ms)", series,
                      x_categories=rate_labels(results))


def itl_distribution(online: dict[str, Any], rate_index: int) -> str:
    """The empirical CDF of every gap between text chunks at one rate (log time axis)."""
    result = online["results"][rate_index]
    gaps = sorted(g * 1e3 for r in result["requests"] if r["error"] is None
                  for g in r["itl_s"])
    positive = [g for g in gaps if g > 0]
    floor = min(positive) if positive else 1e-3
    n = len(gaps)
    # At most 200 points: the CDF read at evenly spaced ranks.
    ranks = sorted({round(k * (n - 1) / 199) for k in range(200)}) if n > 200 else range(n)
    points = [(max(gaps[i], floor), (i + 1) / n) for i in ranks]
    label = rate_labels([result])[0]
    return line_chart(f"Gaps between streamed chunks at rate {label} ({n} gaps)",
                      "inter-token latency (ms, log scale)", "share of gaps at most this",
                      [Series("empirical CDF", points)], log_x=True)


Panels = list[tuple[str, list[tuple[str, float]]]]  # (title, [(arm, headline value)])


def ablation_bars(panels: Panels) -> str:
    """Each ablation's headline number for each of its arms."""
    return bar_panels("Ablations: one switch at a time", panels)


def ablation_panels(ablations: dict[str, Any]) -> Panels:
    """The bars of ``offline.py --ablations ... --out``'s JSON: one panel per ablation."""
    heads = ablations["headlines"]
    panels = []
    for name in ablations["workload"]["ablations"]:
        field, label, higher = (heads[name][k] for k in ("field", "label", "higher_is_better"))
        bars = [(r["arms"][name], headline_value(r, field)) for r in ablations["results"]
                if name in r["arms"] and headline_value(r, field) is not None]
        if bars:
            panels.append((panel_title(name, label, higher), bars))
    return panels


def printed_ablation_panels(text: str) -> Panels:
    """The same bars from a recording of the run, its printed table (the last column is each
    arm's headline, ``<label> <value>``), when the JSON is not at hand."""
    from offline import HEADLINES  # which way is better: the ablation's own setting

    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("ablation  ")) + 2
    panels: dict[str, list[tuple[str, float]]] = {}
    for line in itertools.takewhile(str.strip, lines[start:]):
        name, arm, *_, headline = re.split(r"\s{2,}", line.strip())
        if headline != "-":
            panels.setdefault(name, []).append((arm, float(headline.rsplit(" ", 1)[1])))
    return [(panel_title(name, *HEADLINES[name][1:]), bars) for name, bars in panels.items()]


def panel_title(name: str, label: str, higher_is_better: bool) -> str:
    return f"{name}: {label} ({'higher' if higher_is_better else 'lower'} is better)"


def headline_value(result: dict[str, Any], field: str) -> float | None:
    if field == "tok_per_s":
        return result["tok_per_s"]
    if field == "ttft_p50_ms":
        return None if result["ttft_ms"] is None else result["ttft_ms"]["p50"]
    if field == "itl_p99_ms":
        return None if result["itl_ms"] is None else result["itl_ms"]["p99"]
    raise KeyError(f"unknown headline field {field!r}")


def figures(online: dict[str, Any] | None, ablations: Panels | None,
            prefix: str = "ch19") -> dict[str, str]:
    """Every figure the data allows: file name -> SVG text."""
    out: dict[str, str] = {}
    if online is not None and online["results"]:
        out[f"{prefix}_latency_throughput.svg"] = latency_throughput(online)
        out[f"{prefix}_ttft_by_rate.svg"] = percentiles_by_rate(
            online, "ttft_ms", "Time to first token against request rate")
        out[f"{prefix}_tpot_by_rate.svg"] = percentiles_by_rate(
            online, "tpot_ms", "Time per output token against request rate")
        busiest = max(range(len(online["results"])),
                      key=lambda i: online["results"][i]["output_throughput"])
        out[f"{prefix}_itl_cdf.svg"] = itl_distribution(online, busiest)
    if ablations:
        out[f"{prefix}_ablations.svg"] = ablation_bars(ablations)
    return out


def write_figures(online_path: Path | None, ablations_path: Path | None, out_dir: Path,
                  prefix: str = "ch19") -> list[Path]:
    def load(path: Path | None) -> dict[str, Any] | None:
        return None if path is None else json.loads(path.read_text(encoding="utf-8"))

    panels = None
    if ablations_path is not None:  # a JSON report, or the recording of the run that wrote it
        panels = (ablation_panels(load(ablations_path)) if ablations_path.suffix == ".json"
                  else printed_ablation_panels(ablations_path.read_text(encoding="utf-8")))
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, svg in figures(load(online_path), panels, prefix).items():
        path = out_dir / name
        path.write_text(svg, encoding="utf-8")
        written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(prog="python benchmark/plots.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--online", type=Path, default=None, help="online.py's --out JSON")
    parser.add_argument("--ablations", type=Path, default=None,
                        help="offline.py --ablations' --out JSON, or a recording of its "
                             "printed table (any other file)")
    parser.add_argument("--out", type=Path, default=Path("chapters/figures"),
                        help="directory of the SVG files (default: %(default)s)")
    parser.add_argument("--prefix", default="ch19", help="file name prefix (default: ch19)")
    args = parser.parse_args(argv)
    if args.online is None and args.ablations is None:
        parser.error("give --online, --ablations or both")
    for path in (args.online, args.ablations):
        if path is not None and not path.is_file():
            parser.error(f"{path}: no such file")
    written = write_figures(args.online, args.ablations, args.out, args.prefix)
    for path in written:
        print(f"wrote {path}")
    return written


if __name__ == "__main__":
    main()
