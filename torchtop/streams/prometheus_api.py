"""A client of Prometheus's HTTP API (``/api/v1/query``), standard library only.

The first piece of the cluster view fed by Prometheus: it asks an instant query and gives back
each series' labels and value, or a :class:`PrometheusError` whose message names the problem and
the fix (an unreachable URL, an answer that is not Prometheus's, a query Prometheus refused).
The URL and every label value are untrusted: they are made printable before they reach a message
or a caller.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from torchtop.text import printable

#: Seconds to wait for Prometheus's answer to one query.
TIMEOUT_S = 10.0
#: The most bytes read of one answer.
MAX_ANSWER_BYTES = 64 * 1024 * 1024


class PrometheusError(Exception):
    """A query that got no usable answer; the message says why and what to do."""


@dataclass(frozen=True)
class Series:
    """One series of an instant query's answer: its labels and value."""

    labels: dict[str, str]
    value: float


@dataclass(frozen=True)
class Samples:
    """One series of a range selector's answer (``expr[60s]``): its labels and each sample as
    Prometheus stored it, ``(timestamp, value)``, oldest first."""

    labels: dict[str, str]
    values: list[tuple[float, float]]


def base_url(text: str) -> str:
    """``text`` as the base URL of a Prometheus server (``http://`` added where missing)."""
    url = text.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        parts = urllib.parse.SplitResult("", "", "", "", "")
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise PrometheusError(
            f"{printable(text, one_line=True)!r} is not a Prometheus URL: give one like "
            "http://prometheus.example:9090"
        )
    return url


def query(url: str, expr: str, *, timeout: float = TIMEOUT_S) -> list[Series]:
    """Every series of the instant query ``expr`` at Prometheus ``url`` (a base URL)."""
    out = []
    for labels, item in _result(url, expr, timeout, "vector"):
        out.append(Series(labels, float(item["value"][1])))
    return out


def query_samples(url: str, expr: str, *, timeout: float = TIMEOUT_S) -> list[Samples]:
    """Every series of ``expr``, a range selector (``metric{...}[60s]``), with the samples
    Prometheus stored for it in that range: what each scrape read, at the scrape's time."""
    out = []
    for labels, item in _result(url, expr, timeout, "matrix"):
        out.append(Samples(labels, [(float(t), float(v)) for t, v in item["values"]]))
    return out


def _result(
    url: str, expr: str, timeout: float, kind: str
) -> list[tuple[dict[str, str], dict[str, Any]]]:
    """Each series of the answer as (printable labels, its raw item); a malformed one raises
    the error that the URL is not Prometheus's."""
    shown = printable(url, one_line=True)
    address = f"{url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    try:
        with urllib.request.urlopen(address, timeout=timeout) as answer:
            body = answer.read(MAX_ANSWER_BYTES)
    except urllib.error.HTTPError as e:
        body = e.read(MAX_ANSWER_BYTES)
        if not body:
            raise PrometheusError(
                f"{shown} answered HTTP {e.code} to a query: check that the URL is a Prometheus "
                "server's (its /api/v1/query)"
            ) from None
    except (OSError, ValueError) as e:
        reason = printable(str(getattr(e, "reason", e)), one_line=True)
        raise PrometheusError(
            f"cannot reach Prometheus at {shown} ({reason}): check the URL and that the "
            "server is up and reachable from here"
        ) from None
    return _series(shown, body, kind)


def _series(shown: str, body: bytes, kind: str) -> list[tuple[dict[str, str], dict[str, Any]]]:
    not_prometheus = PrometheusError(
        f"{shown} did not answer as Prometheus does: check that the URL is a Prometheus "
        "server's (for example http://host:9090), not a node's exporter or another service"
    )
    try:
        data: Any = json.loads(body)
    except ValueError:
        raise not_prometheus from None
    if not isinstance(data, dict) or data.get("status") not in ("success", "error"):
        raise not_prometheus
    if data["status"] == "error":
        error = printable(str(data.get("error", "")), one_line=True)
        raise PrometheusError(f"Prometheus at {shown} refused the query: {error}")
    answer: dict[str, Any] = data["data"] if isinstance(data.get("data"), dict) else {}
    result = answer.get("result")
    if not isinstance(result, list):
        raise not_prometheus
    if answer.get("resultType") not in (kind, None):
        raise PrometheusError(
            f"Prometheus at {shown} answered a {printable(str(answer.get('resultType')))} "
            f"where a {kind} was asked for"
        )
    out = []
    for item in result:
        try:
            labels = {
                printable(str(k), one_line=True): printable(str(v), one_line=True)
                for k, v in item["metric"].items()
            }
            # The values are checked here, so that a caller reads them without a surprise.
            if kind == "vector":
                float(item["value"][1])
            else:
                [(float(t), float(v)) for t, v in item["values"]]
        except (KeyError, IndexError, TypeError, ValueError, AttributeError):
            raise not_prometheus from None
        out.append((labels, item))
    return out
