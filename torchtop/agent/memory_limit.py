"""A device memory limit emulated on the CPU: ``torchtop run --memory-limit SIZE``.

Learners (and this project's CI) often have no GPU, yet out-of-memory failures are what they
most need to learn to read. :class:`MemoryLimitTracker` extends the exact
:class:`~torchtop.agent.tensor_tracker.TensorTracker` with:

- the allocation site of each live storage: the stack of the job's own Python code that
  allocated it (frames inside torch and torchtop skipped, a code object's verdict cached);
- a limit: when an operator's new storages would take the live total past it, the tracker
  runs the agent's out-of-memory flow (event, summary, sites, snapshot file, pause) and then
  raises ``torch.OutOfMemoryError`` with a message in the style of CUDA's that says it is
  emulated. The operator has already run: its output is dropped as the error unwinds, so the
  process briefly holds one operator's output beyond the limit;
- a bounded ring of alloc/free events and a snapshot in the format of
  ``torch.cuda.memory._snapshot()`` (one segment per live storage, since the CPU has no caching
  allocator), which PyTorch's memory_viz opens.

Scope: a dispatch mode is per thread. The tracker is entered in the thread that runs the job's
script (``torchtop.agent.bootstrap`` does so before the script starts, and it stays active for
the whole job). The backward pass of CPU tensors runs in that thread too, so gradients count.
Tensors made in other threads of the job are not counted; forked DataLoader workers inherit the
mode, so it switches itself off in them. Storage resized with ``resize_`` grows without the
limit check. ``torch.compile`` may not trace through an active dispatch mode.

Cost: every operator goes through Python (see ``tensor_tracker``); recording a site adds a walk
up the Python stack for each new storage. ``benchmarks/tracker_overhead.py`` measures both.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from collections.abc import Callable
from types import CodeType
from typing import Any

from torchtop.agent.memory_snapshot import (
    CONTEXT_FRAMES,
    PASS_THROUGH,
    SMALL_REQUEST_BYTES,
    is_library_frame,
)
from torchtop.agent.tensor_tracker import TensorTracker, _Entry
from torchtop.protocol import MAX_STACK_FRAMES, MemoryStats
from torchtop.sizes import format_size

#: ``MemoryStats.source`` of the emulated device's samples: exact live tensor bytes.
SOURCE_TENSORS = "cpu-tensors"
#: Frames recorded per storage: a site's stack as shown (context, site, the job's callers).
RECORDED_FRAMES = MAX_STACK_FRAMES

Stack = tuple[tuple[str, int, str], ...]
#: Called at an emulated OOM with the tracker and the bytes requested; returns the message to
#: raise with (or ``None`` for the default one).
OomHandler = Callable[["MemoryLimitTracker", int], "str | None"]

_TORCHTOP_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: Frames of the dispatch machinery itself, never shown as context.
_PLUMBING = (
    f"torch{os.sep}_compile.py",
    f"torch{os.sep}_dynamo{os.sep}",
    f"torch{os.sep}utils{os.sep}_python_dispatch.py",
)


#: What a frame is, cached per code object: the job's, torch's (shown as context), plumbing.
_USER, _LIBRARY, _PLUMBING_KIND = 0, 1, 2


def oom_message(requested: int, limit: int, live: int) -> str:
    """The emulated error's text, worded as CUDA's so that it reads the same."""
    free = max(0, limit - live)
    return (
        f"Emulated out of memory (torchtop --memory-limit {format_size(limit)}). "
        f"Tried to allocate {format_size(requested)}. The emulated device has a total capacity "
        f"of {format_size(limit)} of which {format_size(free)} is free. Of the allocated memory "
        f"{format_size(live)} is allocated by PyTorch tensors. This is not a real CUDA error: "
        "torchtop emulates a device of this size for this CPU job."
    )


class MemoryLimitTracker(TensorTracker):
    """Live tensor storage with allocation sites, and an optional emulated memory limit."""

    def __init__(
        self,
        limit_bytes: int | None = None,
        on_oom: OomHandler | None = None,
        trace_entries: int = 10_000,
    ) -> None:
        super().__init__()
        self.limit_bytes = limit_bytes
        self.num_ooms = 0
        self._on_oom = on_oom
        self._active = True
        self._in_oom = False
        self._trace: deque[tuple[str, int, int, Stack | None, int]] | None = (
            deque(maxlen=trace_entries) if trace_entries > 0 else None
        )
        self._code_kind: dict[CodeType, int] = {}
        self._stacks: dict[Stack, Stack] = {}
        torch_file = getattr(sys.modules.get("torch"), "__file__", None)
        self._torch_dir = os.path.dirname(torch_file) + os.sep if torch_file else None

    # -- life cycle ---------------------------------------------------------------------------

    def install(self) -> MemoryLimitTracker:
        """Enter the tracker in this thread for the rest of the process; off in forked children."""
        self.__enter__()
        os.register_at_fork(after_in_child=self._forked)
        return self

    def _forked(self) -> None:
        """In a forked child (a DataLoader worker): no limit, and out of the thread's modes."""
        self._active = False
        try:
            from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode

            if _get_current_dispatch_mode() is self:
                _pop_mode()
        except Exception:
            pass

    # -- the limit ------------------------------------------------------------------------------

    def _admit(self, nbytes: int, func: Any) -> None:
        limit = self.limit_bytes
        if limit is None or self._in_oom or self._live + nbytes <= limit or not self._active:
            return
        self.num_ooms += 1
        message: str | None = None
        self._in_oom = True
        try:
            if self._on_oom is not None:
                try:
                    message = self._on_oom(self, nbytes)
                except Exception:  # the flow must never replace the job's error
                    message = None
        finally:
            self._in_oom = False
        import torch

        # torch.OutOfMemoryError from torch 2.5; the same class as torch.cuda's before.
        error = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
        raise error(message or oom_message(nbytes, limit, self._live))

    # -- sites ----------------------------------------------------------------------------------

    def _site(self) -> Stack | None:
        """The stack of the job's code that allocated, innermost first: torch's innermost two
        frames, the job's frame, and the job's callers. Interned: a loop allocates from the
        same few stacks, and each stack is kept once."""
        frame = sys._getframe(2)
        context: list[tuple[str, int, str]] = []
        frames: list[tuple[str, int, str]] = []
        kinds = self._code_kind
        while frame is not None:
            code = frame.f_code
            kind = kinds.get(code)
            if kind is None:
                kind = kinds[code] = self._kind(code.co_filename)
            if frames:
                if kind == _PLUMBING_KIND:
                    break  # torchtop's bootstrap and runpy: outside the job's code
                # Torch's frames between the job's own (Module._call_impl) tell nothing.
                if kind == _USER:
                    frames.append((code.co_filename, frame.f_lineno, code.co_name))
                    if len(frames) >= RECORDED_FRAMES:
                        break
            elif kind == _USER:
                frames = [*context, (code.co_filename, frame.f_lineno, code.co_name)]
            elif (
                kind == _LIBRARY
                and len(context) < CONTEXT_FRAMES
                and code.co_name not in PASS_THROUGH
            ):
                context.append((code.co_filename, frame.f_lineno, code.co_name))
            frame = frame.f_back  # type: ignore[assignment]
        if not frames:
            frames = list(context)
        if not frames:
            return None
        stack = tuple(frames)
        return self._stacks.setdefault(stack, stack)

    def _kind(self, filename: str) -> int:
        """Whether a code object's frames are the job's, torch's worth showing, or plumbing."""
        if not is_library_frame(filename, self._torch_dir):
            return _USER
        if (
            filename.startswith(_TORCHTOP_DIR)
            or filename.startswith("<frozen runpy")
            or any(m in filename for m in _PLUMBING)
        ):
            return _PLUMBING_KIND
        return _LIBRARY

    # -- history --------------------------------------------------------------------------------

    def _add(self, storage: Any, key: tuple[str, int], nbytes: int) -> None:
        super()._add(storage, key, nbytes)
        if self._trace is not None:
            entry = self._by_object.get(id(storage))
            site = entry.site if entry is not None else None
            self._trace.append(("alloc", key[1], nbytes, site, time.time_ns() // 1000))

    def _release(self, entry: _Entry, object_id: int) -> None:
        key, nbytes, site = entry.key, entry.nbytes, entry.site
        super()._release(entry, object_id)
        if self._trace is not None and key is not None:
            now = time.time_ns() // 1000
            self._trace.append(("free_requested", key[1], nbytes, site, now))
            self._trace.append(("free_completed", key[1], nbytes, site, now))

    def note_oom(self, requested: int, free: int, site: Stack | None) -> None:
        """Put the failure in the history, as the CUDA allocator does."""
        if self._trace is not None:
            self._trace.append(("oom", free, requested, site, time.time_ns() // 1000))

    # -- reading ----------------------------------------------------------------------------------

    def stats(self, base: MemoryStats | None) -> MemoryStats:
        """The emulated device's sample: exact live tensor bytes against the limit. ``reserved``
        is the process RSS, as on any CPU job."""
        live = self._live
        limit = self.limit_bytes
        return MemoryStats(
            device=base.device if base is not None else "cpu",
            source=SOURCE_TENSORS,
            allocated_bytes=live,
            reserved_bytes=base.reserved_bytes if base is not None else None,
            peak_allocated_bytes=self._peak,
            peak_reserved_bytes=base.peak_reserved_bytes if base is not None else None,
            num_ooms=self.num_ooms,
            free_bytes=max(0, limit - live) if limit is not None else None,
            total_bytes=limit,
        )

    def snapshot(self, trace_entries: int | None = None) -> dict[str, Any]:
        """Live storages and recent history in the format of ``torch.cuda.memory._snapshot()``.

        The CPU has no caching allocator: each live storage is a segment holding one
        ``active_allocated`` block, so reserved equals allocated and nothing is fragmented.
        """
        with self._lock:
            entries = [(e.key, e.nbytes, e.site) for e in self._by_object.values()]
            history = list(self._trace) if self._trace is not None else []
        if trace_entries is not None:
            history = history[-trace_entries:] if trace_entries > 0 else []
        frames_of: dict[Stack | None, list[dict[str, Any]]] = {}

        def frames(stack: Stack | None) -> list[dict[str, Any]]:
            # One list per stack: pickle stores a shared object once.
            found = frames_of.get(stack)
            if found is None:
                found = [{"filename": f, "line": n, "name": fn} for f, n, fn in stack or ()]
                frames_of[stack] = found
            return found

        segments = []
        for key, nbytes, site in entries:
            if key is None or nbytes <= 0:
                continue
            address = key[1]
            block = {
                "address": address,
                "size": nbytes,
                "requested_size": nbytes,
                "state": "active_allocated",
                "frames": frames(site),
            }
            segments.append(
                {
                    "device": 0,
                    "address": address,
                    "total_size": nbytes,
                    "allocated_size": nbytes,
                    "active_size": nbytes,
                    "requested_size": nbytes,
                    "stream": 0,
                    "segment_type": "large" if nbytes > SMALL_REQUEST_BYTES else "small",
                    "segment_pool_id": (0, 0),
                    "is_expandable": False,
                    "frames": [],
                    "blocks": [block],
                }
            )
        segments.sort(key=lambda s: s["address"])
        trace = []
        for action, addr, size, site, time_us in history:
            entry: dict[str, Any] = {
                "action": action,
                "size": size,
                "stream": 0,
                "time_us": time_us,
                "frames": frames(site),
            }
            if action == "oom":
                entry["device_free"] = addr
            else:
                entry["addr"] = addr
            trace.append(entry)
        return {"segments": segments, "device_traces": [trace]}
