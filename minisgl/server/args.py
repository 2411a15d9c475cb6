"""``python -m minisgl``'s command line: the options, and the :class:`ServerArgs` they become.

- **the service**: the checkpoint (``--model``; left out, the book's default model), where to
  listen, how many tokenizer workers, ``--shell`` instead of HTTP, and the request
  lifecycle's limits (``--reply-buffer-size``, ``--slow-reader-timeout``,
  ``--shutdown-timeout``);
- **the engine**: the fields of :class:`~minisgl.scheduler.config.SchedulerConfig` a user may
  set; one left out keeps the engine's own default, so defaults live in one place only;
- **tensor parallelism** (``--tp``): the model split over N scheduler processes.

:func:`parse_args` checks everything before a process starts, so a bad value is argparse's
usage line naming the option, not an error from inside a worker. Chapter 15 tells the story;
chapters 16 and 17 add their options.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from minisgl.env import parse_mem_bytes
from minisgl.scheduler.config import SchedulerConfig
from minisgl.server.lifecycle import DEFAULT_REPLY_BUFFER_SIZE, DEFAULT_SLOW_READER_TIMEOUT_S
from minisgl.utils.checks import check_int, is_number


# The SchedulerConfig fields the command line sets, with their flags' help. The flag is the
# field name with dashes; the default shown is the engine's own.
ENGINE_OPTIONS: dict[str, str] = {
    "attention_backend": "attention kernels: auto, torch or flashinfer",
    "page_size": "token slots per KV page",
    "num_pages": "a fixed number of KV pages (default: sized from free memory)",
    "memory_fraction": "CUDA: share of the free GPU memory the KV pool takes",
    "cpu_kv_memory": "CPU: bytes for the KV pool, e.g. 512MiB (default: MINISGL_CPU_KV_MEMORY)",
    "max_running_reqs": "the most requests running at once",
    "max_seq_len": "the longest sequence (prompt + output) of one request "
                   "(default: the model's context)",
    "max_prefill_tokens": "prompt tokens one prefill step computes at most",
    "prefix_cache": "the prefix cache: naive (none) or radix (shares common prefixes)",
    "chunked_prefill": "cut prompts longer than --max-prefill-tokens into chunks",
    "cuda_graph": "capture decode steps as CUDA graphs (CUDA only)",
    "cuda_graph_max_bs": "the largest decode batch replayed as a CUDA graph",
    "overlap": "overlap scheduling (default: on unless MINISGL_DISABLE_OVERLAP is set)",
    "speculative": "speculative decoding: ngram (prompt lookup) or draft=PATH (a draft model "
                   "with the same tokenizer), each optionally followed by ,k=N guesses a step "
                   "and ,ahead=off (a draft's next round waits for the host) (default: off)",
}


def check_seconds(name: str, value: object, *, allow_zero: bool = False) -> None:
    """Refuse ``value`` unless it is a finite number of seconds > 0 (>= 0 with ``allow_zero``)."""
    if not (is_number(value) and math.isfinite(value) and (value > 0 or allow_zero and value == 0)):
        raise ValueError(f"{name} must be a number of seconds {'>=' if allow_zero else '>'} 0, "
                         f"got {value!r}")


@dataclass(frozen=True)
class ServerArgs:
    """Everything the launcher needs, checked.

    Attributes:
        model: a checkpoint directory or a Hugging Face hub id, as given; None means the book's
            default model (the launcher finds it: :func:`~minisgl.utils.hf.default_model`).
        host, port: where the HTTP server listens.
        device, dtype: as for :class:`~minisgl.scheduler.config.SchedulerConfig`.
        tp: tensor-parallel ranks: one scheduler process per rank.
        shell: run the interactive chat in the terminal instead of the HTTP server.
        shell_max_tokens: the longest reply the shell asks for.
        num_tokenizers: tokenizer worker processes; request ``uid`` goes to ``uid % N``.
        served_model_name: the model name the API reports; None means ``model`` as given.
        startup_timeout_s: how long the launcher waits for the workers to report ready.
        reply_buffer_size: the most replies the API server holds for one reader.
        slow_reader_timeout_s: how long a reader may stay behind the engine
            before its request is aborted.
        shutdown_timeout_s: how long requests in flight may run on after SIGINT
            or SIGTERM.
        engine_options: the engine options given on the command line (field -> value); the
            others keep the engine's defaults.
    """

    model: str | None = None
    host: str = "127.0.0.1"  # loopback: serving every interface is a choice to make
    port: int = 1919
    device: str = "auto"
    dtype: str = "auto"
    tp: int = 1
    shell: bool = False
    shell_max_tokens: int = 2048  # room for a reasoning model to think, then answer
    num_tokenizers: int = 1
    served_model_name: str | None = None
    startup_timeout_s: float = 600.0  # a large checkpoint on a slow disk: minutes
    reply_buffer_size: int = DEFAULT_REPLY_BUFFER_SIZE
    slow_reader_timeout_s: float = DEFAULT_SLOW_READER_TIMEOUT_S
    shutdown_timeout_s: float = 5.0  # then what is left ends with an error
    engine_options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.model is not None and (not isinstance(self.model, str) or not self.model.strip()):
            raise ValueError(f"--model must name a checkpoint directory or a hub id, "
                             f"got {self.model!r}")
        if not self.host:
            raise ValueError("--host must be an address to listen on, e.g. 127.0.0.1")
        check_int("--port", self.port, at_least=1, at_most=65535)
        check_int("--num-tokenizers", self.num_tokenizers, at_least=1)
        check_int("--shell-max-tokens", self.shell_max_tokens, at_least=1)
        # Whether the model splits --tp ways is checked by the launcher, once the checkpoint
        # is found.
        check_int("--tp", self.tp, at_least=1)
        check_seconds("--startup-timeout", self.startup_timeout_s)
        check_int("--reply-buffer-size", self.reply_buffer_size, at_least=1)
        check_seconds("--slow-reader-timeout", self.slow_reader_timeout_s)
        check_seconds("--shutdown-timeout", self.shutdown_timeout_s, allow_zero=True)

    @property
    def model_name(self) -> str:
        """The name the API reports for the model (``/v1/models``, every response's ``model``)."""
        return self.served_model_name or self.model or "default"

    @property
    def url(self) -> str:
        """Where the HTTP server listens."""
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 literal
        return f"http://{host}:{self.port}"

    def scheduler_config(self, model_path: str) -> SchedulerConfig:
        """The scheduler process's config, for the checkpoint directory ``model_path``.

        The shell serves one conversation, so unless told otherwise it keeps one request
        slot (on CUDA that also means capturing a single decode graph instead of dozens).
        """
        shell_defaults = {"max_running_reqs": 1} if self.shell else {}
        return SchedulerConfig(model_path, device=self.device, dtype=self.dtype,
                               **{**shell_defaults, **self.engine_options})


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m minisgl`` (the Reference page shows its ``--help``)."""
    parser = argparse.ArgumentParser(
        prog="python -m minisgl",
        description="Serve a model behind an OpenAI-compatible HTTP API "
                    "(or chat with it in the terminal with --shell).")
    parser.add_argument("--model", default=None, metavar="PATH_OR_HUB_ID",
                        help="a checkpoint directory, or a Hugging Face hub id such as "
                             "Qwen/Qwen3-0.6B (downloaded on first use); default: the book's "
                             "model, models/tiny-shakespeare if the repository has it, else "
                             "models/tiny-qwen3 (built on first use, offline)")
    parser.add_argument("--host", default=ServerArgs.host,
                        help="the address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=ServerArgs.port,
                        help="the port to listen on (default: %(default)s)")
    parser.add_argument("--device", default=ServerArgs.device,
                        help="auto, cpu, cuda or cuda:N (default: %(default)s)")
    parser.add_argument("--dtype", default="auto",
                        choices=("auto", "float32", "bfloat16", "float16"),
                        help="auto is float32 on CPU, bfloat16 on CUDA (default: %(default)s)")
    parser.add_argument("--tp", type=int, default=ServerArgs.tp, metavar="N",
                        help="tensor-parallel ranks: gloo on CPU, one GPU per rank on CUDA "
                             "(default: %(default)s)")
    parser.add_argument("--shell", action="store_true",
                        help="chat in the terminal instead of serving HTTP")
    parser.add_argument("--shell-max-tokens", type=int, default=ServerArgs.shell_max_tokens,
                        metavar="N", help="the longest reply in the shell (default: %(default)s)")
    parser.add_argument("--num-tokenizers", type=int, default=ServerArgs.num_tokenizers,
                        metavar="N", help="tokenizer worker processes (default: %(default)s)")
    parser.add_argument("--served-model-name", metavar="NAME",
                        help="the model name the API reports (default: --model as given)")
    parser.add_argument("--startup-timeout", type=float, default=ServerArgs.startup_timeout_s,
                        metavar="SECONDS", dest="startup_timeout_s",
                        help="how long to wait for the workers to start (default: %(default)s)")
    lifecycle = parser.add_argument_group(
        "request lifecycle", "limits that keep one client from holding the server's memory "
        "or its shutdown")
    lifecycle.add_argument("--reply-buffer-size", type=int, default=ServerArgs.reply_buffer_size,
                           metavar="N", help="the most replies (about one per token) held "
                           "for a client that reads slowly; beyond, its request is aborted "
                           "(default: %(default)s)")
    lifecycle.add_argument("--slow-reader-timeout", type=float, metavar="SECONDS",
                           default=ServerArgs.slow_reader_timeout_s, dest="slow_reader_timeout_s",
                           help="abort the request of a client that stays behind the engine "
                           "this long (default: %(default)s)")
    lifecycle.add_argument("--shutdown-timeout", type=float, metavar="SECONDS",
                           default=ServerArgs.shutdown_timeout_s, dest="shutdown_timeout_s",
                           help="on SIGINT/SIGTERM, how long requests in flight may take to "
                           "finish before they are ended with an error (default: %(default)s)")

    engine = parser.add_argument_group(
        "engine options", "left out, each keeps the engine's default (shown in brackets)")
    for name, help_text in ENGINE_OPTIONS.items():
        _add_engine_option(engine, name, help_text)
    return parser


def _add_engine_option(group: argparse._ArgumentGroup, name: str, help_text: str) -> None:
    """One flag per SchedulerConfig field, typed like the field's default."""
    default = next(f.default for f in dataclasses.fields(SchedulerConfig) if f.name == name)
    flag = "--" + name.replace("_", "-")
    shown = help_text if default is None else f"{help_text} [{default}]"
    # default=None means "not given": the engine then applies its own default.
    # overlap's default is None (on unless MINISGL_DISABLE_OVERLAP), still a switch.
    if isinstance(default, bool) or name == "overlap":
        group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                           help=shown)
        return
    # Integers, unless said otherwise (some default to None: sized by the engine).
    kind, metavar = {"cpu_kv_memory": (_mem_bytes, "SIZE"), "memory_fraction": (float, "F"),
                     "speculative": (str, "SPEC")}.get(
        name, (str, "NAME") if isinstance(default, str) else (int, "N"))
    group.add_argument(flag, type=kind, default=None, metavar=metavar, help=shown)


def _mem_bytes(text: str) -> int:
    try:
        return parse_mem_bytes(text)
    except ValueError as exc:  # argparse turns this into "invalid _mem_bytes value"
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: Sequence[str] | None = None) -> ServerArgs:
    """``argv`` (default: ``sys.argv[1:]``) as checked :class:`ServerArgs`.

    Every value is checked here, the engine options by building the scheduler's config once:
    a mistake exits with status 2 and a message naming the option, before any process starts.
    """
    parser = build_parser()
    ns = vars(parser.parse_args(argv))
    engine = {name: value for name in ENGINE_OPTIONS if (value := ns.pop(name)) is not None}
    try:
        args = ServerArgs(engine_options=engine, **ns)
        # checks the engine options; the path is checked when it is opened
        args.scheduler_config(args.model or "default")
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    return args

