"""One thread reading many agents' connections (:class:`FeedReader`): every frame reaches its
own feed in order, each feed ends with the reason its own thread would give, and closing one
feed or one agent leaves the others reading."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

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
from torchtop.streams.feed import LOST, AgentFeed
from torchtop.streams.reader import FeedReader

T0 = 1_700_000_000.0
WAIT_S = 10.0  # a deadline for what must happen, never a measure


def hello(pid: int) -> Hello:
    return Hello(
        protocol=PROTOCOL_VERSION, pid=pid, argv=["train.py"], cwd="/", started_at=T0,
        python="3.11", torch=None, devices=[], interval_s=0.1,
    )  # fmt: skip


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

    def __init__(self, agent: Agent, reader: FeedReader) -> None:
        self.messages: list[Message] = []
        self.reasons: list[str] = []
        self.feed = AgentFeed(
            address=agent.address, client="exporter", outside=False, reader=reader,
            on_message=self.messages.append, on_end=self.reasons.append,
        )  # fmt: skip


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[list[Agent]]:
    made = [Agent(tmp_path / f"{i}.sock") for i in range(64)]
    yield made
    for agent in made:
        agent.close()


@pytest.fixture
def reader() -> Iterator[FeedReader]:
    shared = FeedReader(name="test-feeds")
    yield shared
    shared.close()


def follow(agents: list[Agent], reader: FeedReader) -> list[Followed]:
    followed = [Followed(agent, reader) for agent in agents]
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
        assert [type(m).__name__ for m in f.messages] == ["Hello"] + ["Sample"] * 5 + ["JobExited"]
        assert [m.t for m in f.messages if isinstance(m, Sample)] == [T0 + r for r in range(5)]
        first, last = f.messages[0], f.messages[-1]
        assert isinstance(first, Hello) and first.pid == 1000 + i
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


def test_an_agent_that_is_not_listening_ends_its_feed_at_once(
    tmp_path: Path, reader: FeedReader
) -> None:
    reasons: list[str] = []
    feed = AgentFeed(
        address=f"unix:{tmp_path}/gone.sock", outside=False, reader=reader,
        on_end=reasons.append,
    )  # fmt: skip
    feed.start()
    assert feed.ended.is_set() and reasons[0].startswith("feed failed: TransportError")
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
