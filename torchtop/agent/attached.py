"""The agent's entry point when ``torchtop attach`` starts it in a job that runs without it.

``torchtop attach`` has the job's own interpreter start a thread at a safe point (in the main
thread, holding the GIL, between two bytecodes: a pending call scheduled through gdb, or
``sys.remote_exec`` on Python 3.14+), and that thread calls :func:`start_attached`. It starts
the agent once (a second attach finds it running) and writes a small status file that the
attacher waits for. It never prints to the job's output and never raises into the job.

An agent started this late sees the job from this moment on: optimizer steps from the next
one, DataLoader batches from the next ``next()`` (a new iterator is also named and its workers
read), memory and host samples, op windows, and on CUDA the allocator history from now on. What
came before is gone; the ``attach`` probe status says so in the viewer and the report.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

#: The probe name of the status that says what an attached agent cannot see.
PROBE = "attach"


def start_attached(status_path: str, options: dict[str, Any], runtime_dir: str) -> None:
    """Start the agent (or find it running) and write ``status_path``. Never raises."""
    try:
        if os.environ.get("TORCHTOP_RUNTIME_DIR") != runtime_dir:
            # The attacher looks for the socket in its own directory.
            os.environ["TORCHTOP_RUNTIME_DIR"] = runtime_dir
        from torchtop.agent import core, rank_start

        agent = core.current()
        reused = agent is not None and not agent.finished
        if agent is None or agent.finished:
            agent = rank_start.start(**options)
            agent.publish(attach_status(time.time(), _process_started_at()))
        write_status(status_path, {"ok": True, "reused": reused, "address": agent.info.address})
    except BaseException as exc:  # nothing of ours may reach the job
        write_status(status_path, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})


def attach_status(now: float, process_started_at: float | None) -> Any:
    """The ``attach`` probe status: when the agent came, and what it cannot have seen."""
    from torchtop.protocol import ProbeStatus

    when = time.strftime("%H:%M:%S", time.localtime(now))
    age = ""
    if process_started_at is not None and now > process_started_at:
        age = f", {_duration(now - process_started_at)} into the job"
    detail = (
        f"attached at {when}{age}: steps, batches and allocations before then are not seen, "
        "nor is the job's output"
    )
    return ProbeStatus(t=now, probe=PROBE, available=False, detail=detail)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _process_started_at() -> float | None:
    """When this process started (Linux ``/proc``), or ``None``."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22, starttime, in clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def write_status(path: str, status: dict[str, Any]) -> None:
    """Write the status file (0600) in one piece: the attacher reads it once it exists."""
    from torchtop.private_files import open_private

    try:
        tmp = f"{path}.tmp"
        with open_private(tmp) as f:
            f.write(json.dumps(status).encode())
        os.replace(tmp, path)
    except OSError:
        pass  # the attacher times out and says so
