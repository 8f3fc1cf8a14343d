"""The report's training figures: steps, step times, throughput and DataLoader waits.

Standard library only. Built from a recording's ``steps`` and ``loaders`` frames; the keys are
documented in the README. A frame lists up to ``MAX_STEP_DETAIL`` of its steps; when it sampled
them, each listed step stands for the steps up to the next one listed, so counts stay exact and
percentiles are those of an even sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from torchtop.protocol import LoaderInfo, LoaderStats, Message, StepStats, step_detail_weights


@dataclass(frozen=True)
class StepPoint:
    """A step as listed in a frame: its end (wall clock), duration, and how many it stands for."""

    end: float
    duration: float | None
    weight: int


def weighted_quantile(values: list[tuple[float, int]], q: float) -> float | None:
    """The ``q`` quantile (nearest rank) of ``(value, weight)`` pairs; ``None`` if empty."""
    values = sorted(v for v in values if v[1] > 0)
    total = sum(w for _, w in values)
    if total == 0:
        return None
    rank = max(1, math.ceil(q * total - 1e-9))
    seen = 0
    for value, weight in values:
        seen += weight
        if seen >= rank:
            return value
    return values[-1][0]


@dataclass
class TrainingSummary:
    """Totals over every ``steps`` frame, and the latest state of every loader."""

    total: int = 0
    skipped: int = 0
    timed: int = 0
    time_s: float = 0.0
    wait_s: float = 0.0
    startup_s: float = 0.0
    optimizer_s: float = 0.0
    samples: int = 0
    points: list[StepPoint] = field(default_factory=list)
    loaders: dict[int, LoaderStats] = field(default_factory=dict)
    loaders_t: float = float("-inf")
    worker_pids: dict[int, set[int]] = field(default_factory=dict)
    peak_workers_rss: dict[int, int] = field(default_factory=dict)

    def add(self, message: Message) -> None:
        if isinstance(message, StepStats):
            self._add_steps(message)
        elif isinstance(message, LoaderInfo):
            # Totals only grow: a frame older than one already seen (the agent's last frames
            # may cross a late sampler tick's) does not replace it.
            newest = message.t >= self.loaders_t
            self.loaders_t = max(self.loaders_t, message.t)
            for loader in message.loaders:
                if newest or loader.index not in self.loaders:
                    self.loaders[loader.index] = loader
                pids = self.worker_pids.setdefault(loader.index, set())
                pids.update(w.pid for w in loader.workers)
                rss = sum(w.rss_bytes or 0 for w in loader.workers if w.alive)
                self.peak_workers_rss[loader.index] = max(
                    self.peak_workers_rss.get(loader.index, 0), rss
                )

    def _add_steps(self, m: StepStats) -> None:
        self.total = max(self.total, m.total)
        self.skipped = max(self.skipped, m.skipped_total)
        self.timed += m.timed
        self.time_s += m.time_s
        self.wait_s += m.wait_s
        self.startup_s += m.startup_s
        self.optimizer_s += m.optimizer_s
        self.samples += m.samples
        weights = step_detail_weights(m.count, len(m.ends))
        for end, duration, weight in zip(m.ends, m.durations, weights, strict=False):
            self.points.append(StepPoint(end, duration, weight))

    # -- the report's keys -----------------------------------------------------------------

    def _durations(self, start: float | None = None, end: float | None = None) -> list[Any]:
        return [
            (p.duration, p.weight)
            for p in self.points
            if p.duration is not None
            and (start is None or p.end >= start)
            and (end is None or p.end <= end)
        ]

    def phase(self, start: float, end: float | None) -> dict[str, Any]:
        """A phase's ``steps`` (those that ended inside it) and ``median_step_time_s``."""
        steps = sum(
            p.weight for p in self.points if p.end >= start and (end is None or p.end <= end)
        )
        median = weighted_quantile(self._durations(start, end), 0.5)
        return {"steps": steps, "median_step_time_s": _r(median)}

    def to_json(self) -> dict[str, Any]:
        durations = self._durations()
        time_s = self.time_s
        return {
            "steps": self.total,
            "skipped_steps": self.skipped,
            "step_time_s": {
                "median": _r(weighted_quantile(durations, 0.5)),
                "p90": _r(weighted_quantile(durations, 0.9)),
                "mean": _r(time_s / self.timed) if self.timed else None,
            },
            "throughput": {
                "steps_per_s": round(self.timed / time_s, 3) if time_s > 0 else None,
                "samples_per_s": (
                    round(self.samples / time_s, 2) if time_s > 0 and self.samples else None
                ),
            },
            "dataloader": {
                "wait_s": _r(self.wait_s),
                "wait_fraction": round(self.wait_s / time_s, 4) if time_s > 0 else None,
                "first_batch_s": _r(sum(x.first_batch_s for x in self.loaders.values())),
                "optimizer_s": _r(self.optimizer_s),
                "loaders": [self._loader_json(x) for _, x in sorted(self.loaders.items())],
            },
        }

    def _loader_json(self, x: LoaderStats) -> dict[str, Any]:
        return {
            "index": x.index,
            "name": x.name,
            "dataset": x.dataset,
            "batch_size": x.batch_size,
            "num_workers": x.num_workers,
            "pin_memory": x.pin_memory,
            "prefetch_factor": x.prefetch_factor,
            "persistent_workers": x.persistent_workers,
            "start_method": x.start_method,
            "batches": x.batches,
            "samples": x.samples,
            "epochs": x.epochs,
            "wait_s": _r(x.wait_s),
            "first_batch_s": _r(x.first_batch_s),
            "workers_seen": len(self.worker_pids.get(x.index, ())),
            "peak_workers_rss_bytes": self.peak_workers_rss.get(x.index) or None,
        }


def _r(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 6)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f} ms"


def training_parts(report: dict[str, Any]) -> list[Any]:
    """The report's steps and loaders as rich renderables (empty when the job took no steps)."""
    if not report.get("steps"):
        return []
    from rich.table import Table
    from rich.text import Text

    step_time = report["step_time_s"]
    throughput = report["throughput"]
    data = report["dataloader"]
    line = Text()
    line.append(f"steps {report['steps']}", style="bold")
    if report["skipped_steps"]:
        line.append(f" ({report['skipped_steps']} skipped by the GradScaler)")
    line.append(f" · step median {_ms(step_time['median'])}, p90 {_ms(step_time['p90'])}")
    if throughput["samples_per_s"] is not None:
        line.append(f" · {throughput['samples_per_s']:.1f} samples/s")
    if data["wait_fraction"] is not None:
        line.append(f" · data wait {data['wait_fraction']:.0%} of step time")
    parts: list[Any] = [line]
    if data["loaders"]:
        table = Table(title="data loaders", title_justify="left")
        for col in ("loader", "dataset", "batch", "workers", "batches", "wait", "first batch"):
            table.add_column(col, justify="left" if col in ("loader", "dataset") else "right")
        for x in data["loaders"]:
            workers = str(x["num_workers"])
            if x["start_method"]:
                workers += f" {x['start_method']}"
            table.add_row(
                x["name"],
                x["dataset"],
                str(x["batch_size"] if x["batch_size"] is not None else "-"),
                workers,
                str(x["batches"]),
                f"{x['wait_s']:.2f} s",
                f"{x['first_batch_s']:.2f} s",
            )
        parts.append(table)
    return parts
