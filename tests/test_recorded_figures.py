"""The book's benchmark figures are what `benchmark/plots.py` draws from the recordings.

Chapter 19 shows SVG figures of the H200 recordings under `docs/recorded/`: the online runs'
JSON, and the ablation table the page includes, as that run printed it. This test redraws them
and compares them byte for byte with the committed files, so that a figure cannot drift from
its data (rerun the command in the failure message after a new recording).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
RECORDED = ROOT / "docs" / "recorded"
FIGURES = ROOT / "chapters" / "figures"
ONLINE, ABLATIONS = RECORDED / "ch19_online-cuda.json", RECORDED / "ch19_ablations-cuda.txt"


def test_the_committed_figures_are_redrawn_from_the_recordings(
        repo_script: Callable[[str], ModuleType], tmp_path: Path) -> None:
    plots = repo_script("benchmark/plots.py")
    drawn = plots.write_figures(ONLINE, ABLATIONS, tmp_path)
    assert len(drawn) == 5, [p.name for p in drawn]
    command = (f"python benchmark/plots.py --online {ONLINE.relative_to(ROOT)} "
               f"--ablations {ABLATIONS.relative_to(ROOT)} --out chapters/figures")
    for path in drawn:
        committed = FIGURES / path.name
        assert committed.exists(), f"{committed} is missing; draw it with `{command}`"
        assert committed.read_bytes() == path.read_bytes(), \
            f"{committed.name} differs from its data; redraw it with `{command}`"
