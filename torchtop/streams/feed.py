"""A background reader of one agent's stream, for viewers and recorders.

:class:`AgentFeed` waits for the agent to listen, connects, and hands every decoded message to a
callback, writing each frame to a recording on the way. It ends when the agent closes the
connection (the job exited or died), when it is closed, or on a malformed frame. An agent that
stays connected but sends nothing for many sampling intervals is reported through
``on_silence(seconds)``, once a second, until it speaks again. A feed reads in a thread of its
own, or, in a process that follows many agents, in the one thread of a
:class:`~torchtop.streams.reader.FeedReader` shared with the others.

Where the job runs on this machine, the feed reads from outside it what can be read there (its
process from ``/proc``, the GPUs from NVML: :class:`~torchtop.streams.outside.OutsideReader`) and
says so in its hello: the agent then leaves those reads to its viewers, and the frames it sends
are completed here before they are handed on or recorded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from torchtop.protocol import (
    PACED_SAMPLE_S,
    GpuSample,
    Hello,
    JobExited,
    LoaderInfo,
    Message,
    ProtocolError,
    Sample,
    decode,
    encode,
)
from torchtop.streams.outside import OutsideReader
from torchtop.streams.reader import failed
from torchtop.streams.recording import FrameSink
from torchtop.streams.worker_memory import with_worker_memory
from torchtop.transport import (
    AgentConnection,
    AgentInfo,
    TransportError,
    pid_alive,
    wait_for_agent,
)

if TYPE_CHECKING:
    from torchtop.streams.reader import FeedReader

#: An agent is silent after this many sampling intervals without a frame (at least
#: SILENCE_MIN_S): viewers then say "no data for N s" instead of "live".
SILENCE_INTERVALS = 20
SILENCE_MIN_S = 3.0
#: The end reason of a stream that broke off without the job's exit.
LOST = "connection lost"
#: How long a lost job may take to finish dying before it counts as possibly still running.
LOST_PID_GRACE_S = 2.0


def _frame(message: Message) -> bytes:
    """A frame as a connection yields it: without its newline."""
    return encode(message)[:-1]


class AgentFeed:
    """Streams one agent into ``on_message``; ``on_end(reason)`` is called once at the end."""

    def __init__(
        self,
        *,
        pid: int | None = None,
        address: str | None = None,
        alive: Callable[[], bool] | None = None,
        wait_s: float = 120.0,
        writer: FrameSink | None = None,
        on_message: Callable[[Message], None] | None = None,
        on_connect: Callable[[AgentInfo | str], None] | None = None,
        on_end: Callable[[str], None] | None = None,
        on_silence: Callable[[float], None] | None = None,
        client: str = "viewer",
        started_at: float | None = None,
        outside: bool = True,
        paced: bool = False,
        reader: FeedReader | None = None,
    ) -> None:
        if pid is None and address is None:
            raise ValueError("give the agent's pid or address")
        self.pid = pid
        self.address = address
        self._alive = alive
        self._wait_s = wait_s
        self.writer = writer
        self._on_message = on_message
        self._on_connect = on_connect
        self._on_end = on_end
        self._on_silence = on_silence
        self._client = client
        #: Read from outside the job what can be (``/proc``, NVML), so that its agent need not:
        #: where this process can (the job's pid seen here; see :class:`OutsideReader`).
        self._outside = outside
        self._started_at = started_at
        #: Samples once a second (:data:`~torchtop.protocol.PACED_SAMPLE_S`), not at the
        #: agent's rate: for what shows or exports figures per second, never a recording.
        self._paced = paced and writer is None
        self.outside: OutsideReader | None = None
        #: The agent's sampling interval (from its hello) and when its last frame arrived.
        self._interval_s = 0.1
        self._last_frame = time.monotonic()
        self._job_pid: int | None = pid
        self._peer_pid: int | None = None
        self._conn: AgentConnection | None = None
        self._closed = threading.Event()
        self.saw_exit: JobExited | None = None
        self.frames = 0
        self.connected = threading.Event()
        self.ended = threading.Event()
        self.end_reason = ""
        #: Read by a :class:`~torchtop.streams.reader.FeedReader` shared with other feeds
        #: (one thread for many agents: an exporter's), else by a thread of its own.
        self._reader = reader
        self._thread = threading.Thread(target=self._run, name="torchtop-feed", daemon=True)

    def start(self) -> AgentFeed:
        """Connect and read; with a shared reader, the connection is made in this thread (and
        a feed given a pid waits here for its agent, up to ``wait_s``)."""
        if self._reader is not None:
            self._reader.add(self)
        else:
            self._thread.start()
        return self

    def join(self, timeout: float | None = None) -> bool:
        if self._reader is not None:
            return self.ended.wait(timeout)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def send(self, message: Message) -> bool:
        """Send a ``request`` to the agent; False when not connected (yet, or any more)."""
        conn = self._conn
        if conn is None or not self.connected.is_set() or self.ended.is_set():
            return False
        return conn.send(message)

    def close(self) -> None:
        self._closed.set()
        if self._reader is not None:
            self._reader.drop(self)  # its thread closes the connection it reads
            return
        conn = self._conn
        if conn is not None:
            conn.close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed.is_set()

    def _run(self) -> None:
        reason = "closed"
        try:
            reason = self._stream()
        except Exception as exc:  # a feed must end with a reason, never a traceback
            reason = failed(exc)
        finally:
            self._end(reason)

    def _end(self, reason: str) -> None:
        self.end_reason = reason
        self.ended.set()
        if self._on_end is not None:
            self._on_end(reason)

    def lost_exit(self) -> JobExited | None:
        """For a recording whose stream broke off without the job's exit: an ``exit`` of
        unknown code saying so ("killed" when the job is gone), so that a report says what
        happened rather than nothing. ``None`` when the exit came, or we closed the feed."""
        if not self.ended.is_set() or self.end_reason != LOST or self.saw_exit is not None:
            return None
        pid = self._job_pid
        # A killed process closes its sockets before it is gone: give it a moment to finish dying.
        deadline = time.monotonic() + LOST_PID_GRACE_S
        while pid is not None and pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid is not None and not pid_alive(pid):
            reason = "connection lost: the job is gone without an exit status (killed?)"
        else:
            reason = "connection lost: the agent closed the connection; the job may still run"
        return JobExited(t=time.time(), exit_code=None, reason=reason)

    @property
    def silence_after_s(self) -> float:
        """How long without a frame before the agent counts as silent: it samples every
        interval, so many missed intervals mean it (or the job's whole process) is stuck."""
        return max(SILENCE_MIN_S, SILENCE_INTERVALS * self._interval_s)

    def _check_silence(self) -> None:
        silent = time.monotonic() - self._last_frame
        if self._on_silence is not None and silent >= self.silence_after_s:
            self._on_silence(silent)

    def _outside_reads(self, peer: int | None) -> list[str]:
        """What this feed reads of the agent's job from outside: the job is the process at the
        socket's other end (``peer``, numbered as this pid namespace sees it)."""
        if not self._outside:
            return []
        if peer is not None:
            self.outside = OutsideReader.for_job(peer)
        else:
            self.outside = OutsideReader.for_job(self._job_pid, self._started_at)
        if self.outside is None:
            return []
        if peer is not None:
            self._job_pid = self._peer_pid = peer
        return self.outside.names()

    def _deliver(self, frame: bytes, message: Message | None) -> None:
        if self.writer is not None:
            self.writer.write_frame(frame)
        self.frames += 1
        if message is None:
            return
        if isinstance(message, JobExited):
            self.saw_exit = message
        elif isinstance(message, Hello):
            # The socket's pid is this namespace's; the hello's is the job's own.
            self._job_pid = self._peer_pid or message.pid
            if message.interval_s > 0:
                self._interval_s = message.interval_s
        if self._on_message is not None:
            self._on_message(message)

    def _stream(self) -> str:
        reason = self._connect()
        if reason is not None:
            return reason
        assert self._conn is not None
        try:
            for frame in self._conn.frames(on_idle=self._check_silence):
                self._receive(frame)
        except ProtocolError as exc:
            return malformed(exc)
        finally:
            self._conn.close()
        return self._outcome()

    def _outcome(self) -> str:
        """Why the stream ended, once the connection closed."""
        if self._closed.is_set():
            return "detached"
        if self.saw_exit is not None:
            return "job exited"
        return LOST

    def _connect(self) -> str | None:
        """Wait for the agent and connect to it; the end reason where that never happens
        (raises :class:`TransportError` where the agent refuses)."""
        address = self.address
        if address is None:
            assert self.pid is not None
            alive = self._alive

            def keep_waiting() -> bool:
                return not self._closed.is_set() and (alive is None or alive())

            info = wait_for_agent(self.pid, self._wait_s, keep_waiting)
            if info is None:
                if self._closed.is_set():
                    return "closed"
                if alive is not None and not alive():
                    return "the job exited before its agent started"
                return f"no agent appeared for pid {self.pid} within {self._wait_s:.0f} s"
            address = info.address
            self._started_at = info.started_at
        deadline = time.monotonic() + 2.0
        while True:
            try:
                self._conn = AgentConnection(
                    address,
                    client=self._client,
                    outside=self._outside_reads,
                    pace_s=PACED_SAMPLE_S if self._paced else 0.0,
                )
                break
            except TransportError:
                # The socket can exist a moment before it listens; retry briefly.
                if time.monotonic() > deadline or self._closed.is_set():
                    raise
                time.sleep(0.05)
        self.connected.set()
        if self._on_connect is not None:
            self._on_connect(address)
        self._last_frame = time.monotonic()
        return None

    def _open(self) -> AgentConnection | str:
        """For a shared reader: wait for the agent and connect, in the caller's thread; the
        connection, or the reason the feed ends without one (as its own thread would say)."""
        try:
            reason = self._connect()
        except Exception as exc:  # an end reason, never a traceback
            return failed(exc)
        if reason is not None:
            return reason
        assert self._conn is not None
        return self._conn

    def _take(self, frames: Iterable[bytes]) -> str | None:
        """For a shared reader: the frames of one read, handed on in order; the reason the
        feed ends where one ends it (a malformed frame, a failing callback), else ``None``."""
        try:
            for frame in frames:
                self._receive(frame)
        except ProtocolError as exc:
            return malformed(exc)
        except Exception as exc:  # one feed's failure ends that feed only
            return failed(exc)
        return None

    def _receive(self, frame: bytes) -> None:
        """One frame from the agent: decoded, completed with what is read from outside the
        job, recorded and handed on (raises :class:`ProtocolError` for a malformed one)."""
        self._last_frame = time.monotonic()
        message = decode(frame)
        outside = self.outside
        if isinstance(message, LoaderInfo) and self._job_pid is not None:
            message = with_worker_memory(message, self._job_pid)
            frame = _frame(message)
        elif isinstance(message, Sample) and outside is not None:
            filled = outside.sample(message)
            if filled is not message:
                message, frame = filled, _frame(filled)
        elif isinstance(message, GpuSample) and outside is not None:
            outside.agent_gpu()
        elif isinstance(message, Hello) and outside is not None:
            outside.hello(message)
        self._deliver(frame, message)
        if isinstance(message, Sample) and outside is not None:
            gpu = outside.gpu()
            if gpu is not None:
                self._deliver(_frame(gpu), gpu)


def malformed(exc: ProtocolError) -> str:
    """The end reason of a stream that sent a malformed frame."""
    return f"the agent sent a malformed frame: {exc}"
