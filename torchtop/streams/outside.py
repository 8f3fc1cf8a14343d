"""A job watched from outside, when no agent can be started in it (see :mod:`.inject`).

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

import psutil

from torchtop.agent.probes.cpu_memory import CpuMemoryProbe
from torchtop.agent.probes.host import HostProbe
from torchtop.agent.sampler import Sampler
from torchtop.model.connection import SourceConnected, SourceDisconnected
from torchtop.protocol import (
    PROTOCOL_VERSION,
    DeviceInfo,
    Hello,
    JobExited,
    Message,
    ProbeStatus,
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
            from torchtop.agent.probes.nvml import NvmlProbe

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
