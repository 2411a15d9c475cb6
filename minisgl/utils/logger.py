"""One logging setup for the whole package: one format, one handler, the level from the environment.

Every module does ``logger = get_logger(__name__)``; all loggers hang under ``minisgl``, which
owns the only handler. Messages go to stderr: stdout belongs to the program that uses the
engine. Chapter 1 tells the story.
"""

from __future__ import annotations

import logging
import sys

from minisgl.env import parse_log_level, read_env

ROOT_LOGGER = "minisgl"
# The process name tells the scheduler's, the tokenizer's and the server's lines apart once the
# engine runs as several processes; in one process it reads MainProcess.
LOG_FORMAT = "[%(asctime)s %(levelname)s %(processName)s] %(name)s: %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of the call.

    A plain StreamHandler keeps the stream it was created with; pytest, notebooks and
    ``contextlib.redirect_stderr`` swap ``sys.stderr`` later, and should see our lines.
    """

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr  # under the handler's lock: handle() holds it while emitting
        super().emit(record)


def configure_logging(level: str | None = None) -> logging.Logger:
    """Install the package's handler (once) and set its level.

    ``level`` defaults to ``MINISGL_LOG_LEVEL``; calling again re-reads it, which is how a test or
    a launcher changes the level after the first logger was created.
    """
    root = logging.getLogger(ROOT_LOGGER)
    if not any(isinstance(h, _StderrHandler) for h in root.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))
        root.addHandler(handler)
    root.setLevel(read_env().log_level if level is None else parse_log_level(level))
    root.propagate = False  # an application's own root handler would print every line twice
    return root


def get_logger(name: str) -> logging.Logger:
    """The logger for module ``name``; names outside the package are put under ``minisgl.``."""
    if name != ROOT_LOGGER and not name.startswith(ROOT_LOGGER + "."):
        name = f"{ROOT_LOGGER}.{name}"  # e.g. "__main__" of an example: same format, same level
    if not any(isinstance(h, _StderrHandler) for h in logging.getLogger(ROOT_LOGGER).handlers):
        configure_logging()
    return logging.getLogger(name)
