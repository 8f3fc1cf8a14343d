"""The viewer's side of ``torchtop attach --node``: another node's ranks through its relay.
Standard library only.

A node is an ssh destination (the viewer runs ``ssh HOST torchtop relay``: nothing listens on
the node) or ``tcp://ADDR:PORT`` (a ``torchtop relay --listen`` there, with its token). The viewer
says hello first (the token with it over TCP), the relay answers with its own hello or one
refusal, then streams its agents' frames, each tagged with its source
(:mod:`torchtop.streams.relay`). :class:`NodeFeed` hands each to ``on_message`` under a stream
of its own, ``NODE/PID``, so two nodes' equal pids never meet. Every failure to reach a node is a
:class:`NodeError` of one line that names the fix.
"""

from __future__ import annotations

import contextlib
import os
import select
import shlex
import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torchtop.protocol import (
    PROTOCOL_VERSION,
    ClientHello,
    Dropped,
    FrameSplitter,
    Message,
    ProtocolError,
    Refused,
    RelayHello,
    decode,
    encode,
)
from torchtop.streams.recording import FrameSink, frame_source, retag_frame
from torchtop.text import printable
from torchtop.transport import keep_alive

#: The command that reaches a node (the host and the remote command are appended), unless
#: ``--ssh-command`` or this variable names another. BatchMode: a password prompt would
#: hang under the viewer; a key (or ssh-agent) is needed. ServerAlive: a node that stops
#: answering (frozen, cut off) ends ssh within a minute, and shows as lost.
SSH_ENV = "TORCHTOP_SSH"
DEFAULT_SSH = "ssh -T -o BatchMode=yes -o ServerAliveInterval=15 -o ServerAliveCountMax=4"
#: How long a node may take to answer with its relay's hello.
CONNECT_TIMEOUT_S = 30.0
#: Lines of ssh's own stderr kept to explain a failure.
STDERR_LINES = 20


class NodeError(Exception):
    """A node cannot be reached or refused the viewer; one line naming the fix."""


@dataclass(frozen=True)
class NodeSpec:
    """A node as the user named it: an ssh destination, or ``tcp://ADDR:PORT``."""

    name: str

    def __post_init__(self) -> None:
        if self.name.startswith("-"):
            raise NodeError(
                f"--node {self.name}: a node name cannot start with '-' (ssh would read it as an "
                "option); give a host, user@host or tcp://ADDR:PORT"
            )

    @property
    def tcp(self) -> tuple[str, int] | None:
        if not self.name.startswith("tcp://"):
            return None
        host, _, port = self.name.removeprefix("tcp://").rpartition(":")
        if not host or not port.isdigit():
            raise NodeError(f"--node {self.name}: a TCP node is tcp://ADDR:PORT")
        return host.strip("[]"), int(port)

    @property
    def label(self) -> str:
        """The node's name in the view: the host, or ADDR:PORT."""
        return self.name.removeprefix("tcp://")


def ssh_command(given: str | None = None) -> list[str]:
    """The ssh command: ``--ssh-command``, else ``$TORCHTOP_SSH``, else :data:`DEFAULT_SSH`."""
    text = given or os.environ.get(SSH_ENV) or DEFAULT_SSH
    return shlex.split(text)


def _tail(lines: deque[str]) -> str:
    """The last words of the node's side (ssh, its shell, its relay), escapes shown."""
    text = " / ".join(line.strip() for line in list(lines)[-2:] if line.strip())
    return printable(text, one_line=True) or "no message"


def _end_of_options(command: list[str]) -> list[str]:
    """``--`` for ssh, so that nothing after it (the host) is read as an option; another
    command (``--ssh-command``) gets the host and the remote command only, as documented."""
    return ["--"] if os.path.basename(command[0]) == "ssh" else []


class _SshLink:
    """The relay as a child process: ``SSH HOST 'TORCHTOP relay ...'``."""

    def __init__(self, command: list[str], host: str, remote: str) -> None:
        self.host = host
        self.stderr: deque[str] = deque(maxlen=STDERR_LINES)
        try:
            self.process = subprocess.Popen(
                [*command, *_end_of_options(command), host, remote],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                # Ctrl-C at the viewer is the viewer's to handle, not ssh's.
                start_new_session=True,
            )
        except FileNotFoundError:
            raise NodeError(
                f"cannot reach node {host}: `{command[0]}` is not installed here; install an "
                f"OpenSSH client, or name the command with --ssh-command or {SSH_ENV}"
            ) from None
        except OSError as exc:
            raise NodeError(f"cannot run `{command[0]}` to reach node {host}: {exc}") from None
        assert self.process.stdout is not None and self.process.stderr is not None
        self._fd = self.process.stdout.fileno()
        threading.Thread(target=self._read_stderr, name="torchtop-ssh-err", daemon=True).start()

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for raw in self.process.stderr:
            self.stderr.append(raw.decode(errors="replace"))

    def send(self, data: bytes) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(data)
        self.process.stdin.flush()

    def recv(self, timeout: float | None) -> bytes | None:
        """What arrived; ``b""`` at the end, ``None`` when ``timeout`` passed first."""
        if timeout is not None and not select.select([self._fd], [], [], max(0.0, timeout))[0]:
            return None
        try:
            return os.read(self._fd, 1 << 16)
        except OSError:
            return b""

    def ended(self) -> str:
        """Why the stream ended: ssh's exit and its last words."""
        try:
            code = self.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            return f"the relay's output ended ({_tail(self.stderr)})"
        time.sleep(0.05)  # the stderr reader's last lines
        return f"ssh exited {code} ({_tail(self.stderr)})"

    def failure(self, remote: str) -> NodeError:
        """The one line for a relay that ended before its hello."""
        try:
            code = self.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            code = None
        time.sleep(0.05)
        said = _tail(self.stderr)
        low = said.lower()
        host = self.host
        if code == 255:
            return NodeError(
                f"cannot reach node {host} over ssh ({said}): check that `ssh {host} true` "
                "works without a password prompt (a key, or ssh-agent)"
            )
        if code == 127 or "not found" in low or "no such file" in low:
            return NodeError(
                f"node {host} has no `{remote}` ({said}): install torchtop there (the same "
                "version as here), or give its path with --remote-torchtop"
            )
        if "invalid choice: 'relay'" in said:
            return NodeError(
                f"node {host} runs a torchtop without `relay` (an older version): install "
                f"torchtop {_version()} there"
            )
        return NodeError(
            f"node {host}: the relay ended before it said hello (exit {code}: {said}); run "
            f"`ssh {host} {remote} relay` there to see why"
        )

    def close(self) -> None:
        # Its stdin closing ends the relay; then ssh ends.
        with contextlib.suppress(OSError, ValueError):
            assert self.process.stdin is not None
            self.process.stdin.close()
        try:
            self.process.wait(timeout=3.0)
        except subprocess.TimeoutExpired:
            self.process.terminate()
            try:
                self.process.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for pipe in (self.process.stdout, self.process.stderr):
            with contextlib.suppress(OSError):
                if pipe is not None:
                    pipe.close()


class _TcpLink:
    """The relay at ``tcp://ADDR:PORT``."""

    def __init__(self, name: str, host: str, port: int, timeout: float) -> None:
        self.name = name
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout)
        except ConnectionRefusedError:
            raise NodeError(
                f"nothing listens at {name}: start `torchtop relay --listen {host}:{port}` on "
                "that node (or check the port)"
            ) from None
        except OSError as exc:
            raise NodeError(
                f"cannot connect to {name} ({exc.strerror or exc}): check the address, and "
                "that the network lets this machine reach that port"
            ) from None
        keep_alive(self.sock)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self, timeout: float | None) -> bytes | None:
        self.sock.settimeout(timeout)
        try:
            return self.sock.recv(1 << 16)
        except TimeoutError:
            return None
        except OSError:
            return b""

    def ended(self) -> str:
        return "the relay closed the connection"

    def failure(self, _remote: str) -> NodeError:
        return NodeError(
            f"the relay at {self.name} closed the connection before its hello: is it a "
            "torchtop relay? (see its output)"
        )

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def _version() -> str:
    from torchtop import __version__

    return __version__


class NodeFeed:
    """One node's ranks through its relay: :meth:`connect` (hello and checks, or a
    :class:`NodeError`), then :meth:`start` streams its agents into ``on_message(stream,
    message)``, ``stream`` being ``NODE/PID``, and calls ``on_end(reason)`` once it ends."""

    def __init__(
        self,
        spec: NodeSpec,
        *,
        run_id: str | None = None,
        ssh: list[str] | None = None,
        remote_torchtop: str = "torchtop",
        token: str | None = None,
        writer: FrameSink | None = None,
    ) -> None:
        """``writer``: a recording that gets each agent's frames tagged ``NODE/PID``."""
        self.spec = spec
        self.writer = writer
        self.run_id = run_id
        self._ssh = ssh if ssh is not None else ssh_command()
        self._remote = remote_torchtop
        self._token = token
        self._on_message: Callable[[str, Message], None] | None = None
        self._on_end: Callable[[str], None] | None = None
        self._link: _SshLink | _TcpLink | None = None
        self._splitter = FrameSplitter()
        self._early: list[bytes] = []
        self.hello: RelayHello | None = None
        #: The agents (pids, as the relay tags them) heard from.
        self.sources: set[str] = set()
        #: Frames the relay dropped for this viewer (it was slower than the agents).
        self.dropped = 0
        self.ended = threading.Event()
        self.end_reason = ""
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torchtop-node", daemon=True)

    @property
    def label(self) -> str:
        return self.spec.label

    def stream(self, source: str) -> str:
        return f"{self.label}/{source}"

    def _relay_command(self) -> str:
        command = f"{self._remote} relay"
        if self.run_id is not None:
            command += f" --run {shlex.quote(self.run_id)}"
        return command

    def connect(self, timeout: float = CONNECT_TIMEOUT_S) -> RelayHello:
        """Reach the relay, say hello, and wait for its own; a :class:`NodeError` otherwise."""
        tcp = self.spec.tcp
        if tcp is not None:
            if self._token is None:
                raise NodeError(
                    f"{self.spec.name} needs the relay's token: give --token-file FILE (the "
                    "relay wrote it, 0600, and printed where)"
                )
            link: _SshLink | _TcpLink = _TcpLink(self.spec.name, *tcp, timeout=timeout)
        else:
            link = _SshLink(self._ssh, self.spec.name, self._relay_command())
        self._link = link
        try:
            hello = ClientHello(protocol=PROTOCOL_VERSION, client="viewer", token=self._token)
            try:
                link.send(encode(hello))
            except OSError:
                pass  # it ended already: its reason comes below
            self.hello = self._await_hello(link, timeout)
            return self.hello
        except BaseException:
            self._link = None
            link.close()
            raise

    def _await_hello(self, link: _SshLink | _TcpLink, timeout: float) -> RelayHello:
        name = self.spec.name
        deadline = time.monotonic() + timeout
        while True:
            data = link.recv(deadline - time.monotonic())
            if data is None:
                raise NodeError(
                    f"node {name} did not answer in {timeout:.0f} s: check that "
                    f"`{self._describe()}` starts its relay"
                )
            if not data:
                raise link.failure(self._remote)
            try:
                frames = list(self._splitter.feed(data))
            except ProtocolError:
                frames = [b"\xff"]
            if not frames:
                continue
            first, self._early = frames[0], frames[1:]
            try:
                message = decode(first)
            except ProtocolError:
                message = None
            if isinstance(message, Refused):
                reason = printable(message.reason, one_line=True)
                raise NodeError(f"node {name} refused this viewer: {reason}")
            if not isinstance(message, RelayHello):
                shown = first[:60].decode(errors="replace")
                raise NodeError(
                    f"node {name}: the relay's first line is not torchtop's ({shown!r}); does "
                    "a shell startup file there print to stdout?"
                )
            if message.protocol != PROTOCOL_VERSION:
                raise NodeError(
                    f"node {name} runs torchtop {printable(message.version, one_line=True)} "
                    f"(protocol {message.protocol}), "
                    f"this viewer torchtop {_version()} (protocol {PROTOCOL_VERSION}): install "
                    "the same version on both"
                )
            return message

    def _describe(self) -> str:
        if self.spec.tcp is not None:
            return f"torchtop relay --listen {self.label}"
        return f"{shlex.join(self._ssh)} {self.spec.name} {self._relay_command()}"

    def start(
        self,
        on_message: Callable[[str, Message], None] | None = None,
        on_end: Callable[[str], None] | None = None,
    ) -> NodeFeed:
        """Stream the node's agents (after :meth:`connect`)."""
        self._on_message = on_message
        self._on_end = on_end
        self._thread.start()
        return self

    def _run(self) -> None:
        reason = "closed"
        try:
            reason = self._stream()
        except Exception as exc:  # a feed ends with a reason, never a traceback
            reason = f"feed failed: {exc!r}"
        finally:
            if self._link is not None:
                self._link.close()
            self.end_reason = reason
            self.ended.set()
            if self._on_end is not None:
                self._on_end(reason)

    def _stream(self) -> str:
        link = self._link
        assert link is not None, "connect() first"
        pending = self._early
        self._early = []
        while True:
            try:
                for frame in pending:
                    self._frame(frame)
            except ProtocolError as exc:
                return f"the relay sent a malformed frame: {exc}"
            if self._closed.is_set():
                return "closed"
            data = link.recv(None)
            if not data:
                return "closed" if self._closed.is_set() else link.ended()
            try:
                pending = list(self._splitter.feed(data))
            except ProtocolError as exc:
                return f"the relay sent a malformed frame: {exc}"

    def _frame(self, frame: bytes) -> None:
        message = decode(frame)
        if message is None:
            return
        source = frame_source(frame)
        if source is None:
            # The relay's own: what it dropped for us.
            if isinstance(message, Dropped):
                self.dropped = message.count
            return
        self.sources.add(source)
        stream = self.stream(source)
        if self.writer is not None:
            self.writer.write_frame(retag_frame(frame, stream))
        if self._on_message is not None:
            self._on_message(stream, message)

    def close(self) -> None:
        """Leave the node: its relay ends (and closes its agents' connections)."""
        self._closed.set()
        link = self._link
        if link is not None:
            link.close()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)


def read_node_token(path: Path | None) -> str | None:
    """The token for TCP nodes, from ``--token-file``."""
    if path is None:
        return None
    from torchtop.streams.token import RelayError, read_token

    try:
        return read_token(path)
    except RelayError as exc:
        raise NodeError(str(exc)) from None
