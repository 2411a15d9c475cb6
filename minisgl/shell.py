"""The interactive chat: ``python -m minisgl --model PATH --shell``.

The shell is a client of the same :class:`~minisgl.server.frontend.RequestRouter` the HTTP
server uses, without HTTP in between: each line you type becomes a chat request (with the
conversation so far), and the reply is printed as it streams in. The worker processes are the
server's, started the same way by the launcher.

Commands: ``/reset`` forgets the conversation, ``/exit`` (or Ctrl-D) leaves, ``/help`` lists
them. The checkpoint's ``generation_config.json`` decides how to sample, as it does for
``transformers``' ``generate``: greedy unless it says ``do_sample``.

Ctrl-C while a reply is being written stops that reply (the request is aborted,
the conversation keeps what was written) and the shell asks for the next line; Ctrl-C at the
prompt leaves. A request that fails prints its error instead of a reply.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from minisgl.core import SamplingParams
from minisgl.server.frontend import RequestRouter
from minisgl.server.protocol import APIError
from minisgl.utils.hf import load_hf_config
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
    config = load_hf_config(path) if path.is_file() else {}
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
    # What Ctrl-C interrupts (the line being read, or the reply being written), and whether
    # it did.
    _current: asyncio.Future[str] | None = field(default=None, init=False, repr=False)
    _interrupted: bool = field(default=False, init=False, repr=False)

    async def run(self, read_line: Callable[[str], Awaitable[str]]) -> None:
        """Read a line, answer it, repeat, until ``/exit`` or the end of input.

        Raises:
            KeyboardInterrupt: Ctrl-C (:meth:`interrupt`) while waiting for a line.
        """
        self._write("Chat with the model. /reset forgets the conversation, /exit leaves.\n")
        while True:
            try:
                line = (await self._interruptible(read_line(PROMPT))).strip()
            except EOFError:  # Ctrl-D, or the end of a piped input
                self._write("\n")
                return
            except asyncio.CancelledError:
                if not self._interrupted:
                    raise
                self._write("\n")
                raise KeyboardInterrupt from None
            if line.startswith("/"):
                if not self.command(line):
                    return
            elif line:
                await self._interruptible(self.answer(line))

    async def _interruptible(self, work: Awaitable[str]) -> str:
        self._current, self._interrupted = asyncio.ensure_future(work), False
        try:
            return await self._current
        finally:
            self._current = None

    def interrupt(self) -> None:
        """Ctrl-C: stop the reply being written, or, at the prompt, leave.

        Stopping a reply cancels the task writing it; the generator of its replies is closed
        on the way out, which aborts the request, so the scheduler stops generating it.
        """
        if self._current is not None and not self._current.done():
            self._interrupted = True
            self._current.cancel()

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
        """Send ``text`` with the conversation so far; print the reply as it comes.

        A reply stopped by Ctrl-C stays in the conversation as far as it got; a
        request that fails prints its error and leaves the conversation as it was.
        """
        turn = {"role": "user", "content": text}
        parts: list[str] = []
        error, stopped = None, False
        try:
            uid = await self.frontend.submit(self.params, messages=[*self.history, turn])
            async with aclosing(self.frontend.replies(uid)) as replies:
                async for reply in replies:
                    if reply.error is not None:
                        error = reply.error.message
                        break
                    parts.append(reply.delta)
                    self._write(reply.delta)
        except APIError as exc:  # the server cannot serve (a worker died)
            error = exc.message
        except asyncio.CancelledError:  # Ctrl-C; closing the replies aborted the request
            if not self._interrupted:
                raise  # the shell itself is being cancelled
            stopped = True
        if error is not None:
            self._write(("\n" if parts else "") + f"[error: {error}]\n")  # on a line of its own
            return ""
        self._write(" [interrupted]\n" if stopped else "\n")
        reply_text = "".join(parts)
        self.history += [turn, {"role": "assistant", "content": reply_text}]
        return reply_text

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()


async def read_stdin_line(prompt: str) -> str:
    """``input(prompt)`` without blocking the event loop.

    ``input`` runs in a daemon thread: a thread of the default executor could not be
    interrupted, and would keep the process alive after Ctrl-C until Enter is pressed. That
    thread can outlive the shell: after Ctrl-C at the prompt the loop closes while ``input``
    still waits, and a line typed during the shutdown finds no loop to hand it to. Nobody
    waits for that line any more, so it is dropped.
    """
    line: concurrent.futures.Future[str] = concurrent.futures.Future()
    line.set_running_or_notify_cancel()  # a read under way cannot be cancelled, only abandoned

    def read() -> None:
        try:
            line.set_result(input(prompt))
        except (EOFError, OSError, ValueError) as exc:  # Ctrl-D above all; a closed or
            line.set_exception(exc)  # undecodable stdin too: handed to the loop as they are

    threading.Thread(target=read, name="shell-input", daemon=True).start()
    return await asyncio.wrap_future(line)


def run_shell(frontend_factory: Callable[[], RequestRouter], model_dir: str | Path,
              max_tokens: int) -> None:
    """Chat with the model in ``model_dir`` on a new event loop until the user leaves, sampling
    as its generation defaults say (:func:`sampling_params_for`); what ``--shell`` runs."""
    params = sampling_params_for(model_dir, max_tokens)

    async def main() -> None:
        frontend = frontend_factory()  # its async queues belong to this loop
        frontend.start()
        shell = Shell(frontend, params)
        loop = asyncio.get_running_loop()
        # Ctrl-C is the shell's to interpret (the workers, in process groups of
        # their own, do not receive it); --shell runs in the main thread, where handlers live.
        loop.add_signal_handler(signal.SIGINT, shell.interrupt)
        try:
            await shell.run(read_stdin_line)
        finally:
            loop.remove_signal_handler(signal.SIGINT)
            await frontend.close()

    asyncio.run(main())
