"""Several nodes in one view: two simulated nodes on this machine (two ``torchrun --nnodes=2
--node_rank=0/1`` on 127.0.0.1, each with its own runtime directory, so each node's torchtop
sees only its own agents), node 0 read here and node 1 through its relay: over TCP with a
token, over the ssh path with ssh replaced by a local command, and over a real sshd when one is
installed. Then the relay's refusals, its end when its viewer goes, and each failure to reach a
node as one line naming the fix.

One two-node job serves every test of the module (it runs until the module ends)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.conftest import SCRIPTS
from tests.viewer.test_tui_tmux import Terminal, terminal  # noqa: F401  (the fixture)
from torchtop.protocol import (
    PROTOCOL_VERSION,
    ClientHello,
    FrameSplitter,
    Refused,
    RelayHello,
    decode,
    encode,
)
from torchtop.streams.nodes import NodeError, NodeFeed, NodeSpec, read_node_token
from torchtop.streams.relay import RelayOutput
from torchtop.streams.runs import AttachedRun
from torchtop.transport import list_agents

TORCHTOP = f"{sys.executable} -m torchtop"
#: The two nodes' run (TORCHELASTIC_RUN_ID).
RUN_ID = "tt-nodes"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Nodes:
    """The two simulated nodes: each one's runtime directory and its `torchtop run`."""

    dirs: list[Path]
    jobs: list[subprocess.Popen[bytes]]

    def env(self, node: int) -> dict[str, str]:
        return {**os.environ, "TORCHTOP_RUNTIME_DIR": str(self.dirs[node])}


def _stop(process: subprocess.Popen[bytes]) -> None:
    """The process and everything it started (its own session)."""
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(process.pid).children(recursive=True):
            child.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@pytest.fixture(scope="module")
def nodes() -> Iterator[Nodes]:
    base = Path(tempfile.mkdtemp(prefix="tt-nodes-", dir="/tmp"))
    dirs = [base / "n0", base / "n1"]
    for d in dirs:
        d.mkdir(mode=0o700)
    port = _free_port()
    jobs = []
    try:
        for rank, d in enumerate(dirs):
            job = subprocess.Popen(
                [sys.executable, "-m", "torchtop", "run", "--headless", "--no-ops",
                 sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                 f"--node_rank={rank}", "--master_addr=127.0.0.1", f"--master_port={port}",
                 f"--rdzv_id={RUN_ID}", "--nproc_per_node=2", str(SCRIPTS / "ddp.py"),
                 "--steps", "100000",
                 "--sleep-ms", "50"],
                env={**os.environ, "TORCHTOP_RUNTIME_DIR": str(d)},
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
            jobs.append(job)
        found = Nodes(dirs, jobs)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            counts = [len(_agents(found, n)) for n in (0, 1)]
            if counts == [2, 2]:
                break
            assert all(job.poll() is None for job in jobs), "a node's job ended early"
            time.sleep(0.3)
        else:
            pytest.fail(f"the two nodes' agents did not start: {counts}")
        yield found
    finally:
        for job in jobs:
            _stop(job)
        shutil.rmtree(base, ignore_errors=True)


def _agents(nodes: Nodes, node: int) -> list[object]:
    out = subprocess.run(
        [sys.executable, "-m", "torchtop", "ps", "--json"],
        env=nodes.env(node), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    import json

    return list(json.loads(out.stdout))


@pytest.fixture
def node0(nodes: Nodes, monkeypatch: pytest.MonkeyPatch) -> Nodes:
    """This test's process is node 0's viewer: it sees node 0's agents only."""
    monkeypatch.setenv("TORCHTOP_RUNTIME_DIR", str(nodes.dirs[0]))
    return nodes


def _until(check: Callable[[], bool], timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _steps(run: AttachedRun) -> dict[int, int]:
    """Each rank's steps so far, by rank."""
    run.drain()
    return {
        job.hello.rank: job.training.total
        for job in run.model.jobs.values()
        if job.hello is not None and job.hello.rank is not None
    }


def _every_rank_steps(run: AttachedRun) -> dict[int, int]:
    """Wait until ranks 0-3 all stepped, then until each stepped again; their streams."""
    _until(lambda: sorted(_steps(run)) == [0, 1, 2, 3] and min(_steps(run).values()) > 0,
           what="ranks 0-3 to step")  # fmt: skip
    first = _steps(run)
    _until(lambda: all(_steps(run)[r] > first[r] for r in first), what="every rank to step on")
    return _steps(run)


def _by_rank(run: AttachedRun) -> dict[int, str]:
    return {
        job.hello.rank: stream
        for stream, job in run.model.jobs.items()
        if job.hello is not None and job.hello.rank is not None
    }


def _unix_connections(pid: int) -> int:
    """The process's Unix sockets: a relay has one per agent it follows, and no other."""
    with contextlib.suppress(psutil.Error):
        return len(psutil.Process(pid).net_connections(kind="unix"))
    return 0


# -- over TCP, with a token ----------------------------------------------------------------------


@pytest.fixture
def tcp_relay(nodes: Nodes) -> Iterator[tuple[subprocess.Popen[str], str, Path]]:
    """`torchtop relay --listen 127.0.0.1:0` on node 1: the process, its address, its token."""
    relay = subprocess.Popen(
        [sys.executable, "-m", "torchtop", "relay", "--listen", "127.0.0.1:0"],
        env=nodes.env(1), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    assert relay.stderr is not None
    line = relay.stderr.readline()
    match = re.search(r"on (127\.0\.0\.1:\d+) .* token in (\S+):", line)
    assert match, line
    try:
        yield relay, match.group(1), Path(match.group(2))
    finally:
        relay.terminate()
        relay.wait(30)


def test_two_nodes_in_one_view_over_tcp_with_a_token(
    node0: Nodes, tcp_relay: tuple[subprocess.Popen[str], str, Path]
) -> None:
    relay, address, token_file = tcp_relay
    # The token: random, private, in node 1's runtime directory.
    assert token_file.parent == node0.dirs[1] and token_file.stat().st_mode & 0o777 == 0o600
    feed = NodeFeed(NodeSpec(f"tcp://{address}"), token=read_node_token(token_file))
    hello = feed.connect()
    assert hello.protocol == PROTOCOL_VERSION and hello.pid == relay.pid
    # A relay that vanishes without a word (a frozen node, a cut network) is given up on.
    link = feed._link
    assert link is not None and hasattr(link, "sock")
    assert link.sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
    run = AttachedRun(list_agents(), [feed])
    assert len(run.agents) == 2  # node 0's own, here
    run.start()
    try:
        steps = _every_rank_steps(run)
        assert sorted(steps) == [0, 1, 2, 3]
        streams = _by_rank(run)
        # Node 1's ranks come through its relay, under streams of their own.
        assert {run.node_of(streams[r]) for r in (2, 3)} == {address}
        assert all(run.opens_elsewhere(streams[r]) for r in (2, 3))
        assert not any(run.opens_elsewhere(streams[r]) for r in (0, 1))
        assert _unix_connections(relay.pid) == 2  # one per agent of node 1
        # A second viewer gets its own; they close when it leaves, the first viewer's stay.
        second = NodeFeed(NodeSpec(f"tcp://{address}"), token=read_node_token(token_file))
        second.connect()
        second.start()
        _until(lambda: _unix_connections(relay.pid) == 4, what="the second viewer's")
        second.close()
        _until(lambda: _unix_connections(relay.pid) == 2, what="the second viewer's to close")
        # The relay goes (its node lost): its ranks are marked lost, node 0's go on.
        relay.send_signal(signal.SIGKILL)
        relay.wait(30)
        _until(lambda: feed.ended.is_set(), what="the node to be lost")
        run.drain()
        assert address in run.lost_nodes
        assert [run.is_lost(streams[r]) for r in range(4)] == [False, False, True, True]
        before = _steps(run)
        _until(lambda: all(_steps(run)[r] > before[r] for r in (0, 1)), what="node 0 to go on")
        assert "lost" in run.status()[0] and run.running()
    finally:
        run.stop_job()


def test_the_relay_refuses_a_bad_token_with_one_line_and_nothing_else(
    nodes: Nodes, tcp_relay: tuple[subprocess.Popen[str], str, Path]
) -> None:
    relay, address, token_file = tcp_relay
    host, port = address.split(":")
    for hello in (
        ClientHello(protocol=PROTOCOL_VERSION, token="not-the-token-at-all"),
        ClientHello(protocol=PROTOCOL_VERSION),  # none
    ):
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(encode(hello))
            received = b"".join(iter(lambda s=s: s.recv(65536), b""))  # type: ignore[misc]
        # One frame, the refusal, naming the fix; not a hello, not one agent's frame.
        (frame,) = received.splitlines()
        refused = decode(frame)
        assert isinstance(refused, Refused) and "bad token" in refused.reason
        assert "--token-file" in refused.reason
    # The right token, another protocol version: refused too, naming the fix.
    token = token_file.read_text().strip()
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(encode(ClientHello(protocol=PROTOCOL_VERSION + 1, token=token)))
        received = b"".join(iter(lambda s=s: s.recv(65536), b""))  # type: ignore[misc]
    (frame,) = received.splitlines()
    refused = decode(frame)
    assert isinstance(refused, Refused) and "same torchtop version" in refused.reason
    # The viewer says the relay's reason in one line.
    with pytest.raises(NodeError, match=r"^node tcp://\S+ refused this viewer: bad token"):
        NodeFeed(NodeSpec(f"tcp://{address}"), token="x" * 32).connect()
    relay.terminate()
    _, err = relay.communicate(timeout=30)
    # The relay's side, one line each.
    assert len(re.findall(r"refused 127\.0\.0\.1:\d+: bad token", err)) == 3, err
    assert "refused" in err and "Traceback" not in err
    # Its token file made for this run is gone with it.
    assert not token_file.exists()


def test_a_viewer_without_a_token_is_told_to_give_one() -> None:
    with pytest.raises(NodeError, match="needs the relay's token: give --token-file"):
        NodeFeed(NodeSpec("tcp://127.0.0.1:1")).connect()


# -- over the ssh path ---------------------------------------------------------------------------


def _local_ssh(tmp_path: Path, env: dict[str, str]) -> Path:
    """A stand-in for ssh that runs the remote command here, as node 1 (its runtime dir)."""
    script = tmp_path / "ssh-to-node1"
    script.write_text(
        "#!/bin/sh\n# ssh HOST COMMAND: the host is this machine.\nshift\n"
        f'exec env TORCHTOP_RUNTIME_DIR={env["TORCHTOP_RUNTIME_DIR"]} sh -c "$1"\n'
    )
    script.chmod(0o700)
    return script


def test_two_nodes_in_one_view_over_the_ssh_path(node0: Nodes, tmp_path: Path) -> None:
    ssh = _local_ssh(tmp_path, node0.env(1))
    feed = NodeFeed(NodeSpec("node1"), ssh=[str(ssh)], remote_torchtop=TORCHTOP)
    feed.connect()
    run = AttachedRun(list_agents(), [feed])
    run.start()
    try:
        _every_rank_steps(run)
        streams = _by_rank(run)
        assert {run.node_of(streams[r]) for r in (2, 3)} == {"node1"}
        link = feed._link
        assert link is not None and hasattr(link, "process")
        relay = psutil.Process(link.process.pid)
        relay_pid = next(
            (p.pid for p in [relay, *relay.children(recursive=True)] if "relay" in p.cmdline()),
            None,
        )
        assert relay_pid is not None and _unix_connections(relay_pid) == 2
    finally:
        run.stop_job()
    # Leaving closes the relay's stdin: it ends, cleanly, its agents' connections with it.
    assert link.process.returncode == 0
    assert not psutil.pid_exists(relay_pid)


def _pilot_two_hosts(run: AttachedRun) -> list[list[str]]:
    """The run view, driven by Pilot, until it shows ranks 0-3; its table's rows."""
    from textual.widgets import DataTable

    from torchtop.streams.sources import attach_rank
    from torchtop.tui.app import TorchtopApp

    async def drive() -> list[list[str]]:
        app = TorchtopApp.for_run(run, "two nodes", open_rank=attach_rank)
        async with app.run_test(size=(120, 30)) as pilot:
            table: DataTable[str] = app.run_screen.query_one("#ranks", DataTable)
            deadline = time.monotonic() + 60
            while True:
                await pilot.pause(0.5)
                rows = [list(map(str, table.get_row_at(i))) for i in range(table.row_count)]
                if sorted(r[1] for r in rows) == ["0", "1", "2", "3"]:
                    return [[str(c.label) for c in table.columns.values()], *rows]
                assert time.monotonic() < deadline, rows

    return asyncio.run(drive())


def test_the_run_view_shows_both_nodes_ranks(node0: Nodes, tmp_path: Path) -> None:
    ssh = _local_ssh(tmp_path, node0.env(1))
    feed = NodeFeed(NodeSpec("node1"), ssh=[str(ssh)], remote_torchtop=TORCHTOP)
    feed.connect()
    run = AttachedRun(list_agents(), [feed])
    try:
        columns, *rows = _pilot_two_hosts(run)
    finally:
        run.stop_job()
    assert columns[:3] == ["node", "rank", "pid"]
    here = socket.gethostname()
    assert sorted(((r[0], r[1]) for r in rows), key=lambda row: row[1]) == [
        (here, "0"), (here, "1"), ("node1", "2"), ("node1", "3")
    ]  # fmt: skip
    assert all(r[3] == "running" for r in rows)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_attach_node_in_a_terminal_shows_both_nodes_and_q_leaves_them_running(
    nodes: Nodes,
    tmp_path: Path,
    terminal: Terminal,  # noqa: F811
) -> None:
    ssh = _local_ssh(tmp_path, nodes.env(1))
    terminal.keys(
        f"TORCHTOP_RUNTIME_DIR={nodes.dirs[0]} {TORCHTOP} attach --node node1 "
        f"--ssh-command {ssh} --remote-torchtop '{TORCHTOP}'; echo EXIT=$?",
        "Enter",
    )

    def ranks(screen: str) -> dict[str, str]:
        """rank -> node, from the table's rows: node, rank, pid, state, ..."""
        found = {}
        for line in screen.splitlines():
            cells = line.split()
            if len(cells) > 4 and cells[1].isdigit() and cells[2].isdigit():
                found[cells[1]] = cells[0]
        return found

    screen = terminal.wait_for(lambda s: sorted(ranks(s)) == ["0", "1", "2", "3"], timeout=90)
    assert "node node1: 2 agents" in screen
    assert {ranks(screen)[r] for r in "23"} == {"node1"}
    assert {ranks(screen)[r] for r in "01"} == {socket.gethostname()}
    terminal.keys("q")
    terminal.wait_for(lambda s: "EXIT=0" in s, timeout=60)
    # Detached: both nodes' jobs run on.
    assert all(job.poll() is None for job in nodes.jobs)


class StdioRelay:
    """`torchtop relay` on node 1 as ssh runs it (stdin and stdout pipes), after the viewer's
    hello: the agents it relays, as their frames' sources arrive."""

    def __init__(self, nodes: Nodes, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "torchtop", "relay", *args], env=nodes.env(1),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(encode(ClientHello(protocol=PROTOCOL_VERSION)))
        self.process.stdin.flush()
        self.hello = decode(self.process.stdout.readline())
        self.sources: set[int] = set()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        splitter = FrameSplitter()
        while data := self.process.stdout.read1(65536):
            for frame in splitter.feed(data):
                self.sources.update(int(s) for s in re.findall(rb'"src":"(\d+)"\}$', frame))

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _ranks_pids(nodes: Nodes, node: int) -> set[int]:
    return {a["pid"] for a in _agents(nodes, node)}  # type: ignore[index]


def test_the_relay_ends_when_its_stdin_closes(nodes: Nodes) -> None:
    relay = StdioRelay(nodes)
    try:
        assert isinstance(relay.hello, RelayHello) and relay.hello.pid == relay.process.pid
        # Its agents' frames follow, each tagged with its agent.
        ranks = _ranks_pids(nodes, 1)
        _until(lambda: relay.sources == ranks, what="node 1's agents' frames")
        _until(lambda: _unix_connections(relay.process.pid) == 2, what="its connections")
        assert relay.process.stdin is not None
        relay.process.stdin.close()
        assert relay.process.wait(30) == 0
    finally:
        relay.close()


def test_the_relay_follows_agents_that_start_later_and_only_its_run(
    nodes: Nodes, tmp_path: Path
) -> None:
    every, one_run = StdioRelay(nodes), StdioRelay(nodes, "--run", RUN_ID)
    late = None
    try:
        assert isinstance(one_run.hello, RelayHello) and one_run.hello.run_id == RUN_ID
        ranks = _ranks_pids(nodes, 1)
        _until(lambda: every.sources == ranks == one_run.sources, what="the ranks' frames")
        # A job of no run starts on node 1 after the relays: the one relay finds it.
        (tmp_path / "late.py").write_text(
            "import time, torchtop\ntorchtop.start(ops=False)\ntime.sleep(120)\n"
        )
        late = subprocess.Popen([sys.executable, str(tmp_path / "late.py")], env=nodes.env(1))
        _until(lambda: late.pid in every.sources, what="the new agent's frames")
        _until(lambda: _unix_connections(every.process.pid) == 3, what="its connection")
        # The relay of one run left it out.
        assert one_run.sources == ranks and _unix_connections(one_run.process.pid) == 2
    finally:
        if late is not None:
            late.kill()
            late.wait()
        every.close()
        one_run.close()


# -- over a real sshd ----------------------------------------------------------------------------


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[tuple[list[str], str]]:
    """An sshd on 127.0.0.1 for this user with a throwaway key: the ssh command and host."""
    binary = shutil.which("sshd") or "/usr/sbin/sshd"
    if not os.path.exists(binary) or shutil.which("ssh") is None:
        pytest.skip("needs OpenSSH's sshd and ssh (apt-get install openssh-server)")
    if os.getuid() == 0:
        # As root sshd wants its privilege separation directory (its service would make it).
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    keys = tmp_path / "ssh"
    keys.mkdir(mode=0o700)
    for name in ("host", "user"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name)],
                       check=True)  # fmt: skip
    (keys / "authorized_keys").write_text((keys / "user.pub").read_text())
    (keys / "authorized_keys").chmod(0o600)
    port = _free_port()
    config = keys / "sshd_config"
    config.write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {keys / 'host'}\n"
        f"AuthorizedKeysFile {keys / 'authorized_keys'}\nPasswordAuthentication no\n"
        f"PidFile {keys / 'sshd.pid'}\nStrictModes no\nUsePAM no\nPermitRootLogin yes\n"
        "AcceptEnv TORCHTOP_RUNTIME_DIR\n"
    )
    daemon = subprocess.Popen([binary, "-D", "-e", "-f", str(config)], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            assert daemon.poll() is None, daemon.stderr.read() if daemon.stderr else ""
            assert time.monotonic() < deadline
            time.sleep(0.1)
        command = [
            "ssh", "-T", "-o", "BatchMode=yes", "-p", str(port), "-i", str(keys / "user"),
            "-o", "StrictHostKeyChecking=no", "-o", f"UserKnownHostsFile={keys / 'known'}",
            "-o", "SendEnv=TORCHTOP_RUNTIME_DIR",
        ]  # fmt: skip
        yield command, "127.0.0.1"
    finally:
        daemon.terminate()
        daemon.wait(30)


def test_two_nodes_in_one_view_over_a_real_sshd(
    node0: Nodes, sshd: tuple[list[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    command, host = sshd
    # The remote shell runs as node 1: its runtime dir, set on the remote command line.
    remote = f"env TORCHTOP_RUNTIME_DIR={node0.dirs[1]} {TORCHTOP}"
    feed = NodeFeed(NodeSpec(host), ssh=command, remote_torchtop=remote)
    feed.connect()
    run = AttachedRun(list_agents(), [feed])
    run.start()
    try:
        _every_rank_steps(run)
        assert {run.node_of(_by_rank(run)[r]) for r in (2, 3)} == {host}
    finally:
        run.stop_job()


# -- one line naming the fix for each failure ----------------------------------------------------


def test_each_failure_to_reach_a_node_is_one_line_naming_the_fix(tmp_path: Path) -> None:
    def fails(spec: str, **kwargs: object) -> str:
        with pytest.raises(NodeError) as caught:
            NodeFeed(NodeSpec(spec), **kwargs).connect(timeout=20)  # type: ignore[arg-type]
        text = str(caught.value)
        assert "\n" not in text and "Traceback" not in text
        return text

    # No ssh here.
    text = fails("node1", ssh=[str(tmp_path / "no-ssh")])
    assert "not installed here" in text and "--ssh-command" in text
    # The host cannot be reached: the real ssh client, and nothing listens on the port.
    if shutil.which("ssh"):
        port = _free_port()
        text = fails("127.0.0.1", ssh=["ssh", "-T", "-o", "BatchMode=yes", "-p", str(port)])
        assert text.startswith("cannot reach node 127.0.0.1 over ssh")
        assert "`ssh 127.0.0.1 true` works" in text
    # No torchtop there.
    ssh = _local_ssh(tmp_path, {"TORCHTOP_RUNTIME_DIR": str(tmp_path)})
    text = fails("node1", ssh=[str(ssh)], remote_torchtop="/nonexistent/torchtop")
    assert "has no `/nonexistent/torchtop`" in text and "--remote-torchtop" in text
    # A torchtop there of another protocol version.
    other = encode(RelayHello(protocol=PROTOCOL_VERSION + 1, version="9.0", host="h", pid=1))
    speaker = tmp_path / "other-version"
    speaker.write_bytes(b"#!/bin/sh\nprintf '%s\\n' '" + other.strip() + b"'\ncat >/dev/null\n")
    speaker.chmod(0o700)
    text = fails("node1", ssh=[str(ssh)], remote_torchtop=str(speaker))
    assert "runs torchtop 9.0" in text and "install the same version on both" in text
    # A shell startup file that prints to stdout.
    text = fails("node1", ssh=[str(ssh)], remote_torchtop="echo Welcome to the cluster; true")
    assert "is not torchtop's ('Welcome to the cluster')" in text
    # Nothing listens at a TCP node.
    text = fails(f"tcp://127.0.0.1:{_free_port()}", token="t" * 32)
    assert "nothing listens at tcp://127.0.0.1:" in text and "torchtop relay --listen" in text


# -- the relay's bound ---------------------------------------------------------------------------


def test_a_stalled_viewer_costs_the_relay_a_bounded_queue_never_the_agents() -> None:
    stalled = threading.Event()
    sent: list[bytes] = []

    def send(data: bytes) -> None:
        stalled.wait()  # the viewer reads nothing until released
        sent.append(data)

    output = RelayOutput(send, cap_bytes=64 << 10).start()
    hello = b'{"kind":"hello","pid":1,"src":"1"}'
    output.write_frame(b'{"kind":"sample","t":0.0}')  # taken by the stalled send
    time.sleep(0.2)
    output.write_frame(hello)
    frame = b'{"kind":"sample","t":1.0,"pad":"' + b"x" * 1000 + b'"}'
    for _ in range(1000):
        output.write_frame(frame)  # never blocks: the writer's thread is stuck, not us
    assert output.queued_bytes <= (64 << 10) + len(hello)
    assert output.dropped >= 1000 - (64 << 10) // len(frame) - 1
    stalled.set()
    _until(lambda: not output.queued_bytes, what="the queue to drain")
    time.sleep(0.2)
    out = b"".join(sent).splitlines()
    messages = [decode(line) for line in out if line.startswith(b'{"kind":"dropped"')]
    # The hello was kept, ahead of what followed it; the drops were counted to the viewer.
    assert out[1] == hello
    assert any(getattr(m, "count", None) == output.dropped for m in messages)
    output.close()


# -- a recording of every node's ranks -------------------------------------------------------------


def test_a_headless_recording_holds_every_nodes_ranks_and_its_report_lists_them(
    node0: Nodes, tmp_path: Path
) -> None:
    nodes = node0
    # Once the job steps (its ranks take a few seconds to start), a few seconds of it.
    here = AttachedRun(list_agents())
    here.start()
    try:
        _until(lambda: len(_steps(here)) == 2 and min(_steps(here).values()) > 0, what="steps")
    finally:
        here.stop_job()
    ssh = _local_ssh(tmp_path, nodes.env(1))
    record = tmp_path / "r.ttr"
    out = subprocess.run(
        [sys.executable, "-m", "torchtop", "attach", "--node", "node1", "--ssh-command", str(ssh),
         "--remote-torchtop", TORCHTOP, "--run", RUN_ID, "--headless", "--record", str(record),
         "--duration", "4"],
        env=nodes.env(0), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "of 4 ranks on 2 nodes" in out.stderr
    assert record.stat().st_mode & 0o777 == 0o600
    report = subprocess.run(
        [sys.executable, "-m", "torchtop", "report", str(record), "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert report.returncode == 0, report.stderr
    import json

    ranks = json.loads(report.stdout)["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert all(r["steps"] > 0 for r in ranks), [(r["rank"], r["steps"]) for r in ranks]
    # Node 1's ranks, tagged under its name: its pids stay apart from node 0's.
    assert {r["pid"] for r in ranks[2:]} == _ranks_pids(nodes, 1)


def test_attach_node_fails_with_one_line_naming_the_fix(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "torchtop", "attach", "--node", "node1", "--ssh-command",
         str(tmp_path / "no-ssh"), "--headless", "--record", str(tmp_path / "r.ttr")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 1
    (line,) = [x for x in out.stderr.splitlines() if not x.startswith("torchtop: reaching")]
    assert line.startswith("torchtop: cannot reach node node1") and "--ssh-command" in line


def test_a_tcp_relay_listens_on_loopback_unless_told_and_tokens_stay_private(
    tmp_path: Path,
) -> None:
    from torchtop.streams.relay import parse_listen
    from torchtop.streams.token import RelayError, read_token, token_for

    assert parse_listen("7000") == ("127.0.0.1", 7000)
    assert parse_listen("0.0.0.0:7000") == ("0.0.0.0", 7000)
    assert parse_listen("[::1]:7000") == ("::1", 7000)
    # A new token: random, 0600; the same file gives it back.
    path = tmp_path / "relay.token"
    token, new = token_for(path)
    assert new and len(token) >= 32 and path.stat().st_mode & 0o777 == 0o600
    assert token_for(path) == (token, False) and token_for(tmp_path / "other")[0] != token
    # One others can read is refused, naming the fix.
    path.chmod(0o644)
    with pytest.raises(RelayError, match=r"open to other users .*chmod 600"):
        read_token(path)
    with pytest.raises(NodeError, match="chmod 600"):
        read_node_token(path)


def test_a_node_name_that_reads_as_an_option_is_refused(tmp_path: Path) -> None:
    """``--node=-oProxyCommand=...`` would be an ssh option (a command ssh runs here): refused
    in one line before anything is run."""
    with pytest.raises(NodeError, match="cannot start with '-'"):
        NodeSpec("-oProxyCommand=true")
    mark = tmp_path / "ran"
    ssh = tmp_path / "ssh"
    ssh.write_text(f"#!/bin/sh\ntouch {mark}\n")
    ssh.chmod(0o700)
    out = subprocess.run(
        [sys.executable, "-m", "torchtop", "attach", f"--node=-oProxyCommand=touch {mark}",
         "--ssh-command", str(ssh), "--headless", "--record", str(tmp_path / "r.ttr")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 1
    assert out.stderr == (
        f"torchtop: --node -oProxyCommand=touch {mark}: a node name cannot start with '-' (ssh "
        "would read it as an option); give a host, user@host or tcp://ADDR:PORT\n"
    )
    assert not mark.exists()


def test_ssh_gets_the_host_after_the_end_of_its_options(tmp_path: Path) -> None:
    """``ssh [options] -- HOST COMMAND``: nothing after ``--`` is read as an option. A command
    that is not ssh (``--ssh-command``) gets the host and the command as before."""
    said = tmp_path / "argv"
    for name in ("ssh", "my-connect"):
        command = tmp_path / name
        command.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {said}\n')
        command.chmod(0o700)
        feed = NodeFeed(NodeSpec("node1"), ssh=[str(command), "-T"], remote_torchtop="tt")
        with pytest.raises(NodeError):
            feed.connect(timeout=20)
        argv = said.read_text().splitlines()
        head = ["-T", "--", "node1"] if name == "ssh" else ["-T", "node1"]
        assert argv[: len(head)] == head and argv[len(head)].startswith("tt relay")


def test_a_relay_refuses_a_runtime_dir_that_is_not_its_users_own(tmp_path: Path) -> None:
    """A relay reads its node's runtime directory as `ps` does: one that is not the user's own
    private folder (here a symlink) is refused, the reason sent to the viewer, never relayed."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "run").symlink_to(real)
    env = {**os.environ, "TORCHTOP_RUNTIME_DIR": str(tmp_path / "run")}
    out = subprocess.run(
        [sys.executable, "-m", "torchtop", "relay"],
        input=encode(ClientHello(protocol=PROTOCOL_VERSION)), capture_output=True, env=env,
        timeout=60,
    )  # fmt: skip
    assert out.returncode == 1
    refused = decode(out.stdout.splitlines()[0])
    assert isinstance(refused, Refused) and "is not a directory owned by you" in refused.reason
    listen = subprocess.run(
        [sys.executable, "-m", "torchtop", "relay", "--listen", "127.0.0.1:0",
         "--token-file", str(tmp_path / "t.token")],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert listen.returncode == 1
    assert listen.stderr.startswith(f"torchtop: {tmp_path / 'run'} is not a directory owned by you")
