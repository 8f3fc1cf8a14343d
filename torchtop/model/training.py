"""A job's training loop: its steps and its DataLoaders.

Pure Python (no Textual, no Rich, no torch), built only from ``steps`` and ``loaders`` messages.
:class:`torchtop.model.job.JobModel` holds one :class:`TrainingState` and hands it those
messages; the step and loader panels read it.

Figures come in two spans: *recent* (the steps of the last :data:`RECENT_WINDOW_S` seconds, or
the last :data:`MIN_RECENT_STEPS` steps when they take longer) and the whole run. The job is
*input-bound* when the recent wait fraction is at least :data:`INPUT_BOUND_FRACTION`: the
training thread spent that share of its step time blocked on the next batch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TypeVar

from torchtop.protocol import LoaderInfo, LoaderStats, Message, StepStats, step_detail_weights

#: Seconds of steps that the recent figures cover.
RECENT_WINDOW_S = 10.0
#: The fewest steps the recent figures cover, however long they take.
MIN_RECENT_STEPS = 5
#: A recent wait fraction at or above this flags the job as input-bound.
INPUT_BOUND_FRACTION = 0.3
T = TypeVar("T")

#: Steps kept for the charts (each may stand for several when the agent sampled them).
DEFAULT_STEP_POINTS = 6000


@dataclass(frozen=True)
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

    def add(self, other: StepTotals) -> None:
        self.steps += other.steps
        self.time_s += other.time_s
        self.wait_s += other.wait_s
        self.startup_s += other.startup_s
        self.optimizer_s += other.optimizer_s
        self.samples += other.samples

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


def _frame_totals(m: StepStats) -> StepTotals:
    return StepTotals(m.timed, m.time_s, m.wait_s, m.startup_s, m.optimizer_s, m.samples)


@dataclass
class TrainingState:
    """Steps and DataLoaders as the viewer knows them. Bounded: the most recent points only."""

    max_points: int = DEFAULT_STEP_POINTS
    #: Steps so far (skipped ones included), and how many a GradScaler skipped.
    total: int = 0
    skipped_total: int = 0
    run: StepTotals = field(default_factory=StepTotals)
    points: deque[StepPoint] = field(init=False)
    #: Per ``steps`` message: its time and its sums, for the recent window.
    frames: deque[tuple[float, StepTotals]] = field(init=False)
    loaders: list[LoaderStats] = field(default_factory=list)
    loaders_t: float | None = None

    def __post_init__(self) -> None:
        self.points = deque(maxlen=self.max_points)
        self.frames = deque(maxlen=self.max_points)

    @property
    def has_data(self) -> bool:
        """Whether the job has taken a step or iterated a DataLoader: the panels then show."""
        return self.total > 0 or bool(self.loaders)

    def apply(self, message: Message) -> bool:
        """Fold in a ``steps`` or ``loaders`` message; True if anything changed."""
        if isinstance(message, StepStats):
            self._apply_steps(message)
            return True
        if isinstance(message, LoaderInfo):
            if self.loaders_t is not None and message.t < self.loaders_t:
                return False  # an older reading than the one shown
            if message.loaders == self.loaders:
                return False
            self.loaders = list(message.loaders)
            self.loaders_t = message.t
            return True
        return False

    def _apply_steps(self, m: StepStats) -> None:
        self.total = max(self.total, m.total)
        self.skipped_total = max(self.skipped_total, m.skipped_total)
        totals = _frame_totals(m)
        self.run.add(totals)
        self.frames.append((m.t, totals))
        weights = step_detail_weights(m.count, len(m.ends))
        for i, (t, weight) in enumerate(zip(m.ends, weights, strict=False)):
            self.points.append(
                StepPoint(
                    t=t,
                    duration=_at(m.durations, i),
                    wait=_at(m.waits, i) or 0.0,
                    startup=_at(m.startups, i) or 0.0,
                    optimizer=_at(m.optimizer, i) or 0.0,
                    samples=_at(m.batch_samples, i) or 0,
                    weight=weight,
                )
            )

    # -- derived ---------------------------------------------------------------------------

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

    def last_points(self, n: int) -> list[StepPoint]:
        """The last ``n`` steps listed, oldest first."""
        if n <= 0:
            return []
        kept = len(self.points)
        return [self.points[i] for i in range(max(0, kept - n), kept)]


def _at(values: list[T], i: int) -> T | None:
    return values[i] if i < len(values) else None
