"""The exported metrics: names, kinds, help and labels, built from job figures.

One table serves Prometheus and OpenTelemetry, so both carry the same figures. Names follow
Prometheus's conventions: a ``torchtop_`` prefix, base units (``_bytes``, ``_seconds``) and
``_total`` on counters (added by the exposition; :attr:`Family.name` is the name without it).
Labels say which job, rank and device a series is: ``run``, ``rank``, ``local_rank``,
``hostname``, ``device``, and the GPU's ``UUID`` spelled as NVIDIA's DCGM exporter spells it, so
``on (UUID)`` joins torchtop's series with DCGM's. Nothing per step, op or phase becomes a label,
and nothing DCGM already exports (utilization, temperature, power) is exported again. The
advisor's findings are one series each while they hold, labelled by rule and severity (a fixed
set of a dozen names), as Prometheus's own ``ALERTS`` series are.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from torchtop.export.figures import DeviceFigures, JobFigures

Kind = Literal["counter", "gauge", "summary"]

#: The labels of every job-level series, in order.
JOB_LABELS = ("run", "rank", "local_rank", "hostname")
#: The labels of every device-level series.
DEVICE_LABELS = (*JOB_LABELS, "device", "UUID")
#: The labels of a device's memory by what holds it.
CATEGORY_LABELS = (*DEVICE_LABELS, "category")
#: The labels of an advisor finding's series.
FINDING_LABELS = (*JOB_LABELS, "finding", "severity")
#: ``MemoryStats.source`` of the CUDA caching allocator.
SOURCE_CUDA = "cuda"


@dataclass(frozen=True)
class Point:
    """One series of a family: its label values and its value (a summary's is count and sum)."""

    labels: tuple[str, ...]
    value: float
    sum: float = 0.0


@dataclass
class Family:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...]
    #: OpenTelemetry's unit (UCUM): ``By``, ``s``, ``1`` or an annotation like ``{step}``.
    unit: str
    points: list[Point] = field(default_factory=list)


def _opt(value: int | None) -> str:
    return "" if value is None else str(value)


def job_labels(snap: JobFigures) -> tuple[str, ...]:
    i = snap.labels
    return (i.run, _opt(i.rank), _opt(i.local_rank), i.hostname)


def device_labels(snap: JobFigures, dev: DeviceFigures) -> tuple[str, ...]:
    return (*job_labels(snap), dev.device, dev.uuid or "")


def families(figures: Iterable[JobFigures]) -> list[Family]:
    """Every family, with one point per job (or per job and device) that has the figure.

    A figure that is unknown (``None``) is left out rather than exported as zero.
    """
    steps = Family(
        "torchtop_steps",
        "counter",
        "Training steps the job finished (optimizer steps, GradScaler skips and torchtop.step()).",
        JOB_LABELS,
        "{step}",
    )
    step_time = Family(
        "torchtop_step_duration_seconds",
        "summary",
        "Duration of training steps, from the end of one step to the end of the next.",
        JOB_LABELS,
        "s",
    )
    wait = Family(
        "torchtop_dataloader_wait_seconds",
        "counter",
        "Time the training thread blocked waiting for the DataLoader's next batch "
        "(each iterator's first batch excluded).",
        JOB_LABELS,
        "s",
    )
    rss = Family(
        "torchtop_host_rss_bytes",
        "gauge",
        "Resident set size of the training process.",
        JOB_LABELS,
        "By",
    )
    sample_t = Family(
        "torchtop_last_sample_timestamp_seconds",
        "gauge",
        "Wall-clock time of the latest sample the agent sent: the moment the gauges describe.",
        JOB_LABELS,
        "s",
    )
    allocated = Family(
        "torchtop_cuda_memory_allocated_bytes",
        "gauge",
        "Memory held by tensors, as the CUDA caching allocator counts it.",
        DEVICE_LABELS,
        "By",
    )
    reserved = Family(
        "torchtop_cuda_memory_reserved_bytes",
        "gauge",
        "Memory the CUDA caching allocator holds from the driver (allocated plus its cache).",
        DEVICE_LABELS,
        "By",
    )
    peak = Family(
        "torchtop_cuda_memory_peak_bytes",
        "gauge",
        "Peak of allocated memory since the job started (the allocator's own peak counter).",
        DEVICE_LABELS,
        "By",
    )
    retries = Family(
        "torchtop_cuda_alloc_retries",
        "counter",
        "Allocations the CUDA caching allocator retried after freeing its cache (a sign of "
        "memory pressure or fragmentation).",
        DEVICE_LABELS,
        "{retry}",
    )
    cpu_allocated = Family(
        "torchtop_cpu_memory_allocated_bytes",
        "gauge",
        "A CPU job's memory in use: the C heap, or live tensor bytes under --memory-limit.",
        DEVICE_LABELS,
        "By",
    )
    ooms = Family(
        "torchtop_ooms",
        "counter",
        "Out-of-memory failures that reached the job (CUDA, or an emulated --memory-limit device).",
        DEVICE_LABELS,
        "{oom}",
    )
    by_category = Family(
        "torchtop_memory_bytes",
        "gauge",
        "A device's memory by what holds it: parameters, gradients and optimizer_state (of "
        "the job's optimizers), other_allocated, cache and fragmentation (sum: reserved).",
        CATEGORY_LABELS,
        "By",
    )
    findings = Family(
        "torchtop_advice_finding",
        "gauge",
        "1 for each finding of torchtop's advisor that holds now, by rule and severity "
        "(info, warning, critical); its evidence and fix are in the viewer and the report.",
        FINDING_LABELS,
        "{finding}",
    )
    agent_cpu = Family(
        "torchtop_agent_cpu_seconds",
        "counter",
        "CPU time torchtop's agent threads used inside the job.",
        JOB_LABELS,
        "s",
    )
    agent_share = Family(
        "torchtop_agent_step_time_ratio",
        "gauge",
        "Share of the job's step time torchtop's agent used over the last second (its threads' "
        "CPU time against the training time; 0.01 is 1%).",
        JOB_LABELS,
        "1",
    )
    agent_measured = Family(
        "torchtop_agent_measured_step_time_ratio",
        "gauge",
        "torchtop's agent's cost on the job's steps as measured by pausing it now and then: the "
        "median step time around its pauses over the median in them, less one (includes the "
        "time a step waits for the GIL; 0.01 is 1%).",
        JOB_LABELS,
        "1",
    )
    lateness = Family(
        "torchtop_collective_lateness_seconds",
        "gauge",
        "How late this rank enqueues its collectives after the first rank of its node, on "
        "average (torch's flight recorder, joined on process group and sequence id).",
        JOB_LABELS,
        "s",
    )
    last_share = Family(
        "torchtop_collective_last_ratio",
        "gauge",
        "Share of the collectives this rank arrived last at: the others waited for it there.",
        JOB_LABELS,
        "1",
    )
    wait_share = Family(
        "torchtop_collective_wait_ratio",
        "gauge",
        "Share of this rank's time spent waiting at collectives for the last rank to arrive "
        "(the run's waiting share is the mean over its ranks).",
        JOB_LABELS,
        "1",
    )
    energy = Family(
        "torchtop_gpu_energy_joules",
        "counter",
        "Energy each GPU of the job used since torchtop's first reading, from NVML's total "
        "energy counter (DCGM's DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION, in joules); GPUs "
        "without the counter (older than Volta, MIG instances) have no series.",
        DEVICE_LABELS,
        "J",
    )
    for snap in figures:
        labels = job_labels(snap)
        if snap.collective_wait_share is not None:
            wait_share.points.append(Point(labels, snap.collective_wait_share))
        for device, uuid, joules in snap.gpu_energy:
            energy.points.append(Point((*labels, device, uuid or ""), joules))
        if snap.collective_late_s is not None:
            lateness.points.append(Point(labels, snap.collective_late_s))
        if snap.collective_last_share is not None:
            last_share.points.append(Point(labels, snap.collective_last_share))
        if snap.agent_cpu_s is not None:
            agent_cpu.points.append(Point(labels, snap.agent_cpu_s))
        if snap.agent_step_share is not None:
            agent_share.points.append(Point(labels, snap.agent_step_share))
        if snap.agent_measured_share is not None:
            agent_measured.points.append(Point(labels, snap.agent_measured_share))
        for name, severity in snap.findings:
            findings.points.append(Point((*labels, name, severity), 1))
        steps.points.append(Point(labels, snap.steps_total))
        step_time.points.append(Point(labels, snap.timed_steps, snap.step_time_s))
        wait.points.append(Point(labels, snap.dataloader_wait_s))
        if snap.host_rss_bytes is not None:
            rss.points.append(Point(labels, snap.host_rss_bytes))
        if snap.sample_t is not None:
            sample_t.points.append(Point(labels, snap.sample_t))
        for dev in snap.devices:
            dl = device_labels(snap, dev)
            if dev.source == SOURCE_CUDA:
                _add(allocated, dl, dev.allocated_bytes)
                _add(reserved, dl, dev.reserved_bytes)
                _add(peak, dl, dev.peak_allocated_bytes)
                _add(retries, dl, dev.alloc_retries)
            elif dev.source:
                _add(cpu_allocated, dl, dev.allocated_bytes)
            ooms.points.append(Point(dl, dev.ooms))
            for category, value in dev.by_category:
                by_category.points.append(Point((*dl, category), value))
    return [
        steps,
        step_time,
        wait,
        allocated,
        reserved,
        peak,
        retries,
        cpu_allocated,
        ooms,
        by_category,
        rss,
        sample_t,
        findings,
        agent_cpu,
        agent_share,
        agent_measured,
        lateness,
        last_share,
        wait_share,
        energy,
    ]


def _add(family: Family, labels: Sequence[str], value: int | None) -> None:
    if value is not None:
        family.points.append(Point(tuple(labels), value))
