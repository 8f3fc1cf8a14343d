"""A TCP relay's door: peers without the token cannot hold it shut (a deadline for the whole
handshake, handshakes bounded apart from sessions, a session only after the token), guesses
slow down, and short tokens are refused."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import torchtop.streams.relay as relay
from torchtop.protocol import PROTOCOL_VERSION, ClientHello, Refused, decode, encode
from torchtop.streams.relay import TcpRelay, bind_tcp
from torchtop.streams.token import RelayError, read_token

TOKEN = "t" * 43


@pytest.fixture
def tcp_relay(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[tuple[TcpRelay, list[str]]]:
    monkeypatch.setenv("TORCHTOP_RUNTIME_DIR", str(tmp_path / "rt"))  # no agents to follow
    lines: list[str] = []
    server = TcpRelay(bind_tcp("127.0.0.1", 0), TOKEN, log=lines.append)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        yield server, lines
    finally:
        server.close()
        thread.join(timeout=10)


def _hello(address: tuple[str, int], token: str | None, wait_s: float = 1.0) -> Refused | None:
    """Connect and present ``token``: the refusal, or ``None`` when the relay serves us (it
    sends nothing in ``wait_s``: there are no agents here to send)."""
    with socket.create_connection(address, timeout=10) as s:
        s.sendall(encode(ClientHello(protocol=PROTOCOL_VERSION, token=token)))
        s.settimeout(wait_s)
        try:
            data = s.recv(65536)
        except TimeoutError:
            return None  # served: no agents here, so nothing to send yet
        message = decode(data.splitlines()[0]) if data else None
        return message if isinstance(message, Refused) else None


def test_a_viewer_with_the_token_is_served_while_64_peers_trickle_bytes(
    tcp_relay: tuple[TcpRelay, list[str]],
) -> None:
    server, lines = tcp_relay
    stop = threading.Event()
    peers = [socket.create_connection(server.address, timeout=10) for _ in range(64)]

    def trickle() -> None:
        while not stop.is_set():
            for peer in peers:
                with contextlib.suppress(OSError):
                    peer.send(b"{")  # never a whole line
            stop.wait(0.2)

    trickler = threading.Thread(target=trickle, daemon=True)
    trickler.start()
    try:
        time.sleep(0.5)  # every peer is in its handshake
        for _ in range(3):
            assert _hello(server.address, TOKEN) is None, lines[-5:]
        assert sum(line.startswith("serving ") for line in lines) == 3
    finally:
        stop.set()
        trickler.join()
        for peer in peers:
            peer.close()


def test_a_peer_that_trickles_is_cut_off_at_the_deadline(
    tcp_relay: tuple[TcpRelay, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, lines = tcp_relay
    monkeypatch.setattr(relay, "HANDSHAKE_DEADLINE_S", 1.0)
    closed = False
    with socket.create_connection(server.address, timeout=10) as peer:
        started = time.monotonic()
        while not closed and time.monotonic() - started < 30:
            try:
                peer.send(b"{")  # a byte every 0.2 s: each read alone is quick
                peer.settimeout(0.2)
                closed = peer.recv(65536).endswith(b"\n")  # the refusal, then the close
            except TimeoutError:
                continue
            except OSError:  # reset: the relay closed it while we were sending
                closed = True
    assert closed, "the relay kept a trickling peer for 30 s"
    # The relay logs its refusal just after sending it.
    deadline = time.monotonic() + 10
    while not any("no hello within 1 s" in line for line in lines):
        assert time.monotonic() < deadline, lines
        time.sleep(0.05)


def test_bad_tokens_from_one_address_wait_longer_each_time(
    tcp_relay: tuple[TcpRelay, list[str]],
) -> None:
    server, _ = tcp_relay
    waits = []
    for _ in range(relay.BAD_TOKENS_FREE + 3):
        started = time.monotonic()
        refused = _hello(server.address, "w" * 43, wait_s=60)
        waits.append(time.monotonic() - started)
        assert refused is not None and refused.reason.startswith("bad token")
    # Past the free tries, each waits before its token is checked: 1 s, then 2 s (lower bounds
    # only: a loaded machine may take longer, never shorter).
    assert waits[-2] >= 0.9 and waits[-1] >= 1.8, waits
    # The right token clears the count; it waits out the back-off once, then is served.
    assert _hello(server.address, TOKEN) is None


def test_short_tokens_are_refused(tmp_path: Path) -> None:
    short = tmp_path / "token"
    short.write_text("s" * 16 + "\n")
    short.chmod(0o600)
    with pytest.raises(RelayError, match="shorter than 22 characters"):
        read_token(short)
    with pytest.raises(RelayError, match="22 characters at least"):
        TcpRelay(bind_tcp("127.0.0.1", 0), "s" * 21)
