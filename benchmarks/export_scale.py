"""What ``torchtop export`` costs at scale: one exporter serving N simulated ranks of a run.

The ranks are the fleet simulator's (:mod:`benchmarks.fleet`, in a process of its own, on one
node), replaying a real recording; ``torchtop export --run sim`` follows them all, as a node's
exporter would. Measured once every rank is exported: the time of a scrape of ``/metrics``
(median and slowest of ``--scrapes``), the response's size and number of series, and the
exporter's memory (RSS) and CPU over the measured span, as a share of one core.

    python -m benchmarks.export_scale --from r.ttr --ranks 256
    python -m benchmarks.export_scale --from r.ttr --ranks 1024 --scrapes 100

The scrape time's p95 and the exporter's largest RSS in the first and the last third of the
scrapes are printed too (``--scrapes 1800`` is a 30-minute soak), and what ``promtool check
metrics`` says of the last scrape where promtool is installed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent


def scrape(url: str) -> tuple[float, bytes]:
    began = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as response:
        body: bytes = response.read()
    return time.perf_counter() - began, body


def percentile(values: list[float], q: float) -> float:
    return sorted(values)[max(0, round(q * len(values)) - 1)]


def promtool_check(body: bytes) -> str:
    """What ``promtool check metrics`` says of a scrape (Prometheus's own linter)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        return "promtool check metrics: skipped (no promtool; Debian's prometheus package has it)"
    out = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True)
    said = (out.stdout + out.stderr).decode(errors="replace").strip()
    verdict = "passed" if out.returncode == 0 and not said else f"rc {out.returncode}"
    return f"promtool check metrics: {verdict}" + (f": {said[:500]}" if said else "")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--from", dest="source", type=Path, required=True)
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--scrapes", type=int, default=10)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between scrapes")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fleet-", dir="/tmp") as root:
        node = Path(root) / "node0"
        fleet = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.fleet", "--from", str(args.source),
             "--ranks", str(args.ranks), "--nodes", "1", "--root", root, "--seconds", "3600"],
            cwd=REPO,
        )  # fmt: skip
        exporter = None
        try:
            began = time.monotonic()
            while len(list(node.glob("*.sock"))) < args.ranks:
                if fleet.poll() is not None:
                    raise SystemExit("the fleet simulator ended before its ranks were up")
                time.sleep(0.2)
            print(f"{args.ranks} ranks up in {time.monotonic() - began:.1f} s", file=sys.stderr)
            env = {**os.environ, "TORCHTOP_RUNTIME_DIR": str(node)}
            exporter = subprocess.Popen(
                [sys.executable, "-m", "torchtop", "export", "sim", "--metrics", "127.0.0.1:0"],
                env=env, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            assert exporter.stderr is not None
            url = ""
            while not url:
                line = exporter.stderr.readline()
                if not line:
                    raise SystemExit("the exporter ended before it served")
                found = re.search(r"serving metrics on (\S+)", line)
                url = found[1] if found else ""
            began = time.monotonic()
            while True:
                _s, body = scrape(url)
                exported = len(set(re.findall(rb'[{,]rank="(\d+)"', body)))
                if exported >= args.ranks:
                    break
                if time.monotonic() - began > 600:
                    raise SystemExit(f"only {exported} of {args.ranks} ranks exported")
                time.sleep(1.0)
            print(f"all exported after {time.monotonic() - began:.1f} s", file=sys.stderr)
            me = psutil.Process(exporter.pid)
            cpu0, wall0 = sum(me.cpu_times()[:2]), time.monotonic()
            times: list[float] = []
            rss: list[int] = []
            said = time.monotonic()
            for i in range(args.scrapes):
                took, body = scrape(url)
                times.append(took)
                rss.append(me.memory_info().rss)
                if time.monotonic() - said >= 60.0:  # progress, for the long runs
                    said = time.monotonic()
                    print(
                        f"{i + 1} of {args.scrapes} scrapes: p95 so far "
                        f"{1000 * percentile(times, 0.95):.0f} ms, exporter RSS "
                        f"{rss[-1] / 2**20:.0f} MiB",
                        file=sys.stderr,
                        flush=True,
                    )
                time.sleep(args.interval)
            cpu = sum(me.cpu_times()[:2]) - cpu0
            wall = time.monotonic() - wall0
            series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
            p95 = percentile(times, 0.95)
            third = max(1, len(rss) // 3)
            print(
                f"export of {args.ranks} ranks: scrape median {1000 * statistics.median(times):.0f}"
                f" ms, p95 {1000 * p95:.0f} ms, slowest {1000 * max(times):.0f} ms; "
                f"{len(body) / 1e6:.2f} MB, {series} series; exporter RSS "
                f"{me.memory_info().rss / 2**20:.0f} MiB (largest in the first third of the "
                f"scrapes {max(rss[:third]) / 2**20:.0f} MiB, in the last "
                f"{max(rss[-third:]) / 2**20:.0f} MiB), CPU {100 * cpu / wall:.1f}% of a core "
                f"({args.scrapes} scrapes, {args.interval} s apart)"
                + (
                    f"; p95 of the first 100 scrapes {1000 * percentile(times[:100], 0.95):.0f} ms"
                    if len(times) > 100
                    else ""
                )
            )
            print(promtool_check(body))
        finally:
            if exporter is not None:
                exporter.terminate()
                exporter.wait()
            fleet.terminate()
            fleet.wait()


if __name__ == "__main__":
    main()
