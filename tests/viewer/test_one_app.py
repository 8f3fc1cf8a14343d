"""The viewer is one app: ``enter`` on a rank's row in the run's view opens that rank's job
screen in the same app, and its ``q`` comes back to the run as it was (the same model, the same
rows, the log not written again); ``q`` on the run's view quits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fakes.source import FakeSource
from test_nodes_view import TwoNodes, hello, rows
from test_tui_app import cuda_job, pilot_test, static_text
from textual.widgets import DataTable, RichLog

from torchtop.protocol import LogLine
from torchtop.streams.runs import RunFold
from torchtop.streams.source import Source
from torchtop.transport import AgentInfo, bind_server
from torchtop.tui.app import TorchtopApp
from torchtop.tui.screens.help import HelpScreen
from torchtop.tui.screens.job import JobScreen
from torchtop.tui.screens.picker import PickerScreen
from torchtop.tui.screens.run import RunScreen
from torchtop.tui.widgets.header import JobHeader

SIZE = (160, 40)


class Ranks:
    """Opens a rank as ``attach_rank`` would, on a fake source of a CUDA job; records each."""

    def __init__(self) -> None:
        self.opened: list[int] = []
        self.sources: list[FakeSource] = []

    def __call__(self, run: RunFold, pid: int) -> tuple[Source, str]:
        self.opened.append(pid)
        source = FakeSource(cuda_job())
        self.sources.append(source)
        return source, f"rank {pid - 100}: train.py"


def two_ranks() -> TwoNodes:
    run = TwoNodes()
    run.feed("100", hello(0, 100, "a"))
    run.feed("101", hello(1, 101, "a"))
    run.queue(None, LogLine(t=1.0, stream="stdout", text="[rank1]:hello from rank 1"))
    return run


@pilot_test
async def test_a_rank_opens_in_the_same_app_and_q_comes_back_to_the_run_as_it_was() -> None:
    run = two_ranks()
    ranks = Ranks()
    app = TorchtopApp.for_run(run, "run", open_rank=ranks)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(0.6)
        assert pilot.app is app
        the_app = id(app)
        run_screen = app.screen
        assert isinstance(run_screen, RunScreen) and run_screen is app.run_screen
        model = run.model
        table: DataTable[str] = run_screen.query_one("#ranks", DataTable)
        shown = rows(table)
        assert [r[:2] for r in shown] == [["0", "100"], ["1", "101"]]
        log = run_screen.query_one("#run-log", RichLog)
        logged = len(log.lines)
        assert logged == 1

        table.move_cursor(row=1)
        await pilot.press("enter")
        await pilot.pause()
        # Rank 1's job screen, pushed over the run's in the same app: the job's keys act on it.
        assert ranks.opened == [101]
        job = app.screen
        assert isinstance(job, JobScreen) and job.source is ranks.sources[0]
        assert app.shown_job is job and app.screen_stack[-2] is run_screen
        assert id(app) == the_app and app.is_running
        job.drain()
        await pilot.pause()
        assert "train.py" in static_text(job.query_one(JobHeader))
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        await pilot.pause()

        # Meanwhile the run goes on: what arrives is shown once back.
        run.queue(None, LogLine(t=2.0, stream="stdout", text="[rank0]:while away"))
        await pilot.press("q")
        await pilot.pause(0.4)
        assert app.screen is run_screen and id(app) == the_app and app.is_running
        assert ranks.sources[0].called("close") and not ranks.sources[0].called("stop_job")
        assert run.going  # coming back from a rank leaves the run running
        assert run.model is model
        assert run_screen.query_one("#ranks", DataTable) is table
        assert [r[:3] for r in rows(table)] == [r[:3] for r in shown]
        assert len(log.lines) == logged + 1  # the new line only: the log is not written again
        assert run_screen.query_one("#run-log", RichLog) is log

        # A second rank opens in the same app too.
        table.move_cursor(row=0)
        await pilot.press("enter")
        await pilot.pause()
        assert ranks.opened == [101, 100] and isinstance(app.screen, JobScreen)
        await pilot.press("q")
        await pilot.pause()
        assert app.screen is run_screen

        # q on the run's view stops the job (the launcher's ranks) and quits.
        await pilot.press("q")
        await pilot.pause()
    assert not app.is_running and not run.going
    assert id(app) == the_app


@pilot_test
async def test_the_run_view_offers_none_of_the_job_s_keys() -> None:
    """The job screen's keys (the app's bindings) are off on the run's view: its footer shows
    its own two, and ? opens no help there."""
    app = TorchtopApp.for_run(two_ranks(), "run", open_rank=Ranks())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(0.6)
        keys = {key for key, active in app.screen.active_bindings.items() if active.enabled}
        assert {"q", "enter"} <= keys
        assert not {"l", "question_mark", "a", "t", "o", "m", "p", "escape"} & keys
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, RunScreen)
        await pilot.press("q")
        await pilot.pause()
    assert not app.is_running


@pilot_test
async def test_a_job_whose_processes_become_ranks_goes_on_on_its_run_in_the_same_app() -> None:
    """The job's screen gives way to its run's (``mp.spawn``'s ranks appeared): the same app,
    with the help the job had open closed first; ``q`` on the run's view quits the app."""
    app = TorchtopApp(FakeSource(cuda_job()), title="train.py")
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(0.3)
        job_screen = app.screen
        assert isinstance(job_screen, JobScreen)
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        run = two_ranks()
        app.show_run(run, "run", open_rank=Ranks())
        await pilot.pause(0.6)
        assert pilot.app is app and isinstance(app.screen, RunScreen)
        assert app.screen is app.run_screen and job_screen not in app.screen_stack
        table: DataTable[str] = app.screen.query_one("#ranks", DataTable)
        assert [r[:2] for r in rows(table)] == [["0", "100"], ["1", "101"]]
        await pilot.press("q")
        await pilot.pause()
    assert not app.is_running and not run.going


@pilot_test
async def test_the_agent_chosen_in_the_picker_opens_in_the_same_app(runtime_dir: Path) -> None:
    """``torchtop attach`` with several agents: the one chosen opens on its job screen in the
    picker's place, in the same app; an agent that cannot be opened is said in one line and
    the picker stays."""
    servers = [bind_server(os.getpid(), ["train.py", "--lr", "3e-4"], 0.0)[0]]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    servers.append(bind_server(child.pid, ["eval.py"], 1.0)[0])
    opened: list[int] = []
    refuse = [True]

    def open_agent(agent: AgentInfo) -> tuple[Source, str]:
        if refuse[0]:
            refuse[0] = False
            raise RuntimeError("cannot record to /nowhere/r.ttr: no such folder")
        opened.append(agent.pid)
        return FakeSource(cuda_job()), agent.command

    try:
        app = TorchtopApp.picker(open_agent)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause(0.3)
            picker = app.screen
            assert isinstance(picker, PickerScreen) and len(picker.agents) == 2
            await pilot.press("enter")
            await pilot.pause(0.3)
            assert app.screen is picker and opened == []  # said, and still offered
            assert any("no such folder" in str(n.message) for n in app._notifications)
            await pilot.press("enter")
            await pilot.pause(0.5)
            assert pilot.app is app and isinstance(app.screen, JobScreen)
            assert app.screen is app.job and picker not in app.screen_stack
            assert app.picked is not None and opened == [app.picked.pid]
            app.exit(0)
    finally:
        child.kill()
        child.wait()
        for server in servers:
            server.close()
