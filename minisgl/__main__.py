"""``python -m minisgl``: the OpenAI-compatible server, or with ``--shell`` a chat in the terminal.

See :mod:`minisgl.server.launch` for what starts, in which order, and how it stops.
"""

from __future__ import annotations

import sys

# The guard matters: every worker is started with spawn, which imports this module again in
# the new process (as ``__mp_main__``); only the real entry point may launch a server.
if __name__ == "__main__":
    from minisgl.server.launch import main

    sys.exit(main())
