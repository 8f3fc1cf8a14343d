"""``torchtop export``: serve running jobs' figures to Prometheus or push them over OTLP."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING

from torchtop.attach.inject import CHECK_PID
from torchtop.commands.core import (
    VERB_HELP,
    CliError,
    Subparsers,
    add_export_options,
    check_runtime_dir,
    positive_float,
)
from torchtop.export.service import Exporter
from torchtop.streams.discovery import Agents
from torchtop.text import printable
from torchtop.transport import find_agent, list_agents

if TYPE_CHECKING:
    from torchtop.export.service import AgentFilter


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    export = sub.add_parser(
        "export",
        help=VERB_HELP["export"],
        description="Follow the running agents of this user on this node (every one, one PID, "
        "or the ranks of one RUN) and serve their figures for Prometheus (default "
        "127.0.0.1:9481) and/or push them over OTLP. Jobs that start later are picked up. "
        "Runs until interrupted; with a PID, until that job ends.",
    )
    export.add_argument(
        "target", nargs="?", metavar="PID | RUN", help="one job's pid, or a run id (default: all)"
    )
    add_export_options(export)
    export.add_argument(
        "--duration",
        metavar="S",
        type=positive_float,
        help="stop after S seconds (default: until interrupted)",
    )
    return export


def run(args: argparse.Namespace) -> int:

    from torchtop.export.prometheus import DEFAULT_HOST, DEFAULT_PORT

    check_runtime_dir()
    if args.metrics is None and args.otlp is None:
        args.metrics = (DEFAULT_HOST, DEFAULT_PORT)
    pid, run = _export_target(args.target)
    exporter = start_exporter(args, Agents(pid=pid), run)
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    if args.duration is not None:
        timer = threading.Timer(args.duration, stop.set)
        timer.daemon = True
        timer.start()
    try:
        while not stop.wait(0.5):
            if pid is not None and find_agent(pid) is None and exporter.jobs.all_ended():
                break  # the one job followed has ended
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        exporter.close()
    return 0


def _export_target(target: str | None) -> tuple[int | None, str | None]:
    """The PID or the run id ``torchtop export TARGET`` follows, checked before serving: a PID
    no running agent answers to is one line, not a server that waits forever; a run that has
    no job yet is said, then waited for."""

    if target is None:
        return None, None
    if target.isdigit() and find_agent(int(target)) is not None:
        return int(target), None
    if any(map(Agents(run=target), list_agents())):
        return None, target  # the ranks of a run
    if target.isdigit():
        pid = int(target)
        if not os.path.exists(f"/proc/{pid}"):
            raise CliError(f"no process {pid} is running: {CHECK_PID}", code=1)
        raise CliError(
            f"pid {pid} runs without torchtop's agent, so there is nothing to export: start one "
            f"in it with `torchtop attach {pid}`, or start the job with `torchtop run --metrics "
            "HOST:PORT SCRIPT`",
            code=1,
        )
    # A run's ranks may start after its exporter (a platform's exporter set up before the job):
    # say that nothing of it runs yet, then wait for it.
    print(
        f"torchtop: no job of run {printable(target, one_line=True)} is running yet: its "
        "metrics are served as its ranks start (`torchtop ps` lists the runs, in the RUN "
        "column; Ctrl-C stops)",
        file=sys.stderr,
    )
    return None, target


def start_exporter(
    args: argparse.Namespace, accept: AgentFilter, run: str | None = None
) -> Exporter:
    from torchtop.export.otlp import OtlpUnavailable
    from torchtop.export.prometheus import MetricsError

    try:
        exporter = Exporter(
            accept,
            metrics=args.metrics,
            otlp=args.otlp,
            otlp_interval_s=args.otlp_interval,
            run=run,
        )
    except (MetricsError, OtlpUnavailable) as exc:
        raise CliError(str(exc), code=1) from None
    exporter.announce()
    return exporter.start()
