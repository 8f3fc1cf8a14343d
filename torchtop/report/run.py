"""``torchtop report`` on a recording of a multi-rank job: the job and each of its ranks.

A recording made by ``torchtop run torchrun ...`` holds every rank's frames, each tagged with
its source (:func:`torchtop.streams.recording.tag_frame`), and the run's own lines untagged:
the job's
output as the runner copied it and the launcher's exit. Each rank is folded into its own
:class:`JobModel` (side by side in a :class:`RunModel`); the report is the single-process report
of the lowest rank (its steps, memory, ops), with the job's exit and output lines taken from the
launcher, plus ``ranks[]`` (one row per rank) and ``findings[]``.

A job ``torchtop run`` started as a script (not through torchrun) records its own agent
untagged, as a single process, and the ranks its processes became tagged: its own stream is the
launcher's (``torch.multiprocessing.spawn``'s parent, which only waits), and a rank too when its
hello says so (:func:`job_as_rank`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torchtop.model import JobModel
from torchtop.model.collectives import waiting
from torchtop.model.run import RunModel
from torchtop.model.run_advice import (
    collective_lateness,
    died,
    exit_status,
    lateness_json,
    launcher_exits,
)
from torchtop.protocol import Hello, Message
from torchtop.report.job import add_text_row, fold, report_json


def is_multi_rank(sources: Sequence[str | None]) -> bool:
    """True for a recording that holds tagged frames of several agents (or of one rank)."""
    return any(source is not None for source in sources)


def job_as_rank(messages: Sequence[Message], sources: Sequence[str | None]) -> str | None:
    """The stream of the job's own agent (its pid) when it is a rank too: Lightning's
    launcher runs in rank 0, whose agent was the job's before its process group said which
    rank it is (a fresh hello). None when the job's process only launched the ranks."""
    if not is_multi_rank(sources):
        return None
    for message, source in zip(messages, sources, strict=True):
        if source is None and isinstance(message, Hello) and message.rank is not None:
            return str(message.pid)
    return None


def rank_models(
    messages: Sequence[Message], sources: Sequence[str | None]
) -> tuple[JobModel, list[JobModel], RunModel]:
    """The run's own model (output lines and the launcher's exit), each rank's by rank, and
    the ranks side by side (with the run-wide findings, the launcher's exit codes taken in)."""
    run: list[Message] = []
    ranks = RunModel(new_job=lambda: JobModel(mode="replay"))
    own = job_as_rank(messages, sources)
    for message, source in zip(messages, sources, strict=True):
        if source is None:
            run.append(message)
            if own is not None:
                ranks.apply(own, message)
        else:
            ranks.apply(source, message)

    def order(job: JobModel) -> tuple[int, int]:
        hello = job.hello
        rank = hello.rank if hello is not None and hello.rank is not None else 1 << 30
        return rank, hello.pid if hello is not None else 0

    launcher = fold(run)
    ranks.advisor.launcher_exits = launcher_exits(entry.text for entry in launcher.logs)
    # Once more at the end: the exits came last, and the launcher's codes only now.
    now = max((job.now for job in ranks if job.now is not None), default=None)
    if now is not None:
        ranks.advisor.evaluate(list(ranks), now)
    return launcher, sorted(ranks, key=order), ranks


def rank_json(job: JobModel, exits: dict[int, int], job_exit: int | None) -> dict[str, Any]:
    """One row of ``ranks[]``. Its exit code is the launcher's for a rank that failed (its
    failure summary), the agent's where it knew it, and 0 for every rank of a job that
    exited 0 (torchrun exits 0 only when every rank did)."""
    hello = job.hello
    run = job.training.run
    median = job.training.step_time(0.5)
    peaks = [d.peak_allocated for d in job.memory.values() if d.peak_allocated is not None]
    exit_ = job.exit
    code = exit_status(job, exits)
    if code is None and job_exit == 0 and exit_ is not None and not died(job, exits):
        code = 0
    recent = job.training.recent(job.now)
    return {
        "rank": hello.rank if hello else None,
        "local_rank": hello.local_rank if hello else None,
        "node_rank": hello.node_rank if hello else None,
        "pid": hello.pid if hello else None,
        "steps": job.training.total,
        "step_time_s": round(median, 6) if median is not None else None,
        "wait_fraction": round(run.wait_fraction, 4) if run.wait_fraction is not None else None,
        "backward_fraction": (round(run.backward_s / run.time_s, 4) if run.time_s > 0 else None),
        "recent_backward_s": (
            round(recent.mean_backward_s, 6) if recent.mean_backward_s is not None else None
        ),
        "peak_allocated_bytes": max(peaks) if peaks else None,
        "peak_rss_bytes": job.peak_rss,
        "exit_code": code,
        "exit_reason": exit_.reason if exit_ is not None else "no exit recorded",
        "state": "dead" if died(job, exits) else "exited" if job.job_ended else "running",
    }


def summarize_ranks(messages: Sequence[Message], sources: Sequence[str | None]) -> dict[str, Any]:
    """The report's JSON object for a multi-rank recording (keys documented in the README)."""
    launcher, ranks, run = rank_models(messages, sources)
    report = report_json(ranks[0] if ranks else launcher)
    first = ranks[0].hello if ranks else None
    report["job"]["world_size"] = first.world_size if first else None
    report["job"]["run_id"] = first.run_id if first else None
    exit_ = launcher.exit
    report["exit_code"] = exit_.exit_code if exit_ is not None else None
    report["exit_reason"] = exit_.reason if exit_ is not None else "no exit recorded"
    report["log_lines"] = launcher.log_total
    exits = run.advisor.launcher_exits
    report["ranks"] = [rank_json(job, exits, report["exit_code"]) for job in ranks]
    # Each rank's arrivals at the collectives (flight recorder), null without a recorder.
    late = collective_lateness(ranks)
    for row in report["ranks"]:
        found = late.get(row["rank"])
        row["collectives"] = lateness_json(found) if found is not None else None
    waited = waiting(late)
    report["collectives"] = waited.json() if waited is not None else None
    start = ranks[0].first_t if ranks else None
    ranked = []
    for finding in run.advisor.all_findings:
        item = finding.to_json(start)
        item["demo"] = item["demo_command"] = None  # no demo shows a multi-rank finding
        ranked.append(item)
    report["findings"] = [*report.get("findings", []), *ranked]
    return report


def ranks_parts(report: dict[str, Any]) -> list[Any]:
    """The text report's table of ranks (imports rich; the JSON path never does)."""
    if not report.get("ranks"):
        return []
    from rich.table import Table
    from rich.text import Text

    from torchtop.sizes import format_bytes

    table = Table(title=f"ranks ({len(report['ranks'])})", title_justify="left")
    for col in (
        "rank",
        "pid",
        "steps",
        "step median",
        "data wait",
        "peak alloc",
        "peak RSS",
        "waits",
        "exit",
    ):
        table.add_column(col, justify="left" if col == "exit" else "right")
    for r in report["ranks"]:
        step = r["step_time_s"]
        wait = r["wait_fraction"]
        # The share of its time it waited at collectives for the last rank.
        waits = (r.get("collectives") or {}).get("wait_share")
        add_text_row(
            table,
            str(r["rank"] if r["rank"] is not None else "?"),
            str(r["pid"]),
            str(r["steps"]),
            f"{step * 1000:.1f} ms" if step is not None else "n/a",
            f"{wait:.0%}" if wait is not None else "n/a",
            format_bytes(r["peak_allocated_bytes"]),
            format_bytes(r["peak_rss_bytes"]),
            f"{waits:.0%}" if waits is not None else "n/a",
            str(r["exit_code"]) if r["exit_code"] is not None else r["exit_reason"],
        )
    parts: list[Any] = [table]
    waited = report.get("collectives")
    if waited and waited.get("wait_share") is not None:
        parts.append(
            Text(
                f"collectives: {waited['joined']} joined; the ranks waited "
                f"{waited['waited_s']:.2f} s in all for the last rank to arrive "
                f"({waited['wait_share']:.1%} of their time)"
            )
        )
    return parts
