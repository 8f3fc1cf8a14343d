from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import pytest
from fakes.nvml import (
    JOB_CUDA_UUIDS,
    MIB,
    FakeGpu,
    FakeNvmlBackend,
    fake_pynvml,
    library_mismatch,
    pynvml_error,
)

from tests.conftest import cuda_available
from torchtop.agent.probes.base import ProbeUnavailable
from torchtop.agent.probes.nvml import NvmlCallError, NvmlProbe, PynvmlBackend
from torchtop.protocol import GpuProcess


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_reads_two_h200s() -> None:
    backend = FakeNvmlBackend.two_h200()
    first, second = NvmlProbe(backend).read()
    assert first.index == 0 and second.index == 1
    assert first.name == second.name == "NVIDIA H200"
    assert first.util_gpu_percent == 97.0 and second.util_gpu_percent == 88.0
    assert first.util_memory_percent == 61.0
    assert first.memory_used_bytes == 118_562 * MIB
    assert second.memory_used_bytes == 97_001 * MIB
    assert first.memory_total_bytes == 143_771 * MIB
    assert first.temperature_c == 64.0
    assert first.power_w == 612.4 and second.power_w == 548.9
    assert first.power_limit_w == 700.0
    assert (first.clock_sm_mhz, first.clock_memory_mhz) == (1980, 3201)
    assert first.processes == [GpuProcess(4242, 117_800 * MIB), GpuProcess(4310, 532 * MIB)]
    assert not first.lost and not second.lost


def test_nvml_starts_on_the_first_read_only() -> None:
    backend = FakeNvmlBackend.two_h200()
    probe = NvmlProbe(backend)
    assert backend.count("init") == 0
    for _ in range(3):
        probe.read()
    assert backend.count("init") == 1
    assert backend.count("device_count") == 1
    # Handles and names do not change: each is asked once per GPU.
    assert backend.count("handle", 0) == backend.count("handle", 1) == 1
    assert backend.count("name", 0) == backend.count("name", 1) == 1
    assert backend.count("utilization", 0) == 3


def test_an_unsupported_call_is_none_and_not_asked_again() -> None:
    backend = FakeNvmlBackend.power_not_supported()
    probe = NvmlProbe(backend)
    for _ in range(5):
        h200, rtx = probe.read()
    assert h200.power_w == 612.4 and h200.power_limit_w == 700.0
    assert rtx.power_w is None and rtx.power_limit_w is None
    assert rtx.name == "NVIDIA GeForce RTX 3090"
    assert rtx.memory_total_bytes == 24_576 * MIB
    assert rtx.util_gpu_percent == 97.0 and rtx.temperature_c == 64.0
    assert backend.count("power_w", 1) == 1
    assert backend.count("power_limit_w", 1) == 1
    assert backend.count("power_w", 0) == 5


def test_other_errors_are_none_and_asked_again() -> None:
    gpu = FakeGpu(fail={"temperature": "other", "clocks": "no_permission"})
    backend = FakeNvmlBackend([gpu])
    probe = NvmlProbe(backend)
    (stats,) = probe.read()
    assert stats.temperature_c is None
    assert stats.clock_sm_mhz is None and stats.clock_memory_mhz is None
    assert stats.util_gpu_percent == 97.0
    del gpu.fail["temperature"]
    (stats,) = probe.read()
    assert stats.temperature_c == 64.0
    assert backend.count("temperature", 0) == 2


def test_a_lost_gpu_stays_lost_and_is_not_asked_again() -> None:
    backend = FakeNvmlBackend.gpu_lost(after_reads=2)
    probe = NvmlProbe(backend)
    for _ in range(2):
        _, gpu1 = probe.read()
        assert not gpu1.lost and gpu1.power_w == 612.4
    calls_before = sum(n for (_, index), n in backend.calls.items() if index == 1)
    for _ in range(3):
        gpu0, gpu1 = probe.read()
        assert gpu1.lost
        assert gpu1.index == 1 and gpu1.name == "NVIDIA H200"
        assert gpu1.util_gpu_percent is None and gpu1.memory_used_bytes is None
        assert gpu1.power_w is None and gpu1.processes is None
        assert not gpu0.lost and gpu0.util_gpu_percent == 97.0
    calls_after = sum(n for (_, index), n in backend.calls.items() if index == 1)
    assert calls_after == calls_before + 1  # the one call that found it lost


def test_library_not_found_is_unavailable_once_and_for_all() -> None:
    backend = FakeNvmlBackend.library_not_found()
    probe = NvmlProbe(backend)
    for _ in range(2):
        with pytest.raises(ProbeUnavailable, match=r"libnvidia-ml\.so\.1 not found"):
            probe.read()
    assert backend.count("init") == 1
    probe.close()
    assert backend.count("shutdown") == 0  # never started, so nothing to shut down


def test_an_init_that_breaks_its_contract_is_still_unavailable() -> None:
    class Broken(FakeNvmlBackend):
        def init(self) -> None:
            raise NvmlCallError("other", "Unknown Error")

    with pytest.raises(ProbeUnavailable, match="NVML not available: other: Unknown Error"):
        NvmlProbe(Broken()).read()


def test_no_gpus_is_unavailable_and_shuts_nvml_down() -> None:
    backend = FakeNvmlBackend([])
    with pytest.raises(ProbeUnavailable, match="no NVIDIA GPUs"):
        NvmlProbe(backend).read()
    assert backend.count("shutdown") == 1


def test_process_list_is_read_at_most_every_interval() -> None:
    backend = FakeNvmlBackend.two_h200()
    clock = Clock()
    probe = NvmlProbe(backend, process_interval_s=10.0, clock=clock)
    seen = []
    for _ in range(251):  # 25 s at 10 Hz
        seen.append(probe.read()[0].processes)
        backend.gpus[0].processes = [(4242, None)]  # changes after the first read
        clock.now += 0.1
    # Reads at 0 s, 10 s and 20 s (within float rounding of the 0.1 s steps).
    assert backend.count("processes", 0) == 3
    assert backend.count("processes", 1) == 3
    assert seen[0] == [GpuProcess(4242, 117_800 * MIB), GpuProcess(4310, 532 * MIB)]
    assert all(p == seen[0] for p in seen[:100])
    assert seen[-1] == [GpuProcess(4242, None)]


def test_process_list_is_none_where_it_cannot_be_read() -> None:
    backend = FakeNvmlBackend([FakeGpu(fail={"processes": "not_supported"})])
    clock = Clock()
    probe = NvmlProbe(backend, clock=clock)
    for _ in range(3):
        (stats,) = probe.read()
        assert stats.processes is None
        clock.now += 11.0
    assert backend.count("processes", 0) == 1


def test_close_shuts_down_once() -> None:
    backend = FakeNvmlBackend.two_h200()
    probe = NvmlProbe(backend)
    probe.read()
    probe.close()
    probe.close()
    assert backend.count("shutdown") == 1
    with pytest.raises(ProbeUnavailable, match="closed"):
        probe.read()


def test_a_backend_that_raises_anything_costs_only_the_field() -> None:
    class Buggy(FakeNvmlBackend):
        def temperature(self, handle: object) -> float:
            raise ZeroDivisionError

    (stats,) = NvmlProbe(Buggy([FakeGpu()])).read()
    assert stats.temperature_c is None and stats.power_w == 612.4


# --- the pynvml backend ---------------------------------------------------------------------


def test_real_nvml_on_this_machine() -> None:
    probe = NvmlProbe()
    try:
        gpus = probe.read()
    except ProbeUnavailable as exc:
        assert str(exc).startswith("NVML not available: ")
    else:
        assert gpus and all(g.memory_total_bytes for g in gpus if not g.lost)
    finally:
        probe.close()


def test_pynvml_missing_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(ProbeUnavailable, match="nvidia-ml-py"):
        PynvmlBackend().init()


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        ("NVML_ERROR_LIBRARY_NOT_FOUND", "libnvidia-ml.so.1 not found"),
        ("NVML_ERROR_DRIVER_NOT_LOADED", "driver is not loaded"),
        ("NVML_ERROR_NO_PERMISSION", "no permission"),
        ("NVML_ERROR_UNKNOWN", "Unknown Error"),
    ],
)
def test_pynvml_init_failures_say_why(
    monkeypatch: pytest.MonkeyPatch, error: str, reason: str
) -> None:
    pynvml = pytest.importorskip("pynvml")

    def fail() -> None:
        raise pynvml.NVMLError(getattr(pynvml, error))

    monkeypatch.setattr(pynvml, "nvmlInit", fail)
    with pytest.raises(ProbeUnavailable, match=f"^NVML not available: .*{reason}"):
        PynvmlBackend().init()


def backend_over(module: SimpleNamespace) -> PynvmlBackend:
    backend = PynvmlBackend()
    backend._nvml = module
    return backend


@pytest.mark.parametrize(
    ("error", "code"),
    [
        ("NVML_ERROR_NOT_SUPPORTED", "not_supported"),
        ("NVML_ERROR_FUNCTION_NOT_FOUND", "not_supported"),
        ("NVML_ERROR_GPU_IS_LOST", "gpu_lost"),
        ("NVML_ERROR_RESET_REQUIRED", "gpu_lost"),
        ("NVML_ERROR_GPU_NOT_FOUND", "gpu_lost"),
        ("NVML_ERROR_NO_PERMISSION", "no_permission"),
        ("NVML_ERROR_UNKNOWN", "other"),
        ("NVML_ERROR_TIMEOUT", "other"),
    ],
)
def test_pynvml_errors_map_to_codes(error: str, code: str) -> None:
    pynvml = pytest.importorskip("pynvml")

    def fail(handle: object) -> None:
        raise pynvml.NVMLError(getattr(pynvml, error))

    backend = backend_over(fake_pynvml(nvmlDeviceGetPowerUsage=fail))
    with pytest.raises(NvmlCallError) as caught:
        backend.power_w(object())
    assert caught.value.code == code


def test_pynvml_units_and_process_lists() -> None:
    pynvml = pytest.importorskip("pynvml")

    def proc(pid: int, used: int | None) -> SimpleNamespace:
        return SimpleNamespace(pid=pid, usedGpuMemory=used)

    def graphics_unsupported(handle: object) -> list[SimpleNamespace]:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    module = fake_pynvml(
        nvmlDeviceGetPowerUsage=lambda h: 612_400,
        nvmlDeviceGetEnforcedPowerLimit=lambda h: 700_000,
        nvmlDeviceGetName=lambda h: b"NVIDIA H200",
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=5, total=9, free=4),
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=97, memory=61),
        nvmlDeviceGetClockInfo=lambda h, kind: 1980 if kind == pynvml.NVML_CLOCK_SM else 3201,
        nvmlDeviceGetComputeRunningProcesses=lambda h: [proc(10, 4 * MIB), proc(11, None)],
        nvmlDeviceGetGraphicsRunningProcesses=lambda h: [proc(10, 4 * MIB), proc(12, MIB)],
    )
    backend = backend_over(module)
    assert backend.power_w("h") == pytest.approx(612.4)
    assert backend.power_limit_w("h") == pytest.approx(700.0)
    assert backend.name("h") == "NVIDIA H200"
    assert backend.memory("h") == (5, 9)
    assert backend.utilization("h") == (97.0, 61.0)
    assert backend.clocks("h") == (1980, 3201)
    assert backend.processes("h") == [(10, 4 * MIB), (11, None), (12, MIB)]

    module.nvmlDeviceGetGraphicsRunningProcesses = graphics_unsupported
    assert backend.processes("h") == [(10, 4 * MIB), (11, None)]
    module.nvmlDeviceGetComputeRunningProcesses = graphics_unsupported
    with pytest.raises(NvmlCallError) as caught:
        backend.processes("h")
    assert caught.value.code == "not_supported"


def test_the_unversioned_process_list_on_an_older_driver_falls_back_to_v2() -> None:
    pytest.importorskip("pynvml")

    def mismatch(handle: object) -> list[SimpleNamespace]:
        raise library_mismatch()

    module = fake_pynvml(
        nvmlDeviceGetComputeRunningProcesses=mismatch,
        nvmlDeviceGetComputeRunningProcesses_v2=lambda h: [
            SimpleNamespace(pid=10, usedGpuMemory=MIB)
        ],
        nvmlDeviceGetGraphicsRunningProcesses=mismatch,
        nvmlDeviceGetGraphicsRunningProcesses_v2=lambda h: [],
    )
    backend = backend_over(module)
    assert backend.processes("h") == [(10, MIB)]
    # Without the _v2 calls either, the list is unsupported: an NvmlCallError, never the
    # mismatch error escaping into the sampler.
    del (
        module.nvmlDeviceGetComputeRunningProcesses_v2,
        module.nvmlDeviceGetGraphicsRunningProcesses_v2,
    )
    with pytest.raises(NvmlCallError) as caught:
        backend.processes("h")
    assert caught.value.code == "not_supported"


@pytest.mark.parametrize("code", ["NVML_ERROR_RESET_REQUIRED", "NVML_ERROR_GPU_NOT_FOUND"])
def test_a_gpu_that_needs_a_reset_or_is_gone_is_marked_lost(code: str) -> None:
    pytest.importorskip("pynvml")
    calls: list[str] = []

    def gone(handle: object) -> Any:
        calls.append("utilization")
        raise pynvml_error(code)

    module = fake_pynvml(
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: "h0",
        nvmlDeviceGetName=lambda h: "NVIDIA H200",
        nvmlDeviceGetUUID=lambda h: "GPU-00000000-5f3a-c2e7-d9b1-4a6c8e02bd7f",
        nvmlDeviceGetUtilizationRates=gone,
    )
    backend = PynvmlBackend()
    backend.init = lambda: setattr(backend, "_nvml", module)  # type: ignore[method-assign]
    probe = NvmlProbe(backend)
    (first,) = probe.read()
    (second,) = probe.read()
    assert first.lost and second.lost and first.name == "NVIDIA H200"
    assert calls == ["utilization"]  # not asked again


def test_gpus_are_matched_to_the_jobs_cuda_devices_by_uuid() -> None:
    backend = FakeNvmlBackend.four_h100_out_of_cuda_order()
    job: list[list[str | None] | None] = [None]
    probe = NvmlProbe(backend, job_uuids=lambda: job[0])
    # Before the job initializes CUDA: NVML's order, nothing known about the job.
    before = probe.read()
    assert [g.index for g in before] == [0, 1, 2, 3]
    assert {g.in_job for g in before} == {None} and {g.cuda_device for g in before} == {None}
    job[0] = list(JOB_CUDA_UUIDS)  # CUDA_VISIBLE_DEVICES=2,0
    after = probe.read()
    assert [(g.index, g.cuda_device, g.in_job) for g in after] == [
        (2, "cuda:0", True),
        (0, "cuda:1", True),
        (1, None, False),
        (3, None, False),
    ]
    assert after[0].util_gpu_percent == 2.0 and after[0].uuid == backend.gpus[2].uuid


def test_mig_instances_are_listed_and_the_parents_utilization_is_asked_again() -> None:
    backend = FakeNvmlBackend.mig_layout()
    instance_uuid = backend.gpus[0].mig[0].uuid
    probe = NvmlProbe(backend, job_uuids=lambda: [instance_uuid[4:]])
    rows = probe.read()
    # The job's MIG instance first, then the rest in NVML's order: each GPU, its instances.
    assert [(g.index, g.mig_parent) for g in rows] == [(0, 0), (0, None), (1, 0), (1, None)]
    mig = rows[0]
    assert mig.uuid == instance_uuid and mig.cuda_device == "cuda:0" and mig.in_job
    assert mig.memory_total_bytes == 40_192 * MIB and mig.util_gpu_percent is None
    parent = next(g for g in rows if g.index == 0 and g.mig_parent is None)
    assert parent.in_job is False and parent.util_gpu_percent is None
    assert parent.memory_total_bytes == 81_920 * MIB
    probe.read()
    # Utilization on the parent is not dropped for good: MIG mode can be turned off.
    assert backend.count("utilization", 0) == 2


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")
def test_real_nvml_reads_a_gpu() -> None:
    probe = NvmlProbe()
    try:
        gpus = probe.read()
    finally:
        probe.close()
    assert gpus
    gpu = gpus[0]
    assert gpu.name and gpu.memory_total_bytes and gpu.memory_used_bytes is not None
    assert gpu.util_gpu_percent is not None and gpu.temperature_c is not None


@pytest.mark.parametrize(
    "uuids",
    [[None], [None, None], []],
    ids=["one-unreadable", "all-unreadable", "none-listed"],
)
def test_no_usable_uuid_leaves_the_gpus_unknown_not_outside_the_job(
    uuids: list[str | None],
) -> None:
    backend = FakeNvmlBackend.four_h100_out_of_cuda_order()
    probe = NvmlProbe(backend, job_uuids=lambda: uuids)
    rows = probe.read()
    assert [g.index for g in rows] == [0, 1, 2, 3]
    assert {g.in_job for g in rows} == {None} and {g.cuda_device for g in rows} == {None}


def test_a_gpu_whose_cuda_uuid_is_unreadable_is_not_called_outside_the_job() -> None:
    # cuda:0's UUID reads, cuda:1's does not: GPU 2 is the job's; which of the others is
    # cuda:1 is unknown, so none of them is said to be outside the job.
    backend = FakeNvmlBackend.four_h100_out_of_cuda_order()
    probe = NvmlProbe(backend, job_uuids=lambda: [JOB_CUDA_UUIDS[0], None])
    rows = probe.read()
    assert [(g.index, g.cuda_device, g.in_job) for g in rows] == [
        (2, "cuda:0", True),
        (0, None, None),
        (1, None, None),
        (3, None, None),
    ]


def test_fake_energy_counter_is_monotonic_millijoules_on_a_100ms_grid() -> None:
    backend = FakeNvmlBackend.two_h200()
    backend.init()
    gpu = backend.gpus[0]
    start = backend.energy_mj(0)
    gpu.clock_s = 0.05  # between NVML's updates: the same reading
    assert backend.energy_mj(0) == start
    gpu.clock_s = 2.0  # 2 s at 612.4 W
    assert backend.energy_mj(0) - start == 1_224_800
    power = FakeNvmlBackend.power_not_supported()
    power.init()
    with pytest.raises(NvmlCallError):
        power.energy_mj(1)


def test_real_backend_reads_total_energy_consumption() -> None:
    backend = backend_over(fake_pynvml(nvmlDeviceGetTotalEnergyConsumption=lambda h: 9_284_771))
    assert backend.energy_mj(object()) == 9_284_771
