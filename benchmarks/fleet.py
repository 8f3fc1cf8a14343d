"""A fleet of simulated ranks, for benchmarks and tests at a scale this machine cannot train at.

Each simulated rank is served by the agent's own socket server (:class:`AgentServer`, the real
protocol, history and client queues) with the frames of a real recording: its hello names the
rank's pid, rank, node and run, and every time in its frames is moved to now (the recording is
replayed in a loop, the step totals going on from one loop to the next). Each rank owns a pid
(a ``sleep`` process, so ``ps``, the scans and the liveness checks see a live process), and the
ranks are grouped into simulated nodes, each with a runtime directory of its own: point
``TORCHTOP_RUNTIME_DIR`` at ``ROOT/node<N>`` to see that node's ranks as a viewer, ``ps``, an
exporter or a relay there would.

Each rank's process is the one that listens on its socket (it calls ``listen`` before it
becomes ``sleep``), so a viewer that asks the socket who serves it (``SO_PEERCRED``) finds the
rank's own process, as it would find a real agent's job: it reads that process from outside,
and sees it gone when the rank is killed. As an agent does, a rank then sends the RSS alone of
its host's figures while its viewers read the rest from outside.

A straggler (its steps ``--slow`` times longer outside backward; ``--synced``: the other ranks
wait for it inside backward, as the ranks of a synchronous job do, so their steps last as long
as its), a hang (no step after ``--hang-after`` seconds; its samples go on) and a dead rank (its
process killed and its server closed after ``--dead-after`` seconds) can be injected. The
straggler slows from the start, or at ``--straggle-after`` seconds; ``SIGUSR1`` slows it at
once and ``SIGUSR2`` kills the dead rank at once, and each injection's wall-clock time is
printed (``fleet: injected ... at T``) so that a benchmark can time what a viewer makes of it.

    python -m benchmarks.fleet --from r.ttr --ranks 64 --nodes 8 --root /tmp/fleet --seconds 60
    python -m benchmarks.fleet --from r.ttr --ranks 8 --straggler 3 --hang 5 --dead 7
    python -m benchmarks.fleet --from r.ttr --ranks 64 --straggler 5 --synced --straggle-after 1e9

Record the source with ``torchtop run --headless --record r.ttr SCRIPT`` (one process).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import heapq
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from torchtop.agent.server import EVENTS, LOGS, OPS, SAMPLES, AgentServer, RingLimit
from torchtop.protocol import (
    PACED_SAMPLE_S,
    AgentStats,
    GpuSample,
    Hello,
    JobExited,
    LoaderInfo,
    LogLine,
    Message,
    OpsWindow,
    Sample,
    StepStats,
    encode,
)
from torchtop.streams.recording import read_recording
from torchtop.transport import AgentInfo, describe_agent, ensure_runtime_dir, socket_path_for

#: History each simulated rank keeps (frames, bytes), as an agent's rings do at their defaults.
RINGS = {
    SAMPLES: RingLimit(frames=6_000, bytes=8 << 20),
    EVENTS: RingLimit(frames=10_000, bytes=4 << 20),
    LOGS: RingLimit(frames=2_000, bytes=1 << 20),
    OPS: RingLimit(frames=500, bytes=1 << 20),
}
#: The fields of a frame that are wall-clock times.
TIME_FIELDS = ("t", "started_at")


def ring_of(message: Message) -> str:
    """The history ring an agent keeps ``message`` in."""
    if isinstance(message, (Sample, GpuSample, AgentStats, StepStats, LoaderInfo)):
        return SAMPLES
    if isinstance(message, LogLine):
        return LOGS
    if isinstance(message, OpsWindow):
        return OPS
    return EVENTS


def moved(
    message: Message, dt: float, steps_before: int, slow: float = 1.0, held: float = 1.0
) -> Message:
    """``message`` with its times moved by ``dt`` and its step totals by ``steps_before``; a
    straggler's steps (``slow`` > 1) last longer outside backward, and those of a rank a
    straggler ``held`` times slower holds back last as long, the extra time inside backward
    (waiting at the gradients' all-reduce)."""
    changes: dict[str, object] = {
        f.name: getattr(message, f.name) + dt
        for f in dataclasses.fields(message)
        if f.name in TIME_FIELDS and isinstance(getattr(message, f.name), float)
    }
    if isinstance(message, StepStats):
        changes["ends"] = [end + dt for end in message.ends]
        changes["total"] = message.total + steps_before
        if slow != 1.0:
            backward = message.backward_s
            changes["time_s"] = backward + (message.time_s - backward) * slow
            changes["durations"] = [
                None if d is None else b + (d - b) * slow
                for d, b in zip(
                    message.durations,
                    message.backwards or [0.0] * len(message.durations),
                    strict=False,
                )
            ]
        elif held != 1.0:
            backward = message.backward_s
            extra = [
                0.0 if d is None else (d - b) * (held - 1.0)
                for d, b in zip(
                    message.durations,
                    message.backwards or [0.0] * len(message.durations),
                    strict=False,
                )
            ]
            waited = (message.time_s - backward) * (held - 1.0)
            changes["time_s"] = message.time_s + waited
            changes["backward_s"] = backward + waited
            changes["durations"] = [
                None if d is None else d + e for d, e in zip(message.durations, extra, strict=True)
            ]
            if message.backwards:
                changes["backwards"] = [
                    b + e for b, e in zip(message.backwards, extra, strict=False)
                ]
    return dataclasses.replace(message, **changes)


def as_sent(sample: Sample, server: AgentServer) -> Sample:
    """``sample`` as an agent sends it: the RSS alone of its host's figures while every viewer
    reads the rest from outside the job (as they read it here, from the rank's process)."""
    host = sample.host
    if host is None or not server.read_outside("host"):
        return sample
    rss_only = dataclasses.replace(
        host, cpu_percent=None, threads=None, children=None, system_used_bytes=None,
        system_total_bytes=None,
    )  # fmt: skip
    return dataclasses.replace(sample, host=rss_only)


@dataclass
class SimulatedRank:
    rank: int
    node: int
    sleeper: subprocess.Popen[bytes]
    server: AgentServer
    hello: Hello
    slow: float = 1.0
    hangs_at: float | None = None
    dies_at: float | None = None
    dead: bool = False
    frames: int = 0
    #: When this rank's next sample goes to viewers at their own pace, as an agent does.
    next_paced_sample: float = 0.0

    @property
    def pid(self) -> int:
        return self.sleeper.pid


@dataclass
class Fleet:
    """``ranks`` simulated ranks on ``nodes`` nodes under ``root``, replaying ``source``."""

    source: Path
    ranks: int
    nodes: int
    root: Path
    run_id: str = "sim"
    straggler: int | None = None
    slow: float = 1.3
    hang: int | None = None
    hang_after_s: float = 20.0
    dead: int | None = None
    dead_after_s: float = 20.0
    #: The straggler holds the other ranks back (they wait for it inside backward).
    synced: bool = False
    #: Seconds after the start when the straggler slows (None: from the start).
    straggle_after_s: float | None = None
    members: list[SimulatedRank] = field(default_factory=list)
    #: Wall-clock time of each injection as it happened: "straggler", "dead", "hang".
    injected: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        contents = read_recording(self.source)
        hellos = [m for m in contents.messages if isinstance(m, Hello)]
        if not hellos:
            raise ValueError(f"{self.source} has no hello: record one process's job")
        self._hello = hellos[0]
        self._frames = [m for m in contents.messages if not isinstance(m, (Hello, JobExited))]
        times = [getattr(m, "t", None) for m in self._frames]
        stamped = [t for t in times if isinstance(t, float)]
        if not stamped:
            raise ValueError(f"{self.source} has no timed frames")
        self._t0, self._t1 = min(stamped), max(stamped)
        steps = [m.total for m in self._frames if isinstance(m, StepStats)]
        self.steps_per_loop = max(steps, default=0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._replay, name="fleet", daemon=True)
        #: When the straggler slows (``straggle_after_s``), until it has.
        self._straggles_at: float | None = None

    def node_dir(self, node: int) -> Path:
        return self.root / f"node{node}"

    def start(self) -> Fleet:
        per_node = max(1, -(-self.ranks // self.nodes))
        now = time.time()
        for rank in range(self.ranks):
            node = rank // per_node
            identity = {
                "rank": rank,
                "local_rank": rank % per_node,
                "world_size": self.ranks,
                "node_rank": node,
                "run_id": self.run_id,
            }
            listener, sleeper = self._listen(self.node_dir(node), identity, now)
            hello = dataclasses.replace(
                self._hello,
                pid=sleeper.pid,
                started_at=now,
                hostname=f"node{node}",
                **identity,  # type: ignore[arg-type]
            )
            server = AgentServer(listener, functools.partial(bytes, encode(hello)), rings=RINGS)
            server.start()
            member = SimulatedRank(rank, node, sleeper, server, hello)
            if rank == self.straggler and self.straggle_after_s is None:
                member.slow = self.slow
            if rank == self.hang:
                member.hangs_at = now + self.hang_after_s
            if rank == self.dead:
                member.dies_at = now + self.dead_after_s
            self.members.append(member)
        if self.straggler is not None and self.straggle_after_s is not None:
            self._straggles_at = now + self.straggle_after_s
        self._thread.start()
        return self

    def _listen(
        self, directory: Path, identity: dict[str, object], now: float
    ) -> tuple[socket.socket, subprocess.Popen[bytes]]:
        """A rank's socket (as an agent's, :func:`~torchtop.transport.bind_server`) and its
        process, which is the one that listens on it: a client's ``SO_PEERCRED`` names the
        process at its ``listen``, so the viewer finds the rank's own process there, not the
        fleet's. The socket is bound under a name of its own, then given the rank's pid's."""
        previous = os.environ.get("TORCHTOP_RUNTIME_DIR")
        os.environ["TORCHTOP_RUNTIME_DIR"] = str(directory)
        try:
            ensure_runtime_dir()
        finally:
            if previous is None:
                os.environ.pop("TORCHTOP_RUNTIME_DIR", None)
            else:
                os.environ["TORCHTOP_RUNTIME_DIR"] = previous
        bound = directory / f".fleet-{identity['rank']}.sock"
        bound.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(bound))
        os.chmod(bound, 0o600)
        # In the child, between fork and exec: the one system call (the socket is the same).
        sleeper = subprocess.Popen(
            ["sleep", "1000000"],
            preexec_fn=functools.partial(listener.listen, socket.SOMAXCONN),
        )
        path = socket_path_for(sleeper.pid, directory)
        os.replace(bound, path)
        listener.setblocking(False)
        info = AgentInfo(
            pid=sleeper.pid,
            argv=list(self._hello.argv),
            started_at=now,
            address=f"unix:{path}",
            cwd=os.getcwd(),
            identity=dict(identity),  # type: ignore[arg-type]
        )
        describe_agent(info, directory)
        return listener, sleeper

    def slow_down(self) -> None:
        """Inject the straggler now (from any thread, a signal handler)."""
        for member in self.members:
            if member.rank == self.straggler and member.slow == 1.0:
                self._straggles_at = None
                member.slow = self.slow
                self.injected["straggler"] = time.time()

    def kill_dead(self) -> None:
        """Kill the dead rank at its next frame (from any thread, a signal handler)."""
        for member in self.members:
            if member.rank == self.dead and not member.dead:
                member.dies_at = time.time()

    def _schedule(self, start: float) -> Iterator[tuple[float, int, Message]]:
        """(when, loop, frame) for every frame of every loop, in time order."""
        length = max(self._t1 - self._t0, 1.0)
        loop = 0
        while True:
            for message in self._frames:
                t = getattr(message, "t", None)
                offset = (t - self._t0) if isinstance(t, float) else 0.0
                yield start + loop * length + offset, loop, message
            loop += 1

    def _replay(self) -> None:
        start = time.time()
        length = max(self._t1 - self._t0, 1.0)
        gens = [self._schedule(start) for _ in self.members]
        order = iter(range(1 << 62))  # ties in time keep each rank's frame order
        pending: list[tuple[float, int, int, int, Message]] = []
        for i, gen in enumerate(gens):
            when, loop, message = next(gen)
            heapq.heappush(pending, (when, next(order), i, loop, message))
        while not self._stop.is_set() and pending:
            when, _n, i, loop, message = heapq.heappop(pending)
            wait = when - time.time()
            if wait > 0 and self._stop.wait(wait):
                return
            member = self.members[i]
            now = time.time()
            straggles_at = self._straggles_at
            if straggles_at is not None and now >= straggles_at:
                self.slow_down()
            if member.dies_at is not None and now >= member.dies_at and not member.dead:
                self._kill(member)
            if member.dead:
                continue
            hung = member.hangs_at is not None and now >= member.hangs_at
            if hung and "hang" not in self.injected:
                self.injected["hang"] = now
            if not (hung and isinstance(message, StepStats)):
                dt = (start + loop * length) - self._t0
                out = moved(
                    message, dt, loop * self.steps_per_loop, member.slow, self._held(member)
                )
                detail_only = False
                if isinstance(out, Sample):  # viewers at their own pace get one a second
                    out = as_sent(out, member.server)
                    detail_only = out.t < member.next_paced_sample
                    if not detail_only:
                        member.next_paced_sample = out.t + PACED_SAMPLE_S
                member.server.publish(encode(out), ring_of(out), detail_only=detail_only)
                member.frames += 1
            when, loop, message = next(gens[i])
            heapq.heappush(pending, (when, next(order), i, loop, message))

    def _held(self, member: SimulatedRank) -> float:
        """How much longer a rank's steps last for waiting on the straggler (synced only)."""
        if not self.synced or member.rank == self.straggler or self.straggler is None:
            return 1.0
        return max((m.slow for m in self.members if m.rank == self.straggler), default=1.0)

    def _kill(self, member: SimulatedRank) -> None:
        """As a rank killed dies: its process first, then (as the kernel does at its exit)
        its connections."""
        member.dead = True
        self.injected["dead"] = time.time()
        member.sleeper.kill()
        member.sleeper.wait()
        member.server.stop(drain_s=0.0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        for member in self.members:
            if not member.dead:
                member.sleeper.kill()
                member.sleeper.wait()
                member.server.stop(drain_s=0.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", type=Path, required=True)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--root", type=Path, default=Path(f"/tmp/torchtop-fleet-{os.getuid()}"))
    parser.add_argument("--run-id", default="sim")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--straggler", type=int)
    parser.add_argument("--slow", type=float, default=1.3)
    parser.add_argument("--hang", type=int)
    parser.add_argument("--hang-after", type=float, default=20.0)
    parser.add_argument("--dead", type=int)
    parser.add_argument("--dead-after", type=float, default=20.0)
    parser.add_argument("--synced", action="store_true", help="the others wait for the straggler")
    parser.add_argument("--straggle-after", type=float, help="seconds before the straggler slows")
    parser.add_argument(
        "--events", type=Path, help="write each injection's wall-clock time here (JSON) at the end"
    )
    args = parser.parse_args(argv)
    fleet = Fleet(
        args.source, args.ranks, args.nodes, args.root, args.run_id,
        args.straggler, args.slow, args.hang, args.hang_after, args.dead, args.dead_after,
        synced=args.synced, straggle_after_s=args.straggle_after,
    ).start()  # fmt: skip
    signal.signal(signal.SIGUSR1, lambda *_: fleet.slow_down())
    signal.signal(signal.SIGUSR2, lambda *_: fleet.kill_dead())
    print(
        f"fleet: {args.ranks} ranks on {args.nodes} nodes under {args.root} "
        f"(TORCHTOP_RUNTIME_DIR={fleet.node_dir(0)} for node 0)",
        file=sys.stderr,
        flush=True,
    )
    # Stopped like Ctrl-C: every rank's server closed and its process killed, none left behind.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    began = time.monotonic()
    try:
        time.sleep(args.seconds)
    except KeyboardInterrupt:
        pass
    finally:
        fleet.stop()
    frames = sum(m.frames for m in fleet.members)
    took = time.monotonic() - began
    for name, at in sorted(fleet.injected.items(), key=lambda item: item[1]):
        print(f"fleet: injected {name} at {at:.3f}", file=sys.stderr)
    if args.events is not None:
        args.events.write_text(json.dumps(fleet.injected))
    print(f"fleet: served {frames} frames in {took:.0f} s ({frames / took:.0f}/s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
