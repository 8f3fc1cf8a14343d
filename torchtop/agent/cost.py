"""The agent's own cost, measured in the job, and the budget that slows its sampler.

Every second the sampler asks :class:`CostMeter` how much CPU the agent's threads used since
the last time: as a share of one core, and, while the job takes steps, of its training time (a
job whose step holds the GIL loses about that much of each step to the agent). Above the budget
for :data:`OVER_BUDGET_S` seconds in a row, the sampler's interval doubles, up to
:data:`MAX_INTERVAL_S`; the first slowdown is said once, in the job's stderr and to viewers.

CPU time does not show what a step that holds the GIL loses waiting for the agent's threads to
let go of it. :class:`PausedSteps` measures that too, as the benchmark does: it pauses the
agent now and then and compares the steps in the pause with those around it; until those
comparisons agree, :class:`TickedSteps` measures it from the steps the sampler's ticks
overlapped against the others.

Neither sees the hooks, which run in the training thread itself: they keep their own time
(:data:`torchtop.agent.steps.HOOK_S`), and its share of the training time is added to both.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from torchtop.agent.threads import agent_cpu_s

#: Seconds above the budget before the sampler slows down (again).
OVER_BUDGET_S = 2
#: The slowest the budget makes the sampler (viewers call an agent silent after 3 s).
MAX_INTERVAL_S = 1.0


#: The least of their own budget (``--ops-budget``) the op windows keep however much of the
#: agent's budget the rest of it takes: op timings still come, further apart.
WINDOWS_FLOOR = 0.2
#: The agent's readings (one a second) whose median is the rest of its cost, for the windows'
#: budget: a second's spell of noise does not move the windows.
REST_READINGS = 10


def windows_budget(ops_budget: float, cost_budget: float, rest_share: float | None) -> float:
    """The share of the job's time the op windows may cost: their own budget, or what the
    agent's budget leaves after the rest of its cost (``rest_share``: its threads' CPU
    without the windows' reading, and its hooks' time), whichever is less, and never below
    :data:`WINDOWS_FLOOR` of their own. On a model whose steps are Python-bound the rest
    takes most of the agent's budget: its windows come further apart, and the agent's whole
    cost stays near its budget. No agent budget (0), or no reading yet: their own."""
    if cost_budget <= 0 or rest_share is None:
        return ops_budget
    return min(ops_budget, max(ops_budget * WINDOWS_FLOOR, cost_budget - rest_share))


@dataclass(frozen=True)
class Cost:
    """One reading: the agent's CPU so far and its shares over the last interval."""

    cpu_s: float | None
    cpu_share: float | None
    #: The agent's threads' CPU and its hooks' time, as a share of the training time.
    step_share: float | None
    #: The step share the budget weighs: the threads' CPU without the op windows' reading,
    #: which their own budget (``--ops-budget``) already paces; not the hooks, which a slower
    #: sampler would not make cheaper. ``None`` while the job takes no steps.
    budgeted_share: float | None = None
    #: The hooks' own time in the training thread, as a share of the training time.
    hooks_share: float | None = None


class CostMeter:
    """Measures the agent's threads' CPU against wall time and the job's steps."""

    def __init__(
        self,
        budget: float,
        steps_total: Callable[[], int],
        cpu_s: Callable[[], float | None] = agent_cpu_s,
        clock: Callable[[], float] = time.monotonic,
        exempt_s: Callable[[], float] = lambda: 0.0,
        hooks_s: Callable[[], float] = lambda: 0.0,
    ) -> None:
        """``exempt_s``: seconds so far of the agent's work another budget pays for (the op
        windows' reading); counted in the shares shown, not in the one this budget weighs.
        ``hooks_s``: seconds so far of the training thread in the agent's hooks."""
        self.budget = budget
        self._steps_total = steps_total
        self._cpu_s = cpu_s
        self._clock = clock
        self._exempt_s = exempt_s
        self._hooks_s = hooks_s
        self._last: tuple[float, float, int, float, float] | None = None
        self._over = 0
        self.slowdowns = 0
        #: The latest readings of the rest of the agent's cost (:meth:`rest_share`).
        self._rest: deque[float] = deque(maxlen=REST_READINGS)

    def read(self) -> Cost:
        """The cost since the previous reading (the shares are ``None`` on the first)."""
        cpu = self._cpu_s()
        now = self._clock()
        try:
            steps = self._steps_total()
        except Exception:
            steps = 0
        if cpu is None:
            return Cost(None, None, None)
        exempt = self._exempt_s()
        hooks = self._hooks_s()
        last, self._last = self._last, (now, cpu, steps, exempt, hooks)
        if last is None or now <= last[0]:
            return Cost(cpu, None, None)
        wall = now - last[0]
        share = max(0.0, cpu - last[1]) / wall
        if steps <= last[2]:
            return Cost(cpu, share, None)
        # While the job steps, the agent's CPU time comes out of its training time, and so
        # does the hooks' time in the training thread.
        budgeted = max(0.0, cpu - last[1] - (exempt - last[3])) / wall
        hooks_share = max(0.0, hooks - last[4]) / wall
        self._rest.append(budgeted + hooks_share)
        return Cost(cpu, share, share + hooks_share, budgeted, hooks_share)

    def rest_share(self) -> float | None:
        """The rest of the agent's cost besides its op windows (its threads' CPU without the
        windows' reading, and its hooks' time): the median of the latest
        :data:`REST_READINGS` readings taken while the job stepped; ``None`` before one."""
        return statistics.median(self._rest) if self._rest else None

    def over_budget(self, cost: Cost) -> bool:
        """True when the sampler should slow down now: ``cost`` is the latest reading, above
        the budget for :data:`OVER_BUDGET_S` readings in a row."""
        share = cost.budgeted_share
        if self.budget <= 0 or share is None or share <= self.budget:
            self._over = 0
            return False
        self._over += 1
        if self._over < OVER_BUDGET_S:
            return False
        self._over = 0
        self.slowdowns += 1
        return True


# --------------------------------------------------------------------------------------------
# The cost on the steps, measured: pauses of the agent compared with the time around them
# --------------------------------------------------------------------------------------------

#: How often the agent pauses to measure what it costs the steps, and for how long. A pause
#: stops the sampler (and so the server's sending) but not the hooks: no step is lost, the
#: viewer sees samples stop for two seconds (it calls an agent silent after three).
PAUSE_EVERY_S = 60.0
PAUSE_S = 2.0
#: Steps needed on each side of a comparison: a job slower than this many steps a pause is not
#: measured this way (its shown cost stays the agent's CPU share).
MIN_BLOCK_STEPS = 8
#: The comparisons kept; their median is the measured cost.
KEEP_PAIRS = 15
#: Comparisons needed before the measured cost is said.
MIN_PAIRS = 3
#: The measure is said only once it is this precise (the standard error of the median of the
#: comparisons, from their spread), or within half of itself: on a busy machine a few pauses'
#: comparisons vary by several percent, and a cost read from them would be the machine's noise
#: (5.1% once, over 6 pauses, where the benchmark measured 0.0 to 1.2%).
MAX_ERROR = 0.005


@dataclass(frozen=True)
class Measured:
    """The agent's cost on the job's steps as a share of their time, measured on ``pairs``
    comparisons: pauses (:class:`PausedSteps`) or steps a tick overlapped
    (:class:`TickedSteps`)."""

    step_share: float
    pairs: int


class PausedSteps:
    """Measures what the agent costs the steps the way a benchmark does, in the job itself.

    Every :data:`PAUSE_EVERY_S` the sampler stops for :data:`PAUSE_S` (:meth:`due`, then
    :meth:`paused` with when the pause began and ended, ``perf_counter``). The steps that ran
    wholly inside the pause ran without the agent's threads; those in the same length of time
    just before and just after ran with them. The ratio of their medians, less one, is one
    comparison; :meth:`measured` is the median of the last :data:`KEEP_PAIRS`. Unlike the
    agent's CPU share, it includes what a Python-bound step loses waiting for the GIL while the
    agent's threads hold it. The step hooks stay in (torch keeps the optimizer's in a dict the
    training thread walks, which another thread must not change under it): the agent adds
    their own time (:data:`torchtop.agent.steps.HOOK_S`) to this measure.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.perf_counter,
        every_s: float = PAUSE_EVERY_S,
        pause_s: float = PAUSE_S,
    ) -> None:
        self._clock = clock
        self.every_s = every_s
        self.pause_s = pause_s
        self._next = clock() + every_s / 2
        self._open: deque[tuple[float, float, list[float], list[float]]] = deque(maxlen=4)
        self._ratios: deque[float] = deque(maxlen=KEEP_PAIRS)
        self.pauses = 0

    def due(self, usual_step_s: float | None, busy: bool = False) -> bool:
        """Whether to pause now: the job steps fast enough to measure (``usual_step_s``, its
        median step) and nothing else of the agent is under way (``busy``: an op window)."""
        now = self._clock()
        if now < self._next:
            return False
        if busy or usual_step_s is None or usual_step_s * MIN_BLOCK_STEPS > self.pause_s:
            self._next = now + self.every_s / 4  # look again a little later
            return False
        return True

    def paused(self, began: float, ended: float, steps: Iterable[tuple[float, float]] = ()) -> None:
        """A pause from ``began`` to ``ended``; ``steps`` (end, duration) as they stand right
        after it: the steps before it and in it are taken now, before a fast job's steps push
        them out of the collector's recent ones."""
        self.pauses += 1
        self._next = ended + self.every_s
        held = list(steps)
        before = [d for e, d in held if began - self.pause_s <= e - d and e <= began]
        off = [d for e, d in held if e - d >= began and e <= ended]
        self._open.append((began, ended, before, off))

    def add(self, ends: Iterable[tuple[float, float]]) -> None:
        """Compare the pauses whose after-block has passed, with the steps so far (``ends``:
        each step's end and duration, ``perf_counter``)."""
        now = self._clock()
        steps = None
        while self._open and self._open[0][1] + self.pause_s <= now:
            _began, ended, before, off = self._open.popleft()
            if steps is None:
                steps = list(ends)
            after = [d for e, d in steps if e - d >= ended and e <= ended + self.pause_s]
            ratio = _ratio(before + after, off)
            if ratio is not None:
                self._ratios.append(ratio)

    @property
    def compared(self) -> int:
        """Comparisons kept (the measure's pairs, once it is said)."""
        return len(self._ratios)

    def measured(self) -> Measured | None:
        """The median comparison, less one; ``None`` until :data:`MIN_PAIRS` comparisons and
        while they vary too much to say (:data:`MAX_ERROR`)."""
        ratios = list(self._ratios)
        if len(ratios) < MIN_PAIRS:
            return None
        share = statistics.median(ratios) - 1.0
        error = _median_error(ratios)
        if error > max(MAX_ERROR, abs(share) / 2):
            return None
        return Measured(share, len(ratios))


def _median_error(values: list[float]) -> float:
    """The standard error of the median of ``values``, from their spread (sigma ~ IQR / 1.349)."""
    q1, _, q3 = statistics.quantiles(values, n=4)
    return 1.2533 * (q3 - q1) / 1.349 / math.sqrt(len(values))


def _mean_error(values: list[float]) -> float:
    """The standard error of the mean of ``values``."""
    return statistics.stdev(values) / math.sqrt(len(values))


def _ratio(on: list[float], off: list[float]) -> float | None:
    """Median step time with the agent (``on``: the steps just before and after a pause) over
    the median without it (``off``: the steps wholly inside it)."""
    if len(off) < MIN_BLOCK_STEPS or len(on) < MIN_BLOCK_STEPS:
        return None
    off_median = statistics.median(off)
    if off_median <= 0:
        return None
    return statistics.median(on) / off_median


# --------------------------------------------------------------------------------------------
# The cost on the steps, measured: the steps a sampler tick overlapped against the others
# --------------------------------------------------------------------------------------------

#: Steps kept for the tick measure (a fast job's last 20 seconds or so, a slow one's minutes).
TICKED_KEEP = 10000
#: Seconds between two readings of the tick measure (each sorts the steps kept), and while
#: it has said nothing yet.
TICKED_EVERY_S = 10.0
TICKED_UNSAID_EVERY_S = 2.0
#: Steps a tick overlapped, and steps none did, before the tick measure is said.
MIN_TICKED = 50
MIN_CLEAR = 200
#: Seconds after a tick's end that still count as its own: the frames it published leave in
#: the server's I/O thread just after it.
TICK_TAIL_S = 0.002


def _overlapped_mean(clear: list[float], span_s: float, period_s: float) -> float | None:
    """What the mean overlapped step would take were the ticks free, from the steps no tick
    overlapped (``clear``): a step of d seconds meets a tick's span of ``span_s`` once every
    ``period_s`` with odds (d + span) / period, and misses it with the rest, so each is weighed
    by their ratio. ``None`` where no step is short enough to miss a tick."""
    total = weights = 0.0
    for d in clear:
        miss = period_s - d - span_s
        if miss <= 0:
            continue
        weight = (d + span_s) / miss
        total += d * weight
        weights += weight
    return total / weights if weights > 0 else None


class TickedSteps:
    """Measures what the agent's threads cost the steps from the steps themselves, with no
    pause: the sampler's ticks (and the sending just after each) are where its threads run, so
    the steps a tick overlapped are the ones that could wait for it, and the others are the
    steps without it. (mean of the overlapped - what they would take without the ticks) x the
    overlapped steps, over the steps' time, is the share of the step time the ticks cost. A
    tick holds up one or two steps, however many its span meets, hence means, not medians.

    A step that holds the GIL (Python-bound) waits for a tick that holds it; a step in C++ or
    CUDA that let go of it does not, and its overlapped steps run as fast as the others: there
    the agent's CPU share says far more than the steps lose. What the overlapped steps would
    take without the ticks comes from the others, each weighed by its odds of being overlapped
    against missed (a longer step is likelier to be overlapped: the machine's slow spells would
    otherwise read as a cost). The op windows' reading, a long tick every several seconds, is
    not in it: the steps from a window's start to the end of its reading are the window's cost,
    which the window measures itself (:meth:`~torchtop.agent.ops.sampler.OpsSampler.
    windows_share`); nor are the hooks, which run in every step: the agent adds both to it.

    :meth:`add` takes the steps' ends and durations and the ticks' start and end, all
    ``perf_counter``; a step is classed once no tick that could overlap it is still to come.
    """

    def __init__(
        self,
        keep: int = TICKED_KEEP,
        every_s: float = TICKED_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        #: (duration, overlapped by a tick) of the latest steps.
        self._steps: deque[tuple[float, bool]] = deque(maxlen=keep)
        self._last_end = -math.inf
        self._every_s = every_s
        self._clock = clock
        self._next = -math.inf
        self._measured: Measured | None = None
        #: How long a tick's span lasts, its tail included (the latest ticks' mean).
        self._span_s = TICK_TAIL_S
        #: How far apart the ticks start (the latest ticks' median gap).
        self._period_s = math.inf

    def add(
        self,
        ends: Sequence[tuple[float, float]],
        ticks: Sequence[tuple[float, float]],
        known_until: float,
        known_from: float = -math.inf,
        windows: Sequence[tuple[float, float]] = (),
    ) -> None:
        """Class the steps (``ends``: each step's end and duration) that ended by
        ``known_until`` (the start of the tick now running) and were not classed before.
        ``ticks``: each tick's start and end, every one from ``known_from`` on (a step that
        began before it is left out: a tick no longer kept may have overlapped it).
        ``windows``: the op windows' spans (start and end, in order): the steps they overlap
        are their cost, measured by the windows themselves, and left out here."""
        last = self._last_end
        new: list[tuple[float, float]] = []
        for step in reversed(ends):  # the new steps only, from the latest back
            if step[0] <= last:
                break
            new.append(step)
        if not new:
            return
        earliest = min(end - duration for end, duration in new)
        spans: list[tuple[float, float]] = []
        for began, ended in reversed(ticks):  # the ticks that could overlap them
            if ended + TICK_TAIL_S <= earliest:
                break
            spans.append((began, ended + TICK_TAIL_S))
        spans.reverse()
        if spans:
            self._span_s = math.fsum(e - b for b, e in spans) / len(spans)
        if len(spans) > 1:  # the usual gap: a pause of the other measure is not one
            self._period_s = statistics.median(
                later[0] - earlier[0] for earlier, later in itertools.pairwise(spans)
            )
        opened = [w for w in windows if w[1] > earliest]
        j = k = 0
        for end, duration in reversed(new):
            if end > known_until:
                break
            start = end - duration
            last = end
            if start < known_from:
                continue
            while k < len(opened) and opened[k][1] <= start:
                k += 1  # windows that ended before this step began
            if k < len(opened) and opened[k][0] < end:
                continue  # a window's step: its cost is the window's
            while j < len(spans) and spans[j][1] <= start:
                j += 1  # ticks that ended before this step began
            self._steps.append((duration, j < len(spans) and spans[j][0] < end))
        self._last_end = last

    @property
    def overlapped(self) -> int:
        """Steps kept that a tick overlapped."""
        return sum(1 for _, hit in self._steps if hit)

    def measured(self, fresh: bool = False) -> Measured | None:
        """The ticks' cost as a share of the step time, over :attr:`overlapped` steps; ``None``
        until :data:`MIN_TICKED` and :data:`MIN_CLEAR` steps, and while the medians are known
        too roughly to say (:data:`MAX_ERROR`, as for the pauses). Worked out again every
        :data:`TICKED_EVERY_S` (:data:`TICKED_UNSAID_EVERY_S` while it says nothing), or now
        if ``fresh``."""
        now = self._clock()
        if fresh or now >= self._next:
            self._measured = self._measure()
            said = self._measured is not None
            self._next = now + (self._every_s if said else TICKED_UNSAID_EVERY_S)
        return self._measured

    def _measure(self) -> Measured | None:
        hit = [d for d, overlapped in self._steps if overlapped]
        clear = [d for d, overlapped in self._steps if not overlapped]
        if len(hit) < MIN_TICKED or len(clear) < MIN_CLEAR:
            return None
        total = math.fsum(d for d, _ in self._steps)
        if total <= 0:
            return None
        weight = len(hit) / total
        # A longer step is likelier to be overlapped: the others are weighed by their odds of
        # a tick against a miss, or the machine's slow spells, overlapped more often, would
        # read as a cost.
        usual = _overlapped_mean(clear, self._span_s, self._period_s)
        if usual is None:
            return None
        share = (statistics.fmean(hit) - usual) * weight
        error = math.hypot(_mean_error(hit), _mean_error(clear)) * weight
        if error > max(MAX_ERROR, abs(share) / 2):
            return None
        return Measured(share, len(hit))
