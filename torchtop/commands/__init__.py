"""The ``torchtop`` command line: one module per verb, on a small shared core (:mod:`.core`).

``main(argv) -> int`` returns the exit code. Each verb's module has ``add_parser(subparsers)``
and ``run(args) -> int``: it parses, calls into the layers above (:mod:`torchtop.streams`,
:mod:`torchtop.report`, :mod:`torchtop.export`, :mod:`torchtop.attach`, :mod:`torchtop.tui`)
and maps their expected errors to :class:`~torchtop.commands.core.CliError`, printed as one line
with an exit code. Only the verb that runs is imported (``torchtop --help`` lists the verbs from
:data:`~torchtop.commands.core.VERB_HELP` and imports none), so a verb's module imports the
layers it drives at its top; Textual, psutil and the exporters' libraries, which cost a
fraction of a second, are imported where a verb's path needs them (the viewer, not
``--headless``).

May import: every other package of torchtop. Nothing imports this one but ``__main__``; the
viewer (:mod:`torchtop.tui`) is started from here, never the other way round.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
from types import ModuleType

from torchtop.commands.core import (
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    VERB_HELP,
    CliError,
    Parser,
    version_line,
)
from torchtop.text import printable

DESCRIPTION = """\
A terminal monitor for PyTorch training: GPU and allocator memory, host load, phases and the
job's output, live or from a recording.

examples:
  torchtop run train.py --lr 3e-4        watch a training script live
  torchtop run --headless --record r.ttr train.py
  torchtop attach                        watch a job that called torchtop.start()
  torchtop attach PID                    watch a job started without torchtop
  torchtop attach --node node2           the ranks of this node and of node2 (over ssh)
  torchtop report r.ttr --json           summarize a recording
  torchtop compare before.ttr after.ttr  what changed between two recordings
  torchtop run --metrics 9481 train.py   serve Prometheus metrics while it runs
  torchtop export                        serve every running job's metrics on 127.0.0.1:9481
  torchtop demo broadcasting             learn a practice, measured live
"""


def verb(name: str) -> ModuleType:
    """The module of the verb ``name``: ``add_parser(subparsers)`` and ``run(args) -> int``."""
    return importlib.import_module(f"torchtop.commands.{name}")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser. Every verb is listed; only ``only`` (the verb that runs)
    gets its options, so no other verb's module is imported."""
    parser = Parser(
        prog="torchtop",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name, line in VERB_HELP.items():
        if name == only:
            verb(name).add_parser(sub)
        else:
            sub.add_parser(name, help=line, add_help=False)
    return parser


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices[name]
            return found
    raise KeyError(name)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The parsed command line; :class:`CliError` for one it does not accept."""
    name = argv[0] if argv and argv[0] in VERB_HELP else None
    parser = build_parser(name)
    if name == "run":
        # argparse would take the job's own options for ours: split the job off first.
        options, target = verb("run").split_run_argv(_subparser(parser, "run"), argv[1:])
        args = parser.parse_args(["run", *options])
        args.target = target
        return args
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    try:
        return run_command(argv)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def run_command(argv: list[str] | None = None) -> int:
    """:func:`main`, except that Ctrl-C (at torchtop, or the job's death by it) propagates as
    :class:`KeyboardInterrupt`."""
    try:
        args = parse_args(sys.argv[1:] if argv is None else list(argv))
        if args.command is None:
            build_parser().print_help()
            return EXIT_USAGE
        return int(verb(args.command).run(args))
    except CliError as exc:
        # The line may quote a job, a file or a peer: its escapes are shown, never obeyed.
        print(f"torchtop: {printable(str(exc))}", file=sys.stderr)
        return exc.code
    except BrokenPipeError:
        # `torchtop report x | head`: the reader went away; that is not an error.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def main_entry() -> None:
    try:
        code = run_command()
    except KeyboardInterrupt:
        # End as Python ends on Ctrl-C: by SIGINT, so a shell's `torchtop ...; next` stops too.
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = EXIT_INTERRUPTED
    sys.exit(code)
