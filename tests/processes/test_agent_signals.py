"""The agent's threads leave the job's signals to the job's own threads.

A signal sent to the process goes to any thread that does not block it; one taken by an agent
thread reaches Python's handler only when the main thread next runs Python code, so a job asleep
in ``time.sleep`` would not see its Ctrl-C. Each agent thread blocks those signals: checked from
the kernel's own view of each thread (``SigBlk`` in ``/proc/self/task/TID/status``).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

JOB = """\
import json, sys, threading, time
import torchtop

torchtop.start(capture_output=True)
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    names = {t.name for t in threading.enumerate()}
    if {"torchtop-sampler", "torchtop-server", "torchtop-output"} <= names:
        break
    time.sleep(0.05)

def blocked(tid):
    with open(f"/proc/self/task/{tid}/status") as status:
        for line in status:
            if line.startswith("SigBlk:"):
                return int(line.split()[1], 16)
    return 0

masks = {t.name: blocked(t.native_id) for t in threading.enumerate()}
torchtop.stop()
sys.__stderr__.write(json.dumps(masks) + "\\n")
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux's /proc")
def test_the_agents_threads_block_the_signals_the_job_handles(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    masks: dict[str, int] = json.loads(out.stderr.strip().splitlines()[-1])
    agent = {name: mask for name, mask in masks.items() if name.startswith("torchtop-")}
    assert {"torchtop-sampler", "torchtop-server", "torchtop-output"} <= set(agent), masks
    for name, mask in agent.items():
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGALRM):
            assert mask & (1 << (signum - 1)), f"{name} takes {signal.Signals(signum).name}"
    # The job's own main thread still takes them.
    assert not masks["MainThread"] & (1 << (signal.SIGINT - 1))
