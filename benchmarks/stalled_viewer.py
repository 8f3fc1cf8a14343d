"""A viewer that stops reading must cost the job nothing: connected against stalled against killed.

One process trains a small MLP with the agent on and a viewer process attached. The viewer reads
normally, then is stopped with SIGSTOP for 30 s, then is killed. For each stage the script reports
the median step time (as a ratio to the reading stage), the agent's queued bytes and the job's
RSS, so a stalled viewer shows up as neither a slower job nor a growing agent.

    python -m benchmarks.stalled_viewer           # about 55 s
    python -m benchmarks.stalled_viewer --quick
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import time

import psutil
import torch

import torchtop
from benchmarks.agent_overhead import attach_viewer, make_step, mlp
from torchtop.agent import core


def stage(step, agent, seconds: float) -> dict[str, float]:  # type: ignore[no-untyped-def]
    times: list[float] = []
    queued: list[int] = []
    process = psutil.Process()
    rss_before = process.memory_info().rss
    end = time.perf_counter() + seconds
    next_probe = 0.0
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        if t0 >= next_probe:
            queued.append(agent.server.pending_bytes())
            next_probe = t0 + 0.25
    return {
        "median_step_ms": statistics.median(times) * 1e3,
        "steps": len(times),
        "max_queued_bytes": max(queued),
        "rss_growth_bytes": process.memory_info().rss - rss_before,
        "dropped": agent.server.total_dropped(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    reading_s, stalled_s, killed_s = (3.0, 5.0, 3.0) if args.quick else (10.0, 30.0, 10.0)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    step = make_step(*mlp())
    agent = core.start()
    viewer = attach_viewer(agent.info.address)
    time.sleep(1.0)
    stage(step, agent, 1.0)  # warm up
    results = {"reading": stage(step, agent, reading_s)}
    os.kill(viewer.pid, signal.SIGSTOP)
    results["stalled"] = stage(step, agent, stalled_s)
    os.kill(viewer.pid, signal.SIGCONT)
    viewer.kill()
    viewer.wait()
    results["killed"] = stage(step, agent, killed_s)
    torchtop.stop()
    base = results["reading"]["median_step_ms"]
    for name, r in results.items():
        r["ratio_to_reading"] = r["median_step_ms"] / base
        print(
            f"{name:8s} step {r['median_step_ms']:7.3f} ms  ratio {r['ratio_to_reading']:.4f}"
            f"  max queued {r['max_queued_bytes'] / 1024:8.1f} KiB"
            f"  RSS growth {r['rss_growth_bytes'] / 1024:8.1f} KiB  dropped {r['dropped']}",
            flush=True,
        )
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
