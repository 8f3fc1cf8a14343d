"""The ranks of one run judged together: the rank that holds the others back, a hang, a rank
that died.

Pure Python over the :class:`~torchtop.model.JobModel` of each rank. :class:`RankAdvisor` runs
the rules at most once per :data:`EVAL_INTERVAL_S` of message time, as the per-job advisor does,
so a run fed live and the same run fed from its recording give the same findings. Findings have
the advisor's shape (:class:`~torchtop.model.advice.Finding`) with the rank they name.

**Stragglers** (the rule TraceML publishes). In a synchronous job (DDP) every rank's step takes
the same time: the ranks meet in the gradient all-reduce inside ``loss.backward()``, and the
early ones wait there for the last. So the time each rank spends inside backward is its
*visible wait* plus the backward compute, the same on every rank. The *culprit* is the rank with
the least time in backward (it arrived last and waited least); the *reference* is the upper
median rank. ``score = (backward_ref - backward_culprit) / step_ref``, over each rank's recent
steps (:data:`~torchtop.model.training.RECENT_WINDOW_S`, at least
:data:`~torchtop.model.training.MIN_RECENT_STEPS` steps each). A score of
:data:`STRAGGLER_WARN` names the culprit (warning; :data:`STRAGGLER_CRITICAL`: critical) once it
has held :data:`STRAGGLER_HOLD_S`. The gap is then attributed: the culprit's extra data wait and
its extra time outside backward and data (forward, optimizer, the rest), each as a share of the
gap; a share of :data:`CAUSE_COVERAGE` names the cause.

**Stragglers from arrivals.** Where the ranks' agents send the collectives their flight
recorders saw, the rank the others wait for at them is named from its arrivals
(:func:`torchtop.model.collectives.straggler`: a clear margin over the other ranks' spread,
over the run's latest :data:`RULE_COLLECTIVES` joined collectives), with its cause from the
step figures (:func:`arrival_cause`); where both rules name the same rank, one finding carries
both evidences. The run's waiting for the last rank (:func:`~torchtop.model.collectives.waiting`)
is kept for the report and the exporter.

**Hangs.** When no rank has finished a step (or taken a batch) for
``hang_threshold(median step)`` seconds (:data:`~torchtop.protocol.HANG_STEPS` median
steps, at least the agents' ``hang_after_s``: 30 s by default), the run is stuck. Each stuck
rank's agent sends its training thread's stack (:class:`~torchtop.protocol.StackSampled`); a
rank whose stack is outside backward and ``torch.distributed`` is the one the others wait for.

**Dead ranks.** A rank whose stream ended with a failing exit, or broke off with none (killed),
is dead; the launcher's own failure summary gives its exit code when the agent could not
(:func:`launcher_exits`).
"""

from __future__ import annotations

import re
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from torchtop.model.advice import MAX_CLEARED, SEVERITY_ORDER, Check, Finding, Severity
from torchtop.model.collectives import (
    ArrivalStraggler,
    CollectiveRecord,
    JoinCache,
    Joined,
    Lateness,
    RunWaiting,
    hang_triage,
    join,
    lateness_of,
    waiting,
)
from torchtop.model.collectives import straggler as last_to_arrive
from torchtop.model.training import MIN_RECENT_STEPS, RECENT_WINDOW_S
from torchtop.protocol import HANG_AFTER_S, StackFrame, StackSampled, hang_threshold

if TYPE_CHECKING:
    from torchtop.model.job import JobModel

#: Seconds of message time between two evaluations.
EVAL_INTERVAL_S = 1.0
#: The straggler score that names a rank (warning), and the one that makes it critical.
STRAGGLER_WARN = 0.10
STRAGGLER_CRITICAL = 0.20
#: Seconds the score must hold before the rank is named.
STRAGGLER_HOLD_S = 2.0
#: The share of the gap a component must explain to be named the cause.
CAUSE_COVERAGE = 0.8
#: A stack frame is in a collective (or waiting for one) when its file is under one of these.
COLLECTIVE_PATHS = ("/torch/distributed/", "/torch/autograd/", "/torch/_tensor.py")
#: Rules with a finding per rank they name (the others have one per run).
PER_RANK = frozenset({"straggler", "rank_died"})
#: The run's latest collectives the arrivals rule, the exported lateness and the waiting read
#: (a straggler that stopped being one clears; about 15 s of a DDP job's all-reduces).
RULE_COLLECTIVES = 1000
#: Frames of the standard library and installed packages: the job's own line is the innermost
#: frame outside these.
LIBRARY_PATHS = ("/site-packages/", "/dist-packages/", "/lib/python3", "<frozen")


@dataclass(frozen=True)
class RankTimes:
    """One rank's mean step over its recent steps, in seconds."""

    rank: int
    steps: int
    step_s: float
    #: Data wait (each iterator's first batch excluded).
    wait_s: float
    #: Inside ``loss.backward()``: backward compute and the collective's wait.
    backward_s: float
    #: Everything else: forward, optimizer, first batches, the rest of the loop.
    own_s: float
    #: Inside ``optimizer.step()`` (part of ``own_s``).
    optimizer_s: float = 0.0

    def json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "steps": self.steps,
            "step_s": round(self.step_s, 6),
            "wait_s": round(self.wait_s, 6),
            "backward_s": round(self.backward_s, 6),
            "own_s": round(self.own_s, 6),
            "optimizer_s": round(self.optimizer_s, 6),
        }


def rank_times(job: JobModel) -> RankTimes | None:
    """The rank's recent mean step; ``None`` without enough timed steps or without a backward
    measured (an agent that predates it, a loop without ``backward``: the rule abstains)."""
    hello = job.hello
    if hello is None or hello.rank is None:
        return None
    recent = job.training.recent(job.now)
    if recent.steps < MIN_RECENT_STEPS or recent.time_s <= 0 or recent.backward_s <= 0:
        return None
    n = recent.steps
    step, wait, backward = recent.time_s / n, recent.wait_s / n, recent.backward_s / n
    own = max(0.0, step - wait - backward)
    return RankTimes(hello.rank, n, step, wait, backward, own, min(own, recent.optimizer_s / n))


@dataclass(frozen=True)
class Verdict:
    """A rule's finding at one evaluation (the advisor's :class:`Check`), before it has held
    long enough to be shown: which rule, the rank it names, and the run."""

    name: str
    rank: int | None
    check: Check
    run_id: str | None = None

    @property
    def key(self) -> tuple[str, int | None, str | None]:
        """One finding per run, or per rank for the rules that name each rank apart (the
        hang's culprit may be known only once its stack arrives: still the same hang)."""
        return (self.name, self.rank if self.name in PER_RANK else None, self.run_id)


def _verdict(name: str, rank: int | None, severity: Severity, title: str, **rest: Any) -> Verdict:
    return Verdict(name, rank, Check(severity=severity, title=title, code=None, demo="", **rest))


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.1f} ms"


def _ranks(ranks: Iterable[int]) -> str:
    """``rank 3``, ``ranks 0, 1``, ``ranks 0-16, 18-255``: three or more in a row as a span,
    so that a line about one rank of 256 is not a list of the other 255."""
    ordered = sorted(set(ranks))
    spans: list[list[int]] = []
    for rank in ordered:
        if spans and rank == spans[-1][-1] + 1:
            spans[-1].append(rank)
        else:
            spans.append([rank])
    parts = [
        f"{span[0]}-{span[-1]}" if len(span) >= 3 else ", ".join(map(str, span)) for span in spans
    ]
    return ("rank " if len(ordered) == 1 else "ranks ") + ", ".join(parts)


def straggler(times: Sequence[RankTimes], now: float) -> Verdict | None:
    """The rank with the least wait in backward, if the gap is :data:`STRAGGLER_WARN` of a
    step or more (see the module's docstring)."""
    if len(times) < 2:
        return None
    ordered = sorted(times, key=lambda r: (r.backward_s, r.rank))
    culprit = ordered[0]
    reference = ordered[len(ordered) // 2]
    gap = reference.backward_s - culprit.backward_s
    if reference.step_s <= 0 or gap <= 0:
        return None
    score = gap / reference.step_s
    if score < STRAGGLER_WARN:
        return None
    excess = {
        "data": culprit.wait_s - reference.wait_s,
        "compute": culprit.own_s - reference.own_s,
    }
    coverage = {name: round(min(1.0, max(0.0, value) / gap), 3) for name, value in excess.items()}
    cause = max(coverage, key=lambda name: coverage[name])
    if coverage[cause] < CAUSE_COVERAGE:
        cause = "unattributed"
    r = culprit.rank
    summary = (
        f"rank {r} holds the others back: {_ms(culprit.backward_s)} in backward where rank "
        f"{reference.rank} waits {_ms(reference.backward_s)} (score {score:.2f} of a "
        f"{_ms(reference.step_s)} step)"
    )
    if cause == "data":
        summary += f"; its data wait is {_ms(excess['data'])} longer"
    elif cause == "compute":
        summary += f"; its work outside backward is {_ms(excess['compute'])} longer"
    fix = _straggler_fix(r, cause)
    start = now - RECENT_WINDOW_S
    return _verdict(
        name="straggler",
        rank=r,
        severity="critical" if score >= STRAGGLER_CRITICAL else "warning",
        title="a straggler holds the others back",
        evidence={
            "score": round(score, 3),
            "gap_s": round(gap, 6),
            "reference_rank": reference.rank,
            "cause": cause,
            "excess_s": {k: round(v, 6) for k, v in excess.items()},
            "coverage": coverage,
            "ranks": [t.json() for t in sorted(times, key=lambda t: t.rank)],
        },
        summary=summary,
        window=(start, now),
        fix=fix,
    )


def _collectives(jobs: Sequence[JobModel]) -> dict[int, list[CollectiveRecord]]:
    return {
        job.hello.rank: list(job.collectives)
        for job in jobs
        if job.hello is not None and job.hello.rank is not None and job.collectives
    }


def collective_join(jobs: Sequence[JobModel], cache: JoinCache | None = None) -> list[Joined]:
    """The collectives the ranks of each node all recorded, oldest first (empty where fewer
    than two ranks sent collectives); with ``cache``, only what arrived since its last use is
    joined."""
    records = _collectives(jobs)
    if len(records) < 2:
        return []
    nodes = {j.hello.rank: j.hello.hostname for j in jobs if j.hello and j.hello.rank is not None}
    return cache.update(records, nodes) if cache is not None else join(records, nodes)


def collective_lateness(jobs: Sequence[JobModel]) -> dict[int, Lateness]:
    """Each rank's lateness at the collectives the ranks of its node all recorded (empty
    where fewer than two ranks sent collectives)."""
    return lateness_of(collective_join(jobs))


def lateness_json(late: Lateness) -> dict[str, Any]:
    share = late.wait_share
    return {
        "rank": late.rank,
        "joined": late.joined,
        "last_share": round(late.last_share, 3),
        "mean_late_s": round(late.mean_s, 6),
        "median_late_s": round(late.median_s, 6),
        "median_margin_s": round(late.margin_s, 6),
        "waited_s": round(late.waited_s, 6),
        "wait_share": round(share, 4) if share is not None else None,
    }


def _median_of(values: Iterable[float]) -> float:
    listed = list(values)
    return statistics.median(listed) if listed else 0.0


def arrival_cause(
    found: ArrivalStraggler, times: Sequence[RankTimes]
) -> tuple[str, dict[str, float], dict[str, float]]:
    """What the straggler does longer than the others in the time since its previous
    collective, from the per-rank step figures: ``data`` (its data wait), ``forward`` (its
    time outside backward, data and the optimizer: forward and the rest of the loop),
    ``optimizer``; each excess over the other ranks' median as a share of its lateness. One
    that explains :data:`CAUSE_COVERAGE` of it is the cause; where together they explain
    less than the rest, the delay is inside its ``backward`` before the collective (DDP
    enqueues its all-reduces there); ``unattributed`` otherwise, and ``unknown`` without the
    step figures (no steps timed, or no backward measured)."""
    own = next((t for t in times if t.rank == found.rank), None)
    others = [t for t in times if t.rank != found.rank]
    if own is None or not others or found.late.margin_s <= 0:
        return "unknown", {}, {}

    def forward(t: RankTimes) -> float:
        return max(0.0, t.own_s - t.optimizer_s)

    excess = {
        "data": own.wait_s - _median_of(t.wait_s for t in others),
        "forward": forward(own) - _median_of(forward(t) for t in others),
        "optimizer": own.optimizer_s - _median_of(t.optimizer_s for t in others),
    }
    late = found.late.margin_s
    coverage = {k: round(min(1.0, max(0.0, v) / late), 3) for k, v in excess.items()}
    cause = max(coverage, key=lambda k: coverage[k])
    if coverage[cause] < CAUSE_COVERAGE:
        cause = "backward" if sum(coverage.values()) < 1 - CAUSE_COVERAGE else "unattributed"
    return cause, {k: round(v, 6) for k, v in excess.items()}, coverage


_ARRIVAL_CAUSE = {
    "data": "its data wait is longer",
    "forward": "its forward (and the rest of its loop outside backward) is longer",
    "optimizer": "its optimizer step is longer",
    "backward": "its data wait, forward and optimizer match the others': the delay is inside "
    "its backward, before the collective",
}


def _straggler_fix(rank: int, cause: str) -> str:
    """What to do about a straggler, by its cause (either rule's)."""
    if cause == "data":
        return (
            f"Make rank {rank}'s batches as quick as the others': its DataLoader waits longer "
            "(more workers, a faster shard or storage on its node, the same per-rank work)."
        )
    if cause in ("forward", "compute"):
        return (
            f"Find the extra work on rank {rank} outside backward: its forward, logging or "
            "evaluation run only there, uneven inputs, or a slower or busier device or host."
        )
    if cause == "optimizer":
        return (
            f"Rank {rank}'s optimizer step takes longer than the others': look for work done "
            "there only (an extra parameter group, clipping or logging on that rank)."
        )
    if cause == "backward":
        return (
            f"Rank {rank} is slow inside its backward before the gradients are all-reduced: "
            "look at hooks on its gradients or activations, uneven inputs, or its device."
        )
    if cause == "unattributed":
        return (
            f"Rank {rank} arrives late at the all-reduce for a reason its data wait and forward "
            "do not show: look at its host (CPU contention, throttling) and its collectives."
        )
    return (
        f"Rank {rank} enqueues its collectives last: find what it does before them that the "
        "others do not (its data, its forward, hooks or logging in its backward, a busier host)."
    )


def _arrives_last(late: Lateness) -> str:
    return (
        f"arrives last at {100 * late.last_share:.0f}% of {late.joined} collectives, "
        f"{_ms(late.margin_s)} after the others (median)"
    )


def arrival_straggler(
    per_rank: dict[int, Lateness], now: float, times: Sequence[RankTimes] = ()
) -> Verdict | None:
    """The rank last at most collectives, from the flight recorder's enqueue times (each
    compared only with the ranks of its node: they share a clock), with its cause where the
    step figures tell it. None where no rank sent collectives or the margin is not clear:
    the rule on the time outside backward decides then."""
    found = last_to_arrive(per_rank)
    if found is None:
        return None
    late = found.late
    cause, excess, coverage = arrival_cause(found, times)
    summary = f"rank {late.rank} {_arrives_last(late)} (the others' spread {_ms(found.spread_s)})"
    if cause in _ARRIVAL_CAUSE:
        summary += f"; {_ARRIVAL_CAUSE[cause]}"
    return _verdict(
        name="straggler",
        rank=late.rank,
        severity="warning",
        title="a straggler holds the others back",
        evidence={
            "source": "arrivals",
            "clock": "enqueue times compared within each node",
            "median_margin_s": round(late.margin_s, 6),
            "spread_s": round(found.spread_s, 6),
            "cause": cause,
            "excess_s": excess,
            "coverage": coverage,
            "ranks": [lateness_json(r) for r in sorted(per_rank.values(), key=lambda r: r.rank)],
        },
        summary=summary,
        window=(now - RECENT_WINDOW_S, now),
        fix=_straggler_fix(late.rank, cause),
    )


def _either_straggler(
    per_rank: dict[int, Lateness], times: Sequence[RankTimes], now: float
) -> Verdict | None:
    """The arrivals' straggler where the ranks sent collectives, else the rule on the time
    outside backward; where both name the same rank, one finding with both evidences."""
    by_time = straggler(times, now)
    by_arrival = arrival_straggler(per_rank, now, times)
    if by_arrival is None:
        return by_time
    if by_time is None or by_arrival.rank is None or by_time.rank != by_arrival.rank:
        return by_arrival
    late = per_rank[by_arrival.rank]
    check = replace(
        by_time.check,
        evidence={**by_time.check.evidence, "arrivals": by_arrival.check.evidence},
        summary=f"{by_time.check.summary}; it {_arrives_last(late)}",
    )
    return replace(by_time, check=check)


def in_collective(frames: Sequence[StackFrame]) -> bool:
    """The stack is inside backward or a ``torch.distributed`` call: where DDP's ranks wait
    for each other."""
    return any(any(p in f.file for p in COLLECTIVE_PATHS) for f in frames)


def job_frame(frames: Sequence[StackFrame]) -> StackFrame | None:
    """The innermost frame of the job's own code (outside the standard library and installed
    packages), else the innermost frame."""
    for frame in reversed(frames):
        if not any(p in frame.file for p in LIBRARY_PATHS):
            return frame
    return frames[-1] if frames else None


def _where(frame: StackFrame | None) -> str:
    if frame is None:
        return "?"
    return f"{frame.file.rsplit('/', 1)[-1]}:{frame.line} in {frame.function}"


def _last_progress(job: JobModel) -> float | None:
    """When the rank last ended a step, or took a batch after its first step (an evaluation
    loop between epochs makes progress without steps); ``None`` before its first step."""
    points = job.training.points
    if not points:
        return None
    batch = job.training.last_batch_t
    return max(points[-1].t, batch) if batch is not None else points[-1].t


def _stack_since(job: JobModel, t: float) -> StackSampled | None:
    """The rank's stack if it was sent after ``t``."""
    return job.stack if job.stack is not None and job.stack.t >= t else None


def hang(jobs: Sequence[JobModel], now: float) -> Verdict | None:
    """No rank finished a step (or took a batch) for the hang threshold: which ranks are
    stuck, and where."""
    ends = [e for e in map(_last_progress, jobs) if e is not None]
    if not ends:
        return None
    alive = [j for j in jobs if not j.job_ended and j.hello is not None]
    if not alive:
        return None
    floors = [j.hello.hang_after_s for j in jobs if j.hello and j.hello.hang_after_s]
    floor = min(floors) if floors else HANG_AFTER_S
    last = max(ends)
    stale = now - last
    if stale < floor:  # the threshold is never below the floor: no need for the medians
        return None
    medians = [m for m in (j.training.step_time(0.5) for j in jobs) if m is not None]
    median = statistics.median(medians) if medians else None
    threshold = hang_threshold(median, floor)
    if stale < threshold:
        return None
    stuck: list[dict[str, Any]] = []
    outside: list[int] = []
    waiting: list[int] = []
    # The ranks still running, and those that sent their stack in this stall before they
    # ended (the rank that held the others may be the first the launcher stops).
    stalled = [j for j in jobs if j.hello is not None and _stack_since(j, last) is not None]
    held = alive + [j for j in stalled if j not in alive]
    for job in sorted(held, key=lambda j: (j.hello.rank if j.hello else None) or 0):
        rank = job.hello.rank if job.hello is not None else None
        stack = _stack_since(job, last)
        row: dict[str, Any] = {"rank": rank, "pid": job.hello.pid if job.hello else None}
        if stack is not None:
            frame = job_frame(stack.frames)
            collective = in_collective(stack.frames)
            row.update(
                where=_where(frame),
                file=frame.file if frame else None,
                line=frame.line if frame else None,
                in_collective=collective,
                stack=[f"{f.file}:{f.line} in {f.function}" for f in stack.frames[-12:]],
            )
            if rank is not None:
                (waiting if collective else outside).append(rank)
        stuck.append(row)
    summary = f"no rank finished a step for {stale:.0f} s (threshold {threshold:.0f} s)"
    if outside:
        wheres = "; ".join(
            f"rank {row['rank']} at {row['where']}" for row in stuck if row["rank"] in outside
        )
        summary += f": {wheres}, outside any collective"
        if waiting:
            summary += f"; {_ranks(waiting)} wait in a collective"
    elif waiting:
        summary += f": {_ranks(waiting)} wait in a collective"
    culprit = outside[0] if len(outside) == 1 else None
    where = {row["rank"]: row["where"] for row in stuck if row.get("where")}
    triage = hang_triage(_collectives(jobs), where)
    if triage:
        summary = f"{summary}. " + "; ".join(finding.line() for finding in triage)
    return _verdict(
        name="hang",
        rank=culprit,
        severity="critical",
        title="the run is stuck",
        evidence={
            "stale_s": round(stale, 3),
            "threshold_s": round(threshold, 3),
            "median_step_s": round(median, 6) if median is not None else None,
            "outside_collective": outside,
            "in_collective": waiting,
            "ranks": stuck,
            "collectives": [
                {
                    "pg": f.pg,
                    "seq": f.seq,
                    "last_completed_seq": f.last_completed_seq,
                    "op": f.op,
                    "sizes": [list(s) for s in f.sizes],
                    "waiting": list(f.waiting),
                    "never_entered": list(f.missing),
                    "desync": [list(d) for d in f.desync],
                }
                for f in triage
            ],
        },
        summary=summary,
        window=(last, now),
        fix=(
            "Look at where the rank outside any collective is blocked (its stack above): every "
            "rank must reach each collective in the same order; a rank that skips or delays "
            "one holds all the others until the collective's timeout."
        ),
    )


def exit_status(job: JobModel, launcher: dict[int, int] | None = None) -> int | None:
    """The rank's exit code: the launcher's word where it gave one, else the agent's."""
    rank = job.hello.rank if job.hello is not None else None
    if launcher and rank is not None and rank in launcher:
        return launcher[rank]
    return job.exit.exit_code if job.exit is not None else None


def died(job: JobModel, launcher: dict[int, int] | None = None) -> bool:
    """The rank ended with a failing exit, or its stream broke off with none (killed)."""
    if job.exit is None or job.hello is None or job.hello.rank is None:
        return False
    code = exit_status(job, launcher)
    return (code is not None and code != 0) or job.exit.reason.startswith("connection lost")


def _signal(code: int | None) -> str:
    names = {-9: "SIGKILL", -15: "SIGTERM", -6: "SIGABRT", -11: "SIGSEGV", -2: "SIGINT"}
    if code is None:
        return "no exit status"
    if code < 0:
        return f"killed by {names.get(code, f'signal {-code}')}"
    return f"exit {code}"


def _rank_of(job: JobModel) -> int:
    return job.hello.rank if job.hello is not None and job.hello.rank is not None else -1


def dead_ranks(
    jobs: Sequence[JobModel], now: float, launcher: dict[int, int] | None = None
) -> list[Verdict]:
    """One finding per rank that died. A rank stopped by SIGTERM after another rank died
    otherwise (the launcher stopping the survivors) is info; the others are critical."""
    dead = [
        j for j in jobs if j.hello is not None and j.hello.rank is not None and died(j, launcher)
    ]
    first = [j for j in dead if exit_status(j, launcher) != -15]
    out = []
    for job in dead:
        assert job.hello is not None and job.hello.rank is not None and job.exit is not None
        rank = job.hello.rank
        code = exit_status(job, launcher)
        consequence = code == -15 and bool(first)
        how = _signal(code)
        summary = f"rank {rank} died ({how}) after {job.training.total} steps"
        if job.exit.reason:
            summary += f": {job.exit.reason}"
        if consequence:
            summary += f" (stopped after {_ranks(_rank_of(j) for j in first)} died)"
        living = [
            j.hello.rank for j in jobs if j.hello and j.hello.rank is not None and not j.job_ended
        ]
        if living and not consequence:
            summary += f"; {_ranks(living)} still running (a collective waits for it)"
        out.append(
            _verdict(
                name="rank_died",
                rank=rank,
                severity="info" if consequence else "critical",
                title="a rank died" if not consequence else "a rank was stopped",
                evidence={
                    "exit_code": code,
                    "reason": job.exit.reason,
                    "steps": job.training.total,
                    "pid": job.hello.pid,
                },
                summary=summary,
                window=(job.exit.t, job.exit.t),
                fix=(
                    "Nothing to fix in this rank: the launcher stopped it once another had died."
                    if consequence
                    else "The rank's own output (its traceback, or the OOM killer in the kernel "
                    "log for a SIGKILL) says why; the others cannot go on without it."
                ),
            )
        )
    return out


#: torchelastic's failure summary: ``rank      : 3 (local_rank: 3)`` then
#: ``exitcode  : -9 (pid: 1234)``.
_RANK_LINE = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank")
_EXIT_LINE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)\s*\(pid")


def launcher_exits(lines: Iterable[str]) -> dict[int, int]:
    """Each failed rank's exit code from torchrun's failure summary in the launcher's output
    (ranks that exited 0 are not listed there)."""
    exits: dict[int, int] = {}
    rank: int | None = None
    for line in lines:
        match = _RANK_LINE.match(line)
        if match:
            rank = int(match.group(1))
            continue
        match = _EXIT_LINE.match(line)
        if match and rank is not None:
            exits[rank] = int(match.group(1))
            rank = None
    return exits


def runs(jobs: Iterable[JobModel]) -> dict[str | None, list[JobModel]]:
    """The jobs that are ranks, grouped by their run (``TORCHELASTIC_RUN_ID``)."""
    grouped: dict[str | None, list[JobModel]] = {}
    for job in jobs:
        if job.hello is not None and job.hello.rank is not None:
            grouped.setdefault(job.hello.run_id, []).append(job)
    return grouped


_Key = tuple[str, int | None, str | None]


@dataclass
class RankAdvisor:
    """Runs the run-wide rules over the ranks' models and keeps what they found."""

    interval_s: float = EVAL_INTERVAL_S
    #: Each failed rank's exit code as the launcher reported it (set by whoever reads the
    #: launcher's output).
    launcher_exits: dict[int, int] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    #: Findings that held and then stopped, oldest first (bounded).
    cleared: deque[Finding] = field(default_factory=lambda: deque(maxlen=MAX_CLEARED))
    last_eval: float | None = None
    #: Each rank's arrivals at the collectives, by (run id, rank), as of the last evaluation.
    lateness: dict[tuple[str | None, int], Lateness] = field(default_factory=dict)
    #: Each run's joined collectives (oldest first) and its waiting, as of the last evaluation.
    joined: dict[str | None, list[Joined]] = field(default_factory=dict)
    waiting: dict[str | None, RunWaiting] = field(default_factory=dict)
    _joins: dict[str | None, JoinCache] = field(default_factory=dict)
    _since: dict[_Key, float] = field(default_factory=dict)
    _shown: dict[_Key, Finding] = field(default_factory=dict)

    @property
    def all_findings(self) -> list[Finding]:
        """Every finding of the run: those that cleared, then those holding."""
        return [*self.cleared, *self.findings]

    def observe(self, jobs: Sequence[JobModel], *, force: bool = False) -> bool:
        """Evaluate if :attr:`interval_s` of message time passed (or ``force``); True if the
        findings changed."""
        now = max((j.now for j in jobs if j.now is not None), default=None)
        if now is None or not (force or self.due(now)):
            return False
        return self.evaluate(jobs, now)

    def due(self, now: float | None) -> bool:
        """Whether an evaluation is due at message time ``now`` (:attr:`interval_s` passed)."""
        last = self.last_eval
        return now is not None and (last is None or now - last >= self.interval_s)

    def evaluate(self, jobs: Sequence[JobModel], now: float) -> bool:
        """Run the rules over each run's ranks at ``now``; True if the findings changed."""
        self.last_eval = now
        verdicts: list[Verdict] = []
        for run_id, ranks in runs(jobs).items():
            times = [t for t in map(rank_times, ranks) if t is not None]
            joined = collective_join(ranks, self._joins.setdefault(run_id, JoinCache()))
            per_rank = lateness_of(joined[-RULE_COLLECTIVES:])
            for late in per_rank.values():
                self.lateness[(run_id, late.rank)] = late
            self.joined[run_id] = joined
            waited = waiting(per_rank)
            if waited is not None:
                self.waiting[run_id] = waited
            found = [_either_straggler(per_rank, times, now), hang(ranks, now)]
            found.extend(dead_ranks(ranks, now, self.launcher_exits))
            verdicts.extend(replace(v, run_id=run_id) for v in found if v is not None)
        holds = {"straggler": STRAGGLER_HOLD_S}
        shown: dict[_Key, Finding] = {}
        for verdict in verdicts:
            since = self._since.setdefault(verdict.key, now)
            if now - since < holds.get(verdict.name, 0.0):
                continue
            check = replace(
                verdict.check, evidence={**verdict.check.evidence, "run_id": verdict.run_id}
            )
            shown[verdict.key] = Finding.going_on(
                verdict.name, verdict.rank, check, now, self._shown.get(verdict.key), self.cleared
            )
        held = {v.key for v in verdicts}
        for key in list(self._since):
            if key not in held:
                del self._since[key]
        for key, gone in self._shown.items():
            if key not in shown:
                self.cleared.append(replace(gone, active=False))
        before = [(f.name, f.rank, f.severity, f.summary) for f in self.findings]
        self._shown = shown
        self.findings = sorted(shown.values(), key=lambda f: SEVERITY_ORDER[f.severity])
        return before != [(f.name, f.rank, f.severity, f.summary) for f in self.findings]
