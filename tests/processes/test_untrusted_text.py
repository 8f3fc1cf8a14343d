"""Text from a job, a recording or another process reaches the terminal shown, never obeyed.

A recording whose every string carries escape sequences (window title, clipboard write, clear
screen) and Rich markup: ``torchtop report`` (text and ``--json``) and ``torchtop ps`` print
them visibly escaped (``\\x1b``), the markup as it is, and never the escape itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import tmux, torchtop
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
from tests.viewer.test_tui_tmux import (
    Terminal,
    terminal,  # noqa: F401 (a fixture: tests name it)
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


# -- the viewer ----------------------------------------------------------------------------------


def _viewer_keys() -> list[list[str]]:
    # The main screen, then each screen that shows the job's text: the OOM screen, advice,
    # help, the log alone, the ops panel alone, what holds memory.
    return [[], ["o"], ["a"], ["question_mark"], ["l"], ["t"], ["h"]]


@pytest.mark.parametrize("keys", _viewer_keys(), ids=lambda keys: "+".join(keys) or "main")
def test_viewer_shows_markup_and_escapes_as_text(keys: list[str]) -> None:
    """Every panel, title, table cell and notification holding a job's text draws it as it is:
    a closing tag that opens nothing crashed the memory panel's title, the OOM screen's
    sites and the run view's rows, which Textual reads as markup."""
    from fakes.source import FakeSource

    from torchtop.tui.app import TorchtopApp

    messages = with_text(job_stream(), _hostile)

    async def scenario() -> str:
        app = TorchtopApp(FakeSource(messages, mode="replay"), title=_hostile("train.py"))
        async with app.run_test(size=(160, 50)) as pilot:
            app.job.drain()
            await pilot.pause()
            for key in keys:
                await pilot.press(key)
                await pilot.pause()
            return app.export_screenshot()

    screen = asyncio.run(scenario())
    assert "\x1b" not in screen and "\x07" not in screen
    assert "[/bogus]" in screen
    assert SHOWN[0] in screen


def test_a_snapshots_notification_quotes_its_path_as_text() -> None:
    from fakes.source import FakeSource

    from torchtop.protocol import OutOfMemory
    from torchtop.tui.app import TorchtopApp

    messages = [m for m in with_text(job_stream(), _hostile) if not isinstance(m, OutOfMemory)]

    async def scenario() -> list[str]:
        app = TorchtopApp(FakeSource(messages, mode="replay"))
        async with app.run_test(size=(160, 50), notifications=True) as pilot:
            app.job.drain()
            await pilot.pause()
            return [str(n.message) for n in app._notifications]

    shown = asyncio.run(scenario())
    assert any(_shown("/tmp/42-oom-1.pickle") in message for message in shown)


def test_run_view_rows_show_markup_as_text() -> None:
    """A rank's row names its node, as given on the command line or by its hello."""
    from textual.widgets import DataTable

    from tests.viewer.test_nodes_view import TwoNodes, hello
    from torchtop.streams.sources import attach_rank
    from torchtop.tui.app import TorchtopApp

    run = TwoNodes()
    node = _hostile("b")
    run.feed("100", hello(0, 100, "a"))
    run.feed("b/100", hello(1, 100, "b"), node=node)

    async def drive() -> list[list[str]]:
        app = TorchtopApp.for_run(run, _hostile("run"), open_rank=attach_rank)
        async with app.run_test(size=(300, 30)) as pilot:
            await pilot.pause(0.6)
            table: DataTable[Any] = app.run_screen.query_one("#ranks", DataTable)
            return [list(map(str, table.get_row_at(i))) for i in range(table.row_count)]

    cells = [cell for row in asyncio.run(drive()) for cell in row]
    assert _shown("b") in cells
    assert not [cell for cell in cells if "\x1b" in cell]


def test_the_picker_lists_another_jobs_command_as_text(runtime_dir: Path) -> None:
    from textual.widgets import OptionList

    from torchtop.tui.app import TorchtopApp

    argv = ["train.py", *MARKUP, TITLE]

    async def shown() -> str:
        app = TorchtopApp.picker()
        async with app.run_test(size=(200, 10)) as pilot:
            await pilot.pause()
            return str(app.screen.query_one(OptionList).get_option_at_index(0).prompt)

    with _fake_agent(runtime_dir, argv, {}):
        prompt = asyncio.run(shown())
    assert f"train.py {' '.join(MARKUP)} {SHOWN[0]}" in prompt


# -- errors that quote a peer --------------------------------------------------------------------


def _fake_ssh(tmp_path: Path, stdout: bytes, stderr: bytes, code: int) -> list[str]:
    """An ``ssh`` that prints ``stdout`` and ``stderr`` as a node's relay (or shell) would."""
    (tmp_path / "out").write_bytes(stdout)
    (tmp_path / "err").write_bytes(stderr)
    script = tmp_path / "ssh"
    script.write_text(
        f"#!/bin/sh\ncat {tmp_path / 'out'}\ncat {tmp_path / 'err'} >&2\nexit {code}\n"
    )
    script.chmod(0o755)
    return [str(script)]


@pytest.mark.parametrize(
    ("stdout", "stderr", "code"),
    [
        (b"", f"{TITLE}Permission denied{CLEAR}\n".encode(), 255),
        (b"", f"sh: torchtop{CLIPBOARD}: not found\n".encode(), 127),
        (b"", f"{TITLE}something else\n".encode(), 1),
    ],
    ids=["ssh", "no-torchtop", "other"],
)
def test_a_nodes_words_in_an_error_show_their_escapes(
    tmp_path: Path, stdout: bytes, stderr: bytes, code: int
) -> None:
    from torchtop.streams.nodes import NodeError, NodeFeed, NodeSpec

    ssh = _fake_ssh(tmp_path, stdout, stderr, code)
    with pytest.raises(NodeError) as caught:
        NodeFeed(NodeSpec("node1"), ssh=ssh).connect(timeout=20)
    text = str(caught.value)
    assert "\x1b" not in text and "\x07" not in text
    assert "\\x1b" in text


def test_a_relays_refusal_and_version_show_their_escapes(tmp_path: Path) -> None:
    from torchtop.protocol import Refused, RelayHello, encode
    from torchtop.streams.nodes import NodeError, NodeFeed, NodeSpec

    refusal = encode(Refused(reason=f"go away {TITLE}{CLEAR}"))
    with pytest.raises(NodeError) as caught:
        NodeFeed(NodeSpec("node1"), ssh=_fake_ssh(tmp_path, refusal, b"", 0)).connect(timeout=20)
    assert str(caught.value).endswith(f"refused this viewer: go away {SHOWN[0]}{SHOWN[2]}")

    other = encode(RelayHello(protocol=99, version=f"9{CLIPBOARD}", host="n", pid=1))
    with pytest.raises(NodeError) as caught:
        NodeFeed(NodeSpec("node1"), ssh=_fake_ssh(tmp_path, other, b"", 0)).connect(timeout=20)
    assert f"runs torchtop 9{SHOWN[1]} (protocol 99)" in str(caught.value)


def test_an_error_line_shows_the_escapes_it_quotes(tmp_path: Path) -> None:
    """A file named by someone else (``torchtop report *.ttr``) is quoted in the error."""
    path = tmp_path / f"x{TITLE}.ttr"
    path.write_bytes(b"")
    out = torchtop("report", str(path))
    assert out.returncode == 1
    assert out.stderr == f"torchtop: {tmp_path}/x{SHOWN[0]}.ttr is empty: " + (
        "nothing was recorded in it; record a job with `torchtop run --record FILE`\n"
    )


# -- the real viewer in tmux ---------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_replay_in_tmux_writes_none_of_the_recordings_escapes(
    recording: Path,
    terminal: Terminal,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Every byte the viewer writes to its terminal is logged (``pipe-pane``): none of the
    recording's sequences; the pane's title is not the one the recording asks for; the
    screen shows the escapes as text and the markup as it is."""
    from tests.processes.test_untrusted_property import FORBIDDEN_IN_VIEWER

    log = tmp_path / "pane.log"
    tmux("pipe-pane", "-o", "-t", terminal.session, f"cat >> {log}")
    terminal.keys(f"{sys.executable} -m torchtop replay {recording}; echo EXIT=$?", "Enter")
    terminal.wait_for(lambda s: "Log" in s and "Memory" in s)
    terminal.keys("e")  # the end of the recording: every message shown
    screen = terminal.wait_for(lambda s: "\\x1b]0;PWNED" in s)
    terminal.keys("l")  # the log alone, full width
    log_screen = terminal.wait_for(lambda s: "epoch 1 loss" in s and "warning" in s)
    assert "[link=https://example.com/x]click[/link]" in log_screen
    title = tmux("display-message", "-p", "-t", terminal.session, "#{pane_title}").stdout
    terminal.keys("q")
    terminal.wait_for(lambda s: "EXIT=0" in s, timeout=15)
    written = log.read_bytes()
    assert b"\\x1b]0;PWNED" in written and "Memory" in screen
    found = FORBIDDEN_IN_VIEWER.search(written)
    assert found is None, written[max(0, found.start() - 80) : found.end() + 20]
    assert "PWNED" not in title


def test_headless_passes_the_jobs_output_on_unchanged_and_its_recording_shows_it_escaped(
    tmp_path: Path,
) -> None:
    """The job's own output is the user's terminal stream: ``run --headless`` copies it as it
    is. What reads it back from the recording (the model: viewer, report) shows the escapes."""
    from torchtop.report.job import fold
    from torchtop.streams.recording import read_recording

    script = tmp_path / "job.py"
    script.write_text(f"import sys\nsys.stdout.write({f'before {TITLE} after'!r} + '\\n')\n")
    record = tmp_path / "job.ttr"
    out = torchtop("run", "--headless", "--record", str(record), str(script))
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"before {TITLE} after\n"
    model = fold(read_recording(record).messages)
    assert [entry.text for entry in model.logs] == [f"before {SHOWN[0]} after"]
