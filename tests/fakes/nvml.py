"""A fake NVML backend with scenarios, for testing the NVML probe without a GPU.

A scenario is a list of :class:`FakeGpu` plus how things go wrong: a field a GPU does not
support, a GPU that is lost after some reads, or NVML failing to start. Every call is counted
per method and GPU, so a test can assert what the probe asked for and how often.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

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
    #: NVML's total energy counter at the fake clock's zero: millijoules since driver load.
    energy_mj_at_zero: int = 9_284_771_305
    #: The fake clock (seconds) that :meth:`FakeNvmlBackend.energy_mj` reads; a test moves it.
    clock_s: float = 0.0
    clock_sm_mhz: int = 1980
    clock_memory_mhz: int = 3201
    processes: list[tuple[int, int | None]] = field(
        default_factory=lambda: [(4242, 117_800 * MIB), (4310, 532 * MIB)]
    )
    fail: dict[str, NvmlErrorCode] = field(default_factory=dict)
    #: After this many ``utilization`` calls (the first call of each read) every call on this
    #: GPU raises ``gpu_lost``, as NVML does once a GPU has fallen off the bus.
    lost_after_reads: int | None = None
    #: NVML's UUID; ``GPU-`` and 8-4-4-4-12 hex digits (``MIG-`` for a MIG instance).
    uuid: str = ""
    #: In MIG mode, the GPU's instances (then the GPU itself reports no utilization).
    mig: list[FakeGpu] = field(default_factory=list)


def uuid_of(n: int, prefix: str = "GPU") -> str:
    """A UUID as NVML spells it, distinct per ``n`` (the GPU check's nvidia-smi fake spells
    GPU ``n`` the same way)."""
    return f"{prefix}-{n:08x}-aaaa-bbbb-cccc-dddddddddddd"


class FakeNvmlBackend:
    """An :class:`~torchtop.agent.probes.nvml.NvmlBackend` over a list of :class:`FakeGpu`."""

    def __init__(self, gpus: list[FakeGpu] | None = None, init_error: str | None = None) -> None:
        self.gpus = gpus if gpus is not None else [FakeGpu(), FakeGpu(util_gpu=12.0)]
        for index, gpu in enumerate(self.gpus):
            gpu.uuid = gpu.uuid or uuid_of(index)
            for slot, instance in enumerate(gpu.mig):
                instance.uuid = instance.uuid or uuid_of(100 * (index + 1) + slot, "MIG")
        self.init_error = init_error
        self.driver = "580.95.05"
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
                    fail={
                        "power_w": "not_supported",
                        "power_limit_w": "not_supported",
                        "energy_mj": "not_supported",
                    },
                ),
            ]
        )

    @classmethod
    def gpu_lost(cls, after_reads: int = 2) -> FakeNvmlBackend:
        """GPU 1 falls off the bus after ``after_reads`` reads."""
        return cls([FakeGpu(), FakeGpu(lost_after_reads=after_reads)])

    @classmethod
    def four_h100_out_of_cuda_order(cls) -> FakeNvmlBackend:
        """Four GPUs in NVML's (PCI bus) order; a job with ``CUDA_VISIBLE_DEVICES=2,0`` sees
        NVML's GPU 2 as ``cuda:0`` and GPU 0 as ``cuda:1``: :data:`JOB_CUDA_UUIDS`."""
        return cls([FakeGpu(name="NVIDIA H100 80GB HBM3", util_gpu=float(i)) for i in range(4)])

    @classmethod
    def mig_layout(cls) -> FakeNvmlBackend:
        """An A100 in MIG mode with two instances (3g.40gb and 2g.20gb), then an A100 without."""
        a100 = "NVIDIA A100-SXM4-80GB"
        instances = [
            FakeGpu(name=f"{a100} MIG 3g.40gb", memory_total=40_192 * MIB, memory_used=9 * GIB,
                    fail={"utilization": "not_supported", "power_w": "not_supported",
                          "power_limit_w": "not_supported", "energy_mj": "not_supported",
                          "temperature": "not_supported",
                          "clocks": "not_supported"}),
            FakeGpu(name=f"{a100} MIG 2g.20gb", memory_total=19_968 * MIB, memory_used=1 * GIB,
                    fail={"utilization": "not_supported", "power_w": "not_supported",
                          "power_limit_w": "not_supported", "energy_mj": "not_supported",
                          "temperature": "not_supported",
                          "clocks": "not_supported"}),
        ]  # fmt: skip
        parent = FakeGpu(name=a100, memory_total=81_920 * MIB, mig=instances)
        return cls([parent, FakeGpu(name=a100, memory_total=81_920 * MIB)])

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
        if isinstance(handle, tuple):  # a MIG instance: (parent, slot)
            parent, slot = handle
            self.calls[(method, 1000 * (parent + 1) + slot)] += 1
            instance = self.gpus[parent].mig[slot]
            code = instance.fail.get(method)
            if code is not None:
                raise NvmlCallError(code, f"{method} failed")
            return instance
        assert isinstance(handle, int)
        self.calls[(method, handle)] += 1
        gpu = self.gpus[handle]
        if method == "utilization" and gpu.mig:
            # A GPU in MIG mode has no utilization of its own (NVML: NOT_SUPPORTED).
            raise NvmlCallError("not_supported", "utilization in MIG mode")
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

    def energy_mj(self, handle: object) -> int:
        """The counter as NVML keeps it: monotonic millijoules since driver load, grown by
        ``power_w`` and updated on a 100 ms grid (a read between updates repeats the last)."""
        gpu = self._gpu("energy_mj", handle)
        updated_s = int(gpu.clock_s * 10) / 10
        return gpu.energy_mj_at_zero + round(gpu.power_w * updated_s * 1000)

    def clocks(self, handle: object) -> tuple[int, int]:
        gpu = self._gpu("clocks", handle)
        return gpu.clock_sm_mhz, gpu.clock_memory_mhz

    def processes(self, handle: object) -> list[tuple[int, int | None]]:
        return list(self._gpu("processes", handle).processes)

    def uuid(self, handle: object) -> str:
        return self._gpu("uuid", handle).uuid

    def driver_version(self) -> str:
        self.calls[("driver_version", -1)] += 1
        return self.driver

    def mig_instances(self, handle: object) -> list[object]:
        gpu = self._gpu("mig_instances", handle)
        assert isinstance(handle, int)
        return [(handle, slot) for slot in range(len(gpu.mig))]


#: The job's CUDA devices under ``CUDA_VISIBLE_DEVICES=2,0`` on
#: :meth:`FakeNvmlBackend.four_h100_out_of_cuda_order`, as torch spells them
#: (``str(get_device_properties(i).uuid)``: no ``GPU-``).
JOB_CUDA_UUIDS = [uuid_of(2)[4:], uuid_of(0)[4:]]


# -- pynvml itself, for the real backend -----------------------------------------------------


def fake_pynvml(**functions: Any) -> SimpleNamespace:
    """The real pynvml's errors and constants, with the device functions replaced."""
    import pynvml

    names = [n for n in dir(pynvml) if n.startswith(("NVML_", "NVMLError", "NVMLLibrary"))]
    namespace = SimpleNamespace(**{n: getattr(pynvml, n) for n in names})
    for name, function in functions.items():
        setattr(namespace, name, function)
    return namespace


def pynvml_error(code_name: str) -> Exception:
    """pynvml's exception for an NVML return code (``NVML_ERROR_RESET_REQUIRED``...)."""
    import pynvml

    error: Exception = pynvml.NVMLError(getattr(pynvml, code_name))
    return error


def library_mismatch() -> Exception:
    """What pynvml's unversioned process-list calls raise on a driver without the _v3
    struct: not an NVMLError (pynvml ``throwOnVersionMismatch``)."""
    import pynvml

    error: Exception = pynvml.NVMLLibraryMismatchError(
        "Unversioned function called and the pyNVML version does not match the NVML lib "
        "version. Either use matching pyNVML and NVML lib versions or use a versioned function "
        "such as nvmlDeviceGetComputeRunningProcesses_v2"
    )
    return error
