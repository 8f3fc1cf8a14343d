"""Installs the step and DataLoader hooks once the job has imported torch, and turns what they
record into ``steps`` and ``loaders`` frames in the sampler thread.

The agent never imports torch first, so the hooks go in once the job's own ``import torch`` has
loaded the modules they patch. To be in place before the job's first step, a
:class:`TorchImportWatcher` sits in ``sys.meta_path``: it finds nothing (every import goes on as
before) and only looks, at each import, whether ``torch.optim.optimizer`` and
``torch.utils.data.dataloader`` have finished loading. Both load early inside ``import torch``,
which imports some 300 more modules after them, so the hooks are installed before
``import torch`` returns. The sampler thread checks too, on every tick, as a fallback.

Everything is undone by :meth:`TrainingMonitor.uninstall`: hook handles removed, the original
methods put back (unless someone wrapped them again on top of ours, in which case ours stays and
only costs its append). A forked child (a DataLoader worker) uninstalls at once: no agent runs
there.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Collection
from typing import Any

from torchtop.agent import holders as holder_hooks
from torchtop.agent import loaders as loader_hooks
from torchtop.agent import steps as step_hooks
from torchtop.agent.loaders import LoaderTracker, read_safely
from torchtop.agent.ops import PROBE as OPS_PROBE
from torchtop.agent.ops import OpsSampler
from torchtop.agent.stall import StallWatch
from torchtop.agent.steps import (
    BACKWARD,
    BATCH,
    EXHAUSTED,
    EXPLICIT_STEP,
    GAP,
    ITERATOR,
    OPT_STEP,
    PENDING,
    SCALER_BEGIN,
    SCALER_END,
    StepCollector,
)
from torchtop.protocol import Message, ProbeStatus

OPTIMIZER_MODULE = "torch.optim.optimizer"
PROFILER_MODULE = "torch.autograd.profiler"
DATALOADER_MODULE = "torch.utils.data.dataloader"
AUTOGRAD_MODULE = "torch.autograd"
#: Where torch keeps its global module hooks (the parameter registration hook).
MODULE_MODULE = "torch.nn.modules.module"
#: ``torch.amp.GradScaler`` from torch 2.3; before, ``torch.cuda.amp.GradScaler``.
SCALER_MODULES = ("torch.amp.grad_scaler", "torch.cuda.amp.grad_scaler")
#: Seconds between reads of the DataLoader workers (psutil, a few per worker).
WORKERS_INTERVAL_S = 1.0
#: Seconds after a new iterator with workers before they are read.
WORKERS_SOON_S = 0.05
#: Seconds between ``steps`` frames. Events are drained every tick; a frame every few ticks
#: costs the sampler thread (and so, through the GIL, the job) less at high step rates.
STEPS_INTERVAL_S = 0.5
#: Ticks wait for the job's backward pass only where it takes at least this many steps an
#: interval. On a Python-bound model (97 tiny ops, 2 ms steps, 50 a tick) a tick that lands at
#: random holds up the step whose Python it interrupts: meeting the pass took the mean step
#: 1.2% lower (0.992, 0.984 of the unmet, in one process, the agent on in both arms). On the
#: MLP (14 ms steps, 7 a tick) it took the steps 0.5% higher (paired medians 1.0047, 1.0057):
#: torch's backward takes the GIL back at each of its nodes, and a tick in it holds them up.
ALIGN_STEPS = 20


def loaded(name: str) -> Any:
    """The module ``name`` if it has finished loading; never imports anything."""
    module = sys.modules.get(name)
    if module is None:
        return None
    if getattr(getattr(module, "__spec__", None), "_initializing", False):
        return None
    return module


def _wrapper(wrapper: Any, original: Any) -> Any:
    """``wrapper`` dressed as ``original`` and marked as ours."""
    wrapper.__wrapped__ = original
    for attribute in ("__name__", "__qualname__", "__doc__"):
        with contextlib.suppress(AttributeError, TypeError):
            setattr(wrapper, attribute, getattr(original, attribute))
    wrapper._torchtop = True
    return wrapper


def _patch(cls: Any, name: str, wrap: Callable[[Any], Any]) -> Callable[[], None]:
    """Replace ``cls.name`` by ``wrap(original)``; return the undo."""
    original = cls.__dict__[name]
    if getattr(original, "_torchtop", False):  # left by an agent that could not undo it
        return lambda: None
    wrapper = wrap(original)
    setattr(cls, name, wrapper)

    def undo() -> None:
        if cls.__dict__.get(name) is wrapper:
            setattr(cls, name, original)

    return undo


class TorchImportWatcher:
    """A ``sys.meta_path`` entry that finds nothing; it installs the hooks once torch's modules
    have loaded, from inside the job's ``import torch``."""

    def __init__(self, monitor: TrainingMonitor) -> None:
        self._monitor = weakref.ref(monitor)
        self.active = True

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if self.active and DATALOADER_MODULE in sys.modules:
            monitor = self._monitor()
            # Never wait for the lock inside an import: if the sampler thread holds it, a later
            # import (or the sampler's next tick) installs instead.
            if monitor is None or monitor.try_install(blocking=False):
                self.active = False
        return None

    def remove(self) -> None:
        """Leave ``sys.meta_path``; rebound, never changed in place, since another thread may be
        walking the list in an import at this moment."""
        self.active = False
        if self in sys.meta_path:
            sys.meta_path = [finder for finder in sys.meta_path if finder is not self]


def _undo_parts(undo: dict[str, list[Callable[[], None]]]) -> None:
    """Run each part's undo actions (put the originals back); one that fails does not stop
    the others."""
    for actions in undo.values():
        for action in actions:
            try:
                action()
            except Exception:
                pass


class TrainingMonitor:
    """The hooks' life cycle in the agent, and their events turned into frames."""

    def __init__(
        self,
        *,
        workers_interval_s: float = WORKERS_INTERVAL_S,
        ops: OpsSampler | None = None,
        stall: StallWatch | None = None,
    ) -> None:
        self.steps = StepCollector()
        #: Sends the training thread's stack once the steps have stopped (``None``: off).
        self.stall = stall
        #: Op-timing windows (``None`` with ``--no-ops``), scheduled from :meth:`tick`.
        self.ops = ops
        self.loaders = LoaderTracker()
        #: What holds the memory, read from the hooked optimizers at most once a second.
        self.holders = holder_hooks.HolderReader()
        self.workers_interval_s = workers_interval_s
        #: Why a part could not be installed, for a ``probe_status`` message; ``None`` if fine.
        self.error: str | None = None
        self._lock = threading.Lock()
        self._undo: dict[str, list[Callable[[], None]]] = {}
        self._watcher: TorchImportWatcher | None = None
        self._running = False
        self._next_workers = 0.0
        self._next_steps = 0.0
        #: When :meth:`remove` took the hooks out (``perf_counter``), and the optimizers then
        #: noted (:func:`holders.noted`), until :meth:`reinstall`.
        self._removed: tuple[float, list[tuple[Any, Any]]] | None = None
        self._error_reported = False
        #: One drain at a time: the agent's last tick may overlap a sampler tick that the
        #: sampler thread has not finished (its join timed out on a busy machine).
        self._tick_lock = threading.Lock()
        self._stopped = False

    # -- installing ------------------------------------------------------------------------

    @property
    def installed(self) -> bool:
        """The optimizer and DataLoader hooks are in (the GradScaler one may follow later)."""
        return "optimizer" in self._undo and "dataloader" in self._undo

    def start(self) -> None:
        """Install now if torch is loaded, else as soon as the job's ``import torch`` loads it."""
        global _current
        self._running = True
        _current = self
        # Events from before this monitor (hooks another one left undrained) are none of its
        # steps: a stale optimizer's step first would make that optimizer its step clock.
        PENDING.clear()
        if not self.try_install():
            self._watcher = TorchImportWatcher(self)
            sys.meta_path.insert(0, self._watcher)

    def try_install(self, *, blocking: bool = True) -> bool:
        """Install whatever part of the hooks can be; True once the core parts are in."""
        if not self._running:
            return True
        if not self._lock.acquire(blocking):
            return False
        try:
            if "optimizer" not in self._undo and loaded(OPTIMIZER_MODULE) is not None:
                self._install_part("optimizer", self._install_optimizer)
            if "dataloader" not in self._undo and loaded(DATALOADER_MODULE) is not None:
                self._install_part("dataloader", self._install_dataloader)
            if "modules" not in self._undo and loaded(MODULE_MODULE) is not None:
                self._install_part("modules", self._install_modules)
            if "backward" not in self._undo and loaded(AUTOGRAD_MODULE) is not None:
                self._install_part("backward", self._install_backward)
            if "scaler" not in self._undo:
                self._install_part("scaler", self._install_scaler)
            if self.ops is not None and "profiler" not in self._undo:
                self._install_part("profiler", self._install_profiler_guard)
            return self.installed
        finally:
            self._lock.release()

    def _install_part(
        self, part: str, install: Callable[[], list[Callable[[], None]] | None]
    ) -> None:
        try:
            undo = install()
        except Exception as exc:  # an unexpected torch: say so, and never fail the job
            self.error = f"{part} hooks: {exc!r}"
            self._undo[part] = []
            return
        if undo is not None:
            self._undo[part] = undo

    @staticmethod
    def _install_optimizer() -> list[Callable[[], None]]:
        optimizer = loaded(OPTIMIZER_MODULE)
        pre = optimizer.register_optimizer_step_pre_hook(step_hooks.optimizer_pre_hook)
        post = optimizer.register_optimizer_step_post_hook(step_hooks.optimizer_post_hook)
        step_hooks.BEFORE_STEP[0] = holder_hooks.step_seen  # one pre-hook a step, not two

        def forget() -> None:
            step_hooks.BEFORE_STEP[0] = None
            holder_hooks.forget_all()

        return [pre.remove, post.remove, forget]

    def _install_modules(self) -> list[Callable[[], None]]:
        return holder_hooks.install_module_hook(loaded(MODULE_MODULE), self._watcher is not None)

    @staticmethod
    def _install_dataloader() -> list[Callable[[], None]]:
        cls = loaded(DATALOADER_MODULE)._BaseDataLoaderIter
        undo_init = _patch(cls, "__init__", loader_hooks.wrap_init)
        undo_next = _patch(cls, "__next__", loader_hooks.wrap_next)
        return [undo_init, undo_next]

    @staticmethod
    def _install_backward() -> list[Callable[[], None]]:
        def wrap(original: Any) -> Any:
            return _wrapper(step_hooks.wrap_backward(original), original)

        return [_patch(loaded(AUTOGRAD_MODULE), "backward", wrap)]

    @staticmethod
    def _install_scaler() -> list[Callable[[], None]] | None:
        for name in SCALER_MODULES:
            module = loaded(name)
            cls = getattr(module, "GradScaler", None)
            if cls is not None and "step" in cls.__dict__:
                return [_patch(cls, "step", step_hooks.wrap_scaler_step)]
        return None  # not loaded yet: tried again on the next tick

    def _install_profiler_guard(self) -> list[Callable[[], None]] | None:
        """Let the job's own profiler win: ours stops before the job's starts, and no window
        opens until the job's has ended (``torch.profiler.profile`` and
        ``torch.autograd.profiler.profile`` both start and stop through these methods)."""
        profiler = loaded(PROFILER_MODULE)
        ops = self.ops
        if profiler is None or ops is None:
            return None
        cls = profiler.profile

        def before(original: Any) -> Any:
            def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
                ops.user_profiler_starting()
                return original(self, *args, **kwargs)

            return _wrapper(guarded, original)

        def after(original: Any) -> Any:
            def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
                try:
                    return original(self, *args, **kwargs)
                finally:
                    ops.user_profiler_stopped()

            return _wrapper(guarded, original)

        undo = []
        for name, wrap in (
            ("_prepare_trace", before),
            ("_start_trace", before),
            ("__exit__", after),
        ):
            if name in cls.__dict__:
                undo.append(_patch(cls, name, wrap))
        return undo

    def uninstall(self) -> None:
        """Remove every hook and put the original methods back."""
        if self.ops is not None:
            self.ops.close_now()  # a window open in this thread; an armed one is disarmed
        with self._lock:
            if self._watcher is not None:
                self._watcher.remove()
                self._watcher = None
            undo, self._undo = self._undo, {}
        _undo_parts(undo)

    def remove(self) -> None:
        """Remove every hook until :meth:`reinstall` (the benchmark's "off" blocks): unlike
        :meth:`uninstall` alone, the sampler's ticks do not put them back meanwhile."""
        self._running = False
        noted = holder_hooks.noted()
        self.uninstall()
        self._removed = (time.perf_counter(), noted)

    def reinstall(self, only: Collection[str] | None = None) -> None:
        """Install again after :meth:`remove` (the benchmark's on/off blocks); ``only``: keep
        just these parts (``"optimizer"``, ``"dataloader"``, ``"backward"``, ...), to measure
        each alone, with the sampler paused (its ticks would put the others back)."""
        # In order with the events: the next step must not span the time without hooks.
        now = time.perf_counter()
        PENDING.append((GAP, now))
        removed, self._removed = self._removed, None
        if removed is not None:  # what holds memory is read as often as if never removed
            holder_hooks.restore(removed[1], now - removed[0])
        self._running = True
        self.try_install()
        if only is not None:
            with self._lock:
                dropped = {p: self._undo.pop(p) for p in list(self._undo) if p not in only}
            _undo_parts(dropped)

    # -- the sampler thread ----------------------------------------------------------------

    def resumed_after(self, paused_s: float) -> None:
        """The sampler was paused ``paused_s`` seconds (:meth:`Sampler.pause`): the frames
        and op windows scheduled in sampling time move on by as much."""
        self._next_steps += paused_s
        self._next_workers += paused_s
        if self.ops is not None:
            self.ops.resumed_after(paused_s)

    def before_tick(self, interval_s: float) -> bool:
        """From the sampler, before each tick: while the job takes at least
        :data:`ALIGN_STEPS` steps an interval, each with a backward pass, wait for its next
        pass to begin and tick in it (:func:`~torchtop.agent.steps.wait_for_backward`). At most
        two steps' time, never half an interval: the ticks keep their schedule. True if the
        tick met a pass."""
        steps = self.steps
        last, recent = steps.last_backward, steps.recent
        if last is None or not recent or "backward" not in self._undo:
            return False
        step_s = recent[-1]
        if step_s * ALIGN_STEPS > interval_s or time.perf_counter() - last > 2 * interval_s:
            return False  # steps too long to gain (see ALIGN_STEPS), or no pass of late
        return step_hooks.wait_for_backward(min(2 * step_s, interval_s / 2))

    def tick(self, now: float) -> list[Message]:
        """Drain the hooks' events; the frames to publish (``steps`` on ticks with steps,
        ``loaders`` about once a second while any is in use).

        Should this ever fail, the hooks come out at once (nothing would drain their events)
        and the error goes on to the sampler, which reports it.
        """
        try:
            with self._tick_lock:
                if self._stopped:
                    return []
                return self._tick(now)
        except Exception:
            self._running = False
            self.uninstall()
            PENDING.clear()
            raise

    def _tick(self, now: float) -> list[Message]:
        if self._running and (
            "scaler" not in self._undo or "backward" not in self._undo or not self.installed
        ):
            self.try_install()
        watcher = self._watcher
        if watcher is not None and not watcher.active:  # its work is done: leave meta_path
            with self._lock:
                watcher.remove()
                self._watcher = None
        self.drain()
        messages: list[Message] = []
        if self.error is not None and not self._error_reported:
            self._error_reported = True
            messages.append(ProbeStatus(t=now, probe="steps", available=False, detail=self.error))
        if time.monotonic() >= self._next_steps:
            frame = self.steps.frame(now, time.time() - time.perf_counter())
            if frame is not None:
                self._next_steps = time.monotonic() + STEPS_INTERVAL_S
                messages.append(frame)
        if self.loaders.workers_started:
            # Workers start just after their iterator's event: read them on the next tick.
            self._next_workers = min(self._next_workers, time.monotonic() + WORKERS_SOON_S)
            self.loaders.workers_started = False
        if time.monotonic() >= self._next_workers:
            self._next_workers = time.monotonic() + self.workers_interval_s
            read_safely(self.loaders)
            info = self.loaders.frame(now)
            if info is not None:
                messages.append(info)
        held = self.holders.frame(now)
        if held is not None:
            messages.append(held)
        if self.ops is not None and "profiler" in self._undo:
            messages.extend(self._ops_call(self.ops.tick, now, self.steps))
        if self.stall is not None:
            try:
                stack = self.stall.check(self.steps, now)
            except Exception:  # never the steps' fault: the stacks stop, nothing else
                self.stall = None
            else:
                if stack is not None:
                    messages.append(stack)
        return messages

    def _ops_call(self, fn: Callable[..., list[Message]], *args: Any) -> list[Message]:
        """Op sampling failing in a way it did not foresee turns it off, never the steps."""
        ops = self.ops
        try:
            return fn(*args)
        except Exception as exc:
            self.ops = None
            if ops is not None:
                with contextlib.suppress(Exception):
                    ops.stop(time.time())  # an open window closes at its owner's boundary
            else:
                step_hooks.BOUNDARY[0] = None
            detail = f"op timings unavailable: op sampling failed: {exc!r}"
            return [ProbeStatus(t=time.time(), probe=OPS_PROBE, available=False, detail=detail)]

    def stop(self, now: float) -> list[Message]:
        """Uninstall, and the last frames: the steps not yet sent and every loader's totals."""
        global _current
        if _current is self:
            _current = None
        self._running = False
        ops_frames: list[Message] = []
        if self.ops is not None:
            ops_frames = self._ops_call(self.ops.stop, now)
        self.uninstall()
        with self._tick_lock:
            self._stopped = True
            return self._last_frames(now) + ops_frames

    def _last_frames(self, now: float) -> list[Message]:
        self.drain()
        messages: list[Message] = []
        frame = self.steps.frame(now, time.time() - time.perf_counter())
        if frame is not None:
            messages.append(frame)
        read_safely(self.loaders)
        info = self.loaders.frame(now, force=True)
        if info is not None:
            messages.append(info)
        return messages

    def drain(self) -> None:
        pending = PENDING
        popleft = pending.popleft
        steps = self.steps
        loaders = self.loaders
        # The three events of every step, called through locals: the sampler holds the GIL
        # (and the training thread waits) for the whole drain, a few microseconds a step.
        loader_batch, step_batch = loaders.batch, steps.batch
        optimizer_step, backward = steps.optimizer_step, steps.backward
        while pending:
            try:
                event = popleft()
            except IndexError:
                return
            kind = event[0]
            if kind == BATCH:
                _, began, ended, iterator, size, grad = event
                wait = ended - began
                first, index = loader_batch(iterator, wait, size, grad)
                step_batch(wait, first=first, loader=index, samples=size)
                steps.last_batch = ended
            elif kind == OPT_STEP:
                optimizer_step(event[1], event[2], event[3], event[4])
            elif kind == BACKWARD:
                backward(event[1], event[2])
            elif kind == ITERATOR:
                loaders.iterator_created(*event[2:])
            elif kind == EXHAUSTED:
                _, began, ended, iterator = event
                loaders.exhausted(iterator, ended - began)
                steps.exhausted(ended - began)
            elif kind == SCALER_BEGIN:
                steps.scaler_begin(event[1], event[2])
            elif kind == SCALER_END:
                steps.scaler_end(event[1], event[2])
            elif kind == EXPLICIT_STEP:
                steps.explicit_step(event[1])
            elif kind == GAP:
                steps.restart()


_current: TrainingMonitor | None = None


def _uninstall_in_child() -> None:
    """In a forked child (a DataLoader worker): no agent, so no hooks either."""
    global _current
    monitor, _current = _current, None
    if monitor is not None:
        monitor._running = False
        step_hooks.BOUNDARY[0] = None
        step_hooks.BEFORE_STEP[0] = None
        step_hooks._WAKE[0] = None
        if monitor.ops is not None:
            monitor.ops.forget_in_child()
        # Another thread may have held the lock at the fork; in the child it never will again.
        monitor._lock = threading.Lock()
        try:
            monitor.uninstall()
        except Exception:
            pass
    PENDING.clear()


def _close_window_before_fork() -> None:
    """A child forked during an op window (a DataLoader worker) must not inherit a running
    profiler: the window closes first, shorter."""
    monitor = _current
    if monitor is not None and monitor.ops is not None:
        with contextlib.suppress(Exception):
            monitor.ops.close_now(disarm=False)


os.register_at_fork(before=_close_window_before_fork, after_in_child=_uninstall_in_child)
