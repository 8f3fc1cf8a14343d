"""Where agents listen and how viewers find and reach them. Standard library only.

Each agent listens on a Unix socket ``<pid>.sock`` in a per-user directory (mode 0700; the socket
itself is 0600) and leaves ``<pid>.json`` beside it describing the job, which ``torchtop ps``
lists. The server checks each peer's uid and refuses other users; a viewer checks the agent's.
Readers check the directory as writers do (a folder of ours, no access for others, not a
symlink), and take only sockets we own: another user may have made the folder first.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import stat
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from torchtop.private_files import open_private, user_name
from torchtop.protocol import (
    PROTOCOL_VERSION,
    ClientHello,
    FrameSplitter,
    Message,
    ProtocolError,
    decode,
    encode,
)


class TransportError(Exception):
    """A socket could not be set up or reached; the message says what to do."""


def runtime_dir() -> Path:
    """The per-user socket directory: ``$XDG_RUNTIME_DIR/torchtop`` or ``/tmp/torchtop-<uid>``."""
    override = os.environ.get("TORCHTOP_RUNTIME_DIR")
    if override:
        return Path(override)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK):
        return Path(xdg) / "torchtop"
    return Path(f"/tmp/torchtop-{os.getuid()}")


def ensure_runtime_dir() -> Path:
    """The socket directory, created with mode 0700 if it does not exist. An existing one must be
    the user's own private folder (a directory, owned by them, no access for group or others):
    anything else is refused, never changed, since it may be someone else's or shared."""
    path = runtime_dir()
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.lstat()
    except OSError as exc:
        raise TransportError(
            f"cannot create the socket directory {path}: {exc.strerror}; "
            "set TORCHTOP_RUNTIME_DIR to a directory you own"
        ) from None
    _check_private_dir(path, info)
    with contextlib.suppress(OSError):
        prune_runtime_dir(path)
    return path


def existing_runtime_dir() -> Path | None:
    """The socket directory for reading: ``None`` when there is none yet; refused (with the fix)
    when it is not the user's own private folder, as :func:`ensure_runtime_dir` refuses it."""
    path = runtime_dir()
    try:
        info = path.lstat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise TransportError(
            f"cannot read the socket directory {path}: {exc.strerror}; "
            "set TORCHTOP_RUNTIME_DIR to a directory you own"
        ) from None
    _check_private_dir(path, info)
    return path


def _check_private_dir(path: Path, info: os.stat_result) -> None:
    """Refuse ``path`` unless it is a directory (not a symlink) owned by us, closed to others."""
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise TransportError(
            f"{path} is not a directory owned by you; remove it or set TORCHTOP_RUNTIME_DIR "
            "to a new path (torchtop creates it, mode 0700)"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        raise TransportError(
            f"{path} is open to other users (mode {mode:o}), so torchtop will not keep its "
            f"sockets and files there: `chmod 700 {path}` if it is yours alone, or set "
            "TORCHTOP_RUNTIME_DIR to a new path (torchtop creates it, mode 0700)"
        )


#: What the files of ended jobs may take together in the runtime directory; the oldest go first.
ENDED_JOBS_CAP_BYTES = 64 << 20
#: The files torchtop names in the runtime directory after a job's pid: its description, its live
#: run's log, its op traces, and its memory snapshots (at an OOM, or asked for from the viewer).
#: Nothing else there is ever deleted.
_JOB_FILE = re.compile(r"(\d+)(\.json|-job\.log|-ops-(last|\d+)\.json|-(oom|snapshot)-\d+\.pickle)")


def prune_runtime_dir(directory: Path, cap_bytes: int = ENDED_JOBS_CAP_BYTES) -> list[Path]:
    """Delete the oldest files of ended jobs until those left take at most ``cap_bytes``; return
    them. A running job's files, and files torchtop did not name, are never touched (recordings
    and the files beside them live where the user asked, not here)."""
    alive: dict[int, bool] = {}
    ended: list[tuple[float, int, Path]] = []
    with os.scandir(directory) as entries:
        for entry in entries:
            match = _JOB_FILE.fullmatch(entry.name)
            if match is None or not entry.is_file(follow_symlinks=False):
                continue
            pid = int(match.group(1))
            if pid not in alive:
                alive[pid] = pid_alive(pid)
            if alive[pid]:
                continue
            info = entry.stat(follow_symlinks=False)
            ended.append((info.st_mtime, info.st_size, Path(entry.path)))
    total = sum(size for _, size, _ in ended)
    removed = []
    for _mtime, size, path in sorted(ended):
        if total <= cap_bytes:
            break
        with contextlib.suppress(OSError):
            path.unlink()
            removed.append(path)
        total -= size
    return removed


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of a Unix socket (Linux), or None if unknown."""
    creds = _peer_creds(sock)
    return None if creds is None else creds[1]


def peer_pid(sock: socket.socket) -> int | None:
    """The pid of the process at the other end of a Unix socket as this process's pid namespace
    numbers it (Linux), or None if unknown or not visible from here."""
    creds = _peer_creds(sock)
    return creds[0] if creds is not None and creds[0] > 0 else None


def _peer_creds(sock: socket.socket) -> tuple[int, int, int] | None:
    opt = getattr(socket, "SO_PEERCRED", None)
    if opt is None:
        return None
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, opt, struct.calcsize("3i"))
    except OSError:
        return None
    pid, uid, gid = struct.unpack("3i", creds)
    return int(pid), int(uid), int(gid)


@dataclass(frozen=True)
class AgentInfo:
    """What ``<pid>.json`` says of a running agent."""

    pid: int
    argv: list[str]
    started_at: float
    address: str
    cwd: str = ""
    #: Which rank of which distributed run, as the agent's ``Hello`` says it (``rank``,
    #: ``local_rank``, ``world_size``, ``node_rank``, ``run_id``, ``restart_count``); empty for a
    #: single process.
    identity: dict[str, int | str | None] = field(default_factory=dict)

    @property
    def command(self) -> str:
        return " ".join(self.argv)

    @property
    def rank_label(self) -> str:
        """``1/2`` (rank of world size), ``1`` without a world size, ``""`` for a single process."""
        rank, world_size = self.identity.get("rank"), self.identity.get("world_size")
        if rank is None:
            return ""
        return f"{rank}/{world_size}" if world_size is not None else str(rank)

    @property
    def run_label(self) -> str:
        """The run a rank belongs to, and its restart once restarted: ``abc123 (restart 1)``."""
        run_id, restarts = self.identity.get("run_id"), self.identity.get("restart_count")
        if run_id is None:
            return ""
        return f"{run_id} (restart {restarts})" if restarts else str(run_id)

    @property
    def socket_path(self) -> str:
        return self.address.removeprefix("unix:")


def socket_path_for(pid: int, directory: Path | None = None) -> Path:
    return (directory or runtime_dir()) / f"{pid}.sock"


def job_log_path(pid: int, directory: Path | None = None) -> Path:
    """Where the output of a job ``torchtop run`` watches goes (and keeps going when its
    viewer leaves it running)."""
    return (directory or runtime_dir()) / f"{pid}-job.log"


def bind_server(
    pid: int, argv: list[str], started_at: float, identity: Mapping[str, Any] | None = None
) -> tuple[socket.socket, AgentInfo]:
    """Bind the agent's listening socket (mode 0600) and write its description file, with the
    rank's ``identity`` (``rank``, ``world_size``, ``run_id``, ...) so ``ps`` tells ranks apart."""
    directory = ensure_runtime_dir()
    path = socket_path_for(pid, directory)
    # A socket of the same name is left by a dead process whose pid we now have.
    _unlink_quietly(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(str(path))
        os.chmod(path, 0o600)
        # As many pending connections as the system allows: a burst of clients must queue,
        # not be refused (the kernel caps it at net.core.somaxconn).
        server.listen(socket.SOMAXCONN)
    except OSError as exc:
        server.close()
        raise TransportError(f"cannot listen on {path}: {exc.strerror}") from None
    server.setblocking(False)
    info = AgentInfo(
        pid=pid,
        argv=list(argv),
        started_at=started_at,
        address=f"unix:{path}",
        cwd=os.getcwd(),
        identity=_identity(identity or {}),
    )
    return server, describe_agent(info, directory)


def describe_agent(info: AgentInfo, directory: Path | None = None) -> AgentInfo:
    """Write (or rewrite, atomically) the agent's description file ``<pid>.json``."""
    info = replace(info, identity=_identity(info.identity))
    meta = (directory or ensure_runtime_dir()) / f"{info.pid}.json"
    tmp = meta.with_suffix(".json.tmp")
    with open_private(tmp) as f:
        f.write(json.dumps(asdict(info)).encode())
    os.replace(tmp, meta)
    return info


def remove_server_files(pid: int) -> None:
    directory = runtime_dir()
    _unlink_quietly(directory / f"{pid}.sock")
    _unlink_quietly(directory / f"{pid}.json")


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def pid_alive(pid: int) -> bool:
    """True while a process of this pid runs (ours or another user's); a zombie (dead, not yet
    reaped by its parent) does not count."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # "pid (comm) S ...": the state follows the last ')' (comm may hold any bytes).
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def list_agents(clean_stale: bool = True) -> list[AgentInfo]:
    """Running agents of this user, oldest first. Files left by dead processes are removed.
    Raises :class:`TransportError` when the directory is not the user's own private folder."""
    directory = existing_runtime_dir()
    if directory is None:
        return []
    agents = []
    for meta in sorted(directory.glob("*.json")):
        # Only an agent's own file, PID.json: op-window traces and other files the agents
        # keep here (PID-ops-last.json, megabytes) are not parsed on every look.
        if not meta.stem.isdigit():
            continue
        try:
            raw = json.loads(meta.read_text())
            info = AgentInfo(
                pid=int(raw["pid"]),
                argv=[str(a) for a in raw["argv"]],
                started_at=float(raw["started_at"]),
                address=str(raw["address"]),
                cwd=str(raw.get("cwd", "")),
                identity=_identity(raw.get("identity") or {}),
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not pid_alive(info.pid) or not _our_socket(info.socket_path):
            if clean_stale:
                remove_server_files(info.pid)
            continue
        agents.append(info)
    agents.sort(key=lambda a: a.started_at)
    return agents


def _our_socket(path: str) -> bool:
    """A socket (not a link to one) that this user owns."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISSOCK(info.st_mode) and info.st_uid == os.getuid()


def _identity(raw: Mapping[str, Any]) -> dict[str, int | str | None]:
    """The identity fields that are plain values (a damaged file yields fewer, never a crash)."""
    if not isinstance(raw, Mapping):
        return {}
    return {
        str(k): v
        for k, v in raw.items()
        if v is None or (isinstance(v, (int, str)) and not isinstance(v, bool))
    }


def find_agent(pid: int) -> AgentInfo | None:
    for info in list_agents():
        if info.pid == pid:
            return info
    return None


#: How long a viewer keeps retrying while the agent's queue of pending connections is full
#: (a storm of other clients), and the longest pause between two tries.
CONNECT_BUSY_S = 20.0
CONNECT_BACKOFF_MAX_S = 1.0


def _connect(path: str, timeout: float) -> socket.socket:
    """Connect to an agent's socket, retrying with backoff while its backlog is full."""
    deadline = time.monotonic() + CONNECT_BUSY_S
    pause = 0.01
    tries = 0
    while True:
        tries += 1
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except (BlockingIOError, TimeoutError) as exc:
            # EAGAIN: the backlog is full; a timeout: the agent did not take us in time.
            sock.close()
            if time.monotonic() + pause > deadline:
                raise TransportError(
                    f"the agent at {path} did not accept a connection in {CONNECT_BUSY_S:.0f} s "
                    f"({tries} tries; {exc.strerror or 'timed out'}): its queue of pending "
                    "connections stayed full, so many clients are connecting at once or the job "
                    "is stuck; try again"
                ) from None
            time.sleep(pause)
            pause = min(pause * 2, CONNECT_BACKOFF_MAX_S)
            continue
        except OSError as exc:
            sock.close()
            raise TransportError(
                f"cannot connect to the agent at {path}: {exc.strerror or exc}; "
                "is the job still running? (see `torchtop ps`)"
            ) from None
        _check_peer(sock, path)
        return sock


def _check_peer(sock: socket.socket, path: str) -> None:
    """Leave a socket served by another user: torchtop reads only the user's own jobs (the
    agent checks its viewers the same way)."""
    try:
        uid = peer_uid(sock)
    except OSError:
        uid = None
    if uid is None or uid == os.getuid():
        return
    sock.close()
    owner = user_name(uid)
    raise TransportError(
        f"the agent at {path} runs as {owner}, not as you ({user_name(os.getuid())}): torchtop "
        f"reads only your own jobs; run torchtop as {owner} to watch it"
    )


class AgentConnection:
    """A viewer's connection to an agent: send our hello, then read messages.

    ``messages()`` yields decoded messages and skips kinds it does not know. It ends when the
    agent closes the connection, and raises :class:`ProtocolError` for a malformed frame.
    """

    def __init__(
        self,
        address: str,
        client: str = "viewer",
        timeout: float = 5.0,
        outside: Sequence[str] | Callable[[int | None], Sequence[str]] = (),
        pace_s: float = 0.0,
    ) -> None:
        """``outside``: what this viewer reads of the job from outside it (see
        :data:`~torchtop.protocol.OUTSIDE_READS`), or a function of the agent's pid (from the
        socket, ``None`` where unknown) that says it. ``pace_s`` above 0: samples at this
        viewer's pace (one a second), for a viewer of many ranks or an exporter."""
        if not address.startswith("unix:"):
            raise TransportError(f"unsupported address {address!r}; expected unix:/path")
        path = address.removeprefix("unix:")
        self.address = address
        self.sock = _connect(path, timeout)
        try:
            reads = outside(peer_pid(self.sock)) if callable(outside) else outside
            hello = ClientHello(
                protocol=PROTOCOL_VERSION, client=client, outside=list(reads), pace_s=pace_s
            )
            self.sock.sendall(encode(hello))
        except OSError as exc:
            self.sock.close()
            raise TransportError(
                f"the agent at {path} closed the connection at once ({exc.strerror or exc}); "
                "it may be serving too many viewers, or the job is ending: try again"
            ) from None
        self.sock.settimeout(None)
        self._splitter = FrameSplitter()
        self._send_lock = threading.Lock()

    def frames(
        self, on_idle: Callable[[], None] | None = None, idle_s: float = 1.0
    ) -> Iterator[bytes]:
        """Raw frames as they arrive (for recording), each without its newline.

        ``on_idle`` is called every ``idle_s`` seconds in which nothing arrives.
        """
        if on_idle is not None:
            self.sock.settimeout(idle_s)
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except TimeoutError:
                if on_idle is not None:
                    on_idle()
                continue
            except OSError:
                return
            if not data:
                return
            yield from self._splitter.feed(data)

    def receive(self) -> Iterator[bytes] | None:
        """The frames of one read that does not wait, for a caller whose selector found the
        socket readable (an incomplete frame waits for the next read), to be taken in full
        before the next read; ``None`` once the agent closed the connection. Taking them
        raises :class:`ProtocolError` at an oversized frame, after the frames before it."""
        try:
            data = self.sock.recv(1 << 16, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return iter(())
        except OSError:
            return None
        if not data:
            return None
        return self._splitter.feed(data)

    def messages(self) -> Iterator[Message]:
        for frame in self.frames():
            message = decode(frame)
            if message is not None:
                yield message

    def send(self, message: Message) -> bool:
        """Send a frame to the agent (a ``request``) from any thread; False if it is gone.

        Another thread may be reading meanwhile: a socket sends and receives independently.
        """
        data = encode(message)
        with self._send_lock:
            try:
                self.sock.sendall(data)
            except OSError:
                return False
        return True

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


#: TCP keepalive of a relay's connection: a peer gone without a word (a node that froze, a
#: network cut) is given up after about ``KEEPALIVE_IDLE_S + KEEPALIVE_COUNT * KEEPALIVE_EVERY_S``.
KEEPALIVE_IDLE_S = 15
KEEPALIVE_EVERY_S = 15
KEEPALIVE_COUNT = 4


def keep_alive(sock: socket.socket) -> None:
    """Probe an idle TCP connection, so that one whose peer vanished ends instead of waiting
    forever (where the system has the options; elsewhere its defaults)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_EVERY_S),
        ("TCP_KEEPCNT", KEEPALIVE_COUNT),
    ):
        option = getattr(socket, name, None)
        if option is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, option, value)


def wait_for_agent(
    pid: int, timeout: float, alive: Callable[[], bool] | None = None
) -> AgentInfo | None:
    """Wait until the agent of ``pid`` listens, ``alive()`` turns false, or time runs out."""
    deadline = time.monotonic() + timeout
    path = socket_path_for(pid)
    while time.monotonic() < deadline:
        if path.exists():
            info = find_agent(pid)
            if info is not None:
                return info
        if alive is not None and not alive():
            return None
        time.sleep(0.05)
    return None


__all__ = [
    "AgentConnection",
    "AgentInfo",
    "ProtocolError",
    "TransportError",
    "bind_server",
    "ensure_runtime_dir",
    "existing_runtime_dir",
    "keep_alive",
    "list_agents",
    "peer_uid",
    "pid_alive",
    "remove_server_files",
    "runtime_dir",
    "wait_for_agent",
]

if sys.platform == "win32":  # pragma: no cover
    raise ImportError("torchtop needs Unix sockets (Linux or macOS)")
