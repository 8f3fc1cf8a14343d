from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent

# A shell without job control (CI started in the background, nohup …&) starts commands with
# SIGINT ignored, and an ignored signal stays ignored across exec: the jobs the tests start would
# then shrug off the Ctrl-C (SIGINT) that the tests send them as a user at a terminal would. A
# handler here is reset to the default in every child at exec, as a terminal would give it.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
SCRIPTS = Path(__file__).resolve().parent / "scripts"


@pytest.fixture(autouse=True)
def runtime_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Each test gets its own socket directory (short: Unix socket paths are limited to 108)."""
    path = Path(tempfile.mkdtemp(prefix="tt-", dir="/tmp")) / "run"
    monkeypatch.setenv("TORCHTOP_RUNTIME_DIR", str(path))
    # And its own tmux server: tests run two at once, and one ending the shared server's last
    # session while another starts one failed it with "server exited unexpectedly".
    monkeypatch.setenv("TMUX_TMPDIR", str(path.parent))
    yield path
    shutil.rmtree(path.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def fleet_recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process's recording of a short real job, for the fleet simulator to replay
    (``benchmarks/fleet.py``); made once for all the test files (of one worker) that replay
    it, none of which changes it."""
    path = tmp_path_factory.mktemp("fleet") / "one.ttr"
    out = torchtop(
        "run", "--headless", "--record", str(path), "--no-ops", str(SCRIPTS / "train_mlp.py"),
        "--steps", "20",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return path


@pytest.fixture(autouse=True)
def config_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The viewer's settings (its theme) go to a folder of the test's, never the user's."""
    path = tmp_path / "config"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(path))
    return path


def torchtop(
    *args: str, timeout: float = 120, **kwargs: object
) -> subprocess.CompletedProcess[str]:
    """Run the real command line in a subprocess, as a user would."""
    return run_tree(
        [sys.executable, "-m", "torchtop", *args],
        timeout=timeout,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        **kwargs,
    )


def run_tree(command: list[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(command, capture_output=True, text=True, timeout=timeout)``, except
    that past ``timeout`` it kills what the command started as well: ``torchtop run`` and
    ``torchtop demo`` start the job as a child, which the command's death alone would leave
    running (taking the CPU of the tests after it, and holding the pipes open)."""
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(process)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.communicate(timeout=10)
            raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def tmux(*args: str, check: bool = True, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """One tmux command, its output captured; bounded, so that a wedged tmux server fails the
    test rather than holding the suite."""
    return subprocess.run(
        ["tmux", *args], capture_output=True, text=True, timeout=30, check=check, **kwargs
    )


class Forked:
    """A forked copy of this process running ``body(self)``, which the parent talks to a byte
    string at a time (:meth:`send`, :meth:`receive`, on either side).

    The child always ends in ``os._exit``, whatever ``body`` raises: it never goes on as a
    second copy of the test run. The parent never waits on it without a bound: :meth:`receive`
    raises after ``timeout`` seconds, and leaving the ``with`` block kills a child still
    running (one that deadlocked on a lock another thread held at the fork) and reaps it."""

    def __init__(self, body: Callable[[Forked], None]) -> None:
        down_r, down_w = os.pipe()  # parent -> child
        up_r, up_w = os.pipe()  # child -> parent
        self.pid = os.fork()
        # Each side keeps its own ends only: a side that ends is then seen to (end of file).
        if self.pid == 0:
            self._read, self._write = down_r, up_w
            os.close(up_r)
            os.close(down_w)
        else:
            self._read, self._write = up_r, down_w
            os.close(down_r)
            os.close(up_w)
        if self.pid == 0:
            code = 1
            try:
                body(self)
                code = 0
            except BaseException:
                traceback.print_exc()  # the parent sees the end of file; pytest, this
            finally:
                os._exit(code)

    def send(self, data: bytes) -> None:
        os.write(self._write, data)

    def receive(self, timeout: float = 60) -> bytes:
        """What the other side sent next; ``b""`` if the child ended without sending."""
        if not select.select([self._read], [], [], timeout)[0]:
            raise TimeoutError(f"the forked child (pid {self.pid}) said nothing in {timeout} s")
        return os.read(self._read, 64)

    def __enter__(self) -> Forked:
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            if os.waitpid(self.pid, os.WNOHANG) == (0, 0):
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
        os.close(self._read)
        os.close(self._write)


def kill_tree(process: subprocess.Popen[Any]) -> None:
    """Kill ``process`` and everything it started, and reap it. A ``torchtop run`` killed
    alone leaves its job running (it cannot forward a SIGKILL): a test's job left behind takes
    the CPU of the tests after it."""
    import psutil

    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(process.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
    process.kill()
    process.wait()


def report_json(path: Path) -> dict[str, object]:
    """``torchtop report PATH --json``, run as a user would, parsed."""
    import json

    out = torchtop("report", str(path), "--json")
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout)
    return result


def cuda_available() -> bool:
    """A CUDA GPU is here (tests marked ``cuda`` skip without one)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())
