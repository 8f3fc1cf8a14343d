"""Bad peers and damaged recordings, against a real agent and the real command line.

Every class of bad frame (random bytes, invalid UTF-8, deep nesting, non-finite numbers, wrong
types, oversized and half-written frames, bad hellos, bad requests) and a seeded stream of
mutated valid frames must close only its own connection, or skip only its own recording line:
afterwards a normal viewer attaches and records at the agent's rate, and ``report`` reads the
recording without a traceback. Bounded: a few seconds of job time.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import SCRIPTS, torchtop
from torchtop.protocol import (
    PROTOCOL_VERSION,
    ClientHello,
    Marked,
    Request,
    encode,
)
from torchtop.streams.recording import read_recording
from torchtop.transport import list_agents

HELLO = encode(ClientHello(protocol=PROTOCOL_VERSION))
NEST = 5000

#: Each is sent on its own connection: as the first frame, or after a valid hello.
BAD_FIRST_FRAMES = {
    "random-bytes": os.urandom(4096) + b"\n",
    "invalid-utf8": b'{"kind":"client_hello","protocol":1,"client":"\xff\xfe"}\n',
    "deep-list": b"[" * NEST + b"\n",
    "deep-object": b'{"a":' * NEST + b"\n",
    "deep-in-a-field": b'{"kind":"client_hello","protocol":1,"client":'
    + b"[" * NEST
    + b"]" * NEST
    + b"}\n",
    "not-an-object": b"[1,2,3]\n",
    "kind-not-a-string": b'{"kind":7}\n',
    "nan": b'{"kind":"client_hello","protocol":NaN}\n',
    "huge-int": b'{"kind":"client_hello","protocol":' + b"9" * 5000 + b"}\n",
    "wrong-types": b'{"kind":"client_hello","protocol":"1","client":[]}\n',
    "oversized": b"x" * (200 * 1024),
    "half-written": b'{"kind":"client_hello","proto',
    "unknown-version": encode(ClientHello(protocol=PROTOCOL_VERSION + 1)),
    "no-hello-first": encode(Marked(t=0.0, name="not a hello")),
    "empty-line": b"\n",
    "nul-bytes": b"\0" * 1000 + b"\n",
}
BAD_AFTER_HELLO = {
    "deep-request": b'{"kind":"request","action":' + b"[" * NEST + b"]" * NEST + b"}\n",
    "request-wrong-types": b'{"kind":"request","action":1,"id":"x"}\n',
    "infinite-number": b'{"kind":"request","action":"snapshot","id":1e999}\n',
    "random-after-hello": os.urandom(2048) + b"\n",
    "request-flood": encode(Request(action="no-such-action")) * 5000,
}


def _mutations(seed: int, count: int) -> Iterator[bytes]:
    """Valid frames cut, bit-flipped, spliced and nested at random (reproducibly)."""
    rng = random.Random(seed)
    seeds = [HELLO, encode(Request(action="snapshot", id=3)), encode(Marked(t=1.0, name="m"))]
    for _ in range(count):
        frame = bytearray(rng.choice(seeds).rstrip(b"\n"))
        for _ in range(rng.randint(1, 4)):
            op = rng.randrange(4)
            pos = rng.randrange(len(frame) + 1)
            if op == 0 and frame:
                frame[pos % len(frame)] ^= 1 << rng.randrange(8)
            elif op == 1:
                del frame[pos:]
            elif op == 2:
                depth = rng.choice((10, 1000, 20000))
                frame[pos:pos] = b"[" * depth
            else:
                frame[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        yield bytes(frame) + b"\n"


def _send(path: str, payload: bytes, hello_first: bool = False) -> None:
    """Connect, send, and wait (briefly) for the agent to close us or not; never raises."""
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(2)
    try:
        sock.connect(path)
        sock.sendall((HELLO if hello_first else b"") + payload)
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(1 << 16):
            pass
    except OSError:
        pass
    finally:
        sock.close()


def _start_job(seconds: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torchtop.agent.bootstrap",
            str(SCRIPTS / "idle_job.py"),
            str(seconds),
        ],
        env={**os.environ, "TORCHTOP_AGENT_OPTIONS": json.dumps({"ops": False, "nvml": False})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _wait_for_agent(job: subprocess.Popen[bytes], timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        agents = [a for a in list_agents() if a.pid == job.pid]
        if agents:
            return agents[0].socket_path
        assert job.poll() is None, job.stderr.read() if job.stderr else ""
        time.sleep(0.05)
    raise AssertionError("no agent appeared")


def test_every_bad_frame_closes_only_its_connection(tmp_path: Path) -> None:
    job = _start_job(120)
    try:
        path = _wait_for_agent(job)
        for payload in BAD_FIRST_FRAMES.values():
            _send(path, payload)
        for payload in BAD_AFTER_HELLO.values():
            _send(path, payload, hello_first=True)
        for i, frame in enumerate(_mutations(seed=10, count=300)):
            _send(path, frame, hello_first=i % 2 == 1)
        # The agent still serves: a normal attach records its samples (an idle job's, that
        # repeat the last one, are left out for up to a second: one a second at least).
        rec = tmp_path / "after.ttr"
        out = torchtop(
            "attach", str(job.pid), "--headless", "--record", str(rec), "--duration", "2"
        )
        assert out.returncode == 0, out.stderr
        report = json.loads(torchtop("report", str(rec), "--json").stdout)
        assert report["samples_per_s"] >= 1
        assert job.poll() is None
        assert [a.pid for a in list_agents()] == [job.pid]
    finally:
        job.kill()
        job.wait(timeout=30)
    assert b"Traceback" not in (job.stderr.read() if job.stderr else b"")


def test_every_bad_line_in_a_recording_is_skipped(tmp_path: Path) -> None:
    good = tmp_path / "good.ttr"
    job = _start_job(1.5)
    try:
        _wait_for_agent(job)
        out = torchtop("attach", str(job.pid), "--headless", "--record", str(good))
        assert out.returncode == 0, out.stderr
    finally:
        job.wait(timeout=30)
    lines = good.read_bytes().splitlines(keepends=True)
    bad_lines = [
        p if p.endswith(b"\n") else p + b"\n"
        for p in [*BAD_FIRST_FRAMES.values(), *BAD_AFTER_HELLO.values()]
    ]
    bad_lines += list(_mutations(seed=11, count=200))
    damaged = tmp_path / "damaged.ttr"
    rng = random.Random(12)
    mixed = list(lines)
    for line in bad_lines:
        mixed.insert(rng.randint(1, len(mixed)), line)
    damaged.write_bytes(b"".join(mixed))
    contents = read_recording(damaged)
    assert len(contents.messages) >= len(read_recording(good).messages)
    for args in (["report", str(damaged)], ["report", str(damaged), "--json"]):
        out = torchtop(*args)
        assert out.returncode == 0, out.stderr
        assert "Traceback" not in out.stderr
    report = json.loads(torchtop("report", str(damaged), "--json").stdout)
    assert report["samples_per_s"] >= 1  # an idle job: one a second at least


@pytest.mark.parametrize("frame", [b"[" * NEST, b'{"a":' * NEST])
def test_deep_nesting_is_a_protocol_error(frame: bytes) -> None:
    from torchtop.protocol import ProtocolError, decode

    with pytest.raises(ProtocolError):
        decode(frame)
