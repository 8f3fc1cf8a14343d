"""The runtime directory stays bounded: ended jobs' files go oldest first past a size cap; a
running job's files and the files a user asked for are never deleted."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

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
        _file(runtime_dir, f"{newer}-snapshot-2.pickle", 1 * MIB, 100),
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


def test_requested_snapshots_of_ended_jobs_are_pruned_like_oom_snapshots(
    tmp_path: Path, runtime_dir: Path
) -> None:
    """A snapshot asked for from the viewer (``PID-snapshot-N.pickle``, up to 64 MiB each) is an
    ended job's file like its OOM snapshots: the oldest go first past the cap."""
    runtime_dir.mkdir(mode=0o700)
    ended = _dead_pid()
    snapshots = [
        _file(runtime_dir, f"{ended}-snapshot-{n}.pickle", 30 * MIB, 500 - n) for n in range(1, 4)
    ]
    (tmp_path / "job.py").write_text("print('ran')\n")
    out = torchtop("run", "--headless", "--no-ops", "job.py", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert [p.exists() for p in snapshots] == [False, True, True]  # 90 MiB: the oldest went


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


# -- another user's files are never trusted ---------------------------------------------------

AS_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
needs_root = pytest.mark.skipif(
    os.getuid() != 0 or shutil.which("setpriv") is None,
    reason="playing another user needs root and setpriv",
)

#: Another user's process that poses as an agent: its socket and description file in ``folder``
#: (which it creates when missing), a hello to whoever connects.
FAKE_AGENT = """\
import json, os, socket, sys
folder = sys.argv[1]
os.makedirs(folder, mode=0o700, exist_ok=True)
path = os.path.join(folder, f"{os.getpid()}.sock")
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(path)
os.chmod(path, 0o666)
server.listen(8)
meta = {"pid": os.getpid(), "argv": ["fake.py"], "started_at": 1.0, "address": "unix:" + path}
with open(os.path.join(folder, f"{os.getpid()}.json"), "w") as f:
    json.dump(meta, f)
print("ready", flush=True)
while True:
    conn, _ = server.accept()
    conn.sendall(b'{"kind": "hello"}\\n')
"""


@pytest.fixture
def fake_agent() -> Iterator[Callable[[Path], subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []

    def start(folder: Path) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [*AS_NOBODY, sys.executable, "-I", "-c", FAKE_AGENT, str(folder)],
            stdout=subprocess.PIPE,
            text=True,
            cwd="/tmp",
        )
        started.append(proc)
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


@needs_root
def test_a_runtime_dir_another_user_made_is_refused_by_readers(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fake_agent: Callable[[Path], subprocess.Popen[str]],
) -> None:
    """Another user made the runtime directory first (``/tmp/torchtop-<uid>`` without
    ``XDG_RUNTIME_DIR``) and put an agent in it: `ps` and `attach` refuse the directory, in one
    line naming the fix, and never list or reach the agent."""
    parent = Path(tempfile.mkdtemp(prefix="tt-", dir="/tmp"))
    parent.chmod(0o1777)  # as /tmp is
    folder = parent / "run"
    try:
        agent = fake_agent(folder)  # nobody's folder, mode 0700
        monkeypatch.setenv("TORCHTOP_RUNTIME_DIR", str(folder))
        for args in (["ps"], ["ps", "--json"], ["attach", "--headless", "--record", "r.ttr"]):
            out = torchtop(*args, cwd=tmp_path)
            assert out.returncode == 1, (args, out.stdout, out.stderr)
            assert out.stderr == (
                f"torchtop: {folder} is not a directory owned by you; remove it or set "
                "TORCHTOP_RUNTIME_DIR to a new path (torchtop creates it, mode 0700)\n"
            )
            assert str(agent.pid) not in out.stdout
        assert not (tmp_path / "r.ttr").exists()
    finally:
        shutil.rmtree(parent)


def test_a_runtime_dir_through_a_symlink_is_refused_by_readers(
    tmp_path: Path, runtime_dir: Path
) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    runtime_dir.symlink_to(real)
    out = torchtop("ps")
    assert out.returncode == 1 and "is not a directory owned by you" in out.stderr


@needs_root
def test_a_socket_that_is_not_ours_is_not_an_agent(runtime_dir: Path) -> None:
    from torchtop.transport import bind_server, list_agents

    server, info = bind_server(os.getpid(), ["train.py"], time.time(), {})
    try:
        assert [a.pid for a in list_agents(clean_stale=False)] == [os.getpid()]
        os.chown(info.socket_path, 65534, 65534)
        assert list_agents(clean_stale=False) == []
    finally:
        server.close()


@needs_root
def test_the_viewer_refuses_an_agent_of_another_user(
    fake_agent: Callable[[Path], subprocess.Popen[str]],
) -> None:
    """A socket served by another uid (found however: a stale description, a path given) is
    left at once: the viewer checks the agent's uid as the agent checks the viewer's."""
    from torchtop.transport import AgentConnection, TransportError

    parent = Path(tempfile.mkdtemp(prefix="tt-", dir="/tmp"))
    parent.chmod(0o1777)  # as /tmp is
    try:
        agent = fake_agent(parent / "run")
        path = parent / "run" / f"{agent.pid}.sock"
        with pytest.raises(TransportError) as refused:
            AgentConnection(f"unix:{path}")
        assert str(refused.value) == (
            f"the agent at {path} runs as nobody, not as you (root): torchtop reads only your "
            "own jobs; run torchtop as nobody to watch it"
        )
    finally:
        shutil.rmtree(parent)
