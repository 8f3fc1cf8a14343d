"""The step and DataLoader hooks in the agent: what they record, and that they change nothing.

Collector and tracker logic runs on scripted events; the hooks themselves run against the real
torch of the test process, installed and removed by each test.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import torchtop
from tests.conftest import Forked
from torchtop.agent import steps as step_hooks
from torchtop.agent.loaders import LoaderTracker, batch_size_of, settings_of, wrap_next
from torchtop.agent.steps import BATCH, BEFORE_STEP, PENDING, StepCollector
from torchtop.agent.training import TrainingMonitor, loaded
from torchtop.protocol import MAX_STEP_DETAIL, LoaderInfo, StepStats, decode, encode

# -- the collector on scripted events ----------------------------------------------------------


def test_steps_run_from_the_end_of_one_optimizer_step_to_the_next() -> None:
    c = StepCollector()
    c.batch(0.5, first=True, loader=0, samples=8)  # worker start-up
    c.optimizer_step(1.1, 7, 1.0)
    c.batch(0.2, first=False, loader=0, samples=8)
    c.optimizer_step(1.6, 7, 1.5)
    first, second = c.take_records()
    assert first.duration is None and first.startup == 0.5 and first.samples == 8
    assert second.duration == pytest.approx(0.5)
    assert second.wait == pytest.approx(0.2) and second.startup == 0.0
    assert second.optimizer == pytest.approx(0.1)
    assert second.samples == 8
    assert c.total == 2


def test_only_the_first_optimizer_to_step_is_the_clock() -> None:
    c = StepCollector()
    for t in (1.0, 2.0, 3.0):
        c.optimizer_step(t + 0.1, 1, t)
        c.optimizer_step(t + 0.3, 2, t + 0.2)  # a second optimizer (a GAN's discriminator)
    records = c.take_records()
    assert c.total == 3
    # The other optimizer's time counts as optimizer time in the step that follows.
    assert records[1].optimizer == pytest.approx(0.2)


def test_the_clock_moves_to_the_optimizer_of_the_next_stage() -> None:
    """Stage 1 trains with one optimizer, stage 2 with another: every step of both counts."""
    c = StepCollector()
    t = 0.0
    for _ in range(100):  # stage 1: optimizer 1, 10 ms steps
        t += 0.01
        c.optimizer_step(t, 1, t - 0.002)
    for _ in range(300):  # stage 2: optimizer 2 only, 10 ms steps
        t += 0.01
        c.optimizer_step(t, 2, t - 0.002)
    records = c.take_records()
    assert c.total == 400 and len(records) == 400
    assert c.clock == 2
    # The stage's first steps (before the clock moved) keep their own ends and times.
    timed = [r for r in records if r.duration is not None]
    assert all(r.duration == pytest.approx(0.01) for r in timed)
    assert all(r.optimizer == pytest.approx(0.002) for r in timed)


def test_a_critic_stepping_ten_times_per_generator_step_never_moves_the_clock() -> None:
    c = StepCollector()
    t = 0.0
    for _ in range(200):
        t += 0.01
        c.optimizer_step(t, 1, t - 0.001)  # the generator: the clock from its first step
        for _ in range(10):
            t += 0.01
            c.optimizer_step(t, 2, t - 0.001)  # the critic
    records = c.take_records()
    assert c.clock == 1 and c.total == 200
    assert records[-1].optimizer == pytest.approx(0.011)  # its own and the critic's ten


def test_a_closure_runs_as_compute_not_optimizer_time() -> None:
    """``optimizer.step(closure)``: forward and backward inside the step are compute."""
    c = StepCollector()
    c.optimizer_step(1.0, 1, 0.9, 0.0)
    c.optimizer_step(2.0, 1, 1.1, 0.8)  # 0.9 s in step(), 0.8 s of it in the closure
    records = c.take_records()
    assert records[1].optimizer == pytest.approx(0.1)


def test_a_scaler_step_without_an_optimizer_step_is_a_skipped_step() -> None:
    c = StepCollector()
    c.scaler_begin(1.0, 1)
    c.optimizer_step(1.2, 1, 1.1)
    c.scaler_end(1.3, 1)
    c.scaler_begin(2.0, 1)  # inf gradients: no optimizer step inside
    c.scaler_end(2.1, 1)
    records = c.take_records()
    assert [r.skipped for r in records] == [False, True]
    assert records[1].duration == pytest.approx(0.9)
    assert (c.total, c.skipped_total) == (2, 1)


def test_explicit_steps_take_over_as_the_clock() -> None:
    c = StepCollector()
    c.explicit_step(1.0)
    c.optimizer_step(1.3, 1, 1.2)
    c.explicit_step(2.0)
    records = c.take_records()
    assert c.total == 2 and c.clock == "explicit"
    assert records[1].optimizer == pytest.approx(0.1)


def test_samples_come_from_the_loader_that_fed_the_step() -> None:
    c = StepCollector()
    c.explicit_step(0.0)
    c.batch(0.1, first=True, loader=1, samples=64)  # validation between steps
    c.batch(0.1, first=False, loader=1, samples=64)
    c.batch(0.1, first=False, loader=0, samples=16)
    c.explicit_step(1.0)
    record = c.take_records()[1]
    assert record.samples == 16
    assert record.wait == pytest.approx(0.2) and record.startup == pytest.approx(0.1)


def test_frames_list_every_step_or_an_even_sample_with_exact_sums() -> None:
    c = StepCollector()
    c.explicit_step(0.0)
    for i in range(1, 201):
        c.batch(0.001, first=False, loader=0, samples=4)
        c.explicit_step(i * 0.01)
    frame = c.frame(now=5.0, to_wall=1000.0)
    assert frame is not None
    assert frame.count == 201 and frame.timed == 200 and frame.total == 201
    assert frame.time_s == pytest.approx(2.0) and frame.wait_s == pytest.approx(0.2)
    assert frame.samples == 800
    assert len(frame.ends) == MAX_STEP_DETAIL == len(frame.durations)
    assert frame.ends[0] == pytest.approx(1000.0)
    assert frame.durations[0] is None
    assert decode(encode(frame)) == frame
    assert c.frame(now=5.1, to_wall=1000.0) is None  # nothing new


def test_restart_forgets_the_open_step() -> None:
    c = StepCollector()
    c.explicit_step(1.0)
    c.restart()
    c.explicit_step(9.0)
    assert [r.duration for r in c.take_records()] == [None, None]


# -- batches and loaders -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("batch", "size"),
    [
        (torch.zeros(5, 3), 5),
        ((torch.zeros(4, 2), torch.zeros(4)), 4),
        ([[torch.zeros(3)], torch.zeros(9)], 3),
        ({"input_ids": torch.zeros(6, 2), "labels": torch.zeros(6)}, 6),
        (torch.tensor(1.0), None),
        ((torch.tensor(2.0), torch.zeros(3)), None),
        (nn.Parameter(torch.zeros(7, 2)), 7),
        ({"ids": [1, 2]}, None),
        ("text", None),
        ([], None),
        ({}, None),
    ],
)
def test_batch_size_is_the_leading_dimension_of_the_first_tensor(batch: Any, size: Any) -> None:
    assert batch_size_of(batch) == size
    # The DataLoader hook sizes the usual batches inline: the same sizes.
    wrapped = wrap_next(lambda _iterator: batch)
    PENDING.clear()
    assert wrapped(object()) is batch
    (event,) = PENDING
    PENDING.clear()
    assert event[0] == BATCH and event[4] == size


class _Loader:
    def __init__(self, dataset: Any, **settings: Any) -> None:
        self.dataset = dataset
        self.batch_size = settings.get("batch_size", 4)
        self.num_workers = settings.get("num_workers", 0)
        self.pin_memory = False
        self.prefetch_factor = 2 if self.num_workers else None
        self.persistent_workers = False
        self.multiprocessing_context = None


class _Iterator:
    _workers: list[Any] = []


class _Data:
    pass


def register(tracker: LoaderTracker, it: Any, loader: Any) -> None:
    """What the ``__init__`` wrapper leaves for a new iterator of ``loader``."""
    import weakref

    tracker.iterator_created(
        id(it),
        weakref.ref(it),
        id(loader),
        weakref.ref(loader),
        settings_of(loader),
        id(loader.dataset),
    )


def test_loaders_are_numbered_in_first_use_order_and_stable_across_epochs() -> None:

    tracker = LoaderTracker()
    train, val = _Loader(_Data(), batch_size=32), _Loader(_Data(), batch_size=64)
    iterators = []
    for _epoch in range(3):
        for loader in (train, val):
            it = _Iterator()
            iterators.append(it)
            register(tracker, it, loader)
            assert tracker.batch(id(it), 0.5, 32) == (True, 0 if loader is train else 1)
            assert tracker.batch(id(it), 0.1, 32) == (False, 0 if loader is train else 1)
    frame = tracker.frame(1.0)
    assert isinstance(frame, LoaderInfo)
    assert [(x.name, x.dataset, x.batch_size, x.epochs) for x in frame.loaders] == [
        ("loader 0", "_Data", 32, 3),
        ("loader 1", "_Data", 64, 3),
    ]
    assert frame.loaders[0].first_batch_s == pytest.approx(1.5)
    assert frame.loaders[0].wait_s == pytest.approx(0.3)
    assert tracker.frame(2.0) is None  # nothing changed
    # A DataLoader made anew over the same dataset is still loader 0.
    dataset = train.dataset
    del train
    again = _Loader(dataset, batch_size=32)
    it = _Iterator()
    register(tracker, it, again)
    assert tracker.batch(id(it), 0.1, 32)[1] == 0


def test_worker_processes_are_read_by_pid() -> None:

    class Process:
        def __init__(self, pid: int) -> None:
            self.pid = pid

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        tracker = LoaderTracker()
        loader = _Loader(_Data(), num_workers=2)
        it = _Iterator()
        it._workers = [Process(child.pid), Process(2**22 + 12345)]
        register(tracker, it, loader)
        tracker.read_workers()
        frame = tracker.frame(1.0)
        assert frame is not None
        alive, gone = frame.loaders[0].workers
        assert alive.pid == child.pid and alive.alive and alive.rss_bytes
        assert alive.cpu_percent is not None
        assert not gone.alive and gone.rss_bytes is None
    finally:
        child.kill()
        child.wait()


# -- the real hooks ----------------------------------------------------------------------------


@pytest.fixture
def monitor() -> Iterator[TrainingMonitor]:
    PENDING.clear()
    m = TrainingMonitor()
    m.start()
    assert m.installed
    yield m
    m.stop(0.0)
    PENDING.clear()


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_hooks_count_optimizer_steps_and_time_next(monitor: TrainingMonitor) -> None:
    model, opt = _model()
    loader = DataLoader(TensorDataset(torch.randn(20, 4), torch.randn(20, 2)), batch_size=8)
    for _epoch in range(2):
        for x, y in loader:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    messages = monitor.tick(1.0)
    (steps,) = [m for m in messages if isinstance(m, StepStats)]
    assert steps.total == 6 and steps.timed == 5
    assert steps.batch_samples == [8, 8, 4, 8, 8, 4]
    assert steps.samples == 8 + 4 + 8 + 8 + 4
    (info,) = [m for m in messages if isinstance(m, LoaderInfo)]
    (stats,) = info.loaders
    assert (stats.name, stats.dataset, stats.batch_size, stats.batches, stats.epochs) == (
        "loader 0",
        "TensorDataset",
        8,
        6,
        2,
    )


class _SlowModel(nn.Module):
    """A forward pass that takes a known time at least (the closure's share of the step)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.02)
        return self.linear(x)


def _steps_in_thread(
    model: nn.Module, opt: torch.optim.Optimizer, seconds: float, pause_s: float = 0.0
) -> threading.Thread:
    """A training loop of ``seconds`` in a thread of its own (the job's training thread),
    started; ``pause_s``: a sleep before each backward pass (longer steps)."""
    x, y = torch.randn(8, 4), torch.randn(8, 2)

    def train() -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            time.sleep(pause_s)
            loss.backward()
            opt.step()

    thread = threading.Thread(target=train)
    thread.start()
    return thread


def test_a_tick_waits_for_the_next_backward_pass_of_a_job_that_steps_often(
    monitor: TrainingMonitor,
) -> None:
    """The tick runs while the pass holds no GIL: it waits for one to begin, at most two
    steps' time, and only for a job whose steps are short beside the interval."""
    model, opt = _model()
    assert not monitor.before_tick(0.1)  # no step yet: no wait
    trainer = _steps_in_thread(model, opt, 1.0)
    try:
        time.sleep(0.2)
        monitor.tick(time.time())  # drains the steps so far
        assert monitor.steps.last_backward is not None and monitor.steps.recent
        met = sum(monitor.before_tick(0.1) for _ in range(20))
        assert met >= 15, met  # the next pass begins within two steps' time
        assert step_hooks._WAKE[0] is None  # nothing left waiting
    finally:
        trainer.join()
    # Steps that stopped: no wait (the last pass is too long ago), and it takes no time.
    monitor.tick(time.time())
    time.sleep(0.25)
    began = time.perf_counter()
    assert not monitor.before_tick(0.1)
    assert time.perf_counter() - began < 0.01


def test_a_tick_does_not_wait_for_a_job_whose_steps_are_long(monitor: TrainingMonitor) -> None:
    model, opt = _model()
    trainer = _steps_in_thread(model, opt, 0.6, pause_s=0.05)
    try:
        time.sleep(0.3)
        monitor.tick(time.time())
        assert monitor.steps.recent and min(monitor.steps.recent) >= 0.05
        assert not any(monitor.before_tick(0.1) for _ in range(3))
    finally:
        trainer.join()


def test_a_wait_for_a_backward_pass_ends_with_the_pass_or_its_timeout(
    monitor: TrainingMonitor,
) -> None:
    began = time.perf_counter()
    assert not step_hooks.wait_for_backward(0.05)
    assert time.perf_counter() - began >= 0.05 and step_hooks._WAKE[0] is None
    model, _ = _model()
    seen: list[bool] = []
    waiter = threading.Thread(target=lambda: seen.append(step_hooks.wait_for_backward(5.0)))
    waiter.start()
    while step_hooks._WAKE[0] is None:
        time.sleep(0.001)
    began = time.perf_counter()
    model(torch.randn(2, 4)).sum().backward()
    waiter.join()
    assert seen == [True] and time.perf_counter() - began < 1.0
    model(torch.randn(2, 4)).sum().backward()  # no tick waits: nothing to release


@pytest.mark.parametrize("how", ["positional", "keyword", "lbfgs"])
def test_a_closures_forward_and_backward_are_not_optimizer_time(
    monitor: TrainingMonitor, how: str
) -> None:
    model = _SlowModel()
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    if how == "lbfgs":
        opt: torch.optim.Optimizer = torch.optim.LBFGS(model.parameters(), max_iter=3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = 0

    def closure() -> torch.Tensor:
        nonlocal calls
        calls += 1
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    for _ in range(4):
        loss = opt.step(closure) if how != "keyword" else opt.step(closure=closure)
        assert isinstance(loss, torch.Tensor)  # what the closure returned passes through
    (steps,) = [m for m in monitor.tick(1.0) if isinstance(m, StepStats)]
    assert steps.total == 4
    # Each timed step ran the closure (>= 20 ms each): none of it is optimizer time, however
    # long the optimizer's own work took on a busy machine.
    in_closures = 0.02 * (calls - calls // 4)
    assert steps.time_s >= in_closures
    assert steps.optimizer_s <= steps.time_s - in_closures, (steps.optimizer_s, steps.time_s)


def test_a_closure_that_raises_reaches_the_job(monitor: TrainingMonitor) -> None:
    _, opt = _model()

    def closure() -> None:
        raise KeyError("from the job")

    with pytest.raises(KeyError, match="from the job"):
        opt.step(closure)


def test_uninstall_puts_everything_back(monitor: TrainingMonitor) -> None:
    from torch.nn.modules import module as nn_module
    from torch.optim import optimizer as optim_module
    from torch.utils.data import dataloader as dl_module

    cls = dl_module._BaseDataLoaderIter
    assert getattr(cls.__next__, "_torchtop", False)
    hooks = (
        len(optim_module._global_optimizer_pre_hooks),
        len(optim_module._global_optimizer_post_hooks),
        len(nn_module._global_parameter_registration_hooks),
    )
    monitor.uninstall()
    assert not getattr(cls.__dict__["__next__"], "_torchtop", False)
    assert not getattr(cls.__dict__["__init__"], "_torchtop", False)
    assert not getattr(torch.amp.GradScaler.__dict__["step"], "_torchtop", False)
    # One pre-hook: the step timer's, which also notes the optimizer for the holders.
    assert len(optim_module._global_optimizer_pre_hooks) == hooks[0] - 1
    assert BEFORE_STEP[0] is None  # the holders' reads are out with it
    assert len(optim_module._global_optimizer_post_hooks) == hooks[1] - 1
    # The module parameter registration hook that finds parameters under no optimizer.
    assert len(nn_module._global_parameter_registration_hooks) == hooks[2] - 1
    PENDING.clear()
    model, opt = _model()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    next(iter(DataLoader(TensorDataset(torch.randn(4, 4)), batch_size=2)))
    assert not PENDING
    monitor.reinstall()
    assert getattr(cls.__dict__["__next__"], "_torchtop", False)


def test_removed_hooks_stay_out_through_the_samplers_ticks_until_reinstalled(
    monitor: TrainingMonitor,
) -> None:
    from torch.utils.data import dataloader as dl_module

    cls = dl_module._BaseDataLoaderIter
    monitor.remove()  # the benchmark's "off" block: no hooks while it lasts
    monitor.tick(time.time())  # a tick puts back hooks that failed or came late, not these
    assert not getattr(cls.__dict__["__next__"], "_torchtop", False)
    assert not monitor.installed
    monitor.reinstall()
    assert getattr(cls.__dict__["__next__"], "_torchtop", False)
    assert monitor.installed


def test_the_time_without_hooks_does_not_count_toward_the_holders_reads(
    monitor: TrainingMonitor,
) -> None:
    """The benchmark's "off" blocks: an optimizer's next read of what holds the memory is
    due in the time the hooks were in, so short blocks do not make the reads denser."""
    from torchtop.agent import holders

    _, opt = _model()
    holders.note_optimizer(opt)
    due = holders._NOTED[opt].next_at
    monitor.remove()
    time.sleep(0.05)
    monitor.reinstall()
    assert holders._NOTED[opt].next_at >= due + 0.05
    moved = holders._NOTED[opt].next_at
    monitor.resumed_after(0.5)  # the sampler's pause moves the sampler's schedules only
    assert holders._NOTED[opt].next_at == moved


class _Windows:
    """The op windows' side of a pause: what they were told."""

    def __init__(self) -> None:
        self.moved: list[float] = []

    def resumed_after(self, paused_s: float) -> None:
        self.moved.append(paused_s)


def test_a_paused_sampler_moves_the_frames_scheduled_in_sampling_time() -> None:
    windows = _Windows()
    monitor = TrainingMonitor(ops=windows)  # type: ignore[arg-type]
    steps, workers = monitor._next_steps, monitor._next_workers
    monitor.resumed_after(2.0)
    assert (monitor._next_steps, monitor._next_workers) == (steps + 2.0, workers + 2.0)
    assert windows.moved == [2.0]


def test_reinstalled_with_only_some_parts_the_others_stay_out(monitor: TrainingMonitor) -> None:
    """``benchmarks.agent_overhead --hook-parts``: one part of the hooks in, the rest out."""
    from torch.optim import optimizer as optim_module
    from torch.utils.data import dataloader as dl_module

    cls = dl_module._BaseDataLoaderIter
    pre_hooks = len(optim_module._global_optimizer_pre_hooks)
    monitor.remove()
    assert len(optim_module._global_optimizer_pre_hooks) == pre_hooks - 1
    monitor.reinstall(("dataloader",))
    assert getattr(cls.__dict__["__next__"], "_torchtop", False)
    assert len(optim_module._global_optimizer_pre_hooks) == pre_hooks - 1
    assert BEFORE_STEP[0] is None
    assert not getattr(torch.autograd.backward, "_torchtop", False)
    monitor.remove()
    monitor.reinstall(("optimizer",))
    assert not getattr(cls.__dict__["__next__"], "_torchtop", False)
    assert len(optim_module._global_optimizer_pre_hooks) == pre_hooks
    assert BEFORE_STEP[0] is not None
    monitor.remove()
    monitor.reinstall()
    assert monitor.installed and getattr(torch.autograd.backward, "_torchtop", False)


class _Broken(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 2:
            raise KeyError("bad record 2")
        return torch.zeros(1)


def test_the_wrapper_reraises_exactly_what_next_raised(monitor: TrainingMonitor) -> None:
    it = iter(DataLoader(_Broken(), batch_size=2))
    next(it)
    with pytest.raises(KeyError, match="bad record 2") as caught:
        next(it)
    frames = traceback.extract_tb(caught.value.__traceback__)
    ours = [f for f in frames if "torchtop" in f.filename]
    assert len(ours) == 1 and ours[0].name == "__next__"  # one pass-through frame, no more
    short = iter(DataLoader(TensorDataset(torch.zeros(2, 1)), batch_size=2))
    next(short)
    with pytest.raises(StopIteration):
        next(short)
    assert list(DataLoader(TensorDataset(torch.zeros(3, 1)), batch_size=2)) != []


def test_grad_scaler_skips_are_told_apart(monitor: TrainingMonitor) -> None:
    model, opt = _model()
    scaler = torch.amp.GradScaler("cpu")
    for i in range(4):
        opt.zero_grad()
        scaler.scale(model(torch.randn(3, 4)).sum()).backward()
        if i == 2:
            model.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
    (steps,) = [m for m in monitor.tick(1.0) if isinstance(m, StepStats)]
    assert (steps.total, steps.skipped_total) == (4, 1)


def test_torchtop_step_works_without_an_optimizer(monitor: TrainingMonitor) -> None:
    for _ in range(5):
        torchtop.step()
    (steps,) = [m for m in monitor.tick(1.0) if isinstance(m, StepStats)]
    assert steps.total == 5 and steps.timed == 4


def test_steps_with_no_agent_cost_nothing_and_grow_nothing() -> None:
    before = PENDING.maxlen
    for _ in range(10):
        torchtop.step()
    assert PENDING.maxlen == before


def test_forked_children_run_no_hooks(monitor: TrainingMonitor) -> None:

    def child(parent: Forked) -> None:  # as a DataLoader worker would be
        from torch.utils.data import dataloader as dl_module

        hooked = getattr(dl_module._BaseDataLoaderIter.__dict__["__next__"], "_torchtop", False)
        parent.send(b"1" if hooked else b"0")

    with Forked(child) as worker:
        assert worker.receive() == b"0"
    from torch.utils.data import dataloader as dl_module

    assert getattr(dl_module._BaseDataLoaderIter.__dict__["__next__"], "_torchtop", False)


# -- installing at the right moment ------------------------------------------------------------


def test_hooks_are_in_before_import_torch_returns() -> None:
    """The agent starts before the job imports torch; the first step is already counted."""
    code = (
        "import json, sys\n"
        "from torchtop.agent.training import TrainingMonitor\n"
        "m = TrainingMonitor(); m.start()\n"
        "before = 'torch' in sys.modules\n"
        "import torch\n"
        "installed = m.installed\n"
        "model = torch.nn.Linear(2, 2); opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "model(torch.ones(1, 2)).sum().backward(); opt.step()\n"
        "frames = m.tick(0.0)\n"
        "print(json.dumps([before, installed, frames[0].total, sys.meta_path.count(m._watcher)]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    before, installed, total, watchers = json.loads(out.stdout.strip().splitlines()[-1])
    assert not before and installed and total == 1 and watchers == 0


def test_the_agent_never_imports_torch_first() -> None:
    code = (
        "import sys\n"
        "from torchtop.agent.training import TrainingMonitor, loaded\n"
        "m = TrainingMonitor(); m.start(); m.tick(0.0); m.stop(0.0)\n"
        "import json, os\n"
        "print('torch' in sys.modules, loaded('torch.optim.optimizer') is None)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.split() == ["False", "True"]
    assert loaded("no.such.module") is None


def test_an_epoch_of_persistent_workers_reuses_the_iterator() -> None:

    tracker = LoaderTracker()
    loader = _Loader(_Data(), num_workers=2)
    it = _Iterator()
    register(tracker, it, loader)
    assert tracker.batch(id(it), 1.0, 4) == (True, 0)  # worker start-up
    tracker.exhausted(id(it), 0.01)
    assert tracker.batch(id(it), 0.2, 4) == (False, 0)  # epoch 2: no start-up, a wait
    (stats,) = tracker.loaders
    assert stats.epochs == 2 and stats.first_batch_s == 1.0
    assert stats.wait_s == pytest.approx(0.21)
    # A new iterator at a spent one's address starts an epoch once, not twice.
    tracker.exhausted(id(it), 0.0)
    register(tracker, it, loader)
    tracker.batch(id(it), 0.5, 4)
    assert stats.epochs == 3


def test_a_failing_tick_takes_the_hooks_out(monitor: TrainingMonitor) -> None:
    from torch.utils.data import dataloader as dl_module

    def broken() -> None:
        raise RuntimeError("a bug")

    monitor.drain = broken  # type: ignore[method-assign]
    try:
        with pytest.raises(RuntimeError):
            monitor.tick(1.0)
    finally:
        del monitor.drain
    assert not monitor.installed
    assert not getattr(dl_module._BaseDataLoaderIter.__dict__["__next__"], "_torchtop", False)


def test_a_part_that_cannot_install_is_reported_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchtop.protocol import ProbeStatus

    def unexpected_torch() -> None:
        raise AttributeError("no register_optimizer_step_pre_hook")

    monkeypatch.setattr(TrainingMonitor, "_install_optimizer", staticmethod(unexpected_torch))
    m = TrainingMonitor()
    m.start()
    try:
        statuses = [x for x in m.tick(1.0) if isinstance(x, ProbeStatus)]
        assert len(statuses) == 1 and not statuses[0].available
        assert "optimizer hooks" in statuses[0].detail
        assert not [x for x in m.tick(2.0) if isinstance(x, ProbeStatus)]
    finally:
        m.stop(0.0)


def test_a_loader_gone_before_its_iterator_is_read_is_still_named() -> None:
    """The job iterates a loader at its very end: the sampler reads the events after both the
    iterator and the loader are freed."""
    import weakref

    tracker = LoaderTracker()
    data = _Data()
    loader = _Loader(data, batch_size=8)
    it = _Iterator()
    register(tracker, it, loader)
    tracker.batch(id(it), 0.3, 8)
    args = (id(it), weakref.ref(it), id(loader), weakref.ref(loader), settings_of(loader), id(data))
    del it, loader
    tracker.prune()
    tracker.iterator_created(*args)  # the second epoch, read after the end
    assert tracker.batch(args[0], 0.3, 8) == (True, 0)
    (entry,) = tracker.loaders
    assert entry.epochs == 2 and entry.batches == 2


def test_the_hooks_modules_import_neither_torch_nor_the_ui() -> None:
    code = (
        "import json, sys, torchtop.agent.training, torchtop.model.training\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    loaded_modules = set(json.loads(out.stdout))
    assert not {"torch", "textual", "rich"} & loaded_modules
