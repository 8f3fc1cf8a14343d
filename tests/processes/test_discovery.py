"""Finding agents: the one filter every consumer uses, and the one scan loop, on real processes
(a child's ancestry) and real description files in a private runtime directory."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from torchtop.streams.discovery import Agents, AgentScan, launcher_of, run_of
from torchtop.transport import AgentInfo, bind_server


def info(pid: int, **identity: int | str | None) -> AgentInfo:
    return AgentInfo(pid=pid, argv=["train.py"], started_at=0.0, address=f"/x/{pid}.sock",
                     identity=dict(identity))  # fmt: skip


def test_a_single_process_is_its_own_run_and_a_rank_is_in_its_run_id() -> None:
    assert run_of(info(41)) == "41"
    assert run_of(info(42, rank=0, run_id="job7")) == "job7"


def test_each_condition_must_hold() -> None:
    rank = info(42, rank=1, run_id="job7")
    single = info(41)
    assert Agents()(rank) and Agents()(single)
    assert Agents(pid=42)(rank) and not Agents(pid=42)(single)
    assert Agents(ranks_only=True)(rank) and not Agents(ranks_only=True)(single)
    assert Agents(run="job7")(rank) and not Agents(run="job8")(rank)
    assert Agents(run="41")(single) and not Agents(run="job7")(single)
    assert not Agents(ranks_only=True, run="job8")(rank)
    assert not Agents(not_pid=42)(rank)


def test_an_agent_that_names_no_identity_yet_passes_the_run_only_when_asked() -> None:
    unnamed = info(43)
    assert not Agents(run="job7")(unnamed)
    assert Agents(run="job7", unidentified=True)(unnamed)
    assert not Agents(run="job7", unidentified=True)(info(44, rank=0, run_id="job8"))


def test_below_follows_the_real_process_tree() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert Agents(below=os.getpid())(info(child.pid))
        assert not Agents(below=child.pid)(info(os.getpid()))
        assert launcher_of(child.pid, {os.getpid(), 1_000_000}) == os.getpid()
        assert launcher_of(child.pid, {1_000_000}) is None
    finally:
        child.kill()
        child.wait()
    # A process that is gone descends from nothing.
    assert not Agents(below=os.getpid())(info(child.pid))
    assert launcher_of(child.pid, {os.getpid()}) is None


@pytest.fixture
def agents_dir(runtime_dir: Path) -> Iterator[Callable[..., None]]:
    """Real agent description files and sockets (as :func:`bind_server` makes them) for this
    process, in the test's own runtime directory."""
    servers: list[socket.socket] = []

    def describe(pid: int, **identity: int | str | None) -> None:
        server, _info = bind_server(pid, ["train.py"], 0.0, identity)
        servers.append(server)

    yield describe
    for server in servers:
        server.close()


def test_the_scan_hands_each_accepted_agent_on_once(agents_dir: Callable[..., None]) -> None:
    found: list[int] = []
    asked: list[int] = []

    def accepts(i: AgentInfo) -> bool:
        asked.append(i.pid)
        return i.identity.get("rank") is not None

    scan = AgentScan(accepts, lambda i: found.append(i.pid), interval_s=60, name="t")
    agents_dir(os.getpid(), rank=0, run_id="r")
    scan.scan_once()
    scan.scan_once()
    assert found == [os.getpid()]
    assert asked == [os.getpid()]


def test_a_refused_agent_is_asked_again_unless_remembered(agents_dir: Callable[..., None]) -> None:
    agents_dir(os.getpid())
    for remember, times in ((False, 2), (True, 1)):
        asked: list[int] = []

        def refuse(i: AgentInfo, asked: list[int] = asked) -> bool:
            asked.append(i.pid)
            return False

        scan = AgentScan(refuse, lambda i: None, interval_s=60, name="t", remember_refused=remember)
        scan.scan_once()
        scan.scan_once()
        assert len(asked) == times


def test_nothing_is_found_after_close(agents_dir: Callable[..., None]) -> None:
    agents_dir(os.getpid(), rank=0, run_id="r")
    found = threading.Event()
    scan = AgentScan(lambda i: True, lambda i: found.set(), interval_s=0.01, name="t")
    scan.close()
    scan.scan_once()
    assert not found.is_set()
