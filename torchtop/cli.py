"""The ``torchtop`` command line. ``main(argv) -> int`` returns the exit code.

Each subcommand imports what it needs when it runs, so ``torchtop --help`` starts in a blink and
nothing here imports torch. Expected failures print one line naming the problem and the fix.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from torchtop.text import printable

EXIT_USAGE = 2
#: What a shell reports for a process that died by SIGINT.
EXIT_INTERRUPTED = 128 + 2

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
  torchtop run --metrics 9481 train.py   serve Prometheus metrics while it runs
  torchtop export                        serve every running job's metrics on 127.0.0.1:9481
  torchtop demo broadcasting             learn a practice, measured live
"""


class CliError(Exception):
    """An expected failure: printed as one line, exit code 2 unless given."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise CliError(f"{message} (see `{self.prog} --help`)")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _add_agent_options(p: argparse.ArgumentParser) -> None:
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
        type=_positive_float,
        default=0.1,
        help="seconds between memory and host samples (default 0.1)",
    )
    p.add_argument(
        "--nvml-interval",
        metavar="S",
        type=_positive_float,
        default=0.5,
        help="seconds between NVML reads (default 0.5)",
    )
    p.add_argument("--no-nvml", action="store_true", help="do not read GPUs through NVML")
    p.add_argument(
        "--hang-after",
        metavar="S",
        type=_positive_float,
        default=os.environ.get("TORCHTOP_HANG_AFTER", "30"),
        help="a job with no step for S seconds (or 10 median steps, if longer) is stuck: its "
        "training thread's stack is sent (default 30, or $TORCHTOP_HANG_AFTER)",
    )


def _parsed_by(module: str, name: str, label: str) -> Callable[[str], Any]:
    """An argparse type that calls ``module.name`` (imported on use: the CLI starts fast) and
    turns its ValueError into argparse's one-line usage error."""

    def parse(text: str) -> Any:
        try:
            return getattr(importlib.import_module(module), name)(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = label  # argparse names the type in "invalid <label> value"
    return parse


_metrics_address = _parsed_by("torchtop.export.prometheus", "parse_address", "address")
_size = _parsed_by("torchtop.sizes", "parse_size", "size")


def _add_export_options(p: argparse.ArgumentParser) -> None:
    """Prometheus and OpenTelemetry export (README: "Metrics for Prometheus and OpenTelemetry")."""
    p.add_argument(
        "--metrics",
        metavar="[ADDR:]PORT",
        type=_metrics_address,
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
        type=_positive_float,
        default=10.0,
        help="seconds between OTLP pushes (default 10)",
    )


def _add_oom_options(p: argparse.ArgumentParser) -> None:
    """Out-of-memory capture and the CPU memory-limit emulation (README: "Out of memory")."""
    p.add_argument(
        "--memory-limit",
        metavar="SIZE",
        type=_size,
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
        type=_positive_float,
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
        type=_count,
        default=10_000,
        help="allocator history entries kept for OOM snapshots (default 10000; 0: live only)",
    )


def _add_ops_options(p: argparse.ArgumentParser) -> None:
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
        type=_percent,
        default=2.0,
        help="share of the job's time op windows may cost, in percent (default 2); "
        "their spacing adapts to what they measured",
    )
    p.add_argument(
        "--ops-window",
        metavar="STEPS",
        type=_positive_count,
        default=2,
        help="training steps per op window (default 2)",
    )


def _percent(text: str) -> float:
    try:
        value = float(text.rstrip("%"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage, got {text!r}") from None
    if not 0 < value <= 50:
        raise argparse.ArgumentTypeError(f"must be above 0 and at most 50, got {text}")
    return value


def _positive_count(text: str) -> int:
    value = _count(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def _ops_agent_options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "ops": not args.no_ops,
        "profile_shapes": args.profile_shapes,
        "profile_stack": args.profile_stack,
        "ops_budget": args.ops_budget / 100.0,
        "ops_window_steps": args.ops_window,
    }


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {text}")
    return value


def _oom_agent_options(args: argparse.Namespace) -> dict[str, Any]:
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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="torchtop",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    run = sub.add_parser(
        "run",
        help="run a script with the agent inside and watch it",
        description="Run an unchanged training script (or -m MODULE) with the agent inside.",
        usage=(
            "torchtop run [options] SCRIPT [ARGS...]\n"
            "       torchtop run [options] -m MODULE [ARGS...]"
        ),
    )
    _add_agent_options(run)
    _add_oom_options(run)
    _add_ops_options(run)
    _add_export_options(run)
    run.add_argument("-m", dest="module", metavar="MODULE", help="run a module, as python -m does")
    run.add_argument("target", nargs="*", metavar="SCRIPT [ARGS...]")

    ps = sub.add_parser(
        "ps", help="list running agents", description="List the running agents of this user."
    )
    ps.add_argument("--json", action="store_true", help="print a JSON list")

    attach = sub.add_parser(
        "attach",
        help="watch a running job (its agent, or one started in it now)",
        description="Attach the viewer (or a headless recorder) to a running job. A Python job "
        "started without torchtop gets an agent started in it (gdb on Python 3.10-3.13, "
        "sys.remote_exec on 3.14+); the viewer asks first.",
    )
    attach.add_argument(
        "pid", nargs="?", type=int, help="the job's pid (default: the only agent, or pick one)"
    )
    attach.add_argument(
        "--yes",
        action="store_true",
        help="start an agent in a job that has none without asking",
    )
    attach.add_argument(
        "--python-path",
        metavar="DIRS",
        help="directories (':'-separated) the job's Python can import torchtop from, when its "
        "environment has none (the refusal names them)",
    )
    attach.add_argument(
        "--headless", action="store_true", help="record without a viewer (needs --record)"
    )
    attach.add_argument("--record", metavar="FILE", type=Path, help="save the stream to FILE")
    attach.add_argument(
        "--duration",
        metavar="S",
        type=_positive_float,
        help="with --headless: stop after S seconds (default: until the job ends)",
    )
    nodes = attach.add_argument_group(
        "several nodes",
        "Show the ranks of other nodes beside this machine's, each node's through its relay "
        "(`torchtop relay`); with --headless --record FILE, record them all in one file. See "
        "README, Several nodes.",
    )
    nodes.add_argument(
        "--node",
        action="append",
        metavar="HOST | tcp://ADDR:PORT",
        help="another node's ranks (repeatable): HOST is an ssh destination (the viewer runs "
        "`ssh HOST torchtop relay`; nothing listens there), tcp://ADDR:PORT a `torchtop relay "
        "--listen` there (needs --token-file)",
    )
    nodes.add_argument(
        "--run",
        metavar="ID",
        help="only the ranks of this run (TORCHELASTIC_RUN_ID), here and on every node",
    )
    nodes.add_argument(
        "--ssh-command",
        metavar="CMD",
        help="the command that reaches a node, the host and the remote command appended "
        "(default: $TORCHTOP_SSH, else `ssh -T -o BatchMode=yes -o ServerAliveInterval=15 "
        "-o ServerAliveCountMax=4`)",
    )
    nodes.add_argument(
        "--remote-torchtop",
        metavar="CMD",
        default="torchtop",
        help="how the nodes' shell runs torchtop (default: torchtop; e.g. "
        "`~/venv/bin/torchtop` or `python3 -m torchtop`)",
    )
    nodes.add_argument(
        "--token-file",
        metavar="FILE",
        type=Path,
        help="the token of the tcp:// nodes' relays (a copy of the file `torchtop relay "
        "--listen` wrote)",
    )

    relay = sub.add_parser(
        "relay",
        help="serve this node's agents to a viewer on another machine",
        description="Serve this node's agents to a viewer elsewhere (`torchtop attach --node`): "
        "their frames, each tagged with its agent, new agents as they start. Without --listen "
        "it speaks on stdin/stdout, as `ssh HOST torchtop relay` runs it, and ends when they "
        "close; nothing listens. With --listen it serves TCP, only to viewers with its token: "
        "for trusted networks only, since the viewer cannot tell the relay from anyone else "
        "listening at that address (over ssh, the default, ssh authenticates both ends).",
    )
    relay.add_argument(
        "--run", metavar="ID", help="only the ranks of this run (default: every agent here)"
    )
    relay.add_argument(
        "--listen",
        metavar="[ADDR:]PORT",
        help="serve over TCP on ADDR:PORT (default ADDR 127.0.0.1, this machine only; another "
        "address, such as 0.0.0.0, only when named; PORT 0 takes a free one) until interrupted",
    )
    relay.add_argument(
        "--token-file",
        metavar="FILE",
        type=Path,
        help="with --listen: the token viewers must present, read from FILE (made there, "
        "0600, if missing; default: a new one in the runtime directory, relay-PORT.token)",
    )

    export = sub.add_parser(
        "export",
        help="serve running jobs' metrics to Prometheus or OpenTelemetry",
        description="Follow the running agents of this user on this node (every one, one PID, "
        "or the ranks of one RUN) and serve their figures for Prometheus (default "
        "127.0.0.1:9481) and/or push them over OTLP. Jobs that start later are picked up. "
        "Runs until interrupted; with a PID, until that job ends.",
    )
    export.add_argument(
        "target", nargs="?", metavar="PID | RUN", help="one job's pid, or a run id (default: all)"
    )
    _add_export_options(export)
    export.add_argument(
        "--duration",
        metavar="S",
        type=_positive_float,
        help="stop after S seconds (default: until interrupted)",
    )

    replay = sub.add_parser(
        "replay",
        help="view a recording",
        description="The viewer over a recording: space plays or pauses, e jumps to the end.",
    )
    replay.add_argument("file", type=Path)
    replay.add_argument(
        "--speed", type=_positive_float, default=1.0, help="playback speed (default 1)"
    )

    doctor = sub.add_parser(
        "doctor",
        help="what torchtop can and cannot see on this machine",
        description="Check this machine for torchtop: Python, torch and its CUDA devices, NVML, "
        "the runtime directory, attach (gdb, ptrace), the exporters, the terminal and "
        "torch.distributed. One line each, with the fix for what is missing.",
    )
    doctor.add_argument(
        "--json", action="store_true", help="print JSON (for scripts and bug reports)"
    )
    doctor.add_argument(
        "--timeout",
        type=_positive_float,
        default=30.0,
        metavar="SECONDS",
        help="how long `import torch` may take in the check (default 30)",
    )

    report = sub.add_parser(
        "report",
        help="summarize a recording",
        description="Summarize a recording: duration, samples, peaks, phases, exit.",
    )
    report.add_argument("file", type=Path)
    report.add_argument("--json", action="store_true", help="print JSON (keys in the README)")

    demo = sub.add_parser(
        "demo",
        help="run a bundled demo of a PyTorch practice",
        description="Run a demo: the same job done the slow way and the fast way, measured.",
    )
    demo.add_argument("name", nargs="?", help="the demo to run (see --list)")
    demo.add_argument("--list", action="store_true", help="list the demos")
    demo.add_argument("--json", action="store_true", help="with --list: print JSON")
    demo.add_argument(
        "--source", action="store_true", help="print the demo's source instead of running it"
    )
    demo.add_argument("--quick", action="store_true", help="a short run (for CI)")
    demo.add_argument(
        "--device", choices=("cpu", "cuda"), help="where to run (default: cuda when available)"
    )
    demo.add_argument("--headless", action="store_true", help="no viewer: print the measured table")
    demo.add_argument("--record", metavar="FILE", type=Path, help="save the stream to FILE")
    _add_oom_options(demo)
    _add_ops_options(demo)
    return parser


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices[name]
            return found
    raise KeyError(name)


def _version() -> str:
    from torchtop import __version__

    return f"torchtop {__version__}"


# --------------------------------------------------------------------------------------------


def split_run_argv(run: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], list[str]]:
    """``run``'s own options, and the job's command line: the script or ``-m MODULE`` and
    everything after it, which belongs to the job as it does under ``python``."""
    options = run._option_string_actions
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return argv[:i], argv[i + 1 :]
        if arg == "-m":
            return argv[:i], ["-m", *argv[i + 1 : i + 2], *argv[i + 2 :]]
        if arg.startswith("-m") and not arg.startswith("--"):
            return argv[:i], ["-m", arg[2:], *argv[i + 1 :]]
        if not arg.startswith("-") or arg == "-":
            return argv[:i], argv[i:]
        action = options.get(arg.split("=", 1)[0])
        takes_value = action is not None and action.nargs != 0
        i += 2 if takes_value and "=" not in arg else 1
    return argv, []


def cmd_run(args: argparse.Namespace) -> int:
    from torchtop.streams.runner import RunError, RunSpec

    target = list(args.target)
    if not target:
        raise CliError("nothing to run: give a script or -m MODULE (see `torchtop run --help`)")
    spec = RunSpec(
        target=target,
        agent_options={
            "interval_s": args.interval,
            "nvml_interval_s": args.nvml_interval,
            "nvml": not args.no_nvml,
            "hang_after_s": args.hang_after,
            **_oom_agent_options(args),
            **_ops_agent_options(args),
        },
        headless=args.headless,
        record=args.record,
    )
    try:
        spec.validate()
    except RunError as exc:
        raise CliError(str(exc)) from None
    if args.metrics is None and args.otlp is None:
        return _run_spec(spec)
    from torchtop.export.service import descends_from

    # The exporter follows the agents below this process: the job, or each rank of torchrun.
    exporter = _start_exporter(args, descends_from(os.getpid()))
    try:
        return _run_spec(spec)
    finally:
        exporter.close(wait_s=2.0)  # the job has exited: its feeds end as they read its last


def _start_exporter(args: argparse.Namespace, accept: Any, run: str | None = None) -> Any:
    from torchtop.export.otlp import OtlpUnavailable
    from torchtop.export.prometheus import MetricsError
    from torchtop.export.service import Exporter

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


def _run_spec(spec: Any) -> int:
    from torchtop.streams.recording import RecordingError
    from torchtop.streams.runner import RunError, run_headless
    from torchtop.transport import TransportError, ensure_runtime_dir

    try:
        ensure_runtime_dir()  # before anything starts: a folder that is not private is refused
    except TransportError as exc:
        raise CliError(str(exc), code=1) from None
    try:
        if spec.headless:
            return run_headless(spec)
        _require_terminal("torchtop run --headless")
        if spec.launcher:
            return _run_ranks_view(spec)
        from torchtop.streams.sources import RunSource
        from torchtop.tui.app import TorchtopApp

        source = RunSource(spec)
        app = TorchtopApp(source, title=spec.description)

        def ranks_appeared() -> None:
            # The job's processes became ranks (mp.spawn, Lightning): the run's view follows.
            with contextlib.suppress(Exception):
                app.call_from_thread(app.exit, RANKS_APPEARED)

        source.on_ranks = ranks_appeared
        code = _run_app(app)
        if app.return_value == RANKS_APPEARED:
            return _view_script_run(source, spec.description)
        source.wait_after_viewer()
        _print_exit_summary(source.job_end())
        # The job's own exit code, as headless gives it (a job stopped from the viewer: 130);
        # the viewer's, when the job runs on without it.
        job_code = source.job.exit_code
        return job_code if job_code is not None else code
    except (RunError, RecordingError) as exc:
        raise CliError(str(exc), code=1) from None


def _print_exit_summary(end: Any) -> None:
    from torchtop.report.exit_summary import exit_summary

    for line in exit_summary(end):
        print(line, file=sys.stderr)


#: What the single job's viewer returns when the job's processes have become ranks.
RANKS_APPEARED = "ranks appeared"


def _view_script_run(source: Any, title: str) -> int:
    """The view of the ranks a script's processes became, until it quits; the job's exit
    code."""
    from torchtop.streams.sources import ScriptRun

    run = ScriptRun(source)
    try:
        _view_run(run, title)
    finally:
        if run.running():
            run.stop_job()
    source.wait_after_viewer()
    _print_exit_summary(source.job_end())
    code = source.job.exit_code
    return code if code is not None else 0


def _run_ranks_view(spec: Any) -> int:
    """A multi-rank job under the live view of its ranks; the job's exit code."""
    from torchtop.streams.runner import RankRun

    run = RankRun(spec)
    try:
        _view_run(run, spec.description)
    finally:
        if run.running():
            run.stop_job()
            print(f"torchtop: stopping job pid {run.job.pid}…", file=sys.stderr)
    code = run.finish()
    _print_exit_summary(run.job_end())
    return code if code is not None else 0


def _view_run(run: Any, title: str) -> None:
    """The view of a run's ranks until it quits; ``enter`` on a rank opens that rank's full
    screens (a job screen on its agent), whose ``q`` comes back to the run."""
    from torchtop.tui.app import TorchtopApp

    _run_app(TorchtopApp.for_run(run, title))


def _require_terminal(alternative: str) -> None:
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise CliError(f"the viewer needs a terminal; without one use `{alternative}`")


def _run_app(app: Any) -> int:
    result = app.run()
    return int(result) if isinstance(result, int) else 0


def _check_runtime_dir() -> None:
    """Refuse, in one line, a socket directory that is not the user's own private folder
    (another user may have made it first), before anything in it is read."""
    from torchtop.transport import TransportError, existing_runtime_dir

    try:
        existing_runtime_dir()
    except TransportError as exc:
        raise CliError(str(exc), code=1) from None


def cmd_ps(args: argparse.Namespace) -> int:
    from torchtop.transport import list_agents

    _check_runtime_dir()
    agents = list_agents()
    launchers = _launchers(agents)
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "pid": a.pid,
                        "command": a.command,
                        "argv": a.argv,
                        "started_at": a.started_at,
                        "address": a.address,
                        "cwd": a.cwd,
                        **a.identity,
                        **({"launches": launchers[a.pid]} if a.pid in launchers else {}),
                    }
                    for a in agents
                ],
                indent=2,
            )
        )
        return 0
    if not agents:
        print("no running agents (start one with `torchtop run SCRIPT` or torchtop.start())")
        return 0

    def shown(text: str) -> str:  # another process's text: escapes shown, one row per agent
        return printable(text, one_line=True)

    # Ranks of a distributed run: which rank of how many, and which run, before the command
    # (every rank runs the same one). The columns appear only when some agent is a rank.
    ranked = any(a.rank_label for a in agents)

    def rank_of(a: Any) -> str:
        return "launcher" if a.pid in launchers else a.rank_label

    def run_of(a: Any) -> str:
        return launchers.get(a.pid, a.run_label)

    rank_w = max([len("RANK"), *(len(shown(rank_of(a))) for a in agents)])
    run_w = max([len("RUN"), *(len(shown(run_of(a))) for a in agents)])
    rank_head = f"{'RANK':>{rank_w}}  {'RUN':{run_w}}  " if ranked else ""
    print(f"{'PID':>8}  {'STARTED':19}  {rank_head}{'ADDRESS':40}  COMMAND")
    for run, members in _by_run(agents, launchers):
        if run:
            # The ranks of one run together, under a line that says what they are.
            print(f"run {shown(run)}: {_ranks_line(members)}")
        for a in members:
            started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(a.started_at))
            rank = f"{shown(rank_of(a)):>{rank_w}}  {shown(run_of(a)):{run_w}}  " if ranked else ""
            print(f"{a.pid:>8}  {started:19}  {rank}{shown(a.address):40}  {shown(a.command)}")
    return 0


def _launchers(agents: list[Any]) -> dict[int, str]:
    """The agents of single processes that started the ranks of a run (the parent of
    ``torch.multiprocessing.spawn``, a job whose subprocesses are a scheduler's tasks), by pid,
    with the run's label."""
    from torchtop.export.service import launcher_of

    singles = {a.pid for a in agents if not a.rank_label}
    found: dict[int, str] = {}
    for a in agents:
        if a.rank_label and a.run_label:
            launcher = launcher_of(a.pid, singles)
            if launcher is not None:
                found.setdefault(launcher, a.run_label)
    return found


def _by_run(
    agents: list[Any], launchers: dict[int, str] | None = None
) -> list[tuple[str, list[Any]]]:
    """Agents grouped by run (single processes under ``""``, first), each run's launcher
    first (``launchers``: see :func:`_launchers`), then its ranks by rank."""
    launchers = launchers or {}
    groups: dict[str, list[Any]] = {}
    for a in agents:
        groups.setdefault(a.run_label if a.rank_label else launchers.get(a.pid, ""), []).append(a)
    for members in groups.values():
        members.sort(
            key=lambda a: (a.identity.get("rank") is not None, a.identity.get("rank") or 0)
        )
    return sorted(groups.items(), key=lambda item: (item[0] != "", item[0]))


def _ranks_line(members: list[Any]) -> str:
    """``4 ranks of 4 on nodes 0, 1`` for the agents of one run."""
    ranks = sorted(a.identity.get("rank") for a in members if a.identity.get("rank") is not None)
    world = {a.identity.get("world_size") for a in members} - {None}
    nodes = sorted({a.identity.get("node_rank") for a in members} - {None})
    line = f"{len(ranks)} rank{'s' if len(ranks) != 1 else ''}"
    if len(world) == 1:
        line += f" of {world.pop()}"
    if nodes:
        line += f" on node{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes))}"
    return line


def _pick_agent(pid: int | None, interactive: bool) -> Any:
    from torchtop.transport import find_agent, list_agents

    if pid is not None:
        info = find_agent(pid)
        if info is None:
            raise CliError(f"no agent running in pid {pid} (see `torchtop ps`)", code=1)
        return info
    agents = list_agents()
    if not agents:
        raise CliError(
            "no running agents: start a job with `torchtop run SCRIPT` or call torchtop.start()",
            code=1,
        )
    if len(agents) == 1:
        return agents[0]
    runs = _by_run(agents, _launchers(agents))
    if len(runs) == 1 and runs[0][0]:
        # Every agent is a rank of one run (or the process that started them): the viewer
        # shows the run; a recording is one rank's.
        run, members = runs[0][0], [a for a in runs[0][1] if a.rank_label]
        if interactive:
            return _RunOfRanks(run, members)
        pids = ", ".join(f"rank {a.identity.get('rank')}: {a.pid}" for a in members)
        raise CliError(
            f"the {len(members)} agents running are the ranks of run {run} ({pids}); a headless "
            f"recording follows one rank: give its PID (`torchtop attach "
            f"{members[0].pid} --headless --record FILE` for rank "
            f"{members[0].identity.get('rank')}), or record every rank with "
            "`torchtop run --headless --record FILE torchrun ...`",
            code=1,
        )
    if not interactive:
        pids = ", ".join(str(a.pid) for a in agents)
        raise CliError(f"{len(agents)} agents are running ({pids}): give a PID", code=1)
    return None  # the viewer offers a picker


def cmd_attach(args: argparse.Namespace) -> int:
    _check_runtime_dir()
    if args.headless:
        if args.record is None:
            raise CliError("--headless records without a viewer: give --record FILE")
        if args.node:
            return _attach_nodes(args)
        info = _attach_target(args, ask=False)
        if isinstance(info, _Outside):
            return _record_outside(info, args.record, args.duration)
        return _record_headless(info, args.record, args.duration)
    if args.duration is not None:
        raise CliError("--duration applies to --headless recording")
    if args.node:
        return _attach_nodes(args)
    _require_terminal(f"torchtop attach {args.pid or 'PID'} --headless --record FILE")
    info = _attach_target(args, ask=not args.yes)
    from torchtop.streams.recording import RecordingError, RecordingWriter
    from torchtop.streams.sources import LiveSource, pick_agent_interactively
    from torchtop.tui.app import TorchtopApp

    if isinstance(info, _RunOfRanks):
        if args.record:
            raise CliError("--record follows one rank: give its PID (see `torchtop ps`)")
        from torchtop.streams.runs import AttachedRun

        run = AttachedRun(info.agents)
        try:
            _view_run(run, f"run {info.run}")
        finally:
            run.stop_job()  # detach: the job runs on
        return 0
    if info is None:
        info = pick_agent_interactively()
        if info is None:
            return 0
    try:
        writer = RecordingWriter(args.record) if args.record else None
    except RecordingError as exc:
        raise CliError(str(exc), code=1) from None
    if isinstance(info, _Outside):
        from torchtop.streams.outside import outside_source

        source = outside_source(info.pid, info.reason, writer)
        _run_app(TorchtopApp(source, title=f"pid {info.pid} (from outside)"))
        return 1
    source = LiveSource(info.address, writer=writer, lines=_left_running_lines(info.pid))
    app = TorchtopApp(source, title=info.command)
    code = _run_app(app)
    _print_exit_summary(_attached_end(app.job.state, info.pid, args.record))
    return code


def _attached_end(state: Any, pid: int, record: Path | None) -> Any:
    """How a job ``torchtop attach`` watched stands once its viewer has closed."""
    from torchtop.report.exit_summary import JobEnd
    from torchtop.transport import job_log_path, pid_alive

    log = job_log_path(pid)
    return JobEnd(
        pid=pid,
        returncode=state.exit_code if state.job_ended else None,
        log_path=log if log.is_file() else None,
        record=record,
        # The job's own lines: its stderr, or its log file's (where both streams go).
        stderr=tuple(e.text for e in state.logs if e.stream in ("stderr", "")),
        running=pid_alive(pid),
    )


def _left_running_lines(pid: int) -> Any:
    """The log file of a job ``torchtop run`` started and left running, if it is one."""
    from torchtop.streams.sources import LogFileLines
    from torchtop.transport import job_log_path

    path = job_log_path(pid)
    return LogFileLines(path) if path.is_file() else None


def _attach_nodes(args: argparse.Namespace) -> int:
    """The ranks of this machine and of every ``--node`` in one run view (or, headless, one
    recording); each node reached (and checked) first, so a node that cannot be is one line."""
    if args.pid is not None:
        raise CliError("--node follows every rank of a run: drop the PID (or use --run ID)")
    if not args.headless:
        if args.record is not None:
            raise CliError("--node records with --headless (`--headless --record FILE`)")
        _require_terminal("torchtop attach --node ... --headless --record FILE")
    from torchtop.streams.nodes import NodeError, NodeFeed, NodeSpec, read_node_token, ssh_command
    from torchtop.streams.recording import RecordingError, RecordingWriter
    from torchtop.streams.runs import AttachedRun
    from torchtop.transport import list_agents

    local = [
        a
        for a in list_agents()
        if a.identity.get("rank") is not None
        and (args.run is None or str(a.identity.get("run_id")) == args.run)
    ]
    feeds: list[NodeFeed] = []
    writer = None
    try:
        token = read_node_token(args.token_file)
        writer = RecordingWriter(args.record) if args.headless else None
        ssh = ssh_command(args.ssh_command)
        for name in dict.fromkeys(args.node):
            feed = NodeFeed(
                NodeSpec(name),
                run_id=args.run,
                ssh=ssh,
                remote_torchtop=args.remote_torchtop,
                token=token,
                writer=writer,
            )
            print(f"torchtop: reaching node {feed.label}…", file=sys.stderr)
            feed.connect()
            feeds.append(feed)
    except (NodeError, RecordingError) as exc:
        for feed in feeds:
            feed.close()
        if writer is not None:
            writer.close()
        raise CliError(str(exc), code=1) from None
    run = AttachedRun(local, feeds, writer)
    if writer is not None:
        return _record_run(run, writer, args.duration)
    title = f"run {args.run}" if args.run else f"{len(feeds) + bool(local)} nodes"
    try:
        _view_run(run, title)
    finally:
        run.stop_job()  # detach: the job runs on
    return 0


def _record_run(run: Any, writer: Any, duration: float | None) -> int:
    """Record every rank of ``run`` (headless) until its streams end, ``duration`` passes or
    Ctrl-C; exit code 1 if no rank was heard from."""
    start = time.monotonic()
    run.start()
    try:
        while run.running() and (duration is None or time.monotonic() - start < duration):
            time.sleep(0.25)
            run.drain()
    except KeyboardInterrupt:
        pass
    finally:
        run.stop_job()
        run.drain()
        writer.close()
    ranks = len(run.model)
    nodes = len({run.node_of(stream) for stream in run.model.jobs})
    line, _going = run.status()
    print(
        f"recorded {writer.frames} frames of {ranks} ranks on {nodes} nodes to {writer.path} "
        f"({printable(line)})",
        file=sys.stderr,
    )
    return 0 if ranks else 1


def cmd_relay(args: argparse.Namespace) -> int:
    from torchtop.streams.relay import RelayError, serve_stdio, serve_tcp

    try:
        if args.listen is not None:
            return serve_tcp(args.listen, args.token_file, args.run)
        if args.token_file is not None:
            raise CliError("--token-file goes with --listen (over ssh, ssh authenticates)")
        if sys.stdin.isatty():
            raise CliError(
                "`torchtop relay` speaks to a viewer on its stdin and stdout: run `torchtop "
                "attach --node THIS_HOST` on the viewer's machine (it starts `ssh THIS_HOST "
                "torchtop relay`), or serve TCP with `torchtop relay --listen PORT`"
            )
        return serve_stdio(args.run)
    except RelayError as exc:
        raise CliError(str(exc), code=1) from None


def _attach_target(args: argparse.Namespace, ask: bool) -> Any:
    """The agent to attach to: a running one, or one started now in a job without one."""
    from torchtop.transport import find_agent

    if args.pid is None or find_agent(args.pid) is not None:
        return _pick_agent(args.pid, interactive=not args.headless)
    from torchtop.attach.inject import AttachRefused, check_ptrace, read_target, start_agent

    try:
        target = read_target(args.pid)
    except AttachRefused as exc:
        raise CliError(str(exc), code=1) from None
    try:
        check_ptrace(target)  # first: another user's process hides its executable
        _require_python(target)  # before asking: there is nothing to start an agent in
        if ask and not _confirm_start(target):
            return _Outside(args.pid, "no agent started")
        started = start_agent(
            args.pid,
            python_path=args.python_path,
            progress=lambda text: print(f"torchtop: {printable(text)}", file=sys.stderr),
        )
    except AttachRefused as exc:
        if not os.path.exists(f"/proc/{args.pid}"):
            raise CliError(str(exc), code=1) from None
        # Say why, then show what can be read from outside (exit code 1 all the same).
        print(f"torchtop: {printable(str(exc))}", file=sys.stderr)
        print(
            f"torchtop: watching pid {args.pid} from outside instead (/proc and NVML only)",
            file=sys.stderr,
        )
        return _Outside(args.pid, str(exc))
    return started.info


def _require_python(target: Any) -> None:
    """A process that is not Python (a shell, a launcher script) gets no agent: say which of
    its children are, or how to start the job under torchtop."""
    if target.python is not None or target.exe is None:
        return  # Python, or another user's process: the attach itself says why not
    import psutil

    from torchtop.attach.inject import AttachRefused, read_target

    pythons: list[int] = []
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(target.pid).children(recursive=True):
            with contextlib.suppress(AttachRefused):
                if read_target(child.pid).python is not None:
                    pythons.append(child.pid)
    where = (
        f"attach to its Python process ({', '.join(map(str, pythons[:4]))}), or " if pythons else ""
    )
    raise CliError(
        f"pid {target.pid} ({target.exe}) is not a Python process, so no agent can start in "
        f"it: {where}start the training job under torchtop with `torchtop run SCRIPT`",
        code=1,
    )


class _RunOfRanks:
    """Every running agent is a rank of this run: ``torchtop attach`` opens the run's view."""

    def __init__(self, run: str, agents: list[Any]) -> None:
        self.run = run
        self.agents = agents


class _Outside:
    """A job no agent can be started in: it is watched from outside."""

    def __init__(self, pid: int, refusal: str) -> None:
        self.pid = pid
        self.reason = refusal.split(":", 1)[0]  # the problem; the fix was printed above


def _record_outside(target: _Outside, path: Path, duration: float | None) -> int:
    """Record ``/proc`` and NVML figures of a job without an agent; exit code 1 (refused)."""
    from torchtop.streams.outside import OutsideWatch
    from torchtop.streams.recording import RecordingError, RecordingWriter

    try:
        writer = RecordingWriter(path)
    except RecordingError as exc:
        raise CliError(str(exc), code=1) from None
    watch = OutsideWatch(target.pid, writer.write, reason=target.reason).start()
    try:
        watch.ended.wait(duration)
    except KeyboardInterrupt:
        pass
    finally:
        watch.stop()
        writer.close()
    print(f"recorded pid {target.pid} from outside to {path}", file=sys.stderr)
    return 1


def _confirm_start(target: Any) -> bool:
    """Ask before starting an agent in someone's job (the live viewer; --yes skips this)."""
    print(
        f"pid {target.pid} ({printable(target.exe or 'unknown', one_line=True)}) runs without "
        "torchtop. Start an agent in it"
        " (it stays until the job ends; see README: Attach)? [y/N] ",
        end="",
        file=sys.stderr,
        flush=True,
    )
    try:
        answer = input()
    except EOFError:
        return False
    return answer.strip().lower() in ("y", "yes")


def _record_headless(info: Any, path: Path, duration: float | None) -> int:
    from torchtop.streams.feed import AgentFeed
    from torchtop.streams.recording import RecordingError, RecordingWriter

    try:
        writer = RecordingWriter(path)
    except RecordingError as exc:
        raise CliError(str(exc), code=1) from None
    feed = AgentFeed(address=info.address, writer=writer, client="recorder").start()
    start = time.monotonic()
    interactive = sys.stderr.isatty()
    try:
        while not feed.ended.is_set():
            elapsed = time.monotonic() - start
            if duration is not None and elapsed >= duration:
                break
            if interactive:
                limit = f"/{duration:.0f}" if duration else ""
                print(
                    f"\rrecording pid {info.pid}: {elapsed:5.1f}{limit} s, {feed.frames} frames",
                    end="",
                    file=sys.stderr,
                )
            feed.ended.wait(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        feed.close()
        feed.join(2.0)
        lost = feed.lost_exit()
        if lost is not None:
            writer.write(lost)
        writer.close()
    if interactive:
        print(file=sys.stderr)
    print(
        f"recorded {feed.frames} frames from pid {info.pid} to {path} "
        f"({printable(feed.end_reason or 'stopped')})",
        file=sys.stderr,
    )
    if feed.frames == 0:
        return 1
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    import signal
    import threading

    from torchtop.export.prometheus import DEFAULT_HOST, DEFAULT_PORT
    from torchtop.transport import find_agent

    _check_runtime_dir()
    if args.metrics is None and args.otlp is None:
        args.metrics = (DEFAULT_HOST, DEFAULT_PORT)
    pid, run = _export_target(args.target)
    exporter = _start_exporter(
        args, (lambda info: info.pid == pid) if pid is not None else (lambda info: True), run
    )
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
    from torchtop.transport import find_agent, list_agents

    if target is None:
        return None, None
    if target.isdigit() and find_agent(int(target)) is not None:
        return int(target), None
    if any(str(a.identity.get("run_id")) == target for a in list_agents() if a.identity):
        return None, target  # the ranks of a run
    if target.isdigit():
        pid = int(target)
        if not os.path.exists(f"/proc/{pid}"):
            from torchtop.attach.inject import CHECK_PID

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


def cmd_replay(args: argparse.Namespace) -> int:
    from torchtop.streams.recording import RecordingError, read_recording

    try:
        contents = read_recording(args.file)
    except RecordingError as exc:
        raise CliError(str(exc), code=1) from None
    _require_terminal(f"torchtop report {args.file}")
    from torchtop.streams.sources import RecordingSource
    from torchtop.tui.app import TorchtopApp

    source = RecordingSource(contents.messages, speed=args.speed)
    return _run_app(TorchtopApp(source, title=str(args.file)))


def cmd_report(args: argparse.Namespace) -> int:
    from torchtop.report.job import render_text, summarize
    from torchtop.report.run import is_multi_rank, ranks_parts, summarize_ranks
    from torchtop.streams.recording import RecordingError, read_recording

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


def cmd_doctor(args: argparse.Namespace) -> int:
    from torchtop.commands import doctor

    return doctor.main(json_output=args.json, timeout_s=args.timeout)


def cmd_demo(args: argparse.Namespace) -> int:
    from torchtop.commands.demo_catalog import DemoNotFound, find_demo, list_demos

    if args.list or not args.name:
        demos = list_demos()
        if args.json:
            print(
                json.dumps(
                    [{"name": d.name, "description": d.description} for d in demos], indent=2
                )
            )
            return 0
        width = max(len(d.name) for d in demos) if demos else 0
        print("demos (run one with `torchtop demo NAME`, add --headless for a table):")
        for d in demos:
            print(f"  {d.name:<{width}}  {d.description}")
        return 0
    try:
        demo = find_demo(args.name)
    except DemoNotFound as exc:
        raise CliError(str(exc)) from None
    if args.source:
        print(demo.path.read_text(), end="")
        return 0
    from torchtop.streams.runner import RunSpec

    demo_args = []
    if args.quick:
        demo_args.append("--quick")
    device = args.device
    if device == "cuda" and _default_device() == "cpu":
        raise CliError(NO_CUDA)  # before the job starts: one line, not the demo's
    agent_options = {**_oom_agent_options(args), **_ops_agent_options(args)}
    if demo.cpu_memory_limit is not None and args.memory_limit is None:
        # A demo that runs out of memory on purpose (oom) gets an emulated device on the CPU,
        # never the machine's RAM; on CUDA it meets the GPU's real limit.
        from torchtop.sizes import parse_size

        device = device or _default_device()
        if device == "cpu":
            agent_options["memory_limit_bytes"] = parse_size(demo.cpu_memory_limit)
    if device:
        demo_args += ["--device", device]
    spec = RunSpec(
        target=["-m", demo.module, *demo_args],
        agent_options=agent_options,
        headless=args.headless,
        record=args.record,
    )
    return _run_spec(spec)


#: ``--device cuda`` where torch finds no GPU (the CLI's line, and a demo's run on its own).
NO_CUDA = (
    "this PyTorch sees no CUDA GPU: run the demo with --device cpu, or install a CUDA build of "
    "torch (`torchtop doctor` says which build this is)"
)


def _default_device() -> str | None:
    """The demos' default device as the job's Python sees it: "cuda" when torch finds a GPU,
    else "cpu" (``None`` if it cannot tell). Asked in a child process: the CLI never imports
    torch."""
    import subprocess

    probe = "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')"
    try:
        proc = subprocess.run(
            [sys.executable, "-W", "ignore", "-c", probe],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    answer = proc.stdout.strip().splitlines()[-1:] if proc.returncode == 0 else []
    return answer[0] if answer and answer[0] in ("cpu", "cuda") else None


COMMANDS = {
    "run": cmd_run,
    "ps": cmd_ps,
    "attach": cmd_attach,
    "relay": cmd_relay,
    "export": cmd_export,
    "replay": cmd_replay,
    "report": cmd_report,
    "demo": cmd_demo,
    "doctor": cmd_doctor,
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The parsed command line; :class:`CliError` for one it does not accept."""
    parser = build_parser()
    if argv[:1] == ["run"]:
        # argparse would take the job's own options for ours: split the job off first.
        options, target = split_run_argv(_subparser(parser, "run"), argv[1:])
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
        return COMMANDS[args.command](args)
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
