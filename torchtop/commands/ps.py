"""``torchtop ps``: the running agents of this user, grouped by run."""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING

from torchtop.commands.core import (
    VERB_HELP,
    Subparsers,
    check_runtime_dir,
)
from torchtop.streams.discovery import launcher_of
from torchtop.text import printable
from torchtop.transport import list_agents

if TYPE_CHECKING:
    from torchtop.transport import AgentInfo


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    ps = sub.add_parser(
        "ps", help=VERB_HELP["ps"], description="List the running agents of this user."
    )
    ps.add_argument("--json", action="store_true", help="print a JSON list")
    return ps


def run(args: argparse.Namespace) -> int:

    check_runtime_dir()
    agents = list_agents()
    launchers = launchers_of_runs(agents)
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

    def rank_of(a: AgentInfo) -> str:
        return "launcher" if a.pid in launchers else a.rank_label

    def run_of(a: AgentInfo) -> str:
        return launchers.get(a.pid, a.run_label)

    rank_w = max([len("RANK"), *(len(shown(rank_of(a))) for a in agents)])
    run_w = max([len("RUN"), *(len(shown(run_of(a))) for a in agents)])
    rank_head = f"{'RANK':>{rank_w}}  {'RUN':{run_w}}  " if ranked else ""
    print(f"{'PID':>8}  {'STARTED':19}  {rank_head}{'ADDRESS':40}  COMMAND")
    for run, members in by_run(agents, launchers):
        if run:
            # The ranks of one run together, under a line that says what they are.
            print(f"run {shown(run)}: {_ranks_line(members)}")
        for a in members:
            started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(a.started_at))
            rank = f"{shown(rank_of(a)):>{rank_w}}  {shown(run_of(a)):{run_w}}  " if ranked else ""
            print(f"{a.pid:>8}  {started:19}  {rank}{shown(a.address):40}  {shown(a.command)}")
    return 0


def launchers_of_runs(agents: list[AgentInfo]) -> dict[int, str]:
    """The agents of single processes that started the ranks of a run (the parent of
    ``torch.multiprocessing.spawn``, a job whose subprocesses are a scheduler's tasks), by pid,
    with the run's label."""

    singles = {a.pid for a in agents if not a.rank_label}
    found: dict[int, str] = {}
    for a in agents:
        if a.rank_label and a.run_label:
            launcher = launcher_of(a.pid, singles)
            if launcher is not None:
                found.setdefault(launcher, a.run_label)
    return found


def by_run(
    agents: list[AgentInfo], launchers: dict[int, str] | None = None
) -> list[tuple[str, list[AgentInfo]]]:
    """Agents grouped by run (single processes under ``""``, first), each run's launcher
    first (``launchers``: see :func:`launchers_of_runs`), then its ranks by rank."""
    launchers = launchers or {}
    groups: dict[str, list[AgentInfo]] = {}
    for a in agents:
        groups.setdefault(a.run_label if a.rank_label else launchers.get(a.pid, ""), []).append(a)
    for members in groups.values():
        members.sort(
            key=lambda a: (a.identity.get("rank") is not None, a.identity.get("rank") or 0)
        )
    return sorted(groups.items(), key=lambda item: (item[0] != "", item[0]))


def _ranks_line(members: list[AgentInfo]) -> str:
    """``4 ranks of 4 on nodes 0, 1`` for the agents of one run."""
    ranks = [a for a in members if a.identity.get("rank") is not None]
    world = {a.identity.get("world_size") for a in members} - {None}
    nodes = sorted({n for a in members if isinstance(n := a.identity.get("node_rank"), int)})
    line = f"{len(ranks)} rank{'s' if len(ranks) != 1 else ''}"
    if len(world) == 1:
        line += f" of {world.pop()}"
    if nodes:
        line += f" on node{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes))}"
    return line
