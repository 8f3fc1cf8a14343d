"""Prometheus export against a real Prometheus server that scrapes torchtop every second.

Jobs run under ``torchtop run --headless --metrics 127.0.0.1:0`` (one process) or start their
own agents as ranks and are served by ``torchtop export``. What Prometheus stored is checked
against the recording of the same run: the step count, and the memory gauges of the very
sample each scrape described. ``promtool check metrics`` lints the exposition, and every query
of the Grafana dashboard runs against the stored series.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, SCRIPTS
from tests.prometheus_server import Prometheus
from torchtop.protocol import Sample, StepStats
from torchtop.report.job import summarize
from torchtop.streams.recording import read_recording

pytestmark = pytest.mark.slow

SCRIPT = str(SCRIPTS / "train_metrics.py")
DASHBOARD = REPO / "dashboards" / "torchtop.json"
SERVING = re.compile(r"serving metrics on http://([\d.]+:\d+)/metrics")


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    server = Prometheus(tmp_path_factory.mktemp("prometheus"))
    yield server
    server.stop()


class Torchtop:
    """A ``torchtop`` command running in the background, its stderr collected line by line."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "torchtop", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})},
        )
        self.lines: list[str] = []
        self._address: str | None = None
        self._found = threading.Event()
        self._threads = [
            threading.Thread(target=self._read, args=(stream,), daemon=True)
            for stream in (self.process.stdout, self.process.stderr)
        ]
        for thread in self._threads:
            thread.start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            self.lines.append(line)
            match = SERVING.search(line)
            if match:
                self._address = match.group(1)
                self._found.set()
        self._found.set()

    def address(self) -> str:
        """The ``host:port`` torchtop said it serves on."""
        assert self._found.wait(120), "torchtop never said where it serves"
        assert self._address is not None, "".join(self.lines)
        return self._address

    def wait(self, timeout: float = 180) -> int:
        code = self.process.wait(timeout)
        for thread in self._threads:
            thread.join(5)
        return code


def start_rank(rank: int, world: int, run: str, steps: int) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "TORCHELASTIC_RUN_ID": run,
        "PYTHONWARNINGS": "ignore",
    }
    return subprocess.Popen(
        [sys.executable, SCRIPT, "--start", "--steps", str(steps), "--tail", "3"],
        env=env,
        stdout=subprocess.DEVNULL,
    )


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return str(r.read().decode())


def by_scrape(series: dict[tuple[str, ...], list[Any]]) -> dict[float, float]:
    (values,) = series.values()
    return dict(values)


def test_a_run_scraped_by_prometheus_matches_its_recording(
    prometheus: Prometheus, tmp_path: Path
) -> None:
    record = tmp_path / "r.ttr"
    job = Torchtop(
        "run", "--headless", "--metrics", "127.0.0.1:0", "--record", str(record),
        SCRIPT, "--steps", "60", "--tail", "4",
    )  # fmt: skip
    address = job.address()
    assert address.startswith("127.0.0.1:") and not address.endswith(":0")
    prometheus.scrape(address, test="single")
    # The exposition as a scraper gets it, linted by Prometheus's own tool.
    prometheus.wait_for("torchtop_steps_total", lambda r: r and float(r[0]["value"][1]) > 5)
    exposition = get(f"http://{address}/metrics")
    lint = subprocess.run(
        [shutil.which("promtool") or "promtool", "check", "metrics"],
        input=exposition,
        capture_output=True,
        text=True,
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
    assert job.wait() == 0, "".join(job.lines)

    messages = list(read_recording(record).messages)
    report = summarize(messages)
    assert report["steps"] == 60
    steps = by_scrape(prometheus.samples('torchtop_steps_total{test="single"}'))
    assert len(steps) >= 3, steps
    # The last scrape, after the job's last step, has the recording's count exactly; before
    # that, every scrape shows a count the job had reached, never decreasing.
    values = [v for _, v in sorted(steps.items())]
    assert values[-1] == report["steps"]
    totals = {0} | {m.total for m in messages if isinstance(m, StepStats)}
    assert set(values) <= totals and values == sorted(values)

    # The gauges of each scrape are those of one sample of the recording: the one whose time
    # the scrape carries.
    samples = {m.t: m for m in messages if isinstance(m, Sample)}
    sample_t = by_scrape(
        prometheus.samples('torchtop_last_sample_timestamp_seconds{test="single"}')
    )
    rss = by_scrape(prometheus.samples('torchtop_host_rss_bytes{test="single"}'))
    heap = by_scrape(prometheus.samples('torchtop_cpu_memory_allocated_bytes{test="single"}'))
    assert sample_t.keys() == rss.keys() == heap.keys()
    # The scrapes followed the job's samples (the job's RSS may hold still between them: that
    # it moved made this fail when Prometheus's first stored scrape came after its last change).
    assert len(set(sample_t.values())) > 1
    for scraped_at, t in sample_t.items():
        sample = samples[t]
        assert sample.host is not None
        assert rss[scraped_at] == sample.host.rss_bytes
        (cpu,) = [m for m in sample.memory if m.device == "cpu"]
        assert heap[scraped_at] == cpu.allocated_bytes

    # Step time and data wait over the whole job, at the last scrape (the target is gone now).
    last = max(steps)
    (mean,) = prometheus.query(
        'torchtop_step_duration_seconds_sum{test="single"}'
        ' / torchtop_step_duration_seconds_count{test="single"}',
        at=last,
    )
    assert float(mean["value"][1]) == pytest.approx(report["step_time_s"]["mean"], abs=1e-6)
    (wait,) = prometheus.query('torchtop_dataloader_wait_seconds_total{test="single"}', at=last)
    assert float(wait["value"][1]) == pytest.approx(report["dataloader"]["wait_s"], abs=1e-6)
    labels = mean["metric"]
    assert labels["hostname"] and labels["run"]
    assert "rank" not in labels  # a single process has no rank


def dashboard_queries() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    return [
        (panel["title"], target["expr"])
        for panel in board["panels"]
        for target in panel.get("targets", [])
    ]


def test_a_multi_rank_run_has_one_series_per_rank(prometheus: Prometheus) -> None:
    run = "mr-test"
    steps = {0: 20, 1: 25, 2: 30}
    exporter = Torchtop("export", "--metrics", "127.0.0.1:0", run)
    address = exporter.address()
    prometheus.scrape(address, test="multi")
    ranks = [start_rank(r, len(steps), run, n) for r, n in steps.items()]
    other = start_rank(0, 1, "another-run", 5)  # a job of another run: not exported
    try:
        for p in [*ranks, other]:
            assert p.wait(120) == 0
        finals = prometheus.wait_for(
            'torchtop_steps_total{test="multi"}',
            lambda r: (
                len(r) == len(steps)
                and all(float(s["value"][1]) == steps[int(s["metric"]["rank"])] for s in r)
            ),
        )
        series = prometheus.query('count by (rank) (torchtop_host_rss_bytes{test="multi"})')
        # Every query of the dashboard runs, and those of a CPU job's panels find one series
        # per rank ($run and Grafana's range variables filled in as Grafana would).
        answered = {}
        for title, expr in dashboard_queries():
            expr = (
                expr.replace("$__rate_interval", "15s")
                .replace("$__range", "5m")
                .replace("$run", run)
            )
            answered[title] = {s["metric"].get("rank") for s in prometheus.query(expr)}
    finally:
        exporter.process.send_signal(signal.SIGTERM)
        assert exporter.wait(30) == 0
    assert {s["metric"]["run"] for s in finals} == {run}
    assert {s["metric"]["local_rank"] for s in finals} == {"0", "1", "2"}
    assert sorted(int(s["metric"]["rank"]) for s in series) == [0, 1, 2]
    for title in ("Step time per rank", "Steps per second", "DataLoader wait share", "Host RSS"):
        assert answered[title] == {"0", "1", "2"}, (title, answered)


def test_run_metrics_follows_the_ranks_a_launcher_starts() -> None:
    # Another job of this user, not started by the runner: not the runner's to export.
    other = start_rank(0, 1, "not-ours", 200)
    job = Torchtop(
        "run", "--headless", "--no-ops", "--metrics", "127.0.0.1:0",
        str(SCRIPTS / "launch_ranks.py"), "2", "launched", "15",
    )  # fmt: skip
    try:
        url = f"http://{job.address()}/metrics"
        host = socket.gethostname()
        wanted = {
            f'torchtop_steps_total{{hostname="{host}",local_rank="{rank}",rank="{rank}",'
            f'run="launched"}} {float(15 + 5 * rank)}'
            for rank in (0, 1)
        }
        lines: set[str] = set()
        while job.process.poll() is None and not wanted <= lines:
            lines = set(get(url).splitlines())
            time.sleep(0.2)
        assert wanted <= lines, lines
        assert not any("not-ours" in line for line in lines)
        assert job.wait() == 0, "".join(job.lines)
    finally:
        other.kill()
        other.wait()
        job.process.kill()
