"""Every file torchtop writes is 0600 whatever the umask, and a runtime directory that is not the
user's own private folder is refused, never changed."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SCRIPTS, torchtop
from torchtop.runner import Job, RunSpec

#: Lists the agent's files (socket, description) while the agent runs, with their modes.
LIST_RUNTIME_DIR = """\
import os, sys, time
sys.argv = [sys.argv[0], "--seconds", "2"]
exec(open({script!r}).read())
folder = os.environ["TORCHTOP_RUNTIME_DIR"]
for name in sorted(os.listdir(folder)):
    print("runtime", name, oct(os.lstat(os.path.join(folder, name)).st_mode & 0o777))
"""


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_every_file_of_a_run_is_private(tmp_path: Path, runtime_dir: Path) -> None:
    job = tmp_path / "job.py"
    job.write_text(LIST_RUNTIME_DIR.format(script=str(SCRIPTS / "train_ops.py")))
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    rec = out_dir / "r.ttr"
    out = subprocess.run(
        [sys.executable, "-m", "torchtop", "run", "--headless", "--record", str(rec), str(job)],
        capture_output=True,
        text=True,
        timeout=120,
        umask=0o022,
    )
    assert out.returncode == 0, out.stderr
    written = sorted(p.name for p in out_dir.iterdir())
    assert "r.ttr" in written and "r.ops-last.json" in written  # the recording and a trace
    assert {name: oct(_mode(out_dir / name)) for name in written} == {
        name: "0o600" for name in written
    }
    listed = [line.split() for line in out.stdout.splitlines() if line.startswith("runtime ")]
    assert {name.rsplit(".", 1)[-1] for _, name, _ in listed} >= {"sock", "json"}
    assert listed and all(mode == "0o600" for _, _, mode in listed), listed


def test_the_live_runs_log_file_is_private(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text("print('hello')\n")
    old = os.umask(0o022)
    try:
        job = Job(RunSpec(target=[str(tmp_path / "job.py")], agent_options={"ops": False}))
        job.start()
    finally:
        os.umask(old)
    assert job.wait(60) == 0
    assert job.log_path is not None and _mode(job.log_path) == 0o600


def test_a_runtime_dir_open_to_others_is_refused_not_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    (tmp_path / "job.py").write_text("print('job ran')\n")
    monkeypatch.setenv("TORCHTOP_RUNTIME_DIR", str(shared))
    for args in (["run", "--headless", "job.py"], ["run", "job.py"]):
        out = torchtop(*args, cwd=tmp_path)
        assert out.returncode == 1, out.stderr
        (line,) = out.stderr.splitlines()
        assert f"{shared} is open to other users (mode 755)" in line
        assert "chmod 700" in line and "TORCHTOP_RUNTIME_DIR" in line
        assert "job ran" not in out.stdout
        assert _mode(shared) == 0o755 and list(shared.iterdir()) == []
