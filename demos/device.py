"""Device hygiene: .to(device) once, .item() sync points, pinned copies.

Three habits that decide how much of a training step is spent waiting rather than computing:

- ``.to(device)`` once, before the loop, for the model and for data that fits, rather than at
  every step. ``model.to(device)`` walks every parameter each time it is called, even when they
  are already there; a batch moved each step is a host-to-device copy each step on a GPU.
- ``.item()`` (and ``float(t)``, ``int(t)``, ``if t:``) reads a value back to Python. On a GPU
  that is a sync point: the CPU stops queuing work and waits until the GPU has finished
  everything queued so far. Logging three numbers per step with ``.item()`` adds three such
  waits per step; accumulating on the device and reading once at the end adds one per loop.
  This demo counts the reads with ``torch.profiler`` (every host read is an
  ``aten::_local_scalar_dense`` op) and times both loops.
- ``pin_memory()`` and ``.to(device, non_blocking=True)``: a copy from page-locked host memory
  is faster and can run while the CPU does other work; from ordinary (pageable) memory the
  driver first copies it into a pinned buffer of its own, and the call waits.

On a CPU-only machine there is no device to copy to: the demo says what it can and cannot
measure there, and what would differ on a GPU.

Run it with ``torchtop demo device`` to watch each phase live, or ``--headless`` for the table
only.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from torchtop.agent import ops as op_windows
from torchtop.demos import _harness as harness


@dataclass(frozen=True)
class OpCounts:
    """What one call of a loop did, counted by ``torch.profiler`` from the ops it recorded."""

    #: ``Tensor.to`` calls made from Python (``aten::to`` events with no op above them: the
    #: same op also runs inside some kernels, such as log_softmax, where the code cannot
    #: avoid it).
    to_calls: int
    #: Those that really copied (an ``aten::_to_copy`` under them): a change of device or
    #: dtype. (Ops such as ``sum`` on a bool tensor copy internally too; those do not count.)
    copies: int
    #: Reads of a value into Python: ``.item()``, ``float(t)``, ``int(t)``, ``if t:``. All go
    #: through ``aten::_local_scalar_dense``, and on CUDA each one waits for the GPU: the sync
    #: points that torchtop's op windows count (the viewer's ops panel, key t, shows them
    #: per step while the demo runs).
    host_reads: int


def count_ops(fn: Callable[[], object]) -> OpCounts:
    """Run ``fn`` once under ``torch.profiler`` and count its moves, copies and host reads."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    to_calls = [e for e in prof.events() if e.name == "aten::to" and e.cpu_parent is None]
    # Reads counted as the agent's op windows count them (one per .item(), however deeply
    # nested): of a CPU tensor a host read, of a device tensor a sync point.
    window = op_windows.aggregate(
        op_windows.read_events(prof.profiler.kineto_results, record_shapes=False)
    )
    return OpCounts(
        to_calls=len(to_calls),
        copies=sum(
            1 for e in to_calls for child in e.cpu_children if child.name == "aten::_to_copy"
        ),
        host_reads=window.host_reads + window.sync_points,
    )


def measure_and_count(
    name: str,
    fn: Callable[[], object],
    description: str,
    *,
    device: torch.device,
    repeat: int,
    min_seconds: float,
    steps: int,
) -> tuple[harness.PhaseResult, OpCounts]:
    """Time the loop ``fn`` as a phase, then count what one call of it did (after the timing:
    every step then has gradients, as in training); the counts per step go in the table."""
    result = harness.measure(
        name, fn, device=device, repeat=repeat, min_seconds=min_seconds, description=description
    )
    ops = count_ops(fn)
    return dataclasses.replace(result, extra=per_step_counts(ops, steps)), ops


def make_model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    width = 128
    return nn.Sequential(
        nn.Linear(64, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, 10),
    ).to(device)


class Trainer:
    """One small classifier and its optimizer: the training step every loop below shares."""

    def __init__(self, device: torch.device) -> None:
        self.model = make_model(device)
        # A small learning rate: the loops below train for hundreds of steps on random data.
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward, backward, update; returns the loss and the logits (still on the device)."""
        logits = self.model(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return loss, logits


def per_step_counts(ops: OpCounts, steps: int) -> dict[str, float]:
    """The table's columns: to() calls, host reads and real copies, per training step."""
    return {
        "to()": ops.to_calls / steps,
        ".item()": ops.host_reads / steps,
        "copies": ops.copies / steps,
    }


def move_once_or_every_step(
    options: harness.DemoOptions, trainer: Trainer, steps: int
) -> list[harness.PhaseResult]:
    """The same loop, with the model and each batch moved at every step or once before it."""
    device = options.device
    repeat = 3 if options.quick else 10
    min_seconds = 0.0 if options.quick else 3.0
    harness.section(f".to(device) every step or once: {steps} training steps, batches of 64")

    # The data starts on the host, as it does when it comes from files or a DataLoader.
    host_inputs = [torch.randn(64, 64) for _ in range(steps)]
    host_targets = [torch.randint(0, 10, (64,)) for _ in range(steps)]

    def move_every_step() -> None:
        for x, y in zip(host_inputs, host_targets, strict=True):
            # A common pattern in copied snippets. It looks harmless, but model.to() visits
            # every parameter, gradient and buffer each call, and on a GPU each batch is a
            # fresh copy.
            trainer.model.to(device)
            x, y = x.to(device), y.to(device)
            trainer.step(x, y)

    # Once, before the loop: the model already is on the device (make_model moved it), and
    # this dataset is small enough to move whole. (A dataset that does not fit is moved a
    # batch at a time; then make the copy cheap and overlap it: see pinned memory below.)
    device_inputs = [x.to(device) for x in host_inputs]
    device_targets = [y.to(device) for y in host_targets]

    def move_once() -> None:
        for x, y in zip(device_inputs, device_targets, strict=True):
            trainer.step(x, y)

    # What model.to(device) costs by itself when nothing has to move:
    trainer.model.to(device)
    calls = 50
    start = time.perf_counter()
    for _ in range(calls):
        trainer.model.to(device)
    model_to = (time.perf_counter() - start) / calls
    parameters = sum(1 for _ in trainer.model.parameters())
    print(
        f"model.to({device.type}) on a model already there: "
        f"{harness.format_seconds(model_to)} a call ({parameters} parameters visited)"
    )
    on_device = device_inputs[0]
    print(
        f"x.to({device.type}) when x is already there returns x itself: "
        f"{on_device.to(device) is on_device} (it copies only when the device or dtype changes)"
    )

    results = []
    for name, fn, description in (
        (
            "to() every step",
            move_every_step,
            "model.to(device) and the batch's .to(device) inside the loop: model.to visits "
            "every parameter and gradient each step, and on a GPU each batch is a copy over "
            "PCIe that the step has to wait for.",
        ),
        (
            "to() once",
            move_once,
            "The model and (here) the whole dataset are moved once before the loop, so the "
            "steps only compute. x.to(device) on a tensor already there returns it unchanged.",
        ),
    ):
        result, ops = measure_and_count(
            name,
            fn,
            description,
            device=device,
            repeat=repeat,
            min_seconds=min_seconds,
            steps=steps,
        )
        print(
            f"{name}: {harness.format_seconds(result.seconds / steps)} a step, with "
            f"{ops.to_calls / steps:g} to() calls and {ops.copies / steps:g} real copies a step"
        )
        results.append(result)
        harness.pause(options)
    print(
        "model.to() converts each parameter and each parameter's .grad: "
        f"{2 * parameters} to() calls a step, plus one for each of the batch's two tensors"
    )
    return results


def item_every_step_or_once(
    options: harness.DemoOptions, trainer: Trainer, steps: int
) -> list[harness.PhaseResult]:
    """Logging loss, accuracy and a NaN check with .item() each step, or on the device."""
    device = options.device
    repeat = 3 if options.quick else 10
    min_seconds = 0.0 if options.quick else 3.0
    harness.section(f".item() in the loop: {steps} steps logging loss, accuracy and a NaN check")
    inputs = [torch.randn(64, 64, device=device) for _ in range(steps)]
    targets = [torch.randint(0, 10, (64,), device=device) for _ in range(steps)]

    def item_every_step() -> tuple[float, int]:
        total_loss, correct = 0.0, 0
        for x, y in zip(inputs, targets, strict=True):
            loss, logits = trainer.step(x, y)
            total_loss += loss.item()  # 1: an explicit read
            correct += int((logits.argmax(1) == y).sum().item())  # 2: another
            if torch.isnan(loss):  # 3: a hidden one: `if tensor` reads its value too
                raise FloatingPointError("the loss is NaN")
        return total_loss / steps, correct

    def item_once_at_end() -> tuple[float, int]:
        # Accumulators on the device: adding to them queues work and never waits.
        total_loss = torch.zeros((), device=device)
        correct = torch.zeros((), dtype=torch.long, device=device)
        saw_nan = torch.zeros((), dtype=torch.bool, device=device)
        for x, y in zip(inputs, targets, strict=True):
            loss, logits = trainer.step(x, y)
            total_loss += loss.detach()  # detach: keep the number, not the graph
            correct += (logits.argmax(1) == y).sum()
            saw_nan |= torch.isnan(loss)
        # Three reads for the whole loop, after the last step is queued.
        if saw_nan.item():
            raise FloatingPointError("the loss was NaN at some step")
        return total_loss.item() / steps, int(correct.item())

    results = []
    for name, fn, description in (
        (
            ".item() every step",
            item_every_step,
            "Each .item() (and each `if tensor`) copies a value to the host, so the CPU waits "
            "for the GPU to finish all queued work: three syncs a step, and the GPU idles "
            "while the CPU queues the next step.",
        ),
        (
            ".item() at the end",
            item_once_at_end,
            "Loss, accuracy and the NaN check accumulate in tensors on the device, so the "
            "loop only queues work and never waits. Three reads for the whole loop.",
        ),
    ):
        result, ops = measure_and_count(
            name,
            fn,
            description,
            device=device,
            repeat=repeat,
            min_seconds=min_seconds,
            steps=steps,
        )
        print(
            f"{name}: {harness.format_seconds(result.seconds / steps)} a step, "
            f"{ops.host_reads} host reads in {steps} steps ({ops.host_reads / steps:.3g} a step)"
        )
        results.append(result)
        harness.pause(options)
    if not options.cuda:
        print(
            "on CPU a read is a plain function call of about a microsecond, with no queue of "
            "device work to wait for; the accumulating loop's extra additions (three small ops "
            "a step) cost as much or more"
        )
    return results


def pinned_copies(options: harness.DemoOptions) -> list[harness.PhaseResult]:
    """Host-to-device copies from pageable and from pinned memory (CUDA only)."""
    harness.section("pin_memory() and non_blocking=True")
    if not options.cuda:
        print(
            "skipped: this runs on the CPU, so there is no host-to-device copy to speed up or "
            "to overlap with compute, and nothing here can be measured"
        )
        try:
            torch.empty(4).pin_memory()
            print("(torch.empty(4).pin_memory() worked: a CUDA driver is present)")
        except Exception as error:  # RuntimeError in PyTorch 2.x; anything means "not here"
            # Pinning asks the CUDA driver to lock the pages, so it needs one.
            print(f"torch.empty(4).pin_memory() here -> {type(error).__name__}: {error}")
        return []

    device = options.device
    numel = (32 if options.quick else 256) * 1024 * 1024 // 4
    repeat = 5 if options.quick else 10
    min_seconds = 0.0 if options.quick else 3.0
    pageable = torch.randn(numel)
    size = harness.format_bytes(numel * 4)

    start = time.perf_counter()
    pinned = pageable.pin_memory()  # page-locked: the GPU's DMA engine can read it directly
    pin_seconds = time.perf_counter() - start
    print(
        f"pinning {size} took {harness.format_seconds(pin_seconds)}: pin once (or let "
        "DataLoader(pin_memory=True) do it in a background thread), not per copy"
    )

    # non_blocking=True from pinned memory: the call returns as soon as the copy is queued.
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    copied = pinned.to(device, non_blocking=True)
    queued = time.perf_counter() - start
    torch.cuda.synchronize(device)
    done = time.perf_counter() - start
    del copied
    print(
        f"pinned.to(device, non_blocking=True) returned after {harness.format_seconds(queued)}; "
        f"the copy finished after {harness.format_seconds(done)}: the CPU was free meanwhile "
        "to prepare the next batch or queue kernels"
    )

    results = []
    for name, fn, description in (
        (
            "pageable .to(cuda)",
            lambda: pageable.to(device),
            "From ordinary (pageable) memory the driver first copies into a pinned staging "
            "buffer, then DMAs it to the GPU, and the call blocks the CPU until it is done.",
        ),
        (
            "pinned, non_blocking",
            lambda: pinned.to(device, non_blocking=True),
            "Page-locked memory is read by the GPU's DMA engine directly: faster, and with "
            "non_blocking=True the copy is only queued, overlapping with other work. "
            "DataLoader(pin_memory=True) pins batches for you.",
        ),
    ):
        result = harness.measure(
            name,
            fn,
            device=device,
            repeat=repeat,
            min_seconds=min_seconds,
            description=description,
        )
        bandwidth = numel * 4 / result.seconds / 1e9
        print(f"{name}: {size} in {harness.format_seconds(result.seconds)} ({bandwidth:.1f} GB/s)")
        results.append(result)
        harness.pause(options)
    return results


def on_a_gpu_paragraph() -> None:
    harness.section("on a GPU this would differ")
    print(
        "On a GPU this would differ: each batch moved every step would be a real copy over "
        "PCIe (the copies column would read 2, not 0), paid on every step; each .item() "
        "would make the CPU wait until the GPU caught up, so it could no longer queue the "
        "next step's kernels while the GPU runs this one: the loop with three reads a step "
        "loses that overlap, which costs most when the GPU's share of a step is large; and "
        "copies from pinned memory with non_blocking=True would run at the full DMA "
        "bandwidth while the CPU moves on. Run `torchtop demo device --device cuda` on a "
        "machine with a GPU to measure it."
    )


def conclusion(
    moves: list[harness.PhaseResult],
    reads: list[harness.PhaseResult],
    copies: list[harness.PhaseResult],
) -> str:
    every, once = moves
    each_step, at_end = reads
    text = (
        f"to(device) once {harness.speed_clause(once, every, 'to(device) every step')} "
        f"({once.extra['to()']:g} to() calls and {once.extra['copies']:g} copies a "
        f"step against {every.extra['to()']:g} and {every.extra['copies']:g}); "
        f"reading with .item() at the end "
        f"({at_end.extra['.item()']:.2g} host reads a step against "
        f"{each_step.extra['.item()']:g}) "
        f"{harness.speed_clause(at_end, each_step, '.item() every step')}"
    )
    if not copies:
        text += " (on CPU a read waits for nothing: there is no sync to save)"
    else:
        pageable, pinned = copies
        text += f"; pinned non_blocking copies {harness.speed_clause(pinned, pageable, 'pageable')}"
    return text + "."


def main() -> None:
    options = harness.begin(__doc__, "device")
    steps = 20 if options.quick else 100
    trainer = Trainer(options.device)
    moves = move_once_or_every_step(options, trainer, steps)
    reads = item_every_step_or_once(options, trainer, steps)
    copies = pinned_copies(options)
    if not options.cuda:
        on_a_gpu_paragraph()
    results = [*moves, *reads, *copies]
    harness.print_results(
        f"device hygiene on {options.device}: time for {steps} steps; to(), .item() and "
        "copies: a step",
        results,
        conclusion(moves, reads, copies),
    )
    harness.emit_json_results(results)


if __name__ == "__main__":
    main()
