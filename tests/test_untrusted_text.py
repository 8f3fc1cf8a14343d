"""Text from a job, a recording or another process reaches the terminal shown, never obeyed.

A recording whose every string carries escape sequences (window title, clipboard write, clear
screen) and Rich markup: ``torchtop report`` (text and ``--json``) and ``torchtop ps`` print
them visibly escaped (``\\x1b``), the markup as it is, and never the escape itself.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import torchtop
from tests.fakes.untrusted import (
    ATTACK_BYTES,
    CLEAR,
    CLIPBOARD,
    MARKUP,
    TITLE,
    job_stream,
    with_text,
    write_recording,
)

SHOWN = ("\\x1b]0;PWNED\\x07", "\\x1b]52;c;cm0gLXJmIH4K\\x07", "\\x1b[2J")
#: What the report would print if it obeyed the markup: a hyperlink (OSC 8).
HYPERLINK = b"\x1b]8;"
#: Rich's colours where the output is a terminal, as the report's is for a user.
TERMINAL = {"FORCE_COLOR": "1", "COLUMNS": "400", "TTY_COMPATIBLE": "1"}


def _hostile(original: str) -> str:
    return f"{original}{TITLE}{''.join(MARKUP)}{CLIPBOARD}{CLEAR}"


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [s for item in value for s in _strings(item)]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in [*_strings(k), *_strings(v)]]
    return []


@pytest.fixture
def recording(tmp_path: Path) -> Path:
    return write_recording(tmp_path / "hostile.ttr", with_text(job_stream(), _hostile))


def test_report_text_shows_escapes_and_markup_as_text(recording: Path) -> None:
    out = torchtop_env("report", str(recording), env=TERMINAL)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    raw = out.stdout.encode()
    for attack in ATTACK_BYTES:
        assert attack not in raw
    assert HYPERLINK not in raw
    for shown in SHOWN:
        assert shown in out.stdout
    # Markup printed as it is, in the tables (phases, loaders, ops, devices) and the lines.
    assert out.stdout.count("[warmup] epoch 1") >= 5
    assert out.stdout.count("[/bogus]") >= 5
    assert "[link=https://example.com/x]click[/link]" in out.stdout


def test_report_json_holds_the_escaped_text(recording: Path) -> None:
    out = torchtop("report", str(recording), "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    strings = _strings(report)
    assert not [s for s in strings if "\x1b" in s or "\x07" in s]
    assert any(SHOWN[0] in s for s in strings)
    assert report["job"]["argv"][0] == _shown("train.py")
    assert report["phases"][0]["name"] == _shown("warmup")


def _shown(original: str) -> str:
    return f"{original}{SHOWN[0]}{''.join(MARKUP)}{SHOWN[1]}{SHOWN[2]}"


def torchtop_env(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The command line as :func:`torchtop` runs it, with ``env`` added to the environment."""
    return subprocess.run(
        [sys.executable, "-m", "torchtop", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore", **env},
    )


def _fake_agent(runtime_dir: Path, argv: list[str], identity: dict[str, Any]) -> socket.socket:
    """A description file and a listening socket, as an agent in this process would leave."""
    runtime_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    pid = os.getpid()
    path = runtime_dir / f"{pid}.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    os.chmod(path, 0o600)
    server.listen()
    meta = {
        "pid": pid,
        "argv": argv,
        "started_at": time.time(),
        "address": f"unix:{path}",
        "cwd": f"/w{CLEAR}",
        "identity": identity,
    }
    fd = os.open(runtime_dir / f"{pid}.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(meta, f)
    return server


def test_ps_shows_another_jobs_command_escaped(runtime_dir: Path) -> None:
    argv = ["train.py", f"--name={TITLE}", f"{CLIPBOARD}x\ny", *MARKUP]
    identity = {"rank": 0, "world_size": 2, "run_id": f"run{CLEAR}", "restart_count": 0}
    with _fake_agent(runtime_dir, argv, identity):
        out = torchtop("ps")
        as_json = torchtop("ps", "--json")
    assert out.returncode == 0, out.stderr
    raw = out.stdout.encode()
    for attack in ATTACK_BYTES:
        assert attack not in raw
    assert f"--name={SHOWN[0]}" in out.stdout
    assert f"{SHOWN[1]}x\\ny" in out.stdout  # one row per agent: a newline is shown, not made
    assert f"run{SHOWN[2]}" in out.stdout
    assert " ".join(MARKUP) in out.stdout
    rows = [line for line in out.stdout.splitlines() if "train.py" in line]
    assert len(rows) == 1
    # JSON escapes control characters itself (\u001b): the argv stays exact for a program.
    assert as_json.returncode == 0, as_json.stderr
    assert b"\x1b" not in as_json.stdout.encode()
    assert json.loads(as_json.stdout)[0]["argv"] == argv
