#!/usr/bin/env python3
"""Fetch what the exercises need to run in a reader's browser, so the site can serve it itself.

    python tools/browser_runtime.py           # into .browser/ (git-ignored), once
    python tools/browser_runtime.py --force   # fetch again

The practice pages run an exercise's own tests with pytest inside Pyodide (CPython compiled to
WebAssembly) in a Web Worker. Nothing is fetched from a CDN while reading: `mkdocs build` copies
what this script put in `.browser/` into the site, and the pages load it from there. Where it
comes from, pinned to exact versions and checked against the registry's digest:

* Pyodide, from the npm registry (package ``pyodide``; MPL-2.0): the interpreter and its
  standard library;
* pure-Python wheels from PyPI for the test runner and what exercise tests import: pytest
  (MIT) with pluggy (MIT), iniconfig (MIT), packaging (Apache-2.0 or BSD-2-Clause) and Pygments
  (BSD-2-Clause); hypothesis (MPL-2.0) with sortedcontainers (Apache-2.0); msgpack
  (Apache-2.0), whose pure-Python fallback is repacked from its source archive.

Without `.browser/` the site still builds; its exercise pages then offer the local judge only.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ROOT / ".browser"
PYODIDE_VERSION = "314.0.8"  # CPython 3.14 in WebAssembly
NPM_REGISTRY = "https://registry.npmjs.org"
# The interpreter, its loader and the standard library: what `loadPyodide` reads.
PYODIDE_FILES = ("pyodide.mjs", "pyodide.asm.mjs", "pyodide.asm.wasm", "python_stdlib.zip",
                 "pyodide-lock.json", "package.json")
# Pure-Python wheels (and what they require), for the Python Pyodide carries.
WHEELS = ("pytest==9.2.0", "hypothesis==6.155.7")
MSGPACK = "msgpack==1.2.4"
LICENCES = {
    "pyodide": "MPL-2.0", "pytest": "MIT", "pluggy": "MIT", "iniconfig": "MIT",
    "packaging": "Apache-2.0 OR BSD-2-Clause", "pygments": "BSD-2-Clause",
    "hypothesis": "MPL-2.0", "sortedcontainers": "Apache-2.0", "msgpack": "Apache-2.0",
}
TIMEOUT_S = 120


def fetch_pyodide(dest: Path) -> None:
    """Pyodide's npm package, checked against the registry's sha512, unpacked into `dest`."""
    with urllib.request.urlopen(f"{NPM_REGISTRY}/pyodide/{PYODIDE_VERSION}",
                                timeout=TIMEOUT_S) as reply:
        dist = json.load(reply)["dist"]
    print(f"pyodide {PYODIDE_VERSION}: {dist['tarball']}", flush=True)
    with urllib.request.urlopen(dist["tarball"], timeout=TIMEOUT_S) as reply:
        archive = reply.read()
    algorithm, _, digest = dist["integrity"].partition("-")
    if base64.b64encode(hashlib.new(algorithm, archive).digest()).decode() != digest:
        raise SystemExit(f"pyodide {PYODIDE_VERSION}: the download does not match the "
                         f"registry's {algorithm} digest")
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for name in PYODIDE_FILES:
            member = tar.extractfile(f"package/{name}")
            if member is None:
                raise SystemExit(f"pyodide {PYODIDE_VERSION}: package/{name} is missing")
            (dest / name).write_bytes(member.read())


def pip_download(args: list[str], dest: Path) -> None:
    """`pip download` (pip checks the hashes PyPI publishes) into `dest`."""
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
           "--dest", str(dest), *args]
    subprocess.run(cmd, check=True, timeout=600)


def fetch_wheels(dest: Path) -> None:
    """The test runner's wheels, for any platform, plus msgpack's pure-Python package."""
    dest.mkdir(parents=True, exist_ok=True)
    print(f"wheels: {', '.join(WHEELS)} and {MSGPACK} (pure Python)", flush=True)
    pip_download(["--only-binary=:all:", "--implementation", "py", "--abi", "none",
                  "--platform", "any", "--python-version", "3.14", *WHEELS], dest)
    with tempfile.TemporaryDirectory() as tmp:
        pip_download(["--no-deps", "--no-binary=:all:", MSGPACK], Path(tmp))
        (sdist,) = Path(tmp).glob("msgpack-*.tar.gz")
        version = MSGPACK.partition("==")[2]
        with tarfile.open(sdist) as tar, zipfile.ZipFile(
            dest / f"msgpack-{version}-py3-none-any.whl", "w", zipfile.ZIP_DEFLATED
        ) as wheel:
            for member in tar.getmembers():
                parts = Path(member.name).parts
                if len(parts) == 3 and parts[1] == "msgpack" and parts[2].endswith(".py"):
                    source = tar.extractfile(member)
                    assert source is not None
                    wheel.writestr(f"msgpack/{parts[2]}", source.read())


def write_index(dest: Path) -> None:
    """`.browser/runtime.json`: the files the site serves, with their versions and licences."""
    wheels = sorted(p.name for p in (dest / "wheels").glob("*.whl"))
    index = {
        "pyodide": PYODIDE_VERSION,
        "pyodide_files": list(PYODIDE_FILES),
        "wheels": wheels,
        "licences": LICENCES,
    }
    (dest / "runtime.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def is_complete(dest: Path = RUNTIME) -> bool:
    index = dest / "runtime.json"
    if not index.exists():
        return False
    data = json.loads(index.read_text(encoding="utf-8"))
    files = [dest / "pyodide" / f for f in data["pyodide_files"]]
    files += [dest / "wheels" / w for w in data["wheels"]]
    return data["pyodide"] == PYODIDE_VERSION and all(f.exists() for f in files)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python tools/browser_runtime.py",
        description="Fetch Pyodide and the test runner's wheels into .browser/, so the docs "
                    "site can run the exercises in the reader's browser without a CDN.")
    parser.add_argument("--force", action="store_true", help="fetch again even if present")
    parser.add_argument("--out", type=Path, default=RUNTIME,
                        help="where to put them (default: .browser/)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if is_complete(args.out) and not args.force:
        print(f"{args.out} is complete (pyodide {PYODIDE_VERSION}); --force fetches again")
        return 0
    shutil.rmtree(args.out, ignore_errors=True)
    fetch_pyodide(args.out / "pyodide")
    fetch_wheels(args.out / "wheels")
    write_index(args.out)
    size = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"wrote {args.out} ({size / 2**20:.1f} MiB); `mkdocs build` copies it into the site")
    return 0


if __name__ == "__main__":
    sys.exit(main())
