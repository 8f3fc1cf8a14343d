"""The agent's OOM flow: CUDA from fixtures and fakes, the CPU emulation for real, requests."""

from __future__ import annotations

import json
import os
import pickle
import sys
import threading
import time
from collections import deque
from operator import methodcaller
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fakes.allocator import (
    ALLOCATOR_FILE,
    allocate,
    fail_into_job,
    no_plan_fits,
    through_cleanups,
    with_retries,
)
from torch.cuda import _memory_viz

from torchtop.agent.core import AgentConfig
from torchtop.agent.memory_limit import SOURCE_TENSORS, MemoryLimitTracker, oom_message
from torchtop.agent.oom import OomController
from torchtop.agent.oom.import_hook import _arm_after_import, _ArmAfterImport
from torchtop.agent.probes.cuda_memory import CudaMemoryProbe
from torchtop.agent.server import EVENTS, SAMPLES, AgentServer, RingLimit
from torchtop.model.memory import DeviceMemory
from torchtop.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    REQUEST_RESUME,
    REQUEST_SNAPSHOT,
    Hello,
    MemorySnapshotTaken,
    MemoryStats,
    Message,
    OomResumed,
    OutOfMemory,
    ProbeStatus,
    Request,
    encode,
)
from torchtop.transport import AgentConnection, bind_server

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GiB = 1 << 30
MiB = 1 << 20


def load(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"cuda_snapshot_{name}.json").read_text())


def make_controller(tmp_path: Path, **config: Any) -> tuple[OomController, list[Message]]:
    messages: list[Message] = []
    controller = OomController(
        AgentConfig(**config), messages.append, pid=4242, snapshot_dir=tmp_path
    )
    return controller, messages


def of_kind(messages: list[Message], kind: type) -> list[Any]:
    return [m for m in messages if isinstance(m, kind)]


def with_fixture(controller: OomController, data: dict[str, Any]) -> None:
    controller.cuda_sources = {
        "snapshot": lambda: data["snapshot"],
        "stats": lambda device: data["memory_stats"],
        "grad_enabled": lambda: True,
    }


def observer_args(data: dict[str, Any], **change: int) -> tuple[int, int, int, int]:
    args = {**data["observer"], **change}
    return args["device"], args["alloc"], args["device_total"], args["device_free"]


def request(data: dict[str, Any], size: int) -> None:
    """The next failure asks for ``size``: the trace's ``oom`` entry holds the request."""
    (trace,) = data["snapshot"]["device_traces"]
    trace.append({**trace[-1], "size": size, "time_us": trace[-1]["time_us"] + 1000})


def observe(controller: OomController, data: dict[str, Any], **change: int) -> None:
    """A failed allocation whose error reaches the job's code (here), which catches it."""
    fail_into_job(controller.observe_cuda_oom, observer_args(data, **change))


# -- CUDA, from fixtures ---------------------------------------------------------------------


def test_cuda_observer_captures_the_failure(tmp_path: Path) -> None:
    data = load("fragmented")
    controller, messages = make_controller(tmp_path)
    with_fixture(controller, data)
    observe(controller, data)
    (event,) = of_kind(messages, OutOfMemory)
    stats = data["memory_stats"]
    assert event.device == "cuda:0" and not event.emulated
    assert event.requested_bytes == 2 * GiB
    assert event.free_bytes == data["observer"]["device_free"]
    assert event.total_bytes == data["observer"]["device_total"]
    assert event.reserved_bytes == stats["reserved_bytes.all.current"]
    assert event.allocated_bytes == stats["allocated_bytes.all.current"]
    assert event.largest_free_block_bytes == 1 * GiB + 512 * MiB
    assert event.fragmented is True and event.grad_enabled is True
    assert [(s.function, s.line) for s in event.top_sites[:2]] == [
        ("train_step", 150),
        ("forward", 88),
    ]
    assert [f.function for f in event.requested_stack][:2] == ["forward", "forward"]
    assert event.requested_stack[1].line == 88  # the allocation that failed, from the trace
    assert event.snapshot_path == str(tmp_path / "4242-oom-1.pickle")
    with open(event.snapshot_path, "rb") as f:
        assert "raise OutOfMemoryError" in _memory_viz.trace(pickle.load(f))
    assert not event.paused and len(encode(event)) < MAX_FRAME_BYTES // 10


def test_cuda_full_verdict(tmp_path: Path) -> None:
    data = load("full")
    controller, messages = make_controller(tmp_path)
    with_fixture(controller, data)
    observe(controller, data)
    (event,) = of_kind(messages, OutOfMemory)
    assert event.fragmented is False and event.requested_bytes == 4 * GiB
    assert event.top_sites[0].function == "forward" and event.top_sites[0].count == 8


def test_the_observer_firing_twice_for_one_failure_captures_once(tmp_path: Path) -> None:
    data = load("fragmented")
    controller, messages = make_controller(tmp_path)
    with_fixture(controller, data)
    observe(controller, data)
    observe(controller, data)  # the same failure, reported again
    assert len(of_kind(messages, OutOfMemory)) == 1 and controller.repeats == 1
    request(data, 3 * GiB)
    observe(controller, data, alloc=3 * GiB)  # a different failure
    assert len(of_kind(messages, OutOfMemory)) == 2


def test_captures_per_run_are_bounded(tmp_path: Path) -> None:
    data = load("full")
    controller, messages = make_controller(tmp_path, max_captures=1)
    with_fixture(controller, data)
    observe(controller, data)
    request(data, 5 * GiB)
    observe(controller, data, alloc=5 * GiB)
    first, second = of_kind(messages, OutOfMemory)
    assert first.snapshot_path and first.top_sites
    assert second.snapshot_path is None and "at most 1 per run" in second.snapshot_error
    assert second.requested_bytes == 5 * GiB and second.free_bytes is not None
    assert sorted(os.listdir(tmp_path)) == ["4242-oom-1.pickle"]


def test_the_observer_never_raises(tmp_path: Path) -> None:
    data = load("full")
    controller, messages = make_controller(tmp_path)

    def broken() -> Any:
        raise RuntimeError("CUDA error: an illegal memory access")

    controller.cuda_sources = {
        "snapshot": broken,
        "stats": lambda device: {},
        "grad_enabled": lambda: False,
    }
    observe(controller, data)
    (event,) = of_kind(messages, OutOfMemory)
    assert "illegal memory access" in event.snapshot_error and event.snapshot_path is None
    assert event.requested_bytes == 4 * GiB and event.top_sites == []

    def failing_publish(message: Message) -> None:
        raise OSError("gone")

    controller._publish = failing_publish
    observe(controller, data, alloc=1)  # must return normally


def test_install_cuda_records_bounded_history_and_attaches_the_observer(tmp_path: Path) -> None:
    controller, messages = make_controller(tmp_path, oom_history_entries=5000)
    cuda, c_api = FakeCuda(), FakeC()
    controller.install_cuda(cuda, c_api)
    controller.install_cuda(cuda, c_api)  # once only
    assert cuda.memory.calls == [
        {"enabled": "all", "context": "alloc", "stacks": "python", "max_entries": 5000}
    ]
    assert c_api.observers == [controller.observe_cuda_oom]
    assert messages == []


def test_install_cuda_reports_instead_of_raising(tmp_path: Path) -> None:
    controller, messages = make_controller(tmp_path, oom_history_entries=0)
    cuda = FakeCuda()
    cuda.memory.fail = True
    c_api = FakeC()
    controller.install_cuda(cuda, c_api)
    (status,) = of_kind(messages, ProbeStatus)
    assert status.probe == "oom_capture" and "history is unavailable" in status.detail
    assert "cudaMallocAsync does not yet support recordHistory" in status.detail
    assert "\n" not in status.detail and "observer is still attached" in status.detail
    # Without history, the observer is attached all the same.
    assert c_api.observers == [controller.observe_cuda_oom] and not controller.history_recorded

    controller, messages = make_controller(tmp_path, oom_history_entries=0)
    cuda = FakeCuda()
    controller.install_cuda(cuda, object())  # a PyTorch without the observer
    assert cuda.memory.calls[0]["enabled"] == "state"  # 0 entries: live blocks' stacks only
    (status,) = of_kind(messages, ProbeStatus)
    assert "observer is unavailable" in status.detail and controller.history_recorded


def test_cuda_capture_waits_for_the_jobs_cuda_init(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    controller, _ = make_controller(tmp_path)
    cuda, c_api = FakeCuda(), FakeC()
    monkeypatch.setattr(torch, "_C", c_api)
    controller._arm_cuda_module(cuda)
    controller._arm_cuda_module(cuda)
    assert cuda.memory.calls == [] and len(cuda.queued) == 1  # nothing until the job inits
    cuda.init()
    assert len(cuda.memory.calls) == 1 and c_api.observers == [controller.observe_cuda_oom]


class FakeMemory:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.fail = False

    def _record_memory_history(self, **kwargs: Any) -> None:
        if self.fail:
            # What the cudaMallocAsync backend (PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync)
            # raises: c10/cuda/CUDAMallocAsyncAllocator.cpp, recordHistory.
            raise RuntimeError(
                "cudaMallocAsync does not yet support recordHistory. If you need it, please "
                "file an issue describing your use case."
            )
        self.calls.append(kwargs)


class FakeCuda:
    """``torch.cuda``'s lazy initialization: queued calls run when the job initializes CUDA."""

    def __init__(self) -> None:
        self.memory = FakeMemory()
        self.queued: list[Any] = []
        self.initialized = False

    def _lazy_call(self, fn: Any) -> None:
        if self.initialized:
            fn()
        else:
            self.queued.append(fn)

    def init(self) -> None:
        self.initialized = True
        for fn in self.queued:
            fn()


class FakeC:
    def __init__(self) -> None:
        self.observers: list[Any] = []

    def _cuda_attach_out_of_memory_observer(self, observer: Any) -> None:
        self.observers.append(observer)


def test_arm_after_import_runs_once_the_module_has_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "fakepkg_oom"
    package.mkdir()
    (package / "__init__.py").write_text("from . import cuda\n")
    (package / "cuda.py").write_text("READY = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[bool] = []
    _arm_after_import("fakepkg_oom.cuda", lambda module: seen.append(module.READY))
    try:
        import fakepkg_oom  # type: ignore[import-not-found]
    finally:
        sys.modules.pop("fakepkg_oom", None)
        cuda = sys.modules.pop("fakepkg_oom.cuda", None)
    assert seen == [True] and fakepkg_oom is not None
    assert not any(isinstance(f, _ArmAfterImport) for f in sys.meta_path)
    assert cuda is not None and "exec_module" not in vars(cuda.__loader__)


# -- the CPU emulation, for real -------------------------------------------------------------


def make_mib(n: int) -> torch.Tensor:
    return torch.zeros(n, 1024, 256)  # n MiB of float32


def limited(
    tmp_path: Path, limit: int, **config: Any
) -> tuple[OomController, list[Message], MemoryLimitTracker]:
    controller, messages = make_controller(tmp_path, memory_limit_bytes=limit, **config)
    tracker = MemoryLimitTracker(limit, on_oom=controller._emulated_oom)
    controller.tracker = tracker  # entered with `with` here; install() enters it for good
    return controller, messages, tracker


def test_memory_limit_raises_an_emulated_oom_after_capturing(tmp_path: Path) -> None:
    _, messages, tracker = limited(tmp_path, 8 * MiB)
    kept = []
    with tracker:
        kept.append(make_mib(4))
        with pytest.raises(torch.OutOfMemoryError) as raised:
            kept.append(make_mib(6))
        assert tracker.live_bytes == 4 * MiB  # the refused tensor was never counted
    assert str(raised.value) == oom_message(6 * MiB, 8 * MiB, 4 * MiB)
    assert "Emulated out of memory" in str(raised.value)
    assert "Tried to allocate 6.00 MiB" in str(raised.value)
    (event,) = of_kind(messages, OutOfMemory)
    assert event.emulated and event.device == "cpu" and event.message == str(raised.value)
    assert (event.requested_bytes, event.free_bytes, event.total_bytes) == (
        6 * MiB,
        4 * MiB,
        8 * MiB,
    )
    assert event.allocated_bytes == 4 * MiB and event.fragmented is False
    assert event.largest_free_block_bytes is None
    (site,) = event.top_sites
    assert (site.function, site.file, site.count, site.bytes) == ("make_mib", __file__, 1, 4 * MiB)
    assert [f.function for f in site.stack][:2] == [
        "make_mib",
        "test_memory_limit_raises_an_emulated_oom_after_capturing",
    ]
    assert event.requested_stack[0].function == "make_mib"
    assert tracker.num_ooms == 1 and len(kept) == 1
    with open(event.snapshot_path, "rb") as f:
        snap = pickle.load(f)
    assert "raise OutOfMemoryError # 6.0MiB requested" in _memory_viz.trace(snap)
    assert "segments: 1" in _memory_viz.segsum(snap)


def test_the_emulated_device_reports_exact_live_bytes(tmp_path: Path) -> None:
    controller, _, tracker = limited(tmp_path, 64 * MiB)

    class Heap:
        def read(self, rss: int | None) -> MemoryStats:
            return MemoryStats("cpu", "cpu-heap", 123, rss)

    probe = controller.cpu_probe(Heap())
    with tracker:
        x = make_mib(3)
        y = x[:1]  # a view adds nothing
        stats = probe.read(900 * MiB)
    assert stats.source == SOURCE_TENSORS and stats.allocated_bytes == 3 * MiB
    assert (stats.total_bytes, stats.free_bytes) == (64 * MiB, 61 * MiB)
    assert stats.reserved_bytes == 900 * MiB and stats.num_ooms == 0
    del x, y
    assert probe.read(None).allocated_bytes == 0
    plain, _ = make_controller(tmp_path)
    heap = Heap()
    assert plain.cpu_probe(heap) is heap  # without --memory-limit, nothing changes


def test_sites_are_the_jobs_lines_and_backward_counts(tmp_path: Path) -> None:
    _, _, tracker = limited(tmp_path, 1 << 40)
    model = torch.nn.Linear(256, 256)

    def forward(batch: torch.Tensor) -> torch.Tensor:
        return model(batch).relu().sum()

    with tracker:
        loss = forward(torch.randn(64, 256))
        loss.backward()
        snap = tracker.snapshot()
    from torchtop.agent.memory_snapshot import top_sites

    sites, live = top_sites(snap)
    names = {s.function for s in sites}
    assert "forward" in names  # the activations saved for backward... were freed by it
    assert any(s.function.startswith("test_sites") for s in sites)  # the gradients
    forward_site = next(s for s in sites if s.function == "forward")
    assert forward_site.stack[0].file.endswith("linear.py") or forward_site.stack[0].function in (
        "forward",
        "relu",
    )
    assert live == len(snap["segments"])
    del loss


def test_the_pause_ends_by_itself_after_its_timeout(tmp_path: Path) -> None:
    _, messages, tracker = limited(tmp_path, 1 * MiB, pause_on_oom=True, pause_timeout_s=0.3)
    start = time.monotonic()
    with tracker, pytest.raises(torch.OutOfMemoryError):
        make_mib(2)
    assert time.monotonic() - start >= 0.3
    event, resumed = [m for m in messages if isinstance(m, (OutOfMemory, OomResumed))]
    assert event.paused and event.pause_timeout_s == 0.3
    assert resumed == OomResumed(t=resumed.t, id=event.id, reason="timeout")


def test_a_resume_request_ends_the_pause(tmp_path: Path) -> None:
    controller, messages, tracker = limited(
        tmp_path, 1 * MiB, pause_on_oom=True, pause_timeout_s=60
    )
    timer = threading.Timer(0.2, controller.handle_request, args=(Request(REQUEST_RESUME, 1),))
    timer.start()
    start = time.monotonic()
    with tracker, pytest.raises(torch.OutOfMemoryError):
        make_mib(2)
    assert time.monotonic() - start < 10
    (resumed,) = of_kind(messages, OomResumed)
    assert resumed.reason == "dismissed"


def test_snapshot_on_request(tmp_path: Path) -> None:
    controller, messages, tracker = limited(tmp_path, 64 * MiB)
    with tracker:
        kept = make_mib(2)
        taken = controller.snapshot_now(request_id=7)
    assert of_kind(messages, MemorySnapshotTaken) == [taken]
    assert taken.request_id == 7 and taken.requested_bytes is None and taken.fragmented is None
    assert taken.allocated_bytes == 2 * MiB and taken.top_sites[0].function == "make_mib"
    assert taken.snapshot_path == str(tmp_path / "4242-snapshot-1.pickle")
    assert os.path.exists(taken.snapshot_path)
    del kept


def test_requests_go_to_the_worker_thread(tmp_path: Path) -> None:
    controller, messages = make_controller(tmp_path, oom_capture=False)
    controller.start()
    try:
        controller.handle_request(Request("frobnicate", 1))  # unknown: ignored
        controller.handle_request(Request(REQUEST_SNAPSHOT, 2))
        deadline = time.monotonic() + 5
        while not of_kind(messages, MemorySnapshotTaken) and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        controller.stop()
    (taken,) = of_kind(messages, MemorySnapshotTaken)
    assert taken.request_id == 2 and taken.snapshot_path is None
    assert "nothing to snapshot" in taken.snapshot_error


def test_the_server_hands_requests_over(tmp_path: Path) -> None:
    hello = Hello(PROTOCOL_VERSION, 1, ["x"], "/", 0.0, "3", None, [], 0.1)
    listener, info = bind_server(os.getpid(), ["test"], time.time())
    server = AgentServer(
        listener,
        lambda: encode(hello),
        rings={SAMPLES: RingLimit(5, 1 << 20), EVENTS: RingLimit(5, 1 << 20)},
    )
    received: list[Request] = []
    server.on_request = received.append
    server.start()
    try:
        conn = AgentConnection(info.address)
        assert conn.send(Request(REQUEST_SNAPSHOT, 3))
        assert conn.send(Request("from-a-newer-viewer", 4))
        deadline = time.monotonic() + 5
        while len(received) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert received == [Request(REQUEST_SNAPSHOT, 3), Request("from-a-newer-viewer", 4)]
        conn.close()
    finally:
        server.stop(drain_s=0)


def test_the_limit_is_off_in_forked_children() -> None:
    """DataLoader workers forked from the job inherit the thread's dispatch mode: not its limit."""
    import subprocess

    code = (
        "import os, torch\n"
        "from torchtop.agent.memory_limit import MemoryLimitTracker\n"
        "MemoryLimitTracker(1 << 20).install()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    from torch.utils._python_dispatch import _get_current_dispatch_mode\n"
        "    torch.zeros(1 << 20)\n"  # 4 MiB, past the limit
        "    os._exit(0 if _get_current_dispatch_mode() is None else 4)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print('child', os.waitstatus_to_exitcode(status))\n"
        "try:\n"
        "    torch.zeros(1 << 20)\n"
        "except torch.OutOfMemoryError:\n"
        "    print('parent oom')\n"
    )
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert out.stdout.split("\n")[:2] == ["child 0", "parent oom"], out.stderr


# -- the figures at the failure -----------------------------------------------


def test_free_memory_under_a_per_process_cap_is_what_the_cap_leaves(tmp_path: Path) -> None:
    # set_per_process_memory_fraction: the observer gets the cap as total and the device's
    # free memory, far above what the job may still take.
    data = load("full")
    controller, messages = make_controller(tmp_path)
    with_fixture(controller, data)
    reserved = data["memory_stats"]["reserved_bytes.all.current"]
    cap = reserved + 100 * MiB
    observe(controller, data, device_total=cap, device_free=135 * GiB)
    (event,) = of_kind(messages, OutOfMemory)
    assert event.total_bytes == cap and event.free_bytes == 100 * MiB
    assert event.free_bytes <= event.total_bytes - event.reserved_bytes


def test_the_request_is_the_traces_and_free_blocks_count_on_its_stream(tmp_path: Path) -> None:
    # The observer reports the 20 MiB segment; the trace's oom entry holds the 6 MiB request.
    # A side stream's free 16 MiB block cannot serve the default stream's request.
    data = load("rounded")
    controller, messages = make_controller(tmp_path)
    with_fixture(controller, data)
    observe(controller, data)
    (event,) = of_kind(messages, OutOfMemory)
    assert data["observer"]["alloc"] == 20 * MiB
    assert event.requested_bytes == 6 * MiB
    assert event.largest_free_block_bytes == 2 * MiB
    assert event.fragmented is False  # 3.5 MiB free on the stream and 2 MiB on the device


# -- failures torch handles itself ----------------------------------------------


def retrying(
    controller: OomController,
    data: dict[str, Any],
    start: int,
    succeeds_at: int,
    others: list[Any] | None = None,
) -> list[int]:
    """A cuDNN-like workspace search in the job's call: halving requests from ``start``; the
    attempt ``succeeds_at`` fits (or none does, and the last error reaches the job). Each
    failure leaves its own ``oom`` entry in the trace, as the allocator does. ``others`` are
    observers attached after the agent's."""
    sizes: list[int] = []

    def traced(alloc: int) -> None:
        sizes.append(alloc)
        request(data, alloc)

    args = observer_args(data, alloc=start)
    with_retries([controller.observe_cuda_oom, *(others or [])], args, succeeds_at, traced)
    return sizes


def test_a_burst_of_halving_requests_that_torch_handles_is_counted_not_published(
    tmp_path: Path,
) -> None:
    data = load("full")
    controller, messages = make_controller(tmp_path, pause_on_oom=True, pause_timeout_s=30.0)
    with_fixture(controller, data)
    started = time.monotonic()
    sizes = retrying(controller, data, 64 * MiB, succeeds_at=4)
    assert sizes == [64 * MiB, 32 * MiB, 16 * MiB, 8 * MiB]
    assert of_kind(messages, OutOfMemory) == [] and of_kind(messages, OomResumed) == []
    assert controller.handled == {"cuda:0": 4} and controller.handled_ooms("cuda:0") == 4
    assert os.listdir(tmp_path) == []  # no snapshot saved for a failure the job never saw
    assert time.monotonic() - started < 30  # never paused
    assert sys.gettrace() is None or "torchtop" not in repr(sys.gettrace())


def test_the_last_failure_of_a_burst_reaches_the_job_and_pauses_there(tmp_path: Path) -> None:
    data = load("full")
    controller, messages = make_controller(tmp_path, pause_on_oom=True, pause_timeout_s=0.1)
    with_fixture(controller, data)
    with pytest.raises(torch.OutOfMemoryError):
        retrying(controller, data, 8 * MiB, succeeds_at=99)
    (event,) = of_kind(messages, OutOfMemory)
    assert event.requested_bytes == 1 * MiB and event.paused  # the last, smallest one
    assert [m.reason for m in of_kind(messages, OomResumed)] == ["timeout"]
    assert controller.handled == {"cuda:0": 3} and event.snapshot_path


# -- failures in backward --------------------------------------------------------

#: autograd's ``_engine_run_backward`` as the training thread runs it: it waits while an engine
#: thread, with no Python frames, does the work and fails; then it raises or returns.
_AUTOGRAD: dict[str, Any] = {"torch": torch}
exec(
    compile(
        """
def _engine_run_backward(engine, raises):
    engine()
    if raises:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate ...")
""",
        "/opt/venv/lib/python3.11/site-packages/torch/autograd/graph.py",
        "exec",
    ),
    _AUTOGRAD,
)


def backward_failing(
    controller: OomController, data: dict[str, Any], *, raises: bool, engine_went_on: bool
) -> None:
    """The training thread calls backward (this frame's line is the job's); an engine thread
    fails with no Python frame of its own."""
    import _thread

    def engine() -> None:
        if engine_went_on:
            # The op retried with less and went on: an allocation with no Python frames.
            (trace,) = data["snapshot"]["device_traces"]
            oom_at = trace[-1]["time_us"]
            trace.append(
                {
                    "action": "alloc",
                    "addr": 1,
                    "size": 2 * MiB,
                    "stream": 0,
                    "time_us": oom_at + 10,
                    "frames": [],
                }
            )
        # The thread's only frame is the observer's: no Python frame calls it.
        _thread.start_new_thread(controller.observe_cuda_oom, observer_args(data))
        wait_for(lambda: controller._backward)
        assert controller._backward

    _AUTOGRAD["_engine_run_backward"](engine, raises)  # loss.backward()


def wait_for(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_backward_failure_is_told_by_its_thread_with_the_training_threads_stack(
    tmp_path: Path,
) -> None:
    data = load("full")
    controller, messages = make_controller(tmp_path, oom_capture=False)
    with_fixture(controller, data)
    controller.start()
    try:
        with pytest.raises(torch.OutOfMemoryError):
            backward_failing(controller, data, raises=True, engine_went_on=False)
        wait_for(lambda: of_kind(messages, OutOfMemory))
    finally:
        controller.stop()
    (event,) = of_kind(messages, OutOfMemory)
    assert event.in_backward is True and event.grad_enabled is None and not event.paused
    # The training thread's stack: autograd's frame for context, then the job's backward line.
    functions = [f.function for f in event.requested_stack]
    assert functions[:2] == ["_engine_run_backward", "backward_failing"], functions
    from torchtop.model.oom_advice import Evidence, suggest

    advice = {s.id for s in suggest(Evidence.of(event))}
    assert {"checkpointing", "mixed-precision"} <= advice


def test_a_backward_failure_torch_handles_is_counted(tmp_path: Path) -> None:
    data = load("full")
    controller, messages = make_controller(tmp_path, oom_capture=False)
    with_fixture(controller, data)
    controller.start()
    try:
        backward_failing(controller, data, raises=False, engine_went_on=True)
        wait_for(lambda: controller.handled)
    finally:
        controller.stop()
    assert controller.handled == {"cuda:0": 1} and of_kind(messages, OutOfMemory) == []


# -- other Python code between the observer and the throw --------------------------------------


class SnapshotOnOom:
    """The job's own observer, as PyTorch's docs suggest: it dumps a snapshot on OOM. It runs
    Python, allocates (CPU tensors, a pickle) and catches an error of its own."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.calls: list[tuple[int, ...]] = []

    def __call__(self, device: int, alloc: int, total: int, free: int) -> None:
        self.calls.append((device, alloc, total, free))
        scratch = torch.zeros(1024) + torch.ones(1024)
        try:
            {}["missing"]
        except KeyError:
            pass
        payload = {"observer": self.calls[-1], "sum": float(scratch.sum()), "big": [0] * 10_000}
        with open(self.folder / f"oom-{len(self.calls)}.pickle", "wb") as f:
            pickle.dump(payload, f)


class Finalized:
    """An object whose finalizer runs Python when its last reference goes."""

    ran: list[str] = []

    def __del__(self) -> None:
        Finalized.ran.append(str(len(Finalized.ran)))


def dropping(holder: list[Any]) -> Any:
    """An observer-position call that only drops the last reference to a finalized object, from
    C (``list.clear``), as garbage collection does between two observers."""
    return lambda *args: holder.clear()


@pytest.mark.parametrize("second", ["snapshot-observer", "finalizer", "both"])
def test_an_oom_reaches_the_job_with_other_python_between_the_observer_and_the_throw(
    tmp_path: Path, second: str
) -> None:
    data = load("full")
    controller, messages = make_controller(tmp_path / "agent")
    (tmp_path / "agent").mkdir()
    with_fixture(controller, data)
    job_observer = SnapshotOnOom(tmp_path)
    holder = [Finalized()]
    others: list[Any] = {
        "snapshot-observer": [job_observer],
        "finalizer": [dropping(holder)],
        "both": [dropping(holder), job_observer],
    }[second]
    Finalized.ran.clear()
    fail_into_job([controller.observe_cuda_oom, *others], observer_args(data))
    (event,) = of_kind(messages, OutOfMemory)
    assert event.requested_bytes == 4 * GiB and controller.handled == {}
    assert bool(job_observer.calls) == (second != "finalizer")
    assert bool(Finalized.ran) == (second != "snapshot-observer")
    assert sys.gettrace() is None or "torchtop" not in repr(sys.gettrace())


def test_an_oom_unwinding_through_torchs_cleanups_still_reaches_the_job(tmp_path: Path) -> None:
    # A context manager's exit and a finally in torch's frames run lines while the error
    # unwinds: they are not torch going on.
    data = load("full")
    controller, messages = make_controller(tmp_path)
    with_fixture(controller, data)
    with pytest.raises(torch.OutOfMemoryError):
        through_cleanups(
            [controller.observe_cuda_oom, SnapshotOnOom(tmp_path)], observer_args(data)
        )
    (event,) = of_kind(messages, OutOfMemory)
    assert event.requested_bytes == 4 * GiB and controller.handled == {}


def test_a_failure_torch_handled_before_another_error_reached_the_job_is_not_an_oom(
    tmp_path: Path,
) -> None:
    # torch caught the OOM (no plan's workspace fit) and raised something else: the job saw
    # no out-of-memory error.
    data = load("full")
    controller, messages = make_controller(tmp_path)
    with_fixture(controller, data)
    with pytest.raises(RuntimeError, match="unable to find an engine"):
        no_plan_fits(controller.observe_cuda_oom, observer_args(data))
    assert of_kind(messages, OutOfMemory) == [] and controller.handled == {"cuda:0": 1}


def test_failures_torch_handles_are_counted_with_a_second_observer_attached(
    tmp_path: Path,
) -> None:
    data = load("full")
    controller, messages = make_controller(tmp_path)
    with_fixture(controller, data)
    job_observer = SnapshotOnOom(tmp_path)
    sizes = retrying(controller, data, 64 * MiB, succeeds_at=3, others=[job_observer])
    assert len(job_observer.calls) == 3 and sizes == [64 * MiB, 32 * MiB, 16 * MiB]
    assert of_kind(messages, OutOfMemory) == [] and controller.handled == {"cuda:0": 3}


def test_a_failure_handled_inside_the_op_is_counted_once_the_jobs_frame_moves_on(
    tmp_path: Path,
) -> None:
    # The job's own frame called the op; torch caught the error in C++ and returned. The frame
    # goes on (it does not return): its next line tells the failure was handled.
    data = load("full")
    controller, messages = make_controller(tmp_path)
    with_fixture(controller, data)
    observers = [controller.observe_cuda_oom, SnapshotOnOom(tmp_path)]
    list(map(methodcaller("__call__", *observer_args(data)), observers))  # the op, handled
    handled_by_now = dict(controller.handled)
    assert handled_by_now == {"cuda:0": 1} and of_kind(messages, OutOfMemory) == []


def test_same_size_failures_torch_handles_are_each_counted(tmp_path: Path) -> None:
    # torch asks twice for the same size and gets it the third time: the allocator counts two
    # failures (num_ooms), and both were handled, so none reached the job.
    data = load("full")
    controller, messages = make_controller(tmp_path)
    with_fixture(controller, data)
    args = observer_args(data)
    allocate_same_size = _TORCH_RETRY["same_size"]
    allocate_same_size(controller.observe_cuda_oom, args, 2)
    assert of_kind(messages, OutOfMemory) == []
    assert controller.handled == {"cuda:0": 2}
    # What the memory panel shows: the allocator's count less those handled.
    stats = probe_stats(controller, {**data["memory_stats"], "num_ooms": 2})
    assert stats.num_ooms == 2 and stats.handled_ooms == 2
    assert DeviceMemory(stats.device, stats, deque()).ooms == 0


def test_a_same_size_failure_after_a_handled_one_reaches_the_job_once(tmp_path: Path) -> None:
    data = load("full")
    controller, messages = make_controller(tmp_path)
    with_fixture(controller, data)
    with pytest.raises(torch.OutOfMemoryError):
        _TORCH_RETRY["same_size"](controller.observe_cuda_oom, observer_args(data), 99)
    # The first to reach the job is published, though two of its size came just before.
    (event,) = of_kind(messages, OutOfMemory)
    assert event.requested_bytes == 4 * GiB
    assert controller.handled == {"cuda:0": 2} and controller.repeats == 0


def probe_stats(controller: OomController, memory_stats: dict[str, Any]) -> MemoryStats:
    """What the agent's CUDA memory probe reads for device 0 from ``memory_stats``."""
    cuda = SimpleNamespace(
        is_initialized=lambda: True,
        is_available=lambda: True,
        device_count=lambda: 1,
        memory_stats=lambda device: memory_stats,
        mem_get_info=lambda device: (8 * GiB, 80 * GiB),
    )
    (stats,) = CudaMemoryProbe(cuda, handled_ooms=controller.handled_ooms).read()
    return stats


#: torch's side of a retry with the same size, up to three attempts (the last one raises).
_TORCH_RETRY: dict[str, Any] = {"torch": torch, "allocate": allocate}
exec(
    compile(
        """
def same_size(observer, args, fails):
    for attempt in range(3):
        try:
            return allocate(observer, args, attempt < fails)
        except torch.OutOfMemoryError:
            if attempt == 2:
                raise
""",
        ALLOCATOR_FILE,
        "exec",
    ),
    _TORCH_RETRY,
)
