"""A run's ranks as Prometheus holds them: the run view fed from its HTTP API, never from a node.

``torchtop attach --prometheus URL`` reads what each node's ``torchtop export`` served and
Prometheus scraped, so one viewer follows a run of any number of nodes at the cost of a few
queries every :data:`POLL_S` seconds. :class:`PrometheusRun` folds the answers into the same
:class:`~torchtop.model.run.RunModel` the relay and local paths feed, one stream per rank
(``RUN/RANK``), as protocol messages:

- a ``hello`` from the series' labels (run, rank, local rank, hostname);
- a ``steps`` frame per scrape that saw steps: the increase of the step counters between two
  scrapes as one entry that stands for all of them (the mean step and data wait per step over
  the scrape interval, not each step);
- a ``sample`` with the latest memory gauges (CUDA allocated, reserved, peak; a CPU job's
  allocated; host RSS).

What Prometheus does not carry is not made up: the pid of a rank, its time in backward (so the
viewer's straggler rule, which compares it, abstains), its op windows, its log lines. The
findings are the ones each node's exporter exports (``torchtop_advice_finding``, about the ranks
of its node) and the straggler score computed in Prometheus over every rank of the run (the
recording rule ``rank:torchtop_straggler_score:1m`` of ``dashboards/torchtop.rules.yml`` where
it is loaded, else the same expression asked directly). A rank whose series went stale (its
exporter stopped, or the scrape fails) is shown lost, with its last figures.
"""

from __future__ import annotations

import itertools
import json
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from torchtop.model.advice import SEVERITY_ORDER, Finding, Severity
from torchtop.model.run_advice import STRAGGLER_CRITICAL, STRAGGLER_WARN
from torchtop.protocol import (
    PROTOCOL_VERSION,
    Hello,
    HostStats,
    MemoryStats,
    Sample,
    StepStats,
)
from torchtop.streams import prometheus_api
from torchtop.streams.prometheus_api import PrometheusError, Samples, Series
from torchtop.streams.runs import RunFold
from torchtop.text import printable

#: Seconds between two rounds of queries.
POLL_S = 2.0
#: Seconds of samples the first round reads (the step-time chart's last minute).
FIRST_WINDOW_S = 60.0
#: The most seconds of samples one round reads (after a pause, a slow answer).
MAX_WINDOW_S = 300.0
#: How far back a run counts as seen when looking for runs.
RUNS_WINDOW = "1h"
#: The counters each scrape's steps are folded from, and the gauges read at each round.
COUNTERS = (
    "torchtop_steps_total",
    "torchtop_step_duration_seconds_count",
    "torchtop_step_duration_seconds_sum",
    "torchtop_dataloader_wait_seconds_total",
)
GAUGES = (
    "torchtop_steps_total",
    "torchtop_host_rss_bytes",
    "torchtop_cuda_memory_allocated_bytes",
    "torchtop_cuda_memory_reserved_bytes",
    "torchtop_cuda_memory_peak_bytes",
    "torchtop_cpu_memory_allocated_bytes",
    "torchtop_advice_finding",
)
#: The view's columns Prometheus has nothing for.
NOT_CARRIED = ("pid", "bwd")
#: The recording rule of the straggler score (``dashboards/torchtop.rules.yml``).
SCORE_RULE = "rank:torchtop_straggler_score:1m"

Query = Callable[[str, str], list[Series]]
QuerySamples = Callable[[str, str], list[Samples]]


def quoted(value: str) -> str:
    """``value`` as a PromQL string (a run id is the user's: escaped, never spliced in)."""
    return json.dumps(value)


def names(families: tuple[str, ...]) -> str:
    return "|".join(families)


def straggler_score_expr(run: str) -> str:
    """Each rank's straggler score over the last minute: the recorded series where the rules
    are loaded, else the rules' expression itself (:func:`straggler_score_inline`)."""
    return f"{SCORE_RULE}{{run={quoted(run)}}} or {straggler_score_inline(run)}"


def straggler_score_inline(run: str, window: str = "1m") -> str:
    """The rules' straggler score of run ``run``'s ranks, as one expression: the share of the
    run's median step a rank spends beyond the run's median step time or median data wait per
    step, over ``window``."""
    sel = f"run={quoted(run)}"
    step = (
        f"(rate(torchtop_step_duration_seconds_sum{{{sel}}}[{window}]) "
        f"/ rate(torchtop_step_duration_seconds_count{{{sel}}}[{window}]) > 0)"
    )
    wait = (
        f"(rate(torchtop_dataloader_wait_seconds_total{{{sel}}}[{window}]) "
        f"/ rate(torchtop_steps_total{{{sel}}}[{window}]) >= 0)"
    )
    step_median = f"quantile by (run) (0.5, {step})"
    beyond_step = f"({step} - on (run) group_left {step_median})"
    beyond_wait = f"({wait} - on (run) group_left quantile by (run) (0.5, {wait}))"
    return (
        f"clamp_min(({beyond_step} > {beyond_wait} or {beyond_wait}) "
        f"/ on (run) group_left {step_median}, 0)"
    )


@dataclass(frozen=True)
class RunSeen:
    """A run Prometheus holds torchtop's series of: its id, ranks and hosts."""

    run: str
    ranks: int
    hosts: int

    def describe(self) -> str:
        hosts = f"{self.hosts} host{'s' if self.hosts != 1 else ''}"
        return f"{self.run} ({self.ranks} rank{'s' if self.ranks != 1 else ''} on {hosts})"


def runs_seen(url: str, *, query: Query = prometheus_api.query) -> list[RunSeen]:
    """The runs with a torchtop series in the last :data:`RUNS_WINDOW`, most ranks first."""
    # Each rank once, however many exporters served it (one restarted on another port).
    series = query(
        url,
        "count by (run, hostname) (count by (run, rank, hostname) "
        f"(last_over_time(torchtop_steps_total[{RUNS_WINDOW}])))",
    )
    ranks: dict[str, int] = defaultdict(int)
    hosts: dict[str, int] = defaultdict(int)
    for one in series:
        run = one.labels.get("run", "")
        ranks[run] += int(one.value)
        hosts[run] += 1
    seen = [RunSeen(run, ranks[run], hosts[run]) for run in ranks]
    return sorted(seen, key=lambda r: (-r.ranks, r.run))


def pick_run(url: str, run: str | None, *, query: Query = prometheus_api.query) -> str:
    """The run to show: ``run`` if Prometheus has it, else the only one it has; otherwise a
    :class:`PrometheusError` that lists the runs seen."""
    shown = printable(url, one_line=True)
    seen = runs_seen(url, query=query)
    listed = ", ".join(r.describe() for r in seen[:12])
    more = f" and {len(seen) - 12} more" if len(seen) > 12 else ""
    if not seen:
        raise PrometheusError(
            f"Prometheus at {shown} holds no torchtop series from the last {RUNS_WINDOW}: "
            "check that it scrapes each node's `torchtop export` (docs/metrics.md, a scrape "
            "job) and that the job is running"
        )
    if run is None:
        if len(seen) == 1:
            return seen[0].run
        raise PrometheusError(
            f"Prometheus at {shown} holds {len(seen)} runs: give one with --run ID "
            f"(seen: {listed}{more})"
        )
    if run not in {r.run for r in seen}:
        raise PrometheusError(
            f"Prometheus at {shown} has no series of run {printable(run, one_line=True)!r} "
            f"in the last {RUNS_WINDOW}: runs seen: {listed}{more}"
        )
    return run


@dataclass
class RankSeries:
    """What the fold knows of one rank between rounds."""

    stream: str
    rank: int | None
    hostname: str
    local_rank: int | None = None
    #: The latest scrape folded (None: none yet, and no hello sent), and its counters (the
    #: base of the next scrape's increase).
    last_t: float | None = None
    counters: dict[str, float] = field(default_factory=dict)
    #: The target (scrape job, instance) its counters are read from.
    target: tuple[str, str] = ("", "")
    #: The times of its recent scrapes (for the scrape interval).
    scrapes: list[float] = field(default_factory=list)


def _int(text: str | None) -> int | None:
    return int(text) if text is not None and text.lstrip("-").isdigit() else None


def _severity(text: str) -> Severity:
    return text if text in SEVERITY_ORDER else "info"  # type: ignore[return-value]


class PrometheusRun(RunFold):
    """The ranks of run ``run_id`` as Prometheus at ``url`` holds them, polled every
    :data:`POLL_S` seconds from a background thread (``query``, ``query_samples``: the API
    client's functions, or a test's)."""

    on_quit = "closes the view"
    rank_lines = False
    not_carried = NOT_CARRIED
    has_output = False

    def __init__(
        self,
        url: str,
        run_id: str,
        *,
        poll_s: float = POLL_S,
        query: Query = prometheus_api.query,
        query_samples: QuerySamples = prometheus_api.query_samples,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__()
        self.url = url
        self.run_id = run_id
        self.poll_s = poll_s
        self._query = query
        self._query_samples = query_samples
        self._clock = clock
        self.ranks: dict[str, RankSeries] = {}
        #: Streams whose series went stale, with the time of their last scrape.
        self.lost: dict[str, float] = {}
        #: Findings from Prometheus: the exporters' and the run-wide straggler score's.
        self.exported: list[Finding] = []
        #: Each rank's straggler score as Prometheus computed it, by stream.
        self.scores: dict[str, float] = {}
        #: Why the last round failed (None: it answered).
        self.error: str | None = None
        self.answered_at: float | None = None
        #: Ranks, lost ranks and the scrape interval as of the last round (for the status).
        self.counts: tuple[int, int, float | None] = (0, 0, None)
        self._last_poll: float | None = None
        self._exported: list[Finding] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the rounds ------------------------------------------------------------------------------

    def poll(self) -> None:
        """One round of queries, folded; a failed round is kept as :attr:`error`."""
        now = self._clock()
        if self._last_poll is None:
            window = FIRST_WINDOW_S
        else:
            window = min(MAX_WINDOW_S, now - self._last_poll + 2 * self.poll_s + 5)
        sel = f"run={quoted(self.run_id)}"
        try:
            samples = self._query_samples(
                self.url, f'{{__name__=~"{names(COUNTERS)}",{sel}}}[{int(window) + 1}s]'
            )
            gauges = self._query(self.url, f'{{__name__=~"{names(GAUGES)}",{sel}}}')
            scores = self._query(self.url, straggler_score_expr(self.run_id))
        except PrometheusError as exc:
            self.error = str(exc)
            return
        self.error = None
        self._last_poll = now
        self.answered_at = now
        self._fold_samples(samples)
        self._fold_gauges(gauges)
        self._fold_scores(scores)
        self.counts = (len(self.ranks), len(self.lost), self._scrape_interval())

    def _rank(self, labels: dict[str, str]) -> RankSeries:
        rank_label = labels.get("rank", "")
        stream = f"{self.run_id}/{rank_label}"
        known = self.ranks.get(stream)
        hostname = labels.get("hostname", "")
        if known is None or known.hostname != hostname:
            known = RankSeries(stream, _int(rank_label), hostname, _int(labels.get("local_rank")))
            self.ranks[stream] = known
        return known

    def _hello(self, rank: RankSeries, t: float) -> None:
        self.queue(
            rank.stream,
            Hello(
                protocol=PROTOCOL_VERSION,
                pid=0,
                argv=[],
                cwd="",
                started_at=t,
                python="",
                torch=None,
                devices=[],
                interval_s=self.poll_s,
                hostname=rank.hostname,
                rank=rank.rank,
                local_rank=rank.local_rank,
                run_id=self.run_id,
            ),
        )

    def _fold_samples(self, samples: list[Samples]) -> None:
        # Each rank's scrapes by target: time -> counter -> value (a scrape reads every counter
        # at once). A rank served by two targets in the window (its exporter restarted on
        # another port, two exporters following it) is read from the one scraped last.
        scrapes: dict[tuple[str, str, str], dict[float, dict[str, float]]] = defaultdict(
            lambda: defaultdict(dict)
        )
        for series in samples:
            name = series.labels.get("__name__", "")
            rank = self._rank(series.labels)
            target = (rank.stream, series.labels.get("job", ""), series.labels.get("instance", ""))
            for t, value in series.values:
                scrapes[target][t][name] = value
        latest: dict[str, tuple[float, str, str]] = {}
        for (stream, job, instance), by_time in scrapes.items():
            latest[stream] = max(latest.get(stream, (0.0, "", "")), (max(by_time), job, instance))
        for stream, (_, job, instance) in latest.items():
            by_time = scrapes[(stream, job, instance)]
            rank = self.ranks[stream]
            if rank.target != (job, instance):
                # Another target's counters count from its own start: its first scrape is
                # the base of the next one's increase.
                rank.target, rank.counters = (job, instance), {}
            for t in sorted(by_time):
                if rank.last_t is not None and t <= rank.last_t:
                    continue
                counters = by_time[t]
                if len(counters) < len(COUNTERS):
                    continue  # a scrape cut across the window's edge
                self._fold_scrape(rank, t, counters)

    def _fold_scrape(self, rank: RankSeries, t: float, counters: dict[str, float]) -> None:
        before = rank.counters
        if rank.last_t is None:
            self._hello(rank, t)
        rank.last_t, rank.counters = t, counters
        rank.scrapes = [*rank.scrapes[-9:], t]
        if not before:
            return  # the base of the next scrape's increase
        steps, timed, time_s, wait_s = (counters[n] - before.get(n, 0.0) for n in COUNTERS)
        if min(steps, timed, time_s, wait_s) < 0:
            return  # the exporter restarted: its counters begin again from here
        if steps <= 0:
            return
        mean = time_s / timed if timed > 0 else None
        self.queue(
            rank.stream,
            StepStats(
                t=t,
                total=int(counters["torchtop_steps_total"]),
                skipped_total=0,
                count=int(steps),
                skipped=0,
                timed=int(timed),
                time_s=time_s,
                wait_s=wait_s,
                startup_s=0.0,
                optimizer_s=0.0,
                samples=0,
                ends=[t],
                durations=[mean],
                waits=[wait_s / timed if timed > 0 else 0.0],
            ),
        )

    def _fold_gauges(self, gauges: list[Series]) -> None:
        host: dict[str, float] = {}
        memory: dict[str, dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
        live: set[str] = set()
        findings: list[tuple[RankSeries, str, Severity]] = []
        for series in gauges:
            name = series.labels.get("__name__", "")
            rank = self._rank(series.labels)
            if name == "torchtop_steps_total":
                live.add(rank.stream)
            elif name == "torchtop_host_rss_bytes":
                host[rank.stream] = series.value
            elif name == "torchtop_advice_finding":
                finding = series.labels.get("finding", "")
                findings.append((rank, finding, _severity(series.labels.get("severity", ""))))
            else:
                device = series.labels.get("device", "")
                memory[rank.stream][device][name] = series.value
        # Replaced whole, not changed in place: the view's thread reads it.
        self.lost = {
            stream: self.lost.get(stream, rank.last_t or 0.0)
            for stream, rank in self.ranks.items()
            if stream not in live
        }
        for stream, rank in self.ranks.items():
            if stream in self.lost or rank.last_t is None:
                continue
            devices = [_memory(device, values) for device, values in memory[stream].items()]
            rss = host.get(stream)
            self.queue(
                stream,
                Sample(
                    t=rank.last_t,
                    host=None if rss is None else HostStats(int(rss), None, None, None, None, None),
                    memory=devices,
                ),
            )
        self._exported = [self._exported_finding(*f) for f in findings]

    def _exported_finding(self, rank: RankSeries, name: str, severity: Severity) -> Finding:
        where = f" on {rank.hostname}" if rank.hostname else ""
        who = f"rank {rank.rank}" if rank.rank is not None else "the job"
        return _finding(
            name,
            severity,
            rank.rank,
            f"{who}{where}: {name}, as its node's torchtop exports it",
            f"Its evidence and fix are in the viewer on its node (`torchtop attach` on "
            f"{rank.hostname or 'that node'}).",
            {"source": "exporter", "hostname": rank.hostname},
            rank.last_t or 0.0,
        )

    def _fold_scores(self, scores: list[Series]) -> None:
        by_stream = {}
        for series in scores:
            stream = f"{self.run_id}/{series.labels.get('rank', '')}"
            if stream in self.ranks:
                by_stream[stream] = series.value
        self.scores = by_stream
        found = list(self._exported)
        if len(by_stream) >= 2:
            stream = max(by_stream, key=lambda s: (by_stream[s], s))
            score = by_stream[stream]
            if score >= STRAGGLER_WARN and stream not in self.lost:
                found.append(self._straggler(self.ranks[stream], score, len(by_stream)))
        self.exported = sorted(found, key=lambda f: SEVERITY_ORDER[f.severity])

    def _straggler(self, rank: RankSeries, score: float, ranks: int) -> Finding:
        where = f" on {rank.hostname}" if rank.hostname else ""
        return _finding(
            "straggler",
            "critical" if score >= STRAGGLER_CRITICAL else "warning",
            rank.rank,
            f"rank {rank.rank}{where} is the slowest of {ranks} ranks: score {score:.2f} in "
            "Prometheus over the last minute (step or data wait beyond the median, per step)",
            f"Make rank {rank.rank} as quick as the others: compare its data wait and step time "
            f"in this table, then open it on {rank.hostname or 'its node'} (`torchtop attach`) "
            "for its time in backward and its ops, which Prometheus does not carry.",
            {"source": "prometheus", "score": round(score, 3), "ranks": ranks},
            rank.last_t or 0.0,
        )

    # -- RunFold ---------------------------------------------------------------------------------

    @property
    def findings(self) -> list[Finding]:
        return sorted(
            [*self.exported, *self.model.advisor.findings],
            key=lambda f: SEVERITY_ORDER[f.severity],
        )

    def is_lost(self, stream: str) -> bool:
        return stream in self.lost

    def opens_elsewhere(self, stream: str) -> str | None:
        rank = self.ranks.get(stream)
        if rank is None:
            return "this view reads Prometheus: a rank's full screens open on its node"
        who = f"rank {rank.rank}" if rank.rank is not None else "this job"
        where = f"on {rank.hostname}" if rank.hostname else "on its node"
        return (
            f"{who} runs {where}: this view reads Prometheus, so its full screens open there "
            "(`torchtop attach` on that node); this view shows its row only"
        )

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="torchtop-prometheus", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.poll_s)

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop_job(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def _scrape_interval(self) -> float | None:
        """The median time between two scrapes of a rank, as stored."""
        gaps = [b - a for r in self.ranks.values() for a, b in itertools.pairwise(r.scrapes)]
        return statistics.median(gaps) if gaps else None

    def status(self) -> tuple[str, bool]:
        shown = printable(self.url, one_line=True)
        if self.error is not None:
            return self.error, False
        if self.answered_at is None:
            return f"asking Prometheus at {shown}…", True
        # Figures the polling thread set whole at the end of its last round.
        ranks, lost, scrape = self.counts
        every = f"scrape {scrape:.0f}s" if scrape is not None else "no scrape yet"
        gone = f", {lost} lost (stale series)" if lost else ""
        return f"{ranks - lost} live{gone} · {every} · {shown}", True


def _memory(device: str, values: dict[str, float]) -> MemoryStats:
    def value(name: str) -> int | None:
        got = values.get(name)
        return None if got is None else int(got)

    cuda = value("torchtop_cuda_memory_allocated_bytes")
    if cuda is not None or "torchtop_cuda_memory_reserved_bytes" in values:
        return MemoryStats(
            device=device,
            source="cuda",
            allocated_bytes=cuda,
            reserved_bytes=value("torchtop_cuda_memory_reserved_bytes"),
            peak_allocated_bytes=value("torchtop_cuda_memory_peak_bytes"),
        )
    return MemoryStats(
        device=device,
        source="cpu-heap",
        allocated_bytes=value("torchtop_cpu_memory_allocated_bytes"),
        reserved_bytes=None,
    )


def _finding(
    name: str,
    severity: Severity,
    rank: int | None,
    summary: str,
    fix: str,
    evidence: dict[str, object],
    t: float,
) -> Finding:
    return Finding(
        name=name,
        severity=severity,
        title=name,
        rank=rank,
        evidence=evidence,
        summary=summary,
        window_start=t,
        window_end=t,
        fix=fix,
        code=None,
        demo="",
        first_t=t,
        last_t=t,
        active=True,
    )
