"""The runtime directory stays bounded: ended jobs' files go oldest first past a size cap; a
running job's files and the files a user asked for are never deleted."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import torchtop
from torchtop.transport import ENDED_JOBS_CAP_BYTES

MIB = 1 << 20


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _file(folder: Path, name: str, size: int, age_s: float) -> Path:
    path = folder / name
    with open(path, "wb") as f:
        f.truncate(size)  # sparse: the size counts, the disk is spared
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_a_run_prunes_ended_jobs_files_oldest_first(tmp_path: Path, runtime_dir: Path) -> None:
    runtime_dir.mkdir(mode=0o700)
    old, newer, live = _dead_pid(), _dead_pid(), os.getpid()
    assert ENDED_JOBS_CAP_BYTES == 64 * MIB
    oldest = _file(runtime_dir, f"{old}-ops-last.json", 30 * MIB, 300)
    kept = [
        _file(runtime_dir, f"{old}-oom-1.pickle", 20 * MIB, 200),
        _file(runtime_dir, f"{newer}-ops-3.json", 30 * MIB, 100),
        _file(runtime_dir, f"{newer}-job.log", 1 * MIB, 100),
        # The test's own process stands for a running job: never touched, however big.
        _file(runtime_dir, f"{live}-ops-last.json", 100 * MIB, 1000),
        # Files torchtop did not name here: a recording and what went beside it.
        _file(runtime_dir, f"{newer}.ttr", 50 * MIB, 1000),
        _file(runtime_dir, f"{newer}.oom-1.pickle", 50 * MIB, 1000),
        _file(runtime_dir, f"{newer}.ops-last.json", 50 * MIB, 1000),
        _file(runtime_dir, "notes.txt", 50 * MIB, 1000),
    ]
    (tmp_path / "job.py").write_text("print('ran')\n")
    out = torchtop("run", "--headless", "--no-ops", "job.py", cwd=tmp_path)
    assert out.returncode == 0 and out.stdout == "ran\n", out.stderr
    assert not oldest.exists()  # 80 MiB of ended jobs' files: the oldest 30 MiB went
    assert [p.name for p in kept if not p.exists()] == []


def test_only_an_agents_own_file_is_read_as_an_agent(runtime_dir: Path) -> None:
    """Op-window traces kept in the runtime directory (``PID-ops-last.json``, megabytes) are
    not agents: they are neither listed nor parsed on every look (`ps`, each rank scan)."""
    import json

    from torchtop.transport import bind_server, list_agents

    server, _ = bind_server(os.getpid(), ["train.py"], time.time(), {})
    try:
        # A trace that parses as an agent's file would (the old listing took it for one).
        meta = json.loads((runtime_dir / f"{os.getpid()}.json").read_text())
        trace = runtime_dir / f"{os.getpid()}-ops-last.json"
        trace.write_text(json.dumps({**meta, "traceEvents": []}))
        assert [a.pid for a in list_agents(clean_stale=False)] == [os.getpid()]
    finally:
        server.close()
