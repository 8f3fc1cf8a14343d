"""What serving metrics costs the job: the agent's overhead with and without an exporter and a
1 s scraper, and a scraper that hangs and floods the endpoint.

1. The agent-overhead measurement of ``benchmarks.agent_overhead`` (a small MLP, agent off and on
   in alternating blocks, a viewer attached) run twice in one process: once as it is, once with
   ``torchtop export --metrics 127.0.0.1:0`` following the job from outside and a scraper
   reading ``/metrics`` every second throughout. The two on/off ratios should agree.
2. With the exporter attached, blocks in which a hostile client on the loopback holds 50
   connections open without finishing a request and sends 1000 scrapes as fast as it can (a
   bounded loop) alternate with quiet blocks, and with control blocks in which the same client
   floods a plain static HTTP server (another process) serving the same bytes. The client and
   the servers take CPU from the job on a small machine whatever they serve; the control shows
   that share, so the torchtop/control ratio is the exporter's own. Reported too: the agent's
   queued bytes for its clients and the job's RSS before and after. The exporter is another
   process and the agent has one bounded queue per client, so neither should move.

    python -m benchmarks.export_overhead            # about 2 minutes
    python -m benchmarks.export_overhead --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

import psutil
import torch

import torchtop
from benchmarks.agent_overhead import block, make_step, measure, mlp
from torchtop.agent import core

SCRAPER = """
import sys, time, urllib.request
url = sys.argv[1]
while True:
    try:
        urllib.request.urlopen(url, timeout=5).read()
    except OSError:
        pass
    time.sleep(1.0)
"""

HOSTILE = """
import socket, sys, urllib.request
host, port = sys.argv[1], int(sys.argv[2])
hanging = []
for _ in range(50):
    s = socket.create_connection((host, port))
    s.sendall(b"GET /metrics HTTP/1.1\\r\\n")  # never finished
    hanging.append(s)
ok = 0
for _ in range(1000):
    try:
        urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5).read()
        ok += 1
    except OSError:
        pass
print(ok, flush=True)
"""


def start_exporter() -> tuple[subprocess.Popen[str], str]:
    """``torchtop export`` following every agent of this benchmark's runtime directory."""
    exporter = subprocess.Popen(
        [sys.executable, "-m", "torchtop", "export", "--metrics", "127.0.0.1:0"],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert exporter.stderr is not None
    line = exporter.stderr.readline()
    match = re.search(r"http://([\d.]+):(\d+)/metrics", line)
    if match is None:
        raise SystemExit(f"the exporter did not start: {line}")
    return exporter, f"{match.group(1)}:{match.group(2)}"


def stop(process: subprocess.Popen[Any]) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def static_server(body: bytes) -> tuple[subprocess.Popen[bytes], str]:
    """A plain HTTP server in another process that serves ``body`` at ``/metrics``."""
    directory = tempfile.mkdtemp(prefix="tt-static-")
    with open(os.path.join(directory, "metrics"), "wb") as f:
        f.write(body)
    port = 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        cwd=directory,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(100):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1).read()
            break
        except OSError:
            time.sleep(0.1)
    return server, f"127.0.0.1:{port}"


def flood_block(step: Any, address: str, seconds: float, agent: Any) -> tuple[list, list, int]:
    """Steps taken while the hostile client runs against ``address`` (at least ``seconds``)."""
    host, port = address.split(":")
    flood = subprocess.Popen(
        [sys.executable, "-c", HOSTILE, host, port], stdout=subprocess.PIPE, text=True
    )
    times: list[float] = []
    queued: list[int] = []
    t0 = time.perf_counter()
    while flood.poll() is None or time.perf_counter() - t0 < seconds:
        times += block(step, 0.1)
        queued.append(agent.server.pending_bytes())
    assert flood.stdout is not None
    return times, queued, int(flood.stdout.read().strip() or 0)


def hostile(address: str, rounds: int, seconds: float) -> dict[str, Any]:
    torch.manual_seed(0)
    step = make_step(*mlp())
    block(step, 1.0)  # warm up
    agent = core.start(ops=False)
    me = psutil.Process()
    time.sleep(2.0)  # the exporter finds the agent and reads its history
    body = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read()
    control, control_address = static_server(body)
    rss_before = me.memory_info().rss
    quiet: list[float] = []
    loud: list[float] = []
    calm: list[float] = []
    queued_quiet: list[int] = []
    queued_loud: list[int] = []
    queued_calm: list[int] = []
    answered = []
    try:
        for _ in range(rounds):
            quiet += block(step, seconds)
            queued_quiet.append(agent.server.pending_bytes())
            times, queued, _ = flood_block(step, control_address, seconds, agent)
            calm += times
            queued_calm += queued
            times, queued, ok = flood_block(step, address, seconds, agent)
            loud += times
            queued_loud += queued
            answered.append(ok)
        rss_after = me.memory_info().rss
        clients = agent.server.client_count
    finally:
        torchtop.stop()
        stop(control)
    median = statistics.median
    result = {
        "median_step_quiet_ms": median(quiet) * 1e3,
        "median_step_control_flood_ms": median(calm) * 1e3,
        "median_step_torchtop_flood_ms": median(loud) * 1e3,
        "ratio_flood_vs_quiet": median(loud) / median(quiet),
        "ratio_flood_vs_control": median(loud) / median(calm),
        "max_queued_bytes_quiet": max(queued_quiet),
        "max_queued_bytes_control": max(queued_calm),
        "max_queued_bytes_flood": max(queued_loud),
        "job_rss_before_mib": rss_before / 2**20,
        "job_rss_after_mib": rss_after / 2**20,
        "agent_clients": clients,
        "scrapes_answered_of_1000": answered,
    }
    print(
        f"hostile scraper: step {result['median_step_quiet_ms']:.3f} ms quiet,"
        f" {result['median_step_control_flood_ms']:.3f} ms flooding a static server,"
        f" {result['median_step_torchtop_flood_ms']:.3f} ms flooding torchtop"
        f" (torchtop/control {result['ratio_flood_vs_control']:.4f},"
        f" torchtop/quiet {result['ratio_flood_vs_quiet']:.4f});"
        f" agent queued bytes max {result['max_queued_bytes_quiet']} quiet,"
        f" {result['max_queued_bytes_control']} flooding the static server,"
        f" {result['max_queued_bytes_flood']} flooding torchtop; job RSS"
        f" {result['job_rss_before_mib']:.1f} -> {result['job_rss_after_mib']:.1f} MiB;"
        f" scrapes answered per flood {answered}",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true", help="print the results as JSON at the end")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rounds, seconds = (3, 0.5) if args.quick else (15, 1.0)
    # Agents of this benchmark only: the exporter must not follow other jobs of this user.
    os.environ["TORCHTOP_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="tt-bench-") + "/run"
    print("agent overhead without an exporter:", flush=True)
    without = measure("mlp", mlp, rounds, seconds, ops=False, self_measure=False)
    exporter, address = start_exporter()
    scraper = subprocess.Popen([sys.executable, "-c", SCRAPER, f"http://{address}/metrics"])
    try:
        print(f"with torchtop export on {address} and a 1 s scraper:", flush=True)
        with_exporter = measure("mlp", mlp, rounds, seconds, ops=False, self_measure=False)
        stop(scraper)
        flood = hostile(address, max(3, rounds // 3), seconds)
    finally:
        stop(scraper)
        stop(exporter)
    print(
        f"on/off ratio without exporter {without['ratio']:.4f},"
        f" with exporter and 1 s scrape {with_exporter['ratio']:.4f}",
        flush=True,
    )
    if args.json:
        print(json.dumps({"without": without, "with": with_exporter, "hostile": flood}, indent=2))


if __name__ == "__main__":
    main()
