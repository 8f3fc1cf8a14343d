"""The live split of parameters, gradients and optimizer state equals the model's arithmetic."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
from torch import nn

from tests.unit.test_server import HELLO
from torchtop.agent import holders, steps
from torchtop.agent.holders import HolderReader, read_holders

F32 = 4


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        out = model(x)
        (out[0] if isinstance(out, tuple) else out).float().pow(2).mean().backward()
        optimizer.step()


def test_mlp_with_adam_to_the_byte() -> None:
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = torch.optim.Adam(model.parameters())
    _train(model, optimizer, torch.randn(8, 64))
    params = list(model.parameters())
    got = read_holders([optimizer]).devices["cpu"]
    assert got.parameters == _bytes(params) == (64 * 256 + 256 + 256 * 10 + 10) * F32
    assert got.gradients == _bytes(params)
    # exp_avg and exp_avg_sq like each parameter, and one float32 scalar ``step`` per parameter.
    assert got.optimizer_state == 2 * _bytes(params) + len(params) * F32


def test_cnn_with_sgd_momentum_to_the_byte() -> None:
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    _train(model, optimizer, torch.randn(2, 3, 8, 8))
    params = list(model.parameters())
    got = read_holders([optimizer]).devices["cpu"]
    assert got.parameters == _bytes(params)
    assert got.gradients == _bytes(params)
    assert got.optimizer_state == _bytes(params)  # one momentum buffer per parameter


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.block = nn.TransformerEncoderLayer(dim, 4, 64, batch_first=True)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(tokens)))


def test_transformer_with_adamw_and_tied_embeddings_counts_the_tied_weight_once() -> None:
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters())
    _train(model, optimizer, torch.randint(0, 50, (2, 5)))
    params = list(model.parameters())  # nn.Module yields the tied weight once
    assert model.head.weight is model.embed.weight
    got = read_holders([optimizer]).devices["cpu"]
    assert got.parameters == _bytes(params)
    assert got.gradients == _bytes(params)
    assert got.optimizer_state == 2 * _bytes(params) + len(params) * F32


def test_views_of_one_storage_and_two_optimizers_over_one_model_count_once() -> None:
    flat = torch.zeros(100)
    a, b = nn.Parameter(flat[:40].view(4, 10)), nn.Parameter(flat[40:])
    # Parameters built from views share ``flat``'s storage.
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    first, second = torch.optim.SGD([a, b], lr=0.1), torch.optim.SGD([a], lr=0.1)
    got = read_holders([first, second]).devices["cpu"]
    assert got.parameters == 100 * F32
    assert got.gradients == 0 and got.optimizer_state == 0


def test_pointers_name_each_storage_by_category() -> None:
    layer = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    _train(layer, optimizer, torch.randn(2, 4))
    got = read_holders([optimizer])
    weight = ("cpu", layer.weight.untyped_storage().data_ptr())
    grad = ("cpu", layer.weight.grad.untyped_storage().data_ptr())  # type: ignore[union-attr]
    assert got.pointers[weight] == ("parameters", 64)
    assert got.pointers[grad] == ("gradients", 64)
    assert sorted(c for c, _ in got.pointers.values()).count("optimizer_state") == 2


def test_reader_sees_only_optimizers_whose_step_ran_and_reads_at_most_once_an_interval() -> None:
    holders.forget_all()
    reader = HolderReader(interval_s=1.0)
    assert reader.read(now=100.0) is None  # no optimizer stepped yet
    layer = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    holders.note_optimizer(optimizer)
    assert reader.read(now=100.5) is None  # within the interval
    first = reader.read(now=101.0)
    assert first is not None and first.devices["cpu"].parameters == (16 + 4) * F32
    assert reader.read(now=101.5) is None
    del optimizer
    import gc

    gc.collect()
    assert reader.read(now=102.0) is None  # the dropped optimizer is forgotten
    holders.forget_all()


def test_the_step_hook_keeps_two_optimizers_apart_and_holds_neither_alive() -> None:
    """The hook remembers the last optimizer it saw to find its record quickly: two that step
    in turn each keep their own reads, and one the job drops is still forgotten."""
    import gc
    import weakref

    holders.forget_all()
    a_layer, b_layer = nn.Linear(4, 4), nn.Linear(8, 8)
    a = torch.optim.SGD(a_layer.parameters(), lr=0.1)
    b = torch.optim.SGD(b_layer.parameters(), lr=0.1)
    for optimizer in (a, b, a, b):
        holders.optimizer_pre_hook(optimizer, (optimizer,), {})
    reads = {id(o): n.read for o, n in holders._NOTED.items()}
    assert set(reads) == {id(a), id(b)}
    assert reads[id(a)] is not None and reads[id(a)].devices["cpu"].parameters == 20 * F32
    assert reads[id(b)] is not None and reads[id(b)].devices["cpu"].parameters == 72 * F32
    gone = weakref.ref(b)
    del b, optimizer
    gc.collect()
    assert gone() is None  # the last optimizer seen is not kept alive by the hook
    assert [id(o) for o in holders._NOTED] == [id(a)]
    holders.forget_all()
    assert holders._LAST == [None, None]


def test_the_agents_step_hook_calls_the_holders_only_when_a_read_may_be_due() -> None:
    """Past an optimizer's first steps (whose state is read as it appears), its step costs a
    comparison until its next read; another optimizer's step is seen at once."""
    holders.forget_all()
    calls: list[int] = []

    def counted(optimizer: object, now: float) -> None:
        calls.append(id(optimizer))
        holders.step_seen(optimizer, now)

    a_layer, b_layer = nn.Linear(4, 4), nn.Linear(8, 8)
    a = torch.optim.SGD(a_layer.parameters(), lr=0.1, momentum=0.9)
    b = torch.optim.SGD(b_layer.parameters(), lr=0.1)
    steps.BEFORE_STEP[0] = counted
    try:
        for _ in range(8):
            steps.optimizer_pre_hook(a, (a,), {})
            a.state[a_layer.weight]["momentum_buffer"] = torch.zeros(4, 4)  # the step's state
        assert calls == [id(a)] * (1 + holders.WATCH_STEPS)
        read = holders._NOTED[a].read
        assert read is not None and read.devices["cpu"].optimizer_state == 16 * F32
        steps.optimizer_pre_hook(b, (b,), {})  # another optimizer: seen at once
        steps.optimizer_pre_hook(a, (a,), {})  # and the first again, after it
        assert calls[-2:] == [id(b), id(a)]
        # A read interval later a read is due: the hook calls, once.
        later = holders.READ_INTERVAL_S + 1.0
        steps._clock = holders._clock = lambda: time.perf_counter() + later
        del calls[:]
        steps.optimizer_pre_hook(a, (a,), {})
        steps.optimizer_pre_hook(a, (a,), {})
        assert calls == [id(a)]
    finally:
        steps._clock = holders._clock = time.perf_counter
        steps.BEFORE_STEP[0] = None
        steps._began.clear()
        holders.forget_all()


def test_the_step_hook_reads_in_the_training_thread_and_the_sampler_touches_no_tensor() -> None:
    """The sampler's side merges numbers: with the optimizer made unreadable after its step,
    it still gives the split, from another thread."""
    holders.forget_all()
    layer = nn.Linear(8, 8)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    optimizer.register_step_pre_hook(holders.optimizer_pre_hook)
    _train(layer, optimizer, torch.randn(2, 8))  # the second step's read sees the momentum

    class Unreadable:
        def __getattr__(self, name: str) -> object:
            raise AssertionError(f"the sampler touched the optimizer ({name})")

        def __iter__(self) -> object:
            raise AssertionError("the sampler touched the optimizer")

    optimizer.param_groups = Unreadable()  # type: ignore[assignment]
    optimizer.state = Unreadable()  # type: ignore[assignment]
    reader = HolderReader()
    seen: dict[str, object] = {}

    def sampler() -> None:
        seen["read"] = reader.read(now=0.0)
        seen["now"] = holders.read_now()

    thread = threading.Thread(target=sampler)
    thread.start()
    thread.join()
    read = seen["read"]
    params = (64 + 8) * F32
    assert isinstance(read, holders.Holders)
    got = read.devices["cpu"]
    assert (got.parameters, got.gradients, got.optimizer_state) == (params, params, params)
    holders.forget_all()


def test_reads_are_spaced_so_that_their_cost_stays_within_the_budget() -> None:
    assert holders.next_read_at(10.0, 0.0002, 1.0, 0.001) == 11.0  # cheap: once an interval
    assert holders.next_read_at(10.0, 0.05, 1.0, 0.001) == pytest.approx(60.0)  # 50 ms: 0.1%
    holders.forget_all()
    params = [nn.Parameter(torch.zeros(2)) for _ in range(10_000)]
    optimizer = torch.optim.SGD(params, lr=0.1)
    sum(p.sum() for p in params).backward()
    noted = holders._Noted()
    before = time.perf_counter()
    holders.read_due(optimizer, noted, interval_s=0.0, budget=0.001)
    read = noted.read
    assert read is not None and read.devices["cpu"].parameters == 10_000 * 2 * F32
    assert read.devices["cpu"].gradients == 10_000 * 2 * F32
    # The next read waits a thousand times what this one took.
    assert noted.cost_s > 0 and noted.next_at - before >= noted.cost_s / 0.001
    holders.forget_all()


def test_a_capture_off_the_training_thread_leaves_the_gradients_out() -> None:
    """``zero_grad()`` frees the gradients every step: their last addresses may hold anything in
    a snapshot taken later. A capture in the stepping thread reads them afresh; one in another
    thread (a snapshot on request) counts the parameters and state only."""
    holders.forget_all()
    layer = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    optimizer.register_step_pre_hook(holders.optimizer_pre_hook)
    _train(layer, optimizer, torch.randn(2, 4))
    params = (16 + 4) * F32
    fresh = holders.read_now()
    assert fresh is not None
    got = fresh.devices["cpu"]
    assert (got.parameters, got.gradients, got.optimizer_state) == (params, params, params)
    seen: dict[str, object] = {}
    thread = threading.Thread(target=lambda: seen.update(now=holders.read_now()))
    thread.start()
    thread.join()
    other = seen["now"]
    assert isinstance(other, holders.Holders)
    got = other.devices["cpu"]
    assert (got.parameters, got.gradients, got.optimizer_state) == (params, 0, params)
    assert all(category != "gradients" for category, _ in other.pointers.values())
    holders.forget_all()


def test_a_capture_inside_backward_reads_afresh() -> None:
    """An OOM in CUDA's backward is captured in the autograd thread; reading there is safe
    (the stepping thread waits for the backward), and on the CPU the same code path runs in a
    custom function's backward."""
    holders.forget_all()
    layer = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    optimizer.register_step_pre_hook(holders.optimizer_pre_hook)
    _train(layer, optimizer, torch.randn(2, 4))
    holders._STEPPING[0] = 0  # as if another thread stepped: only the backward makes it safe
    seen: list[holders.Holders | None] = []

    class Capture(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
            seen.append(holders.read_now())
            return grad

    Capture.apply(layer(torch.randn(2, 4))).sum().backward()  # gradients accumulate on .grad
    (inside,) = seen
    assert inside is not None and inside.devices["cpu"].gradients == (16 + 4) * F32
    holders.forget_all()


def test_the_monitor_sends_a_holders_frame_after_a_real_step_and_the_model_folds_it() -> None:
    """The agent's own optimizer hook notes the optimizer; its sampler tick sends the frame,
    which survives the wire; the model splits allocated and reserved with it."""
    from collections import deque

    from torchtop.agent.training import TrainingMonitor
    from torchtop.model.job import JobModel
    from torchtop.model.memory import DeviceMemory
    from torchtop.protocol import MemoryHolders, MemoryStats, Sample, decode, encode

    monitor = TrainingMonitor()
    monitor.start()
    try:
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
        optimizer = torch.optim.Adam(model.parameters())
        _train(model, optimizer, torch.randn(4, 32))
        frames = [m for m in monitor.tick(5.0) if isinstance(m, MemoryHolders)]
    finally:
        monitor.stop(6.0)
    assert len(frames) == 1
    frame = decode(encode(frames[0])[:-1])
    assert frame == frames[0] and isinstance(frame, MemoryHolders)
    params = _bytes(list(model.parameters()))
    (cpu,) = frame.devices
    assert (cpu.device, cpu.parameters, cpu.gradients) == ("cpu", params, params)
    assert cpu.optimizer_state == 2 * params + 4 * F32

    job = JobModel()
    job.apply(frame)
    allocated, reserved = 10 * params, 12 * params
    stats = MemoryStats(
        device="cpu", source="cpu-heap", allocated_bytes=allocated, reserved_bytes=reserved
    )
    job.apply(Sample(t=5.5, host=None, memory=[stats]))
    split = job.memory["cpu"].by_category
    assert split == {
        "parameters": params,
        "gradients": params,
        "optimizer_state": 2 * params + 16,
        "other_allocated": allocated - 4 * params - 16,
        "cache": reserved - allocated,
        "fragmentation": 0,
    }
    assert sum(split.values()) == reserved
    # Unknown until the holders are read.
    assert DeviceMemory("cpu", stats, deque()).by_category is None


def test_report_and_exporter_carry_the_models_one_split() -> None:
    from torchtop.export.families import families
    from torchtop.export.figures import figures_of
    from torchtop.model.job import JobModel
    from torchtop.protocol import DeviceHolding, DeviceInfo, MemoryHolders, MemoryStats, Sample
    from torchtop.report.job import report_json

    job = JobModel()
    cuda = [DeviceInfo(id="cuda:0", name="H200", total_bytes=150 << 30)]
    job.apply(dataclasses.replace(HELLO, devices=cuda))
    job.apply(MemoryHolders(t=2.0, optimizers=1, devices=[DeviceHolding("cuda:0", 100, 100, 200)]))
    # allocated 1000, reserved 1600, of which 150 free inside split segments.
    stats = MemoryStats("cuda:0", "cuda", 1000, 1600, inactive_split_bytes=150)
    job.apply(Sample(t=2.5, host=None, memory=[stats]))
    split = job.memory["cuda:0"].by_category
    assert split == {
        "parameters": 100,
        "gradients": 100,
        "optimizer_state": 200,
        "other_allocated": 600,
        "cache": 450,
        "fragmentation": 150,
    }
    assert report_json(job)["memory"]["by_category"] == {"cuda:0": split}
    figures = figures_of(job)
    assert figures is not None
    (family,) = [f for f in families([figures]) if f.name == "torchtop_memory_bytes"]
    assert {p.labels[-1]: p.value for p in family.points} == split


def test_parameters_under_no_optimizer_count_once_the_agent_saw_the_modules_built() -> None:
    """A frozen backbone and a teacher model hold memory under no optimizer: the module
    registration hook finds them; a split counts them as parameters, by address too."""
    from torch.nn.modules import module as torch_module

    holders.forget_all()
    undo = holders.install_module_hook(torch_module, seen_all=True)
    try:
        backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU()).requires_grad_(False)
        head = nn.Linear(32, 4)
        teacher = nn.Linear(16, 4)
        optimizer = torch.optim.SGD(head.parameters(), lr=0.1)
        optimizer.register_step_pre_hook(holders.optimizer_pre_hook)
        _train(nn.Sequential(backbone, head), optimizer, torch.randn(2, 16))
        reader = HolderReader()
        frame = reader.frame(1.0, now=0.0)
        frozen = _bytes([*backbone.parameters(), *teacher.parameters()])
        trained = _bytes(list(head.parameters()))
        assert frame is not None and frame.modules_seen
        (cpu,) = frame.devices
        assert (cpu.parameters, cpu.frozen, cpu.gradients) == (frozen + trained, frozen, trained)
        # At an OOM the frozen weights' blocks count as parameters.
        read = reader.last
        assert read is not None
        weight = backbone[0].weight.untyped_storage()
        block = {"address": weight.data_ptr(), "size": weight.nbytes()}
        segments = [{"blocks": [{**block, "state": "active_allocated"}]}]
        split = holders.split_blocks(segments, read, "cpu", None)
        assert split["parameters"] == weight.nbytes() and split["other_allocated"] == 0
    finally:
        for fn in undo:
            fn()
        holders.forget_all()
    assert not holders.MODULES_SEEN[0] and not list(holders._MODULE_PARAMS)


def test_modules_built_before_the_agent_are_said_to_be_missing() -> None:
    """Started after the job built its model (``torch.nn`` already loaded), the agent cannot
    know the frozen parameters: the frame says they are missing."""
    from torchtop.agent.training import TrainingMonitor
    from torchtop.protocol import MemoryHolders

    frozen = nn.Linear(16, 16).requires_grad_(False)  # before the agent
    monitor = TrainingMonitor()
    monitor.start()
    try:
        head = nn.Linear(16, 4)
        optimizer = torch.optim.SGD(head.parameters(), lr=0.1)
        _train(nn.Sequential(frozen, head), optimizer, torch.randn(2, 16))
        frames = [m for m in monitor.tick(5.0) if isinstance(m, MemoryHolders)]
    finally:
        monitor.stop(6.0)
    (frame,) = frames
    assert not frame.modules_seen
    (cpu,) = frame.devices
    assert (cpu.parameters, cpu.frozen) == (_bytes(list(head.parameters())), 0)
