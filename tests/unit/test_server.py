"""The agent's socket server: history, several viewers, bad peers, and stalled viewers."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from torchtop.agent import server as server_module
from torchtop.agent.server import ANSWERS, EVENTS, SAMPLES, AgentServer, RingLimit
from torchtop.protocol import (
    PROTOCOL_VERSION,
    ClientHello,
    Dropped,
    FrameSplitter,
    Hello,
    Marked,
    Message,
    PhaseBegan,
    Request,
    decode,
    encode,
)
from torchtop.transport import bind_server

HELLO = Hello(
    protocol=PROTOCOL_VERSION,
    pid=1,
    argv=["x"],
    cwd="/",
    started_at=0.0,
    python="3",
    torch=None,
    devices=[],
    interval_s=0.1,
)


@pytest.fixture
def server() -> Iterator[AgentServer]:
    listener, info = bind_server(os.getpid(), ["test"], time.time())
    srv = AgentServer(
        listener,
        lambda: encode(HELLO),
        rings={SAMPLES: RingLimit(50, 1 << 20), EVENTS: RingLimit(50, 1 << 20)},
        client_queue=20,
    )
    srv.address = info.socket_path  # type: ignore[attr-defined]
    srv.start()
    yield srv
    srv.stop(drain_s=0)


def _connect(srv: AgentServer, hello: bytes | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(5)
    sock.connect(srv.address)  # type: ignore[attr-defined]
    try:
        sock.sendall(hello if hello is not None else encode(ClientHello(protocol=PROTOCOL_VERSION)))
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused at once; the caller checks that it is closed
    return sock


def _read(sock: socket.socket, count: int, timeout: float = 5) -> list[Message]:
    splitter = FrameSplitter()
    out: list[Message] = []
    deadline = time.monotonic() + timeout
    while len(out) < count and time.monotonic() < deadline:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            break
        if not data:
            break
        for frame in splitter.feed(data):
            message = decode(frame)
            if message is not None:
                out.append(message)
    return out


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _mark(i: int) -> bytes:
    return encode(Marked(t=float(i), name=f"m{i}"))


def test_socket_and_directory_modes(server: AgentServer, runtime_dir: object) -> None:
    path = server.address  # type: ignore[attr-defined]
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700


def test_late_viewer_gets_hello_then_history_in_order(server: AgentServer) -> None:
    for i in range(5):
        server.publish(_mark(i), EVENTS if i % 2 else SAMPLES)
    sock = _connect(server)
    messages = _read(sock, 6)
    assert isinstance(messages[0], Hello)
    assert [m.name for m in messages[1:]] == [f"m{i}" for i in range(5)]  # type: ignore[attr-defined]
    server.publish(_mark(99))
    assert _read(sock, 1)[0].name == "m99"  # type: ignore[attr-defined]


def test_history_ring_is_bounded(server: AgentServer) -> None:
    for i in range(200):
        server.publish(_mark(i))
    messages = _read(_connect(server), 51)
    names = [m.name for m in messages[1:]]  # type: ignore[attr-defined]
    assert names == [f"m{i}" for i in range(150, 200)]


def test_several_viewers_at_once(server: AgentServer) -> None:
    socks = [_connect(server) for _ in range(3)]
    for sock in socks:
        assert isinstance(_read(sock, 1)[0], Hello)
    server.publish(_mark(7))
    for sock in socks:
        assert _read(sock, 1)[0].name == "m7"  # type: ignore[attr-defined]
    assert server.client_count == 3


@pytest.mark.parametrize(
    "payload",
    [
        os.urandom(4096) + b"\n",
        b"x" * (200 * 1024),
        encode(ClientHello(protocol=PROTOCOL_VERSION + 1)),
        encode(Marked(t=0.0, name="not a hello")),
    ],
    ids=["random-bytes", "oversized", "unknown-version", "no-hello"],
)
def test_bad_peer_is_closed_and_others_keep_going(server: AgentServer, payload: bytes) -> None:
    good = _connect(server)
    assert isinstance(_read(good, 1)[0], Hello)
    bad = socket.socket(socket.AF_UNIX)
    bad.settimeout(5)
    bad.connect(server.address)  # type: ignore[attr-defined]
    try:
        bad.sendall(payload)
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert _closed(bad)
    server.publish(_mark(1))
    assert _read(good, 1)[0].name == "m1"  # type: ignore[attr-defined]
    assert _read(_connect(server), 2)[-1].name == "m1"  # type: ignore[attr-defined]


def test_silent_peer_is_dropped_after_the_hello_timeout(
    server: AgentServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_module, "HELLO_TIMEOUT_S", 0.2)
    silent = socket.socket(socket.AF_UNIX)
    silent.settimeout(5)
    silent.connect(server.address)  # type: ignore[attr-defined]
    assert _closed(silent)


def test_other_users_are_refused(server: AgentServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_module, "peer_uid", lambda sock: os.getuid() + 1)
    assert _closed(_connect(server))


def test_stalled_viewer_costs_only_its_bounded_queue(server: AgentServer) -> None:
    stalled = _connect(server)
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    time.sleep(0.2)  # let the server greet it
    frame = encode(Marked(t=0.0, name="x" * 1000))
    for _ in range(5000):
        server.publish(frame)
    # Bounded: the queue (20 frames) plus one send chunk, whatever the viewer failed to read.
    assert server.pending_bytes() <= 20 * len(frame) + server_module.SEND_CHUNK + len(frame)
    assert server.total_dropped() > 4000
    # When the viewer reads again it is told how many frames it lost.
    stalled.settimeout(1)
    dropped = [m for m in _read(stalled, 400) if isinstance(m, Dropped)]
    assert dropped and dropped[-1].count == server.total_dropped()


def _server(**kwargs: object) -> AgentServer:
    listener, info = bind_server(os.getpid(), ["test"], time.time())
    srv = AgentServer(
        listener,
        lambda: encode(HELLO),
        rings={
            SAMPLES: RingLimit(1000, 1 << 20),
            EVENTS: RingLimit(1000, 1 << 20),
            ANSWERS: RingLimit(5, 1 << 20),
        },
        **kwargs,  # type: ignore[arg-type]
    )
    srv.address = info.socket_path  # type: ignore[attr-defined]
    return srv


def _fail_once(
    monkeypatch: pytest.MonkeyPatch, srv: AgentServer, method: str, exc: BaseException
) -> None:
    """Make ``srv.method`` raise ``exc`` on its first call only."""
    original = getattr(srv, method)
    calls = []

    def failing_once() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise exc
        original()

    monkeypatch.setattr(srv, method, failing_once)


def test_a_failing_io_thread_is_restarted_and_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    errors: list[str] = []
    srv = _server(on_error=errors.append)
    _fail_once(monkeypatch, srv, "_pump", RuntimeError("boom"))
    srv.start()
    try:
        assert isinstance(_read(_connect(srv), 1)[0], Hello)
        assert errors and "RuntimeError('boom')" in errors[0] and "restarted" in errors[0]
        assert srv.failures == 1 and srv.alive
    finally:
        srv.stop(drain_s=0)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_io_thread_is_noticed_and_restarted(monkeypatch: pytest.MonkeyPatch) -> None:
    errors: list[str] = []
    srv = _server(on_error=errors.append)
    _fail_once(monkeypatch, srv, "_serve", SystemExit())  # not an Exception: the thread ends
    srv.start()
    try:
        deadline = time.monotonic() + 5
        while srv.alive and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not srv.alive
        srv.check()  # the agent's sampler calls this once a second
        assert srv.alive and errors and "I/O thread ended" in errors[0]
        assert isinstance(_read(_connect(srv), 1)[0], Hello)
    finally:
        srv.stop(drain_s=0)


def test_a_server_that_keeps_failing_closes_its_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    gave_up: list[str] = []
    srv = _server(on_give_up=gave_up.append)

    def always_failing() -> None:
        raise OSError("selector broken")

    monkeypatch.setattr(srv, "_serve", always_failing)
    srv.start()
    deadline = time.monotonic() + 5
    while not gave_up and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gave_up and f"failed {server_module.MAX_FAILURES} times" in gave_up[0]
    assert srv.gave_up and not srv.alive
    with pytest.raises(OSError):
        _connect(srv).recv(1)


def test_frequent_frames_never_push_out_rare_events() -> None:
    srv = _server()
    srv.start()
    try:
        srv.publish(encode(PhaseBegan(t=1.0, name="warmup", id=1)), EVENTS)
        for i in range(12_000):
            srv.publish(_mark(i), ANSWERS)
        messages = _read(_connect(srv), 7)
        assert isinstance(messages[1], PhaseBegan)
        assert [m.name for m in messages[2:]] == [f"m{i}" for i in range(11_995, 12_000)]  # type: ignore[attr-defined]
    finally:
        srv.stop(drain_s=0)


def test_history_is_bounded_in_bytes_and_aged_frames_are_summarized() -> None:
    listener, info = bind_server(os.getpid(), ["test"], time.time())
    srv = AgentServer(listener, lambda: encode(HELLO), rings={SAMPLES: RingLimit(10_000, 50_000)})
    srv.address = info.socket_path  # type: ignore[attr-defined]
    srv.start()
    try:
        big = encode(Marked(t=0.0, name="x" * 1000))
        for _ in range(1000):
            srv.publish(big, SAMPLES, aged=_mark(0))
        srv.publish(_mark(1), SAMPLES)
        assert srv.history_bytes() <= 50_000
        messages = _read(_connect(srv), 200, timeout=2)[1:]
        # Every frame but the last arrived as its summary; the latest is whole.
        assert [m.name for m in messages[:-1]] == ["m0"] * (len(messages) - 1)  # type: ignore[attr-defined]
        assert messages[-1].name == "m1"  # type: ignore[attr-defined]
    finally:
        srv.stop(drain_s=0)


def test_requests_are_rate_limited_per_action() -> None:
    srv = _server()
    served: list[Request] = []
    srv.on_request = served.append
    srv.start()
    try:
        sock = _connect(srv)
        _read(sock, 1)
        started = time.monotonic()
        sock.sendall(encode(Request(action="snapshot")) * 200 + encode(Request(action="profile")))
        deadline = time.monotonic() + 5
        while (
            srv.requests_dropped < 199 - server_module.REQUEST_BURST and time.monotonic() < deadline
        ):
            time.sleep(0.01)
        elapsed = time.monotonic() - started
        snapshots = [r for r in served if r.action == "snapshot"]
        assert (
            len(snapshots) <= server_module.REQUEST_BURST + elapsed / server_module.REQUEST_EVERY_S
        )
        assert [r.action for r in served].count("profile") == 1  # its own budget
    finally:
        srv.stop(drain_s=0)


def test_clients_beyond_the_cap_are_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_module, "MAX_CLIENTS", 3)
    monkeypatch.setattr(server_module, "MAX_PENDING", 4)
    srv = _server()
    srv.start()
    try:
        kept = [_connect(srv) for _ in range(3)]
        for sock in kept:
            assert isinstance(_read(sock, 1)[0], Hello)
        assert _closed(_connect(srv))  # a fourth viewer
        silent = [socket.socket(socket.AF_UNIX) for _ in range(6)]
        for sock in silent:
            sock.settimeout(5)
            sock.connect(srv.address)  # type: ignore[attr-defined]
        assert _closed(silent[0]) and _closed(silent[1])  # the oldest handshakes make room
        assert srv.refused == 3
        kept[0].close()
        time.sleep(0.2)
        assert isinstance(_read(_connect(srv), 1)[0], Hello)
    finally:
        srv.stop(drain_s=0)


def test_queues_are_bounded_in_bytes_for_all_clients(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_module, "TOTAL_QUEUE_BYTES", 200_000)
    srv = _server(client_queue=100_000)
    srv.start()
    try:
        stalled = [_connect(srv) for _ in range(5)]
        for sock in stalled:
            _read(sock, 1)
        time.sleep(0.2)
        frame = encode(Marked(t=0.0, name="x" * 1000))
        for _ in range(5000):
            srv.publish(frame)
        # Five stalled viewers together cost at most the total bound plus their send buffers.
        assert srv.pending_bytes() <= 200_000 + 5 * (server_module.SEND_CHUNK + len(frame))
        assert srv.total_dropped() > 0
    finally:
        srv.stop(drain_s=0)


def test_a_storm_of_hellos_costs_no_more_replays_than_the_greeting_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Hundreds of peers that say hello and close at once: only the budget's worth get a hello
    (and a history replay); the others are dropped unanswered, and a viewer after them is
    answered with the whole history."""
    monkeypatch.setattr(server_module, "GREET_BURST", 4)
    monkeypatch.setattr(server_module, "GREET_PER_S", 5.0)
    srv = _server()
    for i in range(100):
        srv.publish(_mark(i), EVENTS)
    start = time.monotonic()
    srv.start()
    try:
        for _ in range(300):
            _connect(srv).close()
        viewer = _connect(srv)
        messages = _read(viewer, 101, timeout=10)
        elapsed = time.monotonic() - start
        assert isinstance(messages[0], Hello)
        assert [m.name for m in messages[1:] if isinstance(m, Marked)] == [
            f"m{i}" for i in range(100)
        ]
        assert srv.clients_seen <= 4 + 5.0 * elapsed + 1, (srv.clients_seen, elapsed)
        assert srv.clients_seen < 300
    finally:
        srv.stop(drain_s=0)


def test_a_hello_waiting_for_its_turn_is_not_expired_as_silent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(server_module, "GREET_BURST", 1)
    monkeypatch.setattr(server_module, "GREET_PER_S", 2.0)
    monkeypatch.setattr(server_module, "HELLO_TIMEOUT_S", 0.2)
    srv = _server()
    srv.start()
    try:
        viewers = [_connect(srv) for _ in range(4)]  # the last waits about 1.5 s for its turn
        for sock in viewers:
            assert isinstance(_read(sock, 1)[0], Hello)
        assert srv.client_count == 4
    finally:
        srv.stop(drain_s=0)


def test_requests_sent_right_after_the_hello_are_served_while_it_waits_its_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(server_module, "GREET_BURST", 1)
    monkeypatch.setattr(server_module, "GREET_PER_S", 1.0)
    srv = _server()
    served: list[Request] = []
    srv.on_request = served.append
    srv.start()
    try:
        first = _connect(srv)
        assert isinstance(_read(first, 1)[0], Hello)  # took the one greeting of the burst
        viewer = _connect(
            srv, encode(ClientHello(protocol=PROTOCOL_VERSION)) + encode(Request("profile", 1))
        )
        assert isinstance(_read(viewer, 1)[0], Hello)
        assert [r.action for r in served] == ["profile"]
        assert srv.bad_peers == 0 and srv.clients_seen == 2
    finally:
        srv.stop(drain_s=0)


def test_a_batch_of_frames_is_sent_once_at_its_end_by_the_thread_that_published_it(
    server: AgentServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    sock = _connect(server)
    assert isinstance(_read(sock, 1)[0], Hello)
    # Settle the I/O thread first: its replay done and its periodic pump stopped, since a
    # pump that holds the viewer's send lock when a producer sends rightly leaves that send
    # to the I/O thread (a wake), which is not what this test is about.
    (client,) = server._clients.values()
    deadline = time.monotonic() + 5
    while client.replay is not None or client.want_write or client.outbuf:
        assert time.monotonic() < deadline, "the history replay never ended"
        time.sleep(0.01)
    monkeypatch.setattr(server, "_pump", lambda: None)
    with client.send_lock:  # a pump under way when it was stopped is over
        pass
    sends: list[str] = []
    wakes: list[str] = []
    send_now, wake = server.send_now, server._wake
    monkeypatch.setattr(
        server, "send_now", lambda: (sends.append(threading.current_thread().name), send_now())[1]
    )
    monkeypatch.setattr(
        server, "_wake", lambda: (wakes.append(threading.current_thread().name), wake())[1]
    )
    with server.batched():
        server.publish(_mark(1))
        with server.batched():  # a nested block ends with the outer one
            server.publish(_mark(2))
        # Another thread's frame (a log line, an OOM) does not wait for the batch.
        other = threading.Thread(target=server.publish, args=(_mark(3),), name="other")
        other.start()
        other.join()
        server.publish(_mark(4))
        assert sends == ["other"]
    assert sends == ["other", threading.current_thread().name]
    # The viewer's socket took every frame: the I/O thread was never woken for them.
    assert wakes == []
    names = [m.name for m in _read(sock, 4)]  # type: ignore[attr-defined]
    assert names == ["m1", "m2", "m3", "m4"]
    with server.batched():  # nothing published: nothing to send
        pass
    assert len(sends) == 2


def test_frames_a_full_socket_does_not_take_are_left_to_the_io_thread_in_order() -> None:
    srv = _server()
    srv.start()
    try:
        sock = _connect(srv)
        assert isinstance(_read(sock, 1)[0], Hello)
        # The viewer reads nothing for a while: more than its socket holds is published. The
        # producer does not block on the full socket (a blocking send would never return).
        frames = 3000
        for i in range(frames):
            srv.publish(encode(Marked(t=float(i), name=f"m{i}:" + "x" * 1000)))
        assert srv.pending_bytes() > 0  # left for the I/O thread, not sent by the producer
        names = [m.name.split(":")[0] for m in _read(sock, frames, timeout=20)]  # type: ignore[attr-defined]
        assert names == [f"m{i}" for i in range(frames)]  # every frame, in order
        assert srv.bad_peers == 0 and srv.total_dropped() == 0
    finally:
        srv.stop(drain_s=0)
