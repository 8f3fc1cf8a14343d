"""The GPU check's comparisons on recorded data, each with a case that must fail.

The agent's frames come from the agent's own code fed with the CUDA fixtures (tests/fixtures/)
and the fake NVML backend, so each comparison is run on the shapes a real GPU run gives; the
truth is what the GPU check's jobs write (benchmarks/gpu_check_jobs.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fakes.allocator import fail_into_job
from fakes.nvml import MIB, FakeGpu, FakeNvmlBackend

from benchmarks import gpu_check
from benchmarks import gpu_check_compare as cmp
from torchtop.agent.collectives import DEFAULT_RING
from torchtop.agent.core import AgentConfig
from torchtop.agent.oom import OomController
from torchtop.agent.ops import Event, aggregate, ranked
from torchtop.agent.probes.cuda_memory import CudaMemoryProbe
from torchtop.agent.probes.nvml import NvmlProbe
from torchtop.protocol import GpuSample, Message, OutOfMemory, Sample, to_dict

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
ROOT = FIXTURES.parent.parent
GIB = 1 << 30


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())


def statuses(rows: list[cmp.Check]) -> list[str]:
    return [r.status for r in rows]


# -- the command -------------------------------------------------------------------------------


def test_without_a_gpu_it_says_so_in_one_line_and_exits_2(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--out", str(tmp_path / "g")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device is visible" in lines[0], proc.stdout
    assert proc.stderr == ""
    assert not (tmp_path / "g").exists()
    assert time.monotonic() - t0 < 30  # it never imports torch to find out


@pytest.mark.slow
def test_a_job_runs_under_torchtop_headless_without_textual(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lent GPU machine has no Textual: the check's jobs run through the headless paths
    only (here, the CPU job and the model's view of its recording)."""
    blocked = tmp_path / "blocked" / "textual"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('no Textual here')\n")
    monkeypatch.setenv("PYTHONPATH", str(blocked.parent))
    (tmp_path / "work").mkdir()
    session = gpu_check.Session(tmp_path / "work")
    rows = gpu_check.group_cpu_job(session)
    # The view shows the CPU; CUDA never initialized (here: no CUDA build, so windows opened);
    # no GPU to see by UUID.
    assert statuses(rows) == [cmp.PASS, cmp.PASS, cmp.SKIP], (rows, session.steps[0].stderr)
    assert session.steps[0].rc == 0


def test_with_nvidia_smi_but_a_torch_without_cuda_it_asks_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexit 9\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    import torch

    if torch.cuda.is_available():
        pytest.skip("this PyTorch sees a GPU")
    assert gpu_check.no_cuda_reason() == "PyTorch sees no CUDA device (a CPU build, or no driver)"
    assert gpu_check.ENVIRONMENT["torch"] == torch.__version__


def test_no_cuda_reason_on_this_machine() -> None:
    if Path("/dev/nvidiactl").exists() or shutil.which("nvidia-smi"):
        pytest.skip("this machine has an NVIDIA device")
    assert "no /dev/nvidia" in (gpu_check.no_cuda_reason() or "")


# -- allocator against memory_stats() ----------------------------------------------------------


def cuda_module(stats: dict[str, Any], free: int, total: int) -> SimpleNamespace:
    return SimpleNamespace(
        is_available=lambda: True,
        is_initialized=lambda: True,
        device_count=lambda: 1,
        memory_stats=lambda device: stats,
        mem_get_info=lambda device: (free, total),
        get_device_name=lambda device: "NVIDIA H200",
    )


def samples(
    stats: dict[str, Any], times: list[float], free: int, total: int
) -> list[dict[str, Any]]:
    probe = CudaMemoryProbe(cuda_module(stats, free, total))
    return [to_dict(Sample(t=t, host=None, memory=probe.read())) for t in times]


def test_allocator_samples_equal_the_jobs_memory_stats() -> None:
    stats = fixture("cuda_memory_stats_idle_after_training.json")
    free, total = 120 * GIB, 140 * GIB
    plateau = {"kind": "idle", "t0": 10.0, "t1": 11.0, "before": stats, "after": stats,
               "mem_get_info": [free, total]}  # fmt: skip
    frames = samples(stats, [9.5, 10.2, 10.5, 10.9, 11.5], free, total)
    row = cmp.allocator_matches_job(frames, [plateau])
    assert row.status == cmp.PASS and row.measured.startswith("3 samples in 1"), row

    # The agent read another number than the job (another stat: the OOM fixture's).
    other = fixture("cuda_memory_stats_after_oom.json")
    wrong = samples(other, [10.5], free, total)
    row = cmp.allocator_matches_job(wrong, [plateau])
    assert row.status == cmp.FAIL and "differ" in row.measured, row
    # No sample inside a still plateau proves nothing.
    assert cmp.allocator_matches_job(frames[:1], [plateau]).status == cmp.FAIL
    moving = {**plateau, "after": other}
    assert cmp.allocator_matches_job(frames, [moving]).status == cmp.FAIL


# -- NVML against nvidia-smi -------------------------------------------------------------------


def gpu_frames(backend: FakeNvmlBackend, times: list[float]) -> list[dict[str, Any]]:
    probe = NvmlProbe(backend)
    return [to_dict(GpuSample(t=t, gpus=probe.read())) for t in times]


def smi_read(t: float, gpus: list[FakeGpu], **change: float) -> dict[str, Any]:
    fields = cmp.SMI_FIELDS
    lines = []
    for i, gpu in enumerate(gpus):
        values = {
            "index": i,
            "uuid": f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd",
            "memory.used": gpu.memory_used // MIB + change.get("used", 0),
            "memory.total": gpu.memory_total // MIB,
            "memory.reserved": "[N/A]",
            "utilization.gpu": gpu.util_gpu + change.get("util", 0),
        }
        lines.append(", ".join(str(values[f]) for f in fields))
    return {"t": t, "rows": cmp.parse_smi("\n".join(lines))}


PLATEAUS = [{"kind": "busy", "t0": 0.0, "t1": 4.0}, {"kind": "idle", "t0": 4.0, "t1": 8.0}]


def test_nvml_memory_and_utilization_against_nvidia_smi() -> None:
    busy = FakeNvmlBackend.two_h200()
    idle = FakeNvmlBackend([FakeGpu(util_gpu=0.0), FakeGpu(util_gpu=0.0, memory_used=97_001 * MIB)])
    frames = gpu_frames(busy, [2.0, 3.0]) + gpu_frames(idle, [6.0, 7.0])
    reads = [smi_read(2.1, busy.gpus), smi_read(3.0, busy.gpus), smi_read(6.9, idle.gpus)]
    assert cmp.nvml_memory_matches_smi(frames, reads, PLATEAUS).status == cmp.PASS
    row = cmp.nvml_utilization_matches_smi(frames, reads, PLATEAUS)
    assert row.status == cmp.PASS and row.measured.startswith("4 busy and 2 idle"), row

    far = [smi_read(2.1, busy.gpus, used=100), smi_read(6.9, idle.gpus, util=40)]
    assert cmp.nvml_memory_matches_smi(frames, far, PLATEAUS).status == cmp.FAIL
    assert cmp.nvml_utilization_matches_smi(frames, far, PLATEAUS).status == cmp.FAIL
    # Reads too far apart in time are not paired.
    late = [smi_read(2.6, busy.gpus)]
    assert "no NVML read paired" in cmp.nvml_memory_matches_smi(frames, late, PLATEAUS).measured


def test_the_jobs_gpu_is_found_by_uuid_first_and_marked() -> None:
    backend = FakeNvmlBackend.two_h200()
    rows = smi_read(1.0, backend.gpus)["rows"]
    job_uuid = "00000001-aaaa-bbbb-cccc-dddddddddddd"  # torch's form: no "GPU-"
    frames = gpu_frames(backend, [1.0])
    # The agent not (yet) told the job's CUDA UUIDs: NVML's order, nothing marked.
    row = cmp.nvml_gpu_matched_by_uuid(frames, job_uuid, rows)
    assert row.status == cmp.FAIL and "position 1" in row.measured
    # The agent matching them: the job's GPU first and marked.
    probe = NvmlProbe(backend, job_uuids=lambda: [job_uuid])
    agent = [to_dict(GpuSample(t=1.0, gpus=probe.read()))]
    assert cmp.nvml_gpu_matched_by_uuid(agent, job_uuid, rows).status == cmp.PASS
    # NVML orders by PCI bus: the job's CUDA device 0 is NVML's GPU 1.
    gpus = frames[0]["gpus"]
    matched = [
        {**gpus[1], "uuid": rows[1]["uuid"], "cuda_device": "cuda:0", "in_job": True},
        {**gpus[0], "uuid": rows[0]["uuid"], "cuda_device": None, "in_job": False},
    ]
    good = [{**frames[0], "gpus": matched}]
    assert cmp.nvml_gpu_matched_by_uuid(good, job_uuid, rows).status == cmp.PASS
    unordered = [{**frames[0], "gpus": matched[::-1]}]
    assert cmp.nvml_gpu_matched_by_uuid(unordered, job_uuid, rows).status == cmp.FAIL
    unmarked = [{**frames[0], "gpus": [{**g, "cuda_device": None} for g in matched]}]
    assert cmp.nvml_gpu_matched_by_uuid(unmarked, job_uuid, rows).status == cmp.FAIL
    twice = [{**frames[0], "gpus": [matched[0], {**matched[1], "cuda_device": "cuda:0"}]}]
    assert cmp.nvml_gpu_matched_by_uuid(twice, job_uuid, rows).status == cmp.FAIL


def test_the_hello_carries_the_jobs_uuid() -> None:
    from torchtop.protocol import DeviceInfo

    rows = smi_read(1.0, [FakeGpu()])["rows"]
    torch_uuid = "00000000-aaaa-bbbb-cccc-dddddddddddd"

    def hello(uuid: str | None) -> dict[str, Any]:
        device = DeviceInfo(id="cuda:0", name="NVIDIA H200", uuid=uuid)
        return {"kind": "hello", "devices": [to_dict_op(device)]}

    assert cmp.hello_uuid([hello(rows[0]["uuid"])], torch_uuid, rows).status == cmp.PASS
    assert cmp.hello_uuid([hello(None)], torch_uuid, rows).failed
    other = "GPU-00000009-aaaa-bbbb-cccc-dddddddddddd"
    assert cmp.hello_uuid([hello(other)], torch_uuid, rows).failed


def test_shown_devices() -> None:
    assert cmp.shown_devices_match(["cpu"], ["cpu"], "CPU job").status == cmp.PASS
    assert cmp.shown_devices_match(["cuda:0"], ["cpu"], "CPU job").status == cmp.FAIL
    assert cmp.shown_devices_match(None, ["cpu"], "CPU job").status == cmp.FAIL
    assert cmp.shown_devices_match(["cpu", "cuda:0"], ["cpu"], "CPU job").status == cmp.FAIL
    assert cmp.shown_devices_match(["cuda:0", "cpu"], ["cuda:0"], "CUDA job").status == cmp.PASS
    assert cmp.shown_devices_match(["cuda:0", "cuda:1"], ["cuda:0"], "CUDA job").failed
    assert cmp.shown_devices_match(["cpu"], ["cuda:0"], "CUDA job").failed


def test_shown_devices_reads_a_recording_through_the_model(tmp_path: Path) -> None:
    from torchtop.protocol import DeviceInfo, Hello, encode

    hello = Hello(protocol=1, pid=1, argv=["x"], cwd="/", started_at=0.0, python="3", torch="2",
                  devices=[DeviceInfo(id="cpu", name="cpu")], interval_s=0.1)  # fmt: skip
    record = tmp_path / "r.ttr"
    record.write_bytes(encode(hello))
    assert gpu_check.shown_devices(record) == ["cpu"]


# -- out of memory -----------------------------------------------------------------------------


def agent_oom_event(tmp_path: Path, data: dict[str, Any]) -> dict[str, Any]:
    """The agent's own flow, fed the fixture's observer call, memory_stats() and snapshot."""
    (event,) = [f for f in agent_frames(tmp_path, data) if f["kind"] == "oom"]
    return event


def truth_of(data: dict[str, Any]) -> dict[str, Any]:
    """What the GPU check's job writes, from a snapshot fixture."""
    ooms = [e for e in data["snapshot"]["device_traces"][0] if e["action"] == "oom"]
    observer = {**data["observer"], "memory_stats": data["memory_stats"],
                "trace_oom_size": ooms[-1]["size"]}  # fmt: skip
    return {"requested": ooms[-1]["size"], "observer": [observer]}


@pytest.mark.parametrize(
    ("name", "fragmented", "top"),
    [("full", False, ("model.py", 88)), ("fragmented", True, ("train.py", 150))],
)
def test_oom_event_against_the_allocators_numbers(
    tmp_path: Path, name: str, fragmented: bool, top: tuple[str, int]
) -> None:
    """The fixtures' largest live blocks were allocated at these lines of the job."""
    data = fixture(f"cuda_snapshot_{name}.json")
    event = agent_oom_event(tmp_path, data)
    truth = truth_of(data)
    rows = cmp.oom_event_checks(name, [event], truth, fragmented=fragmented, top_site=top)
    assert statuses(rows) == [cmp.PASS] * 5, rows

    # Each figure, when the agent's differs, fails its row.
    wrong = {**event, "reserved_bytes": event["reserved_bytes"] + MIB}
    assert cmp.oom_event_checks(name, [wrong], truth, fragmented=fragmented, top_site=top)[0].failed
    # The segment size in place of the request.
    segment = {**event, "requested_bytes": event["requested_bytes"] + 2 * MIB}
    rows = cmp.oom_event_checks(name, [segment], truth, fragmented=fragmented, top_site=top)
    assert statuses(rows)[:2] == [cmp.FAIL, cmp.FAIL]
    other_verdict = {**event, "fragmented": not fragmented}
    rows = cmp.oom_event_checks(name, [other_verdict], truth, fragmented=fragmented, top_site=top)
    assert rows[3].failed
    rows = cmp.oom_event_checks(name, [event], truth, fragmented=fragmented, top_site=("x.py", 1))
    assert rows[4].failed
    assert cmp.oom_event_checks(name, [], truth, fragmented=fragmented, top_site=top)[0].failed


def test_free_under_a_memory_fraction_is_the_cap_less_reserved() -> None:
    """A 4 GiB cap on a 141 GiB card, with 135 GiB free on the device."""
    stats = {
        "reserved_bytes.all.current": 3 * GIB + 512 * MIB,
        "allocated_bytes.all.current": 3 * GIB,
    }
    observer = {"device": 0, "alloc": GIB, "device_total": 4 * GIB, "device_free": 135 * GIB,
                "memory_stats": stats}  # fmt: skip
    assert cmp.expected_free(observer) == 512 * MIB
    truth = {"requested": GIB, "observer": [observer]}
    event = {"kind": "oom", "requested_bytes": GIB, "allocated_bytes": 3 * GIB,
             "reserved_bytes": stats["reserved_bytes.all.current"],
             "fragmented": False, "top_sites": []}  # fmt: skip
    capped = cmp.oom_event_checks(
        "x", [{**event, "free_bytes": 512 * MIB}], truth, fragmented=False, top_site=("a", 1)
    )
    assert capped[2].status == cmp.PASS
    device_free = cmp.oom_event_checks(
        "x", [{**event, "free_bytes": 135 * GIB}], truth, fragmented=False, top_site=("a", 1)
    )
    assert device_free[2].failed


def test_marker_lines_are_in_the_jobs_file() -> None:
    source = (ROOT / "benchmarks" / "gpu_check_jobs.py").read_text()
    for marker in ("full top site", "fragmented top site"):
        line = cmp.marker_line(source, marker)
        assert "torch." in source.splitlines()[line - 1]
    with pytest.raises(ValueError):
        cmp.marker_line(source, "nothing")


def test_snapshot_loads() -> None:
    assert cmp.snapshot_loads("/s.pickle", 0o600, 0, "Total: 12 MiB").status == cmp.PASS
    assert cmp.snapshot_loads("/s.pickle", 0o644, 0, "Total").failed
    assert cmp.snapshot_loads("/s.pickle", 0o600, 1, "Traceback\nKeyError").failed
    assert cmp.snapshot_loads(None, None, None, "").failed


def oom_stderr(prefix: str = "", line: int = 213, tried: str = "2.00 GiB") -> str:
    return (
        f"{prefix}Traceback (most recent call last):\n"
        '  File "/r/benchmarks/gpu_check_jobs.py", line 460, in <module>\n'
        "    main(sys.argv[1:])\n"
        f'  File "/r/benchmarks/gpu_check_jobs.py", line {line}, in job_oom_full\n'
        "    x = torch.randn(batch, FULL_WIDTH, device=device)\n"
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {tried}. GPU 0 has a "
        "total capacity of 139.81 GiB of which 137.1 GiB is free.\n"
    )


def test_the_jobs_error_is_unchanged() -> None:
    runner = (
        "Traceback (most recent call last):\n"
        '  File "<frozen runpy>", line 198, in _run_module_as_main\n'
    )
    plain = (1, oom_stderr())
    # Under torchtop, the runner's frames come first and torchtop may print after the error.
    watched = (1, oom_stderr().replace("Traceback (most recent call last):\n", runner)
               + "torchtop: OOM snapshot: /tmp/r.oom-1.pickle\n")  # fmt: skip
    assert cmp.job_error_unchanged("run", plain, watched).status == cmp.PASS
    assert cmp.job_error_unchanged("run", plain, (0, "")).failed
    assert cmp.job_error_unchanged("run", plain, (1, oom_stderr(line=214))).failed
    assert cmp.job_error_unchanged("run", plain, (1, oom_stderr(tried="1.00 GiB"))).failed
    assert cmp.job_error_unchanged("run", plain, (-9, oom_stderr())).failed


def test_pause_resumes_at_the_timeout() -> None:
    oom = {"kind": "oom", "t": 100.0, "paused": True}
    good = [oom, {"kind": "oom_resumed", "t": 103.1, "reason": "timeout"}]
    assert cmp.pause_timed_out(good, 3.0).status == cmp.PASS
    assert cmp.pause_timed_out([oom], 3.0).failed
    assert cmp.pause_timed_out([{**oom, "paused": False}, good[1]], 3.0).failed
    assert cmp.pause_timed_out([oom, {**good[1], "t": 100.1, "reason": "viewer"}], 3.0).failed


def test_ooms_handled_inside_torch_are_not_published() -> None:
    trials = [
        {"t0": 10.0, "t1": 11.0, "ooms": 3, "raised": ""},  # cuDNN retried smaller
        {"t0": 12.0, "t1": 13.0, "ooms": 1, "raised": "CUDA out of memory."},
        {"t0": 14.0, "t1": 15.0, "ooms": 0, "raised": ""},
    ]
    sample = {"kind": "sample", "t": 16.0, "memory": [{"device": "cuda:0", "handled_ooms": 3}]}
    right = [{"kind": "oom", "t": 12.5}, sample]
    assert cmp.handled_ooms_not_published(right, trials).status == cmp.PASS
    published = [{"kind": "oom", "t": 10.4}, *right]
    assert cmp.handled_ooms_not_published(published, trials).failed
    assert cmp.handled_ooms_not_published([sample], trials).failed  # the job's one is missing
    uncounted = [right[0], {**sample, "memory": [{"device": "cuda:0", "handled_ooms": None}]}]
    assert cmp.handled_ooms_not_published(uncounted, trials).failed
    # The job is built to provoke a handled OOM: none observed proves nothing, so it fails.
    row = cmp.handled_ooms_not_published([], trials[2:])
    assert row.failed and "no OOM was handled" in row.measured


# -- op windows --------------------------------------------------------------------------------


def ev(name: str, start: int, end: int, **kw: Any) -> Event:
    return Event(name=name, start=start, end=end, thread=kw.pop("thread", 1), **kw)


def step_events(offset: int, *, item: bool, copy: str | None, orphan: bool = False) -> list[Event]:
    """One training step's events as kineto gives them: ops, their runtime calls, kernels
    (``orphan``: the matmul kernel's link to its op is missing)."""
    o = offset
    events = [
        ev("aten::addmm", o, o + 100, correlation=o + 1),
        ev("cudaLaunchKernel", o + 10, o + 20, correlation=o + 2, linked=o + 1),
        ev("sm90_xmma_gemm_f32f32", o + 30, o + 330, device=True, linked=0 if orphan else o + 1),
        ev("aten::relu", o + 110, o + 150, correlation=o + 3),
        ev("vectorized_elementwise_kernel", o + 340, o + 360, device=True, linked=o + 3),
        ev("Optimizer.step#SGD.step", o + 400, o + 450, correlation=o + 4),
    ]
    if item:
        events += [
            ev("aten::item", o + 500, o + 600, correlation=o + 5),
            ev("aten::_local_scalar_dense", o + 510, o + 590, correlation=o + 6),
            ev("cudaStreamSynchronize", o + 520, o + 580),
            ev("Memcpy DtoH (Device -> Pageable)", o + 530, o + 532, device=True, linked=o + 6),
        ]
    if copy:
        events += [
            ev("aten::copy_", o + 700, o + 720, correlation=o + 7),
            ev(f"Memcpy HtoD ({copy} -> Device)", o + 705, o + 715, device=True, linked=o + 7),
        ]
    return events


def window_frame(began: float, steps: int, **kinds: Any) -> dict[str, Any]:
    events = [e for i in range(steps) for e in step_events(i * 1000, **kinds)]
    totals = aggregate(events)
    ops, _ = ranked(totals.ops, device=totals.device)
    return {"kind": "ops", "began": began, "steps": steps, "sync_points": totals.sync_points,
            "copies": totals.copies, "ops": [to_dict_op(op) for op in ops]}  # fmt: skip


def to_dict_op(op: Any) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(op)


KEY_AVERAGES = [
    {"name": "aten::addmm", "calls": 4, "self_device_us": 1200.0},
    {"name": "aten::relu", "calls": 4, "self_device_us": 80.0},
    {"name": "sm90_xmma_gemm_f32f32", "calls": 4, "self_device_us": 1200.0},
]


def test_op_windows_on_cuda() -> None:
    item = window_frame(10.0, 4, item=True, copy=None)
    pinned = window_frame(20.0, 4, item=False, copy="Pinned")
    pageable = window_frame(30.0, 4, item=False, copy="Pageable")
    frames = [item, pinned, pageable]
    assert cmp.window_in(frames, [19.9, 21.0]) is pinned
    assert cmp.window_in(frames, [40.0, 41.0]) is None

    assert cmp.kernels_attributed(item, KEY_AVERAGES).status == cmp.PASS
    assert cmp.per_step(item, "sync_points", 1.0, "syncs").status == cmp.PASS
    assert cmp.per_step(pinned, "copies", 1.0, "copies").status == cmp.PASS
    assert cmp.per_step(pinned, "sync_points", 0.0, "syncs").status == cmp.PASS
    assert cmp.copies_kinds(pinned, pageable).status == cmp.PASS

    # Kernels that found no launching op; another op on top than the profiler's own table.
    orphan = window_frame(10.0, 4, item=True, copy=None, orphan=True)
    row = cmp.kernels_attributed(orphan, KEY_AVERAGES)
    assert row.failed and row.measured.startswith("ratio 0.068"), row
    others = [{"name": f"aten::op{i}", "calls": 1, "self_device_us": 5000.0} for i in range(3)]
    assert cmp.kernels_attributed(item, [*KEY_AVERAGES, *others]).failed
    assert cmp.kernels_attributed(None, KEY_AVERAGES).failed
    assert cmp.per_step(pinned, "sync_points", 1.0, "syncs").failed
    assert cmp.per_step({**item, "steps": 0}, "sync_points", 1.0, "syncs").failed
    assert cmp.copies_kinds(pageable, pinned).failed
    assert cmp.copies_kinds(pinned, None).failed


# -- demos -------------------------------------------------------------------------------------


def demo_output(results: list[dict[str, Any]], device: str = "cuda") -> str:
    payload = json.dumps({"results": results})
    return f"device: {device}\n| table |\nconclusion\n{cmp.RESULT_PREFIX}{payload}\n"


def entry(name: str, peak: int = 0, seconds: float = 1.0, **extra: Any) -> dict[str, Any]:
    return {"name": name, "peak_bytes": peak, "seconds": seconds, "extra": extra}


def test_demo_direction() -> None:
    good = [entry("broadcasting", 32), entry("repeat", 64), entry("expand().contiguous()", 64)]
    assert cmp.demo_direction("broadcasting", 0, demo_output(good)).status == cmp.PASS
    bad = [entry("broadcasting", 64), entry("repeat", 64), entry("expand().contiguous()", 64)]
    row = cmp.demo_direction("broadcasting", 0, demo_output(bad))
    assert row.failed and "broadcast < repeat" in row.measured
    assert cmp.demo_direction("broadcasting", 0, demo_output(good, "cpu")).failed
    assert cmp.demo_direction("broadcasting", 1, "Traceback\nboom").failed
    assert cmp.demo_direction("broadcasting", 0, "no result").failed
    assert "missing" in cmp.demo_direction("broadcasting", 0, demo_output(good[:1])).measured


def test_every_demo_has_directions() -> None:
    from torchtop.commands.demo_catalog import list_demos

    assert {d.name for d in list_demos()} == set(gpu_check.DEMOS)


# -- cost ----------------------------------------------------------------------------------------


def test_cost_rows() -> None:
    result = {
        "ratio": 1.01,
        "mean_ratio": 1.03,
        "median_pair_ratio": 1.0,
        "median_step_off_ms": 2.1,
    }
    assert cmp.overhead(result).status == cmp.PASS
    assert cmp.overhead({**result, "ratio": 1.2}).failed
    assert cmp.overhead({**result, "mean_ratio": 1.2}).failed
    assert cmp.overhead(None).failed
    assert cmp.history_cost([4e-6, 5e-6], [6e-6, 7e-6]).status == cmp.PASS
    assert cmp.history_cost([4e-6], [40e-6]).failed
    assert cmp.history_cost([], [4e-6]).failed


# -- the table and the outputs -----------------------------------------------------------------


def test_table_lists_every_row_and_the_counts() -> None:
    rows = [
        cmp.check("a", "1", "1", True),
        cmp.check("b", "1", "2", False),
        cmp.check("c", "x", "y", None),
    ]
    text = cmp.table(rows)
    assert text.splitlines()[0].split() == ["check", "expected", "measured", "result"]
    assert text.splitlines()[-1] == "1 passed, 1 failed, 1 skipped"
    assert "FAIL" in text.splitlines()[3]


def test_outputs_fit_what_a_device_call_brings_back(tmp_path: Path) -> None:
    session = gpu_check.Session(tmp_path / "work")
    (tmp_path / "work").mkdir()
    session.keep("a.json", {"x": 1})
    session.keep("big.bin", b"0" * (gpu_check.FIXTURE_BUDGET + 1))
    session.steps.append(gpu_check.Step("demo oom", 0, "out", "err", 1.0))
    out = tmp_path / "g"
    gpu_check.write_outputs(out, session, [cmp.check("a", "1", "1", True)], "table")
    files = sorted(p for p in out.rglob("*") if p.is_file())
    assert [p.name for p in files] == [
        "fixtures.tar.gz",
        "logs.tar.gz",
        "report.txt",
        "results.json",
    ]
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in files)
    with tarfile.open(out / "fixtures.tar.gz") as tar:
        assert tar.getnames() == ["fixtures/a.json"]
    results = json.loads((out / "results.json").read_text())
    assert results["fixtures_left_out"] == [f"big.bin ({gpu_check.FIXTURE_BUDGET + 1} bytes)"]


def test_a_step_past_its_timeout_is_killed(tmp_path: Path) -> None:
    session = gpu_check.Session(tmp_path)
    step = session.run("sleep", [sys.executable, "-c", "import time; time.sleep(60)"], timeout=1)
    assert step.rc is None and "killed after" in step.stderr
    # Near the deadline a step gets only what is left of it, whatever its own timeout.
    session.started = time.monotonic() - gpu_check.DEADLINE_S - gpu_check.STEP_GRACE_S + 1
    t0 = time.monotonic()
    step = session.run("sleep", [sys.executable, "-c", "import time; time.sleep(60)"], timeout=50)
    assert step.rc is None and time.monotonic() - t0 < 20


def test_a_failing_or_crashing_group_does_not_stop_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def passing(s: gpu_check.Session) -> list[cmp.Check]:
        s.keep("cuda_memory_stats_x.json", {"num_ooms": 0})
        return [cmp.check("one", "1", "1", True)]

    def crashing(s: gpu_check.Session) -> list[cmp.Check]:
        raise KeyError("plateaus")

    def failing(s: gpu_check.Session) -> list[cmp.Check]:
        return [cmp.check("two", "1", "2", False)]

    monkeypatch.setattr(gpu_check, "no_cuda_reason", lambda: None)
    monkeypatch.setattr(
        gpu_check,
        "GROUPS",
        [
            ("first", passing, 1),
            ("second", crashing, 1),
            ("third", failing, 1),
            ("too long", passing, gpu_check.DEADLINE_S + 1),
        ],
    )
    assert gpu_check.main(["--out", str(tmp_path / "g")]) == 1
    text = capsys.readouterr().out
    assert "1 passed, 2 failed, 1 skipped" in text
    report = (tmp_path / "g" / "report.txt").read_text()
    assert "crashed: KeyError('plateaus')" in report and "not started" in report
    with tarfile.open(tmp_path / "g" / "fixtures.tar.gz") as tar:
        assert tar.getnames() == ["fixtures/cuda_memory_stats_x.json"]
    monkeypatch.setattr(gpu_check, "GROUPS", [("first", passing, 1)])
    assert gpu_check.main(["--out", str(tmp_path / "h"), "--only", "first"]) == 0


@pytest.mark.slow
def test_the_ops_job_gives_one_window_per_phase_with_its_steps(tmp_path: Path) -> None:
    """The op-window job, on the CPU (no copies there): each phase's window is found by its
    time, counts its 4 steps, and `.item()` every step is one host read a step (on a GPU, one
    sync point a step)."""
    (tmp_path / "work").mkdir()
    session = gpu_check.Session(tmp_path / "work")
    record, out = tmp_path / "ops.ttr", tmp_path / "ops.json"
    step = session.torchtop("ops", record, [str(gpu_check.JOBS), "ops", str(out), "cpu"], 240)
    assert step.rc == 0, step.stderr
    truth = json.loads(out.read_text())
    frames = gpu_check.load_frames(record)
    windows = {name: cmp.window_in(frames, span) for name, span in truth["phases"].items()}
    assert all(truth["phases"][name][2] == 1.0 for name in windows), truth["phases"]
    assert [w and w["steps"] for w in windows.values()] == [4, 4, 4]
    assert cmp.per_step(windows["item"], "host_reads", 1.0, "reads").status == cmp.PASS
    assert cmp.per_step(windows["pinned"], "host_reads", 0.0, "reads").status == cmp.PASS
    assert truth["events"] and any(a["name"] == "aten::addmm" for a in truth["key_averages"])


@pytest.mark.slow
def test_the_overhead_job_gives_the_ratios_the_cost_row_reads(tmp_path: Path) -> None:
    session = gpu_check.Session(tmp_path)
    out = tmp_path / "overhead.json"
    step = session.run(
        "overhead", [sys.executable, str(gpu_check.JOBS), "overhead", str(out), "cpu"], 240
    )
    assert step.rc == 0, step.stderr
    row = cmp.overhead(json.loads(out.read_text()))
    assert row.status in (cmp.PASS, cmp.FAIL) and row.measured.startswith("median "), row


def test_the_oom_fixtures_it_saves_feed_the_agents_flow(tmp_path: Path) -> None:
    """What the OOM jobs write becomes a tests/fixtures/cuda_snapshot_*.json: the agent's flow
    reads it as it reads the committed ones."""
    data = fixture("cuda_snapshot_fragmented.json")
    truth = {
        "requested": data["observer"]["alloc"],
        "observer": [{**data["observer"], "memory_stats": data["memory_stats"], "t": 1.0}],
        "snapshot": data["snapshot"],
    }
    saved = gpu_check._observer_fixture(truth)
    assert saved is not None
    assert saved["observer"] == data["observer"]
    assert list(saved["memory_stats"]) == sorted(data["memory_stats"])
    (tmp_path / "b").mkdir()
    a, b = agent_oom_event(tmp_path, saved), agent_oom_event(tmp_path / "b", data)
    for key in ("t", "snapshot_path"):
        del a[key], b[key]
    assert a == b
    assert gpu_check._observer_fixture({**truth, "observer": []}) is None


# -- the rows added for the second reading of the CUDA paths ------------------------------------


def agent_frames(
    tmp_path: Path, data: dict[str, Any], others: list[Any] | None = None, handled: int = 0
) -> list[dict[str, Any]]:
    """The agent's frames for a failure from a snapshot fixture: its ``oom`` event (observers
    called as the allocator calls them: the agent's, then ``others``) and a sample with its
    count of handled failures."""
    messages: list[Message] = []
    controller = OomController(AgentConfig(), messages.append, pid=4242, snapshot_dir=tmp_path)
    controller.cuda_sources = {
        "snapshot": lambda: data["snapshot"],
        "stats": lambda device: data["memory_stats"],
        "grad_enabled": lambda: True,
    }
    obs = data["observer"]
    args = (obs["device"], obs["alloc"], obs["device_total"], obs["device_free"])
    fail_into_job([controller.observe_cuda_oom, *(others or [])], args)
    probe = CudaMemoryProbe(
        cuda_module(data["memory_stats"], obs["device_free"], obs["device_total"]),
        handled_ooms=lambda device: controller.handled_ooms(device) + handled,
    )
    sample = to_dict(Sample(t=2.0, host=None, memory=probe.read()))
    return [to_dict(m) for m in messages if isinstance(m, OutOfMemory)] + [sample]


def test_an_oom_is_published_with_the_jobs_own_observer_attached(tmp_path: Path) -> None:
    data = fixture("cuda_snapshot_full.json")
    calls: list[tuple[int, ...]] = []
    frames = agent_frames(tmp_path, data, others=[lambda *args: calls.append(args)])
    truth = {"observer": [{"t": 1.0}] * len(calls)}
    row = cmp.published_with_second_observer(frames, truth)
    assert row.status == cmp.PASS and len(calls) == 1, row
    # What an agent that took the second observer's call for torch going on would record.
    hidden = [{**frames[-1], "memory": [{**frames[-1]["memory"][0], "handled_ooms": 1}]}]
    row = cmp.published_with_second_observer(hidden, truth)
    assert row.failed and "0 oom events; 1 counted handled" in row.measured
    assert cmp.published_with_second_observer(frames, {"observer": []}).failed


def test_an_oom_in_backward(tmp_path: Path) -> None:
    data = fixture("cuda_snapshot_full.json")
    (event, _) = agent_frames(tmp_path, data)
    requested = event["requested_bytes"]
    call = {"main_thread": False, "trace_oom_size": requested}
    truth = {"observer": [call], "raised": "CUDA out of memory. Tried to allocate 4.00 GiB."}
    in_backward = {**event, "in_backward": True}
    assert cmp.backward_oom([in_backward], truth).status == cmp.PASS
    assert cmp.backward_oom([event], truth).failed  # not marked as in backward
    assert cmp.backward_oom([], truth).failed
    assert cmp.backward_oom([{**in_backward, "requested_bytes": requested + MIB}], truth).failed
    assert cmp.backward_oom([in_backward], {**truth, "raised": ""}).failed
    in_main = {**truth, "observer": [{**call, "main_thread": True}]}
    assert cmp.backward_oom([in_backward], in_main).status == cmp.SKIP


def test_what_holds_the_memory_at_an_oom_in_backward() -> None:
    big, small = 256 * MIB, 32 * 1024  # an 8192x8192 float32 weight and its bias, as blocks
    truth = {
        "parameters": big + small,
        "gradients": big + small,
        "optimizer_state": big + small,
        "raised": "CUDA out of memory. Tried to allocate 256.00 MiB.",
    }
    split = [
        {"category": "parameters", "bytes": big + small},
        {"category": "gradients", "bytes": big + small},
        {"category": "optimizer_state", "bytes": big + 2 * MIB},  # a block left unsplit
        {"category": "other_allocated", "bytes": 3 * big},
    ]
    event = {"kind": "oom", "by_category": split}
    assert cmp.holders_at_backward_oom([event], truth).status == cmp.PASS
    # Read off the training thread, the gradients would be left out: that must fail.
    no_grads = [{**c, "bytes": 0} if c["category"] == "gradients" else c for c in split]
    assert cmp.holders_at_backward_oom([{**event, "by_category": no_grads}], truth).failed
    assert cmp.holders_at_backward_oom([{"kind": "oom", "by_category": []}], truth).failed
    assert cmp.holders_at_backward_oom([], truth).failed
    assert cmp.holders_at_backward_oom([event], {**truth, "raised": ""}).failed


def test_the_holders_job_is_one_of_the_oom_runs() -> None:
    from benchmarks.gpu_check_jobs import JOBS

    assert gpu_check.OOM_RUNS["holders"][2] == ["oom-holders"] and "oom-holders" in JOBS


def test_free_blocks_on_the_failing_stream(tmp_path: Path) -> None:
    # The fixture's side stream holds a free 16 MiB block; the failing stream's largest is
    # 2 MiB. The job's observer reads both from the snapshot as below.
    from benchmarks.gpu_check_jobs import free_blocks

    data = fixture("cuda_snapshot_rounded.json")
    (oom_entry,) = [e for e in data["snapshot"]["device_traces"][0] if e["action"] == "oom"]
    stream = oom_entry["stream"]
    call = {
        "largest_free_block": max(free_blocks(data["snapshot"], 0)),
        "largest_free_block_on_stream": max(free_blocks(data["snapshot"], 0, stream)),
    }
    assert (call["largest_free_block"], call["largest_free_block_on_stream"]) == (
        16 * MIB,
        2 * MIB,
    )
    frames = agent_frames(tmp_path, data)
    truth = {"observer": [call]}
    assert cmp.free_blocks_on_the_failing_stream(frames, truth).status == cmp.PASS
    every_stream = [{**frames[0], "largest_free_block_bytes": 16 * MIB}]
    assert cmp.free_blocks_on_the_failing_stream(every_stream, truth).failed
    assert cmp.free_blocks_on_the_failing_stream([], truth).failed
    same = {"observer": [{**call, "largest_free_block": 2 * MIB}]}
    assert cmp.free_blocks_on_the_failing_stream(frames, same).status == cmp.SKIP


def test_the_cuda_malloc_async_backend(tmp_path: Path) -> None:
    # On cudaMallocAsync, history and maybe the observer are refused: the agent says so.
    messages: list[Message] = []
    controller = OomController(AgentConfig(), messages.append, pid=1, snapshot_dir=tmp_path)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("not supported by the cudaMallocAsync backend")

    cuda = SimpleNamespace(memory=SimpleNamespace(_record_memory_history=refuse))
    controller.install_cuda(cuda, SimpleNamespace(_cuda_attach_out_of_memory_observer=refuse))
    reasons = [to_dict(m) for m in messages]
    truth = {"message": "CUDA out of memory. Tried to allocate 280.00 GiB."}
    row = cmp.async_backend(0, reasons, truth)
    assert row.status == cmp.PASS and "no event" in row.measured, row
    assert cmp.async_backend(0, [{"kind": "oom", "t": 1.0}], truth).status == cmp.PASS
    assert cmp.async_backend(0, [], truth).failed  # silence
    assert cmp.async_backend(1, reasons, truth).failed  # the job broke
    assert cmp.async_backend(0, reasons, {"message": ""}).failed
    assert cmp.async_backend(0, reasons, None).failed


def test_the_agent_never_initialises_cuda_in_a_cpu_job() -> None:
    from torchtop.agent.ops import PROBE, WAITING_FOR_CUDA
    from torchtop.protocol import ProbeStatus

    waiting = to_dict(
        ProbeStatus(t=1.0, probe=PROBE, available=False, detail=f"op timings: {WAITING_FOR_CUDA}")
    )
    truth = {"seconds": 6.6, "libcuda_mapped": False, "cuda_initialized": False}
    assert cmp.never_initialised_cuda([waiting], truth, 6.0).status == cmp.PASS
    assert cmp.never_initialised_cuda([{"kind": "ops"}], truth, 6.0).status == cmp.PASS
    assert cmp.never_initialised_cuda([waiting], {**truth, "libcuda_mapped": True}, 6.0).failed
    assert cmp.never_initialised_cuda([waiting], {**truth, "cuda_initialized": True}, 6.0).failed
    assert cmp.never_initialised_cuda([waiting], {**truth, "seconds": 2.0}, 6.0).failed
    assert cmp.never_initialised_cuda([], truth, 6.0).failed  # no window and no reason


def test_free_under_a_memory_fraction_against_what_the_job_could_allocate() -> None:
    # 4 GiB cap on an H200, 1 GiB held; the job then found it could get 3 GiB - 2 MiB more.
    stats = fixture("cuda_memory_stats_untouched.json")
    stats = {**stats, "reserved_bytes.all.current": GIB, "reserved_bytes.all.peak": GIB}
    total, device_free = 150_754_820_096, 130 * GIB
    fraction = 4 * GIB / total
    plateau = {"t0": 10.0, "t1": 12.0, "device": "cuda:0", "allocatable": 3 * GIB - 2 * MIB,
               "resolution": 2 * MIB, "mem_get_info": [device_free, total]}  # fmt: skip

    def frames(cuda: SimpleNamespace) -> list[dict[str, Any]]:
        probe = CudaMemoryProbe(cuda)
        return [to_dict(Sample(t=t, host=None, memory=probe.read())) for t in (10.5, 11.5)]

    capped = cuda_module(stats, device_free, total)
    capped.get_per_process_memory_fraction = lambda device: fraction
    row = cmp.free_under_cap_matches(frames(capped), plateau)
    assert row.status == cmp.PASS and row.measured.startswith("2 samples"), row
    # The device's free memory, the cap ignored: what the panel showed before.
    row = cmp.free_under_cap_matches(frames(cuda_module(stats, device_free, total)), plateau)
    assert row.failed, row
    assert cmp.free_under_cap_matches([], plateau).failed
    assert cmp.free_under_cap_matches(frames(capped), None).failed
    unbound = {**plateau, "mem_get_info": [3 * GIB, total]}
    assert cmp.free_under_cap_matches(frames(capped), unbound).status == cmp.SKIP


def test_kernels_queued_at_a_windows_close_are_counted() -> None:
    def window(kernel_end: int) -> dict[str, Any]:
        # 24 matmul kernels launched at once; the window holds those that ended before its
        # close (without a sync, the first only).
        events = [ev("aten::mm", 0, 100, correlation=1)]
        events += [
            ev("sm90_xmma_gemm", 200 + i * 15_000, 200 + (i + 1) * 15_000, device=True, linked=1)
            for i in range(kernel_end)
        ]
        totals = aggregate(events)
        ops, _ = ranked(totals.ops, device=totals.device)
        return {"kind": "ops", "began": 1.0, "ops": [to_dict_op(op) for op in ops]}

    kernel_s = 24 * 15_000 / 1e9
    assert cmp.queued_kernels_counted(window(24), kernel_s).status == cmp.PASS
    row = cmp.queued_kernels_counted(window(1), kernel_s)
    assert row.failed and row.measured.startswith("0 ms"), row
    assert cmp.queued_kernels_counted(None, kernel_s).failed
    assert cmp.queued_kernels_counted(window(24), None).failed


def test_rows_for_a_gpu_seen_by_uuid_say_so() -> None:
    rows = smi_read(1.0, [FakeGpu()])["rows"]
    label = gpu_check.VISIBLE_LABEL
    row = cmp.nvml_gpu_matched_by_uuid([], "x", rows, job=label)
    assert row.name.endswith(f"({label})") and row.failed
    assert cmp.hello_uuid([], "x", rows, job=label).name.endswith(f"({label})")


# -- the preflight ---------------------------------------------------------------------------------


def test_the_preflight_says_each_dependency_and_skips_what_needs_a_missing_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ran: list[str] = []

    def group(name: str) -> Any:
        def run(s: gpu_check.Session) -> list[cmp.Check]:
            ran.append(name)
            nvml = s.needs(gpu_check.NVML_DEPENDENCY, "nvml: a row")
            return [nvml or cmp.check("nvml: a row", "1", "1", True)]

        return run

    def answer() -> None:
        gpu_check.ENVIRONMENT.update(
            torch="2.13.0", cuda_runtime="12.8",
            dependencies={"psutil": "ok 7.0.0", "rich": "missing (ModuleNotFoundError: No "
                          "module named 'rich')", "nvidia-ml-py": "missing (ImportError: x)"},
        )  # fmt: skip

    monkeypatch.setattr(gpu_check, "no_cuda_reason", answer)
    monkeypatch.setattr(
        gpu_check, "GROUPS", [("cost", group("cost"), 1), ("demos", group("demos"), 1)]
    )
    assert gpu_check.main(["--out", str(tmp_path / "g")]) == 0
    out = capsys.readouterr().out.splitlines()
    preflight = [line for line in out if line.startswith("preflight:")]
    assert preflight[0] == "preflight: torch 2.13.0 with CUDA 12.8: ok"
    assert preflight[1] == "preflight: psutil 7.0.0: ok"
    assert preflight[2].startswith("preflight: rich: missing (ModuleNotFoundError")
    assert "demos" in preflight[2] and "pip install rich" in preflight[2]
    assert "the NVML rows" in preflight[3]
    assert ran == ["cost"]  # demos need rich
    report = (tmp_path / "g" / "report.txt").read_text()
    assert "skipped: needs rich, missing" in report
    assert "skipped: needs nvidia-ml-py" in report
    assert "0 passed, 0 failed, 2 skipped" in report


def test_the_clock_starts_before_the_preflight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Importing torch took most of the time: the groups that no longer fit do not start, and
    # the check says so at the end.
    def slow_answer() -> None:
        gpu_check.ENVIRONMENT.update(dependencies=dict.fromkeys(gpu_check.DEPENDENCIES, "ok 1"))
        monkeypatch.setattr(time, "monotonic", lambda: real() + gpu_check.DEADLINE_S - 10)

    real = time.monotonic
    monkeypatch.setattr(gpu_check, "no_cuda_reason", slow_answer)
    monkeypatch.setattr(
        gpu_check,
        "GROUPS",
        [("quick", lambda s: [cmp.check("q", "1", "1", True)], 5), ("long", lambda s: [], 40)],
    )
    assert gpu_check.main(["--out", str(tmp_path / "g")]) == 0
    out = capsys.readouterr().out
    assert "these groups did not start: long" in out
    assert "1 passed, 0 failed, 1 skipped" in out


@pytest.mark.slow
def test_the_collectives_rows_on_a_one_rank_group(tmp_path: Path) -> None:
    """The collectives job under ``torchtop run``, on gloo (the CPU; the check runs it on
    NCCL): the agent's frames hold every collective the job enqueued, equal to the job's own
    dump; gloo has no completion, so that row skips. Then each row on damaged data fails."""
    (tmp_path / "work").mkdir()
    session = gpu_check.Session(tmp_path / "work")
    record, out = tmp_path / "c.ttr", tmp_path / "c.json"
    step = session.torchtop(
        "collectives", record, [str(gpu_check.JOBS), "collectives", str(out), "gloo"], 120
    )
    assert step.rc == 0, step.stderr
    truth = json.loads(out.read_text())
    frames = gpu_check.load_frames(record)
    rows = cmp.collectives_checks(frames, truth)
    assert statuses(rows) == [cmp.PASS, cmp.PASS, cmp.SKIP], rows
    assert rows[0].measured == "13 sent, 0 differ"
    assert truth["buffer"] == str(DEFAULT_RING)  # torchtop run turned the recorder on

    def edited(change: Any) -> list[dict[str, Any]]:
        out = []
        for frame in frames:
            if frame.get("kind") == "collectives":
                frame = {**frame, "entries": [change(dict(e)) for e in frame["entries"]]}
                frame["entries"] = [e for e in frame["entries"] if e is not None]
            out.append(frame)
        return out

    missing = edited(lambda e: None if e["seq"] == 5 else e)
    assert statuses(cmp.collectives_checks(missing, truth))[:2] == [cmp.FAIL, cmp.FAIL]
    moved = edited(lambda e: {**e, "enqueued_ns": e["enqueued_ns"] + 1})
    assert statuses(cmp.collectives_checks(moved, truth))[:2] == [cmp.PASS, cmp.FAIL]
    # On NCCL: every entry needs its start and completion, in order after its enqueue.
    nccl = {**truth, "backend": "nccl"}
    timed = edited(
        lambda e: {**e, "started_ns": e["enqueued_ns"] + 10, "completed_ns": e["enqueued_ns"] + 99}
    )
    assert cmp.collectives_checks(timed, nccl)[2].status == cmp.PASS
    assert cmp.collectives_checks(frames, nccl)[2].status == cmp.FAIL
    assert statuses(cmp.collectives_checks([], None)) == [cmp.FAIL] * 3


def energy_run(
    idle_w: float = 70.0, agent_scale: float = 1.0
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[Message]]:
    """A busy plateau (0-4 s at 612.4 W) then an idle one (4-8 s at ``idle_w``) on the fake's
    counter, kept continuous across the change of power. The job reads its counter at the
    plateaus' edges; the agent once a second (its GPU matched to cuda:0), and a step ends every
    0.25 s. ``agent_scale`` makes the agent's counter wrong by that factor."""
    from torchtop.protocol import StepStats

    backend = FakeNvmlBackend([FakeGpu()])
    gpu = backend.gpus[0]
    probe = NvmlProbe(backend, job_uuids=lambda: [gpu.uuid[4:]])
    backend.init()

    def at(t: float) -> None:
        if t >= 4.0 and gpu.power_w != idle_w:
            gpu.clock_s = 4.0
            counter = backend.energy_mj(0)
            gpu.power_w = idle_w
            gpu.energy_mj_at_zero = counter - round(idle_w * 4.0 * 1000)
        gpu.clock_s = t

    plateaus = []
    for kind, t0, t1 in (("busy", 0.0, 4.0), ("idle", 4.0, 8.0)):
        at(t0)
        before = backend.energy_mj(0)
        at(t1)
        plateaus.append(
            {"kind": kind, "t0": t0, "t1": t1, "energy_mj": [before, backend.energy_mj(0)]}
        )
    gpu.power_w, gpu.energy_mj_at_zero = 612.4, FakeGpu().energy_mj_at_zero
    messages: list[Message] = []
    total = 0
    for second in range(1, 8):
        at(second - 0.5)
        stats = probe.read()
        if agent_scale != 1.0:
            first = stats[0]
            scaled = FakeGpu().energy_mj_at_zero + round(
                (first.energy_mj - FakeGpu().energy_mj_at_zero) * agent_scale  # type: ignore[operator]
            )
            stats = [dataclasses.replace(first, energy_mj=scaled)]
        messages.append(GpuSample(t=second - 0.5, gpus=stats))
        ends = [second - 1 + 0.25 * k + 0.1 for k in range(4)]
        total += 4
        messages.append(
            StepStats(
                t=second, total=total, skipped_total=0, count=4, skipped=0, timed=4,
                time_s=1.0, wait_s=0.0, startup_s=0.0, optimizer_s=0.0, samples=0,
                ends=ends, durations=[0.25] * 4,
            )
        )  # fmt: skip
    return [to_dict(m) for m in messages], plateaus, messages


def test_the_agents_energy_counter_against_the_jobs_own_reads() -> None:
    frames, plateaus, _ = energy_run()
    row = cmp.nvml_energy_matches_job(frames, plateaus)
    assert row.status == cmp.PASS, row
    assert row.measured == "busy 612 W (job) / 612 W (agent), idle 70 W (job) / 70 W (agent)"
    # An agent whose counter is half the job's fails; a job that could not read it skips.
    wrong, _, _ = energy_run(agent_scale=0.5)
    assert cmp.nvml_energy_matches_job(wrong, plateaus).status == cmp.FAIL
    unread = [{**p, "energy_mj": [None, None]} for p in plateaus]
    assert cmp.nvml_energy_matches_job(frames, unread).status == cmp.SKIP
    # A GPU without the counter in the agent's frames fails.
    none = [
        {**f, "gpus": [{**g, "energy_mj": None} for g in f["gpus"]]} if f["kind"] == "gpu" else f
        for f in frames
    ]
    assert cmp.nvml_energy_matches_job(none, plateaus).status == cmp.FAIL


def test_the_reports_joules_per_step_against_the_counter_over_the_steps() -> None:
    from torchtop.report.job import summarize

    frames, _, messages = energy_run()
    energy = summarize(messages)["energy"]
    row = cmp.energy_per_step_matches_counter(frames, energy)
    # Readings at 0.5 and 6.5 s; steps end at 0.6, 0.85 ... 6.35: 24 in between.
    assert row.status == cmp.PASS, row
    assert row.measured.endswith("over 24 steps")
    off = {
        "cuda:0": {
            **energy["cuda:0"],
            "joules_per_step": energy["cuda:0"]["joules_per_step"] * 1.01,
        }
    }
    assert cmp.energy_per_step_matches_counter(frames, off).status == cmp.FAIL
    assert cmp.energy_per_step_matches_counter(frames, None).status == cmp.FAIL
