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
from dataclasses import dataclass, field, replace
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

    def energy_mj(self, handle: object) -> int:
        """Millijoules the GPU has used since the driver was loaded (monotonic; NVML updates it
        about every 100 ms). Raises ``not_supported`` on GPUs older than Volta and MIG instances."""
        ...

    def clocks(self, handle: object) -> tuple[int, int]:
        """SM and memory clocks in MHz."""
        ...

    def processes(self, handle: object) -> list[tuple[int, int | None]]:
        """``(pid, bytes used or None)`` for each process with a context on the GPU."""
        ...

    def uuid(self, handle: object) -> str:
        """The GPU's UUID, ``GPU-…`` (``MIG-…`` for a MIG instance)."""
        ...

    def mig_instances(self, handle: object) -> list[object]:
        """Handles of the GPU's MIG instances; empty when MIG mode is off or unsupported."""
        ...

    def driver_version(self) -> str:
        """The NVIDIA driver's version, e.g. ``580.95.05``."""
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

    def energy_mj(self, handle: object) -> int:
        return int(self._call(self._nvml.nvmlDeviceGetTotalEnergyConsumption, handle))

    def clocks(self, handle: object) -> tuple[int, int]:
        nvml = self._nvml
        sm = self._call(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM)
        memory = self._call(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_MEM)
        return int(sm), int(memory)

    def processes(self, handle: object) -> list[tuple[int, int | None]]:
        # Compute contexts are what a training job has; graphics ones are listed as well so the
        # view of who shares the GPU is whole. A process can be in both lists: it counts once.
        # The unversioned calls ask for the newest struct (_v3); a driver without it makes
        # pynvml raise NVMLLibraryMismatchError, and the _v2 calls are asked instead.
        nvml = self._nvml
        found: dict[int, int | None] = {}
        failures: list[NvmlCallError] = []
        for name in (
            "nvmlDeviceGetComputeRunningProcesses",
            "nvmlDeviceGetGraphicsRunningProcesses",
        ):
            try:
                try:
                    listed = self._call(getattr(nvml, name), handle)
                except NvmlCallError as exc:
                    older = getattr(nvml, f"{name}_v2", None)
                    if exc.code != "not_supported" or older is None:
                        raise
                    listed = self._call(older, handle)
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

    def uuid(self, handle: object) -> str:
        value = self._call(self._nvml.nvmlDeviceGetUUID, handle)
        return value.decode(errors="replace") if isinstance(value, bytes) else str(value)

    def driver_version(self) -> str:
        value = self._call(self._nvml.nvmlSystemGetDriverVersion)
        return value.decode(errors="replace") if isinstance(value, bytes) else str(value)

    def mig_instances(self, handle: object) -> list[object]:
        nvml = self._nvml
        try:
            current, _pending = self._call(nvml.nvmlDeviceGetMigMode, handle)
        except NvmlCallError as exc:
            if exc.code == "gpu_lost":
                raise
            return []  # no MIG on this GPU (or this driver)
        if current != nvml.NVML_DEVICE_MIG_ENABLE:
            return []
        instances: list[object] = []
        for slot in range(int(self._call(nvml.nvmlDeviceGetMaxMigDeviceCount, handle))):
            try:
                instances.append(self._call(nvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, slot))
            except NvmlCallError as exc:
                if exc.code == "gpu_lost":
                    raise
                # NOT_FOUND: no instance in this slot.
        return instances

    def _call(self, function: Callable[..., _T], *args: object) -> _T:
        nvml = self._nvml
        if nvml is None:
            raise NvmlCallError("other", "NVML is not initialized")
        mismatch = getattr(nvml, "NVMLLibraryMismatchError", None)
        try:
            return function(*args)
        except nvml.NVMLError as exc:
            raise NvmlCallError(_error_code(nvml, exc), str(exc)) from None
        except Exception as exc:
            # Not an NVMLError: pynvml's unversioned calls raise NVMLLibraryMismatchError
            # when the driver lacks the struct version they ask for.
            if mismatch is not None and isinstance(exc, mismatch):
                raise NvmlCallError("not_supported", str(exc)) from None
            raise


def _error_code(nvml: Any, exc: Any) -> NvmlErrorCode:
    value = getattr(exc, "value", None)
    if value in (nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_FUNCTION_NOT_FOUND):
        # A function missing from an older driver is as final as one the GPU does not support.
        return "not_supported"
    if value in _lost_codes(nvml):
        # Off the bus, in need of a reset, or gone from the system: the GPU will not answer
        # again in this process.
        return "gpu_lost"
    if value == nvml.NVML_ERROR_NO_PERMISSION:
        return "no_permission"
    return "other"


def _lost_codes(nvml: Any) -> tuple[Any, ...]:
    """NVML's codes for a GPU that will not answer again: off the bus, needing a reset, gone."""
    names = ("NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_RESET_REQUIRED", "NVML_ERROR_GPU_NOT_FOUND")
    return tuple(getattr(nvml, name) for name in names if hasattr(nvml, name))


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
    uuid: str | None = None
    #: For a MIG instance, its parent's NVML index.
    mig_parent: int | None = None
    #: For a GPU, its MIG instances (``None`` until looked for; empty without MIG).
    instances: list[_Gpu] | None = None


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
        job_uuids: Callable[[], list[str | None] | None] | None = None,
    ) -> None:
        self._backend: NvmlBackend = backend if backend is not None else PynvmlBackend()
        #: The UUIDs of the job's CUDA devices in CUDA's order (``cuda:0`` first), once the job
        #: has initialized CUDA; ``None`` before.
        self._job_uuids = job_uuids
        self._process_interval_s = process_interval_s
        self._clock = clock
        self._gpus: list[_Gpu] | None = None
        self._failure: str | None = None
        self._initialized = False
        self._closed = False

    def read(self) -> list[GpuStats]:
        """One ``GpuStats`` per GPU, each followed by its MIG instances. Once the job has
        initialized CUDA, GPUs are matched to its devices by UUID (NVML orders them by PCI
        bus and ignores ``CUDA_VISIBLE_DEVICES``; CUDA puts the fastest first): the job's come
        first in CUDA's order with ``cuda_device`` set, the others after, ``in_job=False``.

        Raises :class:`ProbeUnavailable` when NVML cannot be started (then and on every later
        call, without trying again) or after :meth:`close`.
        """
        if self._closed:
            raise ProbeUnavailable("NVML probe is closed")
        if self._failure is not None:
            raise ProbeUnavailable(self._failure)
        if self._gpus is None:
            self._gpus = self._start()
        rows: list[GpuStats] = []
        for gpu in self._gpus:
            rows.append(self._read_gpu(gpu))
            rows.extend(self._read_gpu(instance) for instance in self._instances(gpu))
        return self._matched(rows)

    def _instances(self, gpu: _Gpu) -> list[_Gpu]:
        """The GPU's MIG instances, looked for once."""
        if gpu.instances is None and not gpu.lost and gpu.handle is not None:
            handles = self._call(gpu, "mig", self._backend.mig_instances, gpu.handle)
            gpu.instances = [
                _Gpu(slot, handle=handle, mig_parent=gpu.index)
                for slot, handle in enumerate(handles or [])
            ]
            if gpu.instances:
                # A GPU in MIG mode reports no utilization of its own; that is its mode, not
                # the GPU's make: keep asking.
                gpu.unsupported.discard("utilization")
        if gpu.lost:
            return []
        return gpu.instances or []

    def _matched(self, rows: list[GpuStats]) -> list[GpuStats]:
        uuids: list[str | None] | None = None
        if self._job_uuids is not None:
            with contextlib.suppress(Exception):
                uuids = self._job_uuids()
        return matched(rows, uuids)

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
            return self._lost(gpu)
        backend = self._backend
        try:
            if gpu.handle is None:
                gpu.handle = self._call(gpu, "handle", backend.handle, gpu.index)
                if gpu.handle is None:
                    return GpuStats(index=gpu.index, name=None)
            handle = gpu.handle
            if gpu.name is None:
                gpu.name = self._call(gpu, "name", backend.name, handle)
            if gpu.uuid is None:
                gpu.uuid = self._call(gpu, "uuid", backend.uuid, handle)
            if gpu.instances:
                gpu.unsupported.discard("utilization")
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
                energy_mj=(energy := _int(self._call(gpu, "energy", backend.energy_mj, handle))),
                energy_supported=(
                    False if "energy" in gpu.unsupported else True if energy is not None else None
                ),
                clock_sm_mhz=None if clocks is None else int(clocks[0]),
                clock_memory_mhz=None if clocks is None else int(clocks[1]),
                processes=self._processes(gpu, handle),
                uuid=gpu.uuid,
                mig_parent=gpu.mig_parent,
            )
        except _GpuLost:
            gpu.lost = True
            gpu.handle = None
            gpu.processes = None
            return self._lost(gpu)
        return stats

    @staticmethod
    def _lost(gpu: _Gpu) -> GpuStats:
        return GpuStats(
            index=gpu.index, name=gpu.name, lost=True, uuid=gpu.uuid, mig_parent=gpu.mig_parent
        )

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


def matched(rows: list[GpuStats], uuids: list[str | None] | None) -> list[GpuStats]:
    """``rows`` with the job's GPUs first, in CUDA's order (``uuids``: its devices' UUIDs,
    ``cuda:0`` first; ``None`` before it initialized CUDA), ``cuda_device`` and ``in_job`` set."""
    cuda_index = {uuid_key(u): i for i, u in enumerate(uuids or ()) if u}
    if not cuda_index:
        return rows  # no usable UUID: which GPUs are the job's is unknown
    # A device whose UUID is unknown may be any GPU not matched, and a GPU whose UUID NVML
    # cannot read may be any device: those stay unknown.
    unmatched = False if uuids and all(uuids) else None
    job: list[tuple[int, GpuStats]] = []
    others: list[GpuStats] = []
    for row in rows:
        index = cuda_index.get(uuid_key(row.uuid)) if row.uuid else None
        if index is None:
            others.append(replace(row, in_job=unmatched if row.uuid else None))
        else:
            job.append((index, replace(row, in_job=True, cuda_device=f"cuda:{index}")))
    job.sort(key=lambda pair: pair[0])
    return [row for _, row in job] + others


def uuid_key(uuid: str | None) -> str:
    """A UUID's 32 hex digits: NVML writes ``GPU-``/``MIG-`` before them, torch does not."""
    text = (uuid or "").strip().lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            text = text[len(prefix) :]
    return text.replace("-", "")


def _float(value: float | None) -> float | None:
    return None if value is None else float(value)


def _int(value: int | None) -> int | None:
    return None if value is None else int(value)
