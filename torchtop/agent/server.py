"""The agent's socket server: history rings, per-client bounded queues, one I/O thread.

Producers (the sampler thread, the output reader) call :meth:`AgentServer.publish` with an
encoded frame. That appends to a history ring and to each client's bounded queue; it never
touches a socket, so it never blocks. A full queue drops its oldest frame and counts the drop.
One I/O thread accepts connections, checks the peer's uid and hello, replays the history to a new
client, and writes queued frames with non-blocking sends. A client that stops reading only ever
costs its own queue.

Everything is bounded in bytes: each history ring (rare events such as phases, marks, statuses,
OOMs and the exit have a ring of their own, so frequent frames never push them out), each
client's queue, all clients' queues together, and the number of clients. A hello costs a copy of
references to the history, taken under the lock; the frames themselves are sent from the I/O
thread as the client's socket takes them. Viewer requests are rate-limited per action. Any
exception a peer provokes closes only that peer; if the I/O thread fails anyway it is restarted
(and the failure reported), and after repeated failures the server closes its socket so that no
viewer waits on an agent that no longer serves.
"""

from __future__ import annotations

import contextlib
import heapq
import os
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from torchtop.agent.threads import agent_thread
from torchtop.protocol import (
    OUTSIDE_READS,
    PROTOCOL_VERSION,
    ClientHello,
    Dropped,
    FrameSplitter,
    ProtocolError,
    Request,
    decode,
    encode,
)
from torchtop.transport import peer_uid

#: History rings. Frequent frames (samples, logs, op windows, snapshot answers) each have their
#: own, so none of them can push out the rare events a late viewer needs (phases, marks, probe
#: statuses, OOMs, the exit).
SAMPLES, EVENTS, LOGS, OPS, ANSWERS = "samples", "events", "logs", "ops", "answers"
#: A client must say hello within this many seconds.
HELLO_TIMEOUT_S = 5.0
#: Bytes moved from a client's queue (or its history replay) into its send buffer at a time.
SEND_CHUNK = 1 << 16
#: Viewers and recorders served at once; a hello beyond them is answered by closing.
MAX_CLIENTS = 64
#: Connections that have not said hello yet (a storm of them must not exhaust the job's file
#: descriptors): beyond this, the oldest is closed. Accepted per turn of the I/O loop, so
#: that the hellos of the accepted are read between two batches.
MAX_PENDING = 128
ACCEPT_BATCH = 32
#: Bytes queued for one client, and for all clients together, before the oldest are dropped.
CLIENT_QUEUE_BYTES = 8 << 20
TOTAL_QUEUE_BYTES = 32 << 20
#: Viewer requests: each action may come ``REQUEST_BURST`` times at once, then once every
#: ``REQUEST_EVERY_S``; more are dropped (and counted).
REQUEST_BURST = 3
REQUEST_EVERY_S = 2.0
#: Distinct request actions tracked; further unknown ones share one budget.
MAX_REQUEST_ACTIONS = 16
#: Hellos answered (each starts a history replay, the costly part of a new viewer): a burst of
#: ``GREET_BURST``, then ``GREET_PER_S`` a second. Later hellos wait their turn, reading on: a
#: storm's peers that close meanwhile are dropped without ever costing a replay.
GREET_BURST = 16
GREET_PER_S = 50.0
#: Failures of the I/O thread after which the server closes its socket for good.
MAX_FAILURES = 5


@dataclass
class _Bucket:
    """A token bucket: ``burst`` at once, then ``per_s`` a second."""

    burst: float
    per_s: float
    tokens: float = -1.0  # full, once first used
    last: float = 0.0

    def refill(self, now: float) -> None:
        full = self.tokens < 0
        self.tokens = (
            self.burst if full else min(self.burst, self.tokens + (now - self.last) * self.per_s)
        )
        self.last = now

    def take(self, now: float) -> bool:
        """One token if there is one (refilled to ``now`` first)."""
        self.refill(now)
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


@dataclass(frozen=True)
class RingLimit:
    """How much history one ring keeps: at most ``frames`` frames and ``bytes`` bytes."""

    frames: int
    bytes: int


class _Ring:
    """A history ring bounded in frames and bytes; the oldest frames go first.

    A frame may come with an ``aged`` form (a summary): it replaces the frame in the ring as
    soon as a newer frame arrives, so only the latest is kept in full.
    """

    def __init__(self, limit: RingLimit) -> None:
        self.limit = limit
        self.items: deque[tuple[int, bytes]] = deque()
        self.nbytes = 0
        self._aged: bytes | None = None

    def append(self, seq: int, frame: bytes, aged: bytes | None) -> None:
        if self._aged is not None and self.items:
            old_seq, old = self.items.pop()
            self.items.append((old_seq, self._aged))
            self.nbytes += len(self._aged) - len(old)
        self._aged = aged
        self.items.append((seq, frame))
        self.nbytes += len(frame)
        while len(self.items) > 1 and (
            len(self.items) > self.limit.frames or self.nbytes > self.limit.bytes
        ):
            self.nbytes -= len(self.items.popleft()[1])


@dataclass
class _Client:
    sock: socket.socket
    connected_at: float
    #: The socket's descriptor when accepted: its key in the server's clients.
    fd: int = -1
    splitter: FrameSplitter = field(default_factory=lambda: FrameSplitter(limit=64 * 1024))
    greeted: bool = False
    #: Said hello; waits for its turn to be answered (see ``GREET_PER_S``).
    waiting: bool = False
    #: The history at the hello, not yet sent (references into the rings, never copies).
    replay: Iterator[tuple[int, bytes]] | None = None
    queue: deque[bytes] = field(default_factory=deque)
    queued_bytes: int = 0
    dropped: int = 0
    reported_dropped: int = 0
    outbuf: bytearray = field(default_factory=bytearray)
    want_write: bool = False
    #: What the viewer reads of the job from outside it (its hello's ``outside``).
    outside: frozenset[str] = frozenset()
    #: Wants samples at its own pace (its hello's ``pace_s``): frames published as
    #: ``detail_only`` are not queued for it.
    paced: bool = False
    #: Held while one thread fills ``outbuf`` and sends it: the I/O thread, or a producer
    #: sending its own frames (:meth:`AgentServer.send_now`).
    send_lock: threading.Lock = field(default_factory=threading.Lock)


class _Held(threading.local):
    """A thread's place in :meth:`AgentServer.batched`: its depth, and a wake owed."""

    depth = 0
    due = False


class AgentServer:
    """Serves frames to any number of viewers without ever blocking the producers."""

    def __init__(
        self,
        listener: socket.socket,
        hello_frame: Callable[[], bytes],
        *,
        rings: dict[str, RingLimit],
        client_queue: int = 4096,
        on_error: Callable[[str], None] | None = None,
        on_give_up: Callable[[str], None] | None = None,
    ) -> None:
        self._listener = listener
        self._hello_frame = hello_frame
        self._rings = {name: _Ring(limit) for name, limit in rings.items()}
        self._client_queue = client_queue
        self._on_error = on_error or (lambda _msg: None)
        self._on_give_up = on_give_up or (lambda _msg: None)
        self._lock = threading.Lock()
        self._clients: dict[int, _Client] = {}
        self._queued_bytes = 0
        self._seq = 0
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stopping = threading.Event()
        #: Per thread: inside :meth:`batched` (its depth) and whether a wake is owed.
        self._held = _Held()
        self._thread = self._new_thread()
        self._request_budget: dict[str, _Bucket] = {}
        self._waiting: deque[_Client] = deque()
        #: Connections not greeted yet, oldest first (by ``id``; the I/O thread's own).
        self._pending: dict[int, _Client] = {}
        self._greetings = _Bucket(GREET_BURST, GREET_PER_S)
        self.clients_seen = 0
        #: Connections closed because MAX_CLIENTS viewers or MAX_PENDING handshakes were open.
        self.refused = 0
        #: Peers closed for a malformed frame or any error they provoked.
        self.bad_peers = 0
        #: Viewer requests dropped by the rate limit.
        self.requests_dropped = 0
        #: Failures of the I/O thread so far; the server gave up after ``MAX_FAILURES``.
        self.failures = 0
        self.gave_up = False
        #: Called on the I/O thread with each viewer ``request``; must return at once.
        self.on_request: Callable[[Request], None] = lambda _request: None

    def _new_thread(self) -> threading.Thread:
        return agent_thread(self._run, "torchtop-server")

    # -- producers ----------------------------------------------------------------------------

    def publish(
        self,
        frame: bytes,
        ring: str = SAMPLES,
        aged: bytes | None = None,
        detail_only: bool = False,
    ) -> None:
        """Queue an encoded frame for every client and keep it in the history ring.

        ``aged``: a summary of this frame that replaces it in the history once the ring gets
        its next frame (op windows keep only the latest in full). ``detail_only``: not for the
        clients that take frames at their own pace (it is in the history all the same).
        """
        size = len(frame)
        with self._lock:
            self._seq += 1
            self._rings[ring].append(self._seq, frame, aged)
            if not self._clients:
                return
            for client in self._clients.values():
                if not client.greeted or (detail_only and client.paced):
                    continue
                client.queue.append(frame)
                client.queued_bytes += size
                self._queued_bytes += size
                while client.queue and (
                    len(client.queue) > self._client_queue
                    or client.queued_bytes > CLIENT_QUEUE_BYTES
                    or self._queued_bytes > TOTAL_QUEUE_BYTES
                ):
                    old = len(client.queue.popleft())
                    client.queued_bytes -= old
                    self._queued_bytes -= old
                    client.dropped += 1
        if self._held.depth:
            self._held.due = True  # sent when the batch ends
        else:
            self.send_now()

    @contextlib.contextmanager
    def batched(self) -> Iterator[None]:
        """Frames published in this thread inside the block are sent once, at its end: a
        sampler tick's frames cost the job one send per viewer, not one each."""
        held = self._held
        held.depth += 1
        try:
            yield
        finally:
            held.depth -= 1
            if not held.depth and held.due:
                held.due = False
                self.send_now()

    def send_now(self) -> None:
        """From a producer: send the queued frames in this thread, as far as each viewer's
        socket takes them without blocking, and wake the I/O thread only for what is left (a
        slow viewer, a history replay not done, a send the I/O thread is in).

        Every time a thread other than the job's takes the GIL back, the job's thread may wait
        for it: one non-blocking send here replaces the wake, the I/O thread's return from
        ``select`` and its reads and sends, each a hand-over of the GIL."""
        with self._lock:
            if not self._clients:
                return
            clients = [c for c in self._clients.values() if c.greeted]
        left = False
        for client in clients:
            busy = client.replay is not None or client.want_write
            if busy or not client.send_lock.acquire(blocking=False):
                left = True  # the I/O thread's to send
            else:
                try:
                    left |= not self._send(client)
                except Exception:  # the I/O thread finds it again and decides
                    left = True
                finally:
                    client.send_lock.release()
        if left:
            self._wake()

    def read_outside(self, name: str) -> bool:
        """True while every viewer that said hello reads ``name`` (one of
        :data:`~torchtop.protocol.OUTSIDE_READS`) from outside the job, and while none has:
        the agent then leaves that figure to them. One viewer that does not (an older one, one
        on another machine) is enough for the agent to read it again."""
        with self._lock:
            return all(name in c.outside for c in self._clients.values() if c.greeted or c.waiting)

    @property
    def client_count(self) -> int:
        with self._lock:
            return sum(1 for c in self._clients.values() if c.greeted)

    def pending_bytes(self) -> int:
        """Bytes queued for all clients: the agent's memory that viewers can cost it."""
        with self._lock:
            return self._queued_bytes + sum(len(c.outbuf) for c in self._clients.values())

    def history_bytes(self) -> int:
        """Bytes the history rings hold."""
        with self._lock:
            return sum(ring.nbytes for ring in self._rings.values())

    def total_dropped(self) -> int:
        with self._lock:
            return sum(c.dropped for c in self._clients.values())

    # -- life cycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._selector.register(self._listener, selectors.EVENT_READ, "listen")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def check(self) -> None:
        """Restart the I/O thread if it died (any thread may call this, e.g. once a second)."""
        if self._stopping.is_set() or self.gave_up or self._thread.is_alive():
            return
        if not self._thread.ident:
            return  # never started
        if self._count_failure("the I/O thread ended"):
            self._thread = self._new_thread()
            self._thread.start()

    def stop(self, drain_s: float = 1.0) -> None:
        """Send what is queued (for up to ``drain_s``), then close every connection."""
        deadline = time.monotonic() + drain_s
        while time.monotonic() < deadline and self.pending_bytes() > 0 and self.alive:
            self._wake()
            time.sleep(0.01)
        self._stopping.set()
        self._wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=1.0)
        self._close_all()

    def _close_all(self) -> None:
        with self._lock:
            clients = list(self._clients.values())
            self._clients.clear()
            self._queued_bytes = 0
        self._pending.clear()
        self._waiting.clear()
        for client in clients:
            _close(client.sock)
        _close(self._listener)
        _close(self._wake_r)
        _close(self._wake_w)

    def wait_for_clients_drained(self, timeout: float) -> None:
        """Wait until some client has connected and everything queued is sent, or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.alive:
            if self.clients_seen and self.pending_bytes() == 0:
                return
            time.sleep(0.02)

    def close_fds_in_child(self) -> None:
        """After fork, in the child: drop our copies of every socket without shutting them down."""
        for sock in (self._listener, self._wake_r, self._wake_w):
            _close(sock)
        for client in list(self._clients.values()):
            _close(client.sock)

    # -- the I/O thread -----------------------------------------------------------------------

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._serve()
            except Exception as exc:  # never let the server take down the job
                if not self._count_failure(repr(exc)):
                    return

    def _count_failure(self, what: str) -> bool:
        """Report a failure of the I/O thread; True to go on, False once the server gave up."""
        self.failures += 1
        if self.failures >= MAX_FAILURES:
            self.gave_up = True
            self._stopping.set()
            self._close_all()
            self._on_give_up(
                f"the agent's socket server failed {self.failures} times (last: {what}); "
                "it closed its socket: the job runs on, but no viewer can attach"
            )
            return False
        self._on_error(f"the agent's socket server failed ({what}); restarted it")
        return True

    def _serve(self) -> None:
        while not self._stopping.is_set():
            timeout = 1.0 / GREET_PER_S if self._waiting else 0.5
            for key, mask in self._selector.select(timeout=timeout):
                if key.data == "listen":
                    self._accept()
                elif key.data == "wake":
                    with contextlib.suppress(OSError):
                        while self._wake_r.recv(4096):
                            pass
                else:
                    client = key.data
                    try:
                        if mask & selectors.EVENT_READ:
                            self._read(client)
                        if mask & selectors.EVENT_WRITE and client.sock.fileno() >= 0:
                            self._write(client)
                    except Exception:  # whatever a peer provokes closes only that peer
                        self.bad_peers += 1
                        self._drop_client(client)
            self._greet_waiting()
            self._pump()
            self._expire_handshakes()

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._on_error(f"accept failed: {exc}")
                return
            try:
                uid = peer_uid(sock)
            except OSError:
                uid = None
            if uid is not None and uid != os.getuid():
                _close(sock)
                continue
            if len(self._pending) >= MAX_PENDING:
                self.refused += 1
                # The oldest silent one first: one that said hello is more likely a viewer.
                pending = self._pending.values()
                self._drop_client(next((c for c in pending if not c.waiting), next(iter(pending))))
            sock.setblocking(False)
            client = _Client(sock=sock, connected_at=time.monotonic(), fd=sock.fileno())
            self._pending[id(client)] = client
            with self._lock:
                self._clients[sock.fileno()] = client
            self._selector.register(sock, selectors.EVENT_READ, client)

    def _read(self, client: _Client) -> None:
        try:
            data = client.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop_client(client)
            return
        if not data:
            self._drop_client(client)
            return
        try:
            for frame in client.splitter.feed(data):
                message = decode(frame)
                if not client.greeted and not client.waiting:
                    if not isinstance(message, ClientHello):
                        raise ProtocolError("the first frame must be a client hello")
                    if message.protocol != PROTOCOL_VERSION:
                        raise ProtocolError(f"unsupported protocol version {message.protocol}")
                    client.outside = frozenset(
                        name for name in message.outside[:8] if name in OUTSIDE_READS
                    )
                    client.paced = message.pace_s > 0
                    client.waiting = True
                    self._waiting.append(client)
                elif isinstance(message, Request) and self._allow_request(message.action):
                    # Handed over, never served here: this thread must keep moving frames.
                    with contextlib.suppress(Exception):
                        self.on_request(message)
                # Later frames of kinds we don't know are ignored.
        except Exception:  # ProtocolError, or anything a bad peer provokes: only it goes
            self.bad_peers += 1
            self._drop_client(client)

    def _allow_request(self, action: str) -> bool:
        """A token bucket per action: a burst of ``REQUEST_BURST``, then one per interval."""
        if action not in self._request_budget and len(self._request_budget) >= MAX_REQUEST_ACTIONS:
            action = "\0other"
        bucket = self._request_budget.setdefault(
            action, _Bucket(REQUEST_BURST, 1.0 / REQUEST_EVERY_S)
        )
        if bucket.take(time.monotonic()):
            return True
        self.requests_dropped += 1
        return False

    def _greet_waiting(self) -> None:
        """Answer the waiting hellos the budget allows, oldest first; skip the peers gone.
        A hello beyond ``MAX_CLIENTS`` viewers is answered by closing (the one place it is)."""
        now = time.monotonic()
        while self._waiting:
            client = self._waiting[0]
            if not client.waiting:  # dropped meanwhile: costs no greeting
                self._waiting.popleft()
                continue
            if self.client_count >= MAX_CLIENTS:
                self._waiting.popleft()
                self.refused += 1
                self._drop_client(client)
                continue
            if not self._greetings.take(now):
                return
            self._waiting.popleft()
            client.waiting = False
            self._greet(client)

    def _greet(self, client: _Client) -> None:
        hello = self._hello_frame()
        with self._lock:
            # References only: the frames are sent later, outside the lock, as the socket
            # takes them. Frames published from now on go to the client's queue. The hello
            # and the replay are in place before the client counts as greeted, so a producer
            # sending (:meth:`send_now`) never sends a frame before them.
            snapshot = [list(ring.items) for ring in self._rings.values() if ring.items]
            client.outbuf += hello
            client.replay = heapq.merge(*snapshot)
            client.greeted = True
            self.clients_seen += 1
        self._pending.pop(id(client), None)

    def _pump(self) -> None:
        """Move queued frames into send buffers and send what the sockets take."""
        with self._lock:
            clients = [c for c in self._clients.values() if c.greeted]
        for client in clients:
            try:
                self._write(client)
            except Exception:
                self.bad_peers += 1
                self._drop_client(client)

    def _fill(self, client: _Client) -> None:
        """Top up the send buffer: the rest of the history replay first, then the queue."""
        if client.replay is not None:
            for _seq, frame in client.replay:
                client.outbuf += frame
                if len(client.outbuf) >= SEND_CHUNK:
                    return
            client.replay = None
        with self._lock:
            if client.dropped != client.reported_dropped and len(client.outbuf) < SEND_CHUNK:
                client.reported_dropped = client.dropped
                client.outbuf += encode(Dropped(t=time.time(), count=client.dropped))
            while client.queue and len(client.outbuf) < SEND_CHUNK:
                frame = client.queue.popleft()
                client.queued_bytes -= len(frame)
                self._queued_bytes -= len(frame)
                client.outbuf += frame

    def _send(self, client: _Client) -> bool:
        """Fill the send buffer and send what the socket takes now (``client.send_lock``
        held): True once everything queued is sent. An error other than a full socket is
        raised for the caller to handle."""
        if len(client.outbuf) < SEND_CHUNK:
            self._fill(client)
        while client.outbuf:
            try:
                sent = client.sock.send(client.outbuf)
            except (BlockingIOError, InterruptedError):
                return False
            del client.outbuf[:sent]
            if not client.outbuf:
                self._fill(client)
        return True

    def _write(self, client: _Client) -> None:
        if not client.greeted:
            return
        with client.send_lock:
            try:
                self._send(client)
            except OSError:
                failed = True
            else:
                failed = False
        if failed:
            self._drop_client(client)
            return
        want_write = bool(client.outbuf)
        if want_write != client.want_write:
            client.want_write = want_write
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if want_write else 0)
            with contextlib.suppress(KeyError, ValueError):
                self._selector.modify(client.sock, events, client)

    def _expire_handshakes(self) -> None:
        now = time.monotonic()
        late = [
            c
            for c in self._pending.values()
            if not c.waiting and now - c.connected_at > HELLO_TIMEOUT_S
        ]
        for client in late:
            self._drop_client(client)

    def _drop_client(self, client: _Client) -> None:
        with self._lock:
            if self._clients.get(client.fd) is client:
                del self._clients[client.fd]
                self._queued_bytes -= client.queued_bytes
            client.queue.clear()
            client.queued_bytes = 0
        client.replay = None
        client.waiting = False
        self._pending.pop(id(client), None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(client.sock)
        with client.send_lock:  # not closed under a producer's send
            _close(client.sock)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()
