"""A real Prometheus server for the exporter tests, on 127.0.0.1, scraping every second.

Debian's ``prometheus`` package (``make setup`` installs it where missing, as root). The config
is generated: one ``torchtop`` job whose targets come from a file the test writes once it knows
the port torchtop chose (``file_sd``, which Prometheus watches), so one server serves a module.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

SKIP_REASON = (
    "Prometheus is not installed: `make setup` installs Debian's prometheus package when run "
    "as root (apt-get install prometheus)"
)

CONFIG = """\
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: torchtop
    file_sd_configs:
      - files: ["{targets}"]
        refresh_interval: 1s
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    """One Prometheus process and its HTTP API."""

    def __init__(self, directory: Path, *args: str) -> None:
        """``args``: more of Prometheus's flags (``--query.lookback-delta=5s``)."""
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.skip(SKIP_REASON)
        self.directory = directory
        self.targets = directory / "targets.json"
        self.targets.write_text("[]")
        config = directory / "prometheus.yml"
        config.write_text(CONFIG.format(targets=self.targets))
        self.port = free_port()
        self.log = open(directory / "prometheus.log", "wb")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
                *args,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log_text()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"prometheus did not become ready: {self.log_text()}")

    def log_text(self) -> str:
        self.log.flush()
        return (self.directory / "prometheus.log").read_text(errors="replace")[-2000:]

    def scrape(self, *addresses: str, **labels: str) -> None:
        """Scrape these ``host:port`` targets from now on (and no others)."""
        groups = [{"targets": list(addresses), "labels": labels}] if addresses else []
        tmp = self.targets.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        tmp.replace(self.targets)

    def api(self, path: str, **params: Any) -> Any:
        query = urllib.parse.urlencode({k: str(v) for k, v in params.items()})
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = at
        data = self.api("query", **params)
        return list(data["result"])

    def samples(self, expr: str, window_s: int = 600) -> dict[tuple[str, ...], list[Any]]:
        """Every scraped sample of ``expr``'s series over the last ``window_s``: a map from the
        series' sorted label pairs to ``[(timestamp, value), ...]``."""
        out = {}
        for series in self.query(f"{expr}[{window_s}s]"):
            key = tuple(f"{k}={v}" for k, v in sorted(series["metric"].items()))
            out[key] = [(float(t), float(v)) for t, v in series["values"]]
        return out

    def wait_for(self, expr: str, predicate: Any, timeout: float = 30.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        result: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            result = self.query(expr)
            if predicate(result):
                return result
            time.sleep(0.5)
        raise AssertionError(f"{expr} never satisfied the test; last result {result}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()
