"""``torchtop compare``: two recordings, before and after, and what changed beyond noise."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from torchtop.commands.core import VERB_HELP, CliError, Subparsers
from torchtop.model.compare import step_samples
from torchtop.protocol import Message
from torchtop.report.compare import CompareError, Side, compare, fold_recording, render_text
from torchtop.streams.feed import AgentFeed
from torchtop.streams.recording import RecordingError, read_recording
from torchtop.transport import find_agent

#: A running job is read for its agent's history and then this long.
LIVE_READ_S = 2.0
#: Fewer timed steps than this from a running job are too few to compare.
LIVE_MIN_STEPS = 20


def _live_side(pid: int, read_s: float) -> Side:
    """A running job's steps so far, from its agent's history (as ``attach`` reads it)."""
    info = find_agent(pid)
    if info is None:
        raise CliError(
            f"B: {pid} is neither a recording nor a process with a running agent "
            "(see `torchtop ps`)",
            code=1,
        )
    messages: list[Message] = []
    feed = AgentFeed(address=info.address, on_message=messages.append, client="compare")
    feed.start()
    time.sleep(max(0.0, read_s))
    feed.close()
    feed.join(5.0)
    side = fold_recording(f"pid {pid}", list(messages), [None] * len(messages))
    steps = len(step_samples(side.jobs[0].training))
    if steps < LIVE_MIN_STEPS:
        raise CliError(
            f"pid {pid} has {steps} timed steps so far; a comparison needs at least "
            f"{LIVE_MIN_STEPS}: let it run longer and compare again",
            code=1,
        )
    return side


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
    compare.add_argument(
        "b",
        metavar="B",
        help="the recording after, or the PID of a running job (its steps so far)",
    )
    compare.add_argument(
        "--live-s",
        type=float,
        default=LIVE_READ_S,
        metavar="S",
        help=f"with a running job: seconds to read it after its history (default {LIVE_READ_S})",
    )
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
    for path in (args.a, Path(args.b)):
        if path is not args.a and args.b.isdigit() and not path.exists():
            sides.append(_live_side(int(args.b), args.live_s))
            continue
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
