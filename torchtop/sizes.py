"""Byte sizes written by people (``256MiB``, ``2GiB``, ``500MB``, ``1e9``) and for people.

Standard library only: the CLI parses ``--memory-limit`` with it, the agent writes its
emulated out-of-memory message with it, and the model, the report and the viewer write sizes
with :func:`format_bytes`.
"""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes in ``text``: a number with an optional unit. ``KiB``/``MiB``/``GiB``/``TiB`` are
    powers of 1024, ``KB``/``MB``/``GB``/``TB`` (and ``K``/``M``/``G``/``T``) powers of 1000.

    Raises ``ValueError`` with a message fit for the user for anything else, or for a size
    below one byte.
    """
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"expected a size such as 256MiB, 2GiB, 500MB or 1e9, got {text!r}")
    number, unit = match.groups()
    scale = _UNITS.get(unit.lower())
    if scale is None:
        raise ValueError(
            f"unknown unit {unit!r} in {text!r}; use B, KB, MB, GB, TB or KiB, MiB, GiB, TiB"
        )
    value = float(number) * scale
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"a size must be at least one byte, got {text!r}")
    return int(value)


def format_size(n: int | float | None) -> str:
    """``"256.00 MiB"``: binary units with two decimals, as CUDA's out-of-memory message."""
    if n is None:
        return "?"
    value = float(n)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} bytes" if unit == "bytes" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{n} bytes"  # pragma: no cover


#: Binary units, smallest first, for :func:`format_bytes` and the viewer.
BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def scale_binary(n: float) -> tuple[float, int]:
    """``n`` as a value below 1024 and the index of its binary unit."""
    value = float(n)
    unit = 0
    while abs(value) >= 1024 and unit < len(BINARY_UNITS) - 1:
        value /= 1024
        unit += 1
    return value, unit


def format_bytes(n: int | float | None, missing: str = "—") -> str:
    """Bytes in binary units with three significant digits: ``"1.23 GiB"``, ``"512 MiB"``;
    ``missing`` for a size that could not be read (the model's sentences write ``"?"``)."""
    if n is None:
        return missing
    value, unit = scale_binary(n)
    if unit == 0:
        return f"{int(value)} B"
    if abs(value) >= 100:
        return f"{value:.0f} {BINARY_UNITS[unit]}"
    if abs(value) >= 10:
        return f"{value:.1f} {BINARY_UNITS[unit]}"
    return f"{value:.2f} {BINARY_UNITS[unit]}"
