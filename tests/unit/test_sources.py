"""The recording source: paced playback, pause, jump to the end, and the recording's own clock."""

from __future__ import annotations

import threading
import time

from torchtop.model.connection import SourceConnected, SourceDisconnected
from torchtop.protocol import Marked, Message
from torchtop.streams.sources import RecordingSource


class Collector:
    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.done = threading.Event()

    def __call__(self, message: Message) -> None:
        self.messages.append(message)
        if isinstance(message, SourceDisconnected):
            self.done.set()


def _marks(n: int, spacing: float, t0: float = 1000.0) -> list[Message]:
    return [Marked(t=t0 + i * spacing, name=f"m{i}") for i in range(n)]


def test_plays_at_its_pace_and_keeps_the_recordings_clock() -> None:
    source, sink = RecordingSource(_marks(5, 0.05)), Collector()
    source.start(sink)
    assert sink.done.wait(5)
    assert [m.name for m in sink.messages if isinstance(m, Marked)] == [f"m{i}" for i in range(5)]
    first, last = sink.messages[0], sink.messages[-1]
    assert isinstance(first, SourceConnected) and first.t == 1000.0
    assert isinstance(last, SourceDisconnected) and last.t == 1000.2


def test_pause_holds_and_jump_to_end_delivers_the_rest() -> None:
    source, sink = RecordingSource(_marks(50, 10.0)), Collector()  # 490 s of recording
    source.start(sink)
    time.sleep(0.3)
    delivered = len(sink.messages)
    assert delivered < 5  # paced: only the start is out
    source.set_paused(True)
    assert source.paused
    source.jump_to_end()
    assert sink.done.wait(5)
    assert sum(isinstance(m, Marked) for m in sink.messages) == 50


def test_speed_changes_the_pace_within_bounds() -> None:
    source, sink = RecordingSource(_marks(20, 1.0), speed=1000.0), Collector()  # 19 s at 1000x
    source.start(sink)
    assert sink.done.wait(5)  # 19 ms of playback
    source.set_speed(5000.0)
    assert source.speed == 1000.0
    source.set_speed(0.01)
    assert source.speed == 0.1
    source.close()
