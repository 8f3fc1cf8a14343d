"""The scrape's answer is rendered ahead of the scrapes: a scrape never waits for a render in
progress, gets figures the renderer keeps fresh while scrapes come, renders its own when the
last answer is too old, and the renderer rests when no one scrapes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from torchtop.export.prometheus import Renderer

TEXT = ""
OPENMETRICS = "application/openmetrics-text; version=1.0.0"


class Counting(Collector):
    """A gauge whose value is the number of the render that read it; the renderer's renders
    can be held (a scrape's own never are)."""

    def __init__(self) -> None:
        self.reads = 0
        self.hold = threading.Event()
        self.hold.set()
        self.holding = threading.Event()

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        self.reads += 1
        read = self.reads
        if not self.hold.is_set() and threading.current_thread().name == "torchtop-metrics-render":
            self.holding.set()
            self.hold.wait(30)
        gauge = GaugeMetricFamily("render_number", "which render this is")
        gauge.add_metric([], read)
        yield gauge


def rendered(body: bytes) -> int:
    for line in body.decode().splitlines():
        if line.startswith("render_number "):
            return int(float(line.split()[1]))
    raise AssertionError(body)


def renderer(**kwargs: float) -> tuple[Renderer, Counting]:
    collector = Counting()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return Renderer(registry, **kwargs), collector


def wait_for(condition: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_scrape_during_a_slow_render_gets_the_last_answer_at_once() -> None:
    r, collector = renderer(every_s=0.05)
    collector.hold.clear()  # the renderer's renders block
    try:
        content_type, body = r.answer(TEXT)  # the first scrape renders its own
        assert content_type.startswith("text/plain") and rendered(body) == 1
        assert r.scrape_renders == 1
        collector.holding.wait(20)
        assert collector.holding.is_set(), "the renderer never rendered again"
        _, body = r.answer(TEXT)  # answered while that render is still held
        assert rendered(body) == 1 and not collector.hold.is_set()
        assert r.scrape_renders == 1
        collector.hold.set()
        # Once it ends, scrapes get its figures, and newer ones as the renderer goes on.
        wait_for(lambda: rendered(r.answer(TEXT)[1]) >= 3)
        assert r.scrape_renders == 1
    finally:
        collector.hold.set()
        r.close()


def test_each_format_asked_for_is_kept_rendered() -> None:
    r, _collector = renderer(every_s=0.05)
    try:
        r.answer(TEXT)
        content_type, body = r.answer(OPENMETRICS)
        assert content_type.startswith("application/openmetrics-text")
        assert body.rstrip().endswith(b"# EOF")
        first = rendered(body)
        wait_for(lambda: rendered(r.answer(OPENMETRICS)[1]) > first)
        assert r.scrape_renders == 2  # one each, the first time it was asked for
    finally:
        r.close()


def test_an_answer_older_than_the_limit_is_rendered_again_by_the_scrape() -> None:
    # A renderer that renders rarely: the scrape finds its answer too old and renders.
    r, _collector = renderer(every_s=3600, max_age_s=0.2)
    try:
        assert rendered(r.answer(TEXT)[1]) == 1
        assert rendered(r.answer(TEXT)[1]) == 1  # fresh enough: as rendered
        time.sleep(0.3)
        assert rendered(r.answer(TEXT)[1]) == 2
        assert r.scrape_renders == 2
    finally:
        r.close()


def test_the_renderer_rests_when_nobody_scrapes_and_starts_again_with_a_scrape() -> None:
    r, collector = renderer(every_s=0.05, warm_s=0.3)
    try:
        r.answer(TEXT)
        wait_for(lambda: collector.reads >= 3)
        wait_for(lambda: r._thread is None)  # no scrape for warm_s: it stopped
        reads = collector.reads
        time.sleep(0.3)
        assert collector.reads == reads  # and renders nothing while resting
        r.answer(TEXT)  # its answer was dropped: this scrape renders, and it starts again
        assert collector.reads == reads + 1
        wait_for(lambda: collector.reads > reads + 1)
    finally:
        r.close()


def test_a_render_that_fails_fails_the_next_scrape_with_the_reason() -> None:
    class Failing(Collector):
        calls = 0

        def describe(self) -> Iterator[Metric]:
            return iter(())

        def collect(self) -> Iterator[Metric]:
            Failing.calls += 1
            if Failing.calls >= 2:
                raise RuntimeError("a figure nobody foresaw")
            yield GaugeMetricFamily("fine", "at first", value=1)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Failing())
    r = Renderer(registry, every_s=0.05)
    try:
        r.answer(TEXT)
        wait_for(lambda: Failing.calls >= 2)  # the renderer's render failed and dropped it
        wait_for(lambda: not r._bodies)
        with pytest.raises(RuntimeError, match="nobody foresaw"):
            r.answer(TEXT)
    finally:
        r.close()
