"""JobModel: what each message means to the viewer, without an app."""

from __future__ import annotations

import pytest

from torchtop.model.connection import SourceConnected, SourceDisconnected, SourceStatus
from torchtop.model.job import JobModel, visible_text
from torchtop.protocol import (
    ClientHello,
    DeviceInfo,
    Dropped,
    GpuSample,
    GpuStats,
    Hello,
    HostStats,
    JobExited,
    LogLine,
    Marked,
    MemoryStats,
    PhaseBegan,
    PhaseEnded,
    ProbeStatus,
    Sample,
)

T0 = 1_700_000_000.0
GiB = 1 << 30


def hello(devices: list[DeviceInfo] | None = None) -> Hello:
    return Hello(
        protocol=1,
        pid=4242,
        argv=["python", "train.py"],
        cwd="/work",
        started_at=T0 - 10,
        python="3.11.9",
        torch="2.4.0",
        devices=devices if devices is not None else [DeviceInfo("cpu", "cpu")],
        interval_s=0.1,
    )


def cuda(allocated: int | None, reserved: int | None, **extra: int | None) -> MemoryStats:
    return MemoryStats("cuda:0", "cuda-allocator", allocated, reserved, **extra)


def sample(t: float, *memory: MemoryStats, host: HostStats | None = None) -> Sample:
    return Sample(t, host, list(memory))


HOST = HostStats(3 * GiB, 104.0, 24, 4, 100 * GiB, 250 * GiB)


# -- identity and time -------------------------------------------------------------------------


def test_hello_sets_identity_and_makes_the_state_live() -> None:
    state = JobModel()
    assert state.connection == "connecting"
    state.apply(hello())
    assert state.hello is not None and state.hello.pid == 4242
    assert state.connection == "live"
    assert state.now == T0 - 10
    assert state.uptime == 0.0


def test_now_and_uptime_come_from_message_times_not_the_clock() -> None:
    state = JobModel(mode="replay")
    state.apply(hello())
    state.apply(sample(T0, cuda(1, 2)))
    assert state.now == T0
    assert state.uptime == pytest.approx(10.0)
    # An older message (out of order) does not move time backwards.
    state.apply(LogLine(T0 - 5, "stdout", "late"))
    assert state.now == T0
    assert state.first_t == T0 - 5
    assert state.mode == "replay"


def test_uptime_is_none_without_hello() -> None:
    state = JobModel()
    state.apply(sample(T0, cuda(1, 2)))
    assert state.uptime is None


# -- memory ------------------------------------------------------------------------------------


def test_series_are_bounded() -> None:
    state = JobModel(history_points=50)
    for i in range(200):
        state.apply(sample(T0 + i / 10, cuda(i, 2 * i), host=HOST))
    memory = state.memory["cuda:0"]
    assert len(memory.series) == 50
    assert memory.series[0].t == pytest.approx(T0 + 15.0)
    assert memory.series[-1].allocated == 199
    assert len(state.rss_series) == 50


def test_cache_is_reserved_minus_allocated_and_fragmented_is_inactive_split() -> None:
    state = JobModel()
    state.apply(sample(T0, cuda(3 * GiB, 5 * GiB, inactive_split_bytes=GiB // 4)))
    memory = state.memory["cuda:0"]
    # The cache holds whole free segments as well; only the split ones are fragmentation.
    assert memory.cache == 2 * GiB and memory.fragmented == GiB // 4
    state.apply(sample(T0 + 1, cuda(None, 5 * GiB)))
    assert state.memory["cuda:0"].cache is None and state.memory["cuda:0"].fragmented is None
    state.apply(sample(T0 + 2, cuda(3 * GiB, None)))
    assert state.memory["cuda:0"].cache is None


def test_ooms_the_job_saw_leave_out_those_torch_handled() -> None:
    state = JobModel()
    state.apply(sample(T0, cuda(3 * GiB, 5 * GiB, num_ooms=5, handled_ooms=4)))
    assert state.memory["cuda:0"].ooms == 1
    state.apply(sample(T0 + 1, cuda(3 * GiB, 5 * GiB, num_ooms=2)))
    assert state.memory["cuda:0"].ooms == 2


def test_peaks_are_running_maxima_of_peak_fields_and_current_values() -> None:
    state = JobModel()
    state.apply(sample(T0, cuda(4, 8, peak_allocated_bytes=6, peak_reserved_bytes=8)))
    memory = state.memory["cuda:0"]
    assert (memory.peak_allocated, memory.peak_reserved) == (6, 8)
    # The agent's peak may be reset; ours keeps the highest seen.
    state.apply(sample(T0 + 1, cuda(2, 3, peak_allocated_bytes=2, peak_reserved_bytes=3)))
    assert (memory.peak_allocated, memory.peak_reserved) == (6, 8)
    # Without peak fields, the current values raise the peak.
    state.apply(sample(T0 + 2, cuda(10, 12)))
    assert (memory.peak_allocated, memory.peak_reserved) == (10, 12)
    state.apply(sample(T0 + 3, cuda(None, None)))
    assert (memory.peak_allocated, memory.peak_reserved) == (10, 12)


def test_primary_device_is_the_first_cuda_device_else_cpu() -> None:
    state = JobModel()
    assert state.primary_device == "cpu"
    state.apply(sample(T0, MemoryStats("cpu", "cpu-heap", 1, 2)))
    assert state.primary_device == "cpu"
    state.apply(
        sample(
            T0 + 1,
            MemoryStats("cpu", "cpu-heap", 1, 2),
            MemoryStats("cuda:1", "cuda-allocator", 5, 6),
            MemoryStats("cuda:0", "cuda-allocator", 3, 4),
        )
    )
    assert state.primary_device == "cuda:0"
    assert state.primary_memory is state.memory["cuda:0"]
    assert state.device_ids == ["cuda:0", "cuda:1", "cpu"]


def test_a_job_on_one_gpu_of_a_node_shows_that_gpu() -> None:
    # The hello lists every GPU the node lets the job see; the CUDA probe samples only the
    # devices the job has reserved memory on: here cuda:3.
    node = [DeviceInfo("cpu", "cpu")] + [
        DeviceInfo(f"cuda:{i}", "NVIDIA H200", 141 * GiB) for i in range(8)
    ]
    state = JobModel()
    state.apply(hello(node))
    assert state.primary_device == "cpu" and state.used_devices == ["cpu"]
    state.apply(
        sample(
            T0,
            MemoryStats("cpu", "cpu-heap", 1, 2),
            MemoryStats("cuda:3", "cuda-allocator", 3 * GiB, 4 * GiB),
        )
    )
    assert state.primary_device == "cuda:3" and state.used_devices == ["cuda:3"]
    assert state.primary_memory is state.memory["cuda:3"]


def test_a_job_on_several_gpus_shows_them_all_and_one_that_never_held_memory_not() -> None:
    state = JobModel()
    state.apply(hello([DeviceInfo(f"cuda:{i}", "NVIDIA H200") for i in range(4)]))
    state.apply(
        sample(
            T0,
            MemoryStats("cuda:0", "cuda-allocator", 0, 0, peak_allocated_bytes=0),
            MemoryStats("cuda:2", "cuda-allocator", 3 * GiB, 4 * GiB),
            MemoryStats("cuda:1", "cuda-allocator", 0, 2 * GiB),
        )
    )
    assert state.used_devices == ["cuda:1", "cuda:2"] and state.primary_device == "cuda:1"


def test_a_cpu_job_on_a_gpu_node_shows_the_cpu() -> None:
    state = JobModel()
    state.apply(hello([DeviceInfo("cpu", "cpu"), DeviceInfo("cuda:0", "NVIDIA H200")]))
    state.apply(sample(T0, MemoryStats("cpu", "cpu-heap", 1, 2)))
    assert state.primary_device == "cpu" and state.primary_memory is state.memory["cpu"]


@pytest.mark.parametrize(
    ("source", "allocated_label", "reserved_label"),
    [
        ("cpu-heap", "heap", "RSS"),
        ("cpu-rss", "RSS", "RSS"),
        ("cuda-allocator", "allocated", "reserved"),
    ],
)
def test_memory_labels_say_what_the_numbers_are(
    source: str, allocated_label: str, reserved_label: str
) -> None:
    device = "cpu" if source.startswith("cpu") else "cuda:0"
    state = JobModel()
    state.apply(sample(T0, MemoryStats(device, source, 1, 2)))
    memory = state.memory[device]
    assert memory.allocated_label == allocated_label
    assert memory.reserved_label == reserved_label
    assert memory.is_cuda == (device == "cuda:0")


# -- host, GPUs, probes -------------------------------------------------------------------------


def test_the_jobs_gpus_come_first_and_other_jobs_gpus_count_in_no_peak() -> None:
    # As the agent sends them once matched by UUID: NVML's GPU 2 is the job's cuda:0, a MIG
    # instance follows its GPU, GPU 0 belongs to another job.
    state = JobModel()
    rows = [
        GpuStats(2, "H100", 40.0, cuda_device="cuda:0", in_job=True),
        GpuStats(0, "H100", 99.0, in_job=False),
        GpuStats(1, "A100", 10.0, in_job=False),
        GpuStats(0, "A100 MIG 3g.40gb", None, mig_parent=1, in_job=False),
    ]
    state.apply(GpuSample(T0, rows))
    assert [(g.index, g.mig_parent) for g in state.gpu_rows] == [
        (2, None),
        (0, None),
        (1, None),
        (0, 1),
    ]
    assert state.gpus[0].name == "H100"  # a MIG instance's index never hides a GPU's
    assert state.gpu_peak_util == {2: 40.0}


def test_host_gpus_and_probes() -> None:
    state = JobModel()
    state.apply(sample(T0, host=HOST))
    assert state.host == HOST
    assert list(state.rss_series) == [(T0, 3 * GiB)]
    gpus = [GpuStats(1, "H200", 50.0), GpuStats(0, "H200", 97.0)]
    state.apply(GpuSample(T0, gpus))
    assert sorted(state.gpus) == [0, 1]
    assert state.gpus[0].util_gpu_percent == 97.0
    # A later reading replaces the earlier one; a lost GPU stays listed as lost.
    state.apply(GpuSample(T0 + 1, [GpuStats(0, "H200", lost=True)]))
    assert list(state.gpus) == [0] and state.gpus[0].lost
    assert state.nvml is None
    state.apply(ProbeStatus(T0, "nvml", False, "libnvidia-ml.so.1 not found"))
    state.apply(ProbeStatus(T0, "psutil", True, "ok"))
    assert state.nvml is not None and not state.nvml.available
    assert state.probes["psutil"].available


# -- phases and marks ----------------------------------------------------------------------------


def test_phases_begin_and_end_by_id() -> None:
    state = JobModel()
    state.apply(PhaseBegan(T0, "repeat", 1))
    state.apply(PhaseBegan(T0 + 1, "inner", 2))
    assert [(p.name, p.start, p.end) for p in state.phases] == [
        ("repeat", T0, None),
        ("inner", T0 + 1, None),
    ]
    assert all(p.running for p in state.phases)
    state.apply(PhaseEnded(T0 + 2, "inner", 2))
    state.apply(PhaseEnded(T0 + 3, "repeat", 1))
    assert [(p.id, p.end) for p in state.phases] == [(1, T0 + 3), (2, T0 + 2)]
    assert state.phases_between(T0 + 2.5, T0 + 10)[0].name == "repeat"
    assert len(state.phases_between(T0 + 2.5, T0 + 10)) == 1


def test_a_phase_that_ends_without_a_beginning_started_before_our_history() -> None:
    state = JobModel()
    state.apply(PhaseEnded(T0, "warmup", 7))
    (phase,) = state.phases
    assert (phase.name, phase.start, phase.end) == ("warmup", None, T0)
    assert state.phases_between(T0 - 100, T0 - 50) == [phase]


def test_marks() -> None:
    state = JobModel()
    state.apply(Marked(T0, "checkpoint"))
    state.apply(Marked(T0 + 5, "eval"))
    assert [m.name for m in state.marks] == ["checkpoint", "eval"]
    assert [m.name for m in state.marks_between(T0 + 1, T0 + 6)] == ["eval"]


def test_phases_and_marks_are_bounded() -> None:
    state = JobModel(max_events=10)
    for i in range(30):
        state.apply(PhaseBegan(T0 + i, f"step{i}", i))
        state.apply(PhaseEnded(T0 + i + 0.5, f"step{i}", i))
        state.apply(Marked(T0 + i, "m"))
    assert len(state.phases) == 10
    assert state.phases[0].name == "step20"
    assert len(state.marks) == 10


# -- logs ----------------------------------------------------------------------------------------


def test_logs_are_bounded_and_counted() -> None:
    state = JobModel(log_lines=5)
    for i in range(12):
        state.apply(LogLine(T0 + i, "stdout" if i % 2 else "stderr", f"line {i}"))
    assert state.log_total == 12
    assert [entry.text for entry in state.logs] == [f"line {i}" for i in range(7, 12)]
    assert state.logs[-1].stream == "stdout"
    assert state.logs[-2].stream == "stderr"


def test_progress_bar_redraws_keep_the_text_after_the_last_carriage_return() -> None:
    state = JobModel()
    state.apply(LogLine(T0, "stderr", " 10%|#   |\r 50%|#### |\r100%|########|"))
    state.apply(LogLine(T0, "stdout", "windows line ending\r"))
    assert [entry.text for entry in state.logs] == ["100%|########|", "windows line ending"]


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("plain", "plain"),
        ("a\rb", "b"),
        ("a\rb\r", "b"),
        ("a\r\n", "a"),
        ("\r", ""),
        ("", ""),
    ],
)
def test_visible_text(raw: str, shown: str) -> None:
    assert visible_text(raw) == shown


# -- connection, drops, exit ---------------------------------------------------------------------


def test_dropped_is_the_latest_running_total() -> None:
    state = JobModel()
    state.apply(Dropped(T0, 3))
    state.apply(Dropped(T0 + 1, 10))
    assert state.dropped == 10


def test_exit_then_disconnect_is_ended() -> None:
    state = JobModel()
    state.apply(SourceConnected(T0, "/tmp/agent.sock"))
    assert state.connection == "live" and state.address == "/tmp/agent.sock"
    state.apply(hello())
    state.apply(JobExited(T0 + 1, 1, "Traceback"))
    assert state.job_ended and state.exit_code == 1 and state.exit_reason == "Traceback"
    assert state.connection == "ended"
    state.apply(SourceDisconnected(T0 + 1, "job exited"))
    assert state.connection == "ended"
    assert not state.lost
    assert state.status_label == "ended (exit 1)"


def test_disconnect_without_exit_is_lost_and_keeps_the_data() -> None:
    state = JobModel()
    state.apply(hello())
    state.apply(sample(T0, cuda(1 * GiB, 2 * GiB), host=HOST))
    state.apply(LogLine(T0, "stdout", "step 1"))
    state.apply(SourceDisconnected(T0 + 1, "connection reset by peer"))
    assert state.connection == "disconnected"
    assert state.lost
    assert not state.job_ended and state.exit_code is None
    assert state.status_label == "lost: connection reset by peer"
    assert state.memory["cuda:0"].latest.allocated_bytes == 1 * GiB
    assert state.host == HOST
    assert state.log_total == 1


def test_reconnect_after_a_loss_is_live_again() -> None:
    state = JobModel()
    state.apply(SourceDisconnected(T0, "agent restarting"))
    assert state.lost
    state.apply(SourceConnected(T0 + 1, "/tmp/agent.sock"))
    assert state.connection == "live"
    assert state.disconnect_reason == ""


def test_status_text() -> None:
    state = JobModel()
    state.apply(SourceStatus(T0, "waiting for the agent"))
    assert state.status_text == "waiting for the agent"
    assert state.status_label == "connecting"


# -- version -------------------------------------------------------------------------------------


def test_version_bumps_on_every_change() -> None:
    state = JobModel()
    messages = [
        SourceConnected(T0, "sock"),
        hello(),
        sample(T0 + 1, cuda(1, 2)),
        GpuSample(T0 + 1, [GpuStats(0, "H200")]),
        ProbeStatus(T0 + 1, "nvml", True, "ok"),
        PhaseBegan(T0 + 1, "p", 1),
        PhaseEnded(T0 + 2, "p", 1),
        Marked(T0 + 2, "m"),
        LogLine(T0 + 2, "stdout", "x"),
        Dropped(T0 + 2, 1),
        SourceStatus(T0 + 2, "hi"),
        JobExited(T0 + 3, 0),
    ]
    for message in messages:
        before = state.version
        state.apply(message)
        assert state.version == before + 1, message


def test_version_stays_when_nothing_changed() -> None:
    state = JobModel()
    state.apply(hello())
    state.apply(ProbeStatus(T0, "nvml", False, "no driver"))
    state.apply(Dropped(T0, 4))
    state.apply(SourceStatus(T0, "waiting"))
    state.apply(JobExited(T0, 0))
    state.apply(SourceDisconnected(T0, "job exited"))
    version = state.version
    # The same messages again, a message kind the viewer ignores, and nothing at all.
    state.apply(hello())
    state.apply(ProbeStatus(T0, "nvml", False, "no driver"))
    state.apply(Dropped(T0, 4))
    state.apply(SourceStatus(T0, "waiting"))
    state.apply(JobExited(T0, 0))
    state.apply(SourceDisconnected(T0, "job exited"))
    state.apply(ClientHello(protocol=1))
    state.apply_all([])
    assert state.version == version
