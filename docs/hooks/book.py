"""The book's mkdocs hook: everything on the site that is generated rather than written.

The manifest `tools/steps.toml` (read through `tools/steps.py`) is the one list of chapters.
From it this hook

* inserts the four stages and their chapters into the navigation, after the Setup page;
* brings every written `chapters/chNN_<slug>.md` into the site (edit links point at the real
  file) and generates a "coming" page for every chapter not written yet, so no link 404s;
* brings every exercise statement `practice/<name>/README.md` in as `practice/<name>.md`;
* fills in the placeholders pages leave for it:

      <!-- files-you-will-write -->   a chapter's new, modified and brought-in-early files
      <!-- files-so-far -->           the chapter's tree with its counts
      <!-- chapter-list -->           every chapter by stage, with its status (home page)
      <!-- practice-list -->          every exercise with its judge command
      <!-- usage: tools/steps.py -->  the `--help` text of a script's `build_parser()`
      <!-- env-vars -->               the MINISGL_* environment variables

* captions every code block that includes an earlier version of a file
  (`tools/versions/chNN/<path>`): "<path> as of chapter N (changed in chapters X, Y)", the later
  chapters read from the manifest, so a reader knows the file in the tree reads differently;
  that path names no file: the version is rebuilt from its patch by `tools/snapshots.py`;
* includes code by qualified name (below);
* and warns, which fails `mkdocs build --strict`, when a page includes a recorded output
  (`docs/recorded/...`) that has not been recorded, naming the command that records it, or
  includes a snapshot outside a code block, where it cannot be captioned.

Code by name. Inside a fenced code block, a line

    --8<-- "minisgl/core.py::Req.append_token"

is replaced by the source of that symbol, found with `ast`: a function, class, method, nested
class or function, or a module- or class-level assignment (`PREFIX_CACHES`, the dataclass
field `SamplingParams.stop`), with its decorators and the comment lines directly above it
(up to a section rule such as `# ---- requests out`, which heads a part of the file), dedented.
Definitions under a module's `if`/`try` count as the module's; the first definition of a name
is the one shown. Several names, separated by spaces, show neighbours in one block, in the
order written; names next to each other in the file keep the blank lines between them. A
name written `-Class.member` leaves that member out of a class included in the same line (a
class shown without the methods the page shows later):

    --8<-- "minisgl/core.py::Req -Req.append_token -Req.__repr__"

A file or a name that does not resolve is a warning naming the page, the file and the name, so
a renamed symbol fails `mkdocs build --strict`. Whole files (examples, recorded outputs) are
included by pymdownx.snippets (`--8<-- "examples/ch01_config.py"`), which stops the build on a
missing file itself (`check_paths: true`); a whole earlier version
(`--8<-- "tools/versions/ch07/minisgl/core.py"`) is included by this hook.
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import re
import sys
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.plugins import get_plugin_logger
from mkdocs.structure.files import File, Files, InclusionLevel
from mkdocs.structure.pages import Page

log = get_plugin_logger("book")

USAGE_WIDTH = "88"  # columns of the rendered --help text, so the page does not depend on a terminal
SNIPPET_LINE = re.compile(r'^(?P<indent>[ \t]*)--8<--[ \t]+"(?P<target>[^"]+)"[ \t]*$', re.M)
# `--8<-- "path::Name Other.name -Name.left_out"`: code by qualified name (module docstring).
NAME_INCLUDE = re.compile(
    r'^(?P<indent>[ \t]*)--8<--[ \t]+"(?P<path>[^":]+)::(?P<names>[^"]+)"[ \t]*$', re.M
)
SECTION_RULE = re.compile(r"^[ \t]*#[ \t]*[-=]{8,}")
RECORDED = "docs/recorded/"
SNAPSHOT = re.compile(r"^tools/versions/(?P<chapter>ch\d\d)/(?P<path>[^:]+)")
# A whole earlier version, which exists only as a patch, so pymdownx.snippets cannot read it.
SNAPSHOT_FILE = re.compile(
    r'^(?P<indent>[ \t]*)--8<--[ \t]+"(?P<path>tools/versions/ch\d\d/[^":]+)"[ \t]*$', re.M
)
# A fenced code block: its opening line (indent, fence, info string), body and closing fence.
CODE_BLOCK = re.compile(
    r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^\n`]*)\n(?P<body>(?:.*\n)*?)"
    r"(?P=indent)(?P=fence)[ \t]*$",
    re.M,
)
FILES_YOU_WILL_WRITE = re.compile(r"<!--\s*files-you-will-write\s*-->")
# The bold run-in head the template puts before the tree is folded into the generated line.
FILES_SO_FAR = re.compile(
    r"(?P<head>^\*\*Files so far:?\*\*[ \t]*(?:\n(?:[ \t]*\n)?)?[ \t]*)?"
    r"<!--\s*files-so-far\s*-->",
    re.M,
)
CHAPTER_LIST = re.compile(r"<!--\s*chapter-list\s*-->")
PRACTICE_LIST = re.compile(r"<!--\s*practice-list\s*-->")
USAGE = re.compile(r"<!--\s*usage:\s*(?P<path>[\w./-]+)\s*-->")
ENV_VARS = re.compile(r"<!--\s*env-vars\s*-->")


# --------------------------------------------------------------------------- state of one build
@dataclass
class Book:
    """What one build knows: the repository root, tools/steps.py and its manifest."""

    root: Path
    steps: ModuleType
    manifest: Any  # steps.Manifest

    def chapter_of(self, src_uri: str) -> Any | None:
        """The manifest chapter whose page is `src_uri` (e.g. "chapters/ch01_config.md")."""
        for ch in self.manifest.chapters:
            if ch.page.as_posix() == src_uri:
                return ch
        return None


@dataclass(frozen=True)
class Exercise:
    """One `practice/<name>/exercise.toml`."""

    name: str
    title: str
    chapter: str
    file: str
    summary: str

    @property
    def page(self) -> str:
        return f"practice/{self.name}.md"


# Set by on_config at the start of every build (mkdocs serve rebuilds re-read the manifest).
_book: Book | None = None


def book() -> Book:
    if _book is None:
        raise PluginError("book hook: on_config has not run")
    return _book


# --------------------------------------------------------------------------- events
def on_config(config: MkDocsConfig) -> MkDocsConfig:
    """Read the manifest, add the stages to the nav and anchor snippet paths at the repo root."""
    global _book
    root = Path(config.config_file_path).resolve().parent
    steps_py = root / "tools" / "steps.py"
    if not steps_py.exists():
        raise PluginError(f"{steps_py} is missing: the site's chapter list comes from it")
    steps = load_script(steps_py)
    try:
        manifest = steps.load_manifest(root)
    except ValueError as exc:  # steps.ManifestError
        raise PluginError(str(exc)) from exc
    _book = Book(root, steps, manifest)
    config.nav = with_stages(config.nav or [], manifest)
    # Snippet paths are repository-relative; anchoring them makes `mkdocs build -f` work from
    # any directory, not only from the repository root.
    snippets = config.mdx_configs.setdefault("pymdownx.snippets", {})
    snippets["base_path"] = [str(root)]
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add the chapter pages (written or coming), chapter figures and exercise statements."""
    b = book()
    for f in files:
        if f.generated_by is None:  # a page of docs/: its source lives under docs/
            f.edit_uri = f"docs/{f.src_uri}"

    for ch in b.manifest.chapters:
        source = b.root / ch.page
        if ch.written and source.exists():
            page = File.generated(config, ch.page.as_posix(), abs_src_path=str(source))
            page.edit_uri = ch.page.as_posix()
        else:
            page = File.generated(config, ch.page.as_posix(), content=coming_page(b, ch))
        files.append(page)

    chapter_pages = {ch.page.as_posix() for ch in b.manifest.chapters}
    for path in sorted((b.root / "chapters").rglob("*")):
        rel = path.relative_to(b.root).as_posix()
        if path.is_dir() or path.name.startswith("."):
            continue
        if path.suffix != ".md":  # a chapter's figure, linked as e.g. figures/radix.svg
            files.append(File.generated(config, rel, abs_src_path=str(path)))
        elif rel not in chapter_pages:
            log.warning(f"{rel} is not a chapter of tools/steps.toml: it is left off the site")

    for ex in load_exercises(b):
        statement = File.generated(
            config, ex.page, content=exercise_page(b, ex), inclusion=InclusionLevel.NOT_IN_NAV
        )
        statement.edit_uri = f"practice/{ex.name}/README.md"
        files.append(statement)
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Fill in the generated parts of a page and check its recorded outputs exist."""
    b = book()
    src = page.file.src_uri
    ch = b.chapter_of(src)
    for pattern in (FILES_YOU_WILL_WRITE, FILES_SO_FAR):
        if ch is None and pattern.search(markdown):
            log.warning(f"{src}: {pattern.pattern!r} only works on a chapter page")
    if ch is not None:
        markdown = FILES_YOU_WILL_WRITE.sub(lambda m: files_you_will_write(b, ch), markdown)
        markdown = FILES_SO_FAR.sub(lambda m: files_so_far(b, ch, bool(m.group("head"))), markdown)
    markdown = CHAPTER_LIST.sub(lambda m: chapter_list(b), markdown)
    markdown = PRACTICE_LIST.sub(lambda m: practice_list(b), markdown)
    markdown = USAGE.sub(lambda m: usage_text(b, m.group("path"), src), markdown)
    markdown = ENV_VARS.sub(lambda m: env_vars(b), markdown)
    markdown = captioned_snapshots(b, markdown, src)
    markdown = included_names(b, markdown, src)
    return SNIPPET_LINE.sub(lambda m: checked_recording(b, m, src), markdown)


def on_serve(server: Any, config: MkDocsConfig, builder: Callable[..., Any]) -> Any:
    """`mkdocs serve` rebuilds when a chapter, the code it includes or the manifest changes."""
    root = book().root
    for name in ("chapters", "minisgl", "examples", "tests", "practice", "tools"):
        if (root / name).exists():
            server.watch(str(root / name))
    return server


# --------------------------------------------------------------------------- navigation
def with_stages(nav: list[Any], manifest: Any) -> list[Any]:
    """`nav` with one section per stage, listing its chapters, inserted after setup.md."""
    stages: list[Any] = [
        {
            f"Stage {stage.number} · {stage.title}": [
                {f"{ch.number}. {ch.title}": ch.page.as_posix()}
                for ch in manifest.chapters
                if ch.stage == stage.number
            ]
        }
        for stage in manifest.stages
    ]
    for i, item in enumerate(nav):
        if isinstance(item, dict) and "setup.md" in item.values():
            return nav[: i + 1] + stages + nav[i + 1 :]
    raise PluginError("mkdocs.yml: the nav needs a setup.md entry; the stages follow it")


# --------------------------------------------------------------------------- chapter parts
def chapter_link(ch: Any, to_chapters: str = "") -> str:
    """A markdown link to a chapter's page; `to_chapters` leads from the linking page's
    directory to chapters/ ("" from a chapter, "chapters/" from docs/, "../chapters/" below)."""
    return f"[chapter {ch.number}]({to_chapters}{ch.page.name})"


def explained_in(b: Book, ch: Any, path: str) -> Any | None:
    """The later chapter that explains a file `ch` brings in early (introduces or changes it)."""
    for later in b.manifest.chapters:
        if later.number > ch.number and path in (*later.new, *later.modified):
            return later
    return None


def files_you_will_write(b: Book, ch: Any) -> str:
    def code(paths: Any) -> str:
        return ", ".join(f"`{p}`" for p in paths)

    lines: list[str] = []
    if ch.new:
        lines.append(f"- **New:** {code(ch.new)}")
    if ch.modified:
        lines.append(f"- **Modified:** {code(ch.modified)}")
    by_chapter: dict[str, list[str]] = {}
    for path in ch.early:
        later = explained_in(b, ch, path)
        by_chapter.setdefault(chapter_link(later) if later else "", []).append(path)
    for link, paths in by_chapter.items():
        where = f", explained in {link}" if link else ""
        lines.append(f"- **Brought in early**{where}: {code(paths)}")
    tests = code(t.as_posix() for t in ch.tests)
    lines.append(f"- **Example and tests:** `{ch.example.as_posix()}`, {tests}")
    return "\n".join(lines)


def files_so_far(b: Book, ch: Any, with_head: bool) -> str:
    c = b.steps.tree_counts(b.manifest, ch.id)
    split = f"({c.new} new, {c.modified} modified, {c.early} brought in early)"
    line = f"**Files so far: {c.total} {split}**" if with_head else f"{c.total} files {split}"
    tree = b.steps.tree_text(b.manifest, ch.id)
    return f"{line}\n\n```text\n{tree}\n```\n"


def coming_page(b: Book, ch: Any) -> str:
    """The page a chapter has until it is written: what it will build, and where it sits."""
    stage = next(s for s in b.manifest.stages if s.number == ch.stage)
    summary = getattr(ch, "summary", "") or ""
    parts = [
        f"# Chapter {ch.number} — {ch.title}",
        f"*Stage {stage.number} · {stage.title}*",
        '!!! note "Coming soon"\n'
        "    This chapter is not written yet. Its place in the book, its number and its title are\n"
        "    fixed; the page, its code and its tests arrive together.",
    ]
    if summary:
        parts.append(f"**What it builds.** {summary}")
    if ch.new or ch.modified or ch.early:
        parts.append(f"## Files it will write\n\n{files_you_will_write(b, ch)}")
    parts.append(
        f"When it lands, `python tools/steps.py check {ch.id}` runs its example "
        f"`{ch.example.as_posix()}` and its tests on the chapter's checkpoint."
    )
    return "\n\n".join(parts) + "\n"


def chapter_list(b: Book) -> str:
    """Every chapter by stage, linked, marking those not written yet (for the home page)."""
    out: list[str] = []
    for stage in b.manifest.stages:
        out += [f"### Stage {stage.number} · {stage.title}", ""]
        for ch in (c for c in b.manifest.chapters if c.stage == stage.number):
            coming = "" if ch.written and (b.root / ch.page).exists() else " · *coming*"
            out.append(f"- **{ch.number}** · [{ch.title}]({ch.page.as_posix()}){coming}")
        out.append("")
    return "\n".join(out)


def checked_recording(b: Book, m: re.Match[str], src: str) -> str:
    """Keep a `--8<--` include; a missing recorded output becomes a warning (fatal under
    --strict) naming the command that records it, and a note in the page."""
    target = m.group("target")
    path = target.partition(":")[0]  # "file.txt:section" includes one section of the file
    if not target.startswith(RECORDED) or (b.root / path).exists():
        return m.group(0)
    target = path
    name = Path(target).name
    if name.startswith("tour") or Path(target).parent.name.startswith("tour"):
        command = "python tools/tour.py --record"
    elif "_bench" in name:  # benchmark/offline.py or online.py, on a GPU; saved by hand
        command = f"python benchmark/{name.split('_bench')[0]}.py and save its output"
    else:
        gpu = " --gpu" if target.endswith("-cuda.txt") else ""
        command = f"python tools/steps.py check {name[:4]} --record{gpu}"
    log.warning(f"{src}: {target} has not been recorded; run `{command}`")
    return f"{m.group('indent')}(not recorded yet: run {command})"


def snapshot_caption(b: Book, target: str) -> str | None:
    """ "<path> as of chapter N (changed in chapters X, Y)" for an include of
    `tools/versions/chNN/<path>[:region]`; None for any other include."""
    m = SNAPSHOT.match(target)
    if m is None:
        return None
    path = m.group("path")
    try:
        ch = b.manifest.chapter(m.group("chapter"))
    except ValueError as exc:  # steps.ManifestError: no such chapter
        log.warning(f"{target}: {exc}")
        return f"{path}, an earlier version"
    later = [c.number for c in b.manifest.chapters if c.number > ch.number and path in c.modified]
    if not later:
        return f"{path} as of chapter {ch.number}"
    word = "chapter" if len(later) == 1 else "chapters"
    return f"{path} as of chapter {ch.number} (changed in {word} {', '.join(map(str, later))})"


def captioned_snapshots(b: Book, markdown: str, src: str) -> str:
    """Give every code block that includes a snapshot a title saying which chapter's version
    it shows; warn (fatal under --strict) about a snapshot included outside a code block."""

    def caption(block: re.Match[str]) -> str:
        titles = [t for s in SNIPPET_LINE.finditer(block.group("body"))
                  if (t := snapshot_caption(b, s.group("target"))) is not None]
        if not titles or "title=" in block.group("info"):
            return block.group(0)
        title = "; ".join(dict.fromkeys(titles)).replace('"', "'")
        opening = f'{block.group("indent")}{block.group("fence")}{block.group("info").rstrip()}'
        closing = block.group(0).rsplit("\n", 1)[1]
        return f'{opening} title="{title}"\n{block.group("body")}{closing}'

    markdown = CODE_BLOCK.sub(caption, markdown)
    outside = CODE_BLOCK.sub("", markdown)
    for s in SNIPPET_LINE.finditer(outside):
        if SNAPSHOT.match(s.group("target")):
            log.warning(f"{src}: {s.group('target')} is included outside a code block, so it "
                        "cannot say which chapter's version it shows; put it in a ```python block")
    return markdown


# --------------------------------------------------------------------------- code by name
class SymbolNotFound(LookupError):
    """A qualified name an include asks for is not defined in the file."""


def defined_names(node: ast.stmt) -> list[str]:
    """The names a statement defines that an include can ask for."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    targets = node.targets if isinstance(node, ast.Assign) else (
        [node.target] if isinstance(node, ast.AnnAssign) else [])
    names: list[str] = []
    for target in targets:
        elements = target.elts if isinstance(target, ast.Tuple) else [target]
        names += [e.id for e in elements if isinstance(e, ast.Name)]
    return names


def scope(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements of a body, looking through `if` and `try` (a definition made only when
    an optional package imports is still the module's)."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from scope(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            handlers = [s for h in node.handlers for s in h.body]
            yield from scope(node.body + handlers + node.orelse + node.finalbody)


def find_symbol(tree: ast.Module, qualname: str) -> ast.stmt:
    """The first definition of `qualname` ("Req.append_token"), walking classes and functions;
    SymbolNotFound says which part is missing."""
    body: list[ast.stmt] = tree.body
    found: ast.stmt | None = None
    parts = qualname.split(".")
    for depth, part in enumerate(parts):
        found = next((n for n in scope(body) if part in defined_names(n)), None)
        if found is None:
            where = ".".join(parts[:depth]) or "the module"
            raise SymbolNotFound(f"no {qualname}: {where} defines no {part!r}")
        if depth < len(parts) - 1:
            if not isinstance(found, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                raise SymbolNotFound(f"no {qualname}: {'.'.join(parts[:depth + 1])} is an "
                                     "assignment, it has no members")
            body = found.body
    assert found is not None
    return found


def symbol_span(lines: list[str], node: ast.stmt) -> tuple[int, int]:
    """0-based [start, end) of a definition's lines: its decorators and the comment lines
    directly above it included, up to a section rule (`# ---- requests out`), which heads
    the part of the file rather than the symbol."""
    decorators = getattr(node, "decorator_list", [])
    start = min([d.lineno for d in decorators] + [node.lineno]) - 1
    while start > 0 and lines[start - 1].lstrip().startswith("#") and \
            not SECTION_RULE.match(lines[start - 1]):
        start -= 1
    assert node.end_lineno is not None
    return start, node.end_lineno


def symbols_source(source: str, names: list[str]) -> str:
    """The dedented source of `names` (qualified, space-separated in an include; "-name" leaves
    a member out of an included class), in the order given."""
    tree = ast.parse(source)
    lines = source.splitlines()
    shown = [n for n in names if not n.startswith("-")]
    if not shown:
        raise SymbolNotFound("the include names only members to leave out")
    spans = [symbol_span(lines, find_symbol(tree, name)) for name in shown]
    dropped: set[int] = set()
    for name in (n[1:] for n in names if n.startswith("-")):
        start, end = symbol_span(lines, find_symbol(tree, name))
        if not any(s < start and end <= e for s, e in spans):
            raise SymbolNotFound(f"-{name} leaves out a member, but no symbol of the include "
                                 "contains it")
        while start > 0 and lines[start - 1].lstrip().startswith("#"):  # and a rule above it
            start -= 1
        # The blank lines after it go with it, or those before it if it ends its class.
        after = end
        while after < len(lines) and not lines[after].strip():
            after += 1
        within = any(s < after < e for s, e in spans)
        while not within and start > 0 and not lines[start - 1].strip():
            start -= 1
        dropped.update(range(start, after if within else end))
    parts: list[str] = []
    for i, (start, end) in enumerate(spans):
        if i:  # neighbours in the file keep their blank lines; others are one blank line apart
            between = lines[spans[i - 1][1]:start]
            adjacent = spans[i - 1][1] <= start and not any(line.strip() for line in between)
            parts += [""] * (len(between) if adjacent else 1)
        kept = "\n".join(lines[j] for j in range(start, end) if j not in dropped)
        parts.append(textwrap.dedent(kept))  # each alone: a method may sit next to a constant
    return "\n".join(parts)


def source_text(b: Book, path: str) -> str:
    """The text of a repository file, or of an earlier version (`tools/versions/chNN/<path>`),
    rebuilt from the final file and the patches."""
    m = SNAPSHOT.match(path)
    if m is None:
        return (b.root / path).read_text(encoding="utf-8")
    return b.steps.snapshots.earlier_version(b.manifest, m.group("path"), m.group("chapter"))


def included_names(b: Book, markdown: str, src: str) -> str:
    """Replace every name include of a code block by the symbols' source, and every include of
    a whole earlier version by its text; warn (fatal under --strict) about one that does not
    resolve or stands outside a code block."""
    sources: dict[str, str] = {}

    def include(m: re.Match[str]) -> str:
        path = m.group("path")
        names = m.group("names").split() if "names" in m.groupdict() else None
        target = f'--8<-- "{path}::{m.group("names")}"' if names else f'--8<-- "{path}"'
        try:
            if path not in sources:
                sources[path] = source_text(b, path)
            code = symbols_source(sources[path], names) if names else sources[path].rstrip("\n")
        except FileNotFoundError:
            log.warning(f"{src}: {target}: there is no file {path}")
            return f"{m.group('indent')}# {path} is missing"
        except (SymbolNotFound, SyntaxError, b.steps.VersionError) as exc:
            log.warning(f"{src}: {target}: {path}: {exc}")
            return f"{m.group('indent')}# {path}: {exc}"
        return "\n".join(m.group("indent") + line if line else "" for line in code.split("\n"))

    def block(m: re.Match[str]) -> str:
        start, end = m.start("body") - m.start(), m.end("body") - m.start()
        text = m.group(0)
        body = SNAPSHOT_FILE.sub(include, NAME_INCLUDE.sub(include, m.group("body")))
        return text[:start] + body + text[end:]

    markdown = CODE_BLOCK.sub(block, markdown)
    for m in NAME_INCLUDE.finditer(CODE_BLOCK.sub("", markdown)):
        log.warning(f"{src}: {m.group(0).strip()} is outside a code block; put it in a "
                    "```python block")
    return markdown


# --------------------------------------------------------------------------- practice
def load_exercises(b: Book) -> list[Exercise]:
    """Every `practice/*/exercise.toml`, in directory order; a malformed one is a warning."""
    exercises: list[Exercise] = []
    chapters = {ch.id for ch in b.manifest.chapters}
    for toml in sorted((b.root / "practice").glob("*/exercise.toml")):
        rel = toml.relative_to(b.root).as_posix()
        data = tomllib.loads(toml.read_text(encoding="utf-8"))
        missing = [k for k in ("title", "chapter", "file", "summary") if k not in data]
        if missing:
            log.warning(f"{rel}: missing {', '.join(missing)}; the exercise is left off the site")
            continue
        if data["chapter"] not in chapters:
            log.warning(f"{rel}: chapter {data['chapter']!r} is not in tools/steps.toml")
            continue
        fields = {k: str(data[k]) for k in ("title", "chapter", "file", "summary")}
        exercises.append(Exercise(name=toml.parent.name, **fields))
    return exercises


def judge_block(ex: Exercise, indent: str = "") -> str:
    lines = ["```bash", f"python practice/judge.py {ex.name}", "```"]
    return "\n".join(indent + line for line in lines)


def practice_list(b: Book) -> str:
    exercises = load_exercises(b)
    if not exercises:
        return "*No exercises yet: they arrive with their chapters.*"
    out: list[str] = []
    for ch in b.manifest.chapters:
        mine = [ex for ex in exercises if ex.chapter == ch.id]
        if not mine:
            continue
        out += [f"## Chapter {ch.number} · {ch.title}", ""]
        for ex in mine:
            out += [
                f"### {ex.title} {{ #{ex.name} }}",
                "",
                ex.summary,
                "",
                f"Statement: [{ex.name}]({ex.page}) · you write `practice/{ex.name}/{ex.file}` · "
                f"chapter: {chapter_link(ch, 'chapters/')}",
                "",
                judge_block(ex),
                "",
            ]
    return "\n".join(out)


def exercise_page(b: Book, ex: Exercise) -> str:
    """The exercise's README, with where it belongs and how to judge it after the title."""
    ch = b.manifest.chapter(ex.chapter)
    readme = b.root / "practice" / ex.name / "README.md"
    text = readme.read_text(encoding="utf-8") if readme.exists() else ""
    if not text.lstrip().startswith("# "):
        text = f"# {ex.title}\n\n{text}"
    title, _, body = text.lstrip().partition("\n")
    box = (
        f'!!! info "Practice for {chapter_link(ch, "../chapters/")}"\n'
        f"    Write `practice/{ex.name}/{ex.file}`, then run the judge:\n\n"
        f"{judge_block(ex, indent='    ')}\n\n"
        f"    `--solutions` checks the reference solution instead."
    )
    return f"{title}\n\n{box}\n{body}"


# --------------------------------------------------------------------------- reference
def load_script(path: Path) -> ModuleType:
    """Import a repository script by path, under a private module name, freshly each build."""
    name = "_book_" + re.sub(r"\W", "_", path.stem)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise PluginError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def load_module(root: Path, rel: str) -> ModuleType:
    """A file of the `minisgl` package by its dotted name (so its relative imports work),
    any other file by path."""
    parts = Path(rel).with_suffix("").parts
    if parts[0] != "minisgl":
        return load_script(root / rel)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    module = importlib.import_module(name)
    return importlib.reload(module)  # mkdocs serve: show the file as it is now


@contextmanager
def help_width() -> Iterator[None]:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = USAGE_WIDTH
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


def subcommands(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    return [
        sub
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for sub in dict.fromkeys(action.choices.values())  # aliases map to the same parser
    ]


def usage_text(b: Book, rel: str, src: str) -> str:
    """The `--help` of every (sub)command `rel`'s `build_parser()` defines, as text blocks."""
    if not (b.root / rel).exists():
        return (
            f'!!! note "Not yet available"\n'
            f"    `{rel}` is not in the repository yet; its usage appears here when it lands."
        )
    try:
        build = getattr(load_module(b.root, rel), "build_parser", None)
        parser = build() if build is not None else None
    except Exception as exc:  # the script itself is broken: say where, fail the strict build
        log.warning(f"{src}: {rel} failed while building its argument parser: {exc!r}")
        return f"*`{rel}` could not be imported.*"
    if parser is None:
        log.warning(f"{src}: {rel} has no build_parser() for its usage text")
        return f"*`{rel}` does not expose `build_parser()` yet.*"
    default_prog = os.path.basename(sys.argv[0])  # argparse's default: here "mkdocs"
    if parser.prog == default_prog:
        wanted = f"python {rel}"
        for p in (parser, *subcommands(parser)):
            p.prog = p.prog.replace(default_prog, wanted, 1)
    with help_width():
        helps = [parser.format_help(), *(sub.format_help() for sub in subcommands(parser))]
    return "\n\n".join(f"```text\n{h.rstrip()}\n```" for h in helps)


def env_vars(b: Book) -> str:
    """A table of the MINISGL_* variables declared in `minisgl/env.py` (its `ENV_VARS`)."""
    path = b.root / "minisgl" / "env.py"
    if not path.exists():
        return "*The environment variables arrive with chapter 1 (`minisgl/env.py`).*"
    declared = getattr(load_module(b.root, "minisgl/env.py"), "ENV_VARS", None)
    if declared is None:
        log.warning("minisgl/env.py has no ENV_VARS listing its variables for the reference")
        return "*`minisgl/env.py` does not list its variables yet.*"
    rows = ["| Variable | Default | What it controls |", "|---|---|---|"]
    for var in declared:
        meaning = " ".join(var.help.split()).replace("|", "\\|")
        rows.append(f"| `{var.name}` | `{var.default!r}` | {meaning} |")
    return "\n".join(rows)
