"""Fuzz a running minisgl server from its own OpenAPI schema with schemathesis, every check.

    python tools/fuzz_api.py --url http://127.0.0.1:1919 [--max-examples 200] [--seed 1]

schemathesis reads ``/openapi.json`` and sends what the schema allows (every response must be
documented, well formed, and not a 5xx; valid data must be served) and what it forbids (which
must be refused with a 4xx). It runs all its checks, with one refinement: a request the schema
allows but whose prompt plus ``max_tokens`` does not fit the context is refused with 400
``context_length_exceeded``, as OpenAI does; how many tokens a text becomes is no property a
schema can state, so that answer counts as serving valid data. Exits 1 on any failure.

Run as ``SCHEMATHESIS_HOOKS=tools/fuzz_api.py``, this file registers that check.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
CONTEXT_CHECK = "positive_data_served"


def is_context_refusal(status_code: int, body: Any) -> bool:
    """Whether a response is the server's 400 for a prompt and max_tokens beyond the context."""
    if status_code != 400 or not isinstance(body, dict):
        return False
    error = body.get("error")
    return isinstance(error, dict) and error.get("code") == "context_length_exceeded"


def register_check() -> None:
    """schemathesis' positive_data_acceptance, less the context refusal (see the docstring)."""
    import schemathesis
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    @schemathesis.check
    def positive_data_served(ctx: Any, response: Any, case: Any) -> bool | None:
        try:
            body = response.json()
        except Exception:  # not JSON: not the context refusal
            body = None
        if is_context_refusal(response.status_code, body):
            return None
        return positive_data_acceptance(ctx, response, case)


ALL_PHASES = ("examples", "coverage", "fuzzing", "stateful")


def run(url: str, max_examples: int = 25, seed: int = 1, report: Path | None = None,
        phases: tuple[str, ...] = ALL_PHASES, timeout_s: float = 600) -> list[str]:
    """Fuzz the server at ``url``; the failures schemathesis reported (empty: none).

    ``phases``: schemathesis' test phases; ``coverage`` sends the schema's boundary values
    (some seven hundred requests here, whatever ``max_examples`` is). Its whole output goes
    to ``report`` (a temporary file if None).
    """
    command = [sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json",
               "--checks", "all", "--exclude-checks", "positive_data_acceptance",
               "--max-examples", str(max_examples), "--seed", str(seed), "--no-color",
               "--workers", "1", "--phases", ",".join(phases)]
    env = dict(os.environ, SCHEMATHESIS_HOOKS=str(HERE))
    if report is None:
        report = Path(tempfile.mkstemp(prefix="minisgl-fuzz-", suffix=".txt")[1])
    # schemathesis keeps a cache (.schemathesis/) in its working directory: the report's
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s,
                          cwd=report.resolve().parent)
    output = done.stdout + done.stderr
    report.write_text(output, encoding="utf-8")
    if done.returncode == 0:
        return []
    failures = [line.strip() for line in output.splitlines() if line.strip().startswith("❌")]
    return failures or [f"schemathesis exited with {done.returncode}; see {report}:\n"
                        + output[-3000:]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:1919", help="the server")
    parser.add_argument("--max-examples", type=int, default=200,
                        help="cases per operation and phase (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--report", type=Path, default=None,
                        help="where schemathesis' output goes (default: a temporary file)")
    args = parser.parse_args(argv)
    report = args.report or Path(tempfile.mkstemp(prefix="minisgl-fuzz-", suffix=".txt")[1])
    failures = run(args.url, args.max_examples, args.seed, report)
    summary = [line for line in report.read_text(encoding="utf-8").splitlines()
               if "generated" in line or " in " in line and "=====" in line]
    print("\n".join(summary[-2:]))
    print("\n".join(failures) if failures else "no failures")
    print(f"schemathesis' output: {report}")
    return 1 if failures else 0


if __name__ == "_schemathesis_hooks":  # loaded by schemathesis through SCHEMATHESIS_HOOKS
    register_check()
elif __name__ == "__main__":
    sys.exit(main())
