"""A storm of connections does not lock out a normal viewer, and a hello storm does not grow
the agent: against a real agent process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

from tests.conftest import SCRIPTS
from torchtop.protocol import Hello
from torchtop.transport import AgentConnection, list_agents


def _storm(path: str, stop: threading.Event) -> None:
    while not stop.is_set():
        sock = socket.socket(socket.AF_UNIX)
        try:
            sock.connect(path)
        except OSError:
            pass
        finally:
            sock.close()


def test_normal_attaches_get_through_a_connect_storm() -> None:
    job = subprocess.Popen(
        [sys.executable, "-m", "torchtop.agent.bootstrap", str(SCRIPTS / "idle_job.py"), "120"],
        env={**os.environ, "TORCHTOP_AGENT_OPTIONS": json.dumps({"ops": False, "nvml": False})},
        stdout=subprocess.DEVNULL,
    )
    stop = threading.Event()
    threads: list[threading.Thread] = []
    try:
        deadline = time.monotonic() + 30
        while not (agents := list_agents()) and time.monotonic() < deadline:
            time.sleep(0.05)
        address = agents[0].address
        threads = [
            threading.Thread(target=_storm, args=(agents[0].socket_path, stop)) for _ in range(8)
        ]
        for thread in threads:
            thread.start()
        time.sleep(0.5)
        for _ in range(5):
            conn = AgentConnection(address)
            try:
                assert isinstance(next(conn.messages()), Hello)
            finally:
                conn.close()
        assert job.poll() is None
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        job.kill()
        job.wait(timeout=30)
