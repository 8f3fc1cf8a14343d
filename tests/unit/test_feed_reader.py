"""One thread reading many agents' connections (:class:`FeedReader`): every frame reaches its
own feed in order, each feed ends with the reason its own thread would give, and closing one
feed or one agent leaves the others reading.

The agents are the agent's own socket server (:class:`AgentServer`) where what it sends will
do, and a bare listening socket where a test must send what a server never would (half a
frame, a malformed one) or close at a chosen moment."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from torchtop.agent.server import EVENTS, SAMPLES, AgentServer, RingLimit
from torchtop.protocol import (
    PROTOCOL_VERSION,
    ClientHello,
    FrameSplitter,
    Hello,
    JobExited,
    Message,
    Sample,
    decode,
    encode,
)
from torchtop.streams import feed as feed_module
from torchtop.streams import reader as reader_module
from torchtop.streams.feed import LOST, AgentFeed
from torchtop.streams.reader import FeedReader
from torchtop.transport import bind_server

T0 = 1_700_000_000.0
WAIT_S = 10.0  # a deadline for what must happen, never a measure
#: Pids for the servers' socket names: above any this machine gives (pid_max is at most 2**22).
FAKE_PID = 5_000_000


def hello(pid: int) -> Hello:
    return Hello(
        protocol=PROTOCOL_VERSION, pid=pid, argv=["train.py"], cwd="/", started_at=T0,
        python="3.11", torch=None, devices=[], interval_s=0.1,
    )  # fmt: skip


def hello_frame(pid: int) -> Callable[[], bytes]:
    frame = encode(hello(pid))
    return lambda: frame


class Agent:
    """A listening socket that speaks as an agent does once a viewer connects."""

    def __init__(self, path: Path) -> None:
        self.address = f"unix:{path}"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(1)
        self.conn: socket.socket | None = None

    def accept(self) -> ClientHello:
        self.listener.settimeout(WAIT_S)
        self.conn, _ = self.listener.accept()
        self.conn.settimeout(WAIT_S)
        splitter = FrameSplitter()
        while True:
            frames = list(splitter.feed(self.conn.recv(4096)))
            if frames:
                message = decode(frames[0])
                assert isinstance(message, ClientHello)
                return message

    def send(self, *messages: Message | bytes) -> None:
        assert self.conn is not None
        for m in messages:
            self.conn.sendall(m if isinstance(m, bytes) else encode(m))

    def hung_up(self) -> bool:
        """Whether the viewer closed the connection (reset, where frames were left unread)."""
        assert self.conn is not None
        try:
            return self.conn.recv(1) == b""
        except ConnectionResetError:
            return True

    def hang_up(self) -> None:
        assert self.conn is not None
        self.conn.close()

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.listener.close()


class Followed:
    """A feed read by the shared reader, and what it delivered."""

    def __init__(self, address: str, reader: FeedReader) -> None:
        self.messages: list[Message] = []
        self.reasons: list[str] = []
        self.feed = AgentFeed(
            address=address, client="exporter", outside=False, reader=reader,
            on_message=self.messages.append, on_end=self.reasons.append,
        )  # fmt: skip


@pytest.fixture
def agents(runtime_dir: Path) -> Iterator[list[Agent]]:
    # Beside the runtime directory: a short path (a Unix socket's is at most 108 bytes).
    made = [Agent(runtime_dir.parent / f"{i}.sock") for i in range(64)]
    yield made
    for agent in made:
        agent.close()


@pytest.fixture
def reader() -> Iterator[FeedReader]:
    shared = FeedReader(name="test-feeds")
    yield shared
    shared.close()


def follow(agents: list[Agent], reader: FeedReader) -> list[Followed]:
    followed = [Followed(agent.address, reader) for agent in agents]
    for f, agent in zip(followed, agents, strict=True):
        f.feed.start()  # connects here (the agent's backlog holds it), then the reader reads
        assert agent.accept().client == "exporter"
    return followed


def wait_for(event: threading.Event) -> None:
    assert event.wait(WAIT_S)


def wait_for_messages(f: Followed, count: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while len(f.messages) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(f.messages) >= count


def test_one_thread_reads_every_agent_in_order(agents: list[Agent], reader: FeedReader) -> None:
    threads_before = threading.active_count()
    followed = follow(agents, reader)
    assert threading.active_count() == threads_before + 1  # the reader's thread, not 64
    for i, agent in enumerate(agents):
        agent.send(hello(1000 + i))
    for round_ in range(5):
        for agent in agents:
            # Frames cut anywhere arrive whole: half a frame now, the rest with the next.
            frame = encode(Sample(T0 + round_, None, []))
            agent.send(frame[:7], frame[7:])
    for i, agent in enumerate(agents):
        agent.send(JobExited(T0 + 9, exit_code=0, reason=f"done {i}"))
        agent.hang_up()
    for f in followed:
        wait_for(f.feed.ended)
    for i, f in enumerate(followed):
        assert f.reasons == ["job exited"]
        assert f.feed.end_reason == "job exited"
        assert [type(m).__name__ for m in f.messages] == ["Hello"] + ["Sample"] * 5 + ["JobExited"]
        assert [m.t for m in f.messages if isinstance(m, Sample)] == [T0 + r for r in range(5)]
        first, last = f.messages[0], f.messages[-1]
        assert isinstance(first, Hello) and first.pid == 1000 + i
        assert isinstance(last, JobExited) and last.reason == f"done {i}"
    assert len(reader) == 0


def test_agent_servers_frames_reach_their_feeds_in_order(reader: FeedReader) -> None:
    servers = []
    for i in range(16):
        listener, info = bind_server(FAKE_PID + i, ["train.py"], T0)
        server = AgentServer(
            listener,
            hello_frame(FAKE_PID + i),
            rings={SAMPLES: RingLimit(1000, 1 << 20), EVENTS: RingLimit(100, 1 << 20)},
        )
        server.start()
        servers.append((server, info.address))
    try:
        followed = [Followed(address, reader) for _server, address in servers]
        for f in followed:
            f.feed.start()
        for f in followed:
            wait_for_messages(f, 1)  # the server's hello: the feed is greeted
        for step in range(100):
            for server, _address in servers:
                server.publish(encode(Sample(T0 + step, None, [])))
        for i, (server, _address) in enumerate(servers):
            server.publish(encode(JobExited(T0 + 200, exit_code=0, reason=f"done {i}")), EVENTS)
            server.stop(drain_s=WAIT_S)  # the job exits: its agent closes every connection
        for f in followed:
            wait_for(f.feed.ended)
    finally:
        for server, _address in servers:
            server.stop(drain_s=0)
    for i, f in enumerate(followed):
        assert f.reasons == ["job exited"]
        first, last = f.messages[0], f.messages[-1]
        assert isinstance(first, Hello) and first.pid == FAKE_PID + i
        assert [m.t for m in f.messages if isinstance(m, Sample)] == [T0 + s for s in range(100)]
        assert isinstance(last, JobExited) and last.reason == f"done {i}"
    assert len(reader) == 0


def test_each_feed_ends_for_its_own_reason_and_the_others_go_on(
    agents: list[Agent], reader: FeedReader
) -> None:
    lost, malformed, detached, *rest = follow(agents[:5], reader)
    for agent in agents[:5]:
        agent.send(hello(1))
    agents[0].hang_up()  # no exit: the connection was lost
    agents[1].send(b"{not json\n")
    detached.feed.close()  # the reader closes the connection: the agent sees its end
    assert agents[2].hung_up()
    for f in (lost, malformed, detached):
        wait_for(f.feed.ended)
    assert lost.reasons == [LOST]
    assert len(malformed.reasons) == 1
    assert malformed.reasons[0].startswith("the agent sent a malformed frame")
    assert detached.reasons == ["detached"]
    for agent in agents[3:5]:
        agent.send(Sample(T0 + 1, None, []))
    for f in rest:
        wait_for_messages(f, 2)
        assert not f.feed.ended.is_set()
    assert len(reader) == 2
    reader.close()  # what is still read ends as closed by the viewer
    assert all(f.reasons == ["detached"] for f in rest)
    assert all(agent.hung_up() for agent in agents[3:5])
    # A feed started once the reader closed is closed, never read.
    late = Followed(agents[5].address, reader)
    late.feed.start()
    assert late.reasons == ["detached"]


def test_a_failing_callback_ends_its_feed_only(agents: list[Agent], reader: FeedReader) -> None:
    bad, good = follow(agents[:2], reader)

    def fail(message: Message) -> None:
        raise RuntimeError("a bug in the fold")

    bad.feed._on_message = fail
    agents[0].send(hello(1))
    agents[1].send(hello(2))
    wait_for(bad.feed.ended)
    assert bad.reasons == ["feed failed: RuntimeError('a bug in the fold')"]
    wait_for_messages(good, 1)
    assert not good.feed.ended.is_set()


def test_silent_agents_are_reported_and_a_failing_report_ends_its_feed_only(
    agents: list[Agent], reader: FeedReader, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(feed_module, "SILENCE_MIN_S", 0.0)
    monkeypatch.setattr(reader_module, "SILENCE_CHECK_S", 0.05)
    quiet, bad = follow(agents[:2], reader)
    silences: list[float] = []
    quiet.feed._on_silence = silences.append

    def fail(_seconds: float) -> None:
        raise RuntimeError("a bug in the view")

    bad.feed._on_silence = fail
    for agent in agents[:2]:
        agent.send(replace(hello(1), interval_s=0.01))  # silent after 0.2 s without a frame
    wait_for(bad.feed.ended)
    assert bad.reasons == ["feed failed: RuntimeError('a bug in the view')"]
    deadline = time.monotonic() + WAIT_S
    while not silences and time.monotonic() < deadline:
        time.sleep(0.01)
    assert silences and silences[0] >= 0.2
    assert not quiet.feed.ended.is_set()


def test_an_agent_that_is_not_listening_ends_its_feed_at_once(
    runtime_dir: Path, reader: FeedReader
) -> None:
    reasons: list[str] = []
    feed = AgentFeed(
        address=f"unix:{runtime_dir.parent}/gone.sock", outside=False, reader=reader,
        on_end=reasons.append,
    )  # fmt: skip
    feed.start()
    assert feed.ended.is_set() and len(reasons) == 1
    assert reasons[0].startswith("feed failed: TransportError")
    assert feed.join(0)
    assert len(reader) == 0


def test_a_feed_closed_while_it_connects_is_never_read(
    agents: list[Agent], reader: FeedReader
) -> None:
    reasons: list[str] = []
    feed = AgentFeed(
        address=agents[0].address, outside=False, reader=reader, on_end=reasons.append,
        on_connect=lambda _address: feed.close(),
    )  # fmt: skip
    feed.start()
    wait_for(feed.ended)
    assert reasons == ["detached"] and len(reader) == 0
    agents[0].accept()
    assert agents[0].hung_up()
