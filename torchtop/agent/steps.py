"""Training steps, seen from inside the job without changing its code.

The training thread's side is a handful of hooks that each append one tuple to :data:`PENDING`:
the global optimizer step pre/post hooks (every ``torch.optim`` optimizer, and so Lightning, the
HF Trainer and ``GradScaler.step``), a wrapper around ``GradScaler.step`` that lets a skipped
step (inf or NaN gradients) be told apart, and the DataLoader hooks of
:mod:`torchtop.agent.loaders`. Each costs a timestamp and a ``deque.append``: about a
microsecond (the pre hook notes the time, and calls the holders' read when one is due; the post
hook sends one event per step).
:class:`StepCollector`, in the sampler thread, turns the events into steps.

A step ends when the *step clock* finishes a step: the first optimizer that steps in the job
(other optimizers' time counts as optimizer time, not as steps), or ``torchtop.step()`` from its
first call on, for loops without a torch optimizer. A job that trains in stages with one
optimizer after another moves the clock: once the clock optimizer has stopped stepping while
another steps on, the other becomes the clock, and its steps since the clock's last are counted.
A step lasts from the end of the previous one, so the job's first step has no duration.

``optimizer.step(closure)`` (LBFGS, Lightning) runs the forward and backward pass inside the
step: the closure is timed apart, and its time is compute, not optimizer time.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torchtop.protocol import MAX_STEP_DETAIL, StepStats

# Event kinds: the first item of each tuple in PENDING.
OPT_STEP, SCALER_BEGIN, SCALER_END, EXPLICIT_STEP = range(4)
ITERATOR, BATCH, EXHAUSTED = range(4, 7)
#: The hooks were off for a while: the next step's start is unknown.
GAP = 7
#: A call of ``torch.autograd.backward`` (``loss.backward()``): its start and end.
BACKWARD = 8

#: Events from the training thread, drained by the sampler thread. Bounded, so that hooks left
#: installed with no sampler draining (a forked child, a paused agent) cannot grow memory.
PENDING: deque[tuple[Any, ...]] = deque(maxlen=1 << 16)

_clock = time.perf_counter
_append = PENDING.append
_allocate_lock = threading.Lock
#: Called with the step's key (an optimizer's id, or ``"explicit"``) at each step's end while
#: an op-timing window is armed or open (:mod:`torchtop.agent.ops`); ``None`` otherwise, so the
#: hooks pay one list lookup.
BOUNDARY: list[Callable[[int | str], None] | None] = [None]
#: Called with the optimizer and the step's start (``perf_counter``) by the step pre-hook: the
#: read of what holds the memory, when due (:func:`torchtop.agent.holders.step_seen`), within
#: this hook's call and time rather than in a hook of its own; ``None`` while the agent is out.
BEFORE_STEP: list[Callable[[Any, float], None] | None] = [None]
#: When :data:`BEFORE_STEP` is next due (``perf_counter``; set by it), and the optimizer (its
#: id) whose step called it last: the pre-hook calls it only once that time has come or for
#: another optimizer's step. Most steps cost a comparison, not a call that finds nothing due
#: (2 µs of a tiny model's step, its code and data cold).
BEFORE_AT = [0.0]
BEFORE_KEY = [0]
#: When each optimizer's step began, from its pre hook to its post hook: one event per step.
_began: dict[int, float] = {}
#: Seconds each optimizer's current step has spent in its closure (forward and backward).
_in_closure: dict[int, float] = {}
#: Set while a backward pass runs: one inside another (reentrant checkpointing) is not counted
#: twice.
_in_backward = [False]
#: Set by the sampler thread while its tick waits for the training thread's next backward
#: pass (:func:`wait_for_backward`): a held lock that the pass releases as it begins.
_WAKE: list[Any] = [None]
#: Seconds the training thread has spent in torchtop's own hook code so far: each hook's time
#: from its first clock read to its last, less the original it wraps. What the hooks cost the
#: steps directly (the sampler thread's cost is measured apart); added to the agent's cost.
#: Not the whole of it: calling a hook and the cache lines it displaces cost the job too.
HOOK_S = [0.0]


def step() -> None:
    """Mark the end of a training step, for loops without a torch optimizer.

    From its first call on, these calls are the step clock; optimizer steps still count as
    optimizer time. Costs one ``deque.append`` and works with no agent running.
    """
    t = _clock()
    _append((EXPLICIT_STEP, t, 0))
    HOOK_S[0] += _clock() - t
    boundary = BOUNDARY[0]
    if boundary is not None:  # an op window's start or stop: the windows' own cost
        boundary("explicit")


# -- hooks in the training thread ------------------------------------------------------------


def optimizer_pre_hook(optimizer: Any, args: Any, kwargs: Any) -> Any:
    """Note when the step began; a closure passed to it is swapped for a timed one."""
    key = id(optimizer)
    _began[key] = began = _clock()
    # ``args`` holds the optimizer itself, then the arguments of ``step``.
    changed = None
    if len(args) > 1 and callable(args[1]):
        changed = (args[0], _timed_closure(args[1], key), *args[2:]), kwargs
    elif kwargs and callable(closure := kwargs.get("closure")):
        changed = args, {**kwargs, "closure": _timed_closure(closure, key)}
    before = BEFORE_STEP[0]
    if before is not None and (began >= BEFORE_AT[0] or key != BEFORE_KEY[0]):
        BEFORE_KEY[0] = key
        before(optimizer, began)
    HOOK_S[0] += _clock() - began
    return changed


def _timed_closure(closure: Callable[..., Any], key: int) -> Callable[..., Any]:
    """``closure`` adding the seconds it runs to ``_in_closure[key]`` (LBFGS calls it several
    times per step). What it returns or raises passes through untouched."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        began = _clock()
        try:
            return closure(*args, **kwargs)
        finally:
            _in_closure[key] = _in_closure.get(key, 0.0) + (_clock() - began)

    return timed


def optimizer_post_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
    key = id(optimizer)
    t = _clock()
    _append((OPT_STEP, t, key, _began.pop(key, None), _in_closure.pop(key, 0.0)))
    HOOK_S[0] += _clock() - t
    boundary = BOUNDARY[0]
    if boundary is not None:  # an op window's start or stop: the windows' own cost
        boundary(key)


def wrap_scaler_step(original: Any) -> Any:
    """``GradScaler.step`` that leaves a begin and an end event around the original.

    A step with no optimizer post hook between the two was skipped (inf/NaN gradients).
    Whatever the original raises propagates untouched.
    """

    def step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        _append((SCALER_BEGIN, _clock(), id(optimizer)))
        result = original(self, optimizer, *args, **kwargs)
        _append((SCALER_END, _clock(), id(optimizer)))
        return result

    step.__wrapped__ = original  # type: ignore[attr-defined]
    step.__name__ = getattr(original, "__name__", "step")
    step.__qualname__ = getattr(original, "__qualname__", "step")
    step.__doc__ = getattr(original, "__doc__", None)
    step._torchtop = True  # type: ignore[attr-defined]
    return step


def wrap_backward(original: Any) -> Any:
    """``torch.autograd.backward`` (which ``Tensor.backward`` calls) leaving its start and end.

    In a DDP job the gradient all-reduce runs, and is waited for, inside it: a rank that waits
    for a slower one spends that wait here. Costs two clock reads and one append per call;
    whatever the original returns or raises passes through untouched.
    """

    def backward(*args: Any, **kwargs: Any) -> Any:
        if _in_backward[0]:
            return original(*args, **kwargs)
        _in_backward[0] = True
        wake = _WAKE[0]
        if wake is not None:  # a tick waits for the pass, to run while the pass runs
            _WAKE[0] = None
            try:
                wake.release()
            except RuntimeError:  # released already, by another thread's pass
                pass
        began = _clock()
        try:
            return original(*args, **kwargs)
        finally:
            _in_backward[0] = False
            ended = _clock()
            _append((BACKWARD, began, ended))
            HOOK_S[0] += _clock() - ended

    return backward


# -- the sampler thread's side ---------------------------------------------------------------


#: Seconds the tick lets the pass run on before it begins: ``torch.autograd.backward`` runs
#: some Python (and an op, which lets go of the GIL) before torch's engine does; a tick that
#: took the GIL then would hold the pass up.
ENGINE_S = 1e-4


def wait_for_backward(timeout_s: float) -> bool:
    """From the sampler thread: return as the training thread begins its next backward pass
    (True), or after ``timeout_s`` (False).

    The training thread lets go of the GIL in each op it calls and waits to take it back
    until a tick running then is done: on a Python-bound step a tick landing at random holds
    up whatever Python it interrupts. A backward pass runs in torch's engine, which holds the
    GIL far less (though it takes it back at each node: where the steps are long, a tick in
    the pass costs them more than one at random; see
    :data:`torchtop.agent.training.ALIGN_STEPS`).
    """
    wake = _allocate_lock()
    wake.acquire()
    _WAKE[0] = wake
    try:
        met = wake.acquire(timeout=timeout_s)
    finally:
        _WAKE[0] = None
    if met and ENGINE_S > 0:
        time.sleep(ENGINE_S)
    return met


@dataclass(slots=True)
class StepRecord:
    """One step: its end (``perf_counter`` time) and what it spent its time on."""

    end: float
    duration: float | None
    wait: float
    startup: float
    optimizer: float
    samples: int
    skipped: bool = False
    backward: float = 0.0


@dataclass(slots=True)
class _Interval:
    """What happened since the last step ended."""

    wait: float = 0.0
    startup: float = 0.0
    optimizer: float = 0.0
    backward: float = 0.0
    samples: dict[int, int] = field(default_factory=dict)
    last_loader: int | None = None

    def add(self, later: _Interval) -> None:
        """Take in what happened in ``later``, the interval that followed this one."""
        self.wait += later.wait
        self.startup += later.startup
        self.optimizer += later.optimizer
        self.backward += later.backward
        for loader, count in later.samples.items():
            self.samples[loader] = self.samples.get(loader, 0) + count
        if later.last_loader is not None:
            self.last_loader = later.last_loader


#: The clock moves to another optimizer once the clock optimizer has not stepped for this many
#: of its usual steps (and at least CLOCK_IDLE_MIN_S) while the other stepped CLOCK_MOVE_STEPS
#: times: a GAN's critic stepping five times per generator step never moves it.
CLOCK_IDLE_STEPS = 8
CLOCK_IDLE_MIN_S = 1.0
CLOCK_MOVE_STEPS = 8
#: Other optimizers' steps remembered since the clock's last step (a stage's first steps, counted
#: when the clock moves); past it, the oldest are merged and no longer counted as steps.
MAX_OTHER_STEPS = 4096


class StepCollector:
    """Folds optimizer, scaler and batch events into steps; builds ``steps`` frames."""

    def __init__(self) -> None:
        self.total = 0
        self.skipped_total = 0
        #: ``"explicit"``, the id of the clock optimizer, or ``None`` before the first step.
        self.clock: int | str | None = None
        self._last_end: float | None = None
        self._interval = _Interval()
        self._scaler_open: dict[int, bool] = {}
        self._records: list[StepRecord] = []
        #: The latest step durations (the op sampler's yardstick for a window's slowdown).
        self.recent: deque[float] = deque(maxlen=64)
        #: The latest steps' (end, duration): what an op window cost the steps around it.
        self.ends: deque[tuple[float, float]] = deque(maxlen=4096)
        #: Steps of other optimizers since the clock's last step, each with what happened
        #: before it: (end, optimizer, interval). ``_interval`` runs from the last of them.
        self._others: list[tuple[float, int, _Interval]] = []
        #: When the clock optimizer last stepped.
        self._clock_last: float | None = None
        #: When the training thread last got a batch (``perf_counter``): an evaluation loop
        #: between epochs takes no step but is not stuck.
        self.last_batch: float | None = None
        #: When the latest backward pass ended (``perf_counter``).
        self.last_backward: float | None = None

    @property
    def last_end(self) -> float | None:
        """When the latest step ended (``perf_counter``); ``None`` before the first."""
        return self._last_end

    # -- events ----------------------------------------------------------------------------

    def optimizer_step(
        self, t: float, optimizer: int, began: float | None, in_closure: float = 0.0
    ) -> None:
        """An ``optimizer.step()`` that ran from ``began`` to ``t``, ``in_closure`` seconds of
        it in the closure passed to it (forward and backward: compute, not optimizer time)."""
        if began is not None:
            self._interval.optimizer += max(0.0, t - began - in_closure)
        if optimizer in self._scaler_open:
            self._scaler_open[optimizer] = True
        if self.clock is None:
            self.clock = optimizer
        if self.clock == optimizer:
            self._clock_step(t, skipped=False)
        elif self.clock != "explicit":
            self._other_step(t, optimizer)

    def _clock_step(self, t: float, *, skipped: bool) -> None:
        """The clock's step: what other optimizers did since the last one belongs to it."""
        if self._others:
            merged = self._others[0][2]
            for _, _, interval in self._others[1:]:
                merged.add(interval)
            merged.add(self._interval)
            self._interval = merged
            self._others = []
        self._clock_last = t
        self._end_step(t, skipped)

    def _other_step(self, t: float, optimizer: int) -> None:
        """A step of an optimizer that is not the clock; the clock moves to it if the clock
        optimizer has stopped stepping (the job went on to its next stage)."""
        others = self._others
        others.append((t, optimizer, self._interval))
        self._interval = _Interval()
        if len(others) > MAX_OTHER_STEPS:
            _, _, oldest = others.pop(0)
            oldest.add(others[0][2])
            others[0] = (others[0][0], others[0][1], oldest)
        if self._clock_last is None or len(others) < CLOCK_MOVE_STEPS:
            return
        usual = statistics.median(self.recent) if self.recent else 0.0
        if t - self._clock_last < max(CLOCK_IDLE_MIN_S, CLOCK_IDLE_STEPS * usual):
            return
        if sum(1 for _, key, _ in others if key == optimizer) < CLOCK_MOVE_STEPS:
            return
        # The new clock's steps since the old clock's last are steps; the others' time
        # between them stays in the step it preceded.
        self.clock = optimizer
        self._others = []
        pending: _Interval | None = None
        for end, key, interval in others:
            if pending is None:
                pending = interval
            else:
                pending.add(interval)
            if key == optimizer:
                self._interval = pending
                pending = None
                self._clock_step(end, skipped=False)
        if pending is not None:
            pending.add(self._interval)
            self._interval = pending

    def scaler_begin(self, t: float, optimizer: int) -> None:
        self._scaler_open[optimizer] = False

    def scaler_end(self, t: float, optimizer: int) -> None:
        stepped = self._scaler_open.pop(optimizer, True)
        if stepped:
            return
        # The scaler found inf/NaN gradients and skipped optimizer.step(): still an iteration.
        if self.clock is None:
            self.clock = optimizer
        if self.clock == optimizer:
            self._clock_step(t, skipped=True)

    def explicit_step(self, t: float) -> None:
        self.clock = "explicit"
        self._clock_step(t, skipped=False)

    def batch(self, wait: float, *, first: bool, loader: int | None, samples: int | None) -> None:
        """A batch the training thread waited ``wait`` seconds for."""
        interval = self._interval
        if first:
            interval.startup += wait
        else:
            interval.wait += wait
        if loader is not None:
            if samples:
                interval.samples[loader] = interval.samples.get(loader, 0) + samples
            interval.last_loader = loader

    def backward(self, began: float, ended: float) -> None:
        """A backward pass that ran from ``began`` to ``ended``."""
        self._interval.backward += max(0.0, ended - began)
        self.last_backward = ended

    def exhausted(self, wait: float) -> None:
        """A ``__next__`` that raised StopIteration (an epoch's end; may join the workers)."""
        self._interval.wait += wait

    def restart(self) -> None:
        """The hooks were off: forget the open step, so the next one has no duration."""
        self._last_end = None
        self._interval = _Interval()
        self._others = []
        self._clock_last = None
        self._scaler_open.clear()

    def _end_step(self, t: float, skipped: bool) -> None:
        interval = self._interval
        duration = t - self._last_end if self._last_end is not None else None
        if duration is not None:
            self.recent.append(duration)
            self.ends.append((t, duration))
        # Samples of the loader that fed the step: a validation loop that ran since the last
        # step does not inflate the throughput.
        samples = 0
        if interval.last_loader is not None:
            samples = interval.samples.get(interval.last_loader, 0)
        self._records.append(
            StepRecord(
                end=t,
                duration=duration,
                wait=interval.wait,
                startup=interval.startup,
                optimizer=interval.optimizer,
                samples=samples,
                skipped=skipped,
                backward=interval.backward,
            )
        )
        self.total += 1
        if skipped:
            self.skipped_total += 1
        self._last_end = t
        self._interval = _Interval()

    # -- frames ----------------------------------------------------------------------------

    def take_records(self) -> list[StepRecord]:
        records, self._records = self._records, []
        return records

    def frame(self, now: float, to_wall: float) -> StepStats | None:
        """The ``steps`` frame for the steps that ended since the last call, or ``None``.

        ``to_wall`` converts ``perf_counter`` times to wall-clock time by addition.
        """
        records = self.take_records()
        if not records:
            return None
        timed = [r for r in records if r.duration is not None]
        count = len(records)
        if count <= MAX_STEP_DETAIL:
            detail = records
        else:
            n = MAX_STEP_DETAIL
            detail = [records[j * count // n] for j in range(n)]
        return StepStats(
            t=now,
            total=self.total,
            skipped_total=self.skipped_total,
            count=count,
            skipped=sum(1 for r in records if r.skipped),
            timed=len(timed),
            time_s=_round(sum(r.duration or 0.0 for r in timed)),
            wait_s=_round(sum(r.wait for r in timed)),
            startup_s=_round(sum(r.startup for r in timed)),
            optimizer_s=_round(sum(r.optimizer for r in timed)),
            samples=sum(r.samples for r in timed),
            ends=[round(r.end + to_wall, 6) for r in detail],
            durations=[None if r.duration is None else _round(r.duration) for r in detail],
            waits=[_round(r.wait) for r in detail],
            startups=[_round(r.startup) for r in detail],
            optimizer=[_round(r.optimizer) for r in detail],
            batch_samples=[r.samples for r in detail],
            backward_s=_round(sum(r.backward for r in timed)),
            backwards=[_round(r.backward) for r in detail],
        )


def _round(seconds: float) -> float:
    """Seconds to the nearest 100 ns: as precise as the clocks, and short on the wire."""
    return round(seconds, 7)
