"""The sampler thread: reads the probes on a drift-free schedule and publishes frames.

It also drains the events the training thread left in :data:`torchtop.agent.phases.PENDING`,
so that the training thread's own cost stays one ``deque.append``. Nothing here raises into the
job: a probe that fails three times in a row, or says it is unavailable, is switched off and
reported once as a ``probe_status`` message.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from torchtop.agent import phases
from torchtop.agent.probes.base import ProbeUnavailable
from torchtop.agent.threads import agent_thread
from torchtop.protocol import (
    DEFAULT_INTERVAL_S,
    GpuSample,
    Marked,
    MemoryStats,
    Message,
    PhaseBegan,
    PhaseEnded,
    ProbeStatus,
    Sample,
)

#: Consecutive failures after which a probe is switched off.
MAX_FAILURES = 3
#: Ticks whose times are kept (at the fastest interval, 1 ms, two seconds of them; the cost
#: measure reads them about once a second).
TICKS_KEPT = 2048


def torch_imported() -> bool:
    """True once the job has finished importing torch. The agent never imports it first."""
    module = sys.modules.get("torch")
    if module is None:
        return False
    spec = getattr(module, "__spec__", None)
    return not getattr(spec, "_initializing", False)


class _Guarded:
    """Calls one probe, turning its failures into a status message instead of an exception."""

    def __init__(self, name: str, report: Callable[[Message], None]) -> None:
        self.name = name
        self.enabled = True
        self.failures = 0
        self._report = report

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if not self.enabled:
            return None
        try:
            result = fn(*args)
        except ProbeUnavailable as exc:
            self._switch_off(str(exc))
            return None
        except Exception as exc:
            self.failures += 1
            if self.failures >= MAX_FAILURES:
                self._switch_off(f"{self.name} failed {self.failures} times: {exc!r}")
            return None
        self.failures = 0
        return result

    def _switch_off(self, detail: str) -> None:
        self.enabled = False
        self._report(ProbeStatus(t=time.time(), probe=self.name, available=False, detail=detail))


@dataclass
class SamplerStats:
    ticks: int = 0
    late_ticks: int = 0
    max_tick_s: float = 0.0
    total_tick_s: float = 0.0
    #: Ticks that waited for the job's backward pass and ran in it (:meth:`Sampler._meet_backward`).
    met_backward: int = 0


class Sampler:
    """Runs in its own daemon thread; ``publish(message)`` sends each message on."""

    def __init__(
        self,
        publish: Callable[[Message], None],
        *,
        host: Any,
        cpu_memory: Any,
        cuda_memory: Any | None,
        nvml: Any | None,
        interval_s: float = DEFAULT_INTERVAL_S,
        nvml_interval_s: float = 0.5,
        on_torch_imported: Callable[[], None] | None = None,
        stats_every: int = 10,
        agent_stats: Callable[[SamplerStats], Message | None] | None = None,
        training: Any | None = None,
        collectives: Any | None = None,
        outside: Callable[[str], bool] | None = None,
        batched: Callable[[], AbstractContextManager[None]] | None = None,
        on_resumed: Callable[[float], None] | None = None,
    ) -> None:
        #: ``batched()``: a block whose frames reach the viewers together, at its end (one
        #: wake of the I/O thread a tick).
        self._batched = batched or contextlib.nullcontext
        #: ``outside(name)``: True while the viewers read ``name`` (``host``, ``nvml``) from
        #: outside the job; the sampler then reads the RSS alone, and no NVML.
        self._outside = outside
        self._agent_stats = agent_stats
        #: Steps and DataLoaders (:class:`torchtop.agent.training.TrainingMonitor`): its
        #: ``tick(now)`` drains the training thread's hooks and returns frames to publish.
        self._training = training
        self._publish = publish
        self._on_torch_imported = on_torch_imported
        self._torch_seen = False
        self._cuda_seen = False
        self._host = host
        self._cpu_memory = cpu_memory
        self._cuda_memory = cuda_memory
        self._nvml = nvml
        self.interval_s = interval_s
        self.nvml_interval_s = nvml_interval_s
        self._guards = {
            name: _Guarded(name, publish) for name in ("host", "cpu_memory", "cuda_memory", "nvml")
        }
        self._guards["training"] = _Guarded("training", publish)
        #: The flight recorder's reader (:class:`torchtop.agent.collectives.CollectiveMonitor`).
        self._collectives = collectives
        self._guards["collectives"] = _Guarded("collectives", publish)
        self._stop = threading.Event()
        #: Set by :meth:`stop` at the job's end: the thread's last read of the collectives.
        self._final = False
        self._resumed = threading.Event()
        self._resumed.set()
        self._thread = agent_thread(self._run, "torchtop-sampler")
        self._next_nvml = 0.0
        self.stats = SamplerStats()
        #: The configured interval; :meth:`slow_down` lengthens ``interval_s`` from it.
        self.base_interval_s = interval_s
        #: The agent's stats go out every ``stats_every`` configured intervals, in time (a
        #: slowed sampler still reports about once a second).
        self._stats_period_s = stats_every * interval_s
        self._next_stats = 0.0
        self._rescheduled = False
        #: When the latest ticks ran (``perf_counter``), and when the one running began: the
        #: cost measure classes the steps they overlapped (:class:`~torchtop.agent.cost.
        #: TickedSteps`).
        self.ticks: deque[tuple[float, float]] = deque(maxlen=TICKS_KEPT)
        self.tick_began = -math.inf
        self._pause: tuple[float, float] | None = None
        #: :meth:`pause` and :meth:`resume`: when the pause began, the seconds paused in all,
        #: and how many of them the sampler thread has moved its schedule by.
        self._paused_at: float | None = None
        self._paused_s = 0.0
        self._paused_taken = 0.0
        #: ``on_resumed(seconds)``: what others schedule in sampling time moves on too.
        self._on_resumed = on_resumed

    def slow_down(self, factor: float, most_s: float) -> float:
        """Sample ``factor`` times less often, ``most_s`` seconds apart at most (never faster
        than configured); the new interval."""
        interval = max(self.base_interval_s, min(self.interval_s * factor, most_s))
        if interval != self.interval_s:
            self.interval_s = interval
            self._rescheduled = True
        return self.interval_s

    def start(self) -> None:
        self._thread.start()

    def pause_for(self, seconds: float) -> tuple[float, float]:
        """From the sampler thread itself: do nothing for ``seconds`` (less if stopped), then
        sample on a schedule that starts again; when the pause began and ended
        (``perf_counter``)."""
        began = time.perf_counter()
        self._stop.wait(seconds)
        self._rescheduled = True
        self._pause = (began, time.perf_counter())
        return self._pause

    def _record_tick(self, began: float, ended: float) -> None:
        """Keep when a tick ran (its pause left out: the sampler did nothing then)."""
        pause, self._pause = self._pause, None
        if pause is None:
            self.ticks.append((began, ended))
        else:
            self.ticks.append((began, pause[0]))
            self.ticks.append((pause[1], ended))

    def known_ticks(self) -> tuple[deque[tuple[float, float]], float, float]:
        """From the sampler thread (the one that adds to them), within a tick: the ticks
        kept, each its start and end (``perf_counter``); the time from which every tick is
        among them; and the start of the tick now running, before which every tick has
        ended."""
        ticks = self.ticks
        full = len(ticks) == ticks.maxlen
        return ticks, ticks[0][0] if full else -math.inf, self.tick_began

    def pause(self) -> None:
        """Stop sampling until :meth:`resume` (the thread stays, idle): the overhead
        benchmark's "off" blocks. The time paused does not count: the ticks go on from where
        they were, and so does everything scheduled in sampling time (the agent's stats, NVML,
        the steps' and loaders' frames, op windows), so that however short the blocks, the
        sampling in them is as dense as the job's own."""
        if self._resumed.is_set():
            self._paused_at = time.monotonic()
            self._resumed.clear()

    def resume(self) -> None:
        paused_at = self._paused_at
        if paused_at is not None:  # the seconds counted before the pause is cleared
            self._paused_s += time.monotonic() - paused_at
            self._paused_at = None
        self._resumed.set()

    def sampling_time(self) -> float:
        """``time.monotonic`` less the time :meth:`pause` held the sampler: the clock of the
        agent's own schedules, and of its cost's shares (a share of time it was paused in
        would read lower than what it costs while it runs)."""
        now = time.monotonic()
        paused_at = self._paused_at
        return now - self._paused_s - (now - paused_at if paused_at is not None else 0.0)

    def _take_paused(self) -> float:
        """From the sampler thread: the seconds paused since it last asked."""
        paused = self._paused_s - self._paused_taken
        self._paused_taken += paused
        return paused

    def _resumed_after(self, paused_s: float) -> None:
        """Move what is scheduled in sampling time ``paused_s`` seconds later."""
        self._next_stats += paused_s
        self._next_nvml += paused_s
        if self._on_resumed is not None:
            self._on_resumed(paused_s)

    def stop(self, timeout: float = 1.0, final: bool = False) -> None:
        """Stop the thread, waiting ``timeout`` at most. ``final``: the job is ending; the
        thread reads the collectives' rings a last time before it ends (their last second,
        else never sent), a read that no other thread makes: the thread ending the job takes
        its last sample with ``tick(collectives=False)``."""
        self._final = self._final or final
        self._stop.set()
        self._resumed.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self.drain_events()
            if self._final:
                self._read_collectives(time.time(), final=True)

    def _loop(self) -> None:
        # Ticks fall on start + k * interval: a slow tick delays one sample but never shifts
        # the schedule, and ticks missed entirely are skipped, not bunched.
        start = time.monotonic()
        k = 0
        self._next_stats = start + self._stats_period_s
        while not self._stop.is_set():
            if not self._resumed.is_set():
                while not self._resumed.wait(0.2):
                    if self._stop.is_set():
                        return
            paused = self._take_paused()
            if paused > 0:  # the ticks go on where they were, the pause left out
                start += paused
                self._resumed_after(paused)
                wait = start + k * self.interval_s - time.monotonic()
                if wait > 0:
                    self._stop.wait(wait)
                    continue
            self._meet_backward()
            if not self._resumed.is_set():  # paused while it waited: no tick in the pause
                continue
            began = self.tick_began = time.perf_counter()
            with self._batched():
                self._timed_tick()
            self._record_tick(began, time.perf_counter())
            if self._rescheduled:  # a new interval: the schedule starts again from here
                self._rescheduled = False
                start, k = time.monotonic(), 0
            k += 1
            due = start + k * self.interval_s
            now = time.monotonic()
            if now > due:
                missed = int((now - due) / self.interval_s) + 1
                self.stats.late_ticks += missed
                k += missed
                due = start + k * self.interval_s
            self._stop.wait(max(0.0, due - now))

    def _meet_backward(self) -> None:
        """Let the tick wait, briefly, for the job's next backward pass
        (:meth:`~torchtop.agent.training.TrainingMonitor.before_tick`)."""
        training = self._training
        if training is None or not self._guards["training"].enabled:
            return
        try:
            if training.before_tick(self.interval_s):
                self.stats.met_backward += 1
        except Exception:  # the tick runs as it would have
            pass

    def _timed_tick(self) -> None:
        began = time.monotonic()
        try:
            self.tick()
        except Exception:  # pragma: no cover - tick guards each probe already
            pass
        elapsed = time.monotonic() - began
        self.stats.ticks += 1
        self.stats.total_tick_s += elapsed
        self.stats.max_tick_s = max(self.stats.max_tick_s, elapsed)
        if self._agent_stats is not None and time.monotonic() >= self._next_stats:
            self._next_stats = time.monotonic() + self._stats_period_s
            message = self._agent_stats(self.stats)
            if message is not None:
                self._publish(message)

    def drain_events(self) -> None:
        """Publish every phase and mark the training thread has left so far."""
        pending = phases.PENDING
        while pending:
            try:
                kind, t, name, phase_id, description = pending.popleft()
            except IndexError:
                return
            message: Message
            if kind == "phase_began":
                message = PhaseBegan(t=t, name=name, id=phase_id, description=description)
            elif kind == "phase_ended":
                message = PhaseEnded(t=t, name=name, id=phase_id)
            else:
                message = Marked(t=t, name=name)
            self._publish(message)

    def tick(self, collectives: bool = True) -> None:
        """One sample of every probe; ``collectives``: the collectives' rings too (left to the
        sampler's own thread at the job's end, where a dump that hangs holds up a daemon
        thread, never the exit: see :meth:`stop`)."""
        self.drain_events()
        now = time.time()
        outside = self._outside
        host_outside = outside is not None and outside("host")
        host = self._guards["host"].call(self._host.read_rss if host_outside else self._host.read)
        rss = host.rss_bytes if host is not None else None
        memory: list[MemoryStats] = []
        cpu = self._guards["cpu_memory"].call(self._cpu_memory.read, rss)
        if cpu is not None:
            memory.append(cpu)
        if not self._torch_seen and torch_imported():
            self._torch_seen = True
            if self._on_torch_imported is not None:
                self._on_torch_imported()
        if (
            self._torch_seen
            and not self._cuda_seen
            and self._cuda_memory is not None
            and self._cuda_memory.cuda_initialized()
        ):
            # Once the job has initialized CUDA, the devices' names, sizes and UUIDs can be
            # read: viewers get a new hello with them.
            self._cuda_seen = True
            if self._on_torch_imported is not None:
                self._on_torch_imported()
        if self._cuda_memory is not None and self._torch_seen:
            memory.extend(self._guards["cuda_memory"].call(self._cuda_memory.read) or [])
        self._publish(Sample(t=now, host=host, memory=memory))
        if (
            self._nvml is not None
            and time.monotonic() >= self._next_nvml
            and not (outside is not None and outside("nvml"))
        ):
            self._next_nvml = time.monotonic() + self.nvml_interval_s
            gpus = self._guards["nvml"].call(self._nvml.read)
            if gpus is not None:
                self._publish(GpuSample(t=now, gpus=gpus))
        if self._training is not None:
            for message in self._guards["training"].call(self._training.tick, now) or ():
                self._publish(message)
        if collectives:
            self._read_collectives(now)

    def _read_collectives(self, now: float, final: bool = False) -> None:
        if self._collectives is not None and self._torch_seen:
            seen = self._guards["collectives"].call(self._collectives.tick, now, final)
            for message in seen or ():
                self._publish(message)
