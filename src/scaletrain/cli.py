"""The `scaletrain` command line: train | plan | scaling | config | sample | demo | report ...

Each subcommand is a module of `scaletrain.commands` exposing `add_parser(subparsers)`, which registers its
arguments and sets `func(args) -> int`. This file only dispatches and turns user errors
(`scaletrain.errors.UserError`) into a one-line message and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import sys

from scaletrain.commands.parser import Parser
from scaletrain.errors import Stopped, UserError, disk_full, disk_full_line

# (module that owns the subcommand). Modules are imported only if they exist in this install.
COMMAND_MODULES = (
    "scaletrain.commands.train",
    "scaletrain.commands.checkpoint",
    "scaletrain.commands.plan",
    "scaletrain.commands.scaling",
    "scaletrain.commands.report",
    "scaletrain.commands.verify",
    "scaletrain.commands.launch_info",
    "scaletrain.commands.replay",
    "scaletrain.commands.data",
)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="scaletrain", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name in COMMAND_MODULES:
        if importlib.util.find_spec(name) is None:
            continue
        importlib.import_module(name).add_parser(sub)
    return parser


def _version() -> str:
    from scaletrain.version import __version__

    return f"scaletrain {__version__}"


def main(argv: list[str] | None = None) -> int:
    for stream in (sys.stdout, sys.stderr):  # a path that is not UTF-8 (`--out $'r\\xff'`) prints as its bytes, as
        with contextlib.suppress(AttributeError, ValueError):  # ls does, instead of a UnicodeEncodeError mid-run
            stream.reconfigure(errors="surrogateescape")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        sys.stderr.write(f"scaletrain: error: {_missing_command(parser, args)}\n")
        return 2
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe (`scaletrain config show | head`) shows here, not at exit
        return code
    except BrokenPipeError:  # the reader went away: stop quietly, as a shell tool killed by SIGPIPE does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except UserError as e:
        sys.stderr.write(_printable(f"scaletrain: error: {e}\n"))
        return e.exit_code
    except Stopped as e:
        import signal

        sys.stderr.write(f"scaletrain: stopped by {signal.Signals(e.signum).name}; the ranks were stopped\n")
        return 128 + e.signum
    except KeyboardInterrupt:
        sys.stderr.write("scaletrain: interrupted\n")
        return 130
    except Exception as e:  # a write anywhere that ran out of space: one line, exit 1 (errors.disk_full)
        if not disk_full(e):
            raise
        sys.stderr.write(f"scaletrain: error: {disk_full_line(e)}\n")
        return 1


def _printable(text: str) -> str:
    """`text` with the bytes of names that are not UTF-8 shown as \\xNN (as guards.shown does), never as \\udcNN."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _missing_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The one line for a command line that stops before its (sub)command: what to add, and the choices."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = getattr(args, action.dest, None)
            if chosen is None:
                return f"'{parser.prog}' needs one of: {', '.join(action.choices)} (see '{parser.prog} --help')"
            return _missing_command(action.choices[chosen], args)
    return f"'{parser.prog}' is incomplete (see '{parser.prog} --help')"


if __name__ == "__main__":
    raise SystemExit(main())
