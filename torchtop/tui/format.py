"""Human units for the viewer: bytes, durations, rates, percentages.

Pure functions with no Textual or Rich import, so the state, the widgets and the tests share
one way of writing a number. A value that could not be read (``None``) shows as :data:`MISSING`.
"""

from __future__ import annotations

import math

from torchtop.sizes import BINARY_UNITS as _UNITS
from torchtop.sizes import format_bytes
from torchtop.sizes import scale_binary as _scale

#: How a value that could not be read is shown.
MISSING = "—"

_SHORT_UNITS = ("B", "K", "M", "G", "T", "P")


def format_bytes_short(n: int | float | None) -> str:
    """Bytes in at most five cells, for axes and tight columns: ``"1.2G"``, ``"512M"``, ``"0"``."""
    if n is None:
        return MISSING
    if n == 0:
        return "0"
    value, unit = _scale(n)
    if unit == 0:
        return f"{int(value)}B"
    if abs(value) >= 10:
        return f"{value:.0f}{_SHORT_UNITS[unit]}"
    return f"{value:.1f}{_SHORT_UNITS[unit]}"


def format_used_total(used: int | None, total: int | None) -> str:
    """``"60.1/80.0 GiB"``: both in the unit of the total, so they read at a glance."""
    if used is None and total is None:
        return MISSING
    if total is None or total <= 0:
        return format_bytes(used)
    if used is None:
        return f"{MISSING}/{format_bytes(total)}"
    _, unit = _scale(total)
    divisor = 1024**unit
    return f"{used / divisor:.1f}/{total / divisor:.1f} {_UNITS[unit]}"


def nice_ceiling(n: float) -> float:
    """A round number of bytes at or above ``n`` (two significant digits in its binary unit).

    Used for a chart's y axis so its top label reads "1.8G" rather than "1.73G".
    """
    if n <= 0:
        return 0.0
    value, unit = _scale(n)
    digits = 10.0 ** (math.floor(math.log10(value)) - 1)
    rounded = math.ceil(value / digits - 1e-9) * digits
    return float(rounded * 1024**unit)


def format_duration(seconds: float | None) -> str:
    """A duration in its two largest units: ``"850 ms"``, ``"12.3 s"``, ``"4m 05s"``, ``"2h 03m"``.

    Used where precision matters less than a glance (phase lengths, waits).
    """
    if seconds is None or math.isnan(seconds):
        return MISSING
    if seconds < 0:
        return "-" + format_duration(-seconds)
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    total = int(seconds)
    if total < 3600:
        return f"{total // 60}m {total % 60:02d}s"
    if total < 86400:
        return f"{total // 3600}h {total % 3600 // 60:02d}m"
    return f"{total // 86400}d {total % 86400 // 3600:02d}h"


def format_clock(seconds: float | None) -> str:
    """An elapsed time as a clock: ``"0:01:23"``, ``"27:00:05"``. Used for uptime."""
    if seconds is None or math.isnan(seconds):
        return MISSING
    total = max(0, int(seconds))
    return f"{total // 3600}:{total % 3600 // 60:02d}:{total % 60:02d}"


def format_span(seconds: float) -> str:
    """A chart window's length in a few cells: ``"45s"``, ``"2m"``, ``"1.5h"``."""
    if seconds < 120.5:
        return f"{seconds:.0f}s"
    if seconds < 100 * 60:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def format_percent(p: float | None) -> str:
    """``"98%"``; ``"—"`` when unknown."""
    if p is None or math.isnan(p):
        return MISSING
    return f"{p:.0f}%"


def format_share(part: float, whole: float) -> str:
    """``part`` as a percentage of ``whole``: ``"3.4%"``, ``"45%"``; :data:`MISSING` for no
    whole."""
    if whole <= 0:
        return MISSING
    p = part / whole * 100
    return f"{p:.1f}%" if p < 9.95 else f"{p:.0f}%"


def format_seconds(seconds: float | None) -> str:
    """``"850 µs"``, ``"12.3 ms"``, ``"122 ms"``, ``"1.23 s"``."""
    if seconds is None:
        return MISSING
    seconds = float(f"{seconds:.3g}")  # so that 0.0999999 reads 100 ms, not 100.0 ms
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 0.01:
        return f"{seconds * 1e3:.2f} ms"
    if seconds < 0.1:
        return f"{seconds * 1e3:.1f} ms"
    if seconds < 1:
        return f"{seconds * 1e3:.0f} ms"
    if seconds < 100:
        return f"{seconds:.2f} s"
    return f"{seconds:.0f} s"


def format_seconds_short(seconds: float | None) -> str:
    """At most five cells, for a chart's axis: ``"800µs"``, ``"12ms"``, ``"1.2s"``."""
    if seconds is None:
        return MISSING
    if seconds == 0:
        return "0"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f}µs"
    if seconds < 1:
        return f"{seconds * 1e3:.3g}ms" if seconds < 0.1 else f"{seconds * 1e3:.0f}ms"
    return f"{seconds:.2g}s" if seconds < 10 else f"{seconds:.0f}s"


def format_rate(rate: float | None) -> str:
    """``"8.21"``, ``"262"``, ``"12.3k"``."""
    if rate is None:
        return MISSING
    if rate >= 10_000:
        return f"{rate / 1000:.1f}k"
    if rate >= 100:
        return f"{rate:.0f}"
    if rate >= 10:
        return f"{rate:.1f}"
    return f"{rate:.2f}"
