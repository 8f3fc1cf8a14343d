"""Human units for the viewer."""

from __future__ import annotations

import pytest

from torchtop.model.oom_advice import size
from torchtop.tui.format import (
    MISSING,
    format_bytes,
    format_bytes_short,
    format_clock,
    format_duration,
    format_percent,
    format_span,
    format_used_total,
    nice_ceiling,
)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (None, MISSING),
        (0, "0 B"),
        (512, "512 B"),
        (1536, "1.50 KiB"),
        (512 * MiB, "512 MiB"),
        (int(1.234 * GiB), "1.23 GiB"),
        (int(12.34 * GiB), "12.3 GiB"),
        (141 * GiB, "141 GiB"),
        (2 * 1024 * GiB, "2.00 TiB"),
        (-2 * GiB, "-2.00 GiB"),
    ],
)
def test_format_bytes(n: int | None, text: str) -> None:
    assert format_bytes(n) == text


def test_the_model_writes_sizes_as_the_viewer_does() -> None:
    """The model's sentences write sizes with the same function, ``?`` where one is unknown."""
    for n in (0, 512, 1536, 512 * MiB, int(1.234 * GiB), 141 * GiB, 2 * 1024 * GiB):
        assert size(n) == format_bytes(n)
    assert size(None) == "?"


@pytest.mark.parametrize(
    ("n", "text"),
    [(None, MISSING), (0, "0"), (100, "100B"), (1.5 * GiB, "1.5G"), (512 * MiB, "512M")],
)
def test_format_bytes_short(n: float | None, text: str) -> None:
    assert format_bytes_short(n) == text


def test_format_used_total_shares_the_total_unit() -> None:
    assert format_used_total(int(60.1 * GiB), 80 * GiB) == "60.1/80.0 GiB"
    assert format_used_total(512 * MiB, 16 * GiB) == "0.5/16.0 GiB"
    assert format_used_total(None, 16 * GiB) == f"{MISSING}/16.0 GiB"
    assert format_used_total(3 * GiB, None) == "3.00 GiB"
    assert format_used_total(None, None) == MISSING


@pytest.mark.parametrize(
    ("n", "top"),
    [(0, 0.0), (1.73 * GiB, 1.8 * GiB), (613 * MiB, 620 * MiB), (14 * GiB, 14 * GiB)],
)
def test_nice_ceiling(n: float, top: float) -> None:
    assert nice_ceiling(n) == pytest.approx(top)
    assert nice_ceiling(n) >= n


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, MISSING),
        (0.85, "850 ms"),
        (12.34, "12.3 s"),
        (245, "4m 05s"),
        (7380, "2h 03m"),
        (2 * 86400 + 3 * 3600, "2d 03h"),
        (-5, "-5.0 s"),
    ],
)
def test_format_duration(seconds: float | None, text: str) -> None:
    assert format_duration(seconds) == text


def test_format_clock() -> None:
    assert format_clock(None) == MISSING
    assert format_clock(83.9) == "0:01:23"
    assert format_clock(27 * 3600 + 5) == "27:00:05"
    assert format_clock(-3) == "0:00:00"


def test_format_span_and_percent() -> None:
    assert format_span(90) == "90s"
    assert format_span(120) == "120s"
    assert format_span(600) == "10m"
    assert format_span(3 * 3600) == "3.0h"
    assert format_percent(97.6) == "98%"
    assert format_percent(None) == MISSING
