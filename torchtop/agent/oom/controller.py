"""The out-of-memory controller: capture at the moment of failure, in the thread that failed;
snapshots on request, in its own worker thread; and the job held with ``--pause-on-oom``.

See :mod:`torchtop.agent.oom` for the flow. This module imports torch only inside functions
that run once the job has imported it.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from torchtop.agent.holders import read_now
from torchtop.agent.memory_snapshot import failed_request, save_snapshot, site_stack
from torchtop.agent.oom.capture import (
    _empty_capture,
    _fields,
    _fit,
    _int,
    _read,
    _reason,
    analyse_snapshot,
)
from torchtop.agent.oom.import_hook import _arm_after_import
from torchtop.agent.oom.watch import (
    _WAKE,
    BACKWARD_POLL_S,
    _backward_threads,
    _BackwardWatch,
    _frames_of,
    _Pending,
    _python_frames,
    _training_thread,
    _Watch,
    _went_on,
)
from torchtop.agent.probes.cuda_memory import free_under_cap
from torchtop.agent.threads import agent_thread
from torchtop.protocol import (
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
)

#: Failures reaching the job for the same device and size this close together are published once.
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
        #: Failures torch handled itself, per device (``cuda:N``): the job never saw them.
        self.handled: dict[str, int] = {}
        self.history_recorded = False
        #: Per thread, the failure being followed there (see :class:`_Watch`).
        self._pending_here: dict[int, _Watch] = {}
        #: Failures in backward, until backward ends (see :meth:`_resolve_backward`).
        self._backward: list[_BackwardWatch] = []
        self._cuda_armed = False
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        #: The last failure published: device, requested bytes, monotonic time.
        self._last_published: tuple[str, int | None, float] | None = None
        self._resume = threading.Event()
        self._requests: queue.SimpleQueue[Request | None] = queue.SimpleQueue()
        self._worker = agent_thread(self._work, "torchtop-oom")
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
            # While a backward failure waits to be resolved, look every BACKWARD_POLL_S.
            waiting = self.config.oom_capture and not self._cuda_armed
            timeout = BACKWARD_POLL_S if self._backward else (0.2 if waiting else None)
            try:
                request = self._requests.get(timeout=timeout)
            except queue.Empty:
                request = None
            if not self._cuda_armed and self.config.oom_capture and _torch_imported():
                self._arm_cuda()  # torch came in some way the import hook did not see
            if self._backward:
                try:
                    self._resolve_backward()
                except Exception as exc:
                    self._report(f"a failure in backward could not be followed: {exc!r}")
            if request is None or request is _WAKE:
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
        """Record the allocator's history and attach the observer, each on its own: one that
        cannot be set up (history on the ``cudaMallocAsync`` backend) is reported and leaves
        the other in place. Runs inside the job's CUDA initialization (``cuda`` is
        ``torch.cuda``, ``c_api`` ``torch._C``); never raises."""
        if self.cuda_installed:
            return
        self.cuda_installed = True
        try:
            if c_api is None:
                c_api = sys.modules["torch"]._C
        except Exception as exc:
            self._report(f"CUDA OOM capture is off: torch._C cannot be read ({exc!r})")
            return
        entries = int(self.config.oom_history_entries)
        try:
            cuda.memory._record_memory_history(
                enabled="all" if entries > 0 else "state",
                context="alloc",
                stacks="python",
                max_entries=max(1, entries),
            )
            self.history_recorded = True
        except Exception as exc:
            self._report(
                "allocation history is unavailable, so OOM captures show sizes without the "
                f"lines that allocated ({_reason(exc)}); the OOM observer is still attached"
            )
        attach = getattr(c_api, "_cuda_attach_out_of_memory_observer", None)
        if attach is None:
            self._report(
                "the OOM observer is unavailable: this PyTorch has no "
                "torch._C._cuda_attach_out_of_memory_observer; OOMs are not captured"
            )
            return
        try:
            attach(self.observe_cuda_oom)
        except Exception as exc:
            self._report(f"the OOM observer could not be attached ({_reason(exc)})")

    def observe_cuda_oom(
        self, device: int, alloc: int, device_total: int, device_free: int
    ) -> None:
        """The allocator's observer: ``(device, the size of the segment it tried to get, the
        device's total memory or the allowed maximum under set_per_process_memory_fraction,
        free bytes as cudaMemGetInfo reports)``. Never raises: that would replace the job's
        error."""
        try:
            self.cuda_oom(
                int(device), int(alloc), int(device_total), int(device_free), **self.cuda_sources
            )
        except Exception:
            pass

    def cuda_oom(
        self,
        device: int,
        alloc: int,
        total: int,
        free: int,
        *,
        snapshot: Callable[[], Mapping[str, Any]] | None = None,
        stats: Callable[[int], Mapping[str, Any]] | None = None,
        grad_enabled: Callable[[], bool] | None = None,
    ) -> OutOfMemory | None:
        """The flow for a CUDA failure, in the thread that failed. ``snapshot``, ``stats`` and
        ``grad_enabled`` default to torch's (``_snapshot``, ``memory_stats``,
        ``is_grad_enabled``); tests pass fixtures.

        The failure is captured now, while its memory is live, but published only once it
        reaches the job's code (see :class:`_Watch`); one that torch handles itself is counted
        in :attr:`handled`. Returns the event when it was published at once."""
        if snapshot is None or stats is None or grad_enabled is None:
            import torch

            snapshot = snapshot or torch.cuda.memory._snapshot
            stats = stats or torch.cuda.memory_stats
            grad_enabled = grad_enabled or torch.is_grad_enabled
        snap: Mapping[str, Any] = {"segments": [], "device_traces": []}
        error = ""
        try:
            snap = snapshot()
        except Exception as exc:
            error = f"no snapshot: {exc!r}"
        counters: Mapping[str, Any] = {}
        with contextlib.suppress(Exception):
            counters = stats(device)
        allocated = _int(counters.get("allocated_bytes.all.current"))
        reserved = _int(counters.get("reserved_bytes.all.current"))
        request = failed_request(snap, device)
        requested = request.size if request is not None else alloc
        # Under set_per_process_memory_fraction, total is the cap (else the device's total).
        free = free_under_cap(free, total, reserved)
        # A thread with Python frames is followed there; one without (the autograd engine's)
        # fails in a backward that the training thread waits for.
        job_frames = _python_frames(sys._getframe(1))
        training = None if job_frames else _training_thread()
        in_backward = training is not None
        pending = self._observe(
            device=f"cuda:{device}",
            index=device,
            emulated=False,
            requested=requested,
            stream=request.stream if request is not None else None,
            free=free,
            total=total,
            snap=snap,
            error=error,
            figures=lambda _snap: (allocated, reserved),
            grad_enabled=None if in_backward else grad_enabled,
            message="",
            segment=alloc,
        )
        if in_backward:
            pending.capture = replace(
                pending.capture,
                in_backward=True,
                requested_stack=(
                    site_stack(_frames_of(training[1])) if training is not None else []
                ),
            )
        with self._lock:
            earlier = self._pending_here.pop(threading.get_ident(), None)
        if earlier is not None and not earlier.done:
            # A second failure in the same thread before the first reached the job's code:
            # torch caught the first and retried (cuDNN halves its workspace and asks again).
            earlier.done = True
            self._count_handled(earlier.pending.capture.device)
        if job_frames:
            watch = _Watch(self._watch_finished, pending, job_frames)
            with self._lock:
                self._pending_here[threading.get_ident()] = watch
            watch.arm()
            return None
        if training is not None:
            # Backward: the engine's thread runs no Python. The training thread waits in
            # autograd's run_backward; the worker resolves the failure once it comes out.
            with self._lock:
                self._backward.append(
                    _BackwardWatch(
                        pending,
                        training[0],
                        index=device,
                        time_us=request.time_us if request is not None else None,
                        stream=pending.stream,
                    )
                )
            self._requests.put(_WAKE)
            return None
        return self._publish_failure(pending, pause=True)

    # -- the CPU emulation -----------------------------------------------------------------------

    def _emulated_oom(self, tracker: Any, requested: int) -> str:
        import torch

        from torchtop.agent.memory_limit import oom_message

        limit = int(tracker.limit_bytes)
        live = int(tracker.live_bytes)
        free = max(0, limit - live)
        message = oom_message(requested, limit, live)
        tracker.note_oom(requested, free, tracker._site())
        snap: Mapping[str, Any] = {"segments": [], "device_traces": []}
        error = ""
        try:
            snap = tracker.snapshot()
        except Exception as exc:
            error = f"no snapshot: {exc!r}"
        pending = self._observe(
            device="cpu",
            index=0,
            emulated=True,
            requested=requested,
            stream=None,
            free=free,
            total=limit,
            snap=snap,
            error=error,
            figures=lambda _snap: (live, live),
            grad_enabled=torch.is_grad_enabled,
            message=message,
        )
        # The emulation raises the error itself, in the job's own call: it always reaches it.
        self._publish_failure(pending, pause=True)
        return message

    # -- the flow ----------------------------------------------------------------------------------

    def _observe(
        self,
        *,
        device: str,
        index: int,
        emulated: bool,
        requested: int,
        stream: int | None,
        free: int | None,
        total: int | None,
        snap: Mapping[str, Any],
        error: str,
        figures: Callable[[Mapping[str, Any]], tuple[int | None, int | None]],
        grad_enabled: Callable[[], bool] | None,
        message: str,
        segment: int | None = None,
    ) -> _Pending:
        """Read what the failure shows at its moment. Every failure is followed, a repeat
        too: whether torch handled it or not, the allocator counted it."""
        grad: bool | None = None
        if grad_enabled is not None:
            with contextlib.suppress(Exception):
                grad = bool(grad_enabled())
        capture = analyse_snapshot(
            0,
            device=device,
            index=index,
            emulated=emulated,
            requested=requested,
            stream=stream,
            free=free,
            total=total,
            snap=snap,
            error=error,
            figures=figures,
            segment=segment,
            holders=read_now(),
        )
        return _Pending(replace(capture, grad_enabled=grad), snap, message, stream)

    def _publish_failure(self, pending: _Pending, *, pause: bool) -> OutOfMemory | None:
        """The failure reached the job: save its snapshot, tell the viewers, and with
        ``--pause-on-oom`` hold the calling thread (the job's, when ``pause``)."""
        if pending.done:
            return None
        pending.done = True
        failure = (pending.capture.device, pending.capture.requested_bytes, time.monotonic())
        with self._lock:
            last = self._last_published
            self._last_published = failure
            if (
                last is not None
                and last[:2] == failure[:2]
                and failure[2] - last[2] < (REPEAT_WINDOW_S)
            ):
                # The same failure again (a job that catches its OOM and retries): counted,
                # not published again.
                self.repeats += 1
                return None
            self.captures += 1
            full = self.captures <= int(self.config.max_captures)
        capture_id = next(self._ids)
        with contextlib.suppress(Exception):
            self._flush_events()
        body = replace(pending.capture, id=capture_id, t=time.time())
        if not full:
            body = replace(
                body, snapshot_error=f"not captured: at most {self.config.max_captures} per run"
            )
        elif not body.snapshot_error:
            body = self._save(body, pending.snap, f"oom-{capture_id}")
        paused = pause and bool(self.config.pause_on_oom) and not self._stopping
        timeout = float(self.config.pause_timeout_s)
        event = OutOfMemory(
            **_fields(body),
            message=pending.message,
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

    def _count_handled(self, device: str) -> None:
        with self._lock:
            self.handled[device] = self.handled.get(device, 0) + 1

    def handled_ooms(self, device: str) -> int:
        """How many failures on ``device`` torch handled itself (the job never saw them)."""
        return self.handled.get(device, 0)

    def _resolve_backward(self, snapshot: Callable[[], Mapping[str, Any]] | None = None) -> None:
        """Resolve backward failures whose training thread has left ``run_backward``.

        The engine's threads allocate without Python frames; the training thread, once out of
        backward, with its own. So an allocation without frames on the failing stream after
        the failure means backward went on: torch handled it (cuDNN's smaller workspace).
        Without one, backward ended by the failure, and the error reached the job."""
        with self._lock:
            watches = list(self._backward)
        if not watches:
            return
        running = _backward_threads()
        finished = [w for w in watches if w.thread not in running]
        if not finished:
            return
        snap: Mapping[str, Any] = {}
        try:
            if snapshot is None:
                snapshot = self.cuda_sources.get("snapshot")
            if snapshot is None:
                import torch

                snapshot = torch.cuda.memory._snapshot
            snap = snapshot()
        except Exception:
            snap = {}
        for watch in finished:
            with self._lock, contextlib.suppress(ValueError):
                self._backward.remove(watch)
            if _went_on(snap, watch):
                watch.pending.done = True
                self._count_handled(watch.pending.capture.device)
            else:
                self._publish_failure(watch.pending, pause=False)

    def snapshot_now(self, request_id: int = 0) -> MemorySnapshotTaken:
        """A snapshot on request: the emulated device's, or CUDA's once the job uses it."""
        capture_id = next(self._ids)
        tracker = self.tracker
        body: MemoryCapture
        if tracker is not None:
            live = int(tracker.live_bytes)
            limit = tracker.limit_bytes
            snap, error = _read(tracker.snapshot)
            body = analyse_snapshot(
                capture_id,
                device="cpu",
                index=0,
                emulated=True,
                requested=None,
                stream=None,
                free=max(0, limit - live) if limit is not None else None,
                total=limit,
                snap=snap,
                error=error,
                figures=lambda _snap: (live, live),
                holders=read_now(),
            )
            if not error:
                body = self._save(body, snap, f"snapshot-{capture_id}")
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

        body = analyse_snapshot(
            capture_id,
            device=f"cuda:{index}",
            index=index,
            emulated=False,
            requested=None,
            stream=None,
            free=free,
            total=total,
            snap=snap,
            error="",
            figures=figures,
            holders=read_now(),
        )
        return self._save(body, snap, f"snapshot-{capture_id}")

    def _save(self, body: MemoryCapture, snap: Mapping[str, Any], name: str) -> MemoryCapture:
        """Write the snapshot as a pickle memory_viz opens; the capture says where, or why not."""
        target = self.snapshot_dir / f"{self.snapshot_prefix}{name}.pickle"
        try:
            save_snapshot(
                snap,
                target,
                trace_entries=int(self.config.snapshot_trace_entries),
                max_bytes=int(self.config.snapshot_max_bytes),
            )
        except Exception as exc:
            return replace(body, snapshot_error=f"could not save the snapshot to {target}: {exc}")
        return replace(body, snapshot_path=str(target))

    # -- sending -----------------------------------------------------------------------------------

    def _send(self, message: Message) -> None:
        self._publish(_fit(message))

    def _report(self, detail: str) -> None:
        with contextlib.suppress(Exception):
            self._publish(
                ProbeStatus(t=time.time(), probe=PROBE_NAME, available=False, detail=detail)
            )

    def _watch_finished(self, watch: _Watch, reached: bool) -> None:
        """A watch in the thread that failed has decided: the failure reached the job's code
        (published, and paused there with ``--pause-on-oom``), or torch handled it (counted)."""
        with self._lock:
            if self._pending_here.get(threading.get_ident()) is watch:
                del self._pending_here[threading.get_ident()]
        if watch.pending.done:
            return
        if reached:
            with contextlib.suppress(Exception):
                self._publish_failure(watch.pending, pause=True)
        else:
            watch.pending.done = True
            self._count_handled(watch.pending.capture.device)


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
