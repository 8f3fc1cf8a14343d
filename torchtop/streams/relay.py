"""``torchtop relay``: one node's agents, for a viewer on another machine. Standard library only.

A relay finds the agents of its node in the runtime directory (every agent, or those of one run:
``--run ID``), new ones as they start, connects to each as a viewer does, and writes their frames
to its viewer, each tagged with its source (``"src"``: the agent's pid) exactly as a recording of
several agents holds them (:func:`~torchtop.streams.recording.tag_frame`): one framing for both.

The viewer speaks first, its :class:`~torchtop.protocol.ClientHello`, and the relay checks it
before it sends anything: over TCP the token first (``hmac.compare_digest``), then the protocol
version. A viewer that fails a check gets one :class:`~torchtop.protocol.Refused` frame naming the
fix, and nothing else. One that passes gets a :class:`~torchtop.protocol.RelayHello`, then the
agents' frames.

Two ways to reach it, both a transport the cluster's user already trusts:

- over ssh (:func:`serve_stdio`): the viewer runs ``ssh HOST torchtop relay``; the relay speaks on
  its stdin and stdout and nothing listens. It ends when its stdin or stdout closes (the ssh
  session ended).
- over TCP (:func:`serve_tcp`, ``--listen ADDR:PORT``, 127.0.0.1 unless another address is
  named): only to a viewer that presents the token.

A viewer slower than the agents never holds them up: the frames waiting for it are bounded in
bytes (:data:`QUEUE_BYTES`); past that the oldest are dropped and counted (a ``dropped`` frame
without a source says how many), except hellos and exits, which say which ranks there are.
Requests from the viewer to a rank (a snapshot, an op window) are not relayed: anything the
viewer sends after its hello is read and ignored.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import select
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from torchtop.protocol import (
    PROTOCOL_VERSION,
    ClientHello,
    Dropped,
    FrameSplitter,
    ProtocolError,
    Refused,
    RelayHello,
    decode,
    encode,
)
from torchtop.streams.discovery import Agents
from torchtop.streams.runs import RankFeeds
from torchtop.streams.token import MIN_TOKEN_CHARS, RelayError, token_for
from torchtop.text import printable
from torchtop.transport import (
    TransportError,
    existing_runtime_dir,
    keep_alive,
    runtime_dir,
)

#: Bytes of frames waiting for a slow viewer before the oldest are dropped.
QUEUE_BYTES = 8 << 20
#: Hellos and exits kept past that bound (each agent sends a few).
KEPT_FRAMES = 4096
#: Bytes written to the viewer at a time.
CHUNK = 1 << 16
#: The viewer's hello must arrive within this many seconds, and be at most this long.
HELLO_TIMEOUT_S = 15.0
HELLO_LIMIT = 16 << 10
#: Over TCP, a connection has this many seconds in all to present its hello (a viewer sends
#: it at once; a peer that trickles bytes is cut off here, whatever its pace).
HANDSHAKE_DEADLINE_S = 5.0
#: Handshakes in progress at once, in all and from one address. Past either bound, the oldest
#: is closed: a viewer with the token sends its hello within milliseconds, so peers that hold a
#: connection open without one are the ones that go, and never hold a viewer out.
MAX_PENDING = 64
MAX_PENDING_PER_ADDRESS = 16
#: Bad tokens from one address before its next tries wait, 1 s, then twice as long each time,
#: up to BAD_TOKEN_MAX_WAIT_S.
BAD_TOKENS_FREE = 3
BAD_TOKEN_MAX_WAIT_S = 30.0
#: Viewers one TCP relay serves at once (counted only once their token passed).
MAX_SESSIONS = 8
#: The address ``--listen PORT`` binds: this machine only.
LOOPBACK = "127.0.0.1"
#: Frames a relay never drops: a rank's hello (who it is) and its exit.
_KEPT_KINDS = (b'{"kind":"hello"', b'{"kind":"exit"')


class Refusal(Exception):
    """A viewer's hello failed a check; the message is the reason sent to it."""


def _version() -> str:
    from torchtop import __version__

    return __version__


# -- the viewer's hello -----------------------------------------------------------------------


def check_hello(frame: bytes, token: str | None) -> ClientHello:
    """The viewer's hello if it passes: the token first (when one is required), then the
    protocol version. Anything else is a :class:`Refusal` naming the fix."""
    try:
        hello = decode(frame)
    except ProtocolError:
        hello = None
    if not isinstance(hello, ClientHello):
        raise Refusal(
            "the first frame must be a torchtop viewer's hello: connect with "
            "`torchtop attach --node HOST` (ssh) or `--node tcp://ADDR:PORT --token-file FILE`"
        )
    if token is not None and not hmac.compare_digest((hello.token or "").encode(), token.encode()):
        raise Refusal(
            "bad token: give the viewer the relay's token file with `--token-file FILE` "
            "(`torchtop relay --listen` printed where it wrote it)"
        )
    if hello.protocol != PROTOCOL_VERSION:
        raise Refusal(
            f"the viewer speaks torchtop protocol {hello.protocol}, this relay (torchtop "
            f"{_version()}) protocol {PROTOCOL_VERSION}: install the same torchtop version on "
            "both machines"
        )
    return hello


def read_first_frame(recv: Callable[[], bytes], what: str) -> bytes:
    """The first line ``recv`` gives (each call returns what arrived; ``b""`` at the end)."""
    splitter = FrameSplitter(limit=HELLO_LIMIT)
    while True:
        data = recv()
        if not data:
            raise Refusal(f"{what} closed before its hello")
        try:
            for frame in splitter.feed(data):
                return frame
        except ProtocolError:
            raise Refusal(f"{what} sent a first line longer than {HELLO_LIMIT} bytes") from None


# -- the output -------------------------------------------------------------------------------


class RelayOutput:
    """The frames on their way to the viewer, written by their own thread, so that a slow
    viewer costs only this queue: bounded in bytes, the oldest dropped past it (and counted),
    hellos and exits kept. ``write_frame`` never blocks."""

    def __init__(self, send: Callable[[bytes], None], cap_bytes: int = QUEUE_BYTES) -> None:
        self._send = send
        self._cap = cap_bytes
        self._cond = threading.Condition()
        self._frames: deque[bytes] = deque()
        self._bytes = 0
        #: Hellos and exits that were at the head of a full queue: older than every frame in
        #: it, so written before them, in order.
        self._kept: deque[bytes] = deque()
        self.dropped = 0
        self._reported = 0
        self._closed = False
        self.ended = threading.Event()
        self.end_reason = ""
        self._thread = threading.Thread(target=self._run, name="torchtop-relay-out", daemon=True)

    def start(self) -> RelayOutput:
        self._thread.start()
        return self

    def write_frame(self, frame: bytes) -> None:
        """Queue one frame (without its newline)."""
        with self._cond:
            if self._closed:
                return
            self._frames.append(frame)
            self._bytes += len(frame)
            while self._bytes > self._cap and len(self._frames) > 1:
                old = self._frames.popleft()
                self._bytes -= len(old)
                if old.startswith(_KEPT_KINDS) and len(self._kept) < KEPT_FRAMES:
                    self._kept.append(old)
                else:
                    self.dropped += 1
            self._cond.notify()

    @property
    def queued_bytes(self) -> int:
        with self._cond:
            return self._bytes + sum(map(len, self._kept))

    def _take(self) -> bytes | None:
        with self._cond:
            while not (self._closed or self._kept or self._frames):
                self._cond.wait()
            if self._closed:
                return None
            batch = bytearray()
            while self._kept and len(batch) < CHUNK:
                batch += self._kept.popleft() + b"\n"
            while self._frames and len(batch) < CHUNK:
                frame = self._frames.popleft()
                self._bytes -= len(frame)
                batch += frame + b"\n"
            if self.dropped != self._reported:
                self._reported = self.dropped
                batch += encode(Dropped(t=time.time(), count=self.dropped))
            return bytes(batch)

    def _run(self) -> None:
        try:
            while True:
                batch = self._take()
                if batch is None:
                    self.end_reason = "closed"
                    return
                self._send(batch)
        except OSError as exc:
            self.end_reason = f"the viewer went away ({exc.strerror or exc})"
        except Exception as exc:  # the relay must end with a reason, never hang
            self.end_reason = f"writing failed: {exc!r}"
        finally:
            self.ended.set()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._frames.clear()
            self._kept.clear()
            self._bytes = 0
            self._cond.notify_all()


# -- one viewer -------------------------------------------------------------------------------


class RelaySession:
    """One viewer's relay: its hello, then every agent's frames until :meth:`stop`."""

    def __init__(self, send: Callable[[bytes], None], run_id: str | None = None) -> None:
        self.output = RelayOutput(send)
        self.feeds = RankFeeds(Agents(run=run_id), self.output, client="relay")
        self._run_id = run_id
        self.stopped = threading.Event()

    def start(self) -> RelaySession:
        hello = RelayHello(
            protocol=PROTOCOL_VERSION,
            version=_version(),
            host=socket.gethostname(),
            pid=os.getpid(),
            run_id=self._run_id,
        )
        self.output.write_frame(encode(hello).rstrip(b"\n"))
        self.output.start()
        self.feeds.start()
        return self

    def wait(self, timeout: float | None = None) -> bool:
        """Until the viewer is gone (its output failed) or :meth:`stop`; True if so."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.stopped.is_set():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            if self.output.ended.wait(0.2 if left is None else min(0.2, left)):
                break
        return True

    def serve(self, read: Callable[[], bytes]) -> None:
        """Until the viewer's side closes (``read()`` gives ``b""``: the ssh session or the
        connection ended) or its output fails; then :meth:`stop`. What it sends is ignored."""

        def drain() -> None:
            with contextlib.suppress(OSError):
                while read():
                    pass
            self.stopped.set()

        threading.Thread(target=drain, name="torchtop-relay-in", daemon=True).start()
        try:
            self.wait()
        finally:
            self.stop()

    def stop(self) -> None:
        """Close every agent's connection, then the output."""
        self.stopped.set()
        self.feeds.close()
        self.output.close()


# -- over ssh: stdin and stdout -----------------------------------------------------------------


def _fd_sender(fd: int) -> Callable[[bytes], None]:
    def send(data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]

    return send


def _fd_receiver(fd: int, timeout_s: float) -> Callable[[], bytes]:
    """Reads from ``fd``; ``b""`` at its end or once ``timeout_s`` has passed in all."""
    deadline = time.monotonic() + timeout_s

    def recv() -> bytes:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return b""
        return os.read(fd, 4096)

    return recv


def serve_stdio(run_id: str | None = None, log: Callable[[str], None] | None = None) -> int:
    """The relay over ssh: the viewer's hello on stdin, the frames on stdout, until either
    closes. Returns the exit code (1 when the viewer was refused)."""
    say = log or (lambda line: print(f"torchtop relay: {line}", file=sys.stderr, flush=True))
    # The frames own stdout: anything else that would print there goes to stderr.
    out = os.dup(1)
    os.dup2(2, 1)
    send = _fd_sender(out)
    try:
        frame = read_first_frame(_fd_receiver(0, HELLO_TIMEOUT_S), "the viewer")
        check_hello(frame, token=None)
        existing_runtime_dir()  # the agents' folder must be the user's own, as for `ps`
    except (Refusal, TransportError) as exc:
        with contextlib.suppress(OSError):
            send(encode(Refused(reason=str(exc))))
        say(f"refused the viewer: {exc}")
        return 1
    RelaySession(send, run_id).start().serve(lambda: os.read(0, 4096))
    return 0


# -- over TCP, with a token ----------------------------------------------------------------------


def parse_listen(text: str) -> tuple[str, int]:
    """``PORT`` (on 127.0.0.1), ``ADDR:PORT`` or ``[IPv6]:PORT``."""
    host, _, port = text.rpartition(":")
    host = host.strip("[]") or LOOPBACK
    try:
        number = int(port)
    except ValueError:
        raise RelayError(f"--listen takes [ADDR:]PORT, got {text!r}") from None
    if not 0 <= number < 65536:
        raise RelayError(f"--listen: port {number} is out of range (0-65535)")
    return host, number


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def bind_tcp(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one)."""
    try:
        return socket.create_server(
            (host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET
        )
    except OSError as exc:
        raise RelayError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}; pick another port "
            "(`--listen ADDR:0` takes a free one)"
        ) from None


class TcpRelay:
    """Serves the relay on a listening TCP socket to viewers that present the token."""

    def __init__(
        self,
        server: socket.socket,
        token: str,
        run_id: str | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        if len(token) < MIN_TOKEN_CHARS:
            raise RelayError(f"a relay's token has {MIN_TOKEN_CHARS} characters at least")
        self.server = server
        self._token = token
        self._run_id = run_id
        self._log = log or (lambda line: print(f"torchtop relay: {line}", file=sys.stderr))
        self.address: tuple[str, int] = server.getsockname()[:2]
        self._sessions = threading.BoundedSemaphore(MAX_SESSIONS)
        self._live: set[RelaySession] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        #: Handshakes in progress, oldest first, and those closed to make room.
        self._pending: list[tuple[socket.socket, str]] = []
        self._evicted: set[socket.socket] = set()
        #: Bad tokens per address in a row, and until when its next try waits.
        self._bad_tokens: dict[str, int] = {}
        self._bad_until: dict[str, float] = {}
        #: Viewers refused so far (bad token, other version, too many, no hello in time).
        self.refused = 0

    def serve(self) -> None:
        """Accept viewers until :meth:`close`."""
        self.server.settimeout(0.5)
        while not self._closed.is_set():
            try:
                conn, peer = self.server.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._closed.is_set():
                    return
                raise
            threading.Thread(
                target=self._handle, args=(conn, peer), name="torchtop-relay-viewer", daemon=True
            ).start()

    def _handle(self, conn: socket.socket, peer: tuple[str, int]) -> None:
        who, address = f"{peer[0]}:{peer[1]}", peer[0]
        try:
            self._pend(conn, address)
            try:
                self._wait_out_bad_tokens(address)
                hello_ok = self._handshake(conn, who, address)
            finally:
                with self._lock:
                    evicted = conn in self._evicted
                    self._evicted.discard(conn)
                    if (conn, address) in self._pending:
                        self._pending.remove((conn, address))
            if not hello_ok or evicted:
                return
            # A slot only for a viewer whose token passed: peers without it cannot fill them.
            if not self._sessions.acquire(blocking=False):
                self._refuse(conn, who, f"busy: {MAX_SESSIONS} viewers are connected; try later")
                return
            try:
                self._serve_viewer(conn, who)
            finally:
                self._sessions.release()
        finally:
            with contextlib.suppress(OSError):
                conn.close()

    def _pend(self, conn: socket.socket, address: str) -> None:
        """Count ``conn`` among the handshakes in progress, closing the oldest past a bound."""
        with self._lock:
            mine = [entry for entry in self._pending if entry[1] == address]
            if len(mine) >= MAX_PENDING_PER_ADDRESS:
                self._evict(mine[0])
            elif len(self._pending) >= MAX_PENDING:
                self._evict(self._pending[0])
            self._pending.append((conn, address))

    def _evict(self, entry: tuple[socket.socket, str]) -> None:
        self._pending.remove(entry)
        self._evicted.add(entry[0])
        self.refused += 1
        with contextlib.suppress(OSError):
            entry[0].shutdown(socket.SHUT_RDWR)  # its handshake's recv returns at once

    def _wait_out_bad_tokens(self, address: str) -> None:
        with self._lock:
            until = self._bad_until.get(address, 0.0)
        wait = until - time.monotonic()
        if wait > 0:
            self._closed.wait(min(wait, HANDSHAKE_DEADLINE_S))

    def _handshake(self, conn: socket.socket, who: str, address: str) -> bool:
        """Read and check the hello within :data:`HANDSHAKE_DEADLINE_S` in all."""
        keep_alive(conn)
        deadline = time.monotonic() + HANDSHAKE_DEADLINE_S

        def recv() -> bytes:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Refusal(f"no hello within {HANDSHAKE_DEADLINE_S:g} s")
            conn.settimeout(left)
            try:
                return conn.recv(4096)
            except TimeoutError:
                raise Refusal(f"no hello within {HANDSHAKE_DEADLINE_S:g} s") from None
            except OSError:
                return b""

        try:
            check_hello(read_first_frame(recv, "the viewer"), token=self._token)
        except Refusal as exc:
            with self._lock:
                evicted = conn in self._evicted
            if not evicted:
                if str(exc).startswith("bad token"):
                    self._bad_token(address)
                self._refuse(conn, who, str(exc))
            return False
        with self._lock:
            self._bad_tokens.pop(address, None)
            self._bad_until.pop(address, None)
        return True

    def _bad_token(self, address: str) -> None:
        with self._lock:
            count = self._bad_tokens.get(address, 0) + 1
            self._bad_tokens[address] = count
            if count > BAD_TOKENS_FREE:
                wait = min(BAD_TOKEN_MAX_WAIT_S, 2.0 ** (count - BAD_TOKENS_FREE - 1))
                self._bad_until[address] = time.monotonic() + wait

    def _refuse(self, conn: socket.socket, who: str, reason: str) -> None:
        self.refused += 1
        with contextlib.suppress(OSError):
            conn.sendall(encode(Refused(reason=reason)))
        self._log(f"refused {who}: {printable(reason, one_line=True)}")

    def _serve_viewer(self, conn: socket.socket, who: str) -> None:
        conn.settimeout(None)
        session = RelaySession(conn.sendall, self._run_id)
        with self._lock:
            if self._closed.is_set():
                return
            self._live.add(session)
        self._log(f"serving {who}")
        try:
            session.start().serve(lambda: conn.recv(4096))
        finally:
            with self._lock:
                self._live.discard(session)
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            self._log(f"{who} left")

    def close(self) -> None:
        """Stop accepting; close every viewer's session (and so every agent's connection)."""
        self._closed.set()
        with contextlib.suppress(OSError):
            self.server.close()
        with self._lock:
            live = list(self._live)
        for session in live:
            session.stop()


def default_token_file(port: int) -> Path:
    return runtime_dir() / f"relay-{port}.token"


def serve_tcp(listen: str, token_file: Path | None, run_id: str | None = None) -> int:
    """``torchtop relay --listen``: until SIGINT or SIGTERM. The token comes from
    ``token_file`` (made there if missing) or is new, written 0600 under the runtime
    directory and removed at the end."""
    from torchtop.transport import ensure_runtime_dir

    host, port = parse_listen(listen)
    server = bind_tcp(host, port)
    made: Path | None = None
    try:
        ensure_runtime_dir()  # the agents' folder, checked before anything is served from it
        if token_file is None:
            made = default_token_file(server.getsockname()[1])
        path = token_file or made
        assert path is not None
        token, _new = token_for(path)
        relay = TcpRelay(server, token, run_id)
    except (RelayError, TransportError) as exc:
        server.close()
        raise RelayError(str(exc)) from None
    where = f"{relay.address[0]}:{relay.address[1]}"
    scope = "this machine only" if is_loopback(host) else "reachable from other machines"
    print(
        f"torchtop relay: serving this node's agents on {where} ({scope}) to viewers with "
        f"the token in {path}: `torchtop attach --node tcp://HOST:{relay.address[1]} "
        "--token-file FILE` with a copy of that file",
        file=sys.stderr,
        flush=True,
    )
    if sys.stderr.isatty():
        print(f"torchtop relay: token {token}", file=sys.stderr, flush=True)

    def stop(_signum: int, _frame: FrameType | None) -> None:
        relay.close()

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        relay.serve()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        relay.close()
        if made is not None:
            with contextlib.suppress(OSError):
                made.unlink()
    return 0
