"""``torchtop report``: a recording summarized as text or JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from torchtop.commands.core import (
    VERB_HELP,
    CliError,
    Subparsers,
)
from torchtop.report.job import render_text, summarize
from torchtop.report.run import is_multi_rank, ranks_parts, summarize_ranks
from torchtop.streams.recording import RecordingError, read_recording


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    report = sub.add_parser(
        "report",
        help=VERB_HELP["report"],
        description="Summarize a recording: duration, samples, peaks, phases, exit.",
    )
    report.add_argument("file", type=Path)
    report.add_argument("--json", action="store_true", help="print JSON (keys in the README)")
    return report


def run(args: argparse.Namespace) -> int:

    try:
        contents = read_recording(args.file)
    except RecordingError as exc:
        raise CliError(str(exc), code=1) from None
    if is_multi_rank(contents.sources):
        report = summarize_ranks(contents.messages, contents.sources)
    else:
        report = summarize(contents.messages)
    report["recording"] = {
        "path": str(args.file),
        "skipped_frames": contents.skipped,
        "truncated": contents.truncated,
        "end_byte": contents.end_byte,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        from rich.console import Console, Group

        Console().print(Group(render_text(report), *ranks_parts(report)))
    return 0
