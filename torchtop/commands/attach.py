"""``torchtop attach``: watch a running job (its agent, one started in it now, or from
outside), or every rank of a run on this node and others."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from torchtop.attach.inject import AttachRefused, check_ptrace, read_target, start_agent
from torchtop.commands.core import (
    VERB_HELP,
    CliError,
    Subparsers,
    check_runtime_dir,
    positive_float,
    print_exit_summary,
    require_terminal,
    run_app,
    view_run,
)
from torchtop.commands.ps import by_run, launchers_of_runs
from torchtop.report.exit_summary import JobEnd
from torchtop.streams.discovery import Agents
from torchtop.streams.headless import (
    AgentRecording,
    OutsideRecording,
    Recorded,
    RunRecording,
    record,
)
from torchtop.streams.nodes import NodeError, NodeFeed, NodeSpec, read_node_token, ssh_command
from torchtop.streams.outside import outside_source
from torchtop.streams.recording import RecordingError, RecordingWriter
from torchtop.streams.runs import AttachedRun
from torchtop.streams.sources import LiveSource, LogFileLines
from torchtop.text import printable
from torchtop.transport import find_agent, job_log_path, list_agents, pid_alive

if TYPE_CHECKING:
    from torchtop.attach.inject import Target
    from torchtop.model import JobModel
    from torchtop.transport import AgentInfo


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    attach = sub.add_parser(
        "attach",
        help=VERB_HELP["attach"],
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
        type=positive_float,
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
        help="only the ranks of this run (TORCHELASTIC_RUN_ID), here and on every node, or "
        "in Prometheus (--prometheus)",
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
    cluster = attach.add_argument_group(
        "a run through Prometheus",
        "Show every rank of a run, on any number of nodes, from the Prometheus that scrapes "
        "each node's `torchtop export`: summaries at the scrape interval, no connection to any "
        "node. See docs/ranks.md.",
    )
    cluster.add_argument(
        "--prometheus",
        metavar="URL",
        help="the Prometheus server (http://host:9090); with --run ID, that run, else the only "
        "run it holds (several: they are listed)",
    )
    return attach


def _pick_agent(pid: int | None, interactive: bool) -> AgentInfo | _RunOfRanks | None:

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
    runs = by_run(agents, launchers_of_runs(agents))
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


def run(args: argparse.Namespace) -> int:
    if args.prometheus is not None:
        return _attach_prometheus(args)
    check_runtime_dir()
    if args.headless:
        if args.record is None:
            raise CliError("--headless records without a viewer: give --record FILE")
        if args.node:
            return _attach_nodes(args)
        target = _attach_target(args, ask=False)
        if target is None or isinstance(target, _RunOfRanks):  # offered to a viewer only
            raise CliError("a headless recording follows one agent: give its PID (`torchtop ps`)")
        return _record_headless(target, args.record, args.duration)
    if args.duration is not None:
        raise CliError("--duration applies to --headless recording")
    if args.node:
        return _attach_nodes(args)
    require_terminal(f"torchtop attach {args.pid or 'PID'} --headless --record FILE")
    info = _attach_target(args, ask=not args.yes)
    from torchtop.tui.app import TorchtopApp

    if isinstance(info, _RunOfRanks):
        if args.record:
            raise CliError("--record follows one rank: give its PID (see `torchtop ps`)")

        run = AttachedRun(info.agents)
        try:
            view_run(run, f"run {info.run}")
        finally:
            run.stop_job()  # detach: the job runs on
        return 0
    if info is None:
        # The running agents offered; the chosen one's job screen opens in the same viewer.
        def open_agent(agent: AgentInfo) -> tuple[LiveSource, str]:
            try:
                writer = RecordingWriter(args.record) if args.record else None
            except RecordingError as exc:
                raise CliError(str(exc), code=1) from None
            lines = _left_running_lines(agent.pid)
            return LiveSource(agent.address, writer=writer, lines=lines), agent.command

        picker = TorchtopApp.picker(open_agent)
        code = run_app(picker)
        chosen = picker.picked
        if chosen is None:
            return 0
        print_exit_summary(_attached_end(picker.job.state, chosen.pid, args.record))
        return code
    try:
        writer = RecordingWriter(args.record) if args.record else None
    except RecordingError as exc:
        raise CliError(str(exc), code=1) from None
    if isinstance(info, _Outside):
        source = outside_source(info.pid, info.reason, writer)
        run_app(TorchtopApp(source, title=f"pid {info.pid} (from outside)"))
        return 1
    source = LiveSource(info.address, writer=writer, lines=_left_running_lines(info.pid))
    app = TorchtopApp(source, title=info.command)
    code = run_app(app)
    print_exit_summary(_attached_end(app.job.state, info.pid, args.record))
    return code


def _attached_end(state: JobModel, pid: int, record: Path | None) -> JobEnd:
    """How a job ``torchtop attach`` watched stands once its viewer has closed."""

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


def _left_running_lines(pid: int) -> LogFileLines | None:
    """The log file of a job ``torchtop run`` started and left running, if it is one."""

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
        require_terminal("torchtop attach --node ... --headless --record FILE")

    local = list(filter(Agents(ranks_only=True, run=args.run), list_agents()))
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
        return record(RunRecording(run, writer), writer, args.duration)
    title = f"run {args.run}" if args.run else f"{len(feeds) + bool(local)} nodes"
    try:
        view_run(run, title)
    finally:
        run.stop_job()  # detach: the job runs on
    return 0


def _attach_prometheus(args: argparse.Namespace) -> int:
    """Every rank of a run as Prometheus holds them, in the run view; no node is reached."""
    if args.pid is not None:
        raise CliError("--prometheus shows every rank of a run: drop the PID (or use --run ID)")
    if args.node:
        raise CliError("--prometheus reads every node's ranks from Prometheus: drop --node")
    if args.headless or args.record is not None or args.duration is not None:
        raise CliError(
            "--prometheus opens the viewer only (Prometheus keeps the series): drop --headless, "
            "--record and --duration"
        )
    from torchtop.streams.prometheus_api import PrometheusError, base_url
    from torchtop.streams.prometheus_run import PrometheusRun, pick_run

    try:
        url = base_url(args.prometheus)
        run_id = pick_run(url, args.run)
    except PrometheusError as exc:
        raise CliError(str(exc), code=1) from None
    require_terminal(f"curl '{url}/api/v1/query?query=torchtop_steps_total'")
    run = PrometheusRun(url, run_id)
    try:
        view_run(run, f"run {run_id} through Prometheus")
    finally:
        run.stop_job()
    return 0


def _attach_target(
    args: argparse.Namespace, ask: bool
) -> AgentInfo | _RunOfRanks | _Outside | None:
    """The agent to attach to: a running one, or one started now in a job without one."""

    if args.pid is None or find_agent(args.pid) is not None:
        return _pick_agent(args.pid, interactive=not args.headless)

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


def _require_python(target: Target) -> None:
    """A process that is not Python (a shell, a launcher script) gets no agent: say which of
    its children are, or how to start the job under torchtop."""
    if target.python is not None or target.exe is None:
        return  # Python, or another user's process: the attach itself says why not
    import psutil

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

    def __init__(self, run: str, agents: list[AgentInfo]) -> None:
        self.run = run
        self.agents = agents


class _Outside:
    """A job no agent can be started in: it is watched from outside."""

    def __init__(self, pid: int, refusal: str) -> None:
        self.pid = pid
        self.reason = refusal.split(":", 1)[0]  # the problem; the fix was printed above


def _record_headless(target: AgentInfo | _Outside, path: Path, duration: float | None) -> int:
    """One agent's stream, or a job's figures read from outside, recorded without a viewer."""

    try:
        writer = RecordingWriter(path)
    except RecordingError as exc:
        raise CliError(str(exc), code=1) from None
    recorded: Recorded = (
        OutsideRecording(target.pid, target.reason, writer)
        if isinstance(target, _Outside)
        else AgentRecording(target, writer)
    )
    return record(recorded, writer, duration)


def _confirm_start(target: Target) -> bool:
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
