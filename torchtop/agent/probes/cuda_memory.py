"""CUDA memory as PyTorch's caching allocator sees it, per device.

The probe must never change the job: it does not initialize CUDA, does not create a context on
a device, and does not touch CUDA before the job has. ``torch.cuda.memory_stats()`` only reads
the allocator's counters, so it is safe on any device; ``mem_get_info()`` makes the device
current, which creates a context on a device that has none, so it is called only for devices
whose allocator has reserved memory at some point (and so already has a context).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from torchtop.agent.probes.base import ProbeUnavailable
from torchtop.protocol import DeviceInfo, MemoryStats

#: ``MemoryStats.source`` for numbers from the CUDA caching allocator.
SOURCE_CUDA = "cuda-allocator"


class CudaModule(Protocol):
    """The part of ``torch.cuda`` the probe uses, so tests can pass a fake."""

    def is_available(self) -> bool: ...

    def is_initialized(self) -> bool: ...

    def device_count(self) -> int: ...

    def memory_stats(self, device: int) -> Mapping[str, Any]: ...

    def mem_get_info(self, device: int) -> tuple[int, int]: ...

    def get_device_name(self, device: int) -> str: ...


class CudaMemoryProbe:
    """Reads :class:`~torchtop.protocol.MemoryStats` for each CUDA device the job uses.

    ``cuda`` is the ``torch.cuda`` module (imported on first use) or a fake with the functions
    of :class:`CudaModule`. ``read()`` returns an empty list until the job itself has initialized
    CUDA.
    """

    def __init__(
        self, cuda: object | None = None, handled_ooms: Callable[[str], int] | None = None
    ) -> None:
        self._cuda: Any = cuda
        #: Failures torch handled itself, per device (the OOM capture counts them).
        self.handled_ooms = handled_ooms
        self._uuids: list[str | None] | None = None

    def _module(self) -> Any:
        if self._cuda is None:
            try:
                import torch.cuda
            except Exception as exc:  # ImportError, or OSError for a broken install
                raise ProbeUnavailable(f"CUDA memory not available: {exc}") from None
            self._cuda = torch.cuda
        return self._cuda

    def read(self) -> list[MemoryStats]:
        """One ``MemoryStats`` per device whose allocator has reserved memory, in index order."""
        cuda = self._module()
        try:
            # is_initialized() is a flag check; is_available() would call cuInit on its own.
            if not cuda.is_initialized() or not cuda.is_available():
                return []
            count = int(cuda.device_count())
        except Exception:
            return []
        result = []
        for index in range(count):
            stats = self._read_device(cuda, index)
            if stats is not None:
                result.append(stats)
        return result

    def _read_device(self, cuda: Any, index: int) -> MemoryStats | None:
        try:
            stats: Mapping[str, Any] = cuda.memory_stats(index)
        except Exception:
            return None
        reserved = _int(stats, "reserved_bytes.all.current")
        reserved_peak = _int(stats, "reserved_bytes.all.peak")
        if not reserved and not reserved_peak:
            # The job has never allocated here, so the device may have no context: leave it be.
            return None
        free: int | None
        total: int | None
        try:
            free_raw, total_raw = cuda.mem_get_info(index)
            free, total = int(free_raw), int(total_raw)
        except Exception:
            free = total = None
        cap = _cap(cuda, index, total)
        if cap is not None and free is not None:
            # Under set_per_process_memory_fraction the allocator's limit is the cap.
            total, free = cap, free_under_cap(free, cap, reserved)
        handled: int | None = None
        if self.handled_ooms is not None:
            try:
                handled = int(self.handled_ooms(f"cuda:{index}"))
            except Exception:
                handled = None
        return MemoryStats(
            device=f"cuda:{index}",
            source=SOURCE_CUDA,
            allocated_bytes=_int(stats, "allocated_bytes.all.current"),
            reserved_bytes=reserved,
            active_bytes=_int(stats, "active_bytes.all.current"),
            inactive_split_bytes=_int(stats, "inactive_split_bytes.all.current"),
            peak_allocated_bytes=_int(stats, "allocated_bytes.all.peak"),
            peak_reserved_bytes=reserved_peak,
            num_alloc_retries=_int(stats, "num_alloc_retries"),
            num_ooms=_int(stats, "num_ooms"),
            free_bytes=free,
            total_bytes=total,
            handled_ooms=handled,
        )

    def devices(self) -> list[DeviceInfo]:
        """The CUDA devices the job can use, for the ``hello`` message.

        Before the job initializes CUDA the count comes from NVML alone
        (``torch.cuda._device_count_nvml``, which reads ``CUDA_VISIBLE_DEVICES``), never from
        ``device_count()``: where NVML cannot tell (MIG UUIDs, NVML errors), that falls back to
        ``cudaGetDeviceCount``, which initializes CUDA in the job and breaks the CUDA of its
        forked children. Then the list is empty until the job initializes CUDA, and the names
        are generic. Once CUDA is initialized, the real names, sizes and UUIDs are read from
        the device properties, which needs no context.
        """
        try:
            cuda = self._module()
        except ProbeUnavailable:
            return []
        try:
            initialized = bool(cuda.is_initialized())
            if initialized:
                if not cuda.is_available():
                    return []
                count = int(cuda.device_count())
            else:
                compiled = getattr(cuda, "_is_compiled", None)
                count_nvml = getattr(cuda, "_device_count_nvml", None)
                if count_nvml is None or (compiled is not None and not compiled()):
                    return []
                count = int(count_nvml())  # negative: NVML cannot tell; wait for the job
        except Exception:
            return []
        return [self._device_info(cuda, index, initialized) for index in range(max(0, count))]

    def job_uuids(self) -> list[str | None] | None:
        """The UUIDs of the job's CUDA devices in CUDA's order, once the job has initialized
        CUDA (``None`` before, or when the devices cannot be listed): what the NVML probe
        matches its GPUs to. ``None`` in the list is a device whose UUID is unknown. Kept
        once every UUID is known, since the devices a process sees are fixed from its CUDA
        initialization on; read again until then."""
        if self._uuids is not None or not self.cuda_initialized():
            return self._uuids
        uuids = [device.uuid for device in self.devices()]
        if uuids and all(uuids):
            self._uuids = uuids
        return uuids or None

    def cuda_initialized(self) -> bool:
        """Whether the job has initialized CUDA (a flag check: never initializes it)."""
        cuda = self._cuda if self._cuda is not None else sys.modules.get("torch.cuda")
        try:
            return cuda is not None and bool(cuda.is_initialized())
        except Exception:
            return False

    @staticmethod
    def _device_info(cuda: Any, index: int, initialized: bool) -> DeviceInfo:
        fallback = DeviceInfo(id=f"cuda:{index}", name=f"CUDA device {index}")
        if not initialized:
            return fallback
        try:
            properties = getattr(cuda, "get_device_properties", None)
            if properties is not None:
                props = properties(index)
                return DeviceInfo(
                    id=f"cuda:{index}",
                    name=str(props.name),
                    total_bytes=int(props.total_memory),
                    uuid=gpu_uuid(getattr(props, "uuid", None)),
                    capability=_capability(props),
                )
            return DeviceInfo(id=f"cuda:{index}", name=str(cuda.get_device_name(index)))
        except Exception:
            return fallback


def free_under_cap(free: int, cap: int, reserved: int | None) -> int:
    """What the job may still get under a cap on its memory (``set_per_process_memory_fraction``):
    the cap less what its allocator holds, however much the device has free."""
    if reserved is None or cap <= 0:
        return free
    return min(free, max(0, cap - reserved))


def _cap(cuda: Any, index: int, total: int | None) -> int | None:
    """The allocator's limit on a device under ``set_per_process_memory_fraction`` (the
    fraction of the device's total), or ``None`` when no fraction below 1 is set."""
    fraction_of = getattr(cuda, "get_per_process_memory_fraction", None)
    if fraction_of is None or not total:
        return None
    try:
        fraction = float(fraction_of(index))
    except Exception:
        return None
    if not 0.0 < fraction < 1.0:
        return None
    return int(fraction * total)


def _capability(props: Any) -> str | None:
    major, minor = getattr(props, "major", None), getattr(props, "minor", None)
    if isinstance(major, int) and isinstance(minor, int):
        return f"{major}.{minor}"
    return None


def gpu_uuid(value: Any) -> str | None:
    """A device property's UUID spelled as NVML and DCGM spell it: ``GPU-`` and 32 hex digits
    in 8-4-4-4-12 groups (torch prints the bare groups)."""
    if value is None:
        return None
    try:
        text = str(value).strip()
    except Exception:
        return None
    if text.startswith(("GPU-", "MIG-")):
        return text
    digits = text.replace("-", "")
    if len(digits) != 32 or any(c not in "0123456789abcdefABCDEF" for c in digits):
        return None
    d = digits.lower()
    return f"GPU-{d[:8]}-{d[8:12]}-{d[12:16]}-{d[16:20]}-{d[20:]}"


def _int(stats: Mapping[str, Any], key: str) -> int | None:
    value = stats.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value
