"""Each GPU's energy, from NVML's total energy counter: joules used, mean power, joules per step.

Pure Python. NVML counts the millijoules a GPU used since the driver was loaded, so the energy
of any span is a subtraction: :class:`GpuEnergy` keeps each GPU's readings (bounded) with their
times, and the energy per step is the counter's difference between two readings over the steps
that ended between them. The steps are counted from the step history when asked, not when the
reading arrives: the agent sends a tick's GPU reading before the steps that ended before it.

A GPU without the counter (older than Volta, a MIG instance, some consumer cards) is said to
have none: its figures are ``None`` and :attr:`GpuEnergy.supported` is ``False``, never zero.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from torchtop.model.training import TrainingState
from torchtop.protocol import GpuStats

#: Readings kept per GPU for recent spans and compare's intervals (half an hour at the agent's 2 Hz
#: NVML reads); the run's total and joules per step start from the first reading whatever.
ENERGY_READINGS_KEPT = 3600
#: Seconds of readings the recent figure (the viewer's) covers.
RECENT_ENERGY_S = 10.0
#: What the report and the viewer say of a GPU without the counter.
NOT_SUPPORTED = (
    "not supported: this GPU has no energy counter (older than Volta, a MIG instance, or a "
    "card whose driver does not report it)"
)


def gpu_key(gpu: GpuStats) -> tuple[int | None, int]:
    """A GPU's key among a job's: its MIG parent (``None`` for a whole GPU) and its index."""
    return (gpu.mig_parent, gpu.index)


def gpu_name(gpu: GpuStats) -> str:
    """How the report names a GPU: its CUDA device (``cuda:0``) once matched, else NVML's
    index (``gpu2``, ``gpu0/mig1``)."""
    if gpu.cuda_device is not None:
        return gpu.cuda_device
    if gpu.mig_parent is not None:
        return f"gpu{gpu.mig_parent}/mig{gpu.index}"
    return f"gpu{gpu.index}"


@dataclass(frozen=True)
class EnergySpan:
    """The energy of one span of readings: joules, seconds, and steps that ended within."""

    joules: float
    seconds: float
    steps: int

    @property
    def per_step(self) -> float | None:
        return self.joules / self.steps if self.steps else None

    @property
    def mean_power_w(self) -> float | None:
        return self.joules / self.seconds if self.seconds > 0 else None


@dataclass
class GpuEnergy:
    """One GPU's energy counter readings, ``(t, millijoules)``, oldest first."""

    name: str
    #: NVML's UUID (``GPU-…``, ``MIG-…``): the exporter's ``UUID`` label, as DCGM's.
    uuid: str | None = None
    #: ``None`` until a reading; ``False`` once a reading came without the counter.
    supported: bool | None = None
    #: The first reading ever (kept when the bounded readings let it go), for the run's total.
    first: tuple[float, int] | None = None
    readings: deque[tuple[float, int]] = field(
        default_factory=lambda: deque(maxlen=ENERGY_READINGS_KEPT)
    )

    def observe(self, t: float, gpu: GpuStats) -> None:
        if gpu.lost:
            return
        self.name = gpu_name(gpu)
        self.uuid = gpu.uuid or self.uuid
        if gpu.energy_supported is False:
            self.supported = False
            return
        if gpu.energy_mj is None:
            return
        self.supported = True
        if self.readings and (gpu.energy_mj < self.readings[-1][1] or t <= self.readings[-1][0]):
            return  # a counter that went back (a driver reload) or a reading out of order
        reading = (t, gpu.energy_mj)
        if self.first is None:
            self.first = reading
        self.readings.append(reading)

    @property
    def joules(self) -> float | None:
        """Joules since the first reading (the job's use of this GPU, as far as it was read)."""
        if self.first is None or not self.readings:
            return None
        return (self.readings[-1][1] - self.first[1]) / 1000.0

    def span(
        self, training: TrainingState, start: float | None = None, end: float | None = None
    ) -> EnergySpan | None:
        """The energy between the first and the last reading in ``[start, end]``, over the
        steps that ended between them; ``None`` with fewer than two. Open at the start, it
        begins at the job's first reading, even once the bounded readings have let it go."""
        kept = [r for r in self.readings if _within(r[0], start, end)]
        if start is None and self.first is not None and kept and kept[0] != self.first:
            kept.insert(0, self.first)
        if len(kept) < 2:
            return None
        (t0, e0), (t1, e1) = kept[0], kept[-1]
        before, after = training.history.ended_by([t0, t1])
        return EnergySpan((e1 - e0) / 1000.0, t1 - t0, after - before)

    def intervals(
        self, training: TrainingState, start: float | None = None, end: float | None = None
    ) -> list[EnergySpan]:
        """The span between each two neighbouring readings in ``[start, end]``: what compare
        resamples for its interval."""
        kept = [r for r in self.readings if _within(r[0], start, end)]
        counts = training.history.ended_by([t for t, _ in kept])
        return [
            EnergySpan((b[1] - a[1]) / 1000.0, b[0] - a[0], nb - na)
            for a, b, na, nb in zip(kept, kept[1:], counts, counts[1:], strict=False)
        ]

    def recent(self, training: TrainingState) -> EnergySpan | None:
        """The last :data:`RECENT_ENERGY_S` of readings, or all of them where no step ended
        in that time; ``None`` with fewer than two readings."""
        if not self.readings:
            return None
        recent = self.span(training, self.readings[-1][0] - RECENT_ENERGY_S)
        if recent is not None and recent.steps:
            return recent
        return self.span(training)


def _within(t: float, start: float | None, end: float | None) -> bool:
    return (start is None or t >= start) and (end is None or t <= end)


def fold_gpu_energy(
    energy: dict[tuple[int | None, int], GpuEnergy], t: float, gpus: list[GpuStats]
) -> None:
    """One GPU reading into ``energy``: the job's GPUs (all of them while the agent cannot
    tell), each whole GPU and MIG instance apart."""
    for gpu in gpus:
        if gpu.in_job is False:
            continue
        key = gpu_key(gpu)
        entry = energy.get(key)
        if entry is None:
            entry = energy[key] = GpuEnergy(gpu_name(gpu))
        entry.observe(t, gpu)
