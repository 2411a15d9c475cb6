"""``python -m minisgl``: the OpenAI-compatible server, or with ``--shell`` a chat in the terminal.

See :mod:`minisgl.server.launch` for what starts, in which order, and how it stops. The choice
between the two front ends is made here, at the top: the shell drives the server's frontend, so
it sits above the server package, and the launcher is handed it instead of importing it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minisgl.server.frontend import RequestRouter


def run_terminal_chat(frontend_factory: Callable[[], RequestRouter], model_path: Path,
                      max_tokens: int) -> None:
    """``--shell``: chat with the model in the terminal, with its generation defaults."""
    from minisgl.shell import run_shell, sampling_params_for

    run_shell(frontend_factory, sampling_params_for(model_path, max_tokens))


# The guard matters: every worker is started with spawn, which imports this module again in
# the new process (as ``__mp_main__``); only the real entry point may launch a server.
if __name__ == "__main__":
    from minisgl.server.launch import main

    sys.exit(main(shell=run_terminal_chat))
