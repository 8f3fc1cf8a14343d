"""One thread that reads many agents' connections: for a process that follows hundreds of jobs.

An :class:`~torchtop.streams.feed.AgentFeed` reads its agent in a thread of its own, which
suits a viewer of a few jobs. An exporter that follows every rank of a node (or a simulated
fleet of 1,024) would run that many threads, each waking for every frame and contending for the
interpreter; here one thread waits on all the connections at once (a selector) and hands each
frame to its feed, which decodes, completes and delivers it exactly as its own thread would.

Each feed connects in the thread that starts it (its agent is already listening: it was found
in the runtime directory), then the reader owns the connection: it reads what is ready, ends the
feed when its agent closes the connection or sends a malformed frame, and closes the connection
of a feed that is closed. A slow callback delays the other feeds' frames (they wait in the
kernel and then in the agent's queue for this viewer), never loses them.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from torchtop.protocol import ProtocolError

if TYPE_CHECKING:
    from torchtop.streams.feed import AgentFeed

#: Seconds between looks for silent agents (each feed's ``on_silence``).
SILENCE_CHECK_S = 1.0


class FeedReader:
    """Reads the connections of every feed given to it (``AgentFeed(reader=...)``)."""

    def __init__(self, name: str = "torchtop-feeds") -> None:
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        #: Feeds to start reading and feeds closed, in the order they came.
        self._changes: deque[tuple[bool, AgentFeed]] = deque()
        self._feeds: set[AgentFeed] = set()
        self._stop = False
        #: Started with the first feed.
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def __len__(self) -> int:
        """Feeds being read now."""
        return len(self._feeds)

    def add(self, feed: AgentFeed) -> None:
        """Connect ``feed`` (in this thread) and read it from now on; a feed that cannot
        connect ends at once, with the reason its own thread would give."""
        try:
            reason = feed._connect()
        except Exception as exc:  # as AgentFeed's own thread: an end reason, not a traceback
            reason = f"feed failed: {exc!r}"
        if reason is not None:
            feed._end(reason)
            return
        self._change(True, feed)

    def drop(self, feed: AgentFeed) -> None:
        """Stop reading ``feed``: its connection is closed and it ends (``detached``)."""
        self._change(False, feed)

    def close(self, timeout: float = 5.0) -> None:
        """Stop reading: every feed still read ends, as if closed."""
        with self._lock:
            self._stop = True
            started = self._thread.is_alive() or self._thread.ident is not None
        if not started:
            self._close_selector()
            return
        self._wake()
        self._thread.join(timeout)

    def _change(self, add: bool, feed: AgentFeed) -> None:
        with self._lock:
            stopped = self._stop
            if not stopped:
                self._changes.append((add, feed))
                if add and self._thread.ident is None:
                    self._thread.start()
        if stopped:
            if add:
                self._finish_unread(feed)
            return
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full: it is awake already
            self._wake_w.send(b"\0")

    def _run(self) -> None:
        next_silence = time.monotonic() + SILENCE_CHECK_S
        try:
            while not self._apply_changes():
                for key, _events in self._selector.select(SILENCE_CHECK_S):
                    if key.data is None:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    else:
                        self._read(key.data)
                now = time.monotonic()
                if now >= next_silence:
                    next_silence = now + SILENCE_CHECK_S
                    for feed in list(self._feeds):
                        feed._check_silence()
        finally:
            for feed in list(self._feeds):
                feed._closed.set()
                self._finish(feed, feed._outcome())
            self._close_selector()

    def _close_selector(self) -> None:
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    def _apply_changes(self) -> bool:
        """Start and stop reading the feeds given since the last look; True to stop."""
        while True:
            with self._lock:
                if not self._changes:
                    return self._stop
                add, feed = self._changes.popleft()
            if add and feed not in self._feeds and not feed.ended.is_set():
                if feed.closed:  # closed while it connected
                    self._finish_unread(feed)
                    continue
                assert feed._conn is not None
                try:
                    self._selector.register(feed._conn.sock, selectors.EVENT_READ, feed)
                except (OSError, ValueError) as exc:  # its socket is no longer open
                    self._finish_unread(feed, f"feed failed: {exc!r}")
                    continue
                self._feeds.add(feed)
            elif not add and feed in self._feeds:
                self._finish(feed, feed._outcome())

    def _read(self, feed: AgentFeed) -> None:
        from torchtop.streams.feed import malformed

        conn = feed._conn
        assert conn is not None
        try:
            frames = conn.receive()
            if frames is None:
                self._finish(feed, feed._outcome())
                return
            for frame in frames:
                feed._receive(frame)
        except ProtocolError as exc:
            self._finish(feed, malformed(exc))
        except Exception as exc:  # one feed's failure ends that feed only
            self._finish(feed, f"feed failed: {exc!r}")

    def _finish(self, feed: AgentFeed, reason: str) -> None:
        conn = feed._conn
        self._feeds.discard(feed)
        if conn is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(conn.sock)
            conn.close()
        feed._end(reason)

    def _finish_unread(self, feed: AgentFeed, reason: str | None = None) -> None:
        if feed._conn is not None:
            feed._conn.close()
        feed._end(reason or feed._outcome())
