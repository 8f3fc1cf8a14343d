from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

import psutil
import pytest

from torchtop.agent.probes.base import ProbeUnavailable
from torchtop.agent.probes.host import HostProbe


class FakeProcess:
    """A psutil.Process stand-in whose methods can be made to fail one by one."""

    def __init__(self, fail: dict[str, Exception] | None = None) -> None:
        self.pid = 4242
        self.fail = fail or {}
        self.children_calls = 0
        self.child_count = 3
        self.cpu_calls = 0

    @contextlib.contextmanager
    def oneshot(self) -> Iterator[None]:
        yield

    def _maybe_fail(self, name: str) -> None:
        if name in self.fail:
            raise self.fail[name]

    def memory_info(self) -> object:
        self._maybe_fail("memory_info")

        class Info:
            rss = 512 * 1024 * 1024

        return Info()

    def cpu_percent(self, interval: float | None = None) -> float:
        assert interval is None, "the probe must never block in cpu_percent"
        self._maybe_fail("cpu_percent")
        self.cpu_calls += 1
        return 0.0 if self.cpu_calls == 1 else 187.5

    def num_threads(self) -> int:
        self._maybe_fail("num_threads")
        return 23

    def children(self, recursive: bool = False) -> list[object]:
        assert recursive
        self._maybe_fail("children")
        self.children_calls += 1
        return [object()] * self.child_count


def test_reads_the_current_process() -> None:
    probe = HostProbe()
    first = probe.read()
    second = probe.read()
    me = psutil.Process()
    assert first.rss_bytes is not None and first.rss_bytes > 10 * 1024 * 1024
    assert abs(first.rss_bytes - me.memory_info().rss) < 64 * 1024 * 1024
    assert first.threads is not None and first.threads >= 1
    assert first.system_total_bytes == psutil.virtual_memory().total
    assert first.system_used_bytes is not None and first.system_total_bytes is not None
    assert 0 < first.system_used_bytes < first.system_total_bytes
    assert first.children is not None and first.children >= 0
    # The first cpu_percent only starts psutil's measurement.
    assert first.cpu_percent is None
    assert second.cpu_percent is not None and second.cpu_percent >= 0.0


def test_counts_child_processes() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        stats = HostProbe().read()
        assert stats.children is not None and stats.children >= 1
    finally:
        child.kill()
        child.wait()


def test_children_are_counted_every_n_reads_and_reused_between() -> None:
    process = FakeProcess()
    probe = HostProbe(process, children_every=10)
    seen = []
    for i in range(25):
        if i == 5:
            process.child_count = 7  # a new worker appears between two counts
        seen.append(probe.read().children)
    assert process.children_calls == 3  # reads 0, 10 and 20
    assert seen[:10] == [3] * 10
    assert seen[10:] == [7] * 15


def test_a_field_that_fails_is_none_and_the_rest_come_through() -> None:
    process = FakeProcess(
        fail={
            "memory_info": psutil.AccessDenied(4242),
            "children": psutil.AccessDenied(4242),
        }
    )
    probe = HostProbe(process)
    probe.read()
    stats = probe.read()
    assert stats.rss_bytes is None
    assert stats.children is None
    assert stats.threads == 23
    assert stats.cpu_percent == 187.5
    assert stats.system_total_bytes is not None


def test_cpu_percent_that_cannot_be_read_is_none() -> None:
    probe = HostProbe(FakeProcess(fail={"cpu_percent": OSError("nope")}))
    assert probe.read().cpu_percent is None
    assert probe.read().cpu_percent is None


def test_a_process_that_is_gone_makes_the_probe_unavailable() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    process = psutil.Process(child.pid)
    child.wait()
    probe = HostProbe(process)
    with pytest.raises(ProbeUnavailable, match=f"process {child.pid} is gone"):
        probe.read()


def test_vanishing_during_the_children_walk_is_also_gone() -> None:
    process = FakeProcess(fail={"children": psutil.NoSuchProcess(4242)})
    with pytest.raises(ProbeUnavailable):
        HostProbe(process).read()


def test_children_every_must_be_positive() -> None:
    with pytest.raises(ValueError):
        HostProbe(children_every=0)


def test_the_cpus_it_may_use_and_the_jobs_processes_on_the_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the CPU-oversubscription advice weighs torch's threads against: the affinity (not
    the machine's count) and torchrun's LOCAL_WORLD_SIZE."""
    import os

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    stats = HostProbe().read()
    assert stats.cpus == len(os.sched_getaffinity(0)) and stats.local_processes == 4
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert HostProbe().read().local_processes is None  # a single process
    # Pinned to one CPU, a process has one, however many the machine has.
    pinned = subprocess.run(
        [sys.executable, "-c", "from torchtop.agent.probes.host import HostProbe as H; "
         "print(H().read().cpus)"],
        preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}),
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert pinned.stdout.strip() == "1"


def test_full_every_reads_psutil_once_in_n_and_the_rss_alone_between() -> None:
    # A FakeProcess's pid does not exist here: /proc/4242/statm cannot be opened, so every read
    # is a full one, as on a platform without /proc.
    fake = FakeProcess()
    probe = HostProbe(fake, full_every=5)
    for _ in range(5):
        probe.read()
    assert fake.cpu_calls == 5

    # The real process: psutil on reads 1, 4, 7; the RSS from /proc/self/statm in between.
    probe = HostProbe(full_every=3)
    first = probe.read()
    calls = []
    original = probe._read_full

    def counted() -> object:
        calls.append(1)
        return original()

    probe._read_full = counted  # type: ignore[method-assign]
    between = [probe.read() for _ in range(6)]
    probe.close()
    assert len(calls) == 2
    assert all(stats.rss_bytes is not None and stats.rss_bytes > 0 for stats in between)
    assert between[0].threads == first.threads
    assert between[0].system_total_bytes == first.system_total_bytes
    with pytest.raises(ValueError):
        HostProbe(full_every=0)
