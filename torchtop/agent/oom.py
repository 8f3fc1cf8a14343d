"""The out-of-memory flow: capture at the moment of failure, explain it, save it, and pause.

On CUDA, :class:`OomController` has the caching allocator record its history (bounded:
``torch.cuda.memory._record_memory_history(max_entries=N, stacks="python", context="alloc")``)
and attaches an out-of-memory observer. Both are installed through ``torch.cuda._lazy_call``,
so they take effect when the job itself initializes CUDA, before its first allocation, and the
agent never initializes CUDA on its own. Recording is never switched off again:
``_record_memory_history(enabled=None)`` would leave the allocator's hooks behind.

The allocator calls the observer in the thread that failed, after it has given back what cache
it could and before it raises: the flow reads the snapshot there, so the live blocks are the
ones that caused the failure. Under ``--memory-limit`` the CPU emulation
(:mod:`torchtop.agent.memory_limit`) calls the same flow from its dispatch mode.

The flow: group the live blocks by the job's allocating line, tell *fragmented* from *full*,
save the snapshot (a pickle memory_viz opens), publish an ``oom`` event, and with
``--pause-on-oom`` hold the job until a viewer sends ``resume`` or the timeout passes. Then the
job's own ``OutOfMemoryError`` goes on unchanged: nothing here raises into the job.

The observer may run more than once for one failure (and a job may catch an OOM and retry):
calls for the same device and size within :data:`REPEAT_WINDOW_S` count as one failure, and at
most ``max_captures`` failures per run are captured in full.

Viewer requests (``snapshot``, ``resume``) arrive on the server's I/O thread, which only hands
them over: a snapshot is taken in this module's own worker thread.

This module imports torch only inside functions that run once the job has imported it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.abc
import itertools
import queue
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from torchtop.agent.memory_snapshot import (
    save_snapshot,
    site_stack,
    top_sites,
    totals,
    verdict,
)
from torchtop.protocol import (
    MAX_FRAME_BYTES,
    REQUEST_RESUME,
    REQUEST_SNAPSHOT,
    MemoryCapture,
    MemorySnapshotTaken,
    MemoryStats,
    Message,
    OomResumed,
    OutOfMemory,
    ProbeStatus,
    Request,
    encode,
)

#: Observer calls for the same device and size this close together are one failure.
REPEAT_WINDOW_S = 2.0
#: The probe name under which a failure to set up capture is reported.
PROBE_NAME = "oom_capture"


def _torch_imported() -> bool:
    module = sys.modules.get("torch")
    spec = getattr(module, "__spec__", None)
    return module is not None and not getattr(spec, "_initializing", False)


class OomController:
    """The agent's out-of-memory capture, memory emulation and snapshot requests.

    ``config`` is the agent's :class:`~torchtop.agent.core.AgentConfig`; ``publish`` sends a
    message to the viewers; ``flush_events`` publishes the phases and marks the training thread
    has queued, so that viewers know the phase an OOM happened in.
    """

    def __init__(
        self,
        config: Any,
        publish: Callable[[Message], None],
        *,
        pid: int,
        snapshot_dir: Path,
        flush_events: Callable[[], None] = lambda: None,
    ) -> None:
        self.config = config
        self._publish = publish
        self._flush_events = flush_events
        self.snapshot_dir = Path(config.snapshot_dir) if config.snapshot_dir else snapshot_dir
        self.snapshot_prefix = (
            config.snapshot_prefix if config.snapshot_prefix is not None else f"{pid}-"
        )
        #: The CPU emulation's tracker, once installed.
        self.tracker: Any = None
        self.cuda_installed = False
        #: ``snapshot``/``stats``/``grad_enabled`` for :meth:`cuda_oom` (tests: fixtures).
        self.cuda_sources: dict[str, Any] = {}
        self.captures = 0
        self.repeats = 0
        self._cuda_armed = False
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._last_failure: tuple[str, int, float] | None = None
        self._resume = threading.Event()
        self._requests: queue.SimpleQueue[Request | None] = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._work, name="torchtop-oom", daemon=True)
        self._stopping = False

    # -- life cycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Set up in the calling thread (the job's): the emulation, then CUDA capture."""
        if self.config.memory_limit_bytes is not None:
            try:
                self.install_memory_limit()
            except Exception as exc:
                self._report(f"the --memory-limit emulation could not start: {exc!r}")
        if self.config.oom_capture:
            if _torch_imported():
                self._arm_cuda()
            else:
                _arm_after_import("torch.cuda", self._arm_cuda_module)
        self._worker.start()

    def stop(self) -> None:
        self._stopping = True
        self._resume.set()  # never leave a job paused behind us
        self._requests.put(None)

    def install_memory_limit(self) -> None:
        """Enter the emulation's tracker in this thread (imports torch: the user asked for it)."""
        from torchtop.agent.memory_limit import MemoryLimitTracker

        tracker = MemoryLimitTracker(
            self.config.memory_limit_bytes,
            on_oom=self._emulated_oom,
            trace_entries=max(0, int(self.config.oom_history_entries)),
        )
        self.tracker = tracker.install()

    def cpu_probe(self, probe: Any) -> Any:
        """The CPU memory probe, or under ``--memory-limit`` one that reports the emulated
        device: exact live tensor bytes against the limit."""
        if self.config.memory_limit_bytes is None:
            return probe
        return _EmulatedDeviceProbe(probe, self)

    # -- requests (any thread; cheap) ---------------------------------------------------------

    def handle_request(self, request: Request) -> None:
        """Called by the server's I/O thread: hand the request over and return."""
        if request.action == REQUEST_RESUME:
            self._resume.set()
        elif request.action == REQUEST_SNAPSHOT:
            self._requests.put(request)
        # Actions this agent does not know are ignored: a newer viewer may send more.

    def _work(self) -> None:
        while not self._stopping:
            # Until CUDA capture is armed, look for torch every 0.2 s; then only wait for work.
            waiting = self.config.oom_capture and not self._cuda_armed
            try:
                request = self._requests.get(timeout=0.2 if waiting else None)
            except queue.Empty:
                request = None
            if not self._cuda_armed and self.config.oom_capture and _torch_imported():
                self._arm_cuda()  # torch came in some way the import hook did not see
            if request is None:
                continue
            try:
                self.snapshot_now(request.id)
            except Exception as exc:  # never let a request take the worker down
                self._report(f"snapshot failed: {exc!r}")

    # -- CUDA -----------------------------------------------------------------------------------

    def _arm_cuda(self) -> None:
        try:
            cuda = sys.modules.get("torch.cuda")
            if cuda is None:
                import torch.cuda as cuda
        except Exception:
            return
        self._arm_cuda_module(cuda)

    def _arm_cuda_module(self, cuda: Any) -> None:
        with self._lock:
            if self._cuda_armed:
                return
            self._cuda_armed = True
        lazy_call = getattr(cuda, "_lazy_call", None)
        if lazy_call is None:
            self._report("this PyTorch has no torch.cuda._lazy_call")
            return
        # Runs when the job initializes CUDA (at once if it already has). An exception from a
        # queued call would break the job's CUDA initialization, so it never raises.
        lazy_call(lambda: self.install_cuda(cuda))

    def install_cuda(self, cuda: Any, c_api: Any = None) -> None:
        """Record the allocator's history and attach the observer. Runs inside the job's CUDA
        initialization (``cuda`` is ``torch.cuda``, ``c_api`` ``torch._C``); never raises."""
        try:
            if self.cuda_installed:
                return
            self.cuda_installed = True
            if c_api is None:
                c_api = sys.modules["torch"]._C
            entries = int(self.config.oom_history_entries)
            cuda.memory._record_memory_history(
                enabled="all" if entries > 0 else "state",
                context="alloc",
                stacks="python",
                max_entries=max(1, entries),
            )
            attach = getattr(c_api, "_cuda_attach_out_of_memory_observer", None)
            if attach is None:
                self._report("this PyTorch has no out-of-memory observer; OOMs are not captured")
                return
            attach(self.observe_cuda_oom)
        except Exception as exc:
            self._report(f"could not set up CUDA OOM capture: {exc!r}")

    def observe_cuda_oom(
        self, device: int, alloc: int, device_total: int, device_free: int
    ) -> None:
        """The allocator's observer: ``(device, bytes requested, the device's total memory or
        the allowed maximum under set_per_process_memory_fraction, free bytes as
        cudaMemGetInfo reports)``. Never raises: that would replace the job's error."""
        try:
            self.cuda_oom(
                int(device), int(alloc), int(device_total), int(device_free), **self.cuda_sources
            )
        except Exception:
            pass

    def cuda_oom(
        self,
        device: int,
        requested: int,
        total: int,
        free: int,
        *,
        snapshot: Callable[[], Mapping[str, Any]] | None = None,
        stats: Callable[[int], Mapping[str, Any]] | None = None,
        grad_enabled: Callable[[], bool] | None = None,
    ) -> OutOfMemory | None:
        """The flow for a CUDA failure. ``snapshot``, ``stats`` and ``grad_enabled`` default to
        torch's (``_snapshot``, ``memory_stats``, ``is_grad_enabled``); tests pass fixtures."""
        if snapshot is None or stats is None or grad_enabled is None:
            import torch

            snapshot = snapshot or torch.cuda.memory._snapshot
            stats = stats or torch.cuda.memory_stats
            grad_enabled = grad_enabled or torch.is_grad_enabled
        label = f"cuda:{device}"
        read_stats = stats

        def figures(snap: Mapping[str, Any]) -> tuple[int | None, int | None]:
            try:
                counters = read_stats(device)
                return (
                    _int(counters.get("allocated_bytes.all.current")),
                    _int(counters.get("reserved_bytes.all.current")),
                )
            except Exception:
                return None, None

        return self._failure(
            device=label,
            index=device,
            emulated=False,
            requested=requested,
            free=free,
            total=total,
            take_snapshot=snapshot,
            figures=figures,
            grad_enabled=grad_enabled,
            message="",
        )

    # -- the CPU emulation -----------------------------------------------------------------------

    def _emulated_oom(self, tracker: Any, requested: int) -> str:
        import torch

        from torchtop.agent.memory_limit import oom_message

        limit = int(tracker.limit_bytes)
        live = int(tracker.live_bytes)
        free = max(0, limit - live)
        message = oom_message(requested, limit, live)
        tracker.note_oom(requested, free, tracker._site())
        self._failure(
            device="cpu",
            index=0,
            emulated=True,
            requested=requested,
            free=free,
            total=limit,
            take_snapshot=tracker.snapshot,
            figures=lambda _snap: (live, live),
            grad_enabled=torch.is_grad_enabled,
            message=message,
        )
        return message

    # -- the flow ----------------------------------------------------------------------------------

    def _failure(
        self,
        *,
        device: str,
        index: int,
        emulated: bool,
        requested: int,
        free: int | None,
        total: int | None,
        take_snapshot: Callable[[], Mapping[str, Any]],
        figures: Callable[[Mapping[str, Any]], tuple[int | None, int | None]],
        grad_enabled: Callable[[], bool],
        message: str,
    ) -> OutOfMemory | None:
        now = time.monotonic()
        with self._lock:
            last = self._last_failure
            if (
                last is not None
                and last[:2] == (device, requested)
                and now - last[2] < (REPEAT_WINDOW_S)
            ):
                self.repeats += 1
                return None
            self._last_failure = (device, requested, now)
            self.captures += 1
            full = self.captures <= int(self.config.max_captures)
        capture_id = next(self._ids)
        with contextlib.suppress(Exception):
            self._flush_events()
        grad: bool | None = None
        with contextlib.suppress(Exception):
            grad = bool(grad_enabled())
        body = self._capture(
            capture_id,
            device=device,
            index=index,
            emulated=emulated,
            requested=requested,
            free=free,
            total=total,
            take_snapshot=take_snapshot if full else None,
            figures=figures,
            name=f"oom-{capture_id}",
        )
        if not full:
            body = replace(
                body,
                snapshot_error=f"not captured: at most {self.config.max_captures} per run",
            )
        paused = bool(self.config.pause_on_oom) and not self._stopping
        timeout = float(self.config.pause_timeout_s)
        event = OutOfMemory(
            **{**_fields(body), "grad_enabled": grad},
            message=message,
            paused=paused,
            pause_timeout_s=timeout if paused else None,
        )
        if paused:
            self._resume.clear()
        self._send(event)
        if paused:
            # Hold the job at the failure so its live memory can be explored. Event.wait lets
            # Ctrl-C through, and ends by itself after the timeout, viewer or not.
            dismissed = self._resume.wait(timeout)
            self._send(
                OomResumed(
                    t=time.time(), id=capture_id, reason="dismissed" if dismissed else "timeout"
                )
            )
        return event

    def snapshot_now(self, request_id: int = 0) -> MemorySnapshotTaken:
        """A snapshot on request: the emulated device's, or CUDA's once the job uses it."""
        capture_id = next(self._ids)
        tracker = self.tracker
        body: MemoryCapture
        if tracker is not None:
            live = int(tracker.live_bytes)
            limit = tracker.limit_bytes
            body = self._capture(
                capture_id,
                device="cpu",
                index=0,
                emulated=True,
                requested=None,
                free=max(0, limit - live) if limit is not None else None,
                total=limit,
                take_snapshot=tracker.snapshot,
                figures=lambda _snap: (live, live),
                name=f"snapshot-{capture_id}",
            )
        elif self._cuda_ready():
            body = self._cuda_snapshot(capture_id)
        else:
            body = _empty_capture(
                capture_id,
                "nothing to snapshot: the job has not used CUDA, and no --memory-limit "
                "emulation is on",
            )
        taken = MemorySnapshotTaken(**_fields(body), request_id=request_id)
        self._send(taken)
        return taken

    def _cuda_ready(self) -> bool:
        if not _torch_imported():
            return False
        cuda = sys.modules.get("torch.cuda")
        try:
            return cuda is not None and bool(cuda.is_initialized())
        except Exception:
            return False

    def _cuda_snapshot(self, capture_id: int) -> MemoryCapture:
        import torch

        snap = torch.cuda.memory._snapshot()
        reserved_by_device: dict[int, int] = {}
        for segment in snap.get("segments", ()):
            index = int(segment.get("device", 0))
            reserved_by_device[index] = reserved_by_device.get(index, 0) + int(
                segment.get("total_size", 0)
            )
        index = max(reserved_by_device, key=lambda d: reserved_by_device[d], default=0)
        free = total = None
        if reserved_by_device:
            with contextlib.suppress(Exception):
                free, total = (int(v) for v in torch.cuda.mem_get_info(index))

        def figures(_snap: Mapping[str, Any]) -> tuple[int | None, int | None]:
            counters = torch.cuda.memory_stats(index)
            return (
                _int(counters.get("allocated_bytes.all.current")),
                _int(counters.get("reserved_bytes.all.current")),
            )

        return self._capture(
            capture_id,
            device=f"cuda:{index}",
            index=index,
            emulated=False,
            requested=None,
            free=free,
            total=total,
            take_snapshot=lambda: snap,
            figures=figures,
            name=f"snapshot-{capture_id}",
        )

    def _capture(
        self,
        capture_id: int,
        *,
        device: str,
        index: int,
        emulated: bool,
        requested: int | None,
        free: int | None,
        total: int | None,
        take_snapshot: Callable[[], Mapping[str, Any]] | None,
        figures: Callable[[Mapping[str, Any]], tuple[int | None, int | None]],
        name: str,
    ) -> MemoryCapture:
        """Read, analyse and save one snapshot. Every step may fail on its own and says so in
        ``snapshot_error``; the figures that could be read are still sent."""
        error = ""
        snap: Mapping[str, Any] = {"segments": [], "device_traces": []}
        if take_snapshot is not None:
            try:
                snap = take_snapshot()
            except Exception as exc:
                error = f"no snapshot: {exc!r}"
        mine = _for_device(snap, index)
        sums = totals(mine, requested)
        sites, live = top_sites(mine)
        allocated, reserved = None, None
        with contextlib.suppress(Exception):
            allocated, reserved = figures(mine)
        if allocated is None and mine.get("segments"):
            allocated = sums.allocated
        if reserved is None and mine.get("segments"):
            reserved = sums.reserved
        path: str | None = None
        if take_snapshot is not None and not error:
            target = self.snapshot_dir / f"{self.snapshot_prefix}{name}.pickle"
            try:
                save_snapshot(
                    snap,
                    target,
                    trace_entries=int(self.config.snapshot_trace_entries),
                    max_bytes=int(self.config.snapshot_max_bytes),
                )
                path = str(target)
            except Exception as exc:
                error = f"could not save the snapshot to {target}: {exc}"
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
            fragmented=verdict(requested, free, sums) if requested is not None else None,
            top_sites=sites,
            snapshot_path=path,
            snapshot_error=error,
            live_count=live,
            requested_stack=_failed_stack(snap, index) if requested is not None else [],
        )

    # -- sending -----------------------------------------------------------------------------------

    def _send(self, message: Message) -> None:
        self._publish(_fit(message))

    def _report(self, detail: str) -> None:
        with contextlib.suppress(Exception):
            self._publish(
                ProbeStatus(t=time.time(), probe=PROBE_NAME, available=False, detail=detail)
            )


# -- helpers --------------------------------------------------------------------------------------


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


class _EmulatedDeviceProbe:
    """The CPU memory probe under ``--memory-limit``: the emulated device's exact figures."""

    def __init__(self, base: Any, controller: OomController) -> None:
        self._base = base
        self._controller = controller

    def read(self, rss: int | None) -> MemoryStats | None:
        base: MemoryStats | None
        try:
            base = self._base.read(rss)
        except Exception:
            base = None
        tracker = self._controller.tracker
        if tracker is None:
            return base
        stats: MemoryStats = tracker.stats(base)
        return stats


class _ArmAfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback(module)`` right after module ``name`` has been executed, once.

    It finds the module with the other finders and wraps only that module's loader instance
    for the one ``exec_module`` call, so the module keeps its own loader.
    """

    def __init__(self, name: str, callback: Callable[[Any], None]) -> None:
        self.name = name
        self.callback = callback

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            return None
        spec = None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        original = getattr(loader, "exec_module", None)
        if original is None:
            return spec
        callback = self.callback

        def exec_module(module: Any) -> None:
            try:
                original(module)
            finally:
                try:
                    del loader.exec_module  # type: ignore[union-attr]
                except AttributeError:
                    pass
            with contextlib.suppress(Exception):
                callback(module)

        try:
            loader.exec_module = exec_module  # type: ignore[union-attr]
        except (AttributeError, TypeError):
            pass  # the worker thread arms it once torch is imported
        return spec


def _arm_after_import(name: str, callback: Callable[[Any], None]) -> None:
    if name in sys.modules:
        callback(sys.modules[name])
        return
    sys.meta_path.insert(0, _ArmAfterImport(name, callback))
