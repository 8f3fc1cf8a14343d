"""The op sampler: schedules the windows (sampler thread), opens and closes them (training
thread, or the main thread between two bytecodes for time-based windows), and hands the closed
ones to :class:`~torchtop.agent.ops.frames.FrameMaker`.

:meth:`OpsSampler.tick` runs in the sampler thread, under the sampler's lock;
:meth:`OpsSampler.at_boundary` and :meth:`OpsSampler.window` in the training thread;
:meth:`OpsSampler.request_window` in the server's I/O thread. Once a window is armed, its state
changes only in the training thread (the thread that opened it closes it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from torchtop.agent import steps as step_hooks
from torchtop.agent.activations import ActivationWindow, compiled_in_use
from torchtop.agent.ops.frames import (
    MEASURE_WAIT_S,
    Closed,
    FrameMaker,
    Measuring,
    excess,
    usual_step,
)
from torchtop.agent.ops.main_thread import call_in_main_thread
from torchtop.agent.ops.profiler import (
    _KINETO_DEFAULTED,
    _KINETO_STARTED,
    KINETO_QUIET,
    _Profiler,
    cuda_not_started,
    inside_torch_callback,
    kineto_started,
    records_inputs,
    skip_inherited_destructors,
    user_profiler_running,
)
from torchtop.agent.ops.sections import _active, _paused
from torchtop.protocol import DEFAULT_OPS_BUDGET, Message, OpsWindow, ProbeStatus

PROBE = "ops"
OWN_PROFILER = "the job is running its own torch.profiler"
WAITING_FOR_CUDA = (
    "waiting for the job to use CUDA: on this CUDA build of PyTorch, a window opened earlier "
    "would initialize CUDA in the job"
)

IDLE, ARMED, OPEN = range(3)
#: Step boundaries in a row inside torch's callbacks before windows stop waiting for steps.
REFUSED_LIMIT = 16
#: How long the job's profiler, starting in another thread, waits for ours to stop.
OWNER_WAIT_S = 2.0
#: Requested windows: at most one a second.
REQUEST_GAP_S = 1.0
#: The windows whose costs make the share of the time the windows take (:meth:`windows_share`).
SHARE_WINDOWS = 8


class OpsSampler:
    """Schedules the windows, opens and closes them in the training thread, and turns their
    events into ``ops`` frames in the sampler thread."""

    def __init__(
        self,
        *,
        trace_dir: Path,
        trace_prefix: str,
        window_steps: int = 2,
        budget: float = DEFAULT_OPS_BUDGET,
        min_spacing_s: float = 5.0,
        first_after_steps: int = 3,
        time_window_s: float = 0.2,
        time_fallback_s: float = 5.0,
        record_shapes: bool = False,
        with_stack: bool = False,
    ) -> None:
        self.trace_dir = Path(trace_dir)
        self.trace_prefix = trace_prefix
        self.window_steps = max(1, window_steps)
        self.budget = budget
        self.min_spacing_s = min_spacing_s
        self.first_after_steps = first_after_steps
        self.time_window_s = time_window_s
        self.time_fallback_s = time_fallback_s
        self.record_shapes = record_shapes
        self.with_stack = with_stack
        #: The step clock's key (:attr:`StepCollector.clock`), set by the sampler thread.
        self.clock: int | str | None = None
        self.spacing_s = min_spacing_s
        #: (start, stop, total) cost of the latest windows, in seconds (benchmarks read it).
        self.costs: deque[tuple[float, float, float]] = deque(maxlen=256)
        #: The latest windows priced: when (``monotonic``), their cost and the spacing it set
        #: (:meth:`windows_share`).
        self.priced: deque[tuple[float, float, float]] = deque(maxlen=SHARE_WINDOWS)
        #: The latest windows measured on the job's steps: from their start to the end of the
        #: agent's work on them (``perf_counter``). The steps in them are the windows' cost,
        #: which the tick measure leaves to them (:meth:`unsettled_since`).
        self.spans: deque[tuple[float, float]] = deque(maxlen=64)
        # -- training-thread state (changed only there once a window is armed) ------------
        self._state = IDLE
        self._thread: int | None = None
        self._steps_in = 0
        self._opened_at = 0.0
        self._began = 0.0
        self._start_cost = 0.0
        self._device = False
        self._inputs = False
        self._torch_threads: int | None = None
        #: The activation measurement over the window's first step, and its result.
        self._activations: ActivationWindow | None = None
        self._activation_result: tuple[int, list[tuple[str, int]]] = (0, [])
        #: Windows opened so far (training thread).
        self._opened = 0
        self._requested_window = False
        self._time_based = False
        #: Opened by :meth:`window` around a section: only its end closes it.
        self._explicit = False
        self._closed: deque[Closed] = deque(maxlen=4)
        #: Windows whose cost is measured on the steps that follow them (sampler thread).
        self._measuring: deque[Measuring] = deque()
        #: The window's owner (the thread that opened it) should close it at its next chance:
        #: the profiler can only be stopped from that thread.
        self._close_requested = False
        self._discard = False
        #: Boundaries in a row refused (inside torch's callbacks): past REFUSED_LIMIT the
        #: steps are no place for windows, and time-based windows take over.
        self._refused = 0
        self._steps_unsafe = False
        self._pid = os.getpid()
        #: A pending call to open (close) the window in the main thread is queued.
        self._opening = False
        self._closing = False
        #: Armed for a time-based window (no step clock).
        self._time_armed = False
        self._profiler: _Profiler | None = None
        # -- sampler-thread state ---------------------------------------------------------
        self._request = threading.Event()
        self._next_due = 0.0
        self._started = time.monotonic()
        #: A window over steps has been armed (the first comes as soon as steps do).
        self._step_window_armed = False
        #: Why the last window failed (cleared by the next that opens).
        self._failure: str | None = None
        #: The job's own profiler is on: from our guard on its start and stop, or seen running
        #: when a window was due to open.
        self._user_profiler = False
        self._blocked = False
        #: On a CUDA build, the job has not initialized CUDA: no window may open yet.
        self._cuda_wait = False
        self._reported: str | None = None
        self._failures = 0
        self._stopped = False
        #: Reads the closed windows into frames, and keeps the run's cumulative table.
        self._frames = FrameMaker(
            trace_dir=self.trace_dir,
            trace_prefix=trace_prefix,
            record_shapes=record_shapes,
            with_stack=with_stack,
        )
        self._last_closed = 0.0
        #: The step collector's latest step durations.
        self._recent_steps: deque[float] = deque()
        self._pending_calls: list[Any] = []  # ctypes callbacks must outlive the call
        self._lock = threading.Lock()
        _active[0] = self

    @property
    def read_s(self) -> float:
        """Seconds this sampler's thread spent reading windows so far (see
        :attr:`FrameMaker.read_s`)."""
        return self._frames.read_s

    @property
    def windows(self) -> int:
        """Windows turned into frames so far (benchmarks read it)."""
        return self._frames.windows

    def forget_in_child(self) -> None:
        """In a forked child: no agent, so no windows (a pending call queued before the fork
        finds the pid changed and does nothing), and an exit that cannot hang in kineto."""
        self._stopped = True
        self._state = IDLE
        if _active[0] is self:
            _active[0] = None
        if kineto_started():
            skip_inherited_destructors()

    # -- requests from other threads ---------------------------------------------------------

    def resumed_after(self, paused_s: float) -> None:
        """The agent's sampler was paused for ``paused_s`` seconds (the overhead benchmark's
        "off" blocks): no window could open meanwhile, so that time does not count toward the
        spacing, which keeps the windows' share of the time sampled within the budget."""
        self._next_due += paused_s

    def request_window(self) -> None:
        """A viewer asked for a window now (server I/O thread): the next tick arms one."""
        self._request.set()

    # -- training thread ---------------------------------------------------------------------

    def at_boundary(self, key: int | str) -> None:
        """A step ended (the optimizer post hook or ``torchtop.step()``). Never raises."""
        try:
            if key != self.clock:
                if self.clock is not None:
                    return
                # No tick has read the step clock yet (the job's first steps, or a sampler
                # held up on a busy machine): the first to step is the clock, as the step
                # collector decides. Else a window over those steps would count none of them,
                # or some, and its ops per step would read high.
                self.clock = key
            if self._state == ARMED:
                if _paused[0]:
                    return
                if inside_torch_callback(sys._getframe(1)):
                    self._refuse()
                    return
                self._refused = 0
                self._open(time_based=False)
                if self._state == OPEN:
                    self._activations_begin()
            elif self._state == OPEN and self._thread == threading.get_ident():
                self._activations_end()  # the first step is done
                if not self._time_based:
                    self._steps_in += 1
                due = self._close_requested or (
                    not self._time_based
                    and not self._explicit
                    and self._steps_in >= self.window_steps
                )
                if due and not inside_torch_callback(sys._getframe(1)):
                    self._close(keep=not self._discard)
        except Exception as exc:  # pragma: no cover - the profiler failed in a new way
            self._fail(exc)

    def _open(self, *, time_based: bool) -> None:
        self._state = IDLE
        self._time_armed = False
        step_hooks.BOUNDARY[0] = None if time_based else self.at_boundary
        if os.getpid() != self._pid or self._stopped:  # a forked child, or after the agent
            step_hooks.BOUNDARY[0] = None
            return
        if user_profiler_running():
            self._blocked = True
            step_hooks.BOUNDARY[0] = None
            return
        began = time.time()
        t0 = time.perf_counter()
        try:
            profiler = self._profiler
            if profiler is None:
                profiler = self._profiler = _Profiler(
                    record_shapes=self.record_shapes, with_stack=self.with_stack
                )
            self._inputs = records_inputs(
                self._opened, shapes=self.record_shapes, cuda=profiler.cuda_initialized()
            )
            self._opened += 1
            self._torch_threads = profiler.get_num_threads()
            self._device = profiler.start(inputs=self._inputs)
        except Exception as exc:
            step_hooks.BOUNDARY[0] = None
            self._fail(exc)
            return
        t1 = time.perf_counter()
        self._thread = threading.get_ident()
        self._time_based = time_based
        self._explicit = False
        self._began = began
        self._start_cost = t1 - t0
        self._opened_at = t1
        self._steps_in = 0
        self._close_requested = False
        self._discard = False
        self._state = OPEN
        self._failures = 0
        self._failure = None
        if _KINETO_DEFAULTED[0]:
            # Kineto has read its log level by now: the job's children need not inherit ours.
            _KINETO_DEFAULTED[0] = False
            if os.environ.get("KINETO_LOG_LEVEL") == KINETO_QUIET:
                del os.environ["KINETO_LOG_LEVEL"]

    def _close(self, *, keep: bool = True) -> None:
        """Stop the profiler: only the thread that started it can (torch's profiler state is
        per thread). From any other thread, the owner is asked to, at its next boundary."""
        if self._thread != threading.get_ident():
            self._discard = self._discard or not keep
            self._close_requested = True
            return
        profiler = self._profiler
        # No tick arms the next window while this one stops (it may take a while).
        self._next_due = time.monotonic() + max(self.min_spacing_s, self.spacing_s)
        self._state = IDLE
        step_hooks.BOUNDARY[0] = None
        self._close_requested = False
        self._activations_end()
        if profiler is None:
            return
        t0 = time.perf_counter()
        if self._device:
            # Kernels still queued would fall outside the window; the wait is its cost.
            with contextlib.suppress(Exception):
                profiler.sync()
        try:
            result = profiler.stop()
        except Exception as exc:
            self._fail(exc)
            return
        t1 = time.perf_counter()
        if keep:
            self._closed.append(
                Closed(
                    result=result,
                    began=self._began,
                    opened_at=self._opened_at - self._start_cost,
                    wall_s=t0 - self._opened_at,
                    start_cost_s=self._start_cost,
                    stop_cost_s=t1 - t0,
                    steps=None
                    if self._time_based or (self._explicit and not self._steps_in)
                    else self._steps_in,
                    device=self._device,
                    requested=self._requested_window,
                    inputs=self._inputs,
                    torch_threads=self._torch_threads,
                    activation_bytes=self._activation_result[0],
                    activations=self._activation_result[1],
                )
            )
        self._activation_result = (0, [])
        self._requested_window = False
        self._last_closed = time.monotonic()

    def _activations_begin(self) -> None:
        """Measure the activations of the window's first step (see ``agent/activations``)."""
        self._activation_result = (0, [])
        if compiled_in_use():
            return
        window = ActivationWindow()
        try:
            window.begin()
        except Exception:
            return
        self._activations = window

    def _activations_end(self) -> None:
        window, self._activations = self._activations, None
        if window is None:
            return
        try:
            top = window.end()
        except Exception:
            return
        self._activation_result = (window.total, [(m.path, m.bytes) for m in top])

    def _refuse(self) -> None:
        """A boundary inside torch's callbacks (an optimizer stepped from backward, or in a
        compiled region): no window there. Too many in a row, and the steps are given up."""
        self._refused += 1
        if self._refused >= REFUSED_LIMIT:
            self._steps_unsafe = True
            self._state = IDLE
            step_hooks.BOUNDARY[0] = None

    def _fail(self, exc: BaseException) -> None:
        self._failures += 1
        self._failure = f"the profiler failed: {exc!r}"

    @contextlib.contextmanager
    def window(self) -> Iterator[bool]:
        """A window around a section of this thread, now, whatever the spacing (the demos
        profile one call of each phase this way). Yields whether a window opened: none opens
        while another is open, the job's own profiler runs, or inside a callback from torch.
        Its frame counts the steps that ended inside (``None`` if none did)."""
        opened = False
        if (
            self._state != OPEN
            and not self._user_profiler
            and self._failures < 3
            and not inside_torch_callback(sys._getframe(2))
            and not cuda_not_started()
        ):
            self._open(time_based=False)
            opened = self._state == OPEN
            if opened:
                self._explicit = True
                step_hooks.BOUNDARY[0] = self.at_boundary
        try:
            yield opened
        finally:
            if opened and self._state == OPEN and self._explicit:
                self._close()

    def user_profiler_starting(self) -> None:
        """The job is starting its own profiler (our guard on ``profile._prepare_trace``).

        Ours stops first, so that the job's own profile is complete and unchanged; the window
        is thrown away."""
        self._user_profiler = True
        _KINETO_STARTED[0] = True
        if self._state == OPEN:
            self._close(keep=False)
            # Opened by another thread: its owner stops it at its next step boundary. Give it
            # that long (bounded), so that the two profilers never run at once.
            deadline = time.monotonic() + OWNER_WAIT_S
            while self._state == OPEN and time.monotonic() < deadline:
                time.sleep(0.001)
        elif self._state == ARMED:
            self._state = IDLE
            step_hooks.BOUNDARY[0] = None

    def user_profiler_stopped(self) -> None:
        self._user_profiler = False

    def close_now(self, *, disarm: bool = True) -> None:
        """Close an open window if this thread opened it (at the agent's stop, at exit), and
        unless told otherwise disarm one that waits for a step."""
        if self._state == OPEN:
            with contextlib.suppress(Exception):
                self._close()  # from another thread: asks the owner
            if self._state == OPEN and self._thread == threading.main_thread().ident:
                self._closing = self._in_main_thread(self._close_in_main_thread)
        elif self._state == ARMED and disarm:
            self._state = IDLE
            step_hooks.BOUNDARY[0] = None

    # -- the main thread, for time-based windows ----------------------------------------------

    def _in_main_thread(self, fn: Callable[[FrameType | None], None]) -> bool:
        """Run ``fn(frame)`` in the main thread between two of its bytecodes (``frame`` is the
        one it was running then). False if it could not be queued."""
        return call_in_main_thread(fn, self._pending_calls)

    def _open_time_window(self, frame: FrameType | None) -> None:
        self._opening = False
        if (
            self._state == ARMED
            and self._time_armed
            and not _paused[0]
            and not inside_torch_callback(frame)
        ):
            self._open(time_based=True)
        # Else the main thread was inside a callback from torch: the next tick asks again.

    def _close_in_main_thread(self, frame: FrameType | None) -> None:
        self._closing = False
        if self._state != OPEN or self._thread != threading.get_ident():
            return
        if not inside_torch_callback(frame):
            self._close(keep=not self._discard)

    def _overdue_s(self) -> float:
        """How long a step window may stay open: ten times its steps' usual time, 2 s at least."""
        typical = statistics.median(self._recent_steps) if self._recent_steps else 0.0
        return max(2.0, 10 * self.window_steps * typical)

    # -- sampler thread ----------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        """No window armed or open."""
        return self._state == IDLE

    def windows_share(self, now: float | None = None) -> float | None:
        """What the windows cost the job, as a share of its time: the latest windows' costs
        (measured on its steps) over the time they spanned, each window's the spacing its
        cost set, or, where windows stopped coming, the time since the first of them
        (``monotonic``). ``None`` before a window is priced. Part of the agent's cost that
        the tick measure leaves to the windows (:meth:`unsettled_since`)."""
        priced = self.priced
        if not priced:
            return None
        now = time.monotonic() if now is None else now
        span = max(math.fsum(spacing for _, _, spacing in priced), now - priced[0][0])
        return math.fsum(cost for _, cost, _ in priced) / span if span > 0 else None

    def unsettled_since(self) -> float | None:
        """From the sampler thread: the start (``perf_counter``) of a window open, closed but
        not yet read, or whose cost is still being measured; ``None`` if none. The steps from
        then on belong to the window until its span is known (:attr:`spans`)."""
        if self._measuring:
            return self._measuring[0].start
        closed = self._closed
        if closed:
            with contextlib.suppress(IndexError):
                return closed[0].opened_at
        if self._state == OPEN:
            return self._opened_at
        return None

    def tick(self, now: float, steps: Any) -> list[Message]:
        """Schedule windows and turn closed ones into frames. ``steps`` is the
        :class:`~torchtop.agent.steps.StepCollector`."""
        with self._lock:
            if self._stopped:
                return []
            return self._tick(now, steps)

    def _tick(self, now: float, steps: Any) -> list[Message]:
        messages: list[Message] = []
        if steps.clock is not None:  # else the clock the boundaries took (at_boundary)
            self.clock = steps.clock
        self._recent_steps = steps.recent
        monotonic = time.monotonic()
        while self._closed:
            frame = self._frame(self._closed.popleft(), getattr(steps, "ends", None))
            if frame is not None:
                messages.append(frame)
        messages.extend(self._measured(getattr(steps, "ends", None)))
        if self._blocked and not user_profiler_running():
            self._blocked = False  # the job's profiler has ended
        self._cuda_wait = self._state == IDLE and cuda_not_started()
        status = self._status(now)
        if status is not None:
            messages.append(status)
        if self._failures >= 3:
            return messages
        if self._state == OPEN and self._explicit:
            return messages
        if self._state == OPEN:
            # A time-based window is done; a step window that ran far past its steps (the
            # job left its training loop) must not go on recording everything.
            limit = self.time_window_s if self._time_based else self._overdue_s()
            if time.perf_counter() - self._opened_at >= limit and not self._closing:
                self._closing = self._in_main_thread(self._close_in_main_thread)
            return messages
        if self._state == ARMED and self._time_armed and not self._opening:
            self._opening = self._in_main_thread(self._open_time_window)
        if self._state != IDLE or self._user_profiler or self._blocked or self._cuda_wait:
            return messages
        # A viewer's request is honoured at most once a second.
        requested = self._request.is_set() and monotonic - self._last_closed >= REQUEST_GAP_S
        # The first window over training steps comes as soon as there are steps, whatever
        # the spacing that time-based windows (taken while the job set up) left.
        first_steps = self.clock is not None and not self._step_window_armed
        due = monotonic >= self._next_due or first_steps
        if not requested and not due:
            return messages
        if self.clock is not None and not self._steps_unsafe:
            if requested or steps.total >= self.first_after_steps:
                self._arm(requested, monotonic)
                self._step_window_armed = True
                step_hooks.BOUNDARY[0] = self.at_boundary
        elif requested or monotonic - self._started >= self.time_fallback_s:
            self._arm(requested, monotonic)
            self._time_armed = True
            self._opening = self._in_main_thread(self._open_time_window)
        return messages

    def _arm(self, requested: bool, monotonic: float) -> None:
        self._request.clear()
        self._requested_window = requested
        # Until the window's frame sets the adapted spacing (and after a failure).
        self._next_due = monotonic + max(self.min_spacing_s, self.spacing_s)
        self._state = ARMED

    def _status(self, now: float) -> ProbeStatus | None:
        if self._user_profiler or self._blocked:
            reason: str | None = OWN_PROFILER
        else:
            reason = WAITING_FOR_CUDA if self._cuda_wait else self._failure
        if self._failures >= 3 and reason is not None:
            reason = f"{reason}; op sampling stopped after {self._failures} failures"
        if reason == self._reported:
            return None
        self._reported = reason
        if reason is None:
            return ProbeStatus(t=now, probe=PROBE, available=True, detail="op timings resumed")
        return ProbeStatus(
            t=now, probe=PROBE, available=False, detail=f"op timings unavailable: {reason}"
        )

    def _frame(self, closed: Closed, ends: deque[tuple[float, float]] | None) -> OpsWindow | None:
        """The window's frame; ``None`` while its cost is being measured (see
        :meth:`_measured`). ``ends`` are the latest steps' (end, duration)."""
        made = self._frames.make(closed, self._recent_steps, self.spacing_s, self.time_window_s)
        if made is None:  # cut short before any op ran: no window
            return None
        frame, cost, events = made
        usual = usual_step(ends, closed.opened_at) if closed.steps else None
        if usual is None:
            return self._priced(frame, closed.start_cost_s, closed.stop_cost_s, cost)
        # What the job lost is measured on its steps: from the window's start to the first
        # step that ends after all the work above.
        self._next_due = float("inf")
        done = time.perf_counter()
        self.spans.append((closed.opened_at, done))
        self._measuring.append(
            Measuring(
                frame=frame,
                start=closed.opened_at,
                done=done,
                usual=usual,
                events=events,
                start_cost_s=closed.start_cost_s,
                stop_cost_s=closed.stop_cost_s,
                estimate=cost,
                deadline=time.monotonic() + MEASURE_WAIT_S,
            )
        )
        return None

    def _priced(self, frame: OpsWindow, start: float, stop: float, cost: float) -> OpsWindow:
        """The frame with its cost, and the spacing to the next window that the cost sets."""
        self.costs.append((start, stop, cost))
        self.spacing_s = max(self.min_spacing_s, cost / self.budget)
        self.priced.append((time.monotonic(), cost, self.spacing_s))
        self._next_due = time.monotonic() + self.spacing_s
        return dataclasses.replace(frame, cost_s=cost, spacing_s=self.spacing_s)

    def _measured(
        self, ends: deque[tuple[float, float]] | None, *, final: bool = False
    ) -> list[Message]:
        """Frames of windows whose cost to the job is now known: the steps from the window's
        start to the first that ended after the agent was done with it, less what those steps
        usually take. Without such a step in time, the estimate stands."""
        out: list[Message] = []
        while self._measuring:
            m = self._measuring[0]
            cost = excess(ends, m.start, m.done, m.usual) if ends else None
            if cost is None and not final and time.monotonic() < m.deadline:
                break
            self._measuring.popleft()
            if cost is None:
                cost = m.estimate
            elif m.events:
                self._frames.event_costs.append(cost / m.events)
            out.append(self._priced(m.frame, m.start_cost_s, m.stop_cost_s, cost))
        return out

    def stop(self, now: float) -> list[Message]:
        """Close a window this thread has open (one that another thread opened closes at its
        owner's next boundary), and the frames of those not yet sent."""
        self.close_now()
        if self._state != OPEN:
            step_hooks.BOUNDARY[0] = None
        if _active[0] is self:
            _active[0] = None
        with self._lock:
            messages: list[Message] = []
            while self._closed:
                with contextlib.suppress(Exception):
                    frame = self._frame(self._closed.popleft(), None)
                    if frame is not None:
                        messages.append(frame)
            messages.extend(self._measured(None, final=True))
            self._stopped = True
            return messages
