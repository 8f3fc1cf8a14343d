"""Two runs compared: what changed between a before (A) and an after (B), and whether it is
more than noise. Pure Python, no I/O: :func:`compare_jobs` takes two folded
:class:`~torchtop.model.JobModel`, :func:`compare_runs` two lists of ranks.

The runs are aligned by step: the first steps of each (its warm-up) are left out, as many in
both, then the same step numbers are compared. The warm-up is the steps until the step time
settles (:func:`detect_warmup`), the longer of the two runs', unless given.

Step figures (median, p90, throughput, data-wait share, compute and backward per step) come
with a 95% interval for the difference B - A, from a percentile bootstrap with a fixed seed: each
run's steps are resampled (:data:`BOOTSTRAP_RESAMPLES` times) in blocks of neighbouring steps
(:data:`BLOCK_STEPS`: a burst of load slows several in a row, so steps are not independent)
and the figure computed on each resample. A change is said to be one only when its interval
excludes 0 *and* it is at least :data:`MIN_RELATIVE_CHANGE` of A's figure (or
:data:`MIN_SHARE_CHANGE` for a share): two runs of the same job on the same machine differ by a
few percent that the steps of one run do not show. Anything else is "no difference beyond noise".
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from torchtop.model.energy import EnergySpan
from torchtop.model.job import JobModel
from torchtop.model.ops import OpTimings
from torchtop.model.training import StepPoint, TrainingState, weighted_quantile

#: Resamples of each run's steps for the intervals, and the seed (the same runs, the same answer).
BOOTSTRAP_RESAMPLES = 500
BOOTSTRAP_SEED = 20240601
#: Neighbouring steps resampled together (at most a quarter of the run).
BLOCK_STEPS = 10
#: Steps a run's bootstrap resamples at most (an even sample of the compared steps beyond).
MAX_BOOTSTRAP_STEPS = 1500
#: The interval's coverage.
CONFIDENCE = 0.95
#: The smallest change called one: of A's figure for times, rates, memory and counts...
MIN_RELATIVE_CHANGE = 0.05
#: ... and in share points (0.05: five points of step time) for shares.
MIN_SHARE_CHANGE = 0.05
#: Memory: a change below this share of A's figure, or below MIN_MEMORY_BYTES, is none.
MIN_MEMORY_CHANGE = 0.10
MIN_MEMORY_BYTES = 1 << 20
#: Ops: a change in time per step below this share of A's, or below MIN_OP_S, is none; and
#: runs with fewer profiled steps than MIN_PROFILED_STEPS are too few to tell.
MIN_OP_CHANGE = 0.25
MIN_OP_S = 1e-4
MIN_PROFILED_STEPS = 10
#: Ops compared: the top ones by self time per step in either run.
TOP_OPS = 10
#: Warm-up detection: the window of steps whose median must settle, and how near to the steady
#: median (the second half's) it must come: within WARMUP_TOLERANCE of it, or three scaled
#: median absolute deviations, whichever is wider.
WARMUP_WINDOW = 5
WARMUP_TOLERANCE = 0.10
#: The fewest steps compared for a step figure to be given.
MIN_COMPARED_STEPS = 5

#: The fewest intervals between energy readings (with steps in them) for J/step to be compared.
MIN_ENERGY_INTERVALS = 5

T = TypeVar("T")

NOISE = "no difference beyond noise"
NO_CHANGE = "no change"
NOT_COMPARABLE = "n/a"


class CompareError(Exception):
    """The two runs cannot be compared; the message says why, in one line."""


@dataclass(frozen=True)
class Change:
    """One figure in A and in B, the difference B - A and its interval where the figure comes
    from samples, and the verdict."""

    key: str
    label: str
    #: "s", "share", "1/s", "bytes" or "count".
    unit: str
    a: float | None
    b: float | None
    #: The interval for ``b - a`` (``None`` for figures that are not from step samples).
    ci: tuple[float, float] | None = None
    #: The smallest ``|b - a|`` called a change.
    min_change: float = 0.0
    #: True when a higher figure is better (throughput), False when worse, None: neither.
    higher_is_better: bool | None = False
    #: Why no verdict can be given though both figures are known ("too few profiled steps").
    caveat: str | None = None

    @property
    def delta(self) -> float | None:
        return None if self.a is None or self.b is None else self.b - self.a

    @property
    def relative(self) -> float | None:
        """``b / a - 1``; ``None`` where A's figure is 0 or unknown."""
        if self.a is None or self.b is None or self.a == 0:
            return None
        return self.b / self.a - 1

    @property
    def changed(self) -> bool:
        """A difference beyond the noise (and beyond the smallest change worth one)."""
        delta = self.delta
        if delta is None or self.caveat is not None:
            return False
        if self.ci is not None and self.ci[0] <= 0 <= self.ci[1]:
            return False
        return abs(delta) >= self.min_change and delta != 0

    @property
    def better(self) -> bool | None:
        """Whether the change is for the better (``None``: no change, or neither way)."""
        if not self.changed or self.higher_is_better is None:
            return None
        assert self.delta is not None
        return (self.delta > 0) == self.higher_is_better

    @property
    def verdict(self) -> str:
        if self.delta is None:
            return NOT_COMPARABLE
        if self.caveat is not None:
            return self.caveat
        if not self.changed:
            return NOISE if self.ci is not None else NO_CHANGE
        up = self.delta > 0
        if self.unit == "s":
            return "slower" if up else "faster"
        return "higher" if up else "lower"


@dataclass(frozen=True)
class StepSample:
    """One listed step: its number in the run and its figures (``weight`` steps alike)."""

    index: int
    duration: float
    wait: float
    compute: float
    backward: float
    samples: int
    weight: int


@dataclass(frozen=True)
class StepAlignment:
    """Which steps were compared: from ``start`` (the warm-up left out) to ``end`` (exclusive,
    the shorter run's last), and the warm-ups detected in each run."""

    start: int
    end: int
    given: bool
    warmup_a: int
    warmup_b: int
    steps_a: int
    steps_b: int
    compared_a: int
    compared_b: int


@dataclass(frozen=True)
class OpChange:
    """One op's self time per profiled step in each run."""

    name: str
    cpu: Change
    device: Change | None


@dataclass(frozen=True)
class FindingChange:
    """A finding by rule and rank: in A, in B, or both."""

    name: str
    title: str
    severity: str
    rank: int | None
    #: "appeared", "went" or "kept".
    status: str


@dataclass(frozen=True)
class DeviceChange:
    device: str
    peak_allocated: Change
    peak_reserved: Change
    steady_allocated: Change


@dataclass(frozen=True)
class EnergyChange:
    """One GPU's energy per step in A and in B (``per_step``), or why there is none."""

    device: str
    per_step: Change
    #: Why a run has no figure: "not supported in B", "no energy readings in A".
    note: str | None = None


@dataclass
class JobComparison:
    """One job (or one rank) in A and in B."""

    alignment: StepAlignment
    steps: list[Change]
    memory: list[DeviceChange]
    host_peak_rss: Change
    ops: list[OpChange]
    ops_note: str | None
    counts: list[Change]
    findings: list[FindingChange]
    rank: int | None = None
    #: Each GPU's energy per step (empty without NVML readings in either run).
    energy: list[EnergyChange] = field(default_factory=list)

    @property
    def changed(self) -> list[str]:
        """The labels of every figure that changed beyond noise."""
        labels = [c.label for c in self.steps if c.changed]
        for d in self.memory:
            labels += [
                f"{c.label} {d.device}"
                for c in (d.peak_allocated, d.peak_reserved, d.steady_allocated)
                if c.changed
            ]
        if self.host_peak_rss.changed:
            labels.append(self.host_peak_rss.label)
        labels += [f"{op.name} per step" for op in self.ops if op.cpu.changed]
        labels += [c.label for c in self.counts if c.changed]
        labels += [f"{e.per_step.label} {e.device}" for e in self.energy if e.per_step.changed]
        return labels


@dataclass
class RunComparison:
    """Two multi-rank runs: rank by rank, and the run's steps over every rank."""

    ranks: list[JobComparison]
    run_steps: list[Change]
    alignment: StepAlignment
    #: Ranks in one run only.
    only_a: list[int] = field(default_factory=list)
    only_b: list[int] = field(default_factory=list)


# -- steps ---------------------------------------------------------------------------------------


def step_samples(training: TrainingState) -> list[StepSample]:
    """The timed steps the model lists, numbered from the run's first step (the job's first,
    which has no duration, is step 0)."""
    points: list[StepPoint] = list(training.points)
    listed = sum(p.weight for p in points)
    index = max(0, training.total - listed) if training.total >= listed else 0
    samples = []
    for p in points:
        if p.duration is not None:
            compute = p.compute if p.compute is not None else 0.0
            samples.append(
                StepSample(index, p.duration, p.wait, compute, p.backward, p.samples, p.weight)
            )
        index += p.weight
    return samples


def detect_warmup(samples: Sequence[StepSample]) -> int:
    """The step at which the step time has settled: the first near the steady step time (the
    median of the run's second half) whose next :data:`WARMUP_WINDOW` steps have a median near
    it too. At most half the run; 0 for a run too short to tell."""
    n = len(samples)
    if n < 4 * WARMUP_WINDOW:
        return samples[0].index if samples else 0
    durations = [s.duration for s in samples]
    tail = durations[n // 2 :]
    steady = statistics.median(tail)
    mad = statistics.median([abs(d - steady) for d in tail]) * 1.4826
    tolerance = max(WARMUP_TOLERANCE * steady, 3 * mad)
    for i in range(n // 2):
        if abs(durations[i] - steady) > tolerance:
            continue
        if abs(statistics.median(durations[i : i + WARMUP_WINDOW]) - steady) <= tolerance:
            return samples[i].index
    return samples[n // 2].index


def _last_index(samples: Sequence[StepSample]) -> int:
    return samples[-1].index + samples[-1].weight if samples else 0


def align(
    a: Sequence[StepSample], b: Sequence[StepSample], skip: int | None
) -> tuple[StepAlignment, list[StepSample], list[StepSample]]:
    """The steps of each run to compare: the same step numbers in both, the warm-up left
    out. :class:`CompareError` when a run has no timed step, or none is left to compare."""
    for name, samples in (("A", a), ("B", b)):
        if not samples:
            raise CompareError(f"recording {name} has no timed steps to compare")
    warm_a, warm_b = detect_warmup(a), detect_warmup(b)
    start = max(warm_a, warm_b) if skip is None else skip
    end = min(_last_index(a), _last_index(b))
    kept_a = [s for s in a if start <= s.index < end]
    kept_b = [s for s in b if start <= s.index < end]
    if skip is not None and (not kept_a or not kept_b):
        raise CompareError(
            f"--skip-steps {skip} leaves no step to compare: the runs have {end} steps in common"
        )
    alignment = StepAlignment(
        start=start,
        end=end,
        given=skip is not None,
        warmup_a=warm_a,
        warmup_b=warm_b,
        steps_a=_last_index(a),
        steps_b=_last_index(b),
        compared_a=sum(s.weight for s in kept_a),
        compared_b=sum(s.weight for s in kept_b),
    )
    return alignment, kept_a, kept_b


@dataclass(frozen=True)
class _Figures:
    median: float
    p90: float
    steps_per_s: float | None
    samples_per_s: float | None
    wait_share: float | None
    compute: float
    backward: float
    backward_share: float | None


def _figures(steps: Sequence[StepSample], weighted: bool) -> _Figures:
    """The step figures of ``steps``, each counted ``weight`` times when ``weighted`` (the run
    itself; a resample already drew them in proportion to their weight)."""
    weights = [s.weight if weighted else 1 for s in steps]
    pairs = [(s.duration, w) for s, w in zip(steps, weights, strict=True)]
    median = weighted_quantile(pairs, 0.5) or 0.0
    p90 = weighted_quantile(pairs, 0.9) or 0.0
    n = sum(weights)
    time = sum(s.duration * w for s, w in zip(steps, weights, strict=True))
    wait = sum(s.wait * w for s, w in zip(steps, weights, strict=True))
    compute = sum(s.compute * w for s, w in zip(steps, weights, strict=True))
    backward = sum(s.backward * w for s, w in zip(steps, weights, strict=True))
    samples = sum(s.samples * w for s, w in zip(steps, weights, strict=True))
    return _Figures(
        median=median,
        p90=p90,
        steps_per_s=n / time if time > 0 else None,
        samples_per_s=samples / time if time > 0 and samples else None,
        wait_share=wait / time if time > 0 else None,
        compute=compute / n,
        backward=backward / n,
        backward_share=backward / time if time > 0 else None,
    )


#: Each step figure: key, label, unit, what it reads from the figures, and which way is better.
_STEP_FIGURES: list[tuple[str, str, str, Callable[[_Figures], float | None], bool | None]] = [
    ("step_time_median_s", "step time median", "s", lambda f: f.median, False),
    ("step_time_p90_s", "step time p90", "s", lambda f: f.p90, False),
    ("steps_per_s", "steps/s", "1/s", lambda f: f.steps_per_s, True),
    ("samples_per_s", "samples/s", "1/s", lambda f: f.samples_per_s, True),
    ("data_wait_share", "data wait share", "share", lambda f: f.wait_share, False),
    ("compute_per_step_s", "compute per step", "s", lambda f: f.compute, False),
    ("backward_per_step_s", "backward per step", "s", lambda f: f.backward, False),
    ("backward_share", "backward share", "share", lambda f: f.backward_share, None),
]


def _even(steps: Sequence[StepSample], most: int) -> list[StepSample]:
    if len(steps) <= most:
        return list(steps)
    return [steps[i * len(steps) // most] for i in range(most)]


def _block_length(n: int) -> int:
    """Steps per block of the bootstrap: neighbouring steps are alike (a burst of load slows
    several), so they are resampled together."""
    return max(1, min(BLOCK_STEPS, n // 4))


def _block_draws(pool: Sequence[T], rng: random.Random) -> Iterator[list[T]]:
    """A moving-block bootstrap's resamples of ``pool``: blocks of neighbours drawn at random
    until as many items as the pool's, :data:`BOOTSTRAP_RESAMPLES` times."""
    n = len(pool)
    length = _block_length(n)
    starts = n - length + 1
    blocks = -(-n // length)
    for _ in range(BOOTSTRAP_RESAMPLES):
        drawn: list[T] = []
        for _ in range(blocks):
            start = rng.randrange(starts)
            drawn.extend(pool[start : start + length])
        yield drawn[:n]


def _resamples(steps: Sequence[StepSample], rng: random.Random) -> list[_Figures]:
    """The block bootstrap of the steps, each resample's figures weighed by their weights."""
    pool = _even(steps, MAX_BOOTSTRAP_STEPS)
    return [_figures(drawn, weighted=True) for drawn in _block_draws(pool, rng)]


def _interval(diffs: list[float]) -> tuple[float, float] | None:
    if len(diffs) < BOOTSTRAP_RESAMPLES // 2:
        return None  # the figure is unknown in too many resamples
    ordered = sorted(diffs)
    tail = (1 - CONFIDENCE) / 2
    lo = ordered[max(0, math.floor(tail * len(ordered)))]
    hi = ordered[min(len(ordered) - 1, math.ceil((1 - tail) * len(ordered)) - 1)]
    return lo, hi


def compare_steps(a: Sequence[StepSample], b: Sequence[StepSample]) -> list[Change]:
    """The step figures of two aligned sets of steps, with bootstrap intervals of B - A."""
    if (
        sum(s.weight for s in a) < MIN_COMPARED_STEPS
        or sum(s.weight for s in b) < MIN_COMPARED_STEPS
    ):
        few = f"fewer than {MIN_COMPARED_STEPS} steps compared"
        fa = _figures(a, weighted=True) if a else None
        fb = _figures(b, weighted=True) if b else None
        return [
            Change(
                key,
                label,
                unit,
                read(fa) if fa else None,
                read(fb) if fb else None,
                higher_is_better=better,
                caveat=few,
            )
            for key, label, unit, read, better in _STEP_FIGURES
        ]
    rng = random.Random(BOOTSTRAP_SEED)
    fa, fb = _figures(a, weighted=True), _figures(b, weighted=True)
    ra, rb = _resamples(a, rng), _resamples(b, rng)
    changes = []
    for key, label, unit, read, better in _STEP_FIGURES:
        va, vb = read(fa), read(fb)
        diffs = []
        for x, y in zip(ra, rb, strict=True):
            rx, ry = read(x), read(y)
            if rx is not None and ry is not None:
                diffs.append(ry - rx)
        ci = _interval(diffs) if va is not None and vb is not None else None
        if unit == "share":
            least = MIN_SHARE_CHANGE
        else:
            least = MIN_RELATIVE_CHANGE * abs(va) if va is not None else 0.0
        changes.append(Change(key, label, unit, va, vb, ci, least, better))
    return changes


# -- memory, ops, counts, findings ---------------------------------------------------------------


def _memory_change(key: str, label: str, a: float | None, b: float | None) -> Change:
    least = max(MIN_MEMORY_BYTES, MIN_MEMORY_CHANGE * abs(a)) if a is not None else 0.0
    return Change(key, label, "bytes", a, b, None, least, False)


def _steady_allocated(job: JobModel, device: str, since: float | None) -> float | None:
    memory = job.memory.get(device)
    if memory is None:
        return None
    values = [
        p.allocated
        for p in memory.series
        if p.allocated is not None and (since is None or p.t >= since)
    ]
    return float(statistics.median(values)) if values else None


def compare_memory(
    a: JobModel, b: JobModel, since_a: float | None, since_b: float | None
) -> list[DeviceChange]:
    """Each device's peaks, and its steady allocated memory (the median after the warm-up)."""
    devices = [*a.memory, *(d for d in b.memory if d not in a.memory)]
    changes = []
    for device in devices:
        ma, mb = a.memory.get(device), b.memory.get(device)

        def peak(m: object, attr: str) -> float | None:
            value = getattr(m, attr) if m is not None else None
            return float(value) if value is not None else None

        changes.append(
            DeviceChange(
                device,
                _memory_change(
                    "peak_allocated_bytes",
                    "peak allocated",
                    peak(ma, "peak_allocated"),
                    peak(mb, "peak_allocated"),
                ),
                _memory_change(
                    "peak_reserved_bytes",
                    "peak reserved",
                    peak(ma, "peak_reserved"),
                    peak(mb, "peak_reserved"),
                ),
                _memory_change(
                    "steady_allocated_bytes",
                    "steady allocated",
                    _steady_allocated(a, device, since_a),
                    _steady_allocated(b, device, since_b),
                ),
            )
        )
    return changes


def _ops_per_step(ops: OpTimings) -> tuple[dict[str, tuple[float, float | None]], int]:
    """Self time per profiled step by op name (CPU, device), over every window."""
    latest = ops.latest
    if latest is None or not latest.total_steps:
        return {}, 0
    steps = latest.total_steps
    by_name: dict[str, tuple[float, float | None]] = {}
    for op in latest.cumulative:
        cpu, device = by_name.get(op.name, (0.0, None))
        if op.self_device_s is not None:
            device = (device or 0.0) + op.self_device_s
        by_name[op.name] = (cpu + op.self_cpu_s, device)
    return {
        name: (cpu / steps, device / steps if device is not None else None)
        for name, (cpu, device) in by_name.items()
    }, steps


def _op_change(
    key: str, label: str, a: float | None, b: float | None, caveat: str | None
) -> Change:
    least = max(MIN_OP_S, MIN_OP_CHANGE * abs(a)) if a is not None else 0.0
    return Change(key, label, "s", a, b, None, least, False, caveat)


def compare_ops(a: OpTimings, b: OpTimings) -> tuple[list[OpChange], str | None]:
    """The top ops' self time per profiled step, where both runs have op windows."""
    ops_a, steps_a = _ops_per_step(a)
    ops_b, steps_b = _ops_per_step(b)
    if not ops_a or not ops_b:
        missing = " and ".join(n for n, o in (("A", ops_a), ("B", ops_b)) if not o)
        return [], f"no op timings over whole steps in {missing}"
    caveat = None
    note = None
    if min(steps_a, steps_b) < MIN_PROFILED_STEPS:
        caveat = "too few profiled steps to tell"
        note = (
            f"op timings over {steps_a} and {steps_b} profiled steps: fewer than "
            f"{MIN_PROFILED_STEPS}, too few to call a change"
        )
    names = set(ops_a) | set(ops_b)
    top = sorted(
        names,
        key=lambda n: max(ops_a.get(n, (0.0, None))[0], ops_b.get(n, (0.0, None))[0]),
        reverse=True,
    )[:TOP_OPS]
    changes = []
    for name in top:
        ca, da = ops_a.get(name, (None, None))
        cb, db = ops_b.get(name, (None, None))
        device = None
        if da is not None or db is not None:
            device = _op_change("self_device_per_step_s", "self device", da, db, caveat)
        changes.append(
            OpChange(name, _op_change("self_cpu_per_step_s", "self CPU", ca, cb, caveat), device)
        )
    return changes, note


def _count_change(key: str, label: str, a: float | None, b: float | None) -> Change:
    least = max(0.5, MIN_RELATIVE_CHANGE * abs(a)) if a is not None else 0.0
    return Change(key, label, "count", a, b, None, least, False)


def compare_counts(a: OpTimings, b: OpTimings) -> list[Change]:
    """Sync points, host reads and host-device copies per profiled step."""
    return [
        _count_change(
            "sync_points_per_step",
            "sync points per step",
            a.sync_points_per_step,
            b.sync_points_per_step,
        ),
        _count_change(
            "host_reads_per_step",
            "host reads per step",
            a.host_reads_per_step,
            b.host_reads_per_step,
        ),
        _count_change("copies_per_step", "copies per step", a.copies_per_step, b.copies_per_step),
    ]


def compare_findings(a: JobModel, b: JobModel) -> list[FindingChange]:
    """The findings (by rule and rank) that appeared in B, went from A, or are in both."""
    found_a = {(f.name, f.rank): f for f in a.advice.all_findings}
    found_b = {(f.name, f.rank): f for f in b.advice.all_findings}
    changes = []
    for key, f in found_b.items():
        status = "kept" if key in found_a else "appeared"
        changes.append(FindingChange(f.name, f.title, f.severity, f.rank, status))
    for key, f in found_a.items():
        if key not in found_b:
            changes.append(FindingChange(f.name, f.title, f.severity, f.rank, "went"))
    order = {"appeared": 0, "went": 1, "kept": 2}
    return sorted(changes, key=lambda c: order[c.status])


def _energy_ratio(spans: Sequence[EnergySpan]) -> float | None:
    steps = sum(s.steps for s in spans)
    return sum(s.joules for s in spans) / steps if steps else None


def _energy_note(job: JobModel, device: str, which: str) -> str | None:
    entry = next((e for e in job.energy.values() if e.name == device), None)
    if entry is None or entry.supported is None:
        return f"no energy readings in {which}"
    if entry.supported is False:
        return f"not supported in {which}"
    return None


def compare_energy(
    a: JobModel,
    b: JobModel,
    window_a: tuple[float | None, float | None],
    window_b: tuple[float | None, float | None],
) -> list[EnergyChange]:
    """Each GPU's joules per step over the compared steps, with a block-bootstrap interval
    over the spans between its energy readings (the same resampling as the steps')."""
    names = [e.name for e in a.energy.values()]
    names += [e.name for e in b.energy.values() if e.name not in names]
    changes = []
    for name in names:
        spans = []
        for job, (start, end) in ((a, window_a), (b, window_b)):
            entry = next((e for e in job.energy.values() if e.name == name), None)
            found = entry.intervals(job.training, start, end) if entry is not None else []
            spans.append([s for s in found if s.steps or s.joules])
        va, vb = _energy_ratio(spans[0]), _energy_ratio(spans[1])
        note = _energy_note(a, name, "A") or _energy_note(b, name, "B")
        caveat = None
        ci = None
        if va is not None and vb is not None:
            if min(len(spans[0]), len(spans[1])) < MIN_ENERGY_INTERVALS:
                caveat = "too few energy readings to tell"
            else:
                rng = random.Random(BOOTSTRAP_SEED)
                ra = [_energy_ratio(d) for d in _block_draws(spans[0], rng)]
                rb = [_energy_ratio(d) for d in _block_draws(spans[1], rng)]
                ci = _interval([y - x for x, y in zip(ra, rb, strict=True) if x and y])
        least = MIN_RELATIVE_CHANGE * abs(va) if va is not None else 0.0
        change = Change(
            "energy_per_step_j", "energy per step", "J", va, vb, ci, least, False, caveat
        )
        changes.append(EnergyChange(name, change, note))
    return changes


# -- jobs and runs -------------------------------------------------------------------------------


def _end_of_step(samples: Sequence[StepSample], ends: Sequence[float], index: int) -> float | None:
    for sample, end in zip(samples, ends, strict=True):
        if sample.index >= index:
            return end
    return None


def samples_with_ends(training: TrainingState) -> tuple[list[StepSample], list[float]]:
    """The timed steps (:func:`step_samples`) and each one's end, in the same order."""
    samples = step_samples(training)
    ends = [p.t for p in training.points if p.duration is not None]
    return samples, ends


def compare_jobs(
    a: JobModel,
    b: JobModel,
    skip: int | None = None,
    *,
    alignment: StepAlignment | None = None,
    rank: int | None = None,
) -> JobComparison:
    """Job (or rank) A against B: steps aligned after the warm-up (``skip`` steps when
    given), memory, ops, counts and findings. :class:`CompareError` when one has no steps."""
    samples_a, ends_a = samples_with_ends(a.training)
    samples_b, ends_b = samples_with_ends(b.training)
    if alignment is None:
        alignment, kept_a, kept_b = align(samples_a, samples_b, skip)
    else:
        kept_a = [s for s in samples_a if alignment.start <= s.index < alignment.end]
        kept_b = [s for s in samples_b if alignment.start <= s.index < alignment.end]
    since_a = _end_of_step(samples_a, ends_a, alignment.start)
    since_b = _end_of_step(samples_b, ends_b, alignment.start)
    ops, note = compare_ops(a.op_timings, b.op_timings)
    rss = _memory_change(
        "host_peak_rss_bytes",
        "host peak RSS",
        float(a.peak_rss) if a.peak_rss is not None else None,
        float(b.peak_rss) if b.peak_rss is not None else None,
    )
    until_a = _end_of_step(samples_a, ends_a, alignment.end)
    until_b = _end_of_step(samples_b, ends_b, alignment.end)
    return JobComparison(
        energy=compare_energy(a, b, (since_a, until_a), (since_b, until_b)),
        alignment=alignment,
        steps=compare_steps(kept_a, kept_b),
        memory=compare_memory(a, b, since_a, since_b),
        host_peak_rss=rss,
        ops=ops,
        ops_note=note,
        counts=compare_counts(a.op_timings, b.op_timings),
        findings=compare_findings(a, b),
        rank=rank,
    )


def _rank(job: JobModel, fallback: int) -> int:
    hello = job.hello
    return hello.rank if hello is not None and hello.rank is not None else fallback


def compare_runs(
    a: Sequence[JobModel], b: Sequence[JobModel], skip: int | None = None
) -> RunComparison:
    """Two multi-rank runs: each rank present in both against itself, with one alignment for
    all (the longest warm-up of any rank), and the run's steps (every rank's, pooled)."""
    by_a = {_rank(job, i): job for i, job in enumerate(a)}
    by_b = {_rank(job, i): job for i, job in enumerate(b)}
    common = sorted(set(by_a) & set(by_b))
    if not common:
        raise CompareError("the two runs have no rank in common")
    pooled_a: list[StepSample] = []
    pooled_b: list[StepSample] = []
    warm = 0
    for r in common:
        sa, sb = step_samples(by_a[r].training), step_samples(by_b[r].training)
        if not sa or not sb:
            which = "A" if not sa else "B"
            raise CompareError(f"rank {r} of recording {which} has no timed steps to compare")
        warm = max(warm, detect_warmup(sa), detect_warmup(sb))
        pooled_a += sa
        pooled_b += sb
    alignment = None
    ranks = []
    for r in common:
        sa, sb = step_samples(by_a[r].training), step_samples(by_b[r].training)
        rank_alignment, _, _ = align(sa, sb, warm if skip is None else skip)
        if alignment is None:
            alignment = rank_alignment
        ranks.append(compare_jobs(by_a[r], by_b[r], alignment=rank_alignment, rank=r))
    assert alignment is not None
    start = alignment.start
    end = min(r.alignment.end for r in ranks)
    run_a = [s for s in pooled_a if start <= s.index < end]
    run_b = [s for s in pooled_b if start <= s.index < end]
    return RunComparison(
        ranks=ranks,
        run_steps=compare_steps(run_a, run_b),
        alignment=alignment,
        only_a=sorted(set(by_a) - set(by_b)),
        only_b=sorted(set(by_b) - set(by_a)),
    )
