"""The run view with ranks of several nodes (``torchtop attach --node``): one row per rank even
where two nodes' pids are equal, a node column once more than one node is shown, a lost node's
ranks marked lost, and ``enter`` on another node's rank saying where to open it."""

from __future__ import annotations

import asyncio

from textual.widgets import DataTable

from torchtop.protocol import Hello, LogLine, Message
from torchtop.streams.runs import RunFold
from torchtop.streams.sources import attach_rank
from torchtop.tui.app import TorchtopApp


def hello(rank: int, pid: int, host: str) -> Hello:
    return Hello(
        protocol=1, pid=pid, argv=["train.py"], cwd="/", started_at=1.0, python="3.11",
        torch="2.3", devices=[], interval_s=0.1, hostname=host, rank=rank, local_rank=rank % 2,
        world_size=4, node_rank=rank // 2, run_id="run", restart_count=0,
    )  # fmt: skip


class TwoNodes(RunFold):
    """Ranks 0-1 on this machine, 2-3 on node ``b`` with the same pids, queued as the feeds
    queue them."""

    on_quit = "detaches"

    def __init__(self) -> None:
        super().__init__()
        self.going = True

    @property
    def started(self) -> bool:
        return True

    def start(self) -> None:
        pass

    def feed(self, stream: str, message: Message, node: str | None = None) -> None:
        if node is not None:
            self.remote[stream] = node
        self.queue(stream, message)

    def running(self) -> bool:
        return self.going

    def stop_job(self) -> None:
        self.going = False

    def status(self) -> tuple[str, bool]:
        return "attached", self.going


def rows(table: DataTable[str]) -> list[list[str]]:
    return [list(map(str, table.get_row_at(i))) for i in range(table.row_count)]


def test_ranks_of_two_nodes_with_equal_pids_show_side_by_side_with_their_node() -> None:
    run = TwoNodes()
    run.feed("100", hello(0, 100, "a"))
    run.feed("101", hello(1, 101, "a"))

    async def drive() -> None:
        app = TorchtopApp.for_run(run, "run", open_rank=attach_rank)
        async with app.run_test(size=(120, 30)) as pilot:
            table: DataTable[str] = app.run_screen.query_one("#ranks", DataTable)
            await pilot.pause(0.6)
            # One node: no node column.
            assert [str(c.label) for c in table.columns.values()][:2] == ["rank", "pid"]
            run.feed("b/100", hello(2, 100, "a"), node="b")
            run.feed("b/101", hello(3, 101, "a"), node="b")
            await pilot.pause(0.6)
            assert [str(c.label) for c in table.columns.values()][:3] == ["node", "rank", "pid"]
            assert sorted((r[0], r[1], r[2]) for r in rows(table)) == [
                ("a", "0", "100"), ("a", "1", "101"), ("b", "2", "100"), ("b", "3", "101"),
            ]  # fmt: skip
            # Node b is lost: its ranks say so, the others run on.
            run.lost_nodes["b"] = "ssh exited 255"
            run.queue(None, LogLine(t=2.0, stream="stderr", text="node b lost"))
            await pilot.pause(1.3)
            states = {r[1]: r[3] for r in rows(table)}
            assert states == {"0": "running", "1": "running", "2": "lost", "3": "lost"}
            # Enter on a rank of node b says where its screens open, and stays here.
            table.move_cursor(row=[r[1] for r in rows(table)].index("2"))
            await pilot.press("enter")
            await pilot.pause(0.2)
            assert app.run_screen.open_pid is None and app.is_running
            notes = [str(n.message) for n in app._notifications]
            assert any("runs on node b" in n for n in notes), notes

    asyncio.run(drive())
