"""The live view of a run's ranks, for ``torchtop run`` and ``torchtop attach``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchtop.commands.core import (
    run_app,
)

if TYPE_CHECKING:
    from torchtop.streams.runs import RunFold


def view_run(run: RunFold, title: str) -> None:
    """The view of a run's ranks until it quits; ``enter`` on a rank opens that rank's full
    screens (the single-process viewer on its agent), whose ``q`` comes back to the run."""
    from torchtop.streams.sources import LiveSource, RankLines
    from torchtop.transport import find_agent
    from torchtop.tui.app import TorchtopApp
    from torchtop.tui.run_view import RunView

    while True:
        view = RunView(run, title=title)
        run_app(view)
        if view.open_pid is None:
            return
        info = find_agent(view.open_pid)
        if info is not None:
            rank = info.identity.get("rank")
            # A run torchtop launched has its ranks' output (their agents do not send it).
            lines = RankLines(run, rank) if isinstance(rank, int) and not run.rank_lines else None
            source = LiveSource(info.address, lines=lines)
            run_app(TorchtopApp(source, title=f"rank {rank}: {info.command}"))
