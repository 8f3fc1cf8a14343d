"""``torchtop compare``: two recordings, before and after, and what changed beyond noise."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from torchtop.commands.core import VERB_HELP, CliError, Subparsers
from torchtop.report.compare import CompareError, compare, fold_recording, render_text
from torchtop.streams.recording import RecordingError, read_recording


def _steps(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of steps: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a number of steps is 0 or more, not {value}")
    return value


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    compare = sub.add_parser(
        "compare",
        help=VERB_HELP["compare"],
        description=(
            "Compare two recordings of a job, A (before) and B (after): step time with an "
            "interval for the difference, throughput, data wait, memory, top ops and "
            "findings, aligned by step after the warm-up."
        ),
    )
    compare.add_argument("a", type=Path, metavar="A", help="the recording before")
    compare.add_argument("b", type=Path, metavar="B", help="the recording after")
    compare.add_argument("--json", action="store_true", help="print JSON (keys in docs/report.md)")
    compare.add_argument(
        "--skip-steps",
        type=_steps,
        default=None,
        metavar="N",
        help="leave out the first N steps of each run (default: the warm-up, detected)",
    )
    return compare


def run(args: argparse.Namespace) -> int:

    sides = []
    for path in (args.a, args.b):
        try:
            contents = read_recording(path)
        except RecordingError as exc:
            raise CliError(str(exc), code=1) from None
        sides.append(fold_recording(str(path), contents.messages, contents.sources))
    try:
        report = compare(sides[0], sides[1], args.skip_steps)
    except CompareError as exc:
        raise CliError(str(exc), code=1) from None
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        from rich.console import Console

        Console().print(render_text(report))
    return 0
