"""OpenTelemetry: the same figures, pushed with the OTLP exporter (``--otlp ENDPOINT``).

Needs the ``otel`` extra (``pip install torchtop[otel]``). Each family becomes an observable
instrument whose callback reads the jobs' figures when the SDK collects, so nothing is
recorded between pushes. Instrument names are the Prometheus names without the unit suffix,
with the unit as the instrument's unit: a collector's Prometheus exporter turns them back into
the same names (``torchtop_cuda_memory_allocated`` in ``By`` becomes
``torchtop_cuda_memory_allocated_bytes``; counters get ``_total``). The step-duration summary
goes out as two counters, ``torchtop_step_duration`` (seconds) and ``torchtop_steps_timed``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable
from typing import Any

from torchtop.export.families import Family, families
from torchtop.export.figures import JobFigures

#: The instrumentation scope of every instrument.
SCOPE = "torchtop"
_UNIT_SUFFIXES = {"By": "_bytes", "s": "_seconds"}

Read = Callable[[], Iterable[JobFigures]]


class OtlpUnavailable(Exception):
    """The OpenTelemetry packages are missing; the message says how to install them."""


def instrument_name(family: Family) -> str:
    suffix = _UNIT_SUFFIXES.get(family.unit)
    if suffix and family.name.endswith(suffix):
        return family.name[: -len(suffix)]
    return family.name


def _attributes(family: Family, labels: tuple[str, ...]) -> dict[str, str]:
    # An empty label is an absent one in Prometheus; in OTLP it is left out.
    return {k: v for k, v in zip(family.labels, labels, strict=True) if v}


def instrument(read: Read, reader: Any, *, service: str = "torchtop") -> Any:
    """A ``MeterProvider`` whose instruments observe ``read()`` and export through ``reader``
    (a ``PeriodicExportingMetricReader``, or the SDK's ``InMemoryMetricReader`` in tests)."""
    try:
        from opentelemetry.metrics import CallbackOptions, Observation
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.resources import Resource
    except ImportError:
        raise OtlpUnavailable("--otlp needs OpenTelemetry: pip install 'torchtop[otel]'") from None
    from torchtop import __version__

    provider = MeterProvider(
        resource=Resource.create({"service.name": service}), metric_readers=[reader]
    )
    meter = provider.get_meter(SCOPE, __version__)

    def observe(name: str, pick: Callable[[Any], float]) -> Any:
        def callback(_options: CallbackOptions) -> Iterable[Observation]:
            for family in families(read()):
                if family.name == name:
                    return [
                        Observation(pick(p), _attributes(family, p.labels)) for p in family.points
                    ]
            return []

        return callback

    for family in families(()):
        name = instrument_name(family)
        if family.kind == "summary":
            meter.create_observable_counter(
                name,
                callbacks=[observe(family.name, lambda p: p.sum)],
                unit=family.unit,
                description=f"{family.help} (the sum)",
            )
            meter.create_observable_counter(
                "torchtop_steps_timed",
                callbacks=[observe(family.name, lambda p: p.value)],
                unit="{step}",
                description="Steps with a duration (every step but the first).",
            )
        else:
            create = (
                meter.create_observable_counter
                if family.kind == "counter"
                else meter.create_observable_gauge
            )
            create(
                name,
                callbacks=[observe(family.name, lambda p: p.value)],
                unit=family.unit,
                description=family.help,
            )
    return provider


class _FirstFailure(logging.Handler):
    """Prints the SDK's first export error as one line; later ones stay quiet."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(logging.ERROR)
        self.endpoint = endpoint
        self.failures = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.failures += 1
        if self.failures == 1:
            print(
                f"torchtop: cannot push metrics to {self.endpoint} ({record.getMessage()[:200]}); "
                "check that an OTLP/HTTP collector listens there",
                file=sys.stderr,
            )


class OtlpPusher:
    """Pushes the figures to an OTLP/HTTP endpoint every ``interval_s`` from the SDK's thread."""

    def __init__(self, read: Read, endpoint: str, interval_s: float = 10.0) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
                OTLPMetricExporter,
            )
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        except ImportError:
            raise OtlpUnavailable(
                "--otlp needs OpenTelemetry: pip install 'torchtop[otel]'"
            ) from None
        self.endpoint = metrics_url(endpoint)
        self._log = _FirstFailure(self.endpoint)
        logger = logging.getLogger("opentelemetry")
        logger.addHandler(self._log)
        logger.propagate = False
        reader = PeriodicExportingMetricReader(
            OTLPMetricExporter(endpoint=self.endpoint, timeout=5),
            export_interval_millis=interval_s * 1000,
            export_timeout_millis=10_000,
        )
        self.provider = instrument(read, reader)

    def close(self) -> None:
        """Push once more (the final figures) and stop."""
        try:
            self.provider.shutdown(timeout_millis=5_000)
        except Exception:
            pass
        logging.getLogger("opentelemetry").removeHandler(self._log)


def metrics_url(endpoint: str) -> str:
    """``http://collector:4318`` as the OTLP/HTTP metrics URL (``…/v1/metrics``)."""
    if "://" not in endpoint:
        endpoint = f"http://{endpoint}"
    if endpoint.rstrip("/").endswith("/v1/metrics"):
        return endpoint
    return endpoint.rstrip("/") + "/v1/metrics"


def push(read: Read, endpoint: str, interval_s: float = 10.0) -> OtlpPusher:
    return OtlpPusher(read, endpoint, interval_s)
