#!/usr/bin/env python3
"""The book's checkpoint machinery.

Every chapter of the book ends at a *checkpoint*: the `minisgl/` tree as it stands after that
chapter. The manifest `tools/steps.toml` says which files each chapter adds (`new`), changes
(`modified`) or needs before the chapter that explains them (`early`). From it this script can

    python tools/steps.py list                 # every chapter, its stage and status
    python tools/steps.py tree ch05            # the "Files so far" tree of a chapter
    python tools/steps.py checkout ch05 DIR    # write the tree as of a chapter into DIR
    python tools/steps.py check [ch01 ...]     # rebuild each checkpoint, run its example + tests
        [--gpu]                                # a missing GPU is an error, not a skip
        [--record]                             # save each example's output for the book
    python tools/steps.py versions             # rebuild every earlier version of a file
        [--materialize [chNN|PATH ...]]        # as full copies, to edit (or read: --out DIR)
        [--store]                              # full copies back into patches

`check` builds every checkpoint in a fresh temporary directory that holds only that chapter's
files, so a chapter that imports code from a later chapter fails. It then runs the
repository-level tests and ends with one line: `N passed, N failed, N skipped`.

The version of a file before a later chapter changed it is stored as a patch against the next
version (tools/snapshots.py); every reader of an earlier version goes through that module.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

# tools/ is not a package: the sibling module is found by path, however this file was loaded.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import snapshots  # noqa: E402
from snapshots import EarlierVersion, VersionError, writes_of  # noqa: E402,F401

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = Path("tools/steps.toml")
RECORDED = Path("docs/recorded")
TINY_MODEL = Path("models/tiny-qwen3")
# Files every checkpoint gets besides the chapter's own tree (copied when they exist).
SUPPORT = [Path("tests/conftest.py"), Path("tools/make_tiny_model.py"), Path("tools/assets")]
EXAMPLE_TIMEOUT_S = 900
TESTS_TIMEOUT_S = 3600
# Installed in every checkpoint as sitecustomize.py: `pip install -e .` registers an import
# hook that finds `minisgl.<anything>` in the final tree, which would let an early checkpoint
# import a later chapter's module without anyone noticing. Python runs sitecustomize at start-up,
# after that hook is installed, so removing it here keeps each checkpoint honest.
SITECUSTOMIZE = """import sys
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
"""


# --------------------------------------------------------------------------- the manifest
@dataclass(frozen=True)
class Stage:
    number: int
    title: str


@dataclass(frozen=True)
class Chapter:
    id: str
    slug: str
    title: str
    stage: int
    status: str
    summary: str = ""
    new: tuple[str, ...] = ()
    modified: tuple[str, ...] = ()
    early: tuple[str, ...] = ()
    test_files: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.id}_{self.slug}"

    @property
    def number(self) -> int:
        return int(self.id[2:])

    @property
    def written(self) -> bool:
        return self.status == "written"

    @property
    def page(self) -> Path:
        return Path("chapters") / f"{self.name}.md"

    @property
    def example(self) -> Path:
        return Path("examples") / f"{self.name}.py"

    @property
    def tests(self) -> tuple[Path, ...]:
        return tuple(Path(t) for t in self.test_files) or (Path("tests") / f"test_{self.name}.py",)


@dataclass
class Manifest:
    root: Path
    stages: list[Stage]
    chapters: list[Chapter]

    def chapter(self, chapter_id: str) -> Chapter:
        for ch in self.chapters:
            if ch.id == chapter_id or ch.name == chapter_id:
                return ch
        known = ", ".join(c.id for c in self.chapters)
        raise ManifestError(f"unknown chapter {chapter_id!r}; the manifest has {known}")

    def upto(self, chapter_id: str) -> list[Chapter]:
        last = self.chapter(chapter_id).number
        return [c for c in self.chapters if c.number <= last]


class ManifestError(ValueError):
    """The manifest is inconsistent or names a chapter that does not exist."""


def load_manifest(root: Path | None = None) -> Manifest:
    """Read and validate `tools/steps.toml` under `root` (default: this repository)."""
    root = (root or ROOT).resolve()
    data = tomllib.loads((root / MANIFEST).read_text(encoding="utf-8"))
    stages = [Stage(int(s["number"]), str(s["title"])) for s in data.get("stage", [])]
    chapters = [
        Chapter(
            id=c["id"],
            slug=c["slug"],
            title=c["title"],
            stage=int(c["stage"]),
            status=c.get("status", "coming"),
            summary=str(c.get("summary", "")),
            new=tuple(c.get("new", ())),
            modified=tuple(c.get("modified", ())),
            early=tuple(c.get("early", ())),
            test_files=tuple(c.get("tests", ())),
        )
        for c in data.get("chapter", [])
    ]
    manifest = Manifest(root, stages, chapters)
    _validate(manifest)
    return manifest


def _validate(m: Manifest) -> None:
    problems: list[str] = []
    stage_numbers = {s.number for s in m.stages}
    seen: set[str] = set()
    numbers = [c.number for c in m.chapters]
    if numbers != sorted(numbers) or len(set(numbers)) != len(numbers):
        problems.append("chapters must be listed once each, in order")
    for ch in m.chapters:
        if ch.status not in ("written", "coming"):
            problems.append(f"{ch.id}: status must be 'written' or 'coming', not {ch.status!r}")
        if ch.stage not in stage_numbers:
            problems.append(f"{ch.id}: stage {ch.stage} is not declared")
        for path in (*ch.new, *ch.early):
            if path in seen:
                problems.append(f"{ch.id}: {path} was already introduced by an earlier chapter")
            seen.add(path)
        for path in ch.modified:
            if path not in seen:
                problems.append(f"{ch.id}: modifies {path}, which no earlier chapter introduces")
    if problems:
        raise ManifestError("tools/steps.toml: " + "; ".join(problems))


# --------------------------------------------------------------------------- checkpoints
def source_of(manifest: Manifest, path: str, chapter_id: str) -> Path | EarlierVersion:
    """Where the version of `path` that chapter `chapter_id` sees comes from.

    The final version is the file itself; the version a chapter wrote before a later chapter
    modified the file is rebuilt from the patches under `tools/versions/` (snapshots.py).
    """
    number = manifest.chapter(chapter_id).number
    writes = writes_of(manifest, path)
    current = [c for c in writes if c.number <= number][-1]
    if current is writes[-1]:
        return manifest.root / path
    return EarlierVersion(current.id, path)


def checkpoint_files(manifest: Manifest, chapter_id: str) -> dict[str, Path | EarlierVersion]:
    """Every file of the chapter's tree, mapped to the source it is copied from."""
    files: dict[str, Path] = {}
    for ch in manifest.upto(chapter_id):
        for path in (*ch.new, *ch.early):
            files[path] = source_of(manifest, path, chapter_id)
    return dict(sorted(files.items()))


def is_stale(manifest: Manifest, chapter_id: str) -> bool:
    """True when some file of the chapter's tree changed in a later chapter."""
    return any(
        src != manifest.root / path for path, src in checkpoint_files(manifest, chapter_id).items()
    )


def imported_tests(root: Path, tests: Sequence[Path]) -> list[Path]:
    """The earlier chapters' test modules that ``tests`` import helpers from (``from
    test_ch06_attention import ...``), and theirs in turn: copied into a checkpoint so that
    the imports resolve, never run there."""
    found: list[Path] = []
    todo = list(tests)
    while todo:
        path = root / todo.pop()
        if not path.exists():
            continue
        for name in re.findall(r"^from (test_\w+) import", path.read_text(encoding="utf-8"), re.M):
            module = Path("tests") / f"{name}.py"
            if module not in found and module not in tests:
                found.append(module)
                todo.append(module)
    return found


def build_checkpoint(manifest: Manifest, chapter_id: str, dest: Path) -> None:
    """Write chapter `chapter_id`'s tree, example, tests and support files into `dest`."""
    ch = manifest.chapter(chapter_id)
    wanted = checkpoint_files(manifest, chapter_id)
    missing = [str(src) for src in wanted.values() if isinstance(src, Path) and not src.exists()]
    if missing:
        raise ManifestError(f"{ch.id}: files named by the manifest do not exist: {missing}")
    for rel in (ch.example, *ch.tests, *imported_tests(manifest.root, ch.tests), *SUPPORT):
        if (manifest.root / rel).exists():
            wanted[str(rel)] = manifest.root / rel
    for rel, src in wanted.items():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(src, EarlierVersion):
            text = snapshots.earlier_version(manifest, src.path, src.chapter)
            target.write_bytes(text.encode("utf-8"))
        elif src.is_dir():
            shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, target)
    (dest / "sitecustomize.py").write_text(SITECUSTOMIZE, encoding="utf-8")
    models = manifest.root / "models"
    if models.is_dir():
        (dest / "models").symlink_to(models, target_is_directory=True)


# --------------------------------------------------------------------------- the tree
@dataclass(frozen=True)
class Counts:
    total: int
    new: int
    modified: int
    early: int


def file_marks(manifest: Manifest, chapter_id: str) -> dict[str, str]:
    """Each file of the tree with its mark in this chapter: new, modified, early or ''."""
    ch = manifest.chapter(chapter_id)
    marks = {path: "" for path in checkpoint_files(manifest, chapter_id)}
    marks.update({p: "new" for p in ch.new})
    marks.update({p: "modified" for p in ch.modified})
    marks.update({p: "early" for p in ch.early})
    return marks


def tree_counts(manifest: Manifest, chapter_id: str) -> Counts:
    marks = list(file_marks(manifest, chapter_id).values())
    return Counts(len(marks), marks.count("new"), marks.count("modified"), marks.count("early"))


LABELS = {"new": "new", "modified": "modified", "early": "brought in early"}


def tree_text(manifest: Manifest, chapter_id: str) -> str:
    """The "Files so far" tree: one line per directory and file, marked files labelled."""
    marks = file_marks(manifest, chapter_id)
    lines: list[str] = []
    printed_dirs: set[tuple[str, ...]] = set()
    paths = sorted(marks, key=lambda p: Path(p).parts)
    for path in paths:
        parts = Path(path).parts
        for depth in range(1, len(parts)):
            prefix = parts[:depth]
            if prefix not in printed_dirs:
                printed_dirs.add(prefix)
                lines.append("    " * (depth - 1) + parts[depth - 1] + "/")
        name = "    " * (len(parts) - 1) + parts[-1]
        label = LABELS.get(marks[path], "")
        lines.append(f"{name:<44} {label}".rstrip() if label else name)
    return "\n".join(lines)


def counts_line(counts: Counts) -> str:
    return (
        f"Files so far: {counts.total} ({counts.new} new, {counts.modified} modified, "
        f"{counts.early} brought in early)"
    )


# --------------------------------------------------------------------------- running
@dataclass
class Tally:
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    failures: list[str] = field(default_factory=list)
    skip_reasons: dict[str, int] = field(default_factory=dict)

    def add(self, other: Tally) -> None:
        self.passed += other.passed
        self.failed += other.failed
        self.skipped += other.skipped
        self.failures += other.failures
        for reason, n in other.skip_reasons.items():
            self.skip_reasons[reason] = self.skip_reasons.get(reason, 0) + n

    def line(self) -> str:
        return f"{self.passed} passed, {self.failed} failed, {self.skipped} skipped"


def checkpoint_env(workdir: Path, gpu: bool) -> dict[str, str]:
    env = dict(os.environ)
    # The checkpoint first; keep other entries (e.g. a folder of extra wheels) but never the
    # repository itself, whose final tree must stay out of sight.
    inherited = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                 if p and Path(p).resolve() != ROOT]
    env["PYTHONPATH"] = os.pathsep.join([str(workdir), *inherited])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    if gpu:
        env["MINISGL_REQUIRE_GPU"] = "1"
    return env


def import_isolated(manifest: Manifest, chapter_id: str, workdir: Path,
                    env: dict[str, str]) -> str | None:
    """None if the checkpoint sees its own tree and nothing of later chapters."""
    later = sorted({".".join(Path(p).with_suffix("").parts)
                    for ch in manifest.chapters for p in (*ch.new, *ch.early)
                    if p.endswith(".py") and not p.endswith("__init__.py")}
                   - {".".join(Path(p).with_suffix("").parts)
                      for p in checkpoint_files(manifest, chapter_id)})
    probe = (
        "import importlib.util, minisgl, sys\n"
        "print(minisgl.__file__)\n"
        f"for name in {later!r}:\n"
        "    try:\n"
        "        spec = importlib.util.find_spec(name)\n"
        "    except ImportError:\n"
        "        spec = None\n"
        "    if spec is not None:\n"
        "        print('LEAK', name, spec.origin)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=workdir, env=env, capture_output=True, text=True
    )
    if out.returncode != 0:
        return f"`import minisgl` fails in the checkpoint:\n{out.stderr.strip()}"
    first, *rest = out.stdout.strip().splitlines()
    where = Path(first).resolve()
    if workdir.resolve() not in where.parents:
        return f"`import minisgl` resolved to {where}, outside the checkpoint {workdir}"
    if rest:
        return "later chapters' modules are importable from the checkpoint: " + "; ".join(rest)
    return None


def run_pytest(files: list[Path], cwd: Path, env: dict[str, str], label: str) -> Tally:
    """Run pytest on `files` and count outcomes from its JUnit XML report."""
    tally = Tally()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
               f"--junitxml={report}", *map(str, files)]
        try:
            proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                                  timeout=TESTS_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            tally.failed += 1
            tally.failures.append(f"{label}: tests timed out after {TESTS_TIMEOUT_S} s")
            return tally
        if not report.exists():
            tally.failed += 1
            tally.failures.append(f"{label}: pytest did not run\n{proc.stdout}{proc.stderr}")
            return tally
        for case in ET.parse(report).getroot().iter("testcase"):
            name = f"{label}: {case.get('classname', '')}::{case.get('name', '')}"
            if case.find("failure") is not None or case.find("error") is not None:
                tally.failed += 1
                tally.failures.append(name)
            elif case.find("skipped") is not None:
                tally.skipped += 1
                reason = (case.find("skipped").get("message") or "skipped").strip()
                tally.skip_reasons[reason] = tally.skip_reasons.get(reason, 0) + 1
            else:
                tally.passed += 1
        if proc.returncode not in (0, 5) and tally.failed == 0:
            # pytest failed outside any test (a collection error, a crash in a fixture).
            tally.failed += 1
            tally.failures.append(f"{label}: pytest exited with {proc.returncode}")
        if tally.failed:
            print(_indent(proc.stdout[-6000:] + proc.stderr[-3000:]))
    return tally


def device_description() -> str:
    """Names the device that recorded outputs ran on (the book prints it)."""
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda}, torch {torch.__version__})"
        return f"CPU {platform.machine()}, {os.cpu_count()} cores (torch {torch.__version__})"
    except ImportError:
        return f"CPU {platform.machine()}, {os.cpu_count()} cores"


def _text(output: str | bytes | None) -> str:
    """A timed-out child's partial output (bytes, even with text=True, or None)."""
    if isinstance(output, bytes):
        return output.decode("utf-8", errors="replace")
    return output or ""


def run_example(ch: Chapter, workdir: Path, env: dict[str, str], args: list[str],
                record: str | None, root: Path, timeout_s: float = EXAMPLE_TIMEOUT_S) -> Tally:
    tally = Tally()
    cmd = [sys.executable, str(ch.example), *args]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        tally.failed += 1
        tally.failures.append(f"{ch.id}: example timed out after {timeout_s:g} s")
        # What it printed before it was stopped says where it got stuck.
        print(_indent(_text(exc.stdout)[-4000:] + _text(exc.stderr)[-4000:]))
        return tally
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        tally.failed += 1
        tally.failures.append(f"{ch.id}: {ch.example} exited with {proc.returncode}")
        print(_indent(proc.stdout[-4000:] + proc.stderr[-4000:]))
        return tally
    tally.passed += 1
    print(f"  example {ch.example} ok ({seconds:.1f} s)")
    if record:
        shown = " ".join(["python", str(ch.example), *args])
        text = f"$ {shown}\n{proc.stdout.rstrip()}\n"
        target = root / RECORDED / f"{ch.name}-{record}.txt"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(f"# recorded on {device_description()}\n{text}", encoding="utf-8")
        print(f"  recorded its output in {target.relative_to(root)}")
    return tally


def ensure_tiny_model(root: Path) -> None:
    """Build the tiny model once so examples and tests of every checkpoint can share it."""
    tool = root / "tools" / "make_tiny_model.py"
    if tool.exists() and not (root / TINY_MODEL / "config.json").exists():
        print(f"building {TINY_MODEL} ...")
        subprocess.run([sys.executable, str(tool), "--out", str(root / TINY_MODEL)], cwd=root,
                       check=True)


def check_chapter(manifest: Manifest, ch: Chapter, gpu: bool, record: str | None,
                  example_args: list[str], keep: bool,
                  example_timeout_s: float = EXAMPLE_TIMEOUT_S) -> Tally:
    print(f"{ch.id} {ch.title}")
    tally = Tally()
    workdir = Path(tempfile.mkdtemp(prefix=f"minisgl-{ch.id}-"))
    try:
        build_checkpoint(manifest, ch.id, workdir)
        env = checkpoint_env(workdir, gpu)
        problem = import_isolated(manifest, ch.id, workdir, env)
        if problem:
            tally.failed += 1
            tally.failures.append(f"{ch.id}: {problem}")
            print(_indent(problem))
            return tally
        if (manifest.root / ch.example).exists():
            tally.add(run_example(ch, workdir, env, example_args, record, manifest.root,
                                  example_timeout_s))
        else:
            tally.failed += 1
            tally.failures.append(f"{ch.id}: {ch.example} is missing")
        tests = [t for t in ch.tests if (workdir / t).exists()]
        if not tests:
            tally.failed += 1
            tally.failures.append(f"{ch.id}: no tests ({', '.join(map(str, ch.tests))})")
        else:
            result = run_pytest(tests, workdir, env, ch.id)
            print(f"  tests: {result.line()}")
            tally.add(result)
    except (ManifestError, VersionError) as exc:
        tally.failed += 1
        tally.failures.append(str(exc))
        print(_indent(str(exc)))
    finally:
        if keep:
            print(f"  checkpoint kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return tally


def repository_tests(manifest: Manifest) -> list[Path]:
    """Tests that belong to no chapter, plus the tests of every chapter whose files changed
    later (so each chapter's tests also hold on the final tree)."""
    owned = {t for c in manifest.chapters for t in c.tests}
    tests = sorted(p.relative_to(manifest.root) for p in (manifest.root / "tests").glob("test_*.py"))
    chosen = [t for t in tests if t not in owned]
    for ch in manifest.chapters:
        if ch.written and is_stale(manifest, ch.id):
            chosen += [t for t in ch.tests if (manifest.root / t).exists()]
    return chosen


def check(manifest: Manifest, chapter_ids: list[str], gpu: bool, record: bool, tag: str | None,
          example_args: list[str], keep: bool,
          example_timeout_s: float = EXAMPLE_TIMEOUT_S) -> int:
    if gpu and not _has_cuda():
        print("--gpu was given but no CUDA GPU is visible")
        return 1
    chosen = [manifest.chapter(c) for c in chapter_ids] if chapter_ids else manifest.chapters
    record_tag = (tag or ("cuda" if gpu or _has_cuda() else "cpu")) if record else None
    ensure_tiny_model(manifest.root)
    total = Tally()
    for ch in chosen:
        if not ch.written:
            print(f"{ch.id} {ch.title}: not written yet (counted as skipped)")
            total.skipped += 1
            reason = "chapter not written yet"
            total.skip_reasons[reason] = total.skip_reasons.get(reason, 0) + 1
            continue
        total.add(check_chapter(manifest, ch, gpu, record_tag, example_args, keep,
                                example_timeout_s))
    if not chapter_ids:
        repo_tests = repository_tests(manifest)
        if repo_tests:
            print("repository-level tests (final tree)")
            env = dict(os.environ, MINISGL_REQUIRE_GPU="1") if gpu else dict(os.environ)
            result = run_pytest(repo_tests, manifest.root, env, "repository")
            print(f"  tests: {result.line()}")
            total.add(result)
    if total.skip_reasons:
        print("skipped:")
        for reason, n in sorted(total.skip_reasons.items()):
            print(f"  {n} x {reason}")
    if total.failures:
        print("failed:")
        for f in total.failures:
            print(f"  {f}")
    print(total.line())
    return 1 if total.failed else 0


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.rstrip().splitlines())


# --------------------------------------------------------------------------- commands
def cmd_list(manifest: Manifest) -> int:
    for stage in manifest.stages:
        print(f"Stage {stage.number} · {stage.title}")
        for ch in (c for c in manifest.chapters if c.stage == stage.number):
            if ch.written:
                c = tree_counts(manifest, ch.id)
                state = f"written   {c.total:3d} files ({c.new} new, {c.modified} modified, {c.early} early)"
            else:
                state = "not written yet"
            print(f"  {ch.id}  {ch.title:<48} {state}")
    return 0


def cmd_tree(manifest: Manifest, chapter_id: str) -> int:
    ch = manifest.chapter(chapter_id)
    print(f"{ch.id} {ch.title}")
    print(counts_line(tree_counts(manifest, ch.id)))
    print(tree_text(manifest, ch.id))
    return 0


def cmd_checkout(manifest: Manifest, chapter_id: str, dest: Path) -> int:
    """Write chapter `chapter_id`'s tree into `dest` to read and run, without checking it."""
    ch = manifest.chapter(chapter_id)
    if dest.exists() and any(dest.iterdir()):
        print(f"error: {dest} is not empty; name a new directory", file=sys.stderr)
        return 2
    dest.mkdir(parents=True, exist_ok=True)
    build_checkpoint(manifest, ch.id, dest)
    print(f"{ch.id} {ch.title}: {counts_line(tree_counts(manifest, ch.id))}, written to {dest}")
    print(f"run its example there with:  cd {dest} && PYTHONPATH=. python {ch.example}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python tools/steps.py",
        description="Rebuild the book's chapter checkpoints and run their examples and tests.",
    )
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="repository root holding tools/steps.toml (default: this repository)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list every chapter with its stage and status")
    tree = sub.add_parser("tree", help="print a chapter's 'Files so far' tree and counts")
    tree.add_argument("chapter", help="chapter id, e.g. ch05")
    checkout = sub.add_parser("checkout", help="write a chapter's tree (the code as of that "
                                               "chapter, its example and tests) into a directory")
    checkout.add_argument("chapter", help="chapter id, e.g. ch05")
    checkout.add_argument("dest", type=Path, help="a new or empty directory")
    chk = sub.add_parser("check", help="run chapters' examples and tests on their checkpoints, "
                                       "then the repository-level tests")
    chk.add_argument("chapters", nargs="*", help="chapter ids (default: all, plus repository tests)")
    chk.add_argument("--gpu", action="store_true", help="treat a missing GPU as an error")
    chk.add_argument("--record", action="store_true",
                     help="save each example's output under docs/recorded/ for the book")
    chk.add_argument("--tag", help="name of the recording (default: cuda or cpu)")
    chk.add_argument("--example-args", default="",
                     help="extra arguments for the examples, e.g. \"--model models/qwen3-0.6b-like\"")
    chk.add_argument("--example-timeout", type=float, default=EXAMPLE_TIMEOUT_S, metavar="S",
                     help="seconds an example may run before it counts as failed; what it "
                          f"printed until then is shown (default: {EXAMPLE_TIMEOUT_S})")
    chk.add_argument("--keep", action="store_true", help="keep the checkpoint directories")
    versions = sub.add_parser("versions", help="rebuild, materialize or store the earlier "
                                               "versions of files (tools/versions/)",
                              description=snapshots.DESCRIPTION)
    snapshots.add_arguments(versions)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        manifest = load_manifest(args.root)
        if args.command == "list":
            return cmd_list(manifest)
        if args.command == "tree":
            return cmd_tree(manifest, args.chapter)
        if args.command == "checkout":
            return cmd_checkout(manifest, args.chapter, args.dest)
        if args.command == "versions":
            return snapshots.run(manifest, args)
        return check(manifest, args.chapters, args.gpu, args.record, args.tag,
                     args.example_args.split(), args.keep, args.example_timeout)
    except (ManifestError, VersionError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
