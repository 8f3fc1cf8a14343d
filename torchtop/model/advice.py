"""The advisor: live diagnoses of common training problems, each with its evidence and its fix.

Pure Python over the :class:`~torchtop.model.JobModel` (no torch, Textual or I/O). The model
calls :meth:`Advisor.observe` as it folds messages, at most once per :data:`EVAL_INTERVAL_S` of
*message* time, so a job fed live and the same job fed from its recording give the same
findings at the same times: nothing is written into recordings. The viewer's Advice panel and
``torchtop report`` read :attr:`Advisor.findings`.

Each rule looks at the model at time ``now`` and returns a :class:`Check` when its condition
holds: a severity, the evidence in numbers with the window they came from, what to change and
the demo that shows it. A finding appears once its check has held for the rule's ``hold_s``
seconds of job time, and clears once the check has not held for the rule's ``clear_s`` (0: at
the first evaluation where it no longer holds). The
shape (``name``, ``severity``, ``rank``, ``evidence``, ...) is the one multi-rank findings use.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from dataclasses import replace as _replace
from itertools import pairwise
from typing import Any, Literal, Protocol

from torchtop.model.memory import DeviceMemory
from torchtop.model.oom_advice import EVAL_PHASE, size, step_floors
from torchtop.model.ops import OpTimings, op_avg_s
from torchtop.model.training import MIN_RECENT_STEPS, RECENT_WINDOW_S, LoaderState, TrainingState
from torchtop.protocol import DeviceInfo, GpuStats, Hello, HostStats

Severity = Literal["info", "warning", "critical"]
SEVERITY_ORDER: dict[str, int] = {"critical": 0, "warning": 1, "info": 2}


class JobView(Protocol):
    """What the rules read of a job: :class:`~torchtop.model.JobModel` is one (it holds the
    :class:`Advisor`, so the rules know it by this shape rather than by name)."""

    @property
    def now(self) -> float | None: ...
    @property
    def start(self) -> float | None: ...
    @property
    def hello(self) -> Hello | None: ...
    @property
    def host(self) -> HostStats | None: ...
    @property
    def devices(self) -> list[DeviceInfo]: ...
    @property
    def memory(self) -> dict[str, DeviceMemory]: ...
    @property
    def primary_memory(self) -> DeviceMemory | None: ...
    @property
    def gpus(self) -> dict[int, GpuStats]: ...
    @property
    def gpu_t(self) -> float | None: ...
    @property
    def training(self) -> TrainingState: ...
    @property
    def op_timings(self) -> OpTimings: ...
    def phase_at(self, t: float) -> str | None: ...


#: Seconds of job time between two evaluations of the rules.
EVAL_INTERVAL_S = 1.0
#: The same for each rank of a run's view or an exporter: 64 ranks' rules every second took 2%
#: of a core (the memory-creep rule alone 1.7%), and a rank's own findings hold for seconds to
#: minutes anyway; the run's rules (stragglers, hangs, dead ranks) still run every second.
RANK_EVAL_INTERVAL_S = 5.0
#: Findings that cleared, kept for the report.
MAX_CLEARED = 100

#: Input-bound: the recent data wait over step time.
INPUT_WARN_FRACTION = 0.10
INPUT_CRITICAL_FRACTION = 0.30
#: Workers at or above this mean CPU are busy: more of them, or cheaper samples.
BUSY_WORKER_CPU = 90.0
#: Memory creep: step floors over at least this many steps, cut into this many chunks whose
#: lowest floor must rise chunk after chunk, by at least this much in all.
CREEP_MIN_STEPS = 50
CREEP_MAX_STEPS = 400
#: ... and over at least this many seconds: memory that grows for a moment (DataLoader workers
#: starting, caches filling) and then holds is warm-up, not creep. Fast jobs look back further
#: than ``CREEP_MAX_STEPS`` to cover it.
CREEP_MIN_SPAN_S = 10.0
#: ... after the job's first this many seconds of steps: DataLoader workers starting, the C
#: heap's arenas and the allocator's caches filling make the memory of a healthy job climb
#: for 15-20 s (a CPU job with two workers: 334 -> 413 MiB), then hold.
CREEP_WARMUP_S = 20.0
CREEP_CHUNKS = 5
#: ... each chunk holding at least this many sampled steps.
CREEP_FLOORS_PER_CHUNK = 2
CREEP_MIN_BYTES = 16 << 20
CREEP_MIN_SHARE = 0.05
#: The same on a CPU job, whose RSS also grows as the C heap's arenas warm up and batches from
#: DataLoader workers are mapped in: tens of MiB over hundreds of steps with nothing kept.
CREEP_MIN_BYTES_RSS = 64 << 20
CREEP_MIN_SHARE_RSS = 0.10
#: Evaluation with autograd on: batches fetched with grad mode on by a loader that is not a
#: training loader, in one evaluation interval.
EVAL_GRAD_MIN_BATCHES = 2
#: A loader is a training loader when it gives at most this many batches per step taken.
TRAINING_BATCHES_PER_STEP = 8
#: Host syncs: waits for the device per step on a CUDA job.
SYNC_PER_STEP = 1.0
#: Tiny ops: ops shorter than this on average, taking this share of the op time, this many
#: op calls per step.
TINY_OP_S = 30e-6
TINY_OP_SHARE = 0.5
#: (A small model's whole step, forward, backward and optimizer, runs 100-300 ops: 156 in the
#: profiling demo's MLP. A Python loop over a tensor's rows runs thousands.)
TINY_OP_CALLS_PER_STEP = 500
#: ... over at least this many profiled steps (three windows of two steps), not one glimpse.
TINY_OP_MIN_STEPS = 6
#: Memory pressure: peak reserved over the device's memory.
PRESSURE_SHARE = 0.90
#: Fragmentation: reserved at least this many times allocated, and this share of the device.
FRAG_RATIO = 2.0
FRAG_DEVICE_SHARE = 0.30
#: float32 matmuls: at least this share of the sampled matmul calls take float32 inputs, over
#: at least this many calls, on a device of at least this compute capability (tensor cores).
FP32_MATMUL_SHARE = 0.5
FP32_MATMUL_MIN_CALLS = 10
TENSOR_CORE_CAPABILITY = (7, 0)
#: CPU oversubscription: a DataLoader worker at or above this CPU competes for a core.
BUSY_WORKER_PERCENT = 50.0
#: Low GPU utilization: NVML's mean utilization of the job's GPUs under this, over at least
#: this many readings of the recent window, while steps run.
LOW_GPU_UTIL_PERCENT = 50.0
LOW_GPU_UTIL_MIN_READINGS = 5
#: A GPU reading older than this (seconds) is no reading of now.
GPU_READING_MAX_AGE_S = 5.0


@dataclass(frozen=True)
class Check:
    """A rule's verdict at one evaluation: it holds, with this evidence and this fix."""

    severity: Severity
    title: str
    #: The evidence as numbers (bytes as ints, fractions as floats, settings as they are).
    evidence: dict[str, Any]
    #: The evidence in one line, for the panel and the text report.
    summary: str
    #: Seconds of job time the evidence came from: ``(start, end)``.
    window: tuple[float, float]
    fix: str
    code: str | None
    demo: str


@dataclass(frozen=True)
class Finding:
    """One diagnosis: what, how bad, the evidence and its window, the fix and its demo, and
    when it was first and last true (``active`` while it still holds)."""

    name: str
    severity: Severity
    title: str
    rank: int | None
    evidence: dict[str, Any]
    summary: str
    window_start: float
    window_end: float
    fix: str
    code: str | None
    demo: str
    first_t: float
    last_t: float
    active: bool
    #: Each stretch of job time it held, ``(start, end)``, oldest first: more than one when
    #: it cleared and came back (a finding that flaps is one finding).
    periods: tuple[tuple[float, float], ...] = ()

    @classmethod
    def of(cls, name: str, rank: int | None, check: Check, first_t: float, now: float) -> Finding:
        """The finding a rule's ``check`` makes at ``now``, true since ``first_t``."""
        return cls(
            name=name,
            severity=check.severity,
            title=check.title,
            rank=rank,
            evidence=check.evidence,
            summary=check.summary,
            window_start=check.window[0],
            window_end=check.window[1],
            fix=check.fix,
            code=check.code,
            demo=check.demo,
            first_t=first_t,
            last_t=now,
            active=True,
            periods=((first_t, now),),
        )

    @classmethod
    def going_on(
        cls,
        name: str,
        rank: int | None,
        check: Check,
        now: float,
        shown: Finding | None,
        cleared: deque[Finding],
    ) -> Finding:
        """The finding ``check`` makes at ``now``: the ``shown`` one going on; else the one of
        the same name and rank that held before and cleared, back (taken out of ``cleared``:
        it is one finding, with its periods); else a new one."""
        if shown is not None:
            first_t, earlier, start = shown.first_t, shown.periods[:-1], shown.periods[-1][0]
        else:
            gone = next((f for f in reversed(cleared) if (f.name, f.rank) == (name, rank)), None)
            if gone is not None:
                cleared.remove(gone)
            first_t = gone.first_t if gone is not None else now
            earlier, start = (gone.periods if gone is not None else ()), now
        finding = cls.of(name, rank, check, first_t, now)
        return _replace(finding, periods=(*earlier, (start, now)))

    @property
    def demo_command(self) -> str:
        """``torchtop demo NAME`` for the demo that shows this finding; "" where none does."""
        return f"torchtop demo {self.demo}" if self.demo else ""

    def to_json(self, start: float | None = None) -> dict[str, Any]:
        """Every field, for ``torchtop report --json`` (``findings[]``); times as given, and
        in seconds from ``start`` (the job's start) as ``*_s``."""
        base = start if start is not None else 0.0
        return {
            "name": self.name,
            "severity": self.severity,
            "title": self.title,
            "rank": self.rank,
            "evidence": dict(self.evidence),
            "summary": self.summary,
            "window": [self.window_start, self.window_end],
            "fix": self.fix,
            "code": self.code,
            "demo": self.demo,
            "demo_command": self.demo_command or None,
            "first_t": self.first_t,
            "last_t": self.last_t,
            "window_s": [round(self.window_start - base, 3), round(self.window_end - base, 3)],
            "first_s": round(self.first_t - base, 3),
            "last_s": round(self.last_t - base, 3),
            "active": self.active,
            "periods_s": [[round(a - base, 3), round(b - base, 3)] for a, b in self.periods],
        }


@dataclass
class _Rule:
    name: str
    #: Seconds of job time the check must hold before the finding appears.
    hold_s: float
    check: Callable[[JobView, float, Advisor], Check | None]
    #: Seconds of job time the check must fail before a shown finding clears.
    clear_s: float = 0.0


@dataclass
class Advisor:
    """Runs the rules over one job's model and keeps what they found."""

    interval_s: float = EVAL_INTERVAL_S
    #: Holding findings, worst first (updated at each evaluation).
    findings: list[Finding] = field(default_factory=list)
    #: Findings that held and then stopped, oldest first (bounded).
    cleared: deque[Finding] = field(default_factory=lambda: deque(maxlen=MAX_CLEARED))
    last_eval: float | None = None
    #: Rule name -> the job time its check began to hold (shown or not yet).
    _since: dict[str, float] = field(default_factory=dict)
    _shown: dict[str, Finding] = field(default_factory=dict)
    #: Per loader index: its (batches, grad batches) at the previous evaluation.
    _loader_seen: dict[int, tuple[int, int]] = field(default_factory=dict)
    _steps_seen: int = 0
    #: When the loaders' counts in :attr:`_loader_seen` were read (the agent's time).
    _loaders_seen_t: float | None = None
    #: Loaders that advanced alone while steps were taken: training loaders.
    _training_loaders: set[int] = field(default_factory=set)
    #: The rules' checks that hold at the evaluation in progress (a symptom names its causes).
    _holding: dict[str, Check] = field(default_factory=dict)
    #: (job time, mean NVML utilization of the job's GPUs) at each evaluation with a reading.
    _gpu_util: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=64))

    @property
    def all_findings(self) -> list[Finding]:
        """Every finding of the run: those that cleared, then those holding."""
        return [*self.cleared, *self.findings]

    def summary(self) -> str:
        """The header's line: "1 critical, 2 warnings", or "" with nothing to say."""
        counts: dict[str, int] = {}
        for finding in self.findings:
            counts[finding.severity] = counts.get(finding.severity, 0) + 1
        parts = []
        for severity, plural in (("critical", "critical"), ("warning", "warnings")):
            n = counts.get(severity, 0)
            if n:
                parts.append(f"{n} {severity if n == 1 else plural}")
        n = counts.get("info", 0)
        if n:
            parts.append(f"{n} info")
        return ", ".join(parts)

    def observe(self, model: JobView) -> bool:
        """Evaluate the rules if :attr:`interval_s` of job time passed; True if the findings
        changed."""
        now = model.now
        if now is None:
            return False
        if self.last_eval is not None and now - self.last_eval < self.interval_s:
            return False
        return self.evaluate(model, now)

    def evaluate(self, model: JobView, now: float) -> bool:
        """Run every rule at ``now``; True if the findings changed."""
        self.last_eval = now
        rank = model.hello.rank if model.hello is not None else None
        before = self.findings
        shown: dict[str, Finding] = {}
        self._holding = {}
        self._remember_gpu_util(model, now)
        for rule in RULES:
            check = rule.check(model, now, self)
            if check is not None:
                self._holding[rule.name] = check
            if check is None:
                kept = self._shown.get(rule.name)
                if kept is not None and now - kept.last_t < rule.clear_s:
                    shown[rule.name] = kept  # not long enough untrue to clear
                    continue
                self._since.pop(rule.name, None)
                gone = self._shown.pop(rule.name, None)
                if gone is not None:
                    self.cleared.append(_with(gone, active=False))
                continue
            since = self._since.setdefault(rule.name, now)
            if now - since < rule.hold_s:
                continue
            shown[rule.name] = Finding.going_on(
                rule.name, rank, check, now, self._shown.get(rule.name), self.cleared
            )
        self._shown = shown
        self._remember_loaders(model)
        self.findings = sorted(shown.values(), key=lambda f: SEVERITY_ORDER[f.severity])
        return [(f.name, f.severity, f.summary) for f in before] != [
            (f.name, f.severity, f.summary) for f in self.findings
        ]

    def _remember_gpu_util(self, model: JobView, now: float) -> None:
        if model.gpu_t is None or now - model.gpu_t > GPU_READING_MAX_AGE_S:
            return
        utils = [
            gpu.util_gpu_percent
            for gpu in model.gpus.values()
            if gpu.in_job and gpu.util_gpu_percent is not None and not gpu.lost
        ]
        if utils:
            self._gpu_util.append((now, sum(utils) / len(utils)))

    def _remember_loaders(self, model: JobView) -> None:
        training = model.training
        previous, latest = self._loaders_seen_t, training.loaders_t
        if previous is None or latest is None:
            # The first reading of the loaders' counts: its batches were taken at times
            # unknown. The steps reported since the previous evaluation stand for the interval.
            stepped = training.total - self._steps_seen
        else:
            # The steps that ended between the two readings, whenever they were reported:
            # steps come in frames about twice a second, the loaders' counts about once, so
            # the last steps before an evaluation pass may arrive after a reading that already
            # counts the evaluation loader's first batches. By report, that loader would have
            # advanced alone "while steps were taken", and be held a training loader.
            stepped = training.steps_ended_between(previous, latest)
        advanced = {
            state.stats.index: state.stats.batches
            - self._loader_seen.get(state.stats.index, (0, 0))[0]
            for state in training.loader_states.values()
            if state.stats.batches > self._loader_seen.get(state.stats.index, (0, 0))[0]
        }
        # A loader that alone gave batches while steps were taken, at least one step per
        # TRAINING_BATCHES_PER_STEP batches (gradient accumulation), feeds training. The
        # interval where training ends and evaluation begins has few steps for many batches.
        if stepped > 0 and len(advanced) == 1:
            ((index, batches),) = advanced.items()
            if stepped * TRAINING_BATCHES_PER_STEP >= batches:
                self._training_loaders.add(index)
        self._steps_seen = training.total
        self._loaders_seen_t = latest
        self._loader_seen = {
            state.stats.index: (state.stats.batches, state.stats.grad_batches)
            for state in training.loader_states.values()
        }


def _with(finding: Finding, *, active: bool) -> Finding:
    return _replace(finding, active=active)


def _pct(fraction: float) -> str:
    return f"{100 * fraction:.0f}%"


def _ms(seconds: float | None) -> str:
    return "?" if seconds is None else f"{1000 * seconds:.1f} ms"


# -- the rules ----------------------------------------------------------------------------------


def _recent_start(model: JobView, now: float) -> float:
    """The earliest ``steps`` frame the recent figures cover (as :meth:`TrainingState.recent`)."""
    start = now
    steps = 0
    for t, frame in reversed(model.training.frames):
        if t > now:
            continue
        if t < now - RECENT_WINDOW_S and steps >= MIN_RECENT_STEPS:
            break
        steps += frame.steps
        start = t
    return start


def _busiest_loader(model: JobView) -> LoaderState | None:
    """The loader the training thread waited on most (its first batches included)."""
    loaders = model.training.loader_list
    if not loaders:
        return None
    return max(loaders, key=lambda s: s.stats.wait_s + s.stats.first_batch_s)


def input_bound(model: JobView, now: float, advisor: Advisor) -> Check | None:
    """The training thread waits for data for at least 10% of the step time (30%: critical)."""
    recent = model.training.recent(now)
    fraction = recent.wait_fraction
    if recent.steps < MIN_RECENT_STEPS or fraction is None or fraction < INPUT_WARN_FRACTION:
        return None
    severity: Severity = "critical" if fraction >= INPUT_CRITICAL_FRACTION else "warning"
    evidence: dict[str, Any] = {
        "wait_fraction": round(fraction, 3),
        "mean_wait_s": recent.mean_wait_s,
        "mean_step_s": recent.mean_step_s,
        "steps": recent.steps,
    }
    state = _busiest_loader(model)
    summary = f"data wait {_pct(fraction)} of step time over {recent.steps} steps"
    machine = _Machine.of(model)
    pin = " and pinned memory for the copy to the GPU" if machine.gpu else ""
    fix = f"Prepare batches ahead of the training thread: more DataLoader workers{pin}."
    code: str | None = machine.loader_code(machine.workers(0, 4), persistent_workers=True)
    if state is not None:
        loader = state.stats
        alive = [w for w in loader.workers if w.alive and w.cpu_percent is not None]
        worker_cpu = sum(w.cpu_percent or 0.0 for w in alive) / len(alive) if alive else None
        evidence.update(
            loader=loader.name,
            dataset=loader.dataset,
            num_workers=loader.num_workers,
            pin_memory=loader.pin_memory,
            persistent_workers=loader.persistent_workers,
            prefetch_factor=loader.prefetch_factor,
            worker_cpu_percent=None if worker_cpu is None else round(worker_cpu, 1),
            first_batch_s=loader.first_batch_s,
            epochs=loader.epochs,
            cpus=machine.cpus,
            gpu=machine.gpu,
        )
        summary += (
            f"; {loader.name} ({loader.dataset}) num_workers={loader.num_workers} "
            f"pin_memory={loader.pin_memory} persistent_workers={loader.persistent_workers}"
        )
        current = loader.num_workers
        more = machine.workers(current, 2 * current if current else 4)
        if current == 0:
            fix = (
                "The batches are made in the training thread (num_workers=0): load them in "
                "worker processes, so the next batch is ready when the step ends."
            )
        elif worker_cpu is not None and worker_cpu >= BUSY_WORKER_CPU:
            summary += f", workers at {worker_cpu:.0f}% CPU"
            if more > current:
                fix = (
                    f"The {current} workers are busy at {worker_cpu:.0f}% CPU: add workers "
                    "while cores are free, or make each sample cheaper (decode, augment or "
                    "tokenize once, ahead of training)."
                )
                code = machine.loader_code(more)
            else:
                fix = (
                    f"The {current} workers are busy at {worker_cpu:.0f}% CPU and take the "
                    f"{machine.cpus} cores: make each sample cheaper (decode, augment or "
                    "tokenize once, ahead of training)."
                )
                code = None
        elif (
            not loader.persistent_workers
            and loader.epochs > 1
            and loader.first_batch_s >= loader.wait_s
        ):
            summary += f", worker start-up {loader.first_batch_s:.2f} s over {loader.epochs} epochs"
            fix = (
                "Each epoch starts its workers anew, and the first batch waits for them: keep "
                "them between epochs."
            )
            code = f"DataLoader(ds, num_workers={current}, persistent_workers=True)"
        else:
            more = machine.workers(current, current + 2)
            if more > current:
                fix = "The workers do not keep up: raise prefetch_factor or num_workers"
            else:
                fix = (
                    "The workers do not keep up, and the cores have no room for more: raise "
                    "prefetch_factor, or make each sample cheaper"
                )
            fix += ", and pin memory for the copy to the GPU." if machine.gpu else "."
            code = machine.loader_code(more, prefetch_factor=4)
    return Check(
        severity,
        "Input-bound: the step waits for data",
        evidence,
        summary,
        (_recent_start(model, now), now),
        fix,
        code,
        "dataloader",
    )


@dataclass(frozen=True)
class _Machine:
    """What a fix is checked against before it is offered: a GPU to pin memory for, and the
    cores the job's processes share."""

    gpu: bool
    cpus: int | None
    processes: int

    @classmethod
    def of(cls, model: JobView) -> _Machine:
        host = model.host
        return cls(
            gpu=any(d.id.startswith("cuda") for d in model.devices),
            cpus=host.cpus if host is not None else None,
            processes=(host.local_processes if host is not None else None) or 1,
        )

    def workers(self, current: int, wanted: int) -> int:
        """``wanted`` workers, no more than the cores each process has less its own (but
        never fewer than the job has: taking them away is not a fix for waiting on data)."""
        if self.cpus is None:
            return wanted
        room = max(1, self.cpus // self.processes - 1)
        return max(current, min(wanted, room))

    def loader_code(self, workers: int, **options: object) -> str:
        settings = [f"num_workers={workers}", *(f"{k}={v}" for k, v in options.items())]
        if self.gpu:
            settings.append("pin_memory=True")
        return f"DataLoader(ds, {', '.join(settings)})"


def memory_creep(model: JobView, now: float, advisor: Advisor) -> Check | None:
    """The memory at each step's low point rises over at least 50 steps and 10 s after the
    warm-up: allocated on CUDA; on the CPU the RSS (the heap misses the large tensors, mapped
    apart from it)."""
    memory = model.primary_memory
    if memory is None:
        return None
    first_step = model.training.first_step_t
    if first_step is None:
        return None
    warm = first_step + CREEP_WARMUP_S
    # The last CREEP_MAX_STEPS steps after the warm-up, or more where they span less than
    # CREEP_MIN_SPAN_S: read from the newest back, not over every step kept (a model keeps
    # thousands, and this runs every second for every rank of a run's view).
    ends: list[float] = []
    for p in reversed(model.training.points):
        if p.t > now:
            continue
        if p.t < warm:
            break
        ends.append(p.t)
        if len(ends) > CREEP_MAX_STEPS and p.t <= ends[0] - CREEP_MIN_SPAN_S:
            break
    ends.reverse()
    if len(ends) < CREEP_MIN_STEPS + 1 or ends[-1] - ends[0] < CREEP_MIN_SPAN_S:
        return None
    # Samples within the steps considered; the first end bounds the first step.
    first = ends[0]
    cuda = memory.is_cuda
    points = []
    for m in reversed(memory.series):
        if m.t <= first:
            break
        if m.t <= now:
            points.append((m.t, m.allocated if cuda else m.reserved))
    points.reverse()
    # Steps faster than the sampling leave most steps without a sample: the floors of the
    # sampled steps stand for all of them, as long as each chunk has a few.
    floors = step_floors(points, ends[-1], ends[1:])
    if len(floors) < CREEP_CHUNKS * CREEP_FLOORS_PER_CHUNK:
        return None
    steps = len(ends) - 1
    chunk = len(floors) // CREEP_CHUNKS
    lows = [min(floors[k * chunk : (k + 1) * chunk]) for k in range(CREEP_CHUNKS)]
    if any(b <= a for a, b in pairwise(lows)):
        return None
    rise = floors[-1] - floors[0]
    if cuda:
        least, share = CREEP_MIN_BYTES, CREEP_MIN_SHARE
    else:
        least, share = CREEP_MIN_BYTES_RSS, CREEP_MIN_SHARE_RSS
    if rise < max(least, share * max(floors[0], 1)):
        return None
    per_step = rise / steps
    label = memory.allocated_label if cuda else memory.reserved_label
    return Check(
        "warning",
        "Memory creep: something is kept across steps",
        {
            "device": memory.device,
            "steps": steps,
            "sampled_steps": len(floors),
            "floor_first_bytes": floors[0],
            "floor_last_bytes": floors[-1],
            "rise_bytes": rise,
            "per_step_bytes": int(per_step),
        },
        (
            f"{label} at each step's low point rose {size(floors[0])} -> {size(floors[-1])} "
            f"over {steps} steps ({size(int(per_step))}/step) on {memory.device}"
        ),
        (first, ends[-1]),
        (
            "A tensor outlives its step, often a loss summed with its graph: keep a number, "
            "not the tensor (or detach it), and clear lists that grow each step."
        ),
        "total_loss += loss.item()  # not: total_loss += loss",
        "memory",
    )


def eval_with_grad(model: JobView, now: float, advisor: Advisor) -> Check | None:
    """A loader that is not a training loader (or any loader during an eval-named phase)
    fetched batches with autograd on: the forward passes keep their graphs for nothing."""
    training = model.training
    if training.total == 0:
        return None
    phase = model.phase_at(now)
    in_eval_phase = phase is not None and EVAL_PHASE.search(phase) is not None
    stepped = training.total > advisor._steps_seen
    for state in training.loader_list:
        loader = state.stats
        seen = advisor._loader_seen.get(loader.index)
        if seen is None:
            # Its first report: the batches it counts were fetched at times unknown, maybe
            # while steps already counted went on (a loader reports less often than steps
            # do; a DDP rank stuck in a hang then takes no step after). Its counts are where
            # the next interval starts.
            continue
        batches, grad = seen
        new_grad = loader.grad_batches - grad
        if new_grad < EVAL_GRAD_MIN_BATCHES:
            continue
        named = EVAL_PHASE.search(loader.dataset) is not None
        stepless = not stepped and loader.index not in advisor._training_loaders
        if not (in_eval_phase or named or stepless):
            continue
        why = (
            f"phase {phase!r}"
            if in_eval_phase
            else f"dataset {loader.dataset}"
            if named
            else "no optimizer step meanwhile"
        )
        start = advisor.last_eval if advisor.last_eval is not None else now
        return Check(
            "warning",
            "Evaluation with autograd on",
            {
                "loader": loader.name,
                "dataset": loader.dataset,
                "grad_batches": new_grad,
                "batches": loader.batches - batches,
                "phase": phase,
                "reason": why,
            },
            (
                f"{loader.name} ({loader.dataset}) gave {new_grad} batches with grad mode on "
                f"and {why}"
            ),
            (start, now),
            (
                "The forward passes of evaluation keep their graphs and activations: run them "
                "under torch.no_grad() or torch.inference_mode()."
            ),
            "with torch.inference_mode():\n    val_loss = model(x)",
            "autograd",
        )
    return None


#: Copy-on-write in forked workers: the mean private memory per worker over one epoch, from at
#: least this many readings over this many seconds, rising by at least this much and this share.
COW_MIN_READINGS = 5
COW_MIN_SPAN_S = 5.0
COW_MIN_GROWTH_BYTES = 64 << 20
COW_MIN_GROWTH_FRACTION = 0.25


def worker_copy_on_write(model: JobView, now: float, advisor: Advisor) -> Check | None:
    """Forked DataLoader workers whose private memory (USS) grows over an epoch while the
    dataset holds Python containers (as the agent read its attributes' types; not known from an
    older agent): the dataset's Python objects are copied into each worker page by page as
    their reference counts are written. Shared pages (a NumPy array, a memory-mapped file) do
    not grow USS: a dataset of arrays alone is not this, whatever else grows."""
    for state in model.training.loader_list:
        loader = state.stats
        if loader.num_workers == 0 or loader.start_method in ("spawn", "forkserver"):
            continue
        if loader.dataset_storage == "arrays":
            continue
        readings = list(state.worker_uss)
        if not readings:
            continue
        epoch = readings[-1][1]
        readings = [r for r in readings if r[1] == epoch]
        if len(readings) < COW_MIN_READINGS:
            continue
        (t0, _, first), (t1, _, last) = readings[0], readings[-1]
        third = max(1, len(readings) // 3)
        rising = max(r[2] for r in readings[:third]) < min(r[2] for r in readings[-third:])
        growth = last - first
        if not (
            rising
            and t1 - t0 >= COW_MIN_SPAN_S
            and growth >= COW_MIN_GROWTH_BYTES
            and growth >= COW_MIN_GROWTH_FRACTION * max(first, 1)
        ):
            continue
        workers = sum(1 for w in loader.workers if w.alive) or loader.num_workers
        return Check(
            "warning",
            "DataLoader workers copy the dataset (copy-on-write)",
            {
                "loader": loader.name,
                "dataset": loader.dataset,
                "workers": workers,
                "start_method": loader.start_method,
                "uss_first_bytes": first,
                "uss_last_bytes": last,
                "growth_bytes": growth,
                "epoch": epoch,
                "dataset_storage": loader.dataset_storage,
                "dataset_holds": loader.dataset_detail,
            },
            (
                f"{loader.name} ({loader.dataset}): private memory per worker rose "
                f"{size(first)} -> {size(last)} in {t1 - t0:.0f} s of epoch {epoch} "
                f"(x{workers} workers)"
                + (
                    f"; the dataset holds a {loader.dataset_detail}"
                    if loader.dataset_storage == "python" and loader.dataset_detail
                    else ""
                )
            ),
            (t0, t1),
            (
                "Forked workers share the dataset until Python touches it: each read of a "
                "Python object (list, dict, str) writes its reference count and copies its page "
                "into the worker. Hold the data as NumPy/Arrow arrays or a memory-mapped file, "
                "or start workers with multiprocessing_context='spawn' (or 'forkserver')."
            ),
            "self.labels = np.asarray(labels)  # not: a list of dicts\n"
            "DataLoader(ds, num_workers=2, multiprocessing_context='forkserver')",
            "dataloader",
        )
    return None


def host_syncs(model: JobView, now: float, advisor: Advisor) -> Check | None:
    """At least one wait for the device per step on a CUDA job."""
    ops = model.op_timings
    per_step = ops.sync_points_per_step
    latest = ops.latest
    if per_step is None or latest is None or per_step < SYNC_PER_STEP:
        return None
    syncing = [op for op in latest.cumulative if _syncs(op.name)]
    top = max(syncing, key=lambda op: op.calls, default=None)
    evidence: dict[str, Any] = {
        "sync_points_per_step": per_step,
        "profiled_steps": latest.total_steps,
        "op": top.name if top is not None else None,
        "site": top.site if top is not None else None,
    }
    where = ""
    if top is not None:
        where = f"; {top.name}" + (f" at {top.site}" if top.site else "")
    return Check(
        "warning",
        "Host syncs: the CPU waits for the GPU every step",
        evidence,
        f"{per_step:g} device sync points per step over {latest.total_steps} profiled steps"
        + where,
        (latest.t - latest.total_duration_s, latest.t),
        (
            "Each .item(), print or bool of a device tensor stops the CPU until the GPU "
            "catches up: keep the value on the device and read it every N steps."
        ),
        "if step % 100 == 0: print(loss.item())",
        "device",
    )


def _syncs(name: str) -> bool:
    return name in ("aten::item", "aten::_local_scalar_dense", "aten::nonzero") or (
        "Synchronize" in name or name.startswith("cudaMemcpy")
    )


def tiny_ops(model: JobView, now: float, advisor: Advisor) -> Check | None:
    """Most of the op time in ops of a few µs each, many per step: launch-bound."""
    latest = model.op_timings.latest
    if latest is None or latest.total_steps < TINY_OP_MIN_STEPS:
        return None
    ops = latest.cumulative
    total = sum(op.self_cpu_s for op in ops)
    calls = sum(op.calls for op in ops)
    if total <= 0:
        return None
    tiny = [op for op in ops if op.calls and op_avg_s(op) < TINY_OP_S]
    share = sum(op.self_cpu_s for op in tiny) / total
    per_step = calls / latest.total_steps
    if share < TINY_OP_SHARE or per_step < TINY_OP_CALLS_PER_STEP:
        return None
    top = sorted(tiny, key=lambda op: op.calls, reverse=True)[:3]
    return Check(
        "warning",
        "Tiny ops: the step is launch-bound",
        {
            "tiny_op_share": round(share, 3),
            "ops_per_step": round(per_step, 1),
            "tiny_op_s": TINY_OP_S,
            "top_ops": [op.name for op in top],
        },
        (
            f"{_pct(share)} of op time in ops under {TINY_OP_S * 1e6:.0f} µs, "
            f"{per_step:.0f} ops per step ({', '.join(op.name for op in top)})"
        ),
        (latest.t - latest.total_duration_s, latest.t),
        (
            "Many small ops cost more to launch than to run: work on whole tensors instead "
            "of Python loops, or fuse them."
        ),
        "model = torch.compile(model)",
        "vectorization",
    )


def _device_total(model: JobView, device: str) -> int | None:
    memory = model.memory.get(device)
    if memory is not None and memory.latest.total_bytes:
        return memory.latest.total_bytes
    for info in model.devices:
        if info.id == device and info.total_bytes:
            return info.total_bytes
    return None


def memory_pressure(model: JobView, now: float, advisor: Advisor) -> Check | None:
    """The peak reserved memory is at least 90% of the device's."""
    memory = model.primary_memory
    if memory is None or not memory.is_cuda or memory.peak_reserved is None:
        return None
    total = _device_total(model, memory.device)
    if not total:
        return None
    share = memory.peak_reserved / total
    if share < PRESSURE_SHARE:
        return None
    return Check(
        "warning",
        "Memory pressure: the device is nearly full",
        {
            "device": memory.device,
            "peak_reserved_bytes": memory.peak_reserved,
            "total_bytes": total,
            "share": round(share, 3),
        },
        f"peak reserved {size(memory.peak_reserved)} of {size(total)} ({_pct(share)}) on "
        f"{memory.device}",
        (model.start or now, now),
        (
            "One larger batch or sequence away from an out-of-memory failure: recompute "
            "activations, train in bf16, or use a smaller batch."
        ),
        "with torch.autocast('cuda', dtype=torch.bfloat16): loss = model(x)",
        "checkpointing",
    )


def fragmentation(model: JobView, now: float, advisor: Advisor) -> Check | None:
    """Reserved at least twice allocated while a large share of the device, or the
    allocator had to retry allocations."""
    memory = model.primary_memory
    if memory is None or not memory.is_cuda:
        return None
    allocated = memory.latest.allocated_bytes
    reserved = memory.latest.reserved_bytes
    total = _device_total(model, memory.device)
    retries = memory.num_alloc_retries or 0
    ratio_holds = (
        allocated is not None
        and reserved is not None
        and total is not None
        and reserved >= FRAG_RATIO * max(allocated, 1)
        and reserved >= FRAG_DEVICE_SHARE * total
    )
    if not ratio_holds and retries <= 0:
        return None
    return Check(
        "warning",
        "Fragmentation: the allocator's cache is much larger than what is used",
        {
            "device": memory.device,
            "allocated_bytes": allocated,
            "reserved_bytes": reserved,
            "total_bytes": total,
            "alloc_retries": retries,
            "inactive_split_bytes": memory.fragmented,
        },
        f"reserved {size(reserved)} for {size(allocated)} allocated on {memory.device}, "
        f"{retries} allocation retries",
        (now, now),
        (
            "Blocks of varying sizes split the cache: let the allocator grow segments "
            "instead of cutting them."
        ),
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        "memory",
    )


def _capability(text: str | None) -> tuple[int, int] | None:
    try:
        major, minor = (text or "").split(".")
        return int(major), int(minor)
    except ValueError:
        return None


def float32_matmuls(model: JobView, now: float, advisor: Advisor) -> Check | None:
    """Most sampled matmul calls take float32 inputs on a CUDA device with tensor cores: no
    autocast, so the tensor cores idle (or run TF32 at half bf16's rate)."""
    ops = model.op_timings
    latest = ops.latest
    if latest is None or not ops.device or not latest.total_matmuls:
        return None
    calls = sum(m.calls for m in latest.total_matmuls)
    fp32 = sum(m.calls for m in latest.total_matmuls if m.dtype == "float")
    if calls < FP32_MATMUL_MIN_CALLS or fp32 < FP32_MATMUL_SHARE * calls:
        return None
    devices = [
        (info, cap)
        for info in model.devices
        if info.id.startswith("cuda")
        and (cap := _capability(info.capability)) is not None
        and cap >= TENSOR_CORE_CAPABILITY
    ]
    if not devices:
        return None
    info, cap = devices[0]
    share = fp32 / calls
    return Check(
        "warning",
        "float32 matmuls: the tensor cores are left idle",
        {
            "float32_share": round(share, 3),
            "matmul_calls": calls,
            "dtypes": {m.dtype: m.calls for m in latest.total_matmuls},
            "device": info.id,
            "device_name": info.name,
            "capability": info.capability,
        },
        (
            f"{_pct(share)} of {calls} sampled matmul calls in float32 on {info.name} "
            f"(compute capability {cap[0]}.{cap[1]}, tensor cores), no autocast"
        ),
        (latest.t - latest.total_duration_s, latest.t),
        (
            "Run the forward pass under bf16 autocast: the matmuls use the tensor cores at "
            "several times float32's rate and half the activation memory. At the least, let "
            "float32 matmuls use TF32: torch.set_float32_matmul_precision('high')."
        ),
        "with torch.autocast('cuda', dtype=torch.bfloat16): loss = model(x)",
        "mixed-precision",
    )


def cpu_oversubscription(model: JobView, now: float, advisor: Advisor) -> Check | None:
    """More threads want the CPU than it has: torch's intra-op threads in each of the job's
    processes on the node (warning), or those and the busy DataLoader workers (info: the
    workers are measured busy, but whether the threads suffer is not). Where the threads are
    already no more than the fix would set, the processes per core are the cause (warning
    once they outnumber the cores), and no fix the job already applies is advised."""
    host = model.host
    latest = model.op_timings.latest
    if host is None or not host.cpus or latest is None or latest.torch_threads is None:
        return None
    cpus = host.cpus
    threads = latest.torch_threads
    processes = host.local_processes or 1
    pool = threads * processes
    busy = [
        w
        for state in model.training.loader_list
        for w in state.stats.workers
        if w.alive and (w.cpu_percent or 0.0) >= BUSY_WORKER_PERCENT
    ]
    evidence: dict[str, Any] = {
        "torch_threads": threads,
        "processes": processes,
        "busy_workers": len(busy),
        "cpus": cpus,
    }
    fit = max(1, (cpus - len(busy)) // processes)
    code = f"torch.set_num_threads({fit})  # or OMP_NUM_THREADS={fit}"
    where = f" in each of {processes} processes" if processes > 1 else ""
    if threads <= fit:
        # Fewer threads would not help (the job has no more than the fix would give it):
        # the processes themselves outnumber the cores.
        if processes <= cpus:
            return None
        evidence["processes_per_cpu"] = round(processes / cpus, 2)
        return Check(
            "warning",
            "CPU oversubscription: more processes than cores",
            evidence,
            f"{processes} processes with {threads} torch thread{'s' if threads > 1 else ''} "
            f"each for {cpus} CPUs ({processes / cpus:.1f} per CPU)",
            (latest.began, latest.t),
            (
                "Each process already runs torch on as few threads as it can; there are more "
                "processes on this node than cores, so they take turns and every collective "
                f"waits for the last. Run at most {cpus} processes here (fewer ranks per node, "
                "e.g. torchrun's --nproc_per_node), or give the job more cores."
            ),
            None,
            "",
        )
    if pool > cpus:
        return Check(
            "warning",
            "CPU oversubscription: more torch threads than cores",
            evidence,
            f"{threads} torch threads{where} for {cpus} CPUs",
            (latest.began, latest.t),
            (
                "The intra-op threads outnumber the cores, so they take turns and wait for "
                "each other at every parallel op: set the threads to the cores each process "
                "has, less the DataLoader workers' share."
            ),
            code,
            "dataloader",
        )
    if threads > 1 and pool + len(busy) > cpus and threads > fit:
        return Check(
            "info",
            "CPU oversubscription: DataLoader workers compete with the torch threads",
            evidence,
            f"{threads} torch threads{where} and {len(busy)} busy DataLoader workers for "
            f"{cpus} CPUs",
            (latest.began, latest.t),
            (
                "The busy workers and the intra-op threads share too few cores: give torch "
                "the cores the workers leave."
            ),
            code,
            "dataloader",
        )
    return None


#: Rules whose finding explains a GPU left idle, in the order their fix is worth trying.
GPU_IDLE_CAUSES = (
    "input-bound",
    "host-syncs",
    "tiny-ops",
    "cpu-oversubscription",
    "float32-matmuls",
)


def low_gpu_utilization(model: JobView, now: float, advisor: Advisor) -> Check | None:
    """NVML says the job's GPUs are busy less than half the time while steps run: a symptom,
    named with whichever cause holds."""
    recent = model.training.recent(now)
    if recent.steps < MIN_RECENT_STEPS:
        return None
    readings = [(t, u) for t, u in advisor._gpu_util if t >= now - RECENT_WINDOW_S]
    if len(readings) < LOW_GPU_UTIL_MIN_READINGS:
        return None
    mean = sum(u for _, u in readings) / len(readings)
    if mean >= LOW_GPU_UTIL_PERCENT:
        return None
    causes = [name for name in GPU_IDLE_CAUSES if name in advisor._holding]
    gpus = sorted(g.index for g in model.gpus.values() if g.in_job)
    summary = (
        f"GPU utilization {mean:.0f}% over {len(readings)} readings while {recent.steps} steps ran"
    )
    if causes:
        summary += f"; cause: {', '.join(causes)}"
        first = advisor._holding[causes[0]]
        fix = f"The GPU waits on the CPU side: see the {', '.join(causes)} finding(s). " + first.fix
        code, demo = first.code, first.demo
    else:
        fix = (
            "The GPU waits between kernels: look at the op table and a trace for what the "
            "CPU does meanwhile; give each step more work (a larger batch) or fewer launches "
            "(torch.compile)."
        )
        code, demo = "model = torch.compile(model)", "profiling"
    return Check(
        "warning",
        "Low GPU utilization while steps run",
        {
            "util_percent": round(mean, 1),
            "readings": len(readings),
            "gpus": gpus,
            "steps": recent.steps,
            "causes": causes,
        },
        summary,
        (readings[0][0], now),
        fix,
        code,
        demo,
    )


#: The rules, in priority order, with how long each must hold before it is shown and why.
RULES: Sequence[_Rule] = (
    # Over the recent window (>= 5 steps, ~10 s): 3 s more so one slow batch does not flash.
    _Rule("input-bound", 3.0, input_bound),
    # Already over >= 50 steps of evidence.
    _Rule("memory-creep", 0.0, memory_creep),
    # One interval (~1 s) of evaluation batches is evidence enough; loader counts come about
    # once a second, so an interval may see none: it clears after 3 s without.
    _Rule("eval-with-grad", 0.0, eval_with_grad, clear_s=3.0),
    # Over >= 5 readings (~1 s apart) of one epoch: its evidence is its own window.
    _Rule("worker-copy-on-write", 0.0, worker_copy_on_write),
    # Over the profiled steps of every op window so far.
    _Rule("host-syncs", 0.0, host_syncs),
    _Rule("tiny-ops", 0.0, tiny_ops),
    # A peak: it happened.
    _Rule("memory-pressure", 0.0, memory_pressure),
    # A current reading: hold 5 s so a transient cache does not flash.
    _Rule("fragmentation", 5.0, fragmentation),
    # Over every window that recorded inputs (the first on a CUDA job, then one in four).
    _Rule("float32-matmuls", 0.0, float32_matmuls),
    # A setting, read at each op window: 5 s so workers starting an epoch do not flash.
    _Rule("cpu-oversubscription", 5.0, cpu_oversubscription),
    # Last: it names the causes above that hold. Over >= 5 readings of ~10 s, held 5 s more.
    _Rule("low-gpu-utilization", 5.0, low_gpu_utilization),
)
