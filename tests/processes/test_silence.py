"""A connected agent that stops sending: the viewer says "no data for N s", not "live"."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

from tests.conftest import SCRIPTS
from torchtop.launch import python_module
from torchtop.model.connection import SourceSilent
from torchtop.model.job import JobModel
from torchtop.protocol import Message, Sample
from torchtop.streams.sources import LiveSource
from torchtop.transport import list_agents
from torchtop.tui.widgets.header import connection_badge


class Collector:
    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.changed = threading.Condition()

    def __call__(self, message: Message) -> None:
        with self.changed:
            self.messages.append(message)
            self.changed.notify_all()

    def wait_for(self, what: type, after: int = 0, timeout: float = 30) -> Message:
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                for message in self.messages[after:]:
                    if isinstance(message, what):
                        return message
                left = deadline - time.monotonic()
                assert left > 0, f"no {what.__name__} within {timeout} s"
                self.changed.wait(left)


def test_a_stopped_job_shows_no_data_then_live_again() -> None:
    job = subprocess.Popen(
        [*python_module("torchtop.agent.bootstrap"), str(SCRIPTS / "idle_job.py"), "120"],
        env={**os.environ, "TORCHTOP_AGENT_OPTIONS": json.dumps({"ops": False, "nvml": False})},
        stdout=subprocess.DEVNULL,
    )
    source = None
    try:
        deadline = time.monotonic() + 30
        while not (agents := list_agents()) and time.monotonic() < deadline:
            time.sleep(0.05)
        sink = Collector()
        source = LiveSource(agents[0].address)
        source.start(sink)
        sink.wait_for(Sample)
        os.kill(job.pid, signal.SIGSTOP)  # the whole process, agent included, stops
        stopped = len(sink.messages)
        silent = sink.wait_for(SourceSilent, after=stopped)
        assert isinstance(silent, SourceSilent) and silent.silent_s >= 3
        state = JobModel()
        state.apply_all(sink.messages)
        assert state.silent_s is not None and state.connection == "live"
        assert connection_badge(state).plain == f"◌ no data for {state.silent_s:.0f} s"
        os.kill(job.pid, signal.SIGCONT)
        resumed = len(sink.messages)
        sink.wait_for(Sample, after=resumed)
        state.apply_all(sink.messages[resumed:])
        assert state.silent_s is None
        assert connection_badge(state).plain == "● live"
    finally:
        os.kill(job.pid, signal.SIGCONT)
        if source is not None:
            source.close()
        job.kill()
        job.wait(timeout=30)
