"""``torchtop replay``: a recording in the viewer."""

from __future__ import annotations

import argparse
from pathlib import Path

from torchtop.commands.core import (
    VERB_HELP,
    CliError,
    Subparsers,
    positive_float,
    require_terminal,
    run_app,
)
from torchtop.streams.recording import RecordingError, read_recording
from torchtop.streams.sources import RecordingSource


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    replay = sub.add_parser(
        "replay",
        help=VERB_HELP["replay"],
        description="The viewer over a recording: space plays or pauses, e jumps to the end.",
    )
    replay.add_argument("file", type=Path)
    replay.add_argument(
        "--speed", type=positive_float, default=1.0, help="playback speed (default 1)"
    )
    replay.add_argument(
        "--against",
        type=Path,
        metavar="B",
        help="a second recording drawn against this one: its step time and data wait over "
        "this one's, aligned by step, and what changed beyond noise (torchtop compare's verdict)",
    )
    return replay


def run(args: argparse.Namespace) -> int:

    try:
        contents = read_recording(args.file)
    except RecordingError as exc:
        raise CliError(str(exc), code=1) from None
    b = None
    if args.against is not None:
        try:
            b = read_recording(args.against)
        except RecordingError as exc:
            raise CliError(str(exc), code=1) from None
    require_terminal(f"torchtop report {args.file}")
    from torchtop.tui.app import TorchtopApp

    against = None
    if b is not None:
        from torchtop.report.run import is_multi_rank
        from torchtop.tui.widgets.compare import against as compared
        from torchtop.tui.widgets.compare import fold_messages

        # The whole of A against the whole of B: the verdict torchtop compare gives.
        a = fold_messages(contents.messages)
        multi = is_multi_rank(contents.sources) or is_multi_rank(b.sources)
        against = compared(str(args.against), a, b.messages, multi)
    source = RecordingSource(contents.messages, speed=args.speed)
    return run_app(TorchtopApp(source, title=str(args.file), against=against))
