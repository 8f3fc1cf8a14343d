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
from torchtop.private_files import open_private
from torchtop.streams.runner import Job, RunSpec

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


# -- writes never follow a link, nor land in another user's file --------------------------------

needs_root = pytest.mark.skipif(os.getuid() != 0, reason="another user's file needs root")


def test_a_write_does_not_follow_a_symlink(tmp_path: Path) -> None:
    """A link planted where torchtop writes (a recording, a token, the settings) is refused, and
    the file it points to is left as it was."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    link = tmp_path / "r.ttr"
    link.symlink_to(victim)
    with pytest.raises(OSError, match="a symbolic link"):
        open_private(link)
    assert victim.read_text() == "precious\n" and link.is_symlink()


@needs_root
def test_a_write_does_not_land_in_another_users_file(tmp_path: Path) -> None:
    theirs = tmp_path / "r.ttr"
    theirs.write_text("theirs\n")
    os.chown(theirs, 65534, 65534)
    with pytest.raises(OSError, match="belongs to nobody, not to you"):
        open_private(theirs)
    assert theirs.read_text() == "theirs\n"


def test_a_write_to_a_fifo_is_refused_without_waiting(tmp_path: Path) -> None:
    fifo = tmp_path / "r.ttr"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file"):
        open_private(fifo)


def test_a_recording_over_a_symlink_is_refused_in_one_line(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "r.ttr").symlink_to(victim)
    (tmp_path / "job.py").write_text("print('job ran')\n")
    out = torchtop("run", "--headless", "--record", "r.ttr", "job.py", cwd=tmp_path)
    assert out.returncode == 1
    assert out.stderr == (
        "torchtop: cannot write the recording r.ttr: it is a symbolic link (torchtop writes "
        "only to files of yours, never through a link): remove it, or choose another path\n"
    )
    assert victim.read_text() == "precious\n"


def test_an_existing_file_of_ours_is_rewritten_private(tmp_path: Path) -> None:
    path = tmp_path / "r.ttr"
    path.write_text("old and longer\n")
    path.chmod(0o644)
    with open_private(path) as f:
        f.write(b"new\n")
    assert path.read_text() == "new\n" and _mode(path) == 0o600


def test_the_settings_are_not_written_through_a_symlink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchtop.tui.settings import save_setting, settings_path

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    settings_path().parent.mkdir(parents=True)
    settings_path().symlink_to(victim)
    assert save_setting("theme", "dark") is False
    assert victim.read_text() == "precious\n"


def test_a_token_file_through_a_symlink_is_refused(tmp_path: Path) -> None:
    from torchtop.streams.token import RelayError, read_token, token_for

    token_for(tmp_path / "real.token")
    link = tmp_path / "relay.token"
    link.symlink_to(tmp_path / "real.token")
    with pytest.raises(RelayError, match="a symbolic link"):
        read_token(link)
    with pytest.raises(RelayError, match="a symbolic link"):
        token_for(link)
    dangling = tmp_path / "new.token"
    dangling.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(RelayError, match="a symbolic link"):
        token_for(dangling)
    assert not (tmp_path / "elsewhere").exists()


@needs_root
def test_a_token_file_of_another_user_is_refused(tmp_path: Path) -> None:
    from torchtop.streams.token import RelayError, read_token, token_for

    path = tmp_path / "relay.token"
    token_for(path)
    os.chown(path, 65534, 65534)
    with pytest.raises(RelayError, match="belongs to nobody, not to you"):
        read_token(path)
