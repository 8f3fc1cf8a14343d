"""The agent over a long job: its memory, and a storm of viewers' hellos against the step rate.

One process trains a small MLP on one CPU thread with the agent at its defaults (op sampling
on) and a viewer process attached all along. Every 15 s it records its RSS and the bytes the
agent's history and client queues hold. Three times (after the first minute, half-way, and at
the end) a separate process sends 1,000 hellos (connect, hello, close, from 8 threads at once),
three times, and the job's steps per second from the storm's start (over at least 3 s: the
agent's work may outlast the storm) are compared with the steps per second just before, and
with those during the same storm sent to a listener of the storm process's own (the control: on
a machine with few cores the storm's own threads take CPU from the job, agent or not), and the
CPU seconds the agent's I/O thread spent on it (robust where steps/s are not, on a busy
machine). Reported: RSS growth beyond the first minute (in all, and per hour by a least-squares
fit), the history's and queues' bytes, and the steps/s ratios during the storms.

    python -m benchmarks.agent_soak --minutes 30     # the README's figures
    python -m benchmarks.agent_soak --minutes 2      # a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import psutil
import torch
from torch import nn

from benchmarks.agent_overhead import attach_viewer, make_step
from torchtop.agent import core

#: The storm: this many hellos from this many threads, each its own connection.
HELLOS = 1000
THREADS = 8
#: Storms at the agent (each after one at the control listener) per measurement; medians.
ROUNDS = 3
#: Seconds of steps/s measured from the start of each storm, at least.
WINDOW_S = 3.0
#: Seconds of steps/s measured before each storm.
BEFORE_S = 10.0
#: Seconds between two memory readings, and the time after which growth is counted.
MEMORY_EVERY_S = 15.0
WARM_S = float(os.environ.get("SOAK_WARM_S", "60"))

STORM = """
import socket, sys, threading, time
from torchtop.protocol import PROTOCOL_VERSION, ClientHello, encode
path, hellos, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if path == "-":  # the control: a listener of our own that reads each hello and closes
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(sys.argv[4])
    listener.listen(socket.SOMAXCONN)
    path = sys.argv[4]
    def serve():
        while True:
            conn, _ = listener.accept()
            conn.recv(4096)
            conn.close()
    threading.Thread(target=serve, daemon=True).start()
hello = encode(ClientHello(protocol=PROTOCOL_VERSION))
failed = []
def run(n):
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(path)
            s.sendall(hello)
        except OSError as exc:
            failed.append(exc)
        finally:
            s.close()
workers = [threading.Thread(target=run, args=(hellos // threads,)) for _ in range(threads)]
print("ready", flush=True)
sys.stdin.readline()
began = time.monotonic()
for w in workers: w.start()
for w in workers: w.join()
print(len(failed), time.monotonic() - began, flush=True)
"""


def small_mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """Steps of about a millisecond: a storm of a fraction of a second spans hundreds."""
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    return model, torch.randn(32, 64), torch.randint(0, 10, (32,))


def train_while(step, going) -> tuple[int, float]:  # type: ignore[no-untyped-def]
    """Train while ``going()``; the steps taken and the seconds they took. (Counts only: a
    list of step times would grow the job's memory, which this benchmark measures.)"""
    began = time.monotonic()
    steps = 0
    while going():
        step()
        steps += 1
    return steps, time.monotonic() - began


def train_for(step, seconds: float) -> tuple[int, float]:  # type: ignore[no-untyped-def]
    end = time.monotonic() + seconds
    return train_while(step, lambda: time.monotonic() < end)


def one_storm(step, path: str, *control: str) -> tuple[float, float, int]:  # type: ignore[no-untyped-def]
    """Steps/s from the signal to go (given once the storm process has started and built its
    threads) to the storm's exit or ``WINDOW_S`` later, whichever is last (the agent's work
    on the storm may outlast it); the storm's length, and the hellos that failed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", STORM, path, str(HELLOS), str(THREADS), *control],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    proc.stdin.write("go\n")
    proc.stdin.flush()
    until = time.monotonic() + WINDOW_S
    steps, seconds = train_while(step, lambda: proc.poll() is None or time.monotonic() < until)
    failed, length = proc.stdout.read().split()
    return steps / seconds if seconds > 0 else 0.0, float(length), int(failed)


def server_cpu_s() -> float:
    """CPU seconds the agent's I/O thread has used (its work holds the job's GIL)."""
    for thread in threading.enumerate():
        if thread.name == "torchtop-server" and thread.native_id is not None:
            with open(f"/proc/self/task/{thread.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return 0.0


def storm(step, path: str) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Steps/s before, during a storm of hellos at the agent, and during the same storm at a
    listener of the storm process's own (the control: the same load on the machine's CPUs,
    without the agent's work). The job trains all along."""
    steps, seconds = train_for(step, BEFORE_S)
    before = steps / seconds
    control_path = f"{path}.control"
    controls, durings, lengths, cpus, failed = [], [], [], [], 0
    for _ in range(ROUNDS):
        with contextlib.suppress(OSError):
            os.unlink(control_path)
        controls.append(one_storm(step, "-", control_path)[0])
        cpu = server_cpu_s()
        rate, length, lost = one_storm(step, path)
        cpus.append(server_cpu_s() - cpu)
        durings.append(rate)
        lengths.append(length)
        failed += lost
    with contextlib.suppress(OSError):
        os.unlink(control_path)
    control, during = statistics.median(controls), statistics.median(durings)
    return {
        "storm_s": round(statistics.median(lengths), 2),
        "hellos_failed": failed,
        # Robust where steps/s are not (a shared machine): the agent's own work on the storm.
        "agent_io_cpu_s": round(statistics.median(cpus), 3),
        "steps_per_s_before": round(before, 1),
        "steps_per_s_control": round(control, 1),
        "steps_per_s_during": round(during, 1),
        "ratio_to_before": round(during / before, 3) if before else 0.0,
        "ratio_to_control": round(during / control, 3) if control else 0.0,
    }


def slope_per_hour(points: list[tuple[float, int]]) -> float:
    """Least-squares slope of (seconds, bytes), in bytes per hour."""
    if len(points) < 2:
        return 0.0
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var * 3600


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--no-ops", action="store_true", help="op sampling off (a comparison)")
    args = parser.parse_args()
    total_s = args.minutes * 60

    torch.set_num_threads(1)
    torch.manual_seed(0)
    step = make_step(*small_mlp())
    agent = core.start(ops=not args.no_ops)
    viewer = attach_viewer(agent.info.address)
    process = psutil.Process()
    start = time.monotonic()
    memory: list[dict[str, float]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(MEMORY_EVERY_S):
            memory.append(
                {
                    "t": time.monotonic() - start,
                    "rss": process.memory_info().rss,
                    "history": agent.server.history_bytes(),
                    "queued": agent.server.pending_bytes(),
                }
            )

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    storms = []
    try:
        train_for(step, WARM_S)
        storms.append(storm(step, agent.info.socket_path))
        train_for(step, max(0.0, start + total_s / 2 - time.monotonic()))
        storms.append(storm(step, agent.info.socket_path))
        train_for(step, max(0.0, start + total_s - time.monotonic() - BEFORE_S - 5))
        storms.append(storm(step, agent.info.socket_path))
    finally:
        stop.set()
        viewer.kill()
    windows = agent.ops.windows if agent.ops is not None else 0
    core.stop()

    full_s = agent.config.history_s + WARM_S
    after_warm = [(m["t"], int(m["rss"])) for m in memory if m["t"] >= WARM_S]
    base = after_warm[0][1] if after_warm else 0
    result = {
        "minutes": round((time.monotonic() - start) / 60, 1),
        "op_windows": windows,
        "rss_after_first_minute_mb": round(base / 2**20, 1),
        "rss_growth_beyond_first_minute_mb": round(
            (max(r for _t, r in after_warm) - base) / 2**20 if after_warm else 0.0, 2
        ),
        "rss_growth_end_mb": round((after_warm[-1][1] - base) / 2**20 if after_warm else 0.0, 2),
        "rss_growth_per_hour_mb": round(slope_per_hour(after_warm) / 2**20, 2),
        # Once the history holds its whole time span (history_s), it only turns over.
        "rss_growth_per_hour_once_history_full_mb": round(
            slope_per_hour([(t, r) for t, r in after_warm if t >= full_s]) / 2**20, 2
        ),
        "history_mb_max": round(max((m["history"] for m in memory), default=0) / 2**20, 2),
        "queued_mb_max": round(max((m["queued"] for m in memory), default=0) / 2**20, 2),
        "storms": storms,
        "memory_every_15s": [
            [round(m["t"]), round(m["rss"] / 2**20, 1), round(m["history"] / 2**20, 2)]
            for m in memory
        ],
        "storm_ratio_to_control_median": statistics.median(s["ratio_to_control"] for s in storms),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
