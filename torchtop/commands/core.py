"""The small core every verb shares: the one-line error, the parser that raises it, option
types and the option groups of the agent, and the viewer's entry."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeAlias

from torchtop.protocol import DEFAULT_INTERVAL_S, DEFAULT_OPS_BUDGET

if TYPE_CHECKING:
    from textual.app import App

    from torchtop.report.exit_summary import JobEnd
    from torchtop.streams.runs import RunFold


EXIT_USAGE = 2


#: What a shell reports for a process that died by SIGINT.
EXIT_INTERRUPTED = 128 + 2


class CliError(Exception):
    """An expected failure: printed as one line, exit code 2 unless given."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise CliError(f"{message} (see `{self.prog} --help`)")


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def add_agent_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--headless",
        action="store_true",
        help="no viewer; the job's output passes straight through",
    )
    p.add_argument(
        "--record",
        metavar="FILE",
        type=Path,
        help="save the stream to FILE (.ttr) for replay and report",
    )
    p.add_argument(
        "--interval",
        metavar="S",
        type=positive_float,
        default=DEFAULT_INTERVAL_S,
        help=f"seconds between memory and host samples (default {DEFAULT_INTERVAL_S:g})",
    )
    p.add_argument(
        "--nvml-interval",
        metavar="S",
        type=positive_float,
        default=0.5,
        help="seconds between NVML reads (default 0.5)",
    )
    p.add_argument("--no-nvml", action="store_true", help="do not read GPUs through NVML")
    p.add_argument(
        "--hang-after",
        metavar="S",
        type=positive_float,
        default=os.environ.get("TORCHTOP_HANG_AFTER", "30"),
        help="a job with no step for S seconds (or 10 median steps, if longer) is stuck: its "
        "training thread's stack is sent (default 30, or $TORCHTOP_HANG_AFTER)",
    )
    p.add_argument(
        "--cost-budget",
        metavar="PCT",
        type=budget_type,
        default=1.0,
        help="share of the job's step time torchtop's agent may use, in percent (default 1; "
        "0: no budget); its op windows get what the rest of its cost leaves (up to "
        "--ops-budget); above it the agent samples less often and says so",
    )


#: Each verb, in ``torchtop --help``'s order, with its line there (its module in this package).
VERB_HELP = {
    "run": "run a script with the agent inside and watch it",
    "ps": "list running agents",
    "attach": "watch a running job (its agent, or one started in it now)",
    "relay": "serve this node's agents to a viewer on another machine",
    "export": "serve running jobs' metrics to Prometheus or OpenTelemetry",
    "replay": "view a recording",
    "doctor": "what torchtop can and cannot see on this machine",
    "report": "summarize a recording",
    "compare": "compare two recordings: what changed, beyond noise",
    "demo": "run a bundled demo of a PyTorch practice",
}

#: What ``add_subparsers`` returns: each verb adds its parser to it.
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def parsed_by(module: str, name: str, label: str) -> Callable[[str], Any]:
    """An argparse type that calls ``module.name`` (imported on use: the CLI starts fast) and
    turns its ValueError into argparse's one-line usage error."""

    def parse(text: str) -> Any:
        try:
            return getattr(importlib.import_module(module), name)(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = label  # argparse names the type in "invalid <label> value"
    return parse


metrics_address = parsed_by("torchtop.export.prometheus", "parse_address", "address")


size_type = parsed_by("torchtop.sizes", "parse_size", "size")


def add_export_options(p: argparse.ArgumentParser) -> None:
    """Prometheus and OpenTelemetry export (README: "Metrics for Prometheus and OpenTelemetry")."""
    p.add_argument(
        "--metrics",
        metavar="[ADDR:]PORT",
        type=metrics_address,
        help="serve Prometheus metrics at http://ADDR:PORT/metrics (ADDR 127.0.0.1 unless "
        "given; port 0 picks a free one, printed)",
    )
    p.add_argument(
        "--otlp",
        metavar="ENDPOINT",
        help="push the same metrics to an OTLP/HTTP collector, e.g. http://localhost:4318 "
        "(needs pip install 'torchtop[otel]')",
    )
    p.add_argument(
        "--otlp-interval",
        metavar="S",
        type=positive_float,
        default=10.0,
        help="seconds between OTLP pushes (default 10)",
    )


def add_oom_options(p: argparse.ArgumentParser) -> None:
    """Out-of-memory capture and the CPU memory-limit emulation (README: "Out of memory")."""
    p.add_argument(
        "--memory-limit",
        metavar="SIZE",
        type=size_type,
        help="emulate a device of SIZE (e.g. 256MiB, 2GiB) for a CPU job: tensors past it "
        "raise torch.OutOfMemoryError (emulated), captured like a CUDA OOM",
    )
    p.add_argument(
        "--pause-on-oom",
        action="store_true",
        help="hold the job at an OOM until the OOM screen is dismissed (or --pause-timeout)",
    )
    p.add_argument(
        "--pause-timeout",
        metavar="S",
        type=positive_float,
        default=300.0,
        help="with --pause-on-oom: resume after S seconds (default 300)",
    )
    p.add_argument(
        "--no-oom-capture",
        action="store_true",
        help="do not record CUDA allocator history or capture OOMs",
    )
    p.add_argument(
        "--oom-history",
        metavar="N",
        type=count_type,
        default=10_000,
        help="allocator history entries kept for OOM snapshots (default 10000; 0: live only)",
    )


def add_ops_options(p: argparse.ArgumentParser) -> None:
    """Sampled torch.profiler windows (README: "Op timings")."""
    p.add_argument(
        "--no-ops",
        action="store_true",
        help="do not sample op timings (torch.profiler windows)",
    )
    p.add_argument(
        "--profile-shapes",
        action="store_true",
        help="op windows record input shapes and split ops by them (costs more per window)",
    )
    p.add_argument(
        "--profile-stack",
        action="store_true",
        help="op windows record the script's call site of each op (costs more per window)",
    )
    p.add_argument(
        "--ops-budget",
        metavar="PCT",
        type=percent_type,
        default=DEFAULT_OPS_BUDGET * 100,
        help=f"share of the job's time op windows may cost, in percent (default"
        f" {DEFAULT_OPS_BUDGET * 100:g}); less where the rest of the agent's cost leaves less"
        " of --cost-budget (a fifth of it at least); their spacing adapts to what they measured",
    )
    p.add_argument(
        "--ops-window",
        metavar="STEPS",
        type=positive_count,
        default=2,
        help="training steps per op window (default 2)",
    )


def percent_type(text: str) -> float:
    try:
        value = float(text.rstrip("%"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage, got {text!r}") from None
    if not 0 < value <= 50:
        raise argparse.ArgumentTypeError(f"must be above 0 and at most 50, got {text}")
    return value


def budget_type(text: str) -> float:
    """A percentage from 0 (no budget) to 50."""
    if text.rstrip("%").strip() in ("0", "0.0"):
        return 0.0
    return percent_type(text)


def positive_count(text: str) -> int:
    value = count_type(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def ops_agent_options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "ops": not args.no_ops,
        "profile_shapes": args.profile_shapes,
        "profile_stack": args.profile_stack,
        "ops_budget": args.ops_budget / 100.0,
        "ops_window_steps": args.ops_window,
    }


def count_type(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {text}")
    return value


def oom_agent_options(args: argparse.Namespace) -> dict[str, Any]:
    """The agent options of the OOM flags. Snapshots go next to the recording, named after it
    (``r.ttr`` → ``r.oom-1.pickle``); without one, to the agent's runtime directory
    (``<pid>-oom-1.pickle``)."""
    options: dict[str, Any] = {
        "oom_capture": not args.no_oom_capture,
        "oom_history_entries": args.oom_history,
        "memory_limit_bytes": args.memory_limit,
        "pause_on_oom": args.pause_on_oom,
        "pause_timeout_s": args.pause_timeout,
    }
    if args.record is not None:
        record = Path(args.record).resolve()
        options["snapshot_dir"] = str(record.parent)
        options["snapshot_prefix"] = f"{record.stem}."
    return options


def version_line() -> str:
    from torchtop import __version__

    return f"torchtop {__version__}"


def require_terminal(alternative: str) -> None:
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise CliError(f"the viewer needs a terminal; without one use `{alternative}`")


def run_app(app: App[Any]) -> int:
    result = app.run()
    return int(result) if isinstance(result, int) else 0


def check_runtime_dir() -> None:
    """Refuse, in one line, a socket directory that is not the user's own private folder
    (another user may have made it first), before anything in it is read."""
    from torchtop.transport import TransportError, existing_runtime_dir

    try:
        existing_runtime_dir()
    except TransportError as exc:
        raise CliError(str(exc), code=1) from None


def print_exit_summary(end: JobEnd) -> None:
    from torchtop.report.exit_summary import exit_summary

    for line in exit_summary(end):
        print(line, file=sys.stderr)


def view_run(run: RunFold, title: str) -> None:
    """The view of a run's ranks until it quits; ``enter`` on a rank opens that rank's full
    screens (a job screen on its agent), whose ``q`` comes back to the run."""
    from torchtop.streams.sources import attach_rank
    from torchtop.tui.app import TorchtopApp

    run_app(TorchtopApp.for_run(run, title, open_rank=attach_rank))
