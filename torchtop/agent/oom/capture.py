"""Building the capture of a failure or a snapshot: one snapshot analysed into a
:class:`~torchtop.protocol.MemoryCapture`, the part of it about one device, and a message made
small enough for one frame. No torch here."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from torchtop.agent.holders import Holders, split_blocks
from torchtop.agent.memory_snapshot import site_stack, top_sites, totals, verdict
from torchtop.protocol import MAX_FRAME_BYTES, CategoryBytes, MemoryCapture, Message, encode


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _fields(capture: MemoryCapture) -> dict[str, Any]:
    """A capture's fields, to build an ``oom`` or ``memory_snapshot`` message from."""
    return {f.name: getattr(capture, f.name) for f in dataclasses.fields(MemoryCapture)}


def _empty_capture(capture_id: int, error: str) -> MemoryCapture:
    return MemoryCapture(
        t=time.time(),
        id=capture_id,
        device="",
        emulated=False,
        requested_bytes=None,
        free_bytes=None,
        total_bytes=None,
        reserved_bytes=None,
        allocated_bytes=None,
        largest_free_block_bytes=None,
        fragmented=None,
        top_sites=[],
        snapshot_path=None,
        snapshot_error=error,
    )


def _for_device(snapshot: Mapping[str, Any], index: int) -> dict[str, Any]:
    """The part of a snapshot about one device (segments carry ``device``; traces are a list
    per device)."""
    segments = [s for s in snapshot.get("segments", ()) if int(s.get("device", index)) == index]
    traces = snapshot.get("device_traces") or []
    trace = traces[index] if index < len(traces) else []
    return {"segments": segments, "device_traces": [trace]}


def _failed_stack(snapshot: Mapping[str, Any], index: int) -> list[Any]:
    """The stack of the last ``oom`` in the device's trace: the allocation that failed."""
    traces = snapshot.get("device_traces") or []
    trace = traces[index] if index < len(traces) else []
    for entry in reversed(trace):
        if entry.get("action") == "oom":
            return site_stack(entry.get("frames") or ())
    return []


def analyse_snapshot(
    capture_id: int,
    *,
    device: str,
    index: int,
    emulated: bool,
    requested: int | None,
    stream: int | None,
    free: int | None,
    total: int | None,
    snap: Mapping[str, Any],
    error: str,
    figures: Callable[[Mapping[str, Any]], tuple[int | None, int | None]],
    segment: int | None = None,
    holders: Holders | None = None,
) -> MemoryCapture:
    """Analyse one snapshot (``error`` says why there is none). Every step may fail on its
    own and says so in ``snapshot_error``; the figures that could be read are still sent.
    Free blocks count only on the failing ``stream``, as the allocator reuses them."""
    mine = _for_device(snap, index)
    sums = totals(mine, requested, stream)
    sites, live = top_sites(mine)
    allocated, reserved = None, None
    with contextlib.suppress(Exception):
        allocated, reserved = figures(mine)
    if allocated is None and mine.get("segments"):
        allocated = sums.allocated
    if reserved is None and mine.get("segments"):
        reserved = sums.reserved
    by_category: list[CategoryBytes] = []
    if holders is not None and mine.get("segments"):
        with contextlib.suppress(Exception):
            split = split_blocks(mine["segments"], holders, device, allocated)
            by_category = [CategoryBytes(name, value) for name, value in split.items()]
    return MemoryCapture(
        t=time.time(),
        id=capture_id,
        device=device,
        emulated=emulated,
        requested_bytes=requested,
        free_bytes=free,
        total_bytes=total,
        reserved_bytes=reserved,
        allocated_bytes=allocated,
        largest_free_block_bytes=(
            sums.largest_free_block if mine.get("segments") and not emulated else None
        ),
        fragmented=verdict(requested, free, sums, segment) if requested is not None else None,
        top_sites=sites,
        snapshot_path=None,
        snapshot_error=error,
        live_count=live,
        requested_stack=_failed_stack(snap, index) if requested is not None else [],
        by_category=by_category,
    )


def _fit(message: Message) -> Message:
    """The message, made small enough for one frame: stacks go first, then sites."""
    if not isinstance(message, MemoryCapture):
        return message
    try:
        if len(encode(message)) <= MAX_FRAME_BYTES:
            return message
    except Exception:
        pass
    lean = replace(
        message,
        top_sites=[replace(site, stack=site.stack[:1]) for site in message.top_sites],
        requested_stack=message.requested_stack[:1],
    )
    try:
        if len(encode(lean)) <= MAX_FRAME_BYTES:
            return lean
    except Exception:
        pass
    return replace(lean, top_sites=[])


def _reason(exc: BaseException) -> str:
    """An exception as one line for a person: its message, without a traceback."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _read(
    snapshot: Callable[[], Mapping[str, Any]],
) -> tuple[Mapping[str, Any], str]:
    try:
        return snapshot(), ""
    except Exception as exc:
        return {"segments": [], "device_traces": []}, f"no snapshot: {exc!r}"
