"""A job's training loop: its steps and its DataLoaders, folded from ``steps`` and ``loaders``.

Pure Python. :class:`torchtop.model.JobModel` holds one :class:`TrainingState` and hands it
those messages; the viewer's step and loader panels, the report and the exporters read it.

Figures come in two spans: *recent* (the steps of the last :data:`RECENT_WINDOW_S` seconds, or
the last :data:`MIN_RECENT_STEPS` steps when they take longer) and the whole run. The job is
*input-bound* when the recent wait fraction is at least :data:`INPUT_BOUND_FRACTION`: the
training thread spent that share of its step time blocked on the next batch.

A frame lists up to ``MAX_STEP_DETAIL`` of its steps; when it sampled them, each listed step
stands for the steps up to the next one listed (its *weight*), so counts stay exact and
percentiles are those of an even sample. The whole run's steps are kept in
:class:`StepHistory`, an even sample of bounded size: exact until it fills, then halved.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from torchtop.protocol import LoaderInfo, LoaderStats, Message, StepStats, step_detail_weights

#: Seconds of steps that the recent figures cover.
RECENT_WINDOW_S = 10.0
#: The fewest steps the recent figures cover, however long they take.
MIN_RECENT_STEPS = 5
#: A recent wait fraction at or above this flags the job as input-bound.
INPUT_BOUND_FRACTION = 0.3
T = TypeVar("T")
D = TypeVar("D")

#: Steps kept for the charts (each may stand for several when the agent sampled them).
DEFAULT_STEP_POINTS = 6000
#: Seconds of steps the step-time chart's series folds into one point: the longest step and
#: the longest wait among them, each at its own time. A chart column spans a second or more,
#: so it draws the same curve from a fast job's few points a column as from its hundreds.
CHART_BUCKET_S = 0.1
#: Steps kept for the whole run's percentiles before the sample is halved.
DEFAULT_HISTORY_STEPS = 16384
#: Worker pids remembered per loader to count the workers seen (new pids beyond are counted).
WORKER_PIDS_KEPT = 256
#: Readings of the workers' private memory kept per loader (about one a second).
WORKER_USS_KEPT = 600


@dataclass(slots=True)
class StepPoint:
    """One step as the agent listed it. ``duration`` is ``None`` for the job's first step;
    ``weight`` is how many steps it stands for (more than one when the agent sampled them)."""

    t: float
    duration: float | None
    wait: float
    startup: float
    optimizer: float
    samples: int
    weight: int = 1
    #: Time inside ``loss.backward()`` (a DDP rank's all-reduce wait included); inside compute.
    backward: float = 0.0

    @property
    def compute(self) -> float | None:
        """The step's time not spent waiting for data (optimizer time included)."""
        if self.duration is None:
            return None
        return max(0.0, self.duration - self.wait - self.startup)


@dataclass
class StepTotals:
    """Sums over some timed steps."""

    steps: int = 0
    time_s: float = 0.0
    wait_s: float = 0.0
    startup_s: float = 0.0
    optimizer_s: float = 0.0
    samples: int = 0
    backward_s: float = 0.0

    def add(self, other: StepTotals) -> None:
        self.steps += other.steps
        self.time_s += other.time_s
        self.wait_s += other.wait_s
        self.startup_s += other.startup_s
        self.optimizer_s += other.optimizer_s
        self.samples += other.samples
        self.backward_s += other.backward_s

    @property
    def mean_step_s(self) -> float | None:
        return self.time_s / self.steps if self.steps else None

    @property
    def mean_wait_s(self) -> float | None:
        return self.wait_s / self.steps if self.steps else None

    @property
    def mean_compute_s(self) -> float | None:
        if not self.steps:
            return None
        return max(0.0, self.time_s - self.wait_s - self.startup_s) / self.steps

    @property
    def mean_backward_s(self) -> float | None:
        return self.backward_s / self.steps if self.steps else None

    @property
    def mean_optimizer_s(self) -> float | None:
        return self.optimizer_s / self.steps if self.steps else None

    @property
    def wait_fraction(self) -> float | None:
        """Steady-state data wait over step time (first batches excluded)."""
        return self.wait_s / self.time_s if self.time_s > 0 else None

    @property
    def steps_per_s(self) -> float | None:
        return self.steps / self.time_s if self.time_s > 0 else None

    @property
    def samples_per_s(self) -> float | None:
        """``None`` when no step had a DataLoader batch to count."""
        return self.samples / self.time_s if self.time_s > 0 and self.samples else None


def weighted_quantile(values: Iterable[tuple[float, int]], q: float) -> float | None:
    """The ``q`` quantile (nearest rank) of ``(value, weight)`` pairs; ``None`` if empty."""
    ordered = sorted(v for v in values if v[1] > 0)
    total = sum(w for _, w in ordered)
    if total == 0:
        return None
    rank = max(1, math.ceil(q * total - 1e-9))
    seen = 0
    for value, weight in ordered:
        seen += weight
        if seen >= rank:
            return value
    return ordered[-1][0]


@dataclass
class StepHistory:
    """The whole run's steps as ``(end, duration, weight)``: an even sample of bounded size.

    Exact until ``capacity`` entries; then every pair of neighbours becomes one entry that
    stands for both (the later end, the duration of one of the two picked at random, the sum of
    weights), and new steps are grouped alike as they arrive. Counts stay exact, and
    percentiles are those of a random sample of the whole run, one step in ``2**halvings``
    (picked at random, so a periodic pattern in the step times is not aliased away).
    """

    capacity: int = DEFAULT_HISTORY_STEPS
    entries: list[tuple[float, float | None, int]] = field(default_factory=list)
    #: How many times the sample was halved (0: every listed step is here).
    halvings: int = 0
    #: Steps not yet grouped into an entry (only once halved): the last end, the picked
    #: duration, the summed weight, how many there are, and which of them is picked.
    _group: list[Any] | None = field(default=None, repr=False)
    _seed: int = field(default=0x2545F4914F6CDD1D, repr=False)

    def _pick(self, n: int) -> int:
        """A pseudo-random index below ``n`` (a fixed sequence: the same run folds the same)."""
        self._seed = (self._seed * 6364136223846793005 + 1442695040888963407) & (2**64 - 1)
        return (self._seed >> 33) % n

    def add(self, end: float, duration: float | None, weight: int) -> None:
        if not self.halvings:  # every step kept as it came
            self.entries.append((end, duration, weight))
            if len(self.entries) >= self.capacity:
                self._halve()
            return
        group = self._group
        if group is None:
            group = self._group = [end, None, 0, 0, self._pick(1 << self.halvings)]
        if group[3] == group[4] or group[1] is None:
            group[1] = duration
        group[0] = end
        group[2] += weight
        group[3] += 1
        if group[3] == 1 << self.halvings:
            self._group = None
            self.entries.append((group[0], group[1], group[2]))
            if len(self.entries) >= self.capacity:
                self._halve()

    def extend(self, ends: list[float], durations: list[float | None], weights: list[int]) -> None:
        """:meth:`add` for each of a frame's steps (at once while no step is grouped)."""
        if self.halvings or len(self.entries) + len(ends) >= self.capacity:
            for entry in zip(ends, durations, weights, strict=False):
                self.add(*entry)
            return
        self.entries.extend(zip(ends, durations, weights, strict=False))

    def _halve(self) -> None:
        old = self.entries
        entries = []
        for i in range(0, len(old) - 1, 2):
            a, b = old[i], old[i + 1]
            kept = b if self._pick(2) else a
            duration = kept[1] if kept[1] is not None else (a[1] if kept is b else b[1])
            entries.append((b[0], duration, a[2] + b[2]))
        self.entries = entries
        self.halvings += 1
        if len(old) % 2:  # the odd one out waits for its partner
            end, duration, weight = old[-1]
            size = 1 << (self.halvings - 1)
            self._group = [end, duration, weight, size, size - 1]

    def _all(self) -> Iterator[tuple[float, float | None, int]]:
        yield from self.entries
        if self._group is not None:
            yield (self._group[0], self._group[1], self._group[2])

    def __len__(self) -> int:
        return len(self.entries) + (self._group is not None)

    def durations(
        self, start: float | None = None, end: float | None = None
    ) -> list[tuple[float, int]]:
        """``(duration, weight)`` of the timed steps that ended in ``[start, end]``."""
        return [
            (d, w)
            for t, d, w in self._all()
            if d is not None and (start is None or t >= start) and (end is None or t <= end)
        ]

    def count(self, start: float | None = None, end: float | None = None) -> int:
        """Steps (weights) that ended in ``[start, end]``."""
        return sum(
            w
            for t, _, w in self._all()
            if (start is None or t >= start) and (end is None or t <= end)
        )

    def ended_by(self, times: Sequence[float]) -> list[int]:
        """For each of ``times``, the steps (weights) that ended at or before it, in one pass
        over the history (its ends are in order: steps are listed as they end)."""
        ends: list[float] = []
        cumulative = [0]
        for t, _, w in self._all():
            ends.append(t)
            cumulative.append(cumulative[-1] + w)
        return [cumulative[bisect.bisect_right(ends, t)] for t in times]


@dataclass
class LoaderState:
    """One DataLoader: its latest stats, and what the run saw of its workers."""

    stats: LoaderStats
    workers_seen: int = 0
    peak_workers_rss: int = 0
    _pids: deque[int] = field(default_factory=lambda: deque(maxlen=WORKER_PIDS_KEPT))
    #: Private memory (USS) of the workers, where the viewer could read it from outside:
    #: ``(t, epochs, mean USS per live worker)``, the latest :data:`WORKER_USS_KEPT` readings.
    worker_uss: deque[tuple[float, int, int]] = field(
        default_factory=lambda: deque(maxlen=WORKER_USS_KEPT)
    )
    peak_workers_uss: int = 0

    def observe_workers(self, loader: LoaderStats, t: float | None = None) -> None:
        for worker in loader.workers:
            if worker.pid not in self._pids:
                self._pids.append(worker.pid)
                self.workers_seen += 1
        rss = sum(w.rss_bytes or 0 for w in loader.workers if w.alive)
        self.peak_workers_rss = max(self.peak_workers_rss, rss)
        uss = [w.uss_bytes for w in loader.workers if w.alive and w.uss_bytes is not None]
        if uss and t is not None:
            self.peak_workers_uss = max(self.peak_workers_uss, sum(uss))
            self.worker_uss.append((t, loader.epochs, sum(uss) // len(uss)))


@dataclass(slots=True)
class ChartBucket:
    """The steps of one :data:`CHART_BUCKET_S` as the step-time chart draws them."""

    bucket: int
    step_t: float
    step: float
    wait_t: float
    wait: float


@dataclass
class TrainingState:
    """Steps and DataLoaders. Bounded: the chart's recent points, the run's even sample."""

    max_points: int = DEFAULT_STEP_POINTS
    history_steps: int = DEFAULT_HISTORY_STEPS
    #: ``steps`` frames kept for the recent window (an agent sends one or two a second, at
    #: most ten): the default keeps as many as points; a model that only needs the window
    #: keeps a few hundred.
    max_frames: int = DEFAULT_STEP_POINTS
    #: Steps so far (skipped ones included), and how many a GradScaler skipped.
    total: int = 0
    skipped_total: int = 0
    run: StepTotals = field(default_factory=StepTotals)
    points: deque[StepPoint] = field(init=False)
    #: The step-time chart's series: per :data:`CHART_BUCKET_S` of timed steps, the longest
    #: step and the longest wait for data (start-up included), each with its step's end.
    chart: deque[ChartBucket] = field(init=False)
    #: Per ``steps`` message: its time and its sums, for the recent window.
    frames: deque[tuple[float, StepTotals]] = field(init=False)
    #: The whole run's steps (an even sample once long), for percentiles over any time range.
    history: StepHistory = field(init=False)
    #: Every DataLoader by index, with its latest stats.
    loader_states: dict[int, LoaderState] = field(default_factory=dict)
    loaders_t: float | None = None
    #: When a ``loaders`` frame last showed more batches taken: progress without a step (an
    #: evaluation loop), which the run's hang rule counts as not stuck.
    last_batch_t: float | None = None
    #: The end of the first step listed (the job's first, unless the viewer came late).
    first_step_t: float | None = None

    def __post_init__(self) -> None:
        self.points = deque(maxlen=self.max_points)
        self.chart = deque(maxlen=self.max_points)
        self.frames = deque(maxlen=self.max_frames)
        self.history = StepHistory(self.history_steps)

    @property
    def has_data(self) -> bool:
        """Whether the job has taken a step or iterated a DataLoader: the panels then show."""
        return self.total > 0 or bool(self.loader_states)

    @property
    def loader_list(self) -> list[LoaderState]:
        """Every loader, in the order the job first iterated them."""
        return [self.loader_states[i] for i in sorted(self.loader_states)]

    @property
    def loaders(self) -> list[LoaderStats]:
        """Every loader's latest stats, in the order the job first iterated them."""
        return [x.stats for x in self.loader_list]

    def steps_ended_between(self, start: float, end: float) -> int:
        """Steps (weights) listed so far that ended in ``(start, end]``, among the recent
        points: the latest :attr:`max_points` at most."""
        n = 0
        for point in reversed(self.points):
            if point.t <= start:
                break
            if point.t <= end:
                n += point.weight
        return n

    def apply(self, message: Message) -> bool:
        """Fold in a ``steps`` or ``loaders`` message; True if anything changed."""
        if isinstance(message, StepStats):
            self._apply_steps(message)
            return True
        if isinstance(message, LoaderInfo):
            return self._apply_loaders(message)
        return False

    def _apply_loaders(self, message: LoaderInfo) -> bool:
        # Totals only grow: a frame older than one already seen (the agent's last frames may
        # cross a late sampler tick's) does not replace a loader's stats.
        newest = self.loaders_t is None or message.t >= self.loaders_t
        changed = False
        for loader in message.loaders:
            state = self.loader_states.get(loader.index)
            if state is None:
                state = self.loader_states[loader.index] = LoaderState(loader)
                changed = True
            elif newest and state.stats != loader:
                if loader.batches > state.stats.batches:
                    self.last_batch_t = message.t
                state.stats = loader
                changed = True
            state.observe_workers(loader, message.t)
        if newest:
            self.loaders_t = message.t
        return changed

    def _apply_steps(self, m: StepStats) -> None:
        self.total = max(self.total, m.total)
        self.skipped_total = max(self.skipped_total, m.skipped_total)
        totals = StepTotals(
            m.timed, m.time_s, m.wait_s, m.startup_s, m.optimizer_s, m.samples, m.backward_s
        )
        self.run.add(totals)
        self.frames.append((m.t, totals))
        if self.first_step_t is None and m.ends:
            self.first_step_t = m.ends[0]
        n = len(m.ends)
        weights = step_detail_weights(m.count, n)
        durations = _padded(m.durations, n, None)
        waits = _padded(m.waits, n, 0.0)
        startups = _padded(m.startups, n, 0.0)
        optimizer = _padded(m.optimizer, n, 0.0)
        samples = _padded(m.batch_samples, n, 0)
        backwards = _padded(m.backwards, n, 0.0)
        # The protocol checked the lists' types; missing entries were filled above.
        self.points.extend(
            map(
                StepPoint,
                m.ends,
                durations,
                waits,
                startups,
                optimizer,
                samples,
                weights,
                backwards,
            )
        )
        self.history.extend(m.ends, durations, weights)
        self._fold_chart(m.ends, durations, waits, startups)

    def _fold_chart(
        self,
        ends: list[float],
        durations: list[float | None],
        waits: list[float],
        startups: list[float],
    ) -> None:
        chart = self.chart
        last = chart[-1] if chart else None
        for t, duration, wait, startup in zip(ends, durations, waits, startups, strict=True):
            if duration is None:  # the first step: no time to chart
                continue
            waited = wait + startup
            bucket = int(t // CHART_BUCKET_S)
            if last is None or bucket != last.bucket:
                last = ChartBucket(bucket, t, duration, t, waited)
                chart.append(last)
                continue
            if duration > last.step:
                last.step_t, last.step = t, duration
            if waited > last.wait:
                last.wait_t, last.wait = t, waited

    # -- queries -----------------------------------------------------------------------------

    def recent(self, now: float | None) -> StepTotals:
        """The steps of the last :data:`RECENT_WINDOW_S` seconds before ``now``, or the last
        :data:`MIN_RECENT_STEPS` if those took longer."""
        totals = StepTotals()
        if now is None:
            return totals
        since = now - RECENT_WINDOW_S
        for t, frame in reversed(self.frames):
            if t > now:  # a replay's past seen from a moment before its end
                continue
            if t < since and totals.steps >= MIN_RECENT_STEPS:
                break
            totals.add(frame)
        return totals

    def input_bound(self, now: float | None) -> bool:
        """The recent steps spent at least :data:`INPUT_BOUND_FRACTION` of their time waiting
        for data (over at least :data:`MIN_RECENT_STEPS` steps)."""
        recent = self.recent(now)
        fraction = recent.wait_fraction
        return (
            recent.steps >= MIN_RECENT_STEPS
            and fraction is not None
            and fraction >= INPUT_BOUND_FRACTION
        )

    def step_time(
        self, q: float, start: float | None = None, end: float | None = None
    ) -> float | None:
        """The ``q`` quantile of the duration of steps that ended in ``[start, end]`` (the
        whole run by default); ``None`` without a timed step there."""
        return weighted_quantile(self.history.durations(start, end), q)

    def steps_between(self, start: float | None, end: float | None) -> int:
        """Steps that ended in ``[start, end]`` (``None``: open on that side)."""
        return self.history.count(start, end)

    @property
    def first_batch_s(self) -> float:
        """Worker start-up over every loader: the summed first-batch latencies."""
        return sum(x.stats.first_batch_s for x in self.loader_states.values())

    def last_points(self, n: int) -> list[StepPoint]:
        """The last ``n`` steps listed, oldest first."""
        if n <= 0:
            return []
        kept = len(self.points)
        return [self.points[i] for i in range(max(0, kept - n), kept)]


def _padded(values: list[T], n: int, missing: D) -> list[T] | list[T | D]:
    """``values`` as ``n`` entries: cut, or filled with ``missing`` (an agent may list fewer
    details than ends)."""
    if len(values) == n:
        return values
    padded: list[T | D] = [*values[:n]]
    padded.extend([missing] * (n - len(padded)))
    return padded
