"""The book's site builds with no warnings and reads correctly in a real browser.

`mkdocs build --strict` runs once into a temporary directory; the site is served from
127.0.0.1 and pages are opened in headless Chromium, which loads them the way a reader's browser
does (scripts, styles, images) and hands back the rendered DOM. Without Chromium the browser
tests are skipped and say how to install it; the build itself is always checked.
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

# Building the site and starting a browser take several seconds each.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / ".artifacts"  # screenshots, git-ignored
BROWSER_TIMEOUT_S = 120
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
NO_CHROMIUM = (
    "no Chromium found (looked for /usr/bin/chromium and " + ", ".join(CHROMIUM_NAMES) + " on "
    "PATH); install it, e.g. `apt-get install -y chromium`, to run the browser check"
)
# Pygments marks tokens with short classes: k keyword, n name, s2 string, nf function name, ...
PYGMENTS_TOKEN = re.compile(r'<span class="(?:k|kn|n|nf|nb|s|s1|s2|o|p|mi|c1)">')


def find_chromium() -> str | None:
    if Path("/usr/bin/chromium").exists():
        return "/usr/bin/chromium"
    return next((path for name in CHROMIUM_NAMES if (path := shutil.which(name))), None)


class QuietHandler(SimpleHTTPRequestHandler):
    """Serves the built site; remembers every request so tests can see what the browser fetched."""

    requests: list[tuple[str, int]]

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        self.requests.append((self.path, int(code) if str(code).isdigit() else 0))

    def log_message(self, format: str, *args: object) -> None:  # no noise on stderr
        pass


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built with `mkdocs build --strict` into a temporary directory."""
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[dev]')")
    out = tmp_path_factory.mktemp("site") / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
         "-d", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[tuple[str, list[tuple[str, int]]]]:
    """(base URL, log of (path, status) requests) of the site served on 127.0.0.1."""
    log: list[tuple[str, int]] = []
    handler = type("Handler", (QuietHandler,), {"requests": log})
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", log
    finally:
        server.shutdown()
        server.server_close()


def chromium(url: str, profile: Path, *extra: str) -> str:
    """Run headless Chromium on `url` with `extra` flags; return its stdout."""
    browser = find_chromium()
    if browser is None:
        pytest.skip(NO_CHROMIUM)
    cmd = [
        browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", f"--user-data-dir={profile}", "--window-size=1280,900",
        "--virtual-time-budget=5000", *extra, url,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BROWSER_TIMEOUT_S)
    assert proc.returncode == 0, f"chromium failed on {url}:\n{proc.stderr[-3000:]}"
    return proc.stdout


def render(url: str, profile: Path, screenshot: str) -> str:
    """The DOM of `url` after the browser ran its scripts; a screenshot lands in .artifacts/."""
    ARTIFACTS.mkdir(exist_ok=True)
    return chromium(url, profile, f"--screenshot={ARTIFACTS / screenshot}", "--dump-dom")


def test_every_chapter_of_the_manifest_has_a_page(
    site: Path, repo_script: Callable[[str], ModuleType]
) -> None:
    steps = repo_script("tools/steps.py")
    manifest = steps.load_manifest(ROOT)
    missing = [ch.name for ch in manifest.chapters
               if not (site / "chapters" / ch.name / "index.html").exists()]
    assert not missing, f"chapters without a page on the site: {missing}"
    for page in ("tour", "setup", "practice", "reference"):
        assert (site / page / "index.html").exists(), f"the site has no {page} page"


def test_chapter_page_renders_with_title_navigation_and_code(
    served: tuple[str, list[tuple[str, int]]], tmp_path: Path,
    repo_script: Callable[[str], ModuleType]
) -> None:
    base, requests = served
    ch = repo_script("tools/steps.py").load_manifest(ROOT).chapter("ch01")
    dom = render(f"{base}/chapters/{ch.name}/", tmp_path, "ch01.png")

    assert ch.title in dom, f"the page does not show the chapter's title {ch.title!r}"
    assert 'class="md-nav' in dom and "Stage 1 · One model, one prompt" in dom, (
        "the page has no navigation listing the stages"
    )
    assert "Stage 4 · Scaling out" in dom, "the navigation does not reach the last stage"
    if ch.written and (ROOT / ch.page).exists():
        python = re.search(r'class="language-python highlight".*?</pre>', dom, re.S)
        assert python, "the chapter page has no Python code block"
        assert PYGMENTS_TOKEN.search(python.group(0)), "its code is not highlighted by Pygments"
        assert 'data-md-type="copy"' in dom, "code blocks have no copy button"
    assert "fonts.googleapis.com" not in dom, "the page loads web fonts from the network"
    failed = [(path, code) for path, code in requests if code >= 400]
    assert not failed, f"the browser asked for files the site does not have: {failed}"


def test_tour_shows_the_process_diagram_and_highlighted_code(
    served: tuple[str, list[tuple[str, int]]], tmp_path: Path
) -> None:
    base, requests = served
    dom = render(f"{base}/tour/", tmp_path, "tour.png")

    diagram = re.search(r'<img[^>]+src="[^"]*process-flow\.svg"', dom)
    assert diagram, "the tour has no process diagram"
    fetched = [code for path, code in requests if path.endswith("process-flow.svg")]
    assert fetched and all(code in (200, 304) for code in fetched), (
        f"the browser could not load the diagram (responses: {fetched})"
    )
    python = re.search(r'class="language-python highlight".*?</pre>', dom, re.S)
    assert python and PYGMENTS_TOKEN.search(python.group(0)), "the tour's Python is not highlighted"
    for cdn in ("cdn.jsdelivr.net", "unpkg.com"):
        assert cdn not in dom, f"the page loads scripts from {cdn}"


# ----------------------------------------------------------------------- exercises in the browser
def browser_exercises(repo_script: Callable[[str], ModuleType]) -> list[Any]:
    return [ex for ex in repo_script("practice/judge.py").load_exercises() if ex.in_browser]


def run_in_page(page: Any, timeout_ms: int) -> dict[str, list[str]]:
    """Click "Run the tests" and wait for the verdict: {outcome: [test names with messages]}."""
    page.click(".exercise-run")
    page.wait_for_selector(
        '.exercise-runner[data-state="done"], .exercise-runner[data-state="error"]',
        timeout=timeout_ms)
    assert page.get_attribute(".exercise-runner", "data-state") == "done", (
        f"the run failed: {page.inner_text('.exercise-status')}\n"
        f"{page.inner_text('.exercise-output pre')[-2000:]}"
    )
    by_outcome: dict[str, list[str]] = {}
    for item in page.query_selector_all(".exercise-result"):
        outcome = item.get_attribute("data-outcome") or "?"
        by_outcome.setdefault(outcome, []).append(item.inner_text())
    return by_outcome


def test_browser_exercises_run_offline_in_the_page(
    served: tuple[str, list[tuple[str, int]]], repo_script: Callable[[str], ModuleType]
) -> None:
    """Every exercise marked `browser = true` runs its own tests on its page with the network
    blocked except for the site: the untouched starter fails with messages shown, the reference
    solution (typed into the editor) passes; tests that need PyTorch may only be skipped."""
    if not (ROOT / ".browser" / "runtime.json").exists():
        pytest.skip("the site was built without the in-browser runner: "
                    "run `python tools/browser_runtime.py` first")
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    browser_path = find_chromium()
    if browser_path is None:
        pytest.skip(NO_CHROMIUM)
    exercises = browser_exercises(repo_script)
    chapters = {ex.chapter for ex in exercises}
    wanted = {"ch01", *(f"ch{n:02d}" for n in range(9, 17))}  # every idea that needs no tensors
    assert wanted <= chapters, f"no exercise of {sorted(wanted - chapters)} runs in the browser"
    base, _ = served
    blocked: list[str] = []

    def only_the_site(route: Any) -> None:
        if route.request.url.startswith(base):
            route.continue_()
        else:
            blocked.append(route.request.url)
            route.abort()

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=browser_path,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"])
        try:
            context = browser.new_context()
            context.route("**/*", only_the_site)
            for ex in exercises:
                page = context.new_page()
                page.goto(f"{base}/practice/{ex.id}/")
                page.wait_for_selector('.exercise-runner[data-state="ready"]', timeout=30_000)
                assert page.input_value(".exercise-editor") == ex.starter.read_text(), (
                    f"{ex.id}: the editor does not hold the starter")

                starter = run_in_page(page, BROWSER_TIMEOUT_S * 1000)
                assert starter.get("failed"), f"{ex.id}: the untouched starter passed: {starter}"
                assert all("\n" in line for line in starter["failed"]), (
                    f"{ex.id}: a failing test shows no message: {starter['failed']}")

                page.fill(".exercise-editor", ex.solution.read_text())
                solution = run_in_page(page, BROWSER_TIMEOUT_S * 1000)
                assert not solution.get("failed"), (
                    f"{ex.id}: the reference solution fails in the browser: {solution['failed']}")
                assert len(solution.get("passed", [])) > len(solution.get("skipped", [])), (
                    f"{ex.id}: most tests were skipped in the browser: {solution}")
                page.reload()  # the edited code survives a reload (local storage)
                page.wait_for_selector('.exercise-runner[data-state="ready"]', timeout=30_000)
                assert page.input_value(".exercise-editor") == ex.solution.read_text()
                page.close()
        finally:
            browser.close()
    runtime = [url for url in blocked if "pyodide" in url or url.endswith((".whl", ".wasm"))]
    assert not runtime, f"the runner asked outside the site for: {runtime}"


# --------------------------------------------------------------------------- snapshot captions
SNAPSHOT_INCLUDE = re.compile(r'--8<-- "tools/versions/(ch\d\d)/([^":]+)[^"]*"')
# An include of one top-level name ("...::Name", no dot, no second name) of a snapshot.
SNAPSHOT_NAME = re.compile(r'--8<-- "tools/versions/(ch\d\d)/([^":]+\.py)::(\w+)"')


def later_changes(manifest: object, chapter_id: str, path: str) -> list[int]:
    """The chapters after `chapter_id` that modify `path`, as the manifest lists them."""
    first = manifest.chapter(chapter_id).number  # type: ignore[attr-defined]
    return [c.number for c in manifest.chapters  # type: ignore[attr-defined]
            if c.number > first and path in c.modified]


def test_every_snapshot_include_is_captioned_with_its_chapter(
    site: Path, repo_script: Callable[[str], ModuleType]
) -> None:
    manifest = repo_script("tools/steps.py").load_manifest(ROOT)
    includes = 0
    for ch in manifest.chapters:
        if not (ROOT / ch.page).exists():
            continue
        wanted = []
        for chapter_id, path in SNAPSHOT_INCLUDE.findall((ROOT / ch.page).read_text("utf-8")):
            later = later_changes(manifest, chapter_id, path)
            number = manifest.chapter(chapter_id).number
            wanted.append(f"{path} as of chapter {number}"
                          + (f" (changed in chapter{'s' if len(later) > 1 else ''} "
                             f"{', '.join(map(str, later))})" if later else ""))
        html = (site / "chapters" / ch.name / "index.html").read_text("utf-8")
        shown = re.findall(r'<span class="filename">([^<]*)</span>', html)
        assert sorted(s for s in shown if " as of chapter " in s) == sorted(wanted), (
            f"{ch.page}: the captions of its {len(wanted)} snapshot includes differ\n"
            f"expected {sorted(wanted)}\nactual   {sorted(shown)}"
        )
        includes += len(wanted)
    assert includes > 0, "no chapter includes a snapshot, so nothing was checked"


def test_caption_lists_every_later_chapter_and_leaves_other_blocks_alone(
    repo_script: Callable[[str], ModuleType]
) -> None:
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[dev]')")
    hook = repo_script("docs/hooks/book.py")
    steps = repo_script("tools/steps.py")
    manifest = steps.load_manifest(ROOT)
    book = hook.Book(ROOT, steps, manifest)
    # A file changed twice after its snapshot: every later chapter is named, in order.
    chapter_id, path = next(
        (c.id, p) for c in manifest.chapters for p in (*c.new, *c.early, *c.modified)
        if len(later_changes(manifest, c.id, p)) >= 2
    )
    later = ", ".join(map(str, later_changes(manifest, chapter_id, path)))
    page = (
        f'```python\n--8<-- "tools/versions/{chapter_id}/{path}::Name"\n```\n\n'
        '```python\n--8<-- "minisgl/core.py::Req"\n```\n'
    )
    out = hook.captioned_snapshots(book, page, "chapters/example.md")
    number = manifest.chapter(chapter_id).number
    assert f'```python title="{path} as of chapter {number} (changed in chapters {later})"' in out
    assert '```python\n--8<-- "minisgl/core.py::Req"' in out, "a current file got a caption"
    assert out.count("--8<--") == 2, "captioning dropped an include"


def test_a_name_and_a_whole_file_are_included_from_a_rebuilt_version(
    repo_script: Callable[[str], ModuleType]
) -> None:
    """`tools/versions/chNN/<path>` names no file: the hook rebuilds the version from its
    patch and shows the symbol (or the whole file) as that chapter wrote it."""
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[dev]')")
    hook, steps = repo_script("docs/hooks/book.py"), repo_script("tools/steps.py")
    manifest = steps.load_manifest(ROOT)
    book = hook.Book(ROOT, steps, manifest)
    chapter_id, path, name = next(
        m.groups() for p in sorted((ROOT / "chapters").glob("ch*.md"))
        for m in SNAPSHOT_NAME.finditer(p.read_text("utf-8")))
    text = steps.snapshots.earlier_version(manifest, path, chapter_id)
    page = (f'```python\n--8<-- "tools/versions/{chapter_id}/{path}::{name}"\n```\n\n'
            f'```python\n--8<-- "tools/versions/{chapter_id}/{path}"\n```\n')
    out = hook.included_names(book, page, "chapters/example.md")
    shown, whole = out.split("```\n\n")
    assert re.search(rf"^(async def|def|class) {name}\b", shown, re.M), shown
    assert shown.split("\n", 1)[1].rstrip("\n") in text
    assert whole == "```python\n" + text.rstrip("\n") + "\n```\n"


def test_strict_build_fails_on_a_renamed_symbol(
    tmp_path: Path, repo_script: Callable[[str], ModuleType]
) -> None:
    """A page includes a snapshot's function or class by name; renaming it in the file stops
    the build with a message naming the page, the file and the name."""
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[dev]')")
    copy = tmp_path / "repo"
    top_level_only = {".git", "site", ".artifacts"}  # minisgl/models/ must come along
    shutil.copytree(ROOT, copy, ignore=lambda folder, names: [
        n for n in names if n in {"__pycache__", ".hypothesis", ".pytest_cache"}
        or (Path(folder) == ROOT and n in top_level_only)
        # of models/, only the committed one (the appendix page shows its loss curve)
        or (Path(folder) == ROOT / "models" and n != "tiny-shakespeare")])
    # The first snapshot include of a single top-level function or class.
    page, path, name = next(
        (p, f"tools/versions/{m.group(1)}/{m.group(2)}", m.group(3))
        for p in sorted((copy / "chapters").glob("ch*.md"))
        for m in SNAPSHOT_NAME.finditer(p.read_text("utf-8")))
    # The version is rebuilt from its patch; a full copy beside the patch wins over it.
    snapshots = repo_script("tools/snapshots.py")
    chapter_id, rel = path.split("/", 3)[2:]
    text = snapshots.earlier_version(repo_script("tools/steps.py").load_manifest(copy), rel,
                                     chapter_id)
    definition = re.compile(rf"^((?:async )?def|class) {re.escape(name)}\b", re.M)
    assert definition.search(text), f"{path} defines no {name}"
    (copy / path).write_text(definition.sub(rf"\1 {name}_renamed", text), encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=copy, env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode != 0, (
        f"mkdocs build --strict passed although {path} no longer defines {name}, which "
        f"{page.name} includes\n{proc.stdout[-2000:]}"
    )
    message = next((line for line in (proc.stdout + proc.stderr).splitlines()
                    if f"{path}::{name}" in line), "")
    assert page.name in message and f"no {name}" in message, (proc.stdout + proc.stderr)[-2000:]


# The measuring page: the site's pages in same-origin frames of given widths; a script reads the
# rendered layout and writes what it found into the DOM that Chromium dumps.
MEASURE_PAGE = """<!doctype html><meta charset="utf-8"><body>
<iframe id="desk" src="PAGE" style="width:1400px;height:900px"></iframe>
<iframe id="wide" src="PAGE" style="width:1920px;height:900px"></iframe>
<iframe id="phone" src="FIGURE_PAGE" style="width:390px;height:800px"></iframe>
<iframe id="dark" src="FIGURE_PAGE" style="width:1400px;height:900px"></iframe>
<script>
function scrolling(doc) {
  // Code blocks whose lines are all at most 100 characters, and those of them that scroll.
  const blocks = [...doc.querySelectorAll(".md-typeset pre > code")].filter(code =>
    Math.max(...code.textContent.split("\\n").map(line => line.length)) <= 100);
  const scroll = blocks.filter(code => code.scrollWidth > code.clientWidth + 1);
  return blocks.length + " " + scroll.length;
}
function figure(doc, dark) {
  if (dark) doc.body.setAttribute("data-md-color-scheme", "slate");
  const img = doc.querySelector('.md-typeset img[src$=".svg"]');
  const style = doc.defaultView.getComputedStyle(img);
  return Math.round(img.getBoundingClientRect().width) + " " + style.filter.replace(/ /g, "")
    + " " + style.borderRadius;
}
window.addEventListener("load", () => {
  const doc = id => document.getElementById(id).contentDocument;
  const out = document.createElement("pre");
  out.id = "measured";
  out.textContent = ["desk " + scrolling(doc("desk")), "wide " + scrolling(doc("wide")),
                     "phone " + figure(doc("phone"), false), "dark " + figure(doc("dark"), true)
                    ].join("\\n");
  document.body.appendChild(out);
});
</script>"""


def measure(site: Path, base: str, tmp_path: Path, page: str,
            figure_page: str) -> dict[str, list[str]]:
    """What MEASURE_PAGE finds: per frame, its numbers (see the script)."""
    (site / "measure.html").write_text(
        MEASURE_PAGE.replace("FIGURE_PAGE", figure_page).replace("PAGE", page), encoding="utf-8")
    dom = chromium(f"{base}/measure.html", tmp_path, "--window-size=3800,1000", "--dump-dom")
    found = re.search(r'<pre id="measured">(.*?)</pre>', dom, re.S)
    assert found, "the measuring script did not run"
    return {line.split()[0]: line.split()[1:] for line in found.group(1).splitlines()}


def test_code_fits_and_figures_read_on_a_phone_and_in_the_dark(
    site: Path, served: tuple[str, list[tuple[str, int]]], tmp_path: Path
) -> None:
    base, _ = served
    found = measure(site, base, tmp_path, "/chapters/ch16_lifecycle/", "/chapters/ch16_lifecycle/")
    for width in ("desk", "wide"):  # 1400 and 1920 px
        blocks, scrolling = map(int, found[width])
        assert blocks > 10 and scrolling == 0, (
            f"{scrolling} of {blocks} code blocks of lines up to 100 characters scroll at {width}")
    phone_width = int(found["phone"][0])
    assert phone_width >= 500, f"at phone width the figure shrinks to {phone_width} px"
    dark_filter, radius = found["dark"][1], found["dark"][2]
    assert "invert" in dark_filter and radius != "0px", (
        f"in the dark scheme the figure is a white box (filter {dark_filter}, radius {radius})")


def test_setup_readme_and_appendix_name_the_examples_that_run_the_trained_model() -> None:
    """README, Setup and the model appendix say which chapters' examples default to
    models/tiny-shakespeare; the examples' own `--model` defaults decide."""
    trained = {int(p.name[2:4]) for p in (ROOT / "examples").glob("ch*_*.py")
               if re.search(r'"--model", default="models/tiny-shakespeare"',
                            p.read_text(encoding="utf-8"))}
    assert trained, "no example defaults to models/tiny-shakespeare"
    claims = {
        "README.md": r"the examples of chapters ([\d, and]+) run on",
        "docs/setup.md": r"the examples of chapters ([\d, and]+) run on",
        "docs/model.md": r"the examples of chapters ([\d, and]+) talk to",
    }
    for page, pattern in [*claims.items(),
                          ("docs/setup.md", r"`models/tiny-shakespeare` in chapters ([\d, and]+),")]:
        text = " ".join((ROOT / page).read_text(encoding="utf-8").split())
        named = re.search(pattern, text)
        assert named, f"{page} no longer says which examples run on tiny-shakespeare"
        stated = {int(n) for n in re.findall(r"\d+", named[1])}
        assert stated == trained, (f"{page} names chapters {sorted(stated)}; the examples of "
                                   f"chapters {sorted(trained)} default to tiny-shakespeare")
