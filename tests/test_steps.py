"""tools/steps.py on small made-up manifests: the tree counts and what `check` catches."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import steps  # noqa: E402

MANIFEST = """
[[stage]]
number = 1
title = "Only stage"

[[chapter]]
id = "ch01"
slug = "first"
title = "First"
stage = 1
status = "written"
new = ["minisgl/__init__.py", "minisgl/a.py"]
early = ["minisgl/helpers.py"]

[[chapter]]
id = "ch02"
slug = "second"
title = "Second"
stage = 1
status = "written"
new = ["minisgl/b.py"]
modified = ["minisgl/a.py"]

[[chapter]]
id = "ch03"
slug = "third"
title = "Third"
stage = 1
status = "coming"
"""


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")


@pytest.fixture
def made_up_repo(tmp_path: Path) -> Path:
    """A two-chapter book: ch02 adds b.py and changes a.py; ch01 brings helpers.py in early."""
    write(tmp_path, "tools/steps.toml", MANIFEST)
    write(tmp_path, "minisgl/__init__.py", "")
    write(tmp_path, "minisgl/helpers.py", "def twice(x):\n    return 2 * x\n")
    write(tmp_path, "minisgl/a.py", "VERSION = 2\n")  # the final version
    # as of chapter 1, as a full copy (which wins over a patch; patches: test_snapshots.py)
    write(tmp_path, "tools/versions/ch01/minisgl/a.py", "VERSION = 1\n")
    write(tmp_path, "minisgl/b.py", "from minisgl.a import VERSION\n")
    write(tmp_path, "examples/ch01_first.py", "import minisgl.a\nprint('a is', minisgl.a.VERSION)\n")
    write(tmp_path, "examples/ch02_second.py", "import minisgl.b\nprint('b ok')\n")
    write(tmp_path, "tests/test_ch01_first.py", """
        from minisgl.a import VERSION
        from minisgl.helpers import twice

        def test_runs_on_either_version():
            assert VERSION in (1, 2)  # chapter tests must also hold on later trees

        def test_early_file_is_there():
            assert twice(2) == 4
    """)
    write(tmp_path, "tests/test_ch02_second.py", """
        import minisgl.b
        from minisgl.a import VERSION

        def test_sees_the_modified_version():
            assert VERSION == 2
    """)
    return tmp_path


def run_check(root: Path, *chapters: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "steps.py"), "--root", str(root), "check", *chapters],
        capture_output=True, text=True, timeout=600,
    )


def test_tree_counts_new_modified_and_early(made_up_repo: Path) -> None:
    manifest = steps.load_manifest(made_up_repo)
    assert steps.tree_counts(manifest, "ch01") == steps.Counts(total=3, new=2, modified=0, early=1)
    assert steps.tree_counts(manifest, "ch02") == steps.Counts(total=4, new=1, modified=1, early=0)


def test_tree_text_labels_each_file(made_up_repo: Path) -> None:
    text = steps.tree_text(steps.load_manifest(made_up_repo), "ch02")
    labels = {line.split()[0]: " ".join(line.split()[1:]) for line in text.splitlines()}
    assert labels == {"minisgl/": "", "__init__.py": "", "a.py": "modified",
                      "b.py": "new", "helpers.py": ""}


def test_earlier_chapter_gets_the_earlier_version(made_up_repo: Path) -> None:
    manifest = steps.load_manifest(made_up_repo)
    assert steps.source_of(manifest, "minisgl/a.py", "ch01") == steps.EarlierVersion(
        "ch01", "minisgl/a.py")
    assert steps.source_of(manifest, "minisgl/a.py", "ch02") == made_up_repo / "minisgl/a.py"


def test_checkpoint_holds_only_its_chapters_files(made_up_repo: Path, tmp_path: Path) -> None:
    dest = tmp_path / "ckpt"
    dest.mkdir()
    steps.build_checkpoint(steps.load_manifest(made_up_repo), "ch01", dest)
    assert (dest / "minisgl/a.py").read_text() == "VERSION = 1\n"
    assert (dest / "minisgl/helpers.py").exists()
    assert not (dest / "minisgl/b.py").exists()


def test_checkout_writes_the_tree_as_of_a_chapter_and_its_example_runs_there(
    made_up_repo: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "as-of-ch01"
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "steps.py"), "--root", str(made_up_repo),
         "checkout", "ch01", str(dest)], capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert (dest / "minisgl/a.py").read_text() == "VERSION = 1\n", "not chapter 1's version"
    assert not (dest / "minisgl/b.py").exists(), "a later chapter's file is in the tree"
    assert "PYTHONPATH=. python examples/ch01_first.py" in out.stdout, out.stdout
    ran = subprocess.run([sys.executable, "examples/ch01_first.py"], cwd=dest,
                         env={"PYTHONPATH": "."}, capture_output=True, text=True, timeout=120)
    assert ran.stdout.strip() == "a is 1", ran.stdout + ran.stderr


def test_checkout_refuses_a_directory_that_is_not_empty(made_up_repo: Path, tmp_path: Path
                                                        ) -> None:
    write(tmp_path, "busy/notes.txt", "mine\n")
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "steps.py"), "--root", str(made_up_repo),
         "checkout", "ch02", str(tmp_path / "busy")], capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2 and "not empty" in out.stderr, out.stdout + out.stderr
    assert (tmp_path / "busy/notes.txt").read_text() == "mine\n"


def test_check_passes_and_counts_every_test(made_up_repo: Path) -> None:
    out = run_check(made_up_repo)
    assert out.returncode == 0, out.stdout + out.stderr
    # checkpoints: 2 examples + 2 tests of ch01 + 1 test of ch02; then ch01's 2 tests again on
    # the final tree, because a.py changed after chapter 1; ch03 is not written yet.
    assert out.stdout.strip().splitlines()[-1] == "7 passed, 0 failed, 1 skipped", out.stdout
    assert "ch03 Third: not written yet" in out.stdout


def test_check_fails_when_a_test_imports_a_later_chapter(made_up_repo: Path) -> None:
    write(made_up_repo, "tests/test_ch01_first.py", """
        import minisgl.b  # b.py belongs to chapter 2

        def test_uses_later_file():
            assert minisgl.b
    """)
    out = run_check(made_up_repo, "ch01")
    assert out.returncode == 1, out.stdout
    assert out.stdout.strip().splitlines()[-1] == "1 passed, 1 failed, 0 skipped"


def test_a_chapter_test_may_import_an_earlier_chapters_test_helpers(made_up_repo: Path) -> None:
    """The imported test module is copied into the checkpoint, not run there."""
    write(made_up_repo, "tests/test_ch01_first.py", """
        from minisgl.helpers import twice

        def four():
            return twice(2)

        def test_four():
            assert four() == 4
    """)
    write(made_up_repo, "tests/test_ch02_second.py", """
        from test_ch01_first import four

        def test_reuses_a_helper():
            assert four() == 4
    """)
    out = run_check(made_up_repo, "ch02")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().splitlines()[-1] == "2 passed, 0 failed, 0 skipped", out.stdout


def test_check_fails_when_an_example_imports_a_later_chapter(made_up_repo: Path) -> None:
    write(made_up_repo, "examples/ch01_first.py", "import minisgl.b\n")
    out = run_check(made_up_repo, "ch01")
    assert out.returncode == 1
    assert "examples/ch01_first.py exited with 1" in out.stdout


def test_an_example_that_runs_too_long_fails_and_shows_what_it_printed(made_up_repo: Path
                                                                      ) -> None:
    write(made_up_repo, "examples/ch01_first.py", """
        import sys, time
        print("loaded the model", flush=True)
        print("waiting for the server", file=sys.stderr, flush=True)
        time.sleep(60)
    """)
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "steps.py"), "--root", str(made_up_repo), "check",
         "ch01", "--example-timeout", "3"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout
    assert "ch01: example timed out after 3 s" in out.stdout
    # where it got stuck: both of its streams, up to the moment it was stopped
    assert "loaded the model" in out.stdout and "waiting for the server" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "2 passed, 1 failed, 0 skipped"


def test_manifest_rejects_modifying_an_unknown_file(made_up_repo: Path) -> None:
    write(made_up_repo, "tools/steps.toml", MANIFEST.replace('modified = ["minisgl/a.py"]',
                                                             'modified = ["minisgl/zzz.py"]'))
    with pytest.raises(steps.ManifestError, match="zzz.py"):
        steps.load_manifest(made_up_repo)


def test_editable_install_does_not_leak_into_checkpoints(made_up_repo: Path) -> None:
    """`pip install -e .` of this repository maps `minisgl.<child>` to the final tree; a
    checkpoint must still not see a module (here minisgl/env.py) that its chapter lacks."""
    assert (ROOT / "minisgl" / "env.py").exists()
    write(made_up_repo, "tools/steps.toml", MANIFEST.replace('new = ["minisgl/b.py"]',
                                                             'new = ["minisgl/b.py", "minisgl/env.py"]'))
    write(made_up_repo, "minisgl/env.py", "")
    write(made_up_repo, "tests/test_ch01_first.py", """
        def test_uses_later_file():
            import minisgl.env
    """)
    out = run_check(made_up_repo, "ch01")
    assert out.returncode == 1, out.stdout
