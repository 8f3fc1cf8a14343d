"""What the model folds besides protocol messages: where the stream comes from and how it ends.

These never cross the wire. A source (a live socket, a job torchtop runs, a recording, a fake in
tests) hands them to the model alongside the agent's messages, so the model knows whether the
job is live, lost or over without importing the viewer. A recording that runs out before the
job's exit arrives as :class:`SourceDisconnected` with :data:`END_OF_RECORDING` as its reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torchtop.protocol import Message

#: The reason a replay gives when the recording has no more frames.
END_OF_RECORDING = "end of recording"


@dataclass(frozen=True)
class SourceConnected(Message):
    """The source reached the agent (or opened the recording)."""

    KIND: ClassVar[str] = "x-source-connected"
    t: float
    address: str


@dataclass(frozen=True)
class SourceDisconnected(Message):
    """The stream ended: the job exited, was killed, we detached, or the recording ran out."""

    KIND: ClassVar[str] = "x-source-disconnected"
    t: float
    reason: str


@dataclass(frozen=True)
class SourceSilent(Message):
    """The agent is connected but has sent nothing for ``silent_s`` seconds (repeated while
    it stays silent; any later message means it speaks again)."""

    KIND: ClassVar[str] = "x-source-silent"
    t: float
    silent_s: float


@dataclass(frozen=True)
class SourceStatus(Message):
    """A line of what the source is doing ("starting the job", "waiting for the agent")."""

    KIND: ClassVar[str] = "x-source-status"
    t: float
    text: str
