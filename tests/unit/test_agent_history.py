"""The agent's history: what a late viewer gets after a long, chatty job, and what it costs.

In-process (the agent is built but its sampler is not started): frames go through
``Agent.publish`` as the sampler, the OOM controller and the op sampler send them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import pytest

from tests.unit.test_server import _connect, _fail_once, _read
from tests.viewer.test_ops_tui import window
from torchtop.agent.core import (
    MAX_REQUESTED_SNAPSHOTS,
    SERVER_PROBE,
    SNAPSHOTS_PROBE,
    Agent,
    AgentConfig,
)
from torchtop.agent.oom.capture import _empty_capture, _fields
from torchtop.protocol import (
    REQUEST_SNAPSHOT,
    Hello,
    HostStats,
    MemorySnapshotTaken,
    MemoryStats,
    OpsWindow,
    PhaseBegan,
    ProbeStatus,
    Request,
    Sample,
)
from torchtop.transport import list_agents, remove_server_files, socket_path_for


@pytest.fixture
def agent() -> Iterator[Agent]:
    agent = Agent(AgentConfig(ops=False, nvml=False, oom_capture=False))
    agent.server.address = agent.info.socket_path  # type: ignore[attr-defined]
    agent.server.start()
    yield agent
    agent.server.stop(drain_s=0)
    remove_server_files(agent.pid)


def _answer(i: int) -> MemorySnapshotTaken:
    """An answer to a snapshot request, as the agent sends when it has nothing to save."""
    return MemorySnapshotTaken(**_fields(_empty_capture(i, "nothing to snapshot")), request_id=i)


def test_snapshot_answers_and_op_windows_never_push_out_phases(agent: Agent) -> None:
    agent.publish(PhaseBegan(t=1.0, name="warmup", id=1))
    agent.publish(ProbeStatus(t=1.0, probe="nvml", available=False, detail="no GPU"))
    for i in range(12_000):
        agent.publish(_answer(i))
    for i in range(2_000):
        agent.publish(window(window=i + 1))
    assert agent.server.history_bytes() < 20 << 20
    messages = _read(_connect(agent.server), 10_000, timeout=3)
    assert isinstance(messages[0], Hello)
    assert [m.name for m in messages if isinstance(m, PhaseBegan)] == ["warmup"]
    assert any(isinstance(m, ProbeStatus) and m.probe == "nvml" for m in messages)
    windows = [m for m in messages if isinstance(m, OpsWindow)]
    # Older windows keep their figures without their op tables; the latest is whole.
    assert windows[-1] == window(window=2_000)
    assert all(w.ops == [] and w.cumulative == [] for w in windows[:-1])
    assert windows[0] == dataclasses.replace(
        window(window=windows[0].window), ops=[], cumulative=[]
    )


def _sample(t: float, allocated: int = 1 << 20) -> Sample:
    memory = [
        MemoryStats(
            device="cpu", source="cpu-heap", allocated_bytes=allocated, reserved_bytes=2 << 20
        )
    ]
    host = HostStats(
        rss_bytes=2 << 20,
        cpu_percent=0.0,
        threads=3,
        children=0,
        system_used_bytes=1 << 30,
        system_total_bytes=4 << 30,
    )
    return Sample(t=t, host=host, memory=memory)


def test_a_job_that_holds_still_sends_a_sample_a_second(agent: Agent) -> None:
    sent: list[bytes] = []
    real = agent.server.publish
    agent.server.publish = lambda frame, *rest: (sent.append(frame), real(frame, *rest))  # type: ignore[method-assign]
    # Ten seconds of a job that holds still at 10 Hz, then one tick whose memory moved.
    for i in range(100):
        agent.publish(_sample(100 + i / 10))
    agent.publish(_sample(110.0, allocated=3 << 20))
    agent.publish(_sample(110.1, allocated=3 << 20))
    agent.publish(_sample(110.2, allocated=4 << 20))
    times = [m.t for m in _read(_connect(agent.server), 200, timeout=2) if isinstance(m, Sample)]
    # One a second while nothing moved (the viewers' heartbeat), then each tick that moved.
    assert times == pytest.approx([100.0 + s for s in range(10)] + [110.0, 110.2])
    assert len(sent) == 12


def test_snapshot_requests_are_capped_per_job(agent: Agent) -> None:
    served: list[Request] = []
    sent: list[object] = []
    agent.oom.handle_request = served.append  # type: ignore[method-assign]
    agent.publish = sent.append  # type: ignore[method-assign]
    for i in range(MAX_REQUESTED_SNAPSHOTS + 10):
        agent._on_request(Request(action=REQUEST_SNAPSHOT, id=i))
    assert len(served) == MAX_REQUESTED_SNAPSHOTS
    statuses = [m for m in sent if isinstance(m, ProbeStatus) and m.probe == SNAPSHOTS_PROBE]
    assert len(statuses) == 1 and not statuses[0].available
    assert f"at most {MAX_REQUESTED_SNAPSHOTS}" in statuses[0].detail


def test_a_failing_server_is_reported_on_stderr_and_to_viewers(
    agent: Agent, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _fail_once(monkeypatch, agent.server, "_pump", RuntimeError("boom"))
    agent.server._wake()
    messages = _read(_connect(agent.server), 3)
    statuses = [m for m in messages if isinstance(m, ProbeStatus) and m.probe == SERVER_PROBE]
    assert statuses and "restarted" in statuses[0].detail
    assert "torchtop: the agent's socket server failed (RuntimeError('boom')); restarted it" in (
        capfd.readouterr().err
    )


def test_an_attached_agent_tells_viewers_only(
    agent: Agent, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # `torchtop attach` starts its agent with stderr_notices off: the job's stderr stays its own.
    agent.config.stderr_notices = False
    _fail_once(monkeypatch, agent.server, "_pump", RuntimeError("boom"))
    agent.server._wake()
    messages = _read(_connect(agent.server), 3)
    statuses = [m for m in messages if isinstance(m, ProbeStatus) and m.probe == SERVER_PROBE]
    assert statuses and "restarted" in statuses[0].detail
    assert "torchtop" not in capfd.readouterr().err


def test_a_server_that_gives_up_removes_its_socket(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = Agent(AgentConfig(ops=False, nvml=False, oom_capture=False))

    def broken() -> None:
        raise OSError("selector broken")

    monkeypatch.setattr(agent.server, "_serve", broken)
    assert socket_path_for(agent.pid).exists()
    agent.server.start()
    deadline = time.monotonic() + 5
    while socket_path_for(agent.pid).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not socket_path_for(agent.pid).exists()
    assert list_agents() == []
    assert (
        "it closed its socket: the job runs on, but no viewer can attach" in capfd.readouterr().err
    )
