from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
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
    return subprocess.run(
        [sys.executable, "-m", "torchtop", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        **kwargs,  # type: ignore[arg-type]
    )


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
