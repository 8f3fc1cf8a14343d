"""The agent's socket server: history rings, per-client bounded queues, one I/O thread.

Producers (the sampler thread, the output reader) call :meth:`AgentServer.publish` with an
encoded frame. That appends to a history ring and to each client's bounded queue; it never
touches a socket, so it never blocks. A full queue drops its oldest frame and counts the drop.
One I/O thread accepts connections, checks the peer's uid and hello, replays the history to a new
client, and writes queued frames with non-blocking sends. A client that stops reading only ever
costs its own queue.
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
from collections.abc import Callable
from dataclasses import dataclass, field

from torchtop.protocol import (
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

#: Ring categories: each has its own bound so that chatty samples never push out phases.
SAMPLES, EVENTS, LOGS = "samples", "events", "logs"
#: A client must say hello within this many seconds.
HELLO_TIMEOUT_S = 5.0
#: Bytes moved from a client's queue into its send buffer at a time.
SEND_CHUNK = 1 << 16


@dataclass
class _Client:
    sock: socket.socket
    connected_at: float
    splitter: FrameSplitter = field(default_factory=lambda: FrameSplitter(limit=64 * 1024))
    greeted: bool = False
    queue: deque[bytes] = field(default_factory=deque)
    dropped: int = 0
    reported_dropped: int = 0
    outbuf: bytearray = field(default_factory=bytearray)
    want_write: bool = False


class AgentServer:
    """Serves frames to any number of viewers without ever blocking the producers."""

    def __init__(
        self,
        listener: socket.socket,
        hello_frame: Callable[[], bytes],
        *,
        ring_sizes: dict[str, int],
        client_queue: int = 4096,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        self._listener = listener
        self._hello_frame = hello_frame
        self._rings: dict[str, deque[tuple[int, bytes]]] = {
            name: deque(maxlen=size) for name, size in ring_sizes.items()
        }
        self._client_queue = client_queue
        self._on_error = on_error or (lambda _msg: None)
        self._lock = threading.Lock()
        self._clients: dict[int, _Client] = {}
        self._seq = 0
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torchtop-server", daemon=True)
        self.clients_seen = 0
        #: Called on the I/O thread with each viewer ``request``; must return at once.
        self.on_request: Callable[[Request], None] = lambda _request: None

    # -- producers ----------------------------------------------------------------------------

    def publish(self, frame: bytes, ring: str = SAMPLES) -> None:
        """Queue an encoded frame for every client and keep it in the history ring."""
        with self._lock:
            self._seq += 1
            self._rings[ring].append((self._seq, frame))
            if not self._clients:
                return
            for client in self._clients.values():
                if not client.greeted:
                    continue
                if len(client.queue) >= self._client_queue:
                    client.queue.popleft()
                    client.dropped += 1
                client.queue.append(frame)
        self._wake()

    @property
    def client_count(self) -> int:
        with self._lock:
            return sum(1 for c in self._clients.values() if c.greeted)

    def pending_bytes(self) -> int:
        """Bytes queued for all clients: the agent's memory that viewers can cost it."""
        with self._lock:
            return sum(len(c.outbuf) + sum(map(len, c.queue)) for c in self._clients.values())

    def total_dropped(self) -> int:
        with self._lock:
            return sum(c.dropped for c in self._clients.values())

    # -- life cycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._selector.register(self._listener, selectors.EVENT_READ, "listen")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread.start()

    def stop(self, drain_s: float = 1.0) -> None:
        """Send what is queued (for up to ``drain_s``), then close every connection."""
        deadline = time.monotonic() + drain_s
        while time.monotonic() < deadline and self.pending_bytes() > 0:
            self._wake()
            time.sleep(0.01)
        self._stopping.set()
        self._wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=1.0)
        with self._lock:
            clients = list(self._clients.values())
            self._clients.clear()
        for client in clients:
            _close(client.sock)
        _close(self._listener)
        _close(self._wake_r)
        _close(self._wake_w)

    def wait_for_clients_drained(self, timeout: float) -> None:
        """Wait until some client has connected and everything queued is sent, or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
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
        try:
            while not self._stopping.is_set():
                for key, mask in self._selector.select(timeout=0.5):
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "wake":
                        with contextlib.suppress(OSError):
                            while self._wake_r.recv(4096):
                                pass
                    else:
                        client = key.data
                        if mask & selectors.EVENT_READ:
                            self._read(client)
                        if mask & selectors.EVENT_WRITE and client.sock.fileno() >= 0:
                            self._write(client)
                self._pump()
                self._expire_handshakes()
        except Exception as exc:  # never let the server take down the job
            self._on_error(f"socket server stopped: {exc!r}")

    def _accept(self) -> None:
        while True:
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
            sock.setblocking(False)
            client = _Client(sock=sock, connected_at=time.monotonic())
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
                if not client.greeted:
                    if not isinstance(message, ClientHello):
                        raise ProtocolError("the first frame must be a client hello")
                    if message.protocol != PROTOCOL_VERSION:
                        raise ProtocolError(f"unsupported protocol version {message.protocol}")
                    self._greet(client)
                elif isinstance(message, Request):
                    # Handed over, never served here: this thread must keep moving frames.
                    with contextlib.suppress(Exception):
                        self.on_request(message)
                # Later frames of kinds we don't know are ignored.
        except Exception:  # ProtocolError, or anything a bad peer provokes: only it goes
            self._drop_client(client)

    def _greet(self, client: _Client) -> None:
        with self._lock:
            history = heapq.merge(*self._rings.values())
            client.outbuf += self._hello_frame()
            for _seq, frame in history:
                client.outbuf += frame
            client.greeted = True
            self.clients_seen += 1

    def _pump(self) -> None:
        """Move queued frames into send buffers and send what the sockets take."""
        with self._lock:
            clients = [c for c in self._clients.values() if c.greeted]
        for client in clients:
            self._write(client)

    def _write(self, client: _Client) -> None:
        if not client.greeted:
            return
        with self._lock:
            if client.dropped != client.reported_dropped and len(client.outbuf) < SEND_CHUNK:
                client.reported_dropped = client.dropped
                client.outbuf += encode(Dropped(t=time.time(), count=client.dropped))
            while client.queue and len(client.outbuf) < SEND_CHUNK:
                client.outbuf += client.queue.popleft()
        while client.outbuf:
            try:
                sent = client.sock.send(client.outbuf)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._drop_client(client)
                return
            del client.outbuf[:sent]
            if not client.outbuf:
                with self._lock:
                    while client.queue and len(client.outbuf) < SEND_CHUNK:
                        client.outbuf += client.queue.popleft()
        want_write = bool(client.outbuf)
        if want_write != client.want_write:
            client.want_write = want_write
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if want_write else 0)
            with contextlib.suppress(KeyError, ValueError):
                self._selector.modify(client.sock, events, client)

    def _expire_handshakes(self) -> None:
        now = time.monotonic()
        with self._lock:
            late = [
                c
                for c in self._clients.values()
                if not c.greeted and now - c.connected_at > HELLO_TIMEOUT_S
            ]
        for client in late:
            self._drop_client(client)

    def _drop_client(self, client: _Client) -> None:
        with self._lock:
            for key, value in list(self._clients.items()):
                if value is client:
                    del self._clients[key]
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(client.sock)
        _close(client.sock)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()
