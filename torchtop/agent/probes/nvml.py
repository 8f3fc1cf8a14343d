"""NVIDIA GPUs as NVML sees them: utilization, memory, temperature, power, clocks, processes.

NVML sees the whole GPU, every process on it included, where the CUDA memory probe sees only
this job's allocator. The probe talks to NVML through a small :class:`NvmlBackend` so that tests
can run every scenario (several GPUs, a call a GPU does not support, a GPU that falls off the
bus, no driver at all) without one; :class:`PynvmlBackend` is the real one.

What a GPU cannot report (a consumer card without power readings, a process list hidden by
permissions) is ``None`` and the other fields still come through. A call the GPU does not support
is not asked again. A GPU that NVML reports lost stays lost: every later read returns it with
``lost=True`` and nothing else, without calling NVML for it again.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

from torchtop.agent.probes.base import ProbeUnavailable
from torchtop.protocol import GpuProcess, GpuStats

NvmlErrorCode = Literal["not_supported", "gpu_lost", "no_permission", "other"]

_T = TypeVar("_T")


class NvmlCallError(Exception):
    """An NVML call failed. ``code`` says how, in the few cases the probe treats differently."""

    def __init__(self, code: NvmlErrorCode, detail: str = "") -> None:
        super().__init__(f"{code}: {detail}" if detail else code)
        self.code: NvmlErrorCode = code
        self.detail = detail


class NvmlBackend(Protocol):
    """The NVML calls the probe makes. Every call but ``init`` raises :class:`NvmlCallError`.

    ``init`` raises :class:`ProbeUnavailable` when NVML cannot be used at all. A handle is
    whatever the backend uses to name a GPU; the probe only passes it back.
    """

    def init(self) -> None: ...

    def shutdown(self) -> None: ...

    def device_count(self) -> int: ...

    def handle(self, index: int) -> object: ...

    def name(self, handle: object) -> str: ...

    def utilization(self, handle: object) -> tuple[float, float]:
        """Percent of time the GPU was busy, and percent of time its memory was read or written."""
        ...

    def memory(self, handle: object) -> tuple[int, int]:
        """Bytes used and total on the GPU, all processes together."""
        ...

    def temperature(self, handle: object) -> float:
        """Degrees Celsius of the GPU die."""
        ...

    def power_w(self, handle: object) -> float: ...

    def power_limit_w(self, handle: object) -> float: ...

    def clocks(self, handle: object) -> tuple[int, int]:
        """SM and memory clocks in MHz."""
        ...

    def processes(self, handle: object) -> list[tuple[int, int | None]]:
        """``(pid, bytes used or None)`` for each process with a context on the GPU."""
        ...


# --------------------------------------------------------------------------------------------
# The real backend
# --------------------------------------------------------------------------------------------


class PynvmlBackend:
    """:class:`NvmlBackend` on ``pynvml`` (the nvidia-ml-py package), imported on ``init``."""

    def __init__(self) -> None:
        self._nvml: Any = None

    def init(self) -> None:
        try:
            import pynvml
        except ImportError as exc:
            raise ProbeUnavailable(
                f"NVML not available: the nvidia-ml-py package is not installed ({exc})"
            ) from None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise ProbeUnavailable(f"NVML not available: {_init_reason(pynvml, exc)}") from None
        except OSError as exc:
            raise ProbeUnavailable(f"NVML not available: {exc}") from None
        self._nvml = pynvml

    def shutdown(self) -> None:
        if self._nvml is not None:
            self._call(self._nvml.nvmlShutdown)
            self._nvml = None

    def device_count(self) -> int:
        return int(self._call(self._nvml.nvmlDeviceGetCount))

    def handle(self, index: int) -> object:
        handle: object = self._call(self._nvml.nvmlDeviceGetHandleByIndex, index)
        return handle

    def name(self, handle: object) -> str:
        name = self._call(self._nvml.nvmlDeviceGetName, handle)
        # Older nvidia-ml-py releases return bytes.
        return name.decode(errors="replace") if isinstance(name, bytes) else str(name)

    def utilization(self, handle: object) -> tuple[float, float]:
        rates = self._call(self._nvml.nvmlDeviceGetUtilizationRates, handle)
        return float(rates.gpu), float(rates.memory)

    def memory(self, handle: object) -> tuple[int, int]:
        info = self._call(self._nvml.nvmlDeviceGetMemoryInfo, handle)
        return int(info.used), int(info.total)

    def temperature(self, handle: object) -> float:
        nvml = self._nvml
        return float(self._call(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU))

    def power_w(self, handle: object) -> float:
        return float(self._call(self._nvml.nvmlDeviceGetPowerUsage, handle)) / 1000.0

    def power_limit_w(self, handle: object) -> float:
        return float(self._call(self._nvml.nvmlDeviceGetEnforcedPowerLimit, handle)) / 1000.0

    def clocks(self, handle: object) -> tuple[int, int]:
        nvml = self._nvml
        sm = self._call(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM)
        memory = self._call(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_MEM)
        return int(sm), int(memory)

    def processes(self, handle: object) -> list[tuple[int, int | None]]:
        # Compute contexts are what a training job has; graphics ones are listed as well so the
        # view of who shares the GPU is whole. A process can be in both lists: it counts once.
        nvml = self._nvml
        found: dict[int, int | None] = {}
        failures: list[NvmlCallError] = []
        for getter in (
            nvml.nvmlDeviceGetComputeRunningProcesses,
            nvml.nvmlDeviceGetGraphicsRunningProcesses,
        ):
            try:
                listed = self._call(getter, handle)
            except NvmlCallError as exc:
                if exc.code == "gpu_lost":
                    raise
                failures.append(exc)
                continue
            for process in listed:
                used = process.usedGpuMemory
                found.setdefault(int(process.pid), None if used is None else int(used))
        if len(failures) == 2:
            raise failures[0]
        return list(found.items())

    def _call(self, function: Callable[..., _T], *args: object) -> _T:
        nvml = self._nvml
        if nvml is None:
            raise NvmlCallError("other", "NVML is not initialized")
        try:
            return function(*args)
        except nvml.NVMLError as exc:
            raise NvmlCallError(_error_code(nvml, exc), str(exc)) from None


def _error_code(nvml: Any, exc: Any) -> NvmlErrorCode:
    value = getattr(exc, "value", None)
    if value in (nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_FUNCTION_NOT_FOUND):
        # A function missing from an older driver is as final as one the GPU does not support.
        return "not_supported"
    if value == nvml.NVML_ERROR_GPU_IS_LOST:
        return "gpu_lost"
    if value == nvml.NVML_ERROR_NO_PERMISSION:
        return "no_permission"
    return "other"


def _init_reason(nvml: Any, exc: Any) -> str:
    value = getattr(exc, "value", None)
    if value == nvml.NVML_ERROR_LIBRARY_NOT_FOUND:
        return "libnvidia-ml.so.1 not found (no NVIDIA driver on this machine)"
    if value == nvml.NVML_ERROR_DRIVER_NOT_LOADED:
        return "the NVIDIA driver is not loaded"
    if value == nvml.NVML_ERROR_NO_PERMISSION:
        return "no permission to open the GPUs"
    return str(exc)


# --------------------------------------------------------------------------------------------
# The probe
# --------------------------------------------------------------------------------------------


class _GpuLost(Exception):
    """Internal: the GPU being read fell off the bus."""


@dataclass
class _Gpu:
    """What the probe remembers about one GPU between reads."""

    index: int
    handle: object | None = None
    name: str | None = None
    lost: bool = False
    #: Fields whose NVML call the GPU does not support; they are not asked again.
    unsupported: set[str] = field(default_factory=set)
    processes: list[GpuProcess] | None = None
    processes_read_at: float | None = None


class NvmlProbe:
    """Reads :class:`~torchtop.protocol.GpuStats` for every GPU NVML sees.

    NVML is initialized on the first ``read()``, in the sampler thread, so constructing the
    probe costs nothing and a machine without NVIDIA GPUs finds out only when the sampler asks.
    The process list costs far more than the other calls (NVML asks the driver about every
    context), so it is read at most once every ``process_interval_s`` per GPU and the last list
    is repeated in between; it is ``None`` until first read. ``clock`` is injectable for tests.
    """

    def __init__(
        self,
        backend: NvmlBackend | None = None,
        process_interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._backend: NvmlBackend = backend if backend is not None else PynvmlBackend()
        self._process_interval_s = process_interval_s
        self._clock = clock
        self._gpus: list[_Gpu] | None = None
        self._failure: str | None = None
        self._initialized = False
        self._closed = False

    def read(self) -> list[GpuStats]:
        """One ``GpuStats`` per GPU, in NVML's index order.

        Raises :class:`ProbeUnavailable` when NVML cannot be started (then and on every later
        call, without trying again) or after :meth:`close`.
        """
        if self._closed:
            raise ProbeUnavailable("NVML probe is closed")
        if self._failure is not None:
            raise ProbeUnavailable(self._failure)
        if self._gpus is None:
            self._gpus = self._start()
        return [self._read_gpu(gpu) for gpu in self._gpus]

    def close(self) -> None:
        """Shut NVML down if it was started. Later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        self._shutdown()

    def _start(self) -> list[_Gpu]:
        backend = self._backend
        try:
            backend.init()
        except ProbeUnavailable as exc:
            self._failure = str(exc)
            raise
        except Exception as exc:
            self._failure = f"NVML not available: {exc}"
            raise ProbeUnavailable(self._failure) from None
        self._initialized = True
        try:
            count = int(backend.device_count())
        except Exception as exc:
            self._failure = f"NVML could not count the GPUs: {exc}"
        else:
            if count > 0:
                return [_Gpu(index) for index in range(count)]
            self._failure = "NVML found no NVIDIA GPUs"
        self._shutdown()
        raise ProbeUnavailable(self._failure)

    def _shutdown(self) -> None:
        if self._initialized:
            self._initialized = False
            # Shutting down is best effort: the process may be exiting.
            with contextlib.suppress(Exception):
                self._backend.shutdown()

    def _read_gpu(self, gpu: _Gpu) -> GpuStats:
        if gpu.lost:
            return GpuStats(index=gpu.index, name=gpu.name, lost=True)
        backend = self._backend
        try:
            if gpu.handle is None:
                gpu.handle = self._call(gpu, "handle", backend.handle, gpu.index)
                if gpu.handle is None:
                    return GpuStats(index=gpu.index, name=None)
            handle = gpu.handle
            if gpu.name is None:
                gpu.name = self._call(gpu, "name", backend.name, handle)
            util = self._call(gpu, "utilization", backend.utilization, handle)
            memory = self._call(gpu, "memory", backend.memory, handle)
            clocks = self._call(gpu, "clocks", backend.clocks, handle)
            stats = GpuStats(
                index=gpu.index,
                name=gpu.name,
                util_gpu_percent=None if util is None else float(util[0]),
                util_memory_percent=None if util is None else float(util[1]),
                memory_used_bytes=None if memory is None else int(memory[0]),
                memory_total_bytes=None if memory is None else int(memory[1]),
                temperature_c=_float(self._call(gpu, "temperature", backend.temperature, handle)),
                power_w=_float(self._call(gpu, "power", backend.power_w, handle)),
                power_limit_w=_float(self._call(gpu, "power_limit", backend.power_limit_w, handle)),
                clock_sm_mhz=None if clocks is None else int(clocks[0]),
                clock_memory_mhz=None if clocks is None else int(clocks[1]),
                processes=self._processes(gpu, handle),
            )
        except _GpuLost:
            gpu.lost = True
            gpu.handle = None
            gpu.processes = None
            return GpuStats(index=gpu.index, name=gpu.name, lost=True)
        return stats

    def _processes(self, gpu: _Gpu, handle: object) -> list[GpuProcess] | None:
        now = self._clock()
        due = gpu.processes_read_at is None or now - gpu.processes_read_at >= (
            self._process_interval_s
        )
        if due and "processes" not in gpu.unsupported:
            gpu.processes_read_at = now
            listed = self._call(gpu, "processes", self._backend.processes, handle)
            gpu.processes = (
                None
                if listed is None
                else [GpuProcess(pid=int(pid), used_bytes=used) for pid, used in listed]
            )
        return gpu.processes

    @staticmethod
    def _call(gpu: _Gpu, key: str, function: Callable[..., _T], *args: object) -> _T | None:
        """One backend call: its value, or ``None`` when it fails. A lost GPU raises _GpuLost."""
        if key in gpu.unsupported:
            return None
        try:
            return function(*args)
        except NvmlCallError as exc:
            if exc.code == "gpu_lost":
                raise _GpuLost from None
            if exc.code == "not_supported":
                gpu.unsupported.add(key)
            return None
        except Exception:
            # A backend that breaks its contract costs this field, never the sampler thread.
            return None


def _float(value: float | None) -> float | None:
    return None if value is None else float(value)
