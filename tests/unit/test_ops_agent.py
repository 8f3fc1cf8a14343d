"""Op-timing windows in the agent: the aggregation on made-up events, and the windows' life
cycle with the real (CPU) profiler, driven step by step in this process."""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.conftest import Forked
from torchtop.agent import ops as ops_module
from torchtop.agent import steps as step_hooks
from torchtop.agent.ops import (
    ARMED,
    IDLE,
    OPEN,
    OWN_PROFILER,
    Event,
    OpsSampler,
    aggregate,
    merge,
    ranked,
    records_inputs,
    site_reader,
)
from torchtop.agent.ops import aggregation as ops_aggregation
from torchtop.agent.ops import frames as ops_frames
from torchtop.agent.ops import profiler as ops_profiler
from torchtop.agent.training import TrainingMonitor
from torchtop.protocol import OpsWindow, ProbeStatus, decode, encode

US = 1000  # nanoseconds


def ev(name: str, start: int, end: int, **kw: Any) -> Event:
    return Event(name=name, start=start * US, end=end * US, **kw)


# -- aggregation -------------------------------------------------------------------------------


def test_self_time_is_duration_less_children_per_thread() -> None:
    window = aggregate(
        [
            ev("aten::linear", 0, 100, correlation=1),
            ev("aten::t", 5, 15, correlation=2),
            ev("aten::addmm", 20, 90, correlation=3),
            # Another thread at the same time: not a child of aten::linear.
            ev("aten::mul", 10, 60, thread=2, correlation=4),
        ]
    )
    ops = {key[0]: op for key, op in window.ops.items()}
    assert ops["aten::linear"].total_cpu == 100 * US
    assert ops["aten::linear"].self_cpu == (100 - 10 - 70) * US
    assert ops["aten::addmm"].self_cpu == 70 * US
    assert ops["aten::mul"].self_cpu == 50 * US
    assert window.sync_points == 0 and window.copies == 0 and not window.device


def test_item_counts_one_sync_point_however_deep() -> None:
    events = []
    for step in range(3):
        base = step * 1000
        events += [
            ev("aten::item", base, base + 50),
            ev("aten::_local_scalar_dense", base + 5, base + 45),
            ev("cudaStreamSynchronize", base + 10, base + 40),
        ]
    events.append(ev("cudaDeviceSynchronize", 5000, 5010))  # on its own: a sync of its own
    window = aggregate(events)
    assert window.sync_points == 4 and window.host_reads == 0


def test_item_of_a_cpu_tensor_is_a_host_read_not_a_sync_point() -> None:
    """On a CUDA job: the loss read from the device (the runtime's copy and stream sync nest
    in it), and AdamW reading its CPU ``step`` counters (nothing nests: no wait)."""
    events = [
        ev("aten::item", 0, 50),
        ev("aten::_local_scalar_dense", 5, 45),
        ev("cudaMemcpyAsync", 10, 20),
        ev("cudaStreamSynchronize", 20, 40),
        ev("Memcpy DtoH (Device -> Pageable)", 12, 18, device=True),
    ]
    for i in range(4):  # four parameters' step counters
        base = 100 + i * 20
        events += [
            ev("aten::item", base, base + 10),
            ev("aten::_local_scalar_dense", base + 1, base + 9),
        ]
    window = aggregate(events)
    assert window.sync_points == 1 and window.host_reads == 4


def test_kernels_count_for_the_op_that_launched_them_and_copies_are_counted() -> None:
    window = aggregate(
        [
            ev("aten::linear", 0, 100, correlation=1),
            ev("aten::addmm", 10, 90, correlation=2),
            ev("cudaLaunchKernel", 20, 30, correlation=50, linked=2),
            ev("gemm_kernel", 40, 240, device=True, correlation=50, linked=2),
            ev("aten::copy_", 100, 150, correlation=3),
            ev("Memcpy HtoD (Pageable -> Device)", 120, 170, device=True, linked=3),
            ev("Memcpy DtoH (Device -> Pageable)", 300, 310, device=True, linked=0),
        ]
    )
    ops = {key[0]: op for key, op in window.ops.items()}
    assert window.device and window.copies == 2
    assert ops["aten::addmm"].self_device == 200 * US  # its kernel
    assert ops["aten::linear"].self_device == 0  # called it: total only
    assert ops["aten::linear"].total_device == 200 * US
    assert ops["gemm_kernel"].self_device == 200 * US and ops["gemm_kernel"].calls == 1
    assert ops["aten::copy_"].self_device == 50 * US
    assert ops["Memcpy DtoH (Device -> Pageable)"].calls == 1


class _RawEvent:
    """The part of torch's ``_KinetoEvent`` that read_events calls, with its method names."""

    def __init__(self, name: str, start: int, end: int, device: str = "CPU", **kw: Any) -> None:
        from torch.autograd import DeviceType

        self._name, self._start, self._end = name, start * US, end * US
        self._device = getattr(DeviceType, device)
        self._correlation = kw.get("correlation", 0)
        self._linked = kw.get("linked", 0)
        self._annotation = kw.get("annotation", False)
        # kineto's ActivityType: CPU_OP 0, USER_ANNOTATION 1, GPU_USER_ANNOTATION 2,
        # CONCURRENT_KERNEL 5, CUDA_RUNTIME 7.
        if device != "CPU":
            self._activity = 2 if self._annotation else 5
        elif name.startswith("cuda"):
            self._activity = 7
        else:
            self._activity = 1 if self._annotation else 0

    def name(self) -> str:
        return self._name

    def start_ns(self) -> int:
        return self._start

    def end_ns(self) -> int:
        return self._end

    def start_thread_id(self) -> int:
        return 1

    def device_type(self) -> Any:
        return self._device

    def correlation_id(self) -> int:
        return self._correlation

    def linked_correlation_id(self) -> int:
        return self._linked

    def activity_type(self) -> int:
        return self._activity

    def is_hidden_event(self) -> bool:
        return False

    def is_user_annotation(self) -> bool:
        return self._annotation

    def is_python_function(self) -> bool:
        return False

    def shapes(self) -> list[list[int]]:
        return []


class _RawResult:
    def __init__(self, events: list[_RawEvent]) -> None:
        self._events = events

    def events(self) -> list[_RawEvent]:
        return self._events


def test_annotation_ranges_on_the_device_are_not_device_ops() -> None:
    """An AdamW step on a GPU as kineto reports it: the ``record_function`` range on the CPU,
    the same range again on the GPU's timeline (a user annotation), and the kernel inside."""
    from torchtop.agent.ops import read_events

    step = "Optimizer.step#AdamW.step"
    raw = _RawResult(
        [
            _RawEvent(step, 0, 100, correlation=1, annotation=True),
            _RawEvent("aten::_foreach_add_", 10, 60, correlation=2),
            _RawEvent("cudaLaunchKernel", 20, 30, correlation=50, linked=2),
            _RawEvent(step, 25, 300, device="CUDA", correlation=1, linked=1, annotation=True),
            _RawEvent("foreach_kernel", 40, 240, device="CUDA", correlation=50, linked=2),
        ]
    )
    events = read_events(raw, record_shapes=False)
    window = aggregate(events)
    device_ops = {key[0]: op for key, op in window.ops.items() if op.total_cpu == 0}
    assert set(device_ops) == {"foreach_kernel"}
    assert device_ops["foreach_kernel"].self_device == 200 * US
    # The CPU range is still listed, with its kernel's time in its total (once, not twice).
    (cpu_step,) = [op for key, op in window.ops.items() if key[0] == step]
    assert cpu_step.calls == 1 and cpu_step.total_device == 200 * US


def test_a_runtime_calls_cupti_id_equal_to_an_ops_id_takes_none_of_its_kernels() -> None:
    """Ops carry torch's ids, runtime calls and kernels CUPTI's: two counters that overlap. A
    ``cudaDeviceSynchronize`` outside any op (linked to none) whose CUPTI id equals the op's
    id must not take the op's kernel."""
    from torchtop.agent.ops import read_events

    raw = _RawResult(
        [
            _RawEvent("aten::addmm", 10, 60, correlation=7),
            _RawEvent("cudaLaunchKernel", 20, 30, correlation=41, linked=7),
            _RawEvent("cudaDeviceSynchronize", 70, 300, correlation=7, linked=0),
            _RawEvent("gemm_kernel", 40, 290, device="CUDA", correlation=41, linked=7),
        ]
    )
    window = aggregate(read_events(raw, record_shapes=False))
    ops = {key[0]: op for key, op in window.ops.items()}
    assert ops["aten::addmm"].self_device == 250 * US
    assert ops["cudaDeviceSynchronize"].total_device == 0


def test_python_frames_give_ops_their_call_site_and_are_not_listed(tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    site_of = site_reader([str(lib)])
    window = aggregate(
        [
            ev(f"{tmp_path}/train.py(12): step", 0, 100, python=True),
            ev(f"{lib}/module.py(3): forward", 1, 99, python=True),
            ev("aten::addmm", 10, 20, correlation=1),
            ev(f"{tmp_path}/train.py(20): evaluate", 200, 300, python=True),
            ev("aten::addmm", 210, 220, correlation=2),
        ],
        site_of=site_of,
    )
    assert set(window.ops) == {
        ("aten::addmm", None, "train.py(12): step"),
        ("aten::addmm", None, "train.py(20): evaluate"),
    }


def test_ranked_orders_by_self_time_limits_and_sums_the_rest() -> None:
    window = aggregate(
        [ev(f"op{i}", i * 100, i * 100 + i + 1, correlation=i + 1) for i in range(10)]
    )
    listed, other = ranked(window.ops, device=False, limit=3)
    assert [op.name for op in listed] == ["op9", "op8", "op7"]
    assert listed[0].self_device_s is None
    assert other == pytest.approx(sum(i + 1 for i in range(7)) * US / 1e9)


def test_cumulative_table_adds_windows_and_stays_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops_aggregation, "MAX_CUMULATIVE_KEYS", 3)
    cumulative: dict[Any, Any] = {}
    for _ in range(2):
        merge(cumulative, aggregate([ev("a", 0, 10), ev("b", 20, 30)]).ops)
    merge(cumulative, aggregate([ev("c", 0, 5), ev("d", 10, 15), ev("e", 20, 25)]).ops)
    names = {key[0]: op for key, op in cumulative.items()}
    assert names["a"].calls == 2 and names["a"].self_cpu == 20 * US
    assert len(cumulative) == 3 + 1 and names["(other ops)"].calls == 2


# -- windows with the real profiler --------------------------------------------------------------


class FakeSteps:
    """What the sampler reads from the StepCollector."""

    def __init__(self, clock: int | str | None = 1, total: int = 10) -> None:
        self.clock = clock
        self.total = total
        self.recent: deque[float] = deque([0.001] * 8)


@pytest.fixture
def sampler(tmp_path: Path):
    s = OpsSampler(trace_dir=tmp_path, trace_prefix="job.", min_spacing_s=0.0)
    yield s
    s.close_now()
    step_hooks.BOUNDARY[0] = None


def _model() -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _train_steps(model: Any, opt: Any, n: int, *, item: bool = False) -> None:
    x = torch.randn(8, 16)
    for _ in range(n):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        if item:
            loss.item()


def _boundary(key: int | str = 1) -> None:
    """What the optimizer post hook does at a step's end."""
    hook = step_hooks.BOUNDARY[0]
    if hook is not None:
        hook(key)


def _window(sampler: OpsSampler, steps: FakeSteps, *, item: bool = False) -> list[Any]:
    model, opt = _model()
    assert sampler.tick(time.time(), steps) == []
    assert sampler._state == ARMED and step_hooks.BOUNDARY[0] is not None
    _boundary()
    assert sampler._state == OPEN
    for _ in range(sampler.window_steps):
        _train_steps(model, opt, 1, item=item)
        _boundary()
    assert sampler._state == IDLE and step_hooks.BOUNDARY[0] is None
    return sampler.tick(time.time(), steps)


def test_a_window_spans_two_steps_and_ranks_the_matmuls(sampler: OpsSampler) -> None:
    (frame,) = _window(sampler, FakeSteps(), item=True)
    assert isinstance(frame, OpsWindow) and frame.window == 1
    # One .item() per step, of a CPU tensor: a host read, no wait for a device.
    assert frame.steps == 2 and frame.host_reads == 2 and frame.sync_points == 0
    names = [op.name for op in frame.ops]
    assert {"aten::addmm", "aten::mm"} & set(names[:10]) and len(names) >= 5
    assert not frame.device and frame.ops[0].self_device_s is None
    assert frame.cost_s > 0 and frame.spacing_s >= frame.cost_s / sampler.budget - 1e-9
    assert frame.cumulative == frame.ops
    # The frame goes over the wire unchanged.
    assert decode(encode(frame)) == frame
    trace = json.loads(Path(frame.trace_path or "").read_text())
    assert any(e.get("name") == "aten::addmm" for e in trace["traceEvents"])


def test_a_windows_cost_is_what_the_steps_around_it_lost(sampler: OpsSampler) -> None:
    """The profiled steps' slowdown, the stop, and the agent's reading and freeing of the
    events (which hold the GIL) all show in the steps from the window's start to the first
    that ends after the agent is done: their time beyond the usual step is the cost."""
    steps = FakeSteps()
    t = time.perf_counter() - 1.0
    steps.ends = deque((t + i * 0.01, 0.01) for i in range(50))  # type: ignore[attr-defined]
    assert sampler.unsettled_since() is None and sampler.windows_share() is None
    assert _window(sampler, steps) == []  # held: no step has ended since
    (held,) = sampler._measuring
    # Its steps are the window's until its cost is known: the tick measure leaves them out.
    assert sampler.unsettled_since() == held.start
    assert list(sampler.spans) == [(held.start, held.done)]
    span = held.done - held.start
    ends = steps.ends  # type: ignore[attr-defined]
    ends.append((held.start + span / 3, 0.03))  # the two profiled steps
    ends.append((held.start + span * 2 / 3, 0.02))
    assert sampler.tick(time.time(), steps) == []  # still none after the agent was done
    ends.append((time.perf_counter(), 0.015))  # the step the reading slowed down
    ends.append((time.perf_counter(), 0.04))  # later: not the window's
    (frame,) = sampler.tick(time.time(), steps)
    assert isinstance(frame, OpsWindow) and frame.steps == 2
    assert frame.cost_s == pytest.approx(0.02 + 0.01 + 0.005)
    assert frame.spacing_s == pytest.approx(frame.cost_s / sampler.budget)
    # Priced: what the windows cost the job, as a share of its time, is the agent's cost too.
    assert sampler.unsettled_since() is None
    (priced_at, _, _) = sampler.priced[-1]
    assert sampler.windows_share(priced_at) == pytest.approx(sampler.budget)


def test_the_windows_share_is_their_costs_over_the_time_they_spanned(
    sampler: OpsSampler,
) -> None:
    sampler.priced.extend([(100.0, 0.01, 5.0), (105.0, 0.03, 6.0), (111.0, 0.02, 5.0)])
    assert sampler.windows_share(111.0) == pytest.approx(0.06 / 16.0)
    # Windows that stop coming (the job's own profiler, a job gone idle) count less and less.
    assert sampler.windows_share(140.0) == pytest.approx(0.06 / 40.0)


def test_cumulative_adds_up_over_windows(sampler: OpsSampler) -> None:
    steps = FakeSteps()
    (first,) = _window(sampler, steps)
    sampler._next_due = 0.0
    (second,) = _window(sampler, steps)
    assert second.window == 2 and second.total_steps == 4
    calls = {op.name: op.calls for op in first.ops}
    cumulative = {op.name: op.calls for op in second.cumulative}
    assert cumulative["aten::addmm"] == 2 * calls["aten::addmm"]
    assert second.trace_path == first.trace_path  # the last window replaces the file


def test_only_the_step_clock_moves_the_window(sampler: OpsSampler) -> None:
    steps = FakeSteps(clock=1)
    sampler.tick(time.time(), steps)
    _boundary(key=2)  # another optimizer
    assert sampler._state == ARMED
    _boundary(key=1)
    assert sampler._state == OPEN


def test_no_window_before_the_first_steps_or_before_it_is_due(sampler: OpsSampler) -> None:
    sampler.tick(time.time(), FakeSteps(total=1))
    assert sampler._state == IDLE
    sampler._step_window_armed = True  # a window over steps was taken: the spacing holds
    sampler._next_due = time.monotonic() + 60
    sampler.tick(time.time(), FakeSteps(total=10))
    assert sampler._state == IDLE


def test_time_the_agent_was_paused_does_not_count_toward_the_spacing(
    sampler: OpsSampler,
) -> None:
    sampler._step_window_armed = True
    sampler._next_due = time.monotonic() - 1.0  # due a second ago, but paused for three
    sampler.resumed_after(3.0)
    sampler.tick(time.time(), FakeSteps(total=10))
    assert sampler._state == IDLE


def test_a_request_arms_a_window_at_once_and_keeps_its_trace(sampler: OpsSampler) -> None:
    sampler._next_due = time.monotonic() + 60
    sampler.request_window()
    steps = FakeSteps(total=0)
    sampler.tick(time.time(), steps)
    assert sampler._state == ARMED
    _boundary()
    model, opt = _model()
    for _ in range(2):
        _train_steps(model, opt, 1)
        _boundary()
    (frame,) = sampler.tick(time.time(), steps)
    assert frame.requested and frame.trace_path.endswith("job.ops-1.json")


def test_the_jobs_own_profiler_wins(sampler: OpsSampler) -> None:
    monitor = TrainingMonitor(ops=sampler)
    undo = monitor._install_profiler_guard()
    assert undo
    try:
        model, opt = _model()
        steps = FakeSteps()
        sampler.tick(time.time(), steps)
        _boundary()
        assert sampler._state == OPEN
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as own:
            _train_steps(model, opt, 3)
            # Ours stopped and was thrown away; none opens while the job's runs.
            assert sampler._state == IDLE
            messages = sampler.tick(time.time(), steps)
            assert sampler._state == IDLE
            _boundary()
        names = [e.name for e in own.events()]
        assert sum(1 for n in names if n.startswith("Optimizer.step#")) == 3
        assert names.count("aten::addmm") == 6  # complete: 2 layers, 3 steps
        (status,) = [m for m in messages if isinstance(m, ProbeStatus)]
        assert not status.available and OWN_PROFILER in status.detail
        assert not any(isinstance(m, OpsWindow) for m in messages)
        # Once it has ended, windows resume.
        (resumed,) = sampler.tick(time.time(), steps)
        assert isinstance(resumed, ProbeStatus) and resumed.available
        assert sampler._state == ARMED
    finally:
        for action in undo:
            action()


def test_a_profiler_already_running_blocks_the_window(sampler: OpsSampler) -> None:
    steps = FakeSteps()
    sampler.tick(time.time(), steps)
    with torch.autograd.profiler.profile():
        _boundary()  # due to open, but the job's profiler is on
        assert sampler._state == IDLE
        (status,) = sampler.tick(time.time(), steps)
        assert not status.available
    (status,) = [m for m in sampler.tick(time.time(), steps) if isinstance(m, ProbeStatus)]
    assert status.available


def test_three_failures_stop_sampling_and_say_why(
    sampler: OpsSampler, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: Any, **_: Any) -> bool:
        raise RuntimeError("no profiler here")

    monkeypatch.setattr(ops_profiler._Profiler, "start", broken)
    steps = FakeSteps()
    details = []
    for _ in range(4):
        sampler._next_due = 0.0
        for message in sampler.tick(time.time(), steps):
            details.append(message.detail)
        _boundary()
        assert sampler._state == IDLE
    details += [m.detail for m in sampler.tick(time.time(), steps)]
    reason = "the profiler failed: RuntimeError('no profiler here')"
    assert details[0] == f"op timings unavailable: {reason}"
    assert details[-1].endswith("op sampling stopped after 3 failures")
    assert sampler._state == IDLE and step_hooks.BOUNDARY[0] is None


def test_a_window_left_open_past_its_steps_is_closed_in_the_main_thread(tmp_path: Path) -> None:
    sampler = OpsSampler(trace_dir=tmp_path, trace_prefix="", min_spacing_s=0.0)
    steps = FakeSteps()
    steps.recent = deque([0.0001])
    sampler.tick(time.time(), steps)
    _boundary()
    sampler._opened_at -= 5.0  # as if open 5 s: the job left its loop
    _tick_from_another_thread(sampler, steps)
    deadline = time.monotonic() + 10
    x = torch.randn(16, 16)
    while sampler._state == OPEN and time.monotonic() < deadline:
        x @ x  # the main thread runs bytecodes: the pending call closes the window
    assert sampler._state == IDLE
    (frame,) = [m for m in sampler.tick(time.time(), steps) if isinstance(m, OpsWindow)]
    assert frame.steps == 0


def _tick_from_another_thread(sampler: OpsSampler, steps: FakeSteps) -> list[Any]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.extend(sampler.tick(time.time(), steps)))
    thread.start()
    thread.join()
    return out


def test_time_based_windows_without_steps(tmp_path: Path) -> None:
    """No step clock: the sampler thread has the main thread open and close the window."""
    sampler = OpsSampler(
        trace_dir=tmp_path, trace_prefix="", time_fallback_s=0.0, time_window_s=0.05
    )
    steps = FakeSteps(clock=None, total=0)
    frames: list[Any] = []
    x = torch.randn(32, 32)
    deadline = time.monotonic() + 20
    while not frames and time.monotonic() < deadline:
        frames += [m for m in _tick_from_another_thread(sampler, steps) if isinstance(m, OpsWindow)]
        for _ in range(50):
            x = torch.tanh(x @ x)
    assert frames, "no time-based window was taken"
    assert frames[0].steps is None and frames[0].duration_s >= 0.05
    assert "aten::mm" in [op.name for op in frames[0].ops]


def test_a_time_based_window_costs_its_events_not_its_length(tmp_path: Path) -> None:
    """A job setting up (here: mostly sleeping, a few ops) under a 0.5 s window: the window
    cost the job next to nothing, so it must not push the next window far away."""
    sampler = OpsSampler(
        trace_dir=tmp_path, trace_prefix="", time_fallback_s=0.0, time_window_s=0.5
    )
    steps = FakeSteps(clock=None, total=0)
    frames: list[Any] = []
    x = torch.randn(8, 8)
    deadline = time.monotonic() + 30
    while not frames and time.monotonic() < deadline:
        frames += [m for m in _tick_from_another_thread(sampler, steps) if isinstance(m, OpsWindow)]
        for _ in range(10):
            x = torch.tanh(x)
            time.sleep(0.01)
    assert frames, "no time-based window was taken"
    (frame,) = frames
    assert frame.steps is None and frame.duration_s >= 0.5
    # Its cost is the profiler's start, stop and events (a few ms; more on a busy machine),
    # not its 0.5 s; the next window is spaced by that cost, not by the length.
    assert frame.cost_s < 0.5 * frame.duration_s, (frame.cost_s, frame.duration_s)
    assert frame.spacing_s <= max(sampler.min_spacing_s, frame.cost_s / sampler.budget) + 1e-6
    assert frame.spacing_s < frame.duration_s / sampler.budget


def test_the_first_window_over_steps_comes_as_soon_as_steps_do(sampler: OpsSampler) -> None:
    """Windows taken while the job set up (no steps yet) left a long spacing: the first
    steps get a window all the same, at once."""
    sampler.min_spacing_s = 60.0
    sampler._next_due = time.monotonic() + 3600
    assert sampler.tick(time.time(), FakeSteps(clock=None, total=0)) == []
    assert sampler._state == IDLE
    sampler.tick(time.time(), FakeSteps(clock=1, total=5))
    assert sampler._state == ARMED
    (frame,) = _window(sampler, FakeSteps(clock=1, total=5))[-1:]
    assert frame.steps == 2
    # After that one, the spacing holds again.
    assert sampler.tick(time.time(), FakeSteps(clock=1, total=9)) == []
    assert sampler._state == IDLE


def test_a_child_forked_during_a_window_inherits_no_profiler(tmp_path: Path) -> None:
    """A DataLoader worker forked mid-window: the window closes before the fork."""

    sampler = OpsSampler(trace_dir=tmp_path, trace_prefix="", min_spacing_s=0.0)
    monitor = TrainingMonitor(ops=sampler)
    monitor.start()
    try:
        model, opt = _model()
        steps = FakeSteps(clock=id(opt))
        sampler.tick(time.time(), steps)
        _train_steps(model, opt, 1)  # the real optimizer hook opens the window
        assert sampler._state == OPEN
        with Forked(
            lambda parent: parent.send(b"%d" % torch._C._autograd._profiler_enabled())
        ) as child:
            assert child.receive() == b"0"
        assert sampler._state == IDLE and not torch._C._autograd._profiler_enabled()
        frames = [m for m in sampler.tick(time.time(), steps) if isinstance(m, OpsWindow)]
        assert len(frames) == 1 and frames[0].steps == 0
    finally:
        monitor.stop(0.0)
    assert step_hooks.BOUNDARY[0] is None


# -- never inside torch's callbacks ---------------------------------------------------------------


def test_callbacks_from_torchs_cpp_code_are_recognised() -> None:
    import sys

    from torch.utils._python_dispatch import TorchDispatchMode

    from torchtop.agent.ops import inside_torch_callback

    assert not inside_torch_callback(sys._getframe())
    seen: list[bool] = []
    x = torch.ones(3, requires_grad=True)
    x.register_hook(lambda g: seen.append(inside_torch_callback(sys._getframe())) or g)
    (x * 2).sum().backward()

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(inside_torch_callback(sys._getframe()))
            return func(*args, **(kwargs or {}))

    with Mode():
        torch.ones(2) + 1
    assert seen and all(seen)


def test_an_optimizer_stepping_inside_backward_opens_no_window(sampler: OpsSampler) -> None:
    """The "optimizer step in backward" pattern: the step hook runs inside the autograd engine,
    where a profiler started would be undone when backward returns."""
    model, opt = _model()
    steps = FakeSteps(clock=id(opt))
    previous = step_hooks.BOUNDARY[0]
    sampler.tick(time.time(), steps)
    assert sampler._state == ARMED
    weight = next(model.parameters())
    handle = weight.register_post_accumulate_grad_hook(lambda p: sampler.at_boundary(id(opt)))
    try:
        for _ in range(3):
            model(torch.randn(2, 16)).sum().backward()
        assert sampler._state == ARMED  # still waiting for a safe boundary
        sampler.at_boundary(id(opt))  # from the loop itself: safe
        assert sampler._state == OPEN
    finally:
        handle.remove()
        step_hooks.BOUNDARY[0] = previous


def test_no_window_inside_a_demos_timing_pass(sampler: OpsSampler) -> None:
    """The demos time their phases: a window there would slow the timed ops several times."""
    import torchtop
    from torchtop.demos import _harness as harness

    sampler.tick(time.time(), FakeSteps(clock="explicit"))
    assert sampler._state == ARMED
    during: list[int] = []
    passes: list[str | None] = []

    def work() -> torch.Tensor:
        torchtop.step()  # a step boundary in the timed code
        during.append(sampler._state)
        passes.append(harness.current_pass())
        return torch.ones(4) * 2

    harness.measure("timed", work, device="cpu", repeat=3)
    # Warm-up and three timed calls: armed, never open; then one call in a window of its own
    # (the phase's ops for the viewer), and the memory pass, outside any window.
    assert during == [ARMED] * 4 + [OPEN, IDLE]
    # A demo that records per call can keep the timed calls only.
    assert passes == ["warm-up", "timed", "timed", "timed", "profiled", "memory"]
    assert harness.current_pass() is None
    (frame,) = [m for m in sampler.tick(time.time(), FakeSteps()) if isinstance(m, OpsWindow)]
    assert frame.steps == 1 and "aten::mul" in [op.name for op in frame.ops]
    torchtop.step()  # no window was armed since: none opens
    assert sampler._state == IDLE
    sampler._request.set()
    sampler._last_closed = 0.0  # a request more than a second after the last window
    sampler.tick(time.time(), FakeSteps(clock="explicit"))
    torchtop.step()
    assert sampler._state == OPEN
    with harness.untimed_by_profiler():  # a window open when a timing pass begins closes
        assert sampler._state == IDLE


# -- found in review: owners, signals, refusals, limits ------------------------------------------


def test_the_jobs_profiler_in_another_thread_waits_for_our_window_to_close(
    sampler: OpsSampler,
) -> None:
    """Only the thread that started a profiler can stop it: a window open in the training
    thread closes at that thread's next boundary, and the job's profiler waits for it."""
    monitor = TrainingMonitor(ops=sampler)
    undo = monitor._install_profiler_guard() or []
    stop = threading.Event()
    ours_on_at_end: list[bool] = []

    def training() -> None:
        model, opt = _model()
        while not stop.is_set():
            _train_steps(model, opt, 1)
            _boundary()
            time.sleep(0.002)
        ours_on_at_end.append(torch._C._autograd._profiler_enabled())

    try:
        sampler.window_steps = 10_000  # a window that stays open
        sampler.tick(time.time(), FakeSteps())
        thread = threading.Thread(target=training)
        thread.start()
        deadline = time.monotonic() + 10
        while sampler._state != OPEN and time.monotonic() < deadline:
            time.sleep(0.005)
        assert sampler._state == OPEN and sampler._thread == thread.ident
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as own:
            assert sampler._state == IDLE  # ours was stopped by its owner first
            torch.ones(3) + 1
        assert "aten::add" in [e.name for e in own.events()]
        stop.set()
        thread.join()
        assert ours_on_at_end == [False]
        messages = sampler.tick(time.time(), FakeSteps())
        assert not any(isinstance(m, OpsWindow) for m in messages)  # thrown away
    finally:
        stop.set()
        for action in undo:
            action()


def test_a_signal_during_a_pending_call_reaches_the_job_afterwards(sampler: OpsSampler) -> None:
    """A Ctrl-C handled while a time-based window starts or stops in the main thread is not
    lost: the job gets its KeyboardInterrupt as it enters its next function."""
    import os
    import signal

    def interrupted(frame: Any) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # the handler runs in here, inside the pending call

    def spin() -> int:
        return sum(range(100))

    queued: list[bool] = []

    def sampler_thread() -> None:
        time.sleep(0.2)  # the main thread is in its loop by then
        queued.append(sampler._in_main_thread(interrupted))

    thread = threading.Thread(target=sampler_thread)
    thread.start()
    with pytest.raises(KeyboardInterrupt):
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            spin()
    thread.join()
    assert queued == [True] and not sampler._pending_calls
    import sys

    assert sys.getprofile() is None


def test_steps_that_always_end_inside_backward_give_way_to_time_based_windows(
    sampler: OpsSampler,
) -> None:
    model, opt = _model()
    steps = FakeSteps(clock=id(opt))
    sampler.tick(time.time(), steps)
    weight = next(model.parameters())
    handle = weight.register_post_accumulate_grad_hook(lambda p: sampler.at_boundary(id(opt)))
    try:
        for _ in range(ops_module.REFUSED_LIMIT):
            model(torch.randn(2, 16)).sum().backward()
    finally:
        handle.remove()
    assert sampler._state == IDLE and sampler._steps_unsafe
    assert step_hooks.BOUNDARY[0] is None
    sampler.time_fallback_s = 0.0
    sampler._next_due = 0.0
    sampler.tick(time.time(), steps)  # time-based from now on: the main thread opens it
    deadline = time.monotonic() + 5
    while sampler._state != OPEN and time.monotonic() < deadline:
        sum(range(100))
    assert sampler._state == OPEN and sampler._time_based


def test_a_window_that_cannot_open_leaves_nothing_armed(
    sampler: OpsSampler, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: Any, **_: Any) -> bool:
        raise RuntimeError("no profiler here")

    monkeypatch.setattr(ops_profiler._Profiler, "start", broken)
    sampler.tick(time.time(), FakeSteps())
    assert sampler._state == ARMED
    with sampler.window() as opened:
        assert not opened
    assert sampler._state == IDLE and step_hooks.BOUNDARY[0] is None


def test_a_window_before_any_tick_read_the_clock_counts_every_step_in_it(
    sampler: OpsSampler,
) -> None:
    """A demo's first phase can take its profiled call before the sampler's first tick has
    read the step clock (its steps are fast; on a busy machine the tick comes late): the
    window counts all its steps, not those after the tick, and its ops per step are right."""
    model, opt = _model()
    with sampler.window() as opened:
        assert opened
        for i in range(6):
            _train_steps(model, opt, 1)
            _boundary(7)
            if i == 1:  # a tick before the collector has drained a step: no clock yet
                sampler.tick(time.time(), FakeSteps(clock=None))
            if i == 3:  # the collector has the clock now
                sampler.tick(time.time(), FakeSteps(clock=7))
    (frame,) = [
        m for m in sampler.tick(time.time(), FakeSteps(clock=7)) if isinstance(m, OpsWindow)
    ]
    assert frame.steps == 6 and frame.total_steps == 6
    # Six steps of the same model: each op ran a whole number of times a step.
    for op in frame.ops:
        assert op.calls % 6 == 0, op
    # A step of another optimizer does not count once the first has the clock.
    assert sampler.clock == 7
    with sampler.window() as opened:
        _train_steps(model, opt, 2)
        _boundary(7)
        _boundary(8)
    (frame,) = [
        m for m in sampler.tick(time.time(), FakeSteps(clock=7)) if isinstance(m, OpsWindow)
    ]
    assert frame.steps == 1


def test_a_time_window_the_jobs_end_cut_before_any_op_is_not_sent(sampler: OpsSampler) -> None:
    """A job with no steps may take its time window's opening call only as it leaves its loop
    (under the memory limit's dispatch mode, say): the window the exit then cuts holds no op
    and is no window at all; one cut as short that recorded ops still is."""
    sampler._open(time_based=True)
    assert sampler._state == OPEN
    assert [m for m in sampler.stop(time.time()) if isinstance(m, OpsWindow)] == []
    # Counted nowhere, and no trace written over the last window's.
    assert sampler.windows == 0
    assert not list(sampler._frames.trace_dir.glob("*ops*"))


def test_a_time_window_cut_short_with_ops_in_it_is_sent(tmp_path: Path) -> None:
    sampler = OpsSampler(trace_dir=tmp_path, trace_prefix="job.", min_spacing_s=0.0)
    try:
        sampler._open(time_based=True)
        torch.randn(8, 8) @ torch.randn(8, 8)
        (frame,) = [m for m in sampler.stop(time.time()) if isinstance(m, OpsWindow)]
        assert frame.steps is None and frame.duration_s < sampler.time_window_s
        assert "aten::mm" in {op.name for op in frame.ops}
    finally:
        step_hooks.BOUNDARY[0] = None


def test_requested_windows_are_rate_limited_and_their_traces_bounded(
    sampler: OpsSampler, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(ops_frames, "KEPT_TRACES", 2)
    steps = FakeSteps()
    model, opt = _model()
    paths = []
    for _ in range(3):
        sampler._next_due = time.monotonic() + 60
        sampler._last_closed = 0.0
        sampler.request_window()
        sampler.tick(time.time(), steps)
        _boundary()
        _train_steps(model, opt, 2)
        _boundary()
        _boundary()
        (frame,) = [m for m in sampler.tick(time.time(), steps) if isinstance(m, OpsWindow)]
        assert frame.requested
        paths.append(Path(frame.trace_path or ""))
    assert [p.exists() for p in paths] == [False, True, True]
    sampler.request_window()  # straight after a window: waits its second
    sampler.tick(time.time(), steps)
    assert sampler._state == IDLE and sampler._request.is_set()


def test_windows_that_record_inputs_count_matmuls_by_dtype_and_read_the_threads(
    tmp_path: Path,
) -> None:
    """The dtypes are what the profiler names (the advice's fixtures use the same names), and
    the thread count is the training thread's own setting."""
    sampler = OpsSampler(
        trace_dir=tmp_path, trace_prefix="job.", min_spacing_s=0.0, record_shapes=True
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        (plain,) = _window(sampler, FakeSteps())
        sampler._next_due = 0.0
        with torch.autocast("cpu", dtype=torch.bfloat16):
            (autocast,) = _window(sampler, FakeSteps())
    finally:
        torch.set_num_threads(threads)
        sampler.close_now()
        step_hooks.BOUNDARY[0] = None
    assert plain.torch_threads == 3 and autocast.torch_threads == 3
    assert {m.dtype for m in plain.matmuls} == {"float"} and plain.matmuls[0].calls >= 6
    assert "c10::BFloat16" in {m.dtype for m in autocast.matmuls}
    assert sum(m.calls for m in autocast.total_matmuls) == sum(
        m.calls for m in plain.matmuls + autocast.matmuls
    )
    assert decode(encode(autocast)) == autocast


def test_a_cpu_job_records_no_inputs_unless_asked_and_a_cuda_job_one_window_in_four(
    sampler: OpsSampler,
) -> None:
    (frame,) = _window(sampler, FakeSteps())
    assert frame.matmuls == [] and frame.torch_threads == torch.get_num_threads()
    cuda = [records_inputs(n, shapes=False, cuda=True) for n in range(8)]
    assert cuda == [True, False, False, False, True, False, False, False]
    assert not any(records_inputs(n, shapes=False, cuda=False) for n in range(8))
    assert all(records_inputs(n, shapes=True, cuda=False) for n in range(8))


def test_runtime_calls_by_name_where_torch_has_no_activity_type() -> None:
    from torchtop.agent.ops.torch_events import _runtime_call

    runtime = ["cudaDeviceSynchronize", "cudaLaunchKernel", "cuLaunchKernel", "hipMemcpyAsync"]
    ops = ["aten::cumsum", "cumulative_loss", "Optimizer.step#AdamW.step", "custom_block"]
    assert [_runtime_call(n) for n in runtime + ops] == [True] * 4 + [False] * 4


class RecordingProfiler:
    """The sampler's view of torch's profiler, recording the calls in order. ``sync`` takes
    ``sync_s``, as a device sync does while kernels are still queued."""

    def __init__(self, *, device: bool, sync_s: float = 0.0) -> None:
        self.device = device
        self.sync_s = sync_s
        self.calls: list[str] = []

    def cuda_initialized(self) -> bool:
        return self.device

    def get_num_threads(self) -> int:
        return 1

    def start(self, *, inputs: bool = False) -> bool:
        self.calls.append("start")
        return self.device

    def sync(self) -> None:
        self.calls.append("sync")
        time.sleep(self.sync_s)

    def stop(self) -> None:
        self.calls.append("stop")


@pytest.mark.parametrize("device", [True, False], ids=["device", "cpu-only"])
def test_a_window_that_recorded_device_activity_syncs_before_it_stops(
    sampler: OpsSampler, device: bool
) -> None:
    # Kernels still queued when a window closes would fall outside it: torch's own profiler
    # synchronizes before it stops, and so does the window, at its own cost.
    profiler = RecordingProfiler(device=device, sync_s=0.05)
    sampler._profiler = profiler  # type: ignore[assignment]
    with sampler.window() as opened:
        assert opened
    assert profiler.calls == (["start", "sync", "stop"] if device else ["start", "stop"])
    (closed,) = sampler._closed
    if device:
        assert closed.stop_cost_s >= 0.05


def test_the_profilers_sync_is_the_devices() -> None:
    from types import SimpleNamespace

    synced: list[str] = []
    profiler = ops_profiler._Profiler(record_shapes=False, with_stack=False)
    profiler._cuda = SimpleNamespace(synchronize=lambda: synced.append("cuda"))
    profiler.sync()
    assert synced == ["cuda"]


def test_on_a_cuda_build_no_window_opens_until_the_job_initializes_cuda(
    sampler: OpsSampler, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On a CUDA build the profiler's start asks for the device count and loads CUPTI even for
    # CPU-only activities: a window would initialize CUDA in a job that has not (or never
    # does), breaking its forked CUDA children. Step windows, viewer requests and the job's
    # own sections all wait, and the ops panel says why.
    initialized = [False]
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized[0])
    profiler = RecordingProfiler(device=False)
    sampler._profiler = profiler  # type: ignore[assignment]
    steps = FakeSteps()
    sampler.request_window()
    statuses = [m for m in sampler.tick(time.time(), steps) if isinstance(m, ProbeStatus)]
    _boundary()
    with sampler.window() as opened:
        assert not opened
    assert profiler.calls == [] and sampler._state == IDLE
    (status,) = statuses
    assert not status.available and "waiting for the job to use CUDA" in status.detail
    initialized[0] = True
    statuses = [m for m in sampler.tick(time.time(), steps) if isinstance(m, ProbeStatus)]
    _boundary()
    assert profiler.calls == ["start"] and sampler._state == OPEN
    assert [s.available for s in statuses] == [True]


def test_a_step_window_measures_its_first_steps_activations_by_module(
    sampler: OpsSampler,
) -> None:
    """The hooks go in at the window's opening boundary and out at the next; the frame names
    the modules, the report carries them (``memory.top_modules``) and the hooks are gone."""
    from torch.nn.modules import module as nn_module

    from torchtop.model.job import JobModel
    from torchtop.report.job import report_json

    hooks = len(nn_module._global_forward_pre_hooks)
    torch.manual_seed(0)
    wide = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 16))
    model = nn.Sequential(nn.Linear(16, 16), wide, nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = FakeSteps()
    assert sampler.tick(time.time(), steps) == []
    _boundary()
    assert sampler._activations is not None
    assert len(nn_module._global_forward_pre_hooks) == hooks + 1
    for _ in range(sampler.window_steps):
        _train_steps(model, opt, 1)
        _boundary()
        assert sampler._activations is None  # out after the first step
        assert len(nn_module._global_forward_pre_hooks) == hooks
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    (frame,) = sampler.tick(time.time(), steps)
    assert isinstance(frame, OpsWindow) and decode(encode(frame)) == frame
    batch = 8
    # Saved for backward, each storage once: every Linear's input, ReLU's output (which the
    # second Linear saves too), and outside the model the loss's input (pow).
    assert frame.activation_bytes == batch * (16 + 16 + 256 + 16 + 4) * 4
    assert [m.path for m in frame.activations] == ["Sequential.1", "Sequential.0", "Sequential.2"]
    assert frame.activations[0].bytes == batch * (16 + 256) * 4
    job = JobModel()
    job.apply(frame)
    (top, *_) = report_json(job)["memory"]["top_modules"]
    assert top == {"path": "Sequential.1", "bytes": batch * 272 * 4, "share": round(272 / 308, 4)}
