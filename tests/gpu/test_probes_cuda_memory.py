from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.conftest import cuda_available
from torchtop.agent.probes.cuda_memory import SOURCE_CUDA, CudaMemoryProbe, gpu_uuid

FIXTURES = Path(__file__).parents[1] / "fixtures"
GIB = 1 << 30
H200_TOTAL = 150_754_820_096


def fixture(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / f"cuda_memory_stats_{name}.json").read_text())
    return data


class FakeCuda:
    """A torch.cuda stand-in over recorded memory_stats() dicts, one per device."""

    def __init__(
        self,
        stats: list[dict[str, Any]],
        *,
        available: bool = True,
        initialized: bool = True,
        free: int = 8 * GIB,
        names: list[str] | None = None,
    ) -> None:
        self.stats = stats
        self.available = available
        self.initialized = initialized
        self.free = free
        self.names = names or ["NVIDIA H200"] * len(stats)
        self.calls: Counter[tuple[str, int]] = Counter()
        self.nvml_count: int | None = None
        self.fail: set[tuple[str, int]] = set()

    def _count(self, name: str, device: int = -1) -> None:
        self.calls[(name, device)] += 1
        if (name, device) in self.fail:
            raise RuntimeError(f"{name}({device}) failed")

    def is_available(self) -> bool:
        self._count("is_available")
        return self.available

    def is_initialized(self) -> bool:
        self._count("is_initialized")
        return self.initialized

    def device_count(self) -> int:
        # torch.cuda.device_count(): before CUDA is initialized, NVML's count or, when NVML
        # cannot tell, cudaGetDeviceCount, which initializes the driver in the job.
        self._count("device_count")
        return len(self.stats)

    def _device_count_nvml(self) -> int:
        # NVML's count under CUDA_VISIBLE_DEVICES, or -1 when NVML cannot tell (MIG UUIDs in
        # CUDA_VISIBLE_DEVICES, no libnvidia-ml): torch.cuda._device_count_nvml.
        self._count("_device_count_nvml")
        return self.nvml_count if self.nvml_count is not None else len(self.stats)

    def memory_stats(self, device: int) -> dict[str, Any]:
        self._count("memory_stats", device)
        return dict(self.stats[device]) if self.initialized else {}

    def mem_get_info(self, device: int) -> tuple[int, int]:
        self._count("mem_get_info", device)
        return self.free, H200_TOTAL

    def get_device_name(self, device: int) -> str:
        self._count("get_device_name", device)
        return self.names[device]


class TorchUuid:
    """torch's ``_CUuuid``: prints the 16 bytes as bare 8-4-4-4-12 hex groups."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __str__(self) -> str:
        return self.text


#: What torch prints for an H200's ``get_device_properties(0).uuid``; NVML and DCGM's exporter
#: spell the same UUID with a ``GPU-`` prefix.
TORCH_UUID = "604ac76c-d9cf-fef3-62e9-d92044ab6e52"


class FakeCudaWithProperties(FakeCuda):
    def get_device_properties(self, device: int) -> SimpleNamespace:
        self._count("get_device_properties", device)
        return SimpleNamespace(
            name=self.names[device],
            total_memory=H200_TOTAL,
            uuid=TorchUuid(TORCH_UUID),
            major=9,  # an H200 is sm_90
            minor=0,
        )


# --- the fixtures themselves -----------------------------------------------------------------


def torch_key_set() -> set[str]:
    """The flat keys torch.cuda.memory_stats() returns on PyTorch 2.x (no private pools)."""
    arrays = (
        "active",
        "active_bytes",
        "allocated_bytes",
        "allocation",
        "inactive_split",
        "inactive_split_bytes",
        "requested_bytes",
        "reserved_bytes",
        "segment",
    )
    metrics = ("current", "peak", "allocated", "freed")
    keys = {
        f"{a}.{p}.{m}" for a in arrays for p in ("all", "large_pool", "small_pool") for m in metrics
    }
    keys |= {f"{s}.{m}" for s in ("oversize_allocations", "oversize_segments") for m in metrics}
    keys |= {
        "max_split_size",
        "num_alloc_retries",
        "num_device_alloc",
        "num_device_free",
        "num_oom_rejections",
        "num_ooms",
        "num_sync_all_streams",
    }
    return keys


@pytest.mark.parametrize("name", ["idle_after_training", "after_oom", "untouched"])
def test_fixtures_have_torchs_flat_sorted_key_format(name: str) -> None:
    stats = fixture(name)
    assert set(stats) == torch_key_set()
    assert list(stats) == sorted(stats)  # memory_stats() sorts its keys
    assert all(isinstance(v, int) for v in stats.values())
    for prefix in ("allocated_bytes", "reserved_bytes", "active_bytes", "segment", "allocation"):
        for metric in ("current", "allocated", "freed"):
            pools = [stats[f"{prefix}.{p}.{metric}"] for p in ("large_pool", "small_pool")]
            assert stats[f"{prefix}.all.{metric}"] == sum(pools)
        for pool in ("all", "large_pool", "small_pool"):
            s = {
                m: stats[f"{prefix}.{pool}.{m}"] for m in ("current", "peak", "allocated", "freed")
            }
            assert s["peak"] >= s["current"] == s["allocated"] - s["freed"]
    for pool in ("all", "large_pool", "small_pool"):
        allocated = stats[f"allocated_bytes.{pool}.current"]
        active = stats[f"active_bytes.{pool}.current"]
        reserved = stats[f"reserved_bytes.{pool}.current"]
        assert allocated <= active <= reserved


# --- reading --------------------------------------------------------------------------------


def test_maps_torchs_keys_for_an_idle_device_after_training() -> None:
    raw = fixture("idle_after_training")
    cuda = FakeCuda([raw], free=80 * GIB)
    (stats,) = CudaMemoryProbe(cuda).read()
    assert stats.device == "cuda:0"
    assert stats.source == SOURCE_CUDA
    assert stats.allocated_bytes == raw["allocated_bytes.all.current"] == 19_693_763_072
    assert stats.reserved_bytes == raw["reserved_bytes.all.current"] == 61_832_429_568
    assert stats.active_bytes == raw["active_bytes.all.current"]
    assert stats.inactive_split_bytes == raw["inactive_split_bytes.all.current"]
    assert stats.peak_allocated_bytes == raw["allocated_bytes.all.peak"]
    assert stats.peak_reserved_bytes == raw["reserved_bytes.all.peak"]
    assert stats.num_alloc_retries == 0 and stats.num_ooms == 0
    assert (stats.free_bytes, stats.total_bytes) == (80 * GIB, H200_TOTAL)
    # The story the fixture tells: most of the cache is not in use, some of it is fragmented.
    assert stats.allocated_bytes is not None and stats.reserved_bytes is not None
    assert stats.allocated_bytes < stats.reserved_bytes / 3
    assert stats.inactive_split_bytes is not None and stats.inactive_split_bytes > 3 * GIB


def test_reports_ooms_and_allocator_retries() -> None:
    (stats,) = CudaMemoryProbe(FakeCuda([fixture("after_oom")])).read()
    assert stats.num_ooms == 1
    assert stats.num_alloc_retries == 3
    assert stats.peak_reserved_bytes == 144_955_146_240
    assert stats.reserved_bytes is not None and stats.peak_reserved_bytes > stats.reserved_bytes


def test_nothing_before_the_job_initializes_cuda() -> None:
    cuda = FakeCuda([fixture("idle_after_training")], initialized=False)
    assert CudaMemoryProbe(cuda).read() == []
    # is_available() would run cuInit in the job; it must not even be asked.
    assert cuda.calls[("is_available", -1)] == 0
    assert cuda.calls[("memory_stats", 0)] == 0
    assert cuda.calls[("mem_get_info", 0)] == 0


def test_nothing_when_cuda_is_not_available() -> None:
    cuda = FakeCuda([fixture("idle_after_training")], available=False)
    assert CudaMemoryProbe(cuda).read() == []


def test_a_device_the_job_never_used_is_skipped_without_touching_it() -> None:
    cuda = FakeCuda([fixture("untouched"), fixture("after_oom"), fixture("untouched")])
    stats = CudaMemoryProbe(cuda).read()
    assert [s.device for s in stats] == ["cuda:1"]
    # mem_get_info would create a context on the unused devices.
    assert cuda.calls[("mem_get_info", 0)] == 0
    assert cuda.calls[("mem_get_info", 2)] == 0
    assert cuda.calls[("mem_get_info", 1)] == 1


def test_a_device_that_reserved_once_and_emptied_its_cache_is_still_read() -> None:
    raw = fixture("after_oom")
    for key in list(raw):
        if key.endswith(".current") and ("bytes" in key or key.startswith("segment")):
            raw[key] = 0
    (stats,) = CudaMemoryProbe(FakeCuda([raw])).read()
    assert stats.reserved_bytes == 0
    assert stats.peak_reserved_bytes == 144_955_146_240


def test_missing_keys_are_none() -> None:
    raw = fixture("idle_after_training")
    for key in ("active_bytes.all.current", "inactive_split_bytes.all.current", "num_ooms"):
        del raw[key]
    (stats,) = CudaMemoryProbe(FakeCuda([raw])).read()
    assert stats.active_bytes is None
    assert stats.inactive_split_bytes is None
    assert stats.num_ooms is None
    assert stats.allocated_bytes == raw["allocated_bytes.all.current"]


def test_free_and_total_are_none_when_mem_get_info_fails() -> None:
    cuda = FakeCuda([fixture("idle_after_training")])
    cuda.fail.add(("mem_get_info", 0))
    (stats,) = CudaMemoryProbe(cuda).read()
    assert stats.free_bytes is None and stats.total_bytes is None
    assert stats.allocated_bytes is not None


def test_a_device_whose_stats_fail_is_left_out() -> None:
    cuda = FakeCuda([fixture("after_oom"), fixture("idle_after_training")])
    cuda.fail.add(("memory_stats", 0))
    assert [s.device for s in CudaMemoryProbe(cuda).read()] == ["cuda:1"]


# --- devices --------------------------------------------------------------------------------


def test_devices_before_cuda_is_initialized_have_generic_names() -> None:
    cuda = FakeCudaWithProperties([fixture("untouched")] * 2, initialized=False)
    devices = CudaMemoryProbe(cuda).devices()
    assert [(d.id, d.name, d.total_bytes) for d in devices] == [
        ("cuda:0", "CUDA device 0", None),
        ("cuda:1", "CUDA device 1", None),
    ]
    assert cuda.calls[("is_available", -1)] == 0
    assert cuda.calls[("get_device_properties", 0)] == 0
    assert cuda.calls[("device_count", -1)] == 0  # never a CUDA call before the job's


def test_devices_wait_for_the_job_when_nvml_cannot_count_them() -> None:
    # CUDA_VISIBLE_DEVICES=MIG-…, or NVML failing: device_count() would fall back to
    # cudaGetDeviceCount and initialize CUDA in the job (and poison its fork).
    cuda = FakeCudaWithProperties([fixture("untouched")] * 2, initialized=False)
    cuda.nvml_count = -1
    probe = CudaMemoryProbe(cuda)
    assert probe.devices() == [] and not probe.cuda_initialized()
    assert cuda.calls[("device_count", -1)] == 0
    cuda.initialized = True  # the job initialized CUDA: now the count is CUDA's own
    assert [d.id for d in probe.devices()] == ["cuda:0", "cuda:1"] and probe.cuda_initialized()


def test_devices_once_initialized_have_names_and_sizes() -> None:
    cuda = FakeCudaWithProperties([fixture("after_oom")], names=["NVIDIA H200"])
    (device,) = CudaMemoryProbe(cuda).devices()
    assert (device.id, device.name, device.total_bytes) == ("cuda:0", "NVIDIA H200", H200_TOTAL)
    assert device.capability == "9.0"  # tensor cores: the float32-matmuls rule reads it


def test_devices_carry_the_uuid_as_dcgm_spells_it() -> None:
    cuda = FakeCudaWithProperties([fixture("after_oom")])
    (device,) = CudaMemoryProbe(cuda).devices()
    assert device.uuid == f"GPU-{TORCH_UUID}"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (TORCH_UUID.upper(), f"GPU-{TORCH_UUID}"),
        (TORCH_UUID.replace("-", ""), f"GPU-{TORCH_UUID}"),
        (f"GPU-{TORCH_UUID}", f"GPU-{TORCH_UUID}"),
        ("not a uuid", None),
        (None, None),
    ],
)
def test_gpu_uuid_spelling(value: object, expected: str | None) -> None:
    assert gpu_uuid(value) == expected


def test_devices_fall_back_to_get_device_name() -> None:
    cuda = FakeCuda([fixture("after_oom")], names=["NVIDIA H200"])
    (device,) = CudaMemoryProbe(cuda).devices()
    assert (device.name, device.total_bytes) == ("NVIDIA H200", None)
    cuda.fail.add(("get_device_name", 0))
    (device,) = CudaMemoryProbe(cuda).devices()
    assert device.name == "CUDA device 0"


def test_no_devices_when_cuda_is_initialized_but_not_available() -> None:
    assert CudaMemoryProbe(FakeCuda([fixture("after_oom")], available=False)).devices() == []


# --- real torch -----------------------------------------------------------------------------


def test_real_torch_without_cuda_in_use_reads_nothing() -> None:
    torch = pytest.importorskip("torch")
    probe = CudaMemoryProbe()
    if torch.cuda.is_initialized():
        pytest.skip("CUDA already initialized in this test process")
    assert probe.read() == []
    assert not torch.cuda.is_initialized()


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")
def test_real_cuda_allocator() -> None:
    import torch

    probe = CudaMemoryProbe()
    tensor = torch.empty(256 << 20, dtype=torch.uint8, device="cuda:0")
    stats = {s.device: s for s in probe.read()}
    s = stats["cuda:0"]
    assert s.source == SOURCE_CUDA
    assert s.allocated_bytes is not None and s.allocated_bytes >= tensor.numel()
    assert s.reserved_bytes is not None and s.reserved_bytes >= s.allocated_bytes
    assert s.total_bytes is not None and s.free_bytes is not None
    assert 0 < s.free_bytes < s.total_bytes
    assert s.num_ooms is not None
    devices = probe.devices()
    assert devices[0].id == "cuda:0" and devices[0].total_bytes is not None
    assert abs(devices[0].total_bytes - s.total_bytes) <= s.total_bytes // 100
    del tensor


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")
def test_real_probe_does_not_initialize_cuda() -> None:
    code = (
        "import torch\n"
        "from torchtop.agent.probes.cuda_memory import CudaMemoryProbe\n"
        "p = CudaMemoryProbe()\n"
        "assert p.read() == []\n"
        "assert p.devices()\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_sampler_asks_for_a_new_hello_once_the_job_initializes_cuda() -> None:
    """Names, sizes and UUIDs can be read only after the job's CUDA initialization: viewers
    get a hello again then, once."""
    from torchtop.agent.sampler import Sampler

    cuda = FakeCudaWithProperties([fixture("after_oom")], initialized=False)
    hellos: list[int] = []
    sampler = Sampler(
        lambda message: None,
        host=SimpleNamespace(read=lambda: None),
        cpu_memory=SimpleNamespace(read=lambda rss: None),
        cuda_memory=CudaMemoryProbe(cuda),
        nvml=None,
        on_torch_imported=lambda: hellos.append(1),
    )
    sampler.tick()  # torch is imported in this process: the first new hello
    sampler.tick()
    assert len(hellos) == 1
    cuda.initialized = True
    sampler.tick()
    sampler.tick()
    assert len(hellos) == 2


def test_the_jobs_uuids_once_it_has_initialized_cuda() -> None:
    cuda = FakeCudaWithProperties([fixture("after_oom")] * 2, initialized=False)
    probe = CudaMemoryProbe(cuda)
    assert probe.job_uuids() is None
    cuda.initialized = True
    uuids = probe.job_uuids()
    assert uuids is not None and len(uuids) == 2 and uuids == probe.job_uuids()


def test_the_jobs_uuids_are_read_again_while_any_is_unreadable() -> None:
    # Device properties with no usable UUID (an older torch, a device not ready): unknown,
    # so read again later rather than kept for the rest of the job.
    cuda = FakeCudaWithProperties([fixture("after_oom")] * 2)
    uuid: list[Any] = [None]
    original = cuda.get_device_properties

    def properties(device: int) -> SimpleNamespace:
        props = original(device)
        props.uuid = uuid[0]
        return props

    cuda.get_device_properties = properties  # type: ignore[method-assign]
    probe = CudaMemoryProbe(cuda)
    assert probe.job_uuids() in (None, [None, None])
    cuda.fail.add(("device_count", -1))
    assert probe.job_uuids() is None  # the devices could not be listed: unknown
    cuda.fail.clear()
    uuid[0] = TorchUuid(TORCH_UUID)
    expected = [gpu_uuid(TORCH_UUID)] * 2
    assert probe.job_uuids() == expected
    cuda.fail.add(("get_device_properties", 0))
    assert probe.job_uuids() == expected  # once all are known, kept


def test_free_under_a_per_process_memory_fraction_is_what_the_cap_leaves() -> None:
    # set_per_process_memory_fraction(0.5): the allocator refuses to reserve past half of the
    # device, however much the device has free (82 GiB here, beside the job's 57.6 GiB).
    stats = fixture("idle_after_training")
    reserved = stats["reserved_bytes.all.current"]
    cuda = FakeCuda([stats], free=82 * GIB)
    cuda.get_per_process_memory_fraction = lambda device: 0.5  # type: ignore[attr-defined]
    (read,) = CudaMemoryProbe(cuda).read()
    cap = int(0.5 * H200_TOTAL)
    assert read.total_bytes == cap
    assert read.free_bytes == cap - reserved < 13 * GIB
    # No cap set (fraction 1.0): the device's own figures.
    cuda.get_per_process_memory_fraction = lambda device: 1.0  # type: ignore[attr-defined]
    (read,) = CudaMemoryProbe(cuda).read()
    assert (read.free_bytes, read.total_bytes) == (82 * GIB, H200_TOTAL)
