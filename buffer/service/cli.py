"""``rollout-buffer``: one command-line tool, one subcommand per thing a user does.

    rollout-buffer [serve] [OPTIONS]   run the service (``python buffer.py`` and ``python -m buffer``
                                       do the same: slime's users start it so)
    rollout-buffer status              a running buffer's tasks, jobs and rates, once
    rollout-buffer tail                follow the trajectories as they are written
    rollout-buffer check DIR [--repair] check a data folder, and salvage what can be read
    rollout-buffer worker --buffer URL --task NAME --generator FILE   run a generator for a buffer elsewhere
    rollout-buffer gateway --buffer-url URL [--processes N]   the gateway in processes of its own
    rollout-buffer simulator [OPTIONS]  the simulated policy server (``python -m buffer.simulator``)
    rollout-buffer demo [OPTIONS]       the example run (``rollout_buffer_example.sh``)

The installed command works from any folder, slime's ``rollout_buffer/`` (whose own ``buffer.py``
and ``generator/`` shadow this package for ``python -m buffer`` there) included: a console
script's ``sys.path`` starts with its own folder, not the working one.

Each subcommand is one ``Command`` in ``COMMANDS``: its flags are added by one function and it is
run by another, so a new one is one entry. The service's flags are made from ``Settings`` itself:
an option added there is a flag here, with its ``ROLLOUT_BUFFER_*`` variable, and nothing else to
change. A bad value is one line naming the flag (or the variable), never a validation traceback.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import socket
import sys
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from pydantic import SecretStr, ValidationError

from buffer import __version__
from buffer.service.settings import Settings

PROG = "rollout-buffer"
#: Once the workers have stopped and the long polls answered, how long the requests still in
#: flight may take before uvicorn cancels them.
GRACEFUL_SHUTDOWN_S = 3
HELP_FLAGS = ("-h", "--help")


class Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line: the flag, what is wrong, where the options are."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (--help lists the options)\n")


@dataclass(frozen=True, slots=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


@dataclass(frozen=True, slots=True)
class Program:
    """A subcommand that is a program of its own, with its own flags: given the rest of the
    command line and the name to call itself by."""

    name: str
    help: str
    main: Callable[[list[str], str], int | None]


def main(argv: Sequence[str] | None = None) -> None:
    """Run the subcommand named first; with none (or only flags), serve, as ``python buffer.py`` does."""
    args = list(sys.argv[1:] if argv is None else argv)
    names = {command.name for command in COMMANDS}
    if args[:1] and args[0] in HELP_FLAGS:
        sys.stdout.write(help_text())
        sys.exit(0)
    if args[:1] == ["--version"]:
        sys.stdout.write(f"{PROG} {__version__}\n")
        sys.exit(0)
    for program in PROGRAMS:
        if args[:1] == [program.name]:
            sys.exit(program.main(args[1:], f"{PROG} {program.name}"))
    if not args or args[0] not in names:
        args = ["serve", *args]
    namespace = parser().parse_args(args)
    sys.exit(namespace.run(namespace))


def parser() -> Parser:
    top = Parser(
        prog=PROG,
        description="A rollout buffer for agentic RL training of LLMs, drop-in compatible with slime's.",
    )
    commands = top.add_subparsers(title="commands", metavar="COMMAND", parser_class=Parser)
    for command in COMMANDS:
        sub = commands.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(sub)
        sub.set_defaults(run=command.run, command=command.name)
    return top


def help_text() -> str:
    """The commands, then serve's options: serving is what running it without a command does."""
    serve_parser = Parser(prog=f"{PROG} serve")
    add_serve_arguments(serve_parser)
    usage = f"usage: {PROG} [COMMAND] [OPTIONS]\n\n"
    named = [(command.name, command.help) for command in COMMANDS]
    named += [(program.name, program.help) for program in PROGRAMS]
    lines = [f"  {name:<10} {summary}" for name, summary in named]
    serve_options = serve_parser.format_help().split("\n\n", 1)[1]
    return (
        usage
        + "A rollout buffer for agentic RL training of LLMs, drop-in compatible with slime's.\n\n"
        + "commands (`rollout-buffer COMMAND --help` for each one's options):\n"
        + "\n".join(lines)
        + "\n\nWithout a command it serves (`python buffer.py` too); serve's options:\n\n"
        + serve_options
    )


# -- serve -------------------------------------------------------------------------------


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per ``Settings`` field: ``--kebab-name``, its description, its default."""
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        annotation = _without_none(field.annotation)
        variable = f"ROLLOUT_BUFFER_{name.upper()}"
        default = field.get_default(call_default_factory=True)
        shown = "" if default in (None, []) or isinstance(default, SecretStr) else f" (default: {default})"
        help_line = f"{field.description or ''}{shown}; ${variable}".replace("%", "%%")
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_line}
        if annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(annotation) is list:  # repeat the flag, or give a JSON list
            kwargs["action"] = "append"
            kwargs["type"] = _list_entries
            (item,) = typing.get_args(annotation)
            kwargs["metavar"] = _metavar(name.removesuffix("s"), item)
        elif typing.get_origin(annotation) is typing.Literal:
            kwargs["choices"] = [str(choice) for choice in typing.get_args(annotation)]
        else:
            kwargs["metavar"] = _metavar(name, annotation)
        if isinstance(field.json_schema_extra, dict) and "metavar" in field.json_schema_extra:
            kwargs["metavar"] = field.json_schema_extra["metavar"]
        parser.add_argument(flag, **kwargs)


def _without_none(annotation: Any) -> Any:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(members) == 1:
            return members[0]
    return annotation


def _list_entries(value: str) -> list[str]:
    """One use of a list flag: a JSON list (as its variable takes), or one entry."""
    if value.lstrip().startswith("["):
        try:
            entries = json.loads(value)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON list: {exc}") from None
        if not isinstance(entries, list) or not all(isinstance(entry, str) for entry in entries):
            raise argparse.ArgumentTypeError("a JSON list of strings is expected")
        return entries
    return [value]


def _metavar(name: str, annotation: Any) -> str:
    """A word a reader understands (``DIR``, ``SECONDS``), not a type expression (``{Path,null}``)."""
    if annotation is Path:
        return "DIR" if name.endswith("_dir") else "PATH"
    if annotation is float:
        for suffix, word in (("_s", "SECONDS"), ("_seconds", "SECONDS"), ("_hours", "HOURS")):
            if name.endswith(suffix):
                return word
        return "NUMBER"
    if annotation is int:
        return "BYTES" if name.endswith("_bytes") else "N"
    return name.upper()


def settings_from(namespace: argparse.Namespace) -> Settings:
    """The flags given, over the ``ROLLOUT_BUFFER_*`` variables, over the defaults; one line per
    bad value on stderr and exit status 2."""
    given = {name: value for name, value in vars(namespace).items() if name in Settings.model_fields}
    for name, value in given.items():
        if isinstance(value, list):  # an appended flag: one list of the entries of each use
            given[name] = [entry for entries in value for entry in entries]
    try:
        return Settings(**given)
    except ValidationError as exc:
        for error in exc.errors():
            field = str(error["loc"][0]) if error["loc"] else ""
            if field in given:
                source = f"--{field.replace('_', '-')} {given[field]}"
            else:
                variable = f"ROLLOUT_BUFFER_{field.upper()}"
                source = f"{variable}={os.environ.get(variable, '')}"
            sys.stderr.write(f"{PROG} serve: {source}: {error['msg']}\n")
        sys.exit(2)


def serve(namespace: argparse.Namespace) -> int:
    import uvicorn

    from buffer.logs import configure_logging
    from buffer.service.app import create_app

    settings = settings_from(namespace)
    configure_logging(settings.log_level, settings.log_format, levels=settings.log_levels())
    # Each write allocates many short-lived objects; collecting the young generation every
    # 50,000 allocations instead of 700 gains some 15% of write throughput. What exists at
    # start-up (imports, settings) is never garbage: keep it out of every collection.
    gc.set_threshold(50_000, 20, 20)
    gc.freeze()
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=None,  # keep the levels configured above, --log-level-for uvicorn.error=... too
        log_config=None,  # and the format
        access_log=settings.access_log,
        timeout_keep_alive=5,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        **_connection_options(settings),
    )

    class Server(uvicorn.Server):
        """uvicorn's server, stopping in the order that loses nothing, well within the 10 s
        ``docker stop`` gives: at SIGTERM or Ctrl-C the jobs' workers stop first, while the port
        is open, so their last writes land (at most ``--worker-grace-s``); then the long polls
        answer at once, uvicorn closes the port and finishes the requests in flight (at most
        ``GRACEFUL_SHUTDOWN_S``), and the app's lifespan closes the journal."""

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM:
                # uvicorn raises a captured signal again once it has shut down, which makes
                # the exit status -15; a stop asked for and done cleanly is a success: 0.
                self._captured_signals.remove(sig)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            services = getattr(app.state, "services", None)
            if services is not None:
                if not self.force_exit:
                    try:
                        await services.jobs.shutdown()
                    except Exception:  # the port closes, and the journal, all the same
                        logging.getLogger(__name__).exception("stopping the jobs failed")
                services.begin_shutdown()
            await super().shutdown(sockets)

    Server(config).run()
    return 0


def _connection_options(settings: Settings) -> dict[str, Any]:
    """uvicorn's HTTP protocol, bounded: headers in size and time, connections in number
    (``buffer.service.connections``). Without httptools, uvicorn's h11 protocol and its own header limit."""
    try:
        from buffer.service import connections
    except ImportError:  # pragma: no cover - uvicorn[standard] brings httptools
        return {"http": "h11", "h11_max_incomplete_event_size": settings.max_header_bytes}
    descriptors = connections.raise_descriptor_limit()
    max_connections = settings.max_connections or connections.default_max_connections()
    logging.getLogger(__name__).info(
        "at most %d connections (open-file limit %d), headers within %d bytes and %g s",
        max_connections,
        descriptors,
        settings.max_header_bytes,
        settings.header_timeout_seconds,
    )
    limits = connections.ConnectionLimits(
        settings.max_header_bytes, settings.header_timeout_seconds, max_connections
    )
    return {"http": connections.guarded_protocol(limits)}


# -- the views of a running buffer (buffer/service/console.py: they load no server code) ----------


def _add_status_arguments(parser: argparse.ArgumentParser) -> None:
    from buffer.service import console

    console.add_status_arguments(parser)


def _add_tail_arguments(parser: argparse.ArgumentParser) -> None:
    from buffer.service import console

    console.add_tail_arguments(parser)


def _run_console(namespace: argparse.Namespace) -> int:
    from buffer.service import console

    return console.run(namespace)


def _add_check_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("data_dir", metavar="DIR", type=Path, help="the service's --data-dir")
    parser.add_argument(
        "--repair", action="store_true", help="rebuild the folder from what can be read; say what was dropped"
    )


def _run_check(namespace: argparse.Namespace) -> int:
    from buffer.store import check as datacheck

    return datacheck.run(namespace.data_dir, repair=namespace.repair)


def _add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    from buffer.workers import remote  # a generator for a buffer elsewhere: no server code

    remote.add_arguments(parser)


def _run_worker(namespace: argparse.Namespace) -> int:
    from buffer.workers import remote

    return remote.run(namespace)


def _add_gateway_arguments(parser: argparse.ArgumentParser) -> None:
    from buffer.service import gateway_process

    add_serve_arguments(parser)  # the service's flags: --port, --data-dir, --host, ...
    gateway_process.add_arguments(parser)


def _run_gateway(namespace: argparse.Namespace) -> int:
    from buffer.service import gateway_process

    return gateway_process.run(settings_from(namespace), namespace)


COMMANDS: tuple[Command, ...] = (
    Command("serve", "run the rollout buffer service (the default)", add_serve_arguments, serve),
    Command(
        "status",
        "a running buffer's tasks, jobs, rates and failed generators",
        _add_status_arguments,
        _run_console,
    ),
    Command("tail", "follow the trajectories a running buffer receives", _add_tail_arguments, _run_console),
    Command("check", "check a data folder, and with --repair salvage it", _add_check_arguments, _run_check),
    Command("worker", "run a generator here for a buffer elsewhere", _add_worker_arguments, _run_worker),
    Command(
        "gateway",
        "the recording gateway in processes of its own, writing to a buffer elsewhere",
        _add_gateway_arguments,
        _run_gateway,
    ),
)


def _simulator(argv: list[str], prog: str) -> int:
    from buffer.simulator.cli import main as simulate

    simulate(argv, prog)
    return 0


def _demo(argv: list[str], prog: str) -> int:
    from buffer import demo

    return demo.main(argv, prog)


PROGRAMS: tuple[Program, ...] = (
    Program("simulator", "the simulated policy server (SGLang or vLLM; the sim extra)", _simulator),
    Program("demo", "the example run: a policy server, this buffer, a trainer polling it", _demo),
)
