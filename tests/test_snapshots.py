"""tools/snapshots.py: earlier versions of files stored as reverse patches against the next one.

The whole repository's versions are rebuilt, written out in full and stored again; made-up
files show what a patch survives (a change elsewhere in the final file) and what it refuses
(a change to the lines it replaces or their context), and random edits round-trip exactly.
"""
from __future__ import annotations

import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import snapshots  # noqa: E402
import steps  # noqa: E402

# One stage; a.py is written by chapter 1 and changed by chapters 2 and 3.
MANIFEST = '[[stage]]\nnumber = 1\ntitle = "Stage"\n' + "".join(f"""
[[chapter]]
id = "ch0{n}"
slug = "c{n}"
title = "C{n}"
stage = 1
status = "written"
{'new' if n == 1 else 'modified'} = ["minisgl/a.py"]
""" for n in (1, 2, 3))
FINAL = [f"line {i}\n" for i in range(1, 31)]
AS_OF_CH02 = FINAL[:10] + ["only in chapter 2\n"] + FINAL[12:]  # lines 11-12 replaced
AS_OF_CH01 = AS_OF_CH02[:20] + FINAL[25:]  # and, further down, lines 22-26 not written yet


def steps_py(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "tools/steps.py"), "--root", str(root),
                           *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def book(tmp_path: Path) -> Path:
    """a.py written by ch01, changed by ch02 and ch03, its two earlier versions as patches."""
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools/steps.toml").write_text(MANIFEST)
    (tmp_path / "minisgl").mkdir()
    (tmp_path / "minisgl/a.py").write_text("".join(FINAL))
    for chapter, lines in (("ch01", AS_OF_CH01), ("ch02", AS_OF_CH02)):
        full = tmp_path / "tools/versions" / chapter / "minisgl/a.py"
        full.parent.mkdir(parents=True)
        full.write_text("".join(lines))
    assert steps_py(tmp_path, "versions", "--store").returncode == 0
    return tmp_path


def rebuilt(root: Path, chapter: str) -> str:
    return snapshots.earlier_version(steps.load_manifest(root), "minisgl/a.py", chapter)


def test_every_version_of_the_repository_rebuilds_from_one_patch_each() -> None:
    manifest = steps.load_manifest(ROOT)
    assert snapshots.stored_versions(manifest), "the manifest stores no earlier version"
    assert snapshots.problems(manifest) == []


def test_storing_the_whole_repository_again_rebuilds_every_version_unchanged(
        tmp_path: Path) -> None:
    """Write every version of the repository out in full, store them again (the conversion
    that turns full copies into patches), and rebuild: each version reads exactly as before."""
    manifest = steps.load_manifest(ROOT)
    versions = snapshots.stored_versions(manifest)
    for rel in ["tools/steps.toml", *dict.fromkeys(v.path for v in versions)]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, tmp_path / rel)
    shutil.copytree(ROOT / snapshots.VERSIONS, tmp_path / snapshots.VERSIONS)
    copy = steps.load_manifest(tmp_path)
    full = snapshots.materialize(copy, [], None)
    assert len(full) == len(versions)
    texts = {v: snapshots.earlier_version(manifest, v.path, v.chapter) for v in versions}
    for v in versions:  # the copies are the versions, and they stand beside their patches
        assert (tmp_path / v.location).read_bytes().decode() == texts[v]
        assert (tmp_path / v.patch).exists()
    written, removed = snapshots.store(copy)
    assert removed == len(versions)
    assert not [f for f in (tmp_path / snapshots.VERSIONS).rglob("*")
                if f.is_file() and f.suffix != snapshots.SUFFIX], "a full copy was left behind"
    for v in versions:
        assert snapshots.earlier_version(copy, v.path, v.chapter) == texts[v], v
    assert snapshots.store(copy) == (0, 0), "storing twice changed something"


def test_a_change_elsewhere_in_the_final_file_reaches_every_earlier_version(book: Path) -> None:
    final = book / "minisgl/a.py"
    final.write_text("# a fix at the top\n" + final.read_text())
    assert rebuilt(book, "ch02") == "# a fix at the top\n" + "".join(AS_OF_CH02)
    assert rebuilt(book, "ch01") == "# a fix at the top\n" + "".join(AS_OF_CH01)
    assert steps_py(book, "versions").returncode == 0


@pytest.mark.parametrize("line", [10, 11, 14])  # context before, a replaced line, context after
def test_a_patch_whose_lines_changed_fails_naming_the_file_the_chapter_and_the_hunk(
        book: Path, line: int) -> None:
    final = book / "minisgl/a.py"
    lines = final.read_text().splitlines(keepends=True)
    lines[line - 1] = "changed\n"
    final.write_text("".join(lines))
    with pytest.raises(snapshots.VersionError) as caught:
        rebuilt(book, "ch02")
    message = str(caught.value)
    assert "tools/versions/ch02/minisgl/a.py.patch: hunk 1 (@@ -11,2 +11,1 @@" in message
    assert "as of ch03" in message and "as of ch02 cannot be rebuilt" in message
    out = steps_py(book, "versions")
    assert out.returncode == 1 and "hunk 1" in out.stdout, out.stdout
    assert steps_py(book, "versions", "--store").returncode == 1, "stored over a conflict"


def test_a_full_copy_wins_until_store_turns_it_into_a_patch(book: Path, tmp_path: Path) -> None:
    out = steps_py(book, "versions", "--materialize", "ch02", "minisgl/a.py")
    assert out.returncode == 0, out.stdout  # in place: chapter 1's version comes along
    copies = {c: book / "tools/versions" / c / "minisgl/a.py" for c in ("ch01", "ch02")}
    assert all(p.exists() for p in copies.values()), out.stdout
    copies["ch02"].write_text("an edited chapter 2\n")
    assert rebuilt(book, "ch02") == "an edited chapter 2\n"
    assert "2 problems" in steps_py(book, "versions").stdout  # the two full copies
    assert steps_py(book, "versions", "--store").returncode == 0
    assert not any(p.exists() for p in copies.values())
    assert rebuilt(book, "ch02") == "an edited chapter 2\n"
    assert rebuilt(book, "ch01") == "".join(AS_OF_CH01)  # its patch now starts from the edit
    elsewhere = tmp_path / "read"
    assert steps_py(book, "versions", "--materialize", "ch01", "--out", str(elsewhere)
                    ).returncode == 0
    assert (elsewhere / "ch01/minisgl/a.py").read_text() == "".join(AS_OF_CH01)
    assert not (elsewhere / "ch02").exists()


def test_a_chapter_added_between_makes_the_patch_refuse_its_new_base(book: Path) -> None:
    manifest = (book / "tools/steps.toml").read_text()
    (book / "tools/steps.toml").write_text(manifest.replace('id = "ch03"', 'id = "ch04"'))
    with pytest.raises(snapshots.VersionError, match="as of ch04 into the one as of ch02"):
        rebuilt(book, "ch02")


def test_checkpoints_and_the_tree_use_the_rebuilt_version(book: Path, tmp_path: Path) -> None:
    dest = tmp_path / "ckpt"
    dest.mkdir()
    steps.build_checkpoint(steps.load_manifest(book), "ch01", dest)
    assert (dest / "minisgl/a.py").read_text() == "".join(AS_OF_CH01)


def random_text(rng: random.Random, lines: int) -> str:
    text = "".join(rng.choice(["a\n", "b\n", "\n", "c\r\n", "d\x0ce\n"]) for _ in range(lines))
    return text + rng.choice(["", "no newline"])


def test_patches_round_trip_random_edits() -> None:
    """Insertions, deletions and replacements anywhere, empty files, repeated lines and a last
    line without a newline: applying the patch gives back the earlier text exactly."""
    rng = random.Random(7)
    version = snapshots.EarlierVersion("ch01", "x.py")
    for _ in range(300):
        base = random_text(rng, rng.randrange(0, 30))
        lines = snapshots.split_lines(base)
        for _ in range(rng.randrange(0, 4)):
            at = rng.randrange(0, len(lines) + 1)
            cut = rng.randrange(0, 4)
            lines[at:at + cut] = snapshots.split_lines(random_text(rng, rng.randrange(0, 4)))
        text = "".join(line if line.endswith("\n") else line + "\n" for line in lines[:-1])
        text += lines[-1] if lines else ""
        patch = snapshots.make_patch(base, text, version, "ch02")
        assert snapshots.apply_patch(patch, base, version, "ch02") == text, (base, text, patch)
