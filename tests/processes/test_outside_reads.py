"""What a viewer reads of the job from outside it, the agent leaves to it; and a viewer that
takes samples at its own pace gets one a second.

A real job under its agent, real connections: a viewer that says it reads the process from
outside gets samples with the RSS alone while it is the only one; a second viewer that does
not (an older one) brings the agent's full reads back, and they stop again when it leaves.
The feed fills those fields itself, so that what is recorded is complete either way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.fakes.nvml import FakeNvmlBackend, uuid_of
from torchtop.agent.probes.nvml import NvmlProbe
from torchtop.protocol import PROTOCOL_VERSION, DeviceInfo, Hello, HostStats, Sample
from torchtop.streams.feed import AgentFeed
from torchtop.streams.outside import OutsideReader, SharedNvml
from torchtop.streams.recording import RecordingWriter, read_recording
from torchtop.transport import AgentConnection, AgentInfo, list_agents

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture
def agent() -> Iterator[tuple[subprocess.Popen[bytes], AgentInfo]]:
    yield from _job()


@pytest.fixture
def moving_agent() -> Iterator[tuple[subprocess.Popen[bytes], AgentInfo]]:
    """A job whose memory moves every step: no sample of it repeats the last."""
    yield from _job("--churn")


def _job(*options: str) -> Iterator[tuple[subprocess.Popen[bytes], AgentInfo]]:
    script = str(SCRIPTS / "idle_job.py")
    job = subprocess.Popen(
        [sys.executable, "-m", "torchtop.agent.bootstrap", script, "120", *options],
        env={**os.environ, "TORCHTOP_AGENT_OPTIONS": json.dumps({"ops": False, "nvml": False})},
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while not (agents := [a for a in list_agents() if a.pid == job.pid]):
            assert time.monotonic() < deadline, "the agent did not start"
            assert job.poll() is None, "the job ended before its agent listened"
            time.sleep(0.05)
        yield job, agents[0]
    finally:
        job.kill()
        job.wait()


class _Reader:
    """A raw connection's samples, read in a thread, from a moment on."""

    def __init__(self, address: str, outside: list[str]) -> None:
        self.conn = AgentConnection(address, outside=outside)
        self.samples: list[tuple[float, HostStats]] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for message in self.conn.messages():
            if isinstance(message, Sample) and message.host is not None:
                self.samples.append((time.monotonic(), message.host))

    def since(self, t: float) -> list[HostStats]:
        return [host for at, host in list(self.samples) if at >= t]

    def close(self) -> None:
        self.conn.close()


def _full(host: HostStats) -> bool:
    return host.threads is not None


def _settle() -> float:
    """A moment for the agent to see a viewer come or go, then 'from now'."""
    time.sleep(1.5)
    return time.monotonic()


def test_the_agent_reads_the_rss_alone_while_every_viewer_reads_the_rest(agent) -> None:
    _, info = agent
    outside = _Reader(info.address, ["host", "nvml"])
    try:
        t0 = _settle()
        time.sleep(2.5)
        alone = outside.since(t0)
        # An idle job's samples that repeat the last one are left out: one a second at least.
        assert len(alone) >= 2
        assert all(h.rss_bytes and h.rss_bytes > 0 for h in alone)
        assert not any(_full(h) for h in alone), "the agent read psutil with no one needing it"

        older = _Reader(info.address, [])  # a viewer that reads nothing from outside
        try:
            t1 = _settle()
            time.sleep(2.5)
            both = outside.since(t1)
            assert both and all(_full(h) for h in both)
            assert all(_full(h) for h in older.since(t1))
        finally:
            older.close()
        t2 = _settle()
        time.sleep(2.5)
        after = outside.since(t2)
        assert after and not any(_full(h) for h in after)
    finally:
        outside.close()


@pytest.mark.parametrize("by", ["pid", "address"])
def test_the_feed_fills_in_what_it_reads_and_records_it(agent, tmp_path: Path, by: str) -> None:
    """By pid (``torchtop run``), or by the socket alone (attach): the job is the process at
    the socket's other end."""
    job, info = agent
    path = tmp_path / "rec.jsonl"
    writer = RecordingWriter(path)
    where = {"pid": job.pid} if by == "pid" else {"address": info.address}
    feed = AgentFeed(**where, writer=writer, client="recorder").start()
    try:
        assert feed.connected.wait(10)
        time.sleep(5.0)
    finally:
        feed.close()
        feed.join(5)
        writer.close()
    assert feed.outside is not None and feed.outside.names()[0] == "host"
    messages = read_recording(path).messages
    samples = [m for m in messages if isinstance(m, Sample) and m.host is not None]
    assert len(samples) >= 4  # an idle job sends a sample a second at least
    later = samples[len(samples) // 2 :]  # past the first reads (CPU needs two)
    assert all(h.threads is not None and h.threads >= 2 for h in (s.host for s in later))
    assert all(s.host.cpu_percent is not None for s in later)
    assert all(s.host.system_total_bytes for s in later)
    assert all(s.host.children == 0 for s in later)  # an idle job forks nothing
    rss = [s.host.rss_bytes for s in later]
    assert all(r is not None and r > 10 << 20 for r in rss)
    assert any(isinstance(m, Hello) for m in messages)


def test_a_pid_that_is_not_the_agents_job_is_not_read_from_outside(agent) -> None:
    job, info = agent
    assert OutsideReader.for_job(job.pid, info.started_at) is not None
    # The same pid number seen from another pid namespace names another process.
    assert OutsideReader.for_job(job.pid, info.started_at - 3600) is None
    assert OutsideReader.for_job(None) is None
    assert OutsideReader.for_job(2**22 + 12345) is None


def test_gpus_read_outside_once_for_every_feed_and_matched_to_each_job() -> None:
    """NVML (the fake: no GPU here) read by the feed's side for the agent: one NVML read
    serves every reader of the process, each reader matches the GPUs to its own job's CUDA
    devices, and none makes a ``gpu`` frame while the agent sends its own."""
    backend = FakeNvmlBackend.four_h100_out_of_cuda_order()
    shared = SharedNvml(NvmlProbe(backend))
    me = psutil.Process()
    readers = [OutsideReader(me, nvml=shared) for _ in range(8)]
    assert readers[0].names() == ["host", "nvml"]
    # This job sees NVML's GPU 2 as cuda:0 and GPU 0 as cuda:1 (CUDA_VISIBLE_DEVICES=2,0).
    readers[0].hello(_hello([uuid_of(2), uuid_of(0)]))
    gpu = readers[0].gpu()
    assert gpu is not None
    assert [(g.cuda_device, g.uuid) for g in gpu.gpus[:2]] == [
        ("cuda:0", uuid_of(2)),
        ("cuda:1", uuid_of(0)),
    ]
    assert [g.in_job for g in gpu.gpus] == [True, True, False, False]
    for reader in readers[1:]:
        rows = reader.gpu()
        assert rows is not None and [g.in_job for g in rows.gpus] == [None] * 4  # no CUDA yet
    assert backend.calls[("utilization", 0)] == 1, "eight readers read NVML more than once"
    quiet = OutsideReader(me, nvml=shared)
    quiet.agent_gpu()  # the agent sends its own (another viewer needs it): none made here
    assert quiet.gpu() is None


def test_no_nvml_here_means_the_agent_keeps_it() -> None:
    shared = SharedNvml(NvmlProbe(FakeNvmlBackend(init_error="libnvidia-ml.so.1 not found")))
    reader = OutsideReader.for_job(os.getpid(), nvml=shared)
    assert reader is not None and reader.names() == ["host"]
    assert reader.gpu() is None
    assert shared.failure is not None and "libnvidia-ml" in shared.failure


def _hello(uuids: list[str]) -> Hello:
    devices = [DeviceInfo(id="cpu", name="x86_64")] + [
        DeviceInfo(id=f"cuda:{i}", name="NVIDIA H100 80GB HBM3", uuid=u)
        for i, u in enumerate(uuids)
    ]
    return Hello(
        protocol=PROTOCOL_VERSION,
        pid=os.getpid(),
        argv=[],
        cwd="",
        started_at=time.time(),
        python="3.11",
        torch="2.13.0",
        devices=devices,
        interval_s=0.1,
        hostname="node",
    )


def test_a_paced_viewer_gets_a_sample_a_second_and_everything_else(moving_agent) -> None:
    _, info = moving_agent
    counts: dict[str, dict[str, int]] = {"full": {}, "paced": {}}

    def read(name: str, conn: AgentConnection) -> None:
        for message in conn.messages():
            kind = type(message).__name__
            counts[name][kind] = counts[name].get(kind, 0) + 1

    full = AgentConnection(info.address)
    paced = AgentConnection(info.address, pace_s=1.0)
    threads = [
        threading.Thread(target=read, args=(name, conn), daemon=True)
        for name, conn in (("full", full), ("paced", paced))
    ]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # past the history replay
    before = {name: dict(c) for name, c in counts.items()}
    time.sleep(6.0)
    full.close()
    paced.close()
    got = {
        name: {k: v - before[name].get(k, 0) for k, v in counts[name].items()} for name in counts
    }
    assert 4 <= got["paced"]["Sample"] <= 8, got
    assert got["full"]["Sample"] >= 5 * got["paced"]["Sample"], got
    # The agent's own stats, once a second, go to both.
    assert got["paced"].get("AgentStats", 0) >= 4, got
