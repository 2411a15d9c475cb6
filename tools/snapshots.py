"""Earlier versions of files, stored as reverse patches.

A file that a later chapter modifies has, besides its final version in `minisgl/`, one earlier
version per chapter that wrote it before: the version as of chapter A is the file as chapter A
left it. That version is stored as `tools/versions/<chA>/<path>.patch`, a patch that turns the
*next* version of the file (the next stored one, or the final file for the last) back into it.
Rebuilding a version walks back from the final file through the chain, so a fix made to the
final file reaches every earlier version whose lines around it are the same; where they are
not, the patch fails to apply, naming the file, the chapter and the hunk.

The patch format is a unified diff that keeps only the lines the earlier version has and the
next one lacks (`+` lines). The lines it replaces and three lines of context on either side are
not spelled out but checked by a digest in the hunk header, which keeps the patches small:

    --- minisgl/core.py as of ch07
    +++ minisgl/core.py as of ch04
    @@ -120,5 +120,2 @@ 3 3 5d41402abc4b      (5 lines at 120 become the 2 below; context
    +    return self.length                    3 before and 3 after; digest of those 11 lines)
    +
    \\ No newline at end of file              (only after a last line without one)

A hunk may apply at an offset (the final file grew or shrank above it); lines that no longer
read as when the patch was made are an error. A full copy `tools/versions/<chA>/<path>` (an
author's working copy, or one restored by a merge) wins over the patch beside it until
`python tools/steps.py versions --store` turns it back into a patch.
"""
from __future__ import annotations

import argparse
import hashlib
import re
from dataclasses import dataclass
from difflib import SequenceMatcher
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # steps.py imports this module; the types are only for reading
    from steps import Chapter, Manifest

VERSIONS = Path("tools/versions")
SUFFIX = ".patch"
CONTEXT = 3  # lines checked on either side of a hunk
NO_NEWLINE = "\\ No newline at end of file"
HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@ (\d+) (\d+) ([0-9a-f]{12})$")
CHAPTER_ID = re.compile(r"^ch\d\d$")


class VersionError(ValueError):
    """An earlier version cannot be rebuilt: its patch is missing, malformed or does not apply."""


@dataclass(frozen=True)
class EarlierVersion:
    """The version of `path` that chapter `chapter` wrote, before a later chapter changed it."""

    chapter: str
    path: str

    @property
    def location(self) -> Path:
        """Where a full copy lives; the patch is the same path with `.patch` added."""
        return VERSIONS / self.chapter / self.path

    @property
    def patch(self) -> Path:
        return self.location.with_name(self.location.name + SUFFIX)


# --------------------------------------------------------------------------- the chain
def writes_of(manifest: Manifest, path: str) -> list[Chapter]:
    """The chapters that write `path` (introduce it, bring it in early or modify it), in order."""
    return [c for c in manifest.chapters if path in (*c.new, *c.early, *c.modified)]


def stored_versions(manifest: Manifest) -> list[EarlierVersion]:
    """Every earlier version the manifest implies: one per write of a file but its last."""
    paths = dict.fromkeys(p for c in manifest.chapters for p in (*c.new, *c.early, *c.modified))
    return [EarlierVersion(c.id, path) for path in paths for c in writes_of(manifest, path)[:-1]]


def _read(path: Path) -> str:
    return path.read_bytes().decode("utf-8")  # bytes: keep every line ending as it is


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode("utf-8"))


def earlier_version(manifest: Manifest, path: str, chapter_id: str) -> str:
    """The text of `path` as chapter `chapter_id` left it, rebuilt from the final file."""
    writes = [c.id for c in writes_of(manifest, path)]
    if chapter_id not in writes[:-1]:
        raise VersionError(f"{VERSIONS / chapter_id / path}: chapter {chapter_id} stores no "
                           f"earlier version of {path} (the chapters that do: "
                           f"{', '.join(writes[:-1]) or 'none'})")
    final = manifest.root / path
    if not final.exists():
        raise VersionError(f"{path} is missing, so its earlier versions cannot be rebuilt")
    text = _read(final)
    for i in range(len(writes) - 2, writes.index(chapter_id) - 1, -1):
        version = EarlierVersion(writes[i], path)
        full, patch = manifest.root / version.location, manifest.root / version.patch
        if full.exists():
            text = _read(full)
        elif patch.exists():
            text = apply_patch(_read(patch), text, version, writes[i + 1])
        else:
            raise VersionError(f"{version.patch} is missing: the manifest says chapter "
                               f"{version.chapter} wrote a version of {path} that "
                               f"chapter {writes[i + 1]} changed")
    return text


# --------------------------------------------------------------------------- patches
def split_lines(text: str) -> list[str]:
    """Lines with their "\\n" (only "\\n" ends a line); a last line without one is kept."""
    parts = text.split("\n")
    return [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def digest(lines: list[str]) -> str:
    return hashlib.blake2b("".join(lines).encode("utf-8"), digest_size=6).hexdigest()


def _range(start: int, count: int) -> str:
    """A unified diff's range: an empty one names the line before it."""
    return f"{start if count == 0 else start + 1},{count}"


def _header(version: EarlierVersion, base_chapter: str) -> tuple[str, str]:
    return (f"--- {version.path} as of {base_chapter}",
            f"+++ {version.path} as of {version.chapter}")


def make_patch(base: str, text: str, version: EarlierVersion, base_chapter: str) -> str:
    """The patch that turns `base` (the next version, as of `base_chapter`) into `text`."""
    old, new = split_lines(base), split_lines(text)
    out = [f"{line}\n" for line in _header(version, base_chapter)]
    matcher = SequenceMatcher(None, old, new, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        before, after = min(CONTEXT, i1), min(CONTEXT, len(old) - i2)
        check = digest(old[i1 - before:i2 + after])
        out.append(f"@@ -{_range(i1, i2 - i1)} +{_range(j1, j2 - j1)} @@ {before} {after} "
                   f"{check}\n")
        for line in new[j1:j2]:
            out.append(f"+{line}" if line.endswith("\n") else f"+{line}\n{NO_NEWLINE}\n")
    return "".join(out)


@dataclass(frozen=True)
class Hunk:
    number: int
    header: str
    start: int  # 0-based index in the base of the first line it replaces
    removed: int
    before: int
    after: int
    check: str
    lines: tuple[str, ...]


def parse_patch(patch: str, version: EarlierVersion, base_chapter: str) -> list[Hunk]:
    """The hunks of a patch; a malformed patch, or one made against another version than the
    manifest's next one (a chapter was added between), is a VersionError."""
    rows = patch.split("\n")
    if rows[-1] == "":
        rows.pop()
    if tuple(rows[:2]) != _header(version, base_chapter):
        raise VersionError(f"{version.patch}: its header {rows[:2]} does not say the patch turns "
                           f"the version as of {base_chapter} into the one as of "
                           f"{version.chapter}, as the manifest does")
    hunks: list[Hunk] = []
    i = 2
    while i < len(rows):
        m = HUNK.match(rows[i])
        if m is None:
            raise VersionError(f"{version.patch}, line {i + 1}: expected a hunk header, "
                               f"found {rows[i]!r}")
        old_start, old_count, new_count = int(m[1]), int(m[2] or 1), int(m[4] or 1)
        lines, i = _hunk_lines(rows, i + 1, new_count, version)
        hunks.append(Hunk(len(hunks) + 1, m[0],
                          old_start if old_count == 0 else old_start - 1, old_count,
                          int(m[5]), int(m[6]), m[7], tuple(lines)))
    return hunks


def _hunk_lines(rows: list[str], i: int, count: int,
                version: EarlierVersion) -> tuple[list[str], int]:
    """The `count` added lines from row `i` on, and the row after them."""
    lines: list[str] = []
    while len(lines) < count:
        if i >= len(rows) or not rows[i].startswith("+"):
            raise VersionError(f"{version.patch}, line {i + 1}: a hunk ends before its "
                               f"{count} lines")
        lines.append(rows[i][1:] + "\n")
        i += 1
        if i < len(rows) and rows[i] == NO_NEWLINE:
            lines[-1] = lines[-1][:-1]
            i += 1
    return lines, i


def _fits(base: list[str], hunk: Hunk, at: int) -> bool:
    lo, hi = at - hunk.before, at + hunk.removed + hunk.after
    return lo >= 0 and hi <= len(base) and digest(base[lo:hi]) == hunk.check


def _find(base: list[str], hunk: Hunk, nominal: int, lowest: int) -> int | None:
    """Where the hunk applies: at `nominal` or the nearest offset, never before `lowest`."""
    highest = len(base) - hunk.removed
    for distance in range(max(nominal - lowest, highest - nominal) + 1):
        for at in (nominal - distance, nominal + distance):
            if lowest <= at <= highest and _fits(base, hunk, at):
                return at
    return None


def apply_patch(patch: str, base: str, version: EarlierVersion, base_chapter: str) -> str:
    """Turn `base` (the version as of `base_chapter`) into `version` with its patch."""
    lines = split_lines(base)
    out: list[str] = []
    done, shift = 0, 0  # base lines consumed; how far the hunks moved so far
    for hunk in parse_patch(patch, version, base_chapter):
        at = _find(lines, hunk, hunk.start + shift, done)
        if at is None:
            where = hunk.start + shift
            shown = "".join(lines[max(where - hunk.before, 0):where + hunk.removed + hunk.after])
            raise VersionError(
                f"{version.patch}: hunk {hunk.number} ({hunk.header}) does not apply: the lines "
                f"of {version.path} as of {base_chapter} it replaces, or the {CONTEXT} lines "
                f"around them, changed since the patch was made, so the version as of "
                f"{version.chapter} cannot be rebuilt. Around line {where + 1} they now read:\n"
                f"{shown}(carry the change into the earlier version: see "
                f"`python tools/steps.py versions --help`)")
        out += lines[done:at] + list(hunk.lines)
        done, shift = at + hunk.removed, at - hunk.start
    return "".join(out + lines[done:])


# --------------------------------------------------------------------------- storing
def base_chapter(manifest: Manifest, version: EarlierVersion) -> str:
    """The chapter whose version of the file the patch of `version` starts from."""
    writes = [c.id for c in writes_of(manifest, version.path)]
    return writes[writes.index(version.chapter) + 1]


def store(manifest: Manifest) -> tuple[int, int]:
    """Write every earlier version as a patch against the next one, then remove the full
    copies; returns (patches written, full copies removed). Every text is rebuilt before
    anything is written, and every new patch is checked to rebuild its version exactly, so a
    run that fails leaves the tree as it was, and a second run writes nothing."""
    versions = stored_versions(manifest)
    texts = {v: earlier_version(manifest, v.path, v.chapter) for v in versions}
    patches: dict[EarlierVersion, str] = {}
    for v in versions:
        base_id = base_chapter(manifest, v)
        newer = EarlierVersion(base_id, v.path)
        base = texts[newer] if newer in texts else _read(manifest.root / v.path)
        patches[v] = make_patch(base, texts[v], v, base_id)
        if apply_patch(patches[v], base, v, base_id) != texts[v]:
            raise VersionError(f"{v.patch}: the new patch does not rebuild the version exactly")
    written = removed = 0
    for v, patch in patches.items():
        target = manifest.root / v.patch
        if not target.exists() or _read(target) != patch:
            _write(target, patch)
            written += 1
    for v in versions:
        if (manifest.root / v.location).exists():
            (manifest.root / v.location).unlink()
            removed += 1
    return written, removed


def select(manifest: Manifest, selectors: list[str]) -> list[EarlierVersion]:
    """The stored versions named by chapter ids and file paths (none named: every one)."""
    chapters = {s for s in selectors if CHAPTER_ID.match(s)}
    paths = {s for s in selectors if s not in chapters}
    stored = stored_versions(manifest)
    unknown = sorted(paths - {v.path for v in stored})
    if unknown:
        raise VersionError(f"no earlier version of {', '.join(unknown)} is stored (only files "
                           "a later chapter modifies have one)")
    chosen = [v for v in stored if (not chapters or v.chapter in chapters)
              and (not paths or v.path in paths)]
    if not chosen:
        raise VersionError(f"no stored version matches {' '.join(selectors)}")
    return chosen


def materialize(manifest: Manifest, selectors: list[str], out: Path | None) -> list[Path]:
    """Write the full text of the versions named into `out`/<chNN>/<path>, or, without `out`,
    beside their patches, where they win over the patches until `store`. In place, the older
    versions of the same files come along: their patches start from the copies being edited."""
    chosen = select(manifest, selectors)
    if out is None:
        number = {c.id: c.number for c in manifest.chapters}
        chosen = [v for v in stored_versions(manifest)
                  if any(c.path == v.path and number[v.chapter] <= number[c.chapter]
                         for c in chosen)]
    texts = {v: earlier_version(manifest, v.path, v.chapter) for v in chosen}
    written: list[Path] = []
    for v, text in texts.items():
        target = out / v.chapter / v.path if out is not None else manifest.root / v.location
        _write(target, text)
        written.append(target)
    return written


def problems(manifest: Manifest) -> list[str]:
    """What keeps tools/versions/ from being exactly one patch per earlier version, each
    rebuilding its version."""
    found: list[str] = []
    stored = stored_versions(manifest)
    for v in stored:
        try:
            earlier_version(manifest, v.path, v.chapter)
        except VersionError as exc:
            found.append(str(exc))
        if (manifest.root / v.location).exists():
            found.append(f"{v.location} is a full copy: `python tools/steps.py versions "
                         "--store` turns it into a patch")
    known = {p for v in stored for p in (v.location, v.patch)}
    for f in sorted((manifest.root / VERSIONS).rglob("*")):
        rel = f.relative_to(manifest.root)
        if f.is_file() and "__pycache__" not in rel.parts and rel not in known:
            found.append(f"{rel}: no chapter of tools/steps.toml stores this version")
    return found


# --------------------------------------------------------------------------- the command
DESCRIPTION = """\
The earlier versions of files live under tools/versions/<chNN>/<path>.patch, each a patch that
turns the next version of the file (the final one for the last) back into the one chapter NN
left. Without options: rebuild every version and report what is wrong. To change an earlier
version: --materialize it (a full copy beside its patch, which wins over the patch; the older
versions of the file come along), edit the copies, then --store. A change to a final file that a
patch no longer fits fails, naming the patch and the hunk: set the final file back, --materialize
its versions, make the change in the final file and in the copies, then --store."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--store", "--from-full", action="store_true",
                        help="turn every full copy under tools/versions/ into a patch against "
                             "the next version and remove it; refresh every other patch")
    action.add_argument("--materialize", nargs="*", metavar="chNN|PATH",
                        help="write the full text of the versions named by chapter and/or file "
                             "(none named: all) beside their patches, or under --out")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="with --materialize: write DIR/<chNN>/<path> instead, to read")


def patch_lines(manifest: Manifest) -> int:
    return sum(len(split_lines(_read(f)))
               for f in (manifest.root / VERSIONS).rglob(f"*{SUFFIX}"))


def run(manifest: Manifest, args: argparse.Namespace) -> int:
    """`python tools/steps.py versions [--store | --materialize ... [--out DIR]]`."""
    if args.out is not None and args.materialize is None:
        print("error: --out goes with --materialize")
        return 2
    try:
        if args.store:
            written, removed = store(manifest)
            print(f"{written} patches written, {removed} full copies removed")
        elif args.materialize is not None:
            for path in materialize(manifest, args.materialize, args.out):
                print(f"wrote {path}")
            return 0
    except VersionError as exc:
        print(f"error: {exc}")
        return 1
    found = problems(manifest)
    for problem in found:
        print(problem)
    versions = stored_versions(manifest)
    print(f"{len(versions)} earlier versions of {len({v.path for v in versions})} files, "
          f"{patch_lines(manifest)} lines of patches under {VERSIONS}/; "
          f"{len(found)} problems")
    return 1 if found else 0
