"""``/metrics`` for Prometheus: a custom collector over the jobs' figures, and its HTTP server.

The collector reads figures that the feeds keep up to date; a scrape never waits for a feed
and a feed never waits for a scrape. Nor does a scrape wait for the figures to be rendered: while
scrapes come, a renderer thread keeps the answer rendered ahead of them (:class:`Renderer`), so
that a scrape of a thousand ranks is answered at once with figures about a second old, however
busy the feeds keep the interpreter. The server runs in daemon threads of the torchtop process
(never in a training rank), answers each connection within a timeout, serves a bounded number
at once and closes the rest, and reports its own errors to nobody: a scraper that hangs, floods
or sends garbage costs at most its own connection.
"""

from __future__ import annotations

import contextlib
import io
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector, CollectorRegistry

from torchtop.export.families import Family, families
from torchtop.export.figures import JobFigures

DEFAULT_HOST = "127.0.0.1"
#: ``torchtop export``'s port when none is given.
DEFAULT_PORT = 9481
#: Connections served at once; more are closed at once. Prometheus needs one per scrape.
MAX_CONNECTIONS = 64
#: Seconds a connection may take to send its request and read the answer (a scrape takes
#: milliseconds; a client that hangs holds its thread no longer than this).
CONNECTION_TIMEOUT_S = 3.0
#: Seconds between renders while scrapes come (more when a render takes long: see
#: :data:`RENDER_SHARE`).
RENDER_EVERY_S = 1.0
#: The largest share of its time the renderer spends rendering: a render of 0.3 s is redone
#: every 1.5 s at most.
RENDER_SHARE = 0.2
#: Seconds the renderer goes on after the last scrape (Prometheus's default interval is a
#: minute; 15 s is common). After that, the next scrape renders its own answer.
RENDER_WARM_S = 150.0
#: The oldest rendered answer a scrape is given; an older one is rendered again first.
RENDER_MAX_AGE_S = 30.0
#: Seconds a connection may take in all, however it paces its bytes: a peer that trickles a
#: byte at a time gets no more.
CONNECTION_DEADLINE_S = 5.0


class MetricsError(Exception):
    """The metrics endpoint cannot be served; the message says why and what to do."""


def parse_address(text: str) -> tuple[str, int]:
    """``[ADDR:]PORT`` as ``(host, port)``: ``9481``, ``0.0.0.0:9481``, ``[::1]:0``."""
    host, sep, port_text = text.rpartition(":")
    if not sep:
        host = DEFAULT_HOST
    elif host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host:
        raise ValueError(f"no address before the port in {text!r}: give ADDR:PORT or PORT")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"expected [ADDR:]PORT, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} is out of range (0 picks a free one)")
    return host, port


def to_prometheus(family: Family) -> Metric:
    """One family in prometheus_client's terms."""
    labels = list(family.labels)
    metric: Any
    if family.kind == "counter":
        metric = CounterMetricFamily(family.name, family.help, labels=labels)
        for p in family.points:
            metric.add_metric(list(p.labels), p.value)
    elif family.kind == "summary":
        metric = SummaryMetricFamily(family.name, family.help, labels=labels)
        for p in family.points:
            metric.add_metric(list(p.labels), count_value=p.value, sum_value=p.sum)
    else:
        metric = GaugeMetricFamily(family.name, family.help, labels=labels)
        for p in family.points:
            metric.add_metric(list(p.labels), p.value)
    return metric


class JobCollector(Collector):
    """Reads the jobs' figures at each scrape (no state of its own, no multiprocess mode)."""

    def __init__(self, read: Callable[[], Iterable[JobFigures]]) -> None:
        self._read = read

    def describe(self) -> Iterator[Metric]:
        return iter(())  # registering must not collect

    def collect(self) -> Iterator[Metric]:
        for family in families(self._read()):
            yield to_prometheus(family)


def registry_for(read: Callable[[], Iterable[JobFigures]]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobCollector(read))
    return registry


Encoder = Callable[[CollectorRegistry], bytes]


class Renderer:
    """The scrape's answer, rendered ahead of the scrapes in a thread of its own.

    A scrape is answered with the latest rendered body of the format it asks for (text or
    OpenMetrics) when that body is at most :data:`RENDER_MAX_AGE_S` old; otherwise (the first
    scrape, or the first after :data:`RENDER_WARM_S` without any) the scrape renders its own and
    the renderer starts again. While scrapes come, each format asked for is rendered every
    :data:`RENDER_EVERY_S`, or less often where a render is long (:data:`RENDER_SHARE`), so the
    figures a scrape gets are about a second old. Rendering 1,024 ranks takes a few hundred
    milliseconds of a busy interpreter: a scrape that did it itself waited seconds behind the
    feeds' threads.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        every_s: float = RENDER_EVERY_S,
        warm_s: float = RENDER_WARM_S,
        max_age_s: float = RENDER_MAX_AGE_S,
    ) -> None:
        self.registry = registry
        self._every_s = every_s
        self._warm_s = warm_s
        self._max_age_s = max_age_s
        self._cond = threading.Condition()
        #: Per content type: its encoder and when a scrape last asked for it.
        self._wanted: dict[str, tuple[Encoder, float]] = {}
        #: Per content type: when its body was rendered (began reading the figures), the body.
        self._bodies: dict[str, tuple[float, bytes]] = {}
        #: Per content type: when the renderer renders it next.
        self._next_at: dict[str, float] = {}
        self._thread: threading.Thread | None = None
        self._closed = False
        #: Renders a scrape did itself, having no fresh answer.
        self.scrape_renders = 0

    def answer(self, accept: str) -> tuple[str, bytes]:
        """``(content_type, body)`` for a scrape whose ``Accept`` header is ``accept``; raises
        what rendering raised when the scrape had to render and it failed."""
        encoder, content_type = choose_encoder(accept)
        now = time.monotonic()
        with self._cond:
            self._wanted[content_type] = (encoder, now)
            cached = self._bodies.get(content_type)
            if cached is not None and now - cached[0] <= self._max_age_s:
                self._wake()
                return content_type, cached[1]
        began = time.monotonic()
        body = encoder(self.registry)
        with self._cond:
            self.scrape_renders += 1
            self._store(content_type, began, body)
            self._next_at[content_type] = began + self._every_s
            self._wake()
        return content_type, body

    def _store(self, content_type: str, began: float, body: bytes) -> None:
        held = self._bodies.get(content_type)
        if held is None or held[0] < began:
            self._bodies[content_type] = (began, body)

    def _wake(self) -> None:
        """Start the renderer, or wake it if it waits for a scrape (under ``_cond``)."""
        if self._closed:
            return
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=self._run, name="torchtop-metrics-render", daemon=True
            )
            self._thread.start()
        self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                for content_type, (_encoder, asked) in list(self._wanted.items()):
                    if now - asked > self._warm_s:  # no scrape for a while: rest
                        del self._wanted[content_type]
                        self._bodies.pop(content_type, None)
                        self._next_at.pop(content_type, None)
                if not self._wanted:
                    self._thread = None
                    return
                due = min(self._wanted, key=lambda c: self._next_at.get(c, 0.0))
                wait = self._next_at.get(due, 0.0) - now
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                encoder = self._wanted[due][0]
            began = time.monotonic()
            try:
                body = encoder(self.registry)
            except Exception:
                # A figure that cannot be rendered: the next scrape renders its own, and its
                # answer says what failed.
                with self._cond:
                    self._bodies.pop(due, None)
                    self._wanted.pop(due, None)
                    self._next_at.pop(due, None)
                continue
            took = time.monotonic() - began
            with self._cond:
                self._store(due, began, body)
                self._next_at[due] = began + max(self._every_s, took / RENDER_SHARE)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class _DeadlineReader(io.RawIOBase):
    """A socket's reads, each given only what is left of the connection's deadline."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the connection's deadline passed")
        self._sock.settimeout(min(left, CONNECTION_TIMEOUT_S))
        return self._sock.recv_into(buffer)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = CONNECTION_TIMEOUT_S
    protocol_version = "HTTP/1.0"

    def setup(self) -> None:
        super().setup()
        deadline = time.monotonic() + CONNECTION_DEADLINE_S
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, deadline))

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path not in ("/metrics", "/"):
            self._answer(404, "text/plain; charset=utf-8", b"not found: torchtop serves /metrics\n")
            return
        try:
            content_type, body = self.server.renderer.answer(self.headers.get("Accept", ""))
        except Exception as exc:  # a figure that cannot be rendered fails this scrape only
            self._answer(500, "text/plain; charset=utf-8", f"{exc!r}\n".encode())
            return
        self._answer(200, content_type, body)

    def _answer(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the job's terminal is not the place for access logs


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    #: A burst of connections waits in the kernel to be accepted (and refused), not refused there.
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], registry: CollectorRegistry, limit: int) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.renderer = Renderer(registry)
        self._slots = threading.BoundedSemaphore(limit)
        self.refused = 0
        self.errors = 0
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        self.errors += 1  # a peer that reset or timed out: its own connection ends, nothing else


class MetricsServer:
    """Serves a registry at ``http://HOST:PORT/metrics`` from daemon threads."""

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str = DEFAULT_HOST,
        port: int = 0,
        *,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        try:
            self._server = _Server((host, port), registry, max_connections)
        except OSError as exc:
            hint = "pick another port, or 0 for a free one"
            if isinstance(exc, socket.gaierror) or exc.errno == 99:  # EADDRNOTAVAIL
                hint = "give an address of this machine, e.g. 127.0.0.1 or 0.0.0.0"
            raise MetricsError(
                f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}; {hint}"
            ) from None
        self.host = host
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.5},
            name="torchtop-metrics",
            daemon=True,
        )

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    @property
    def refused(self) -> int:
        """Connections closed unanswered because ``max_connections`` were being served."""
        return self._server.refused

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._server.renderer.close()
            if self._thread.is_alive():
                self._server.shutdown()
            self._server.server_close()


def serve(
    read: Callable[[], Iterable[JobFigures]], address: Sequence[Any] = (DEFAULT_HOST, 0)
) -> MetricsServer:
    """Start serving the figures that ``read`` returns; raises :class:`MetricsError`."""
    host, port = address
    return MetricsServer(registry_for(read), host, port).start()
