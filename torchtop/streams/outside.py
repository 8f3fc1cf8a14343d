"""A job read from outside: by itself when no agent can be started in it (:class:`OutsideWatch`),
or beside its agent, which leaves to its viewers what they can read themselves
(:class:`OutsideReader`).

What ``/proc`` and NVML tell any process of the same user: the job's RSS, CPU, threads and
children, and each GPU with the memory every process holds on it. No steps, no allocator, no op
timings: those live inside the job. The frames are the agent's own (``hello``, ``sample``,
``gpu``, ``probe_status``, ``exit``), read by the agent's probes pointed at the job's pid, so
the viewer, recordings and the report take them as they are.
"""

from __future__ import annotations

import contextlib
import os
import platform
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import psutil

from torchtop.agent.probes.base import ProbeUnavailable
from torchtop.agent.probes.cpu_memory import CpuMemoryProbe
from torchtop.agent.probes.host import HostProbe
from torchtop.agent.probes.nvml import NvmlProbe, matched
from torchtop.agent.sampler import Sampler
from torchtop.model.connection import SourceConnected, SourceDisconnected
from torchtop.protocol import (
    PROTOCOL_VERSION,
    DeviceInfo,
    GpuSample,
    GpuStats,
    Hello,
    HostStats,
    JobExited,
    Message,
    ProbeStatus,
    Sample,
)
from torchtop.streams.recording import RecordingWriter
from torchtop.streams.source import Sink, Source

#: The probe status's name: the same as an attached agent's, "what attach cannot see".
PROBE = "attach"


class OutsideWatch:
    """Samples ``pid`` from outside into ``publish`` until the job ends or :meth:`stop`."""

    def __init__(
        self,
        pid: int,
        publish: Callable[[Message], None],
        *,
        reason: str,
        interval_s: float = 0.5,
        nvml: bool = True,
    ) -> None:
        self.pid = pid
        self.reason = reason
        self.ended = threading.Event()
        self._publish = publish
        self._process = psutil.Process(pid)
        self._interval_s = interval_s
        nvml_probe = None
        if nvml:
            nvml_probe = NvmlProbe()
        self._nvml = nvml_probe
        # RSS stands for the job's memory: its heap cannot be read from outside.
        self._sampler = Sampler(
            publish,
            host=HostProbe(self._process),
            cpu_memory=CpuMemoryProbe(mallinfo=None),
            cuda_memory=None,
            nvml=nvml_probe,
            interval_s=interval_s,
            nvml_interval_s=max(interval_s, 0.5),
        )
        self._thread = threading.Thread(target=self._watch, name="torchtop-outside", daemon=True)

    def hello(self) -> Hello:
        """The job as ``/proc`` describes it; fields it hides are left empty."""
        process = self._process
        argv: list[str] = []
        cwd = ""
        with contextlib.suppress(psutil.Error):
            argv = process.cmdline()[1:]  # past the interpreter, as the agent's sys.argv
        with contextlib.suppress(psutil.Error):
            cwd = process.cwd()
        started = time.time()
        with contextlib.suppress(psutil.Error):
            started = process.create_time()
        return Hello(
            protocol=PROTOCOL_VERSION,
            pid=self.pid,
            argv=argv,
            cwd=cwd,
            started_at=started,
            python="?",
            torch=None,
            devices=[DeviceInfo(id="cpu", name=platform.processor() or platform.machine())],
            interval_s=self._interval_s,
            hostname=socket.gethostname(),
        )

    def status(self) -> ProbeStatus:
        detail = (
            f"watched from outside ({self.reason}): /proc and NVML only, no steps, allocator or "
            "op timings"
        )
        return ProbeStatus(t=time.time(), probe=PROBE, available=False, detail=detail)

    def start(self) -> OutsideWatch:
        self._publish(self.hello())
        self._publish(self.status())
        self._sampler.start()
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self.ended.is_set():
            if not _alive(self.pid):
                self._sampler.stop()
                reason = "the job ended (seen from outside: its exit code is unknown)"
                self._publish(JobExited(t=time.time(), exit_code=None, reason=reason))
                self.ended.set()
                break
            self.ended.wait(self._interval_s)

    def stop(self) -> None:
        self.ended.set()
        self._sampler.stop()
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.close()


def _alive(pid: int) -> bool:
    try:
        process = psutil.Process(pid)
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return os.path.exists(f"/proc/{pid}")


def outside_source(pid: int, reason: str, writer: RecordingWriter | None = None) -> Source:
    """The viewer's source for a job watched from outside (recorded too with ``writer``)."""
    return _OutsideSource(pid, reason, writer)


class _OutsideSource(Source):
    mode = "live"
    takes_requests = False  # no agent inside

    def __init__(self, pid: int, reason: str, writer: RecordingWriter | None) -> None:
        self.pid = pid
        self.reason = reason
        self.writer = writer
        self._watch: OutsideWatch | None = None

    def start(self, sink: Sink) -> None:
        def publish(message: Message) -> None:
            if self.writer is not None:
                with contextlib.suppress(Exception):
                    self.writer.write(message)
            sink(message)
            if isinstance(message, JobExited):
                sink(SourceDisconnected(t=time.time(), reason=message.reason))

        sink(SourceConnected(t=time.time(), address=f"/proc/{self.pid}"))
        self._watch = OutsideWatch(self.pid, publish, reason=self.reason).start()

    def close(self) -> None:
        if self._watch is not None:
            self._watch.stop()
        if self.writer is not None:
            self.writer.close()


# --------------------------------------------------------------------------------------------
# Reading for an agent: what its viewers read from outside while the agent leaves it to them
# --------------------------------------------------------------------------------------------

#: A job whose process started this much before or after its agent says is not the agent's
#: (a pid seen from another pid namespace): nothing is read from outside for it.
START_SLACK_S = 5.0
#: A sample older than this (the agent's history, sent at attach) keeps what the agent sent.
FILL_WITHIN_S = 2.0
#: How often the process table is walked for every reader of this process together.
CHILDREN_EVERY_S = 5.0


class SharedNvml:
    """One NVML reader for every feed of this process: a run view of 64 ranks on one node
    reads NVML once per interval, not 64 times. Each reader matches the rows to its own job's
    devices (:func:`~torchtop.agent.probes.nvml.matched`)."""

    def __init__(self, probe: NvmlProbe | None = None) -> None:
        self._probe = probe
        self._lock = threading.Lock()
        self._rows: list[GpuStats] | None = None
        self._read_at = -float("inf")
        #: Why NVML cannot be read here, once it was found so.
        self.failure: str | None = None

    def available(self) -> bool:
        """Whether NVML answers (started on the first call)."""
        return self.rows(max_age_s=float("inf")) is not None

    def rows(self, max_age_s: float) -> list[GpuStats] | None:
        """Every GPU's row, read at most ``max_age_s`` ago; ``None`` without NVML."""
        with self._lock:
            if self.failure is not None:
                return None
            now = time.monotonic()
            if self._rows is not None and now - self._read_at < max_age_s:
                return self._rows
            if self._probe is None:
                self._probe = NvmlProbe()
            try:
                self._rows = self._probe.read()
            except ProbeUnavailable as exc:
                self.failure = str(exc)
                return None
            except Exception as exc:  # a reader must never fail its feed
                self.failure = f"NVML failed: {exc!r}"
                return None
            self._read_at = now
            return self._rows


_SHARED_NVML: SharedNvml | None = None
_SHARED_LOCK = threading.Lock()


def shared_nvml() -> SharedNvml:
    """This process's NVML reader, made on first use."""
    global _SHARED_NVML
    with _SHARED_LOCK:
        if _SHARED_NVML is None:
            _SHARED_NVML = SharedNvml()
        return _SHARED_NVML


def children_by_parent(proc: str = "/proc") -> dict[int, list[int]]:
    """Each process's children, by its pid: one read of each ``/proc/PID/stat`` (the parent is
    the second field after the name, which may hold spaces and parentheses: it ends at the last
    ``)``). A quarter of the CPU psutil's walk takes (it builds a ``Process`` for each, and reads
    each ``stat`` twice), which a node running 1,000 processes notices. psutil's walk where
    there is no ``/proc``."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir(proc)
    except OSError:
        for process in psutil.process_iter(["ppid"]):
            ppid = process.info.get("ppid")
            if isinstance(ppid, int):
                children.setdefault(ppid, []).append(process.pid)
        return children
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"{proc}/{name}/stat", "rb") as stat:
                text = stat.read()
            ppid = int(text[text.rindex(b")") + 2 :].split(b" ", 2)[1])
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not a process's
            continue
        children.setdefault(ppid, []).append(int(name))
    return children


class _ProcessTable:
    """Children per process, from one walk of the process table every few seconds shared by
    every reader (a walk reads every process's ``stat``: one per reader would cost 64 walks for
    64 ranks)."""

    def __init__(self, every_s: float = CHILDREN_EVERY_S) -> None:
        self._every_s = every_s
        self._lock = threading.Lock()
        self._children: dict[int, list[int]] = {}
        self._walked_at = -float("inf")

    def descendants(self, process: psutil.Process) -> int:
        with self._lock:
            now = time.monotonic()
            if now - self._walked_at >= self._every_s:
                self._children, self._walked_at = children_by_parent(), now
            table = self._children
        count, todo, seen = 0, list(table.get(process.pid, ())), {process.pid}
        while todo:
            pid = todo.pop()
            if pid in seen:
                continue
            seen.add(pid)
            count += 1
            todo.extend(table.get(pid, ()))
        return count


_PROCESS_TABLE = _ProcessTable()


class OutsideReader:
    """What a feed reads of its job from outside it, for an agent that leaves it to its viewers.

    The feed says in its hello which figures it reads (:meth:`names`); while every viewer does,
    the agent's ``sample`` carries the RSS alone and it sends no ``gpu`` frames. The feed then
    fills the host's other fields into each ``sample`` (:meth:`sample`; psutil once a second,
    the process table shared) and makes the ``gpu`` frames itself (:meth:`gpu`; NVML shared by
    every feed of this process), so that the viewer, the recording and the report get the same
    frames as before. Where the agent sent a figure itself (another viewer needs it), that one
    is kept and nothing is added.
    """

    def __init__(
        self,
        process: psutil.Process,
        *,
        nvml: SharedNvml | None = None,
        host_every_s: float = 1.0,
        nvml_every_s: float = 0.5,
    ) -> None:
        self._process = process
        self._host = HostProbe(process, children_every=1, count_children=_PROCESS_TABLE.descendants)
        self._host_every_s = host_every_s
        self._host_at = -float("inf")
        self._host_last: HostStats | None = None
        self._nvml = nvml
        self._nvml_every_s = nvml_every_s
        self._nvml_at = -float("inf")
        self._agent_gpu_at = -float("inf")
        self._uuids: list[str | None] | None = None

    @classmethod
    def for_job(
        cls, pid: int | None, started_at: float | None = None, *, nvml: SharedNvml | None = None
    ) -> OutsideReader | None:
        """A reader for ``pid`` when this process can read it from outside (``None`` where it
        cannot: no such process here, ``/proc`` hidden, or a pid that is not the agent's job).
        NVML is read where it answers."""
        if pid is None:
            return None
        try:
            process = psutil.Process(pid)
            created = process.create_time()
            process.memory_info()
        except (psutil.Error, OSError):
            return None
        if started_at is not None and abs(created - started_at) > START_SLACK_S:
            return None
        if nvml is None:
            nvml = shared_nvml()
        return cls(process, nvml=nvml if nvml.available() else None)

    def names(self) -> list[str]:
        """The figures read here, for the feed's hello."""
        return ["host", "nvml"] if self._nvml is not None else ["host"]

    def hello(self, hello: Hello) -> None:
        """The job's CUDA devices, to match NVML's GPUs to (the agent says them again once the
        job has initialized CUDA)."""
        cuda = [d for d in hello.devices if d.id.startswith("cuda:")]
        self._uuids = [d.uuid for d in cuda] if cuda else None

    def sample(self, sample: Sample) -> Sample:
        """``sample`` with the host's fields the agent left to its viewers filled in."""
        host = sample.host
        if host is None or host.cpu_percent is not None or host.threads is not None:
            return sample  # the agent read them (or read nothing)
        if abs(time.time() - sample.t) > FILL_WITHIN_S:
            return sample  # history from before this viewer: what it was then is not known
        now = time.monotonic()
        if now - self._host_at >= self._host_every_s:
            self._host_at = now
            with contextlib.suppress(ProbeUnavailable, psutil.Error, OSError):
                self._host_last = self._host.read()
        last = self._host_last
        if last is None:
            return sample
        filled = replace(
            last, rss_bytes=host.rss_bytes, cpus=host.cpus, local_processes=host.local_processes
        )
        return replace(sample, host=filled)

    def agent_gpu(self) -> None:
        """The agent sent a ``gpu`` frame itself: none is made here for a while."""
        self._agent_gpu_at = time.monotonic()

    def gpu(self) -> GpuSample | None:
        """A ``gpu`` frame when one is due and the agent sends none; ``None`` otherwise."""
        if self._nvml is None:
            return None
        now = time.monotonic()
        if now - self._nvml_at < self._nvml_every_s:
            return None
        if now - self._agent_gpu_at < 4 * self._nvml_every_s:
            return None
        self._nvml_at = now
        rows = self._nvml.rows(max_age_s=self._nvml_every_s / 2)
        if rows is None:
            return None
        return GpuSample(t=time.time(), gpus=matched(rows, self._uuids))
