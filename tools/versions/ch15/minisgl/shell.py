"""The interactive chat: ``python -m minisgl --model PATH --shell``.

The shell is a client of the same :class:`~minisgl.server.frontend.RequestRouter` the HTTP
server uses, without HTTP in between: each line you type becomes a chat request (with the
conversation so far), and the reply is printed as it streams in. The worker processes are the
server's, started the same way by the launcher.

Commands: ``/reset`` forgets the conversation, ``/exit`` (or Ctrl-D) leaves, ``/help`` lists
them. The checkpoint's ``generation_config.json`` decides how to sample, as it does for
``transformers``' ``generate``: greedy unless it says ``do_sample``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from minisgl.core import SamplingParams
from minisgl.server.frontend import RequestRouter
from minisgl.utils.logger import get_logger

logger = get_logger(__name__)

PROMPT = ">>> "
COMMANDS = {"/reset": "forget the conversation so far",
            "/exit": "leave the shell (Ctrl-D does too)",
            "/help": "list the commands"}


def sampling_params_for(model_dir: str | Path, max_tokens: int) -> SamplingParams:
    """How the checkpoint's ``generation_config.json`` says to sample; greedy if it does not
    ask for sampling (``do_sample``) or has no such file."""
    path = Path(model_dir) / "generation_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    if not config.get("do_sample", False):
        return SamplingParams(temperature=0.0, max_tokens=max_tokens)
    top_k = config.get("top_k") or -1  # transformers' 0 means "no top-k", ours is -1
    return SamplingParams(temperature=float(config.get("temperature", 1.0)),
                          top_p=float(config.get("top_p", 1.0)), top_k=int(top_k),
                          min_p=float(config.get("min_p") or 0.0), max_tokens=max_tokens)


@dataclass
class Shell:
    """A conversation in the terminal, over a :class:`RequestRouter`.

    Args:
        frontend: sends each turn to the workers and streams the reply back.
        params: how to sample the replies.
        out: where replies (and the shell's own messages) are written.
    """

    frontend: RequestRouter
    params: SamplingParams
    out: TextIO = field(default_factory=lambda: sys.stdout)
    history: list[dict[str, str]] = field(default_factory=list)

    async def run(self, read_line: Callable[[str], Awaitable[str]]) -> None:
        """Read a line, answer it, repeat, until ``/exit`` or the end of input."""
        self._write("Chat with the model. /reset forgets the conversation, /exit leaves.\n")
        while True:
            try:
                line = (await read_line(PROMPT)).strip()
            except EOFError:  # Ctrl-D, or the end of a piped input
                self._write("\n")
                return
            if not line:
                continue
            if line.startswith("/"):
                if not self.command(line):
                    return
                continue
            await self.answer(line)

    def command(self, line: str) -> bool:
        """Carry out a ``/command``; False means leave."""
        if line == "/exit":
            return False
        if line == "/reset":
            self.history.clear()
            self._write("(conversation forgotten)\n")
        elif line == "/help":
            self._write("".join(f"  {name:<8}{what}\n" for name, what in COMMANDS.items()))
        else:
            self._write(f"unknown command {line!r}; the commands are {', '.join(COMMANDS)}\n")
        return True

    async def answer(self, text: str) -> str:
        """Send ``text`` with the conversation so far; print the reply as it comes."""
        turn = {"role": "user", "content": text}
        uid = await self.frontend.submit(self.params, messages=[*self.history, turn])
        parts: list[str] = []
        async for reply in self.frontend.replies(uid):
            parts.append(reply.delta)
            self._write(reply.delta)
        self._write("\n")
        reply_text = "".join(parts)
        self.history += [turn, {"role": "assistant", "content": reply_text}]
        return reply_text

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()


async def read_stdin_line(prompt: str) -> str:
    """``input(prompt)`` without blocking the event loop.

    ``input`` runs in a daemon thread: a thread of the default executor could not be
    interrupted, and would keep the process alive after Ctrl-C until Enter is pressed.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[str] = loop.create_future()

    def read() -> None:
        try:
            line = input(prompt)
        except (EOFError, OSError, ValueError) as exc:  # Ctrl-D above all; a closed or
            # undecodable stdin too: handed to the loop as they are
            loop.call_soon_threadsafe(_settle, future, None, exc)
        else:
            loop.call_soon_threadsafe(_settle, future, line, None)

    threading.Thread(target=read, name="shell-input", daemon=True).start()
    return await future


def _settle(future: asyncio.Future[str], line: str | None, exc: BaseException | None) -> None:
    if future.done():  # cancelled meanwhile (Ctrl-C)
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(line)  # type: ignore[arg-type]


def run_shell(frontend_factory: Callable[[], RequestRouter], params: SamplingParams,
              read_line: Callable[[str], Awaitable[str]] = read_stdin_line) -> None:
    """Run the shell on a new event loop until the user leaves."""

    async def main() -> None:
        frontend = frontend_factory()  # its async queues belong to this loop
        frontend.start()
        try:
            await Shell(frontend, params).run(read_line)
        finally:
            await frontend.close()

    asyncio.run(main())
