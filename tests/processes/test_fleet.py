"""The fleet simulator (``benchmarks/fleet.py``): simulated ranks that speak the real protocol
from a real recording, seen by torchtop's own readers as the ranks of one run on their nodes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from benchmarks.fleet import Fleet
from torchtop.model.run_advice import died
from torchtop.streams.runs import AttachedRun
from torchtop.transport import list_agents, pid_alive

pytestmark = pytest.mark.slow


@pytest.fixture
def fleet(fleet_recording: Path, runtime_dir: Path) -> Iterator[Fleet]:
    simulated = Fleet(fleet_recording, ranks=6, nodes=2, root=runtime_dir, dead=4, dead_after_s=1.0)
    yield simulated.start()
    simulated.stop()


def test_each_node_sees_its_ranks_of_the_run_stepping_on(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHTOP_RUNTIME_DIR", str(fleet.node_dir(0)))
    agents = list_agents()
    assert sorted(a.identity["rank"] for a in agents) == [0, 1, 2]  # type: ignore[type-var]
    assert {a.identity["run_id"] for a in agents} == {"sim"}
    assert {a.identity["world_size"] for a in agents} == {6}
    run = AttachedRun(agents)
    run.start()
    try:
        deadline = time.monotonic() + 60
        loop = fleet.steps_per_loop
        totals: dict[str, int] = {}
        while time.monotonic() < deadline:
            time.sleep(0.25)
            run.drain()
            totals = {s: job.training.total for s, job in run.model.jobs.items()}
            if len(totals) == 3 and min(totals.values()) > loop:
                break
        # Every rank's hello names its own pid and rank, and its steps go on past one loop.
        assert len(totals) == 3 and min(totals.values()) > loop > 0, (totals, loop)
        hellos = {job.hello.pid: job.hello.rank for job in run.model.jobs.values() if job.hello}
        assert hellos == {a.pid: a.identity["rank"] for a in agents}
    finally:
        run.stop_job()


def test_a_dead_rank_is_gone_from_its_node(fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHTOP_RUNTIME_DIR", str(fleet.node_dir(1)))
    (dead,) = [m for m in fleet.members if m.rank == 4]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and pid_alive(dead.pid):
        time.sleep(0.2)
    assert not pid_alive(dead.pid)
    assert sorted(a.identity["rank"] for a in list_agents()) == [3, 5]  # type: ignore[type-var]


def test_a_killed_rank_shows_dead_in_an_attached_run(
    fleet_recording: Path, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``torchtop attach`` with no PID follows a run's ranks: one killed while it watches is
    dead in its model (its exit says the process is gone: the socket's peer is the rank's own
    process), and the other ranks go on."""
    simulated = Fleet(fleet_recording, ranks=3, nodes=1, root=runtime_dir, dead=1, dead_after_s=1e9)
    simulated.start()
    monkeypatch.setenv("TORCHTOP_RUNTIME_DIR", str(simulated.node_dir(0)))
    run = AttachedRun(list_agents())
    run.start()
    try:
        (dead,) = [m for m in simulated.members if m.rank == 1]

        def folded(ready: Callable[[], bool]) -> bool:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                run.drain()
                if ready():
                    return True
                time.sleep(0.1)
            return False

        assert folded(lambda: len(run.model) == 3 and all(j.training.total for j in run.model))
        simulated.kill_dead()
        job = run.model.jobs[str(dead.pid)]
        assert folded(lambda: died(job)), job.exit
        assert job.exit is not None and "the job is gone" in job.exit.reason
        others = [j for s, j in run.model.jobs.items() if s != str(dead.pid)]
        assert not any(died(j) or j.job_ended for j in others)
    finally:
        run.stop_job()
        simulated.stop()
