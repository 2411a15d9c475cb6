"""The docs hook that lets a reader run an exercise's tests in the browser.

An exercise whose `exercise.toml` says `browser = true` needs no PyTorch: its page gets an
editor with the starter, "Run the tests" and "Reset" buttons and the per-test results, and
`docs/assets/exercise.js` runs its own `test_exercise.py` with pytest inside Pyodide in a Web
Worker (`docs/assets/exercise-worker.mjs`, which calls `practice/browser_run.py`). At build
time this hook

* writes one bundle per such exercise, `assets/exercises/<name>.json`: the layout the local
  judge runs in (`practice/judge.py`'s `stage`: the chapter's `minisgl` tree, the tests, the
  conftest, the tiny model's config files) and the starter;
* copies Pyodide and the test runner's wheels from `.browser/` (`tools/browser_runtime.py`
  fetches them) into `assets/pyodide/`, so nothing is loaded from outside the site;
* fills `<!-- browser-exercises -->` (the practice page) with the list of those exercises.

The other exercises' pages say they need PyTorch and show the local judge command. Without
`.browser/` the site still builds, and every exercise page offers the local judge only.
"""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.plugins import get_plugin_logger
from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page

log = get_plugin_logger("browser")

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ROOT / ".browser"
BROWSER_EXERCISES = re.compile(r"<!--\s*browser-exercises\s*-->")
EXERCISE_PAGE = re.compile(r"^practice/(?P<name>[^/]+)\.md$")
# Files of the staged judge layout a browser run needs (the rest is examples and tools).
BUNDLED = re.compile(r"^(minisgl/.*\.py|exercise/[^/]+\.py|judge_plugins/[^/]+\.py)$")
TINY_MODEL = "models/tiny-qwen3"
TINY_MODEL_FILES = ("config.json", "generation_config.json")  # what a test without torch reads
RUNNER_FILES = ("results.py", "browser_run.py")  # from practice/, at the bundle's root
STACK_SWITCHING = ("Chrome or Edge 137 or newer (they run asyncio code through WebAssembly "
                   "stack switching); Firefox and Safari do not yet")


# practice/judge.py and its exercises, as this build read them (see on_config)
_judge: ModuleType | None = None
_exercises: list[Any] = []


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    """Read practice/judge.py (and, through it, every exercise) once per build, not per page."""
    global _judge, _exercises
    spec = importlib.util.spec_from_file_location("_browser_judge", ROOT / "practice" / "judge.py")
    assert spec is not None and spec.loader is not None
    _judge = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = _judge
    spec.loader.exec_module(_judge)
    _exercises = _judge.load_exercises()
    return config


def judge() -> ModuleType:
    """practice/judge.py, which knows the exercises and how a run is laid out."""
    assert _judge is not None, "on_config reads practice/judge.py before any page"
    return _judge


def runtime_ready() -> bool:
    return (RUNTIME / "runtime.json").exists()


def exercises() -> list[Any]:
    return _exercises


def uses_asyncio(ex: Any) -> bool:
    sources = (ex.folder / "test_exercise.py", ex.starter)
    return any("asyncio" in p.read_text(encoding="utf-8") for p in sources)


# --------------------------------------------------------------------------- pages
def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    markdown = BROWSER_EXERCISES.sub(lambda m: browser_list(), markdown)
    m = EXERCISE_PAGE.match(page.file.src_uri)
    if m is None:
        return markdown
    ex = next((e for e in exercises() if e.id == m.group("name")), None)
    if ex is None:
        return markdown
    return markdown + "\n\n" + runner_section(ex)


def runner_section(ex: Any) -> str:
    command = f"`python practice/judge.py {ex.id}`"
    if not ex.in_browser:
        return ("## Run the tests\n\n"
                f"This exercise needs PyTorch, which does not run in a browser: write "
                f"`practice/{ex.id}/{ex.file}` in your checkout and judge it with {command}.\n")
    if not runtime_ready():
        return ("## Run the tests\n\n"
                f"This site was built without the in-browser runner (`python "
                f"tools/browser_runtime.py`, then rebuild, adds it): judge locally with "
                f"{command}.\n")
    note = ""
    if uses_asyncio(ex):
        note = (f"\nIts tests use asyncio, which runs in the browser in {STACK_SWITCHING}; "
                f"elsewhere use the local judge.\n")
    return (
        "## Run the tests in your browser\n\n"
        f"Write `{ex.file}` below and run its tests here: the same `test_exercise.py` the "
        f"local judge runs ({command}), with pytest in Python compiled to WebAssembly, on this "
        f"page, offline. Your code is kept in this browser's local storage.\n{note}\n"
        f'<div class="exercise-runner" data-exercise="{ex.id}" data-file="{ex.file}" '
        f'data-asyncio="{str(uses_asyncio(ex)).lower()}">\n'
        f'<textarea class="exercise-editor" spellcheck="false" aria-label="{ex.file}"></textarea>\n'
        '<p class="exercise-buttons"><button type="button" class="md-button md-button--primary '
        'exercise-run">Run the tests</button> <button type="button" class="md-button '
        'exercise-reset">Reset to the starter</button></p>\n'
        '<p class="exercise-status" role="status"></p>\n'
        '<ol class="exercise-results"></ol>\n'
        '<details class="exercise-output"><summary>pytest output</summary><pre></pre></details>\n'
        "</div>\n"
    )


def browser_list() -> str:
    mine = [ex for ex in exercises() if ex.in_browser]
    if not mine:
        return "*No exercise runs in the browser yet.*"
    rows = ["| exercise | chapter | note |", "|---|---|---|"]
    for ex in mine:
        note = "asyncio: needs WebAssembly stack switching" if uses_asyncio(ex) else ""
        chapter = ex.chapter[2:].lstrip("0")
        rows.append(f"| [{ex.title}](practice/{ex.id}.md) | {chapter} | {note} |")
    return "\n".join(rows)


# --------------------------------------------------------------------------- build output
def on_post_build(config: MkDocsConfig) -> None:
    """Put Pyodide, the wheels and one bundle per browser exercise into the built site."""
    site = Path(config.site_dir)
    if not runtime_ready():
        log.info("no .browser/ (python tools/browser_runtime.py): exercises run locally only")
        return
    target = site / "assets" / "pyodide"
    shutil.copytree(RUNTIME / "pyodide", target, dirs_exist_ok=True)
    shutil.copytree(RUNTIME / "wheels", target / "wheels", dirs_exist_ok=True)
    shutil.copy2(RUNTIME / "runtime.json", target / "runtime.json")
    judge().steps.ensure_tiny_model(ROOT)  # its config files go into the bundles
    for ex in exercises():
        if ex.in_browser:
            bundle = exercise_bundle(judge(), ex)
            out = site / "assets" / "exercises" / f"{ex.id}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(bundle, sort_keys=True), encoding="utf-8")


def exercise_bundle(judge: ModuleType, ex: Any) -> dict[str, Any]:
    """The judge's layout for `ex`, as {relative path: text}, with the starter beside it."""
    files: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix=f"bundle-{ex.id}-") as tmp:
        workdir = Path(tmp)
        judge.stage(ex, ex.starter, workdir)
        for path in sorted(workdir.rglob("*")):
            rel = path.relative_to(workdir).as_posix()
            if path.is_file() and BUNDLED.match(rel):
                files[rel] = path.read_text(encoding="utf-8")
    for name in TINY_MODEL_FILES:  # the checkpoint links models/ (rglob does not follow it)
        files[f"{TINY_MODEL}/{name}"] = (ROOT / TINY_MODEL / name).read_text(encoding="utf-8")
    for name in RUNNER_FILES:
        files[name] = (ROOT / "practice" / name).read_text(encoding="utf-8")
    return {"exercise": ex.id, "file": ex.file, "starter": ex.starter.read_text(encoding="utf-8"),
            "engine_answer": ex.engine_answer, "files": files}
