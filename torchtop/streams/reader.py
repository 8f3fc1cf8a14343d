"""One thread that reads many agents' connections: for a process that follows hundreds of jobs.

An :class:`~torchtop.streams.feed.AgentFeed` reads its agent in a thread of its own, which
suits a viewer of a few jobs. An exporter that follows every rank of a node (or a simulated
fleet of 1,024) would run that many threads, each waking for every frame and contending for the
interpreter; here one thread waits on all the connections at once (a selector) and hands each
read's frames to their feed, which decodes, completes and delivers them exactly as its own
thread would.

Each feed connects in the thread that starts it (its agent is already listening: it was found
in the runtime directory), then the reader owns the connection: it reads what is ready, ends the
feed when its agent closes the connection or sends a malformed frame, and closes the connection
of a feed that is closed. A slow callback delays the other feeds' frames (they wait in the
kernel and then in the agent's queue for this viewer), never loses them.

This module imports nothing of ``feed.py`` (which imports it): what the reader needs of a feed
is :class:`ReadFeed`.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Protocol

from torchtop.transport import AgentConnection

#: Seconds between looks for silent agents (each feed's ``on_silence``).
SILENCE_CHECK_S = 1.0


def failed(exc: Exception) -> str:
    """The end reason of a feed that failed (a bug, or an agent that refused it), read in a
    thread of its own or by a reader."""
    return f"feed failed: {exc!r}"


class ReadFeed(Protocol):
    """A feed's side of being read by a :class:`FeedReader` (an
    :class:`~torchtop.streams.feed.AgentFeed`'s)."""

    @property
    def ended(self) -> threading.Event:
        """Set once the feed ended (``_end`` was called)."""

    @property
    def closed(self) -> bool:
        """Whether the feed was closed by its viewer."""

    def close(self) -> None:
        """Close the feed (its reader then ends it: ``_outcome`` says detached)."""

    def _open(self) -> AgentConnection | str:
        """Wait for the agent and connect, in the caller's thread: the connection, or the
        reason the feed ends without one."""

    def _take(self, frames: Iterable[bytes]) -> str | None:
        """Hand on the frames of one read, in order: the reason the feed ends where one ends
        it (a malformed frame, a failing callback), else ``None``."""

    def _check_silence(self) -> None:
        """Say, where the agent has been silent for long, for how long."""

    def _outcome(self) -> str:
        """Why the feed ends, once its connection closed."""

    def _end(self, reason: str) -> None:
        """End the feed with ``reason`` (once)."""


class FeedReader:
    """Reads the connections of every feed given to it (``AgentFeed(reader=...)``)."""

    def __init__(self, name: str = "torchtop-feeds") -> None:
        self._selector = selectors.DefaultSelector()
        # A pipe wakes the selector (not a socket pair: the process's sockets stay its agents').
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        #: Feeds to start reading (with their connection) and feeds closed (``None``), in the
        #: order they came.
        self._changes: deque[tuple[ReadFeed, AgentConnection | None]] = deque()
        #: The feeds read now, and their connections.
        self._feeds: dict[ReadFeed, AgentConnection] = {}
        self._stop = False
        #: Started with the first feed.
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def __len__(self) -> int:
        """Feeds being read now."""
        return len(self._feeds)

    def add(self, feed: ReadFeed) -> None:
        """Connect ``feed`` (in this thread) and read it from now on; a feed that cannot
        connect ends at once, with the reason its own thread would give."""
        opened = feed._open()
        if isinstance(opened, str):
            feed._end(opened)
            return
        self._change(feed, opened)

    def drop(self, feed: ReadFeed) -> None:
        """Stop reading ``feed``: its connection is closed and it ends (``detached``)."""
        self._change(feed, None)

    def close(self, timeout: float = 5.0) -> None:
        """Stop reading: every feed still read ends, as if closed."""
        with self._lock:
            self._stop = True
            started = self._thread.ident is not None
        if not started:
            self._close_selector()
            return
        self._wake()
        self._thread.join(timeout)

    def _change(self, feed: ReadFeed, conn: AgentConnection | None) -> None:
        with self._lock:
            stopped = self._stop
            if not stopped:
                self._changes.append((feed, conn))
                if conn is not None and self._thread.ident is None:
                    self._thread.start()
        if not stopped:
            self._wake()
        elif conn is not None:  # came after the reader stopped: closed, never read
            feed.close()
            self._finish_unread(feed, conn)

    def _wake(self) -> None:
        with self._lock, contextlib.suppress(OSError):  # full: it is awake already
            if self._wake_w >= 0:  # not closed
                os.write(self._wake_w, b"\0")

    def _run(self) -> None:
        next_silence = time.monotonic() + SILENCE_CHECK_S
        try:
            while not self._apply_changes():
                for key, _events in self._selector.select(SILENCE_CHECK_S):
                    if key.data is None:
                        with contextlib.suppress(OSError):
                            os.read(self._wake_r, 4096)
                    else:
                        self._read(key.data)
                now = time.monotonic()
                if now >= next_silence:
                    next_silence = now + SILENCE_CHECK_S
                    for feed in list(self._feeds):
                        try:
                            feed._check_silence()
                        except Exception as exc:  # one feed's failure ends that feed only
                            self._finish(feed, failed(exc))
        finally:
            with self._lock:
                self._stop = True  # a feed given from now on is closed at once
                left = [(feed, conn) for feed, conn in self._changes if conn is not None]
                self._changes.clear()
            for feed, conn in left:
                feed.close()
                self._finish_unread(feed, conn)
            for feed in list(self._feeds):
                feed.close()  # its reason: detached
                self._finish(feed, feed._outcome())
            self._close_selector()

    def _close_selector(self) -> None:
        with self._lock:  # once: a pipe's fd closed twice could be another file's by then
            if self._wake_r < 0:
                return
            wake_r, wake_w, self._wake_r, self._wake_w = self._wake_r, self._wake_w, -1, -1
        self._selector.close()
        os.close(wake_r)
        os.close(wake_w)

    def _apply_changes(self) -> bool:
        """Start and stop reading the feeds given since the last look; True to stop."""
        while True:
            with self._lock:
                if not self._changes:
                    return self._stop
                feed, conn = self._changes.popleft()
            if conn is None:
                if feed in self._feeds:
                    self._finish(feed, feed._outcome())
            elif feed in self._feeds or feed.ended.is_set():  # started twice: read once
                conn.close()
            elif feed.closed:  # closed while it connected
                self._finish_unread(feed, conn)
            else:
                try:
                    self._selector.register(conn.sock, selectors.EVENT_READ, feed)
                except (OSError, ValueError) as exc:  # its socket is no longer open
                    self._finish_unread(feed, conn, failed(exc))
                    continue
                self._feeds[feed] = conn

    def _read(self, feed: ReadFeed) -> None:
        conn = self._feeds.get(feed)
        if conn is None:  # ended earlier in this round of the selector
            return
        frames = conn.receive()
        reason = feed._outcome() if frames is None else feed._take(frames)
        if reason is not None:
            self._finish(feed, reason)

    def _finish(self, feed: ReadFeed, reason: str) -> None:
        conn = self._feeds.pop(feed)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        self._finish_unread(feed, conn, reason)

    def _finish_unread(
        self, feed: ReadFeed, conn: AgentConnection, reason: str | None = None
    ) -> None:
        conn.close()
        feed._end(reason or feed._outcome())
