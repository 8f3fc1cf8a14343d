"""A fake NVML backend with scenarios, for testing the NVML probe without a GPU.

A scenario is a list of :class:`FakeGpu` plus how things go wrong: a field a GPU does not
support, a GPU that is lost after some reads, or NVML failing to start. Every call is counted
per method and GPU, so a test can assert what the probe asked for and how often.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from torchtop.agent.probes.base import ProbeUnavailable
from torchtop.agent.probes.nvml import NvmlCallError, NvmlErrorCode

GIB = 1 << 30
MIB = 1 << 20


@dataclass
class FakeGpu:
    """One GPU's readings. ``fail`` maps a method name to the error code that method raises."""

    name: str = "NVIDIA H200"
    util_gpu: float = 97.0
    util_memory: float = 61.0
    memory_used: int = 118_562 * MIB
    # An H200 reports 143771 MiB in nvidia-smi.
    memory_total: int = 143_771 * MIB
    temperature: float = 64.0
    power_w: float = 612.4
    power_limit_w: float = 700.0
    clock_sm_mhz: int = 1980
    clock_memory_mhz: int = 3201
    processes: list[tuple[int, int | None]] = field(
        default_factory=lambda: [(4242, 117_800 * MIB), (4310, 532 * MIB)]
    )
    fail: dict[str, NvmlErrorCode] = field(default_factory=dict)
    #: After this many ``utilization`` calls (the first call of each read) every call on this
    #: GPU raises ``gpu_lost``, as NVML does once a GPU has fallen off the bus.
    lost_after_reads: int | None = None


class FakeNvmlBackend:
    """An :class:`~torchtop.agent.probes.nvml.NvmlBackend` over a list of :class:`FakeGpu`."""

    def __init__(self, gpus: list[FakeGpu] | None = None, init_error: str | None = None) -> None:
        self.gpus = gpus if gpus is not None else [FakeGpu(), FakeGpu(util_gpu=12.0)]
        self.init_error = init_error
        #: Calls per ``(method, gpu index)``; ``gpu index`` is -1 for calls not about a GPU.
        self.calls: Counter[tuple[str, int]] = Counter()
        self.initialized = False

    # Scenarios ------------------------------------------------------------------------------

    @classmethod
    def two_h200(cls) -> FakeNvmlBackend:
        """Two busy H200s in one job."""
        return cls([FakeGpu(), FakeGpu(util_gpu=88.0, memory_used=97_001 * MIB, power_w=548.9)])

    @classmethod
    def power_not_supported(cls) -> FakeNvmlBackend:
        """GPU 1 has no power readings (as on some consumer and virtualized GPUs)."""
        return cls(
            [
                FakeGpu(),
                FakeGpu(
                    name="NVIDIA GeForce RTX 3090",
                    memory_total=24_576 * MIB,
                    memory_used=20_011 * MIB,
                    fail={"power_w": "not_supported", "power_limit_w": "not_supported"},
                ),
            ]
        )

    @classmethod
    def gpu_lost(cls, after_reads: int = 2) -> FakeNvmlBackend:
        """GPU 1 falls off the bus after ``after_reads`` reads."""
        return cls([FakeGpu(), FakeGpu(lost_after_reads=after_reads)])

    @classmethod
    def library_not_found(cls) -> FakeNvmlBackend:
        """No NVIDIA driver on the machine."""
        return cls([], init_error="NVML not available: libnvidia-ml.so.1 not found")

    # Counting -------------------------------------------------------------------------------

    def count(self, method: str, index: int = -1) -> int:
        """How many times ``method`` was called for GPU ``index`` (or, with -1, in all)."""
        if index >= 0:
            return self.calls[(method, index)]
        return sum(n for (name, _), n in self.calls.items() if name == method)

    # NvmlBackend ----------------------------------------------------------------------------

    def init(self) -> None:
        self.calls[("init", -1)] += 1
        if self.init_error is not None:
            raise ProbeUnavailable(self.init_error)
        self.initialized = True

    def shutdown(self) -> None:
        self.calls[("shutdown", -1)] += 1
        self.initialized = False

    def device_count(self) -> int:
        self.calls[("device_count", -1)] += 1
        return len(self.gpus)

    def handle(self, index: int) -> object:
        self.calls[("handle", index)] += 1
        if not 0 <= index < len(self.gpus):
            raise NvmlCallError("other", "invalid argument")
        return index

    def _gpu(self, method: str, handle: object) -> FakeGpu:
        assert self.initialized, f"{method} called before init or after shutdown"
        assert isinstance(handle, int)
        self.calls[(method, handle)] += 1
        gpu = self.gpus[handle]
        if gpu.lost_after_reads is not None and self.calls[("utilization", handle)] > (
            gpu.lost_after_reads
        ):
            raise NvmlCallError("gpu_lost", "GPU is lost")
        code = gpu.fail.get(method)
        if code is not None:
            raise NvmlCallError(code, f"{method} failed")
        return gpu

    def name(self, handle: object) -> str:
        return self._gpu("name", handle).name

    def utilization(self, handle: object) -> tuple[float, float]:
        gpu = self._gpu("utilization", handle)
        return gpu.util_gpu, gpu.util_memory

    def memory(self, handle: object) -> tuple[int, int]:
        gpu = self._gpu("memory", handle)
        return gpu.memory_used, gpu.memory_total

    def temperature(self, handle: object) -> float:
        return self._gpu("temperature", handle).temperature

    def power_w(self, handle: object) -> float:
        return self._gpu("power_w", handle).power_w

    def power_limit_w(self, handle: object) -> float:
        return self._gpu("power_limit_w", handle).power_limit_w

    def clocks(self, handle: object) -> tuple[int, int]:
        gpu = self._gpu("clocks", handle)
        return gpu.clock_sm_mhz, gpu.clock_memory_mhz

    def processes(self, handle: object) -> list[tuple[int, int | None]]:
        return list(self._gpu("processes", handle).processes)
