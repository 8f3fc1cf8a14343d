"""``--otlp``: a real job's figures pushed by the OTLP/HTTP exporter to an in-process receiver
that decodes them with OpenTelemetry's own protobuf classes, checked against the recording."""

from __future__ import annotations

import contextlib
import gzip
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import SCRIPTS, torchtop
from torchtop.report.job import summarize
from torchtop.streams.recording import read_recording

pytestmark = pytest.mark.slow
metrics_service = pytest.importorskip(
    "opentelemetry.proto.collector.metrics.v1.metrics_service_pb2",
    reason="the otel extra is not installed",
)


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP metrics endpoint that keeps every request it is sent, decoded."""

    def __init__(self) -> None:
        self.requests: list[Any] = []
        self.paths: list[str] = []
        super().__init__(("127.0.0.1", 0), _Handler)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        request = metrics_service.ExportMetricsServiceRequest()
        request.ParseFromString(body)
        self.server.requests.append(request)
        self.server.paths.append(self.path)
        answer = metrics_service.ExportMetricsServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def serving(server: Receiver) -> Iterator[Receiver]:
    """The receiver answering on its own thread for the block's length."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with serving(Receiver()) as server:
        yield server


def points(request: Any) -> dict[str, list[tuple[float, dict[str, str]]]]:
    """Each metric's data points in one export request: value and attributes."""
    out: dict[str, list[tuple[float, dict[str, str]]]] = {}
    for rm in request.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                data = metric.sum if metric.HasField("sum") else metric.gauge
                for p in data.data_points:
                    value = p.as_double if p.HasField("as_double") else p.as_int
                    attrs = {a.key: a.value.string_value for a in p.attributes}
                    out.setdefault(metric.name, []).append((value, attrs))
    return out


def test_a_run_pushes_its_figures_over_otlp(receiver: Receiver, tmp_path: Path) -> None:
    record = tmp_path / "r.ttr"
    result = torchtop(
        "run", "--headless", "--otlp", receiver.endpoint, "--otlp-interval", "1",
        "--record", str(record), str(SCRIPTS / "train_metrics.py"), "--steps", "30", "--tail", "1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"pushing metrics to {receiver.endpoint}/v1/metrics" in result.stderr
    assert receiver.requests and set(receiver.paths) == {"/v1/metrics"}
    report = summarize(read_recording(record).messages)
    # The push at exit carries the job's final figures.
    final = points(receiver.requests[-1])
    ((steps, attrs),) = final["torchtop_steps"]
    assert steps == report["steps"] == 30
    assert attrs["hostname"] and attrs["run"] and "rank" not in attrs
    ((wait, _),) = final["torchtop_dataloader_wait"]
    assert wait == pytest.approx(report["dataloader"]["wait_s"], abs=1e-6)
    ((rss, _),) = final["torchtop_host_rss"]
    assert rss > 0
    resource = receiver.requests[-1].resource_metrics[0].resource
    assert {a.key: a.value.string_value for a in resource.attributes}["service.name"] == "torchtop"
