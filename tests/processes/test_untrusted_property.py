"""Hostile text in every field of every message kind, never obeyed and never a crash.

A seeded generator puts control characters (window title, clipboard write, clear screen, C1
controls, bidi overrides, lone surrogates), Rich markup and frames of invalid UTF-8 into
recordings of one job or of a run of ranks. For each: ``torchtop report`` (text on a terminal,
and ``--json``), ``torchtop ps`` (text and ``--json``) and the Prometheus exposition print
without a traceback and without any of the recording's escape sequences; and the real viewer,
replaying such a recording in a pseudo-terminal, writes none of them to it.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import pty
import random
import re
import select
import socket
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.untrusted import hostile, job_stream, with_text
from torchtop import commands as cli
from torchtop.protocol import Hello, JobExited, LogLine, Message, encode
from torchtop.streams.recording import tag_frame

EXAMPLES = 25
#: What no output may hold, whatever the recording: its escape sequences, a hyperlink made
#: from its markup, a bell, and the C1 controls (``\x9b`` is ``ESC [`` to some terminals).
FORBIDDEN = re.compile(rb"\x1b\]0;|\x1b\]52;|\x1b\[2J|\x1b\]8;|\x07|\xc2[\x80-\x9f]")
#: What the viewer may not write to its terminal: the recording's sequences (the title is
#: PWNED), a hyperlink, and C1 controls. Textual's own escapes (colours, cursor, its own
#: OSC 22 pointer shape ending in a bell) are the viewer's, and allowed.
FORBIDDEN_IN_VIEWER = re.compile(
    rb"\x1b\]0;PWNED|PWNED\x07|\x1b\]52;|\x1b\[2J|\x1b\]8;|\xc2[\x80-\x9f]"
)


def assert_clean(output: str, *, terminal: bool) -> None:
    """``output`` writes to a terminal as UTF-8 (no lone surrogate) and holds nothing of the
    recording's escapes; off a terminal, no ESC at all."""
    data = output.encode("utf-8")  # strict: a lone surrogate would fail here, as on stdout
    found = FORBIDDEN.search(data)
    assert found is None, data[max(0, found.start() - 60) : found.end() + 20]
    if not terminal:
        assert b"\x1b" not in data


def recording(rng: random.Random, path: Path) -> Path:
    """A recording of one job, or of a run of two ranks and its launcher, with hostile text
    in every string (each original string replaced the same way throughout), some messages
    left out, and some damaged frames (invalid UTF-8 inside a string) between."""
    stream = with_text(job_stream(), lambda _original: hostile(rng))
    stream = [m for m in stream if isinstance(m, Hello) or rng.random() < 0.85]
    frames: list[bytes] = []
    if rng.random() < 0.5:
        frames = [encode(m) for m in stream]
    else:
        for rank, src in enumerate(("100", "101")):
            for message in stream:
                if isinstance(message, Hello):
                    message = _as_rank(message, rank)
                frames.append(tag_frame(encode(message)[:-1], src) + b"\n")
        launcher: list[Message] = [
            LogLine(1_700_000_050.0, "stderr", hostile(rng)),
            JobExited(1_700_000_051.0, 1, hostile(rng)),
        ]
        frames += [encode(m) for m in launcher]
    for _ in range(3):
        at = rng.randrange(len(frames))
        frame = frames[at]
        cut = frame.find(b'":"') + 3
        frames.insert(at, frame[:cut] + b"\xff\xfe\x1b]0;PWNED\x07" + frame[cut:])
    path.write_bytes(b"".join(frames))
    return path


def _as_rank(hello: Hello, rank: int) -> Hello:
    import dataclasses

    return dataclasses.replace(hello, pid=100 + rank, rank=rank, local_rank=rank, world_size=2)


def run_cli(*args: str) -> str:
    """``torchtop ARGS`` in this process: its stdout (it must exit 0)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(list(args))
    assert code == 0
    return out.getvalue()


@pytest.fixture
def fake_agent(runtime_dir: Path) -> Iterator[Path]:
    """A listening socket of this process's pid: ``ps`` lists whatever ``PID.json`` says."""
    runtime_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = runtime_dir / f"{os.getpid()}.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
        os.chmod(path, 0o600)
        server.listen()
        yield runtime_dir / f"{os.getpid()}.json"


def write_agent(meta_path: Path, rng: random.Random) -> None:
    meta = {
        "pid": os.getpid(),
        "argv": [hostile(rng) for _ in range(rng.randrange(1, 4))],
        "started_at": time.time(),
        "address": f"unix:{meta_path.with_suffix('.sock')}",
        "cwd": hostile(rng),
        "identity": {"rank": 0, "world_size": 2, "run_id": hostile(rng), "restart_count": 1},
    }
    meta_path.write_text(json.dumps(meta))


def test_reports_ps_and_exposition_never_emit_a_recordings_escapes(
    tmp_path: Path, fake_agent: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prometheus_client.exposition import generate_latest

    from torchtop.export.figures import figures_of
    from torchtop.export.prometheus import registry_for
    from torchtop.report.run import rank_models
    from torchtop.streams.recording import read_recording

    # Rich writes colours, as to a user's terminal (its own escapes are allowed; none of the
    # recording's are).
    monkeypatch.setenv("FORCE_COLOR", "1")
    rng = random.Random(25)
    for example in range(EXAMPLES):
        monkeypatch.setenv("COLUMNS", str(rng.choice((40, 80, 200))))
        path = recording(rng, tmp_path / f"r{example}.ttr")
        assert_clean(run_cli("report", str(path)), terminal=True)
        assert_clean(run_cli("report", str(path), "--json"), terminal=False)
        write_agent(fake_agent, rng)
        assert_clean(run_cli("ps"), terminal=False)
        assert_clean(run_cli("ps", "--json"), terminal=False)
        contents = read_recording(path)
        launcher, ranks, _run = rank_models(contents.messages, contents.sources)
        snapshots = [s for job in [launcher, *ranks] if (s := figures_of(job)) is not None]
        exposition = generate_latest(registry_for(lambda s=snapshots: s)).decode()
        assert_clean(exposition, terminal=False)


# -- the viewer in a pseudo-terminal -------------------------------------------------------------


def _read_for(fd: int, seconds: float) -> bytes:
    data = b""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([fd], [], [], left)[0]:
            break
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the viewer has exited and closed its end
            break
        if not chunk:
            break
        data += chunk
    return data


def replay_in_a_pty(path: Path, keys: list[bytes]) -> bytes:
    """Every byte ``torchtop replay PATH`` writes to its terminal, pressing ``keys`` in turn
    once it has drawn, then ``q``."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 140, 0, 0))
    env = {**os.environ, "TERM": "xterm-256color", "PYTHONWARNINGS": "ignore"}
    process = subprocess.Popen(
        [sys.executable, "-m", "torchtop", "replay", str(path), "--speed", "1000"],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        start_new_session=True,
    )
    os.close(slave)
    written = b""
    try:
        deadline = time.monotonic() + 60
        while b"Log" not in written and time.monotonic() < deadline:  # drawn
            written += _read_for(master, 0.5)
        for key in [*keys, b"q"]:
            os.write(master, key)
            written += _read_for(master, 1.5)
        process.wait(timeout=30)
        written += _read_for(master, 0.5)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(master)
    assert process.returncode == 0, written[-2000:]
    return written


def test_the_replayed_viewer_writes_none_of_a_recordings_escapes(tmp_path: Path) -> None:
    rng = random.Random(2025)
    path = recording(rng, tmp_path / "hostile.ttr")
    # The end of the recording, its OOM screen (and back), then the log alone.
    written = replay_in_a_pty(path, [b"e", b"o", b"\x1b", b"l"])
    assert b"Traceback" not in written
    found = FORBIDDEN_IN_VIEWER.search(written)
    assert found is None, written[max(0, found.start() - 80) : found.end() + 20]
    assert b"\\x1b" in written  # the recording's escapes, shown
