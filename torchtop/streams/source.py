"""Where the viewer's messages come from: a live agent, a job torchtop runs, or a recording.

A source feeds :mod:`torchtop.protocol` messages, plus the source events of
:mod:`torchtop.model.connection`, to a thread-safe ``sink`` from its own background thread. The app
drains what arrived at a steady frame rate into :class:`torchtop.model.JobModel`. Tests use a
fake source.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from torchtop.model.connection import (
    SourceConnected,
    SourceDisconnected,
    SourceSilent,
    SourceStatus,
)
from torchtop.protocol import Message

Sink = Callable[[Message], None]

__all__ = [
    "Sink",
    "Source",
    "SourceConnected",
    "SourceDisconnected",
    "SourceSilent",
    "SourceStatus",
]


class Source:
    """Base class. Subclasses override :meth:`start` and :meth:`close` and any capability."""

    #: Shown in the header: "live", "run", "replay".
    mode: ClassVar[str] = "live"
    #: True when quitting should ask whether to stop the job or leave it running.
    owns_job: ClassVar[bool] = False
    #: True for recordings: play, pause and jump to the end apply.
    seekable: ClassVar[bool] = False
    #: False where no agent answers requests (a recording, a job watched from outside): the
    #: snapshot and op-window keys are not offered.
    takes_requests: ClassVar[bool] = True

    def start(self, sink: Sink) -> None:
        """Begin feeding ``sink`` from a background thread. Returns at once."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop feeding and release the connection. Leaves the job running."""

    # -- owned jobs ---------------------------------------------------------------------------

    def job_running(self) -> bool:
        return False

    def stop_job(self) -> None:
        """Ask the job to stop (SIGINT, then SIGTERM, then SIGKILL if it will not)."""

    # -- recordings ---------------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return False

    def set_paused(self, paused: bool) -> None:
        """Pause or resume playback."""

    def jump_to_end(self) -> None:
        """Deliver everything that is left at once."""

    def set_speed(self, speed: float) -> None:
        """Playback speed as a multiple of real time."""

    @property
    def speed(self) -> float:
        return 1.0

    # -- requests to the agent ------------------------------------------------------------------

    def send_request(self, action: str) -> bool:
        """Ask the agent for something (``protocol.REQUEST_*``: a snapshot now, resume a job
        held at an OOM). False when this source cannot reach an agent (a recording, or not
        connected)."""
        return False
