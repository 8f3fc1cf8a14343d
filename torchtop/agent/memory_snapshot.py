"""Reading a memory snapshot in ``torch.cuda.memory._snapshot()``'s format. No torch import.

The CUDA path takes the snapshot from the caching allocator; the CPU emulation
(``--memory-limit``) builds one in the same format from its tracker. Either way the functions
here answer the questions an out-of-memory failure raises:

- what holds the memory: live blocks grouped by the line of the job's own code that allocated
  them (:func:`top_sites`);
- was the memory full, or free but in pieces too small (:func:`verdict`);
- and they write the snapshot as a pickle that PyTorch's memory_viz opens, bounded in size
  (:func:`save_snapshot`).

The format, from ``torch/cuda/memory.py``: ``{"segments": [Segment], "device_traces":
[[TraceEntry]]}``; a segment is one ``cudaMalloc`` (``address``, ``total_size``, ``stream``,
``segment_type`` "small"/"large", ``segment_pool_id``, ``allocated_size``, ``active_size``,
``blocks``); a block is a piece of it (``address``, ``size``, ``requested_size``, ``state``
"active_allocated"/"active_awaiting_free"/"inactive", ``frames``); a frame is ``{"filename",
"line", "name"}``, innermost first.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchtop.protocol import MAX_SITES, MAX_STACK_FRAMES, AllocationSite, StackFrame

#: Requests above this size are served from "large" segments only (the allocator's kSmallSize).
SMALL_REQUEST_BYTES = 1 << 20
#: The site of live blocks that carry no Python frame: allocated before history was recorded,
#: by the autograd engine's device threads, or from C++.
NO_STACK_FILE = "<no Python stack>"
NO_STACK_FUNCTION = "recorded before history, in backward, or from C++"
#: Frames of torch's own code kept in a site's stack, the innermost first ("Linear.forward,
#: called from train.py:40").
CONTEXT_FRAMES = 2
#: Torch functions that only pass a call on: never worth a line of a stack.
PASS_THROUGH = frozenset({"_call_impl", "_wrapped_call_impl", "inner", "_fn", "wrapper"})

_TORCHTOP_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: The demos ship inside torchtop's package (``torchtop/demos``) but are the job's own code.
_DEMOS_DIR = _TORCHTOP_DIR + "demos" + os.sep
_LIBRARY_MARKERS = (
    f"{os.sep}site-packages{os.sep}torch{os.sep}",
    f"{os.sep}dist-packages{os.sep}torch{os.sep}",
    f"{os.sep}torch{os.sep}nn{os.sep}",
    f"{os.sep}torch{os.sep}autograd{os.sep}",
    f"{os.sep}torch{os.sep}utils{os.sep}",
    f"{os.sep}torch{os.sep}optim{os.sep}",
    f"{os.sep}torch{os.sep}_dynamo{os.sep}",
    f"{os.sep}torch{os.sep}_tensor.py",
    f"{os.sep}torch{os.sep}_compile.py",
    f"{os.sep}torch{os.sep}functional.py",
)
_RUNNER_FILES = ("<frozen runpy>", "runpy.py", "<frozen importlib._bootstrap>")


def _torch_dir() -> str | None:
    module = sys.modules.get("torch")
    path = getattr(module, "__file__", None)
    return os.path.dirname(os.path.abspath(path)) + os.sep if path else None


def _is_torchtop(filename: str) -> bool:
    """torchtop's own code: the agent, the runner, the CLI; not the demos it ships."""
    return filename.startswith(_TORCHTOP_DIR) and not filename.startswith(_DEMOS_DIR)


def is_library_frame(filename: str, torch_dir: str | None = None) -> bool:
    """True for a frame of torch, torchtop (its demos aside) or the interpreter's runner; the
    job's own frames are all the others."""
    if not filename:
        return True
    if _is_torchtop(filename):
        return True
    if torch_dir is not None and filename.startswith(torch_dir):
        return True
    if filename.endswith(_RUNNER_FILES) or filename.startswith("<frozen"):
        return True
    return any(marker in filename for marker in _LIBRARY_MARKERS)


# -- allocation sites ---------------------------------------------------------------------------


def _frame(raw: Mapping[str, Any]) -> StackFrame:
    return StackFrame(
        file=str(raw.get("filename", "?")),
        line=int(raw.get("line", 0) or 0),
        function=str(raw.get("name", "?")),
    )


def site_stack(
    frames: Sequence[Mapping[str, Any]], torch_dir: str | None = None
) -> list[StackFrame]:
    """An allocation's stack as a site shows it, innermost first: torch's innermost frames
    (at most ``CONTEXT_FRAMES``: "Linear.forward"), the job's frame that allocated
    (the site: the first frame outside torch), then the job's own callers, without torch's
    frames between them (``Module._call_impl``) or the runner's beyond them; at most
    ``MAX_STACK_FRAMES``. Empty without frames."""
    if not frames:
        return []
    site = next(
        (
            i
            for i, f in enumerate(frames)
            if not is_library_frame(str(f.get("filename", "")), torch_dir)
        ),
        None,
    )
    if site is None:
        # Only library frames: show the outermost ones, nearest to whatever called torch.
        return [_frame(f) for f in frames[-MAX_STACK_FRAMES:]]
    context = [f for f in frames[:site] if str(f.get("name", "")) not in PASS_THROUGH]
    chosen = [*context[:CONTEXT_FRAMES], frames[site]]
    for f in frames[site + 1 :]:
        if len(chosen) >= MAX_STACK_FRAMES:
            break
        filename = str(f.get("filename", ""))
        if _is_runner(filename):
            break  # torchtop's bootstrap and runpy: outside the job
        if not is_library_frame(filename, torch_dir):
            chosen.append(f)
    return [_frame(f) for f in chosen]


def _is_runner(filename: str) -> bool:
    return (
        _is_torchtop(filename) or filename.endswith(_RUNNER_FILES) or filename.startswith("<frozen")
    )


def _site_key(frames: Sequence[Mapping[str, Any]], torch_dir: str | None) -> tuple[str, int, str]:
    for f in frames:
        filename = str(f.get("filename", ""))
        if not is_library_frame(filename, torch_dir):
            return (filename, int(f.get("line", 0) or 0), str(f.get("name", "?")))
    if frames:
        outer = frames[-1]
        return (
            str(outer.get("filename", "?")),
            int(outer.get("line", 0) or 0),
            str(outer.get("name", "?")),
        )
    return (NO_STACK_FILE, 0, NO_STACK_FUNCTION)


@dataclass
class _Group:
    bytes: int = 0
    count: int = 0
    largest: int = -1
    frames: Sequence[Mapping[str, Any]] = ()


def live_blocks(snapshot: Mapping[str, Any]) -> Iterable[Mapping[str, Any]]:
    """Blocks in use by tensors (``active_allocated``) in every segment."""
    for segment in snapshot.get("segments", ()):
        for block in segment.get("blocks", ()):
            if block.get("state") == "active_allocated":
                yield block


def top_sites(
    snapshot: Mapping[str, Any], limit: int = MAX_SITES, torch_dir: str | None = None
) -> tuple[list[AllocationSite], int]:
    """Live blocks grouped by the job's allocating line, largest first, and how many blocks
    are live in all. Each site's stack is that of its largest block."""
    if torch_dir is None:
        torch_dir = _torch_dir()
    groups: dict[tuple[str, int, str], _Group] = {}
    live = 0
    for block in live_blocks(snapshot):
        live += 1
        frames = block.get("frames") or ()
        key = _site_key(frames, torch_dir)
        group = groups.get(key)
        if group is None:
            group = groups[key] = _Group()
        size = int(block.get("size", 0))
        group.bytes += size
        group.count += 1
        if size > group.largest:
            group.largest = size
            group.frames = frames
    ordered = sorted(groups.items(), key=lambda item: (-item[1].bytes, -item[1].count, item[0]))
    sites = [
        AllocationSite(
            file=file,
            line=line,
            function=function,
            bytes=group.bytes,
            count=group.count,
            stack=site_stack(group.frames, torch_dir),
        )
        for (file, line, function), group in ordered[:limit]
    ]
    return sites, live


# -- totals and the verdict ---------------------------------------------------------------------


@dataclass(frozen=True)
class SnapshotTotals:
    """Sums over a snapshot's segments."""

    #: Bytes of all segments: the allocator's reserved memory.
    reserved: int
    #: Bytes of ``active_allocated`` blocks.
    allocated: int
    #: Bytes of ``inactive`` blocks: free, but held in the allocator's segments.
    free_in_segments: int
    #: The largest ``inactive`` block.
    largest_free_block: int


@dataclass(frozen=True)
class FailedRequest:
    """The allocation that failed, from the last ``oom`` entry of a device's trace.

    The allocator's observer is told the size of the segment it tried to get (a request of at
    most 1 MiB asks for a 2 MiB segment, one of 1 to 10 MiB for 20 MiB); the trace holds the
    request itself, the stream it was made on, and the device's free memory at that moment.
    """

    size: int
    stream: int | None
    device_free: int | None
    time_us: int | None
    frames: Sequence[Mapping[str, Any]]


def failed_request(snapshot: Mapping[str, Any], index: int = 0) -> FailedRequest | None:
    """The last ``oom`` entry of device ``index``'s trace, or ``None`` without one."""
    traces = snapshot.get("device_traces") or []
    trace = traces[index] if 0 <= index < len(traces) else []
    for entry in reversed(trace):
        if entry.get("action") != "oom":
            continue
        size = entry.get("size")
        if not isinstance(size, int) or size <= 0:
            return None
        stream, free, time_us = entry.get("stream"), entry.get("device_free"), entry.get("time_us")
        return FailedRequest(
            size=size,
            stream=stream if isinstance(stream, int) else None,
            device_free=free if isinstance(free, int) else None,
            time_us=time_us if isinstance(time_us, int) else None,
            frames=entry.get("frames") or (),
        )
    return None


def totals(
    snapshot: Mapping[str, Any], requested: int | None = None, stream: int | None = None
) -> SnapshotTotals:
    """Reserved, allocated and free-in-segment bytes. With ``requested``, the free blocks are
    only those of the pool that could serve it (large segments for requests above 1 MiB, small
    ones otherwise) and of the default pool (not a CUDA graph's private pool); with ``stream``,
    only those of segments of that stream, since the allocator hands a free block out again
    only on the stream it was allocated on."""
    reserved = allocated = free = largest = 0
    for segment in snapshot.get("segments", ()):
        reserved += int(segment.get("total_size", 0))
        usable = True
        if stream is not None and segment.get("stream", stream) != stream:
            usable = False
        if requested is not None:
            kind = segment.get("segment_type")
            if kind is not None and (kind == "large") != (requested > SMALL_REQUEST_BYTES):
                usable = False
            pool = segment.get("segment_pool_id")
            if pool is not None and tuple(pool) != (0, 0):
                usable = False
        for block in segment.get("blocks", ()):
            state = block.get("state")
            size = int(block.get("size", 0))
            if state == "active_allocated":
                allocated += size
            elif state == "inactive" and usable:
                free += size
                largest = max(largest, size)
    return SnapshotTotals(reserved, allocated, free, largest)


def verdict(
    requested: int | None,
    device_free: int | None,
    totals: SnapshotTotals,
    segment: int | None = None,
) -> bool | None:
    """``True`` for *fragmented*: the free memory adds up to the request (free in the
    allocator's segments plus free on the device), yet no free block can hold the request and
    the device cannot hold the new segment the allocator asked for (``segment``, the request
    rounded up: 2 MiB, 20 MiB or a multiple of 2 MiB). ``False`` for *full*. ``None`` without
    a request.
    """
    if requested is None:
        return None
    device = device_free or 0
    if totals.free_in_segments + device < requested:
        return False
    return totals.largest_free_block < requested and device < max(requested, segment or 0)


# -- saving -------------------------------------------------------------------------------------


def bounded(snapshot: Mapping[str, Any], trace_entries: int) -> dict[str, Any]:
    """A copy of ``snapshot`` that keeps at most the last ``trace_entries`` of each device's
    trace (0 drops the traces). Segments and their blocks' frames are kept whole."""
    result = dict(snapshot)
    traces = snapshot.get("device_traces") or []
    result["device_traces"] = [
        list(trace[-trace_entries:]) if trace_entries > 0 else [] for trace in traces
    ]
    return result


def save_snapshot(
    snapshot: Mapping[str, Any], path: Path, *, trace_entries: int, max_bytes: int
) -> int:
    """Pickle ``snapshot`` to ``path`` (mode 0600, written whole or not at all) and return its
    size. Above ``max_bytes`` the traces go first, then the blocks' frames."""
    data = pickle.dumps(bounded(snapshot, trace_entries), protocol=4)
    if len(data) > max_bytes:
        data = pickle.dumps(bounded(snapshot, 0), protocol=4)
    if len(data) > max_bytes:
        stripped = bounded(snapshot, 0)
        stripped["segments"] = [
            {**seg, "blocks": [{**b, "frames": []} for b in seg.get("blocks", ())]}
            for seg in snapshot.get("segments", ())
        ]
        data = pickle.dumps(stripped, protocol=4)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return len(data)
