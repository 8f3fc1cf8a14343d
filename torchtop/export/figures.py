"""What an exporter reads about one job (one rank): its identity and its figures.

The figures come from the job's :class:`~torchtop.model.job.JobModel` (the fold the viewer and
the report read, so a figure is the same number everywhere); :func:`figures_of` copies the
ones exported into an immutable :class:`JobFigures` that the HTTP and OTLP threads read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torchtop.model.advice import Finding
from torchtop.model.collectives import Lateness
from torchtop.model.job import JobModel
from torchtop.protocol import Hello


@dataclass(frozen=True)
class JobLabels:
    """Who a job is, as its series' labels say: one series per (run, rank) on a host."""

    pid: int
    hostname: str
    run: str
    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None

    @classmethod
    def of(cls, hello: Hello) -> JobLabels:
        return cls(
            pid=hello.pid,
            hostname=hello.hostname,
            # A single process has no run id: its pid names the run.
            run=hello.run_id or str(hello.pid),
            rank=hello.rank,
            local_rank=hello.local_rank,
            world_size=hello.world_size,
        )


@dataclass(frozen=True)
class DeviceFigures:
    """One device's latest allocator reading, with its UUID and captured OOMs."""

    device: str
    #: ``MemoryStats.source``: "cuda", "cpu-heap", ...; empty for a device known only by its
    #: captured OOMs.
    source: str
    uuid: str | None
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    alloc_retries: int | None = None
    ooms: int = 0
    #: What holds the memory (the model's ``DeviceMemory.by_category``), as (category, bytes).
    by_category: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class JobFigures:
    """A job's figures at one moment. Counters are totals since the job started (steps) or
    since the exporter attached (the sums over steps it saw)."""

    labels: JobLabels
    #: Wall-clock time of the latest sample folded, the moment the gauges describe.
    sample_t: float | None = None
    steps_total: int = 0
    #: Steps with a duration (the first has none), and their summed duration.
    timed_steps: int = 0
    step_time_s: float = 0.0
    dataloader_wait_s: float = 0.0
    host_rss_bytes: int | None = None
    devices: tuple[DeviceFigures, ...] = ()
    exited: bool = False
    #: The advisor's findings that hold now: (rule name, severity), worst first.
    findings: tuple[tuple[str, str], ...] = ()
    #: The agent's own cost: its threads' CPU seconds so far, and its latest share of the
    #: job's step time (``None`` while the job takes no step, or from an older agent).
    agent_cpu_s: float | None = None
    agent_step_share: float | None = None
    agent_measured_share: float | None = None
    #: Its mean lateness at the collectives against the first rank of its node (flight
    #: recorder), and the share of them it was last at; ``None`` without a recorder.
    collective_late_s: float | None = None
    collective_last_share: float | None = None
    #: The share of its time spent waiting for the last rank at the collectives.
    collective_wait_share: float | None = None
    #: Joules each GPU of the job used since its first energy reading: (device, UUID, joules);
    #: GPUs without NVML's energy counter are left out.
    gpu_energy: tuple[tuple[str, str | None, float], ...] = ()


def figures_of(
    model: JobModel, run_findings: Sequence[Finding] = (), late: Lateness | None = None
) -> JobFigures | None:
    """The exported figures of one job's model; ``None`` before its hello. ``run_findings``
    (the run's findings about its ranks: straggler, hang, dead rank) add those that name this
    job's rank of its run to its own."""
    hello = model.hello
    if hello is None:
        return None
    uuids = {d.id: d.uuid for d in hello.devices}
    ooms: dict[str, int] = {}
    for entry in model.captures.entries:
        if entry.is_oom:
            ooms[entry.capture.device] = ooms.get(entry.capture.device, 0) + 1
    devices = []
    for device_id in model.device_ids:
        memory = model.memory.get(device_id)
        if memory is None:
            if device_id in ooms:
                devices.append(
                    DeviceFigures(device_id, "", uuids.get(device_id), ooms=ooms[device_id])
                )
            continue
        mem = memory.latest
        devices.append(
            DeviceFigures(
                device=device_id,
                source=mem.source,
                uuid=uuids.get(device_id),
                allocated_bytes=mem.allocated_bytes,
                reserved_bytes=mem.reserved_bytes,
                peak_allocated_bytes=memory.peak_allocated,
                alloc_retries=memory.num_alloc_retries,
                ooms=model.device_ooms(device_id) or 0,
                by_category=tuple((memory.by_category or {}).items()),
            )
        )
    training = model.training
    return JobFigures(
        labels=JobLabels.of(hello),
        sample_t=_last_sample_t(model),
        steps_total=training.total,
        timed_steps=training.run.steps,
        step_time_s=training.run.time_s,
        dataloader_wait_s=training.run.wait_s,
        host_rss_bytes=model.host.rss_bytes if model.host is not None else None,
        devices=tuple(devices),
        exited=model.job_ended,
        agent_cpu_s=model.agent_stats.cpu_s if model.agent_stats is not None else None,
        agent_step_share=model.agent_stats.step_share if model.agent_stats is not None else None,
        agent_measured_share=(
            model.agent_stats.measured_step_share if model.agent_stats is not None else None
        ),
        collective_late_s=late.mean_s if late is not None and late.joined else None,
        collective_last_share=late.last_share if late is not None and late.joined else None,
        collective_wait_share=late.wait_share if late is not None and late.joined else None,
        gpu_energy=tuple(
            (e.name, e.uuid, e.joules) for e in model.energy.values() if e.joules is not None
        ),
        findings=tuple(
            (f.name, f.severity)
            for f in [
                *model.advice.findings,
                *(
                    f
                    for f in run_findings
                    if hello.rank is not None
                    and f.rank == hello.rank
                    and f.evidence.get("run_id") == hello.run_id
                ),
            ]
        ),
    )


def _last_sample_t(model: JobModel) -> float | None:
    if model.rss_series:
        return model.rss_series[-1][0]
    times = [m.series[-1].t for m in model.memory.values() if m.series]
    return max(times) if times else None
