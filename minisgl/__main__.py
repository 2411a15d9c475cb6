"""``python -m minisgl``: the OpenAI-compatible server, or with ``--shell`` a chat in the terminal.

See :mod:`minisgl.server.launch` for what starts, in which order, and how it stops. The choice
between the two front ends is made here, at the top: the shell drives the server's frontend, so
it sits above the server package, and the launcher is handed it instead of importing it.
"""

from __future__ import annotations

import sys

# The guard matters: every worker is started with spawn, which imports this module again in
# the new process (as ``__mp_main__``); only the real entry point may launch a server.
if __name__ == "__main__":
    from minisgl.server.launch import main
    from minisgl.shell import run_shell

    sys.exit(main(shell=run_shell))
