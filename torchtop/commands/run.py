"""``torchtop run``: start a script (or ``-m MODULE``) with the agent inside and watch it."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from torchtop.commands.core import (
    VERB_HELP,
    CliError,
    Subparsers,
    add_agent_options,
    add_export_options,
    add_oom_options,
    add_ops_options,
    oom_agent_options,
    ops_agent_options,
    print_exit_summary,
    require_terminal,
    run_app,
    view_run,
)
from torchtop.commands.export import start_exporter
from torchtop.streams.discovery import Agents
from torchtop.streams.recording import RecordingError
from torchtop.streams.runner import RankRun, RunError, RunSpec, run_headless
from torchtop.streams.sources import RunSource, ScriptRun, attach_rank
from torchtop.transport import TransportError, ensure_runtime_dir


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    run = sub.add_parser(
        "run",
        help=VERB_HELP["run"],
        description="Run an unchanged training script (or -m MODULE) with the agent inside.",
        usage=(
            "torchtop run [options] SCRIPT [ARGS...]\n"
            "       torchtop run [options] -m MODULE [ARGS...]"
        ),
    )
    add_agent_options(run)
    add_oom_options(run)
    add_ops_options(run)
    add_export_options(run)
    run.add_argument("-m", dest="module", metavar="MODULE", help="run a module, as python -m does")
    run.add_argument("target", nargs="*", metavar="SCRIPT [ARGS...]")
    return run


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


def run(args: argparse.Namespace) -> int:

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
            "cost_budget": args.cost_budget / 100.0,
            **oom_agent_options(args),
            **ops_agent_options(args),
        },
        headless=args.headless,
        record=args.record,
    )
    try:
        spec.validate()
    except RunError as exc:
        raise CliError(str(exc)) from None
    if args.metrics is None and args.otlp is None:
        return run_spec(spec)

    # The exporter follows the agents below this process: the job, or each rank of torchrun.
    exporter = start_exporter(args, Agents(below=os.getpid()))
    try:
        return run_spec(spec)
    finally:
        exporter.close(wait_s=2.0)  # the job has exited: its feeds end as they read its last


def run_spec(spec: RunSpec) -> int:

    try:
        ensure_runtime_dir()  # before anything starts: a folder that is not private is refused
    except TransportError as exc:
        raise CliError(str(exc), code=1) from None
    try:
        if spec.headless:
            return run_headless(spec)
        require_terminal("torchtop run --headless")
        if spec.launcher:
            return _run_ranks_view(spec)
        from torchtop.tui.app import TorchtopApp

        source = RunSource(spec)
        app = TorchtopApp(source, title=spec.description)
        runs: list[ScriptRun] = []

        def show_ranks() -> None:
            runs.append(ScriptRun(source))
            app.show_run(runs[0], spec.description, open_rank=attach_rank)

        def ranks_appeared() -> None:
            # The job's processes became ranks (mp.spawn, Lightning): the run's screen follows.
            with contextlib.suppress(Exception):
                app.call_from_thread(show_ranks)

        source.on_ranks = ranks_appeared
        code = run_app(app)
        if runs and runs[0].running():
            runs[0].stop_job()
        source.wait_after_viewer()
        print_exit_summary(source.job_end())
        # The job's own exit code, as headless gives it (a job stopped from the viewer: 130);
        # the viewer's, when the job runs on without it.
        job_code = source.job.exit_code
        return job_code if job_code is not None else code
    except (RunError, RecordingError) as exc:
        raise CliError(str(exc), code=1) from None


def _run_ranks_view(spec: RunSpec) -> int:
    """A multi-rank job under the live view of its ranks; the job's exit code."""

    run = RankRun(spec)
    try:
        view_run(run, spec.description)
    finally:
        if run.running():
            run.stop_job()
            print(f"torchtop: stopping job pid {run.job.pid}…", file=sys.stderr)
    code = run.finish()
    print_exit_summary(run.job_end())
    return code if code is not None else 0
