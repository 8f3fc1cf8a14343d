"""The Prometheus API client of the cluster view, against a real Prometheus and real servers
that are not Prometheus: series and values come back; an unreachable URL, another service's
answer and a refused query each give an error that names the problem and the fix."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.prometheus_server import Prometheus, free_port
from torchtop.streams.prometheus_api import PrometheusError, base_url, query


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    server = Prometheus(tmp_path_factory.mktemp("prometheus"))
    yield server
    server.stop()


@pytest.fixture
def other_service(tmp_path: Path) -> Iterator[str]:
    """A plain HTTP file server whose every path answers an HTML page."""
    (tmp_path / "index.html").write_text("<html>not prometheus</html>")

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, directory=str(tmp_path), **kwargs)  # type: ignore[arg-type]

        def do_GET(self) -> None:
            self.path = "/index.html"
            super().do_GET()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_query_returns_labels_and_values(prometheus: Prometheus) -> None:
    series = query(prometheus.url, 'label_replace(vector(3), "run", "r\\u001b[2J", "", "")')
    assert [(s.labels, s.value) for s in series] == [({"run": "r\\x1b[2J"}, 3.0)]


def test_refused_query_says_so(prometheus: Prometheus) -> None:
    with pytest.raises(PrometheusError, match=r"refused the query: .*parse error"):
        query(prometheus.url, "sum(")


def test_unreachable_url_says_so() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(PrometheusError, match=r"cannot reach Prometheus at .*check the URL"):
        query(url, "up", timeout=5)


def test_another_service_is_not_taken_for_prometheus(other_service: str) -> None:
    with pytest.raises(PrometheusError, match="did not answer as Prometheus does"):
        query(other_service, "up")


def test_base_url() -> None:
    assert base_url("prom:9090/") == "http://prom:9090"
    assert base_url("https://prom.example") == "https://prom.example"
    with pytest.raises(PrometheusError, match="not a Prometheus URL"):
        base_url("ftp://prom\x1b[2J")
