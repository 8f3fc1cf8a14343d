"""Ranks of a torchrun job that calls torchtop.start() are told apart in `ps` and the picker."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import torchtop
from torchtop.transport import list_agents
from torchtop.tui.app import TorchtopApp
from torchtop.tui.screens.picker import describe

JOB = """\
import time, torchtop
torchtop.start(ops=False)
for _ in range(600):
    time.sleep(0.1)
"""


def test_ps_and_the_picker_show_rank_world_size_and_run(tmp_path: Path) -> None:
    (tmp_path / "ddp.py").write_text(JOB)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "ddp.py"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while len(list_agents()) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        agents = list_agents()
        assert len(agents) == 2
        listed = json.loads(torchtop("ps", "--json").stdout)
        assert sorted((a["rank"], a["local_rank"], a["world_size"]) for a in listed) == [
            (0, 0, 2),
            (1, 1, 2),
        ]
        (run_id,) = {a["run_id"] for a in listed}
        assert run_id and all(a["restart_count"] == 0 and a["node_rank"] == 0 for a in listed)
        table = torchtop("ps").stdout.splitlines()
        assert table[0].split()[:4] == ["PID", "STARTED", "RANK", "RUN"]
        # The run's ranks together, by rank, under a line naming the run.
        assert table[1] == f"run {run_id}: 2 ranks of 2 on node 0"
        by_rank = sorted(agents, key=lambda a: a.identity["rank"])
        assert [line.split()[0] for line in table[2:4]] == [str(a.pid) for a in by_rank]
        # A headless recording with no PID: it says the run's ranks are there and how to
        # record one of them (the viewer opens the whole run: tests/viewer/test_ranks_view.py).
        out = torchtop("attach", "--headless", "--record", str(tmp_path / "r.ttr"))
        assert out.returncode == 1
        (line,) = out.stderr.splitlines()
        assert f"the 2 agents running are the ranks of run {run_id}" in line
        assert f"`torchtop attach {by_rank[0].pid} --headless --record FILE` for rank 0" in line
        for agent in agents:
            (row,) = [line for line in table if line.split()[0] == str(agent.pid)]
            assert f"{agent.identity['rank']}/2  {run_id}" in row
        for agent in agents:
            assert f"rank {agent.identity['rank']}/2 of run {run_id}  ddp.py" in describe(agent)

        async def shown() -> list[str]:
            app = TorchtopApp.picker()
            async with app.run_test(size=(120, 20)) as pilot:
                await pilot.pause()
                options = app.screen.query_one("OptionList")
                return [str(options.get_option_at_index(i).prompt) for i in range(2)]

        assert sorted(asyncio.run(shown())) == sorted(describe(a) for a in agents)
    finally:
        launcher.terminate()
        launcher.wait(30)
