"""A :class:`Source` for tests: delivers scripted messages and records what the app asked of it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

from torchtop.protocol import Message
from torchtop.streams.source import Sink, Source


class FakeSource(Source):
    """Delivers ``messages`` on :meth:`start` (or later, on :meth:`deliver`) from the caller's
    thread, and records every call in ``calls`` as ``(method, args...)`` tuples.

    Set ``mode``, ``owns_job``, ``seekable`` and ``running`` per test: the constructor takes
    them so one class covers a live agent, an owned job and a recording.
    """

    mode: ClassVar[str] = "live"
    owns_job: ClassVar[bool] = False
    seekable: ClassVar[bool] = False

    def __init__(
        self,
        messages: Iterable[Message] = (),
        *,
        deliver_on_start: bool = True,
        mode: str | None = None,
        owns_job: bool | None = None,
        seekable: bool | None = None,
        running: bool = False,
    ) -> None:
        # Instance attributes shadow the class defaults the base class declares.
        if mode is not None:
            self.mode = mode  # type: ignore[misc]
        if owns_job is not None:
            self.owns_job = owns_job  # type: ignore[misc]
        if seekable is not None:
            self.seekable = seekable  # type: ignore[misc]
        self.script: list[Message] = list(messages)
        self.deliver_on_start = deliver_on_start
        self.running = running
        self.sink: Sink | None = None
        self.calls: list[tuple[object, ...]] = []
        self._paused = False
        self._speed = 1.0

    # -- feeding -------------------------------------------------------------------------------

    def start(self, sink: Sink) -> None:
        self.calls.append(("start",))
        self.sink = sink
        if self.deliver_on_start:
            self.deliver()

    def deliver(self, messages: Iterable[Message] | None = None) -> None:
        """Send ``messages`` (default: whatever of the script is left) to the app's sink."""
        assert self.sink is not None, "start() has not been called"
        if messages is None:
            batch, self.script = self.script, []
        else:
            batch = list(messages)
        for message in batch:
            self.sink(message)

    def close(self) -> None:
        self.calls.append(("close",))

    # -- owned jobs ----------------------------------------------------------------------------

    def job_running(self) -> bool:
        return self.running

    def stop_job(self) -> None:
        self.calls.append(("stop_job",))
        self.running = False

    # -- recordings ----------------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return self._paused

    def set_paused(self, paused: bool) -> None:
        self.calls.append(("set_paused", paused))
        self._paused = paused

    def jump_to_end(self) -> None:
        self.calls.append(("jump_to_end",))

    def set_speed(self, speed: float) -> None:
        self.calls.append(("set_speed", speed))
        self._speed = speed

    @property
    def speed(self) -> float:
        return self._speed

    # -- for assertions ------------------------------------------------------------------------

    def called(self, method: str) -> bool:
        return any(call[0] == method for call in self.calls)


class RequestingSource(FakeSource):
    """A fake source that can (or cannot) reach an agent with requests."""

    def __init__(self, messages: Any = (), *, reachable: bool = True, **kwargs: Any) -> None:
        super().__init__(messages, **kwargs)
        self.reachable = reachable

    def send_request(self, action: str) -> bool:
        self.calls.append(("send_request", action))
        return self.reachable

    def requests(self) -> list[object]:
        return [call[1] for call in self.calls if call[0] == "send_request"]
