"""Out of memory on purpose: what fills the device, and three ways to fit.

In training, device memory goes mostly to activations: the forward pass saves each layer's
input for the backward pass, so memory grows with batch size times depth. This demo trains a
deep MLP with a batch that doubles every step until the device runs out of memory: a real CUDA
out-of-memory error on a GPU, and on the CPU a device that torchtop emulates
(``torchtop demo oom`` runs it with ``--memory-limit 512MiB``; give another size to change it).
The error is caught like any exception, so the demo goes on while the viewer's OOM screen shows
what held the memory. Then the batch that failed is trained in ways that fit:

- gradient accumulation: the same samples in 4 micro-batches, a backward each, one step;
- activation checkpointing: keep only each segment's input, recompute the rest in backward;
- ``torch.no_grad()``, for evaluation: no graph, so no activations saved at all.

Recovering from an OOM in the same process takes one thing: let go of what the failed step
held. Python frees it when the ``except`` block ends (the exception's traceback keeps the
failed frames and their tensors alive until then) and once the batch is ``del``-eted; on CUDA,
``torch.cuda.empty_cache()`` then hands the cached blocks back to the driver.

Run it with ``torchtop demo oom`` to see the OOM screen (esc closes it, the demo goes on), or
``--headless`` for the table only. On CUDA, ``--quick`` caps this process at 4 GiB with
``torch.cuda.set_per_process_memory_fraction`` so the failure comes in a few seconds.
"""

from __future__ import annotations

import gc
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import torchtop
from torchtop.demos import _harness as harness
from torchtop.demos.checkpointing import DeepMLP  # deep and narrow: activations dominate
from torchtop.sizes import parse_size

#: The size of the device that ``torchtop demo oom`` emulates when the demo runs on the CPU.
#: The demo catalog reads it without importing this module; ``--memory-limit`` overrides it.
CPU_MEMORY_LIMIT = "512MiB"
#: ``torch.OutOfMemoryError`` (torch 2.5 on), or the same class under its older name.
OutOfMemoryError = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
#: With ``--quick`` on CUDA, this process may use at most this much of the GPU.
CUDA_QUICK_CAP = 4 << 30
MICRO_BATCHES = 4


@dataclass(frozen=True)
class Device:
    """The memory this demo sets out to exceed."""

    name: str
    capacity: int
    in_use: Callable[[], int]


def the_device(options: harness.DemoOptions) -> Device | None:
    """The emulated device, or the GPU (capped with ``--quick``); ``None`` on a plain CPU."""
    emulated = harness.emulated_device()
    if emulated is not None:
        return Device(
            f"the emulated {harness.format_bytes(emulated.limit_bytes)} device",
            emulated.limit_bytes,
            lambda: int(emulated.live_bytes),
        )
    if not options.cuda:
        return None
    index = options.device.index
    device = torch.cuda.current_device() if index is None else index
    total = torch.cuda.get_device_properties(device).total_memory
    capacity = total
    if options.quick and total > CUDA_QUICK_CAP:
        # A real CUDA OOM, sooner: the caching allocator refuses to go past this fraction.
        torch.cuda.set_per_process_memory_fraction(CUDA_QUICK_CAP / total, device)
        capacity = CUDA_QUICK_CAP
    name = f"{torch.cuda.get_device_name(device)} ({harness.format_bytes(capacity)}"
    name += " for this process)" if capacity < total else ")"
    return Device(name, capacity, lambda: torch.cuda.memory_allocated(device))


class Training:
    """The model and its optimizer; :meth:`step` is one training step."""

    def __init__(self, width: int, depth: int, device: torch.device) -> None:
        self.model = DeepMLP(width, depth).to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)

    def step(self, x: torch.Tensor, y: torch.Tensor, micro_batches: int = 1) -> None:
        """Forward, backward and the optimizer's step on one batch.

        With ``micro_batches`` > 1 the batch goes through in pieces, each loss scaled so that
        the gradients summed in ``.grad`` equal the whole batch's: gradient accumulation.
        """
        self.optimizer.zero_grad(set_to_none=True)
        for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True):
            loss = nn.functional.mse_loss(self.model(xs), ys) / micro_batches
            loss.backward()
        self.optimizer.step()


def error_figure(message: str, pattern: str) -> int | None:
    """A byte count from an out-of-memory message (CUDA's and the emulation's read alike)."""
    match = re.search(pattern, message)
    if match is None:
        return None
    try:
        return parse_size(match.group(1))
    except ValueError:
        return None


def double_until_oom(
    options: harness.DemoOptions, device: Device, training: Training, width: int, start: int
) -> tuple[harness.PhaseResult, harness.PhaseResult]:
    """Train with a batch that doubles each step; return the largest batch that fit and the
    one that did not, each as a row of the table."""
    harness.section(f"doubling the batch on {device.name}")
    fitted: harness.PhaseResult | None = None
    failed: harness.PhaseResult | None = None
    batch = start
    with torchtop.phase(
        "doubling the batch",
        "Each step trains on twice the samples of the last. The forward saves every "
        "layer's input for backward, so activation memory doubles too, until a step asks "
        "for more than the device has left: an out-of-memory error.",
    ):
        while failed is None:
            x = torch.randn(batch, width, device=options.device)
            y = torch.randn(batch, 1, device=options.device)
            before = device.in_use()
            # Time first, then memory in a second pass (below), as harness.measure does.
            start_time = time.perf_counter()
            try:
                training.step(x, y)
                if options.cuda:
                    torch.cuda.synchronize(options.device)
            except OutOfMemoryError as error:
                seconds = time.perf_counter() - start_time  # until it failed
                message = str(error)
                asked = error_figure(message, r"Tried to allocate ([0-9.]+ [KMGT]iB)")
                in_use = error_figure(
                    message, r"Of the allocated memory ([0-9.]+ [KMGT]iB) is allocated by PyTorch"
                )
                print(f"batch {batch}: torch.OutOfMemoryError: {message.split('. ')[0]}.")
                print(
                    f"  it asked for {harness.format_bytes(asked or 0)} more with "
                    f"{harness.format_bytes(in_use or 0)} of "
                    f"{harness.format_bytes(device.capacity)} in use"
                )
                # Its peak: what was in use when it failed, above what was in use before it.
                extra: dict[str, object] = {"batch": batch, "fits": "no"}
                if asked is not None:
                    extra["asked"] = harness.Bytes(asked)
                peak = max(0, (in_use or before) - before)
                failed = harness.PhaseResult(f"batch {batch}", seconds, peak, extra)
                break
            seconds = time.perf_counter() - start_time
            with harness.track_memory(options.device) as meter:
                training.step(x, y)
            peak = meter.peak_bytes
            print(
                f"batch {batch}: fits, peak {harness.format_bytes(peak)} above the "
                f"{harness.format_bytes(before)} in use "
                f"({100 * (before + peak) / device.capacity:.0f}% of the device), "
                f"{harness.format_seconds(seconds)}"
            )
            fitted = harness.PhaseResult(
                f"batch {batch}", seconds, peak, {"batch": batch, "fits": "yes"}
            )
            del x, y
            batch *= 2
            harness.pause(options, 0.5)
    # Here the except block has ended: the traceback, and with it the failed step's frames and
    # their activations, are gone. What is left is the batch: del it, and on CUDA hand the
    # cached blocks back to the driver (other processes see them free again).
    del x, y
    gc.collect()
    if options.cuda:
        torch.cuda.empty_cache()
    print(
        f"after the except block and del x, y: {harness.format_bytes(device.in_use())} in use "
        "(the model's weights), as before the loop"
    )
    if fitted is None:
        raise SystemExit(f"even the first batch ({start}) did not fit on {device.name}")
    return fitted, failed


def fit_the_batch(
    options: harness.DemoOptions, device: Device, training: Training, width: int, batch: int
) -> list[harness.PhaseResult]:
    """The batch that failed, three ways that fit, each a measured phase."""
    model = training.model
    depth = len(model.blocks)
    segment = max(1, round((depth / 2) ** 0.5))
    segments = -(-depth // segment)
    repeat = 1 if options.quick else 3
    min_seconds = 0.0 if options.quick else 4.0
    harness.section(f"the same {batch} samples, three ways that fit")
    x = torch.randn(batch, width, device=options.device)
    y = torch.randn(batch, 1, device=options.device)

    def accumulate() -> None:
        training.step(x, y, micro_batches=MICRO_BATCHES)

    def checkpointed() -> None:
        model.segment = segment
        try:
            training.step(x, y)
        finally:
            model.segment = 0

    def evaluate() -> torch.Tensor:
        with torch.no_grad():
            return nn.functional.mse_loss(model(x), y)

    results = []
    for name, fn, description in (
        (
            f"{MICRO_BATCHES} micro-batches",
            accumulate,
            f"Gradient accumulation: {MICRO_BATCHES} micro-batches of {batch // MICRO_BATCHES},"
            " a backward each; gradients add up in .grad and one optimizer step follows. Only "
            "one micro-batch's activations live at a time, for the same gradient.",
        ),
        (
            f"checkpoint {segments} segments",
            checkpointed,
            f"checkpoint() around each {segment} blocks keeps only the segments' inputs and "
            "reruns each segment's forward during backward. Saved activations go from depth "
            "to about 2 sqrt(depth) layers, for one extra forward.",
        ),
        (
            "no_grad() eval",
            evaluate,
            "Evaluation needs no backward: under torch.no_grad() nothing is saved, and each "
            "activation is freed once the next layer has read it. The whole batch fits with "
            "room to spare.",
        ),
    ):
        before = device.in_use()
        try:
            result = harness.measure(
                name,
                fn,
                device=options.device,
                repeat=repeat,
                min_seconds=min_seconds,
                extra={"batch": batch, "fits": "yes"},
                description=description,
            )
        except OutOfMemoryError as error:  # not on the devices this demo sizes itself for
            print(f"{name}: torch.OutOfMemoryError too: {str(error).split('. ')[0]}.")
            results.append(harness.PhaseResult(name, 0.0, 0, {"batch": batch, "fits": "no"}))
            continue
        in_use = before + result.peak_bytes
        print(
            f"{name}: fits, peak {harness.format_bytes(result.peak_bytes)} above the "
            f"{harness.format_bytes(before)} in use: {100 * in_use / device.capacity:.0f}% of "
            f"the device, {harness.format_seconds(result.seconds)}"
        )
        results.append(result)
        harness.pause(options)
    return results


def conclusion(device: Device, results: list[harness.PhaseResult]) -> str:
    """One sentence from the measured numbers."""
    fitted, failed, *ways = results
    fmt = harness.format_bytes
    batch, asked = failed.extra["batch"], failed.extra.get("asked")
    text = f"batch {batch} ran out of {device.name}"
    if asked is not None:
        text += f", asking for {fmt(asked)} more after reaching {fmt(failed.peak_bytes)}"
    text += f" (batch {fitted.extra['batch']} fit at {fmt(fitted.peak_bytes)})"
    fits = [way for way in ways if way.extra["fits"] == "yes"]
    if not fits:
        return text + "; none of the three ways fit."
    clauses = [
        f"{way.name} ({fmt(way.peak_bytes)}, "
        f"{harness.memory_phrase(way, fitted).removesuffix(' peak memory')})"
        for way in fits
    ]
    listed = ", ".join(clauses[:-1]) + (" and " if len(clauses) > 1 else "") + clauses[-1]
    text += (
        f"; the same {batch} samples fit with {listed} than batch {fitted.extra['batch']} in "
        "one piece"
    )
    missed = [way.name for way in ways if way.extra["fits"] != "yes"]
    if missed:
        text += f", but not with {', '.join(missed)}"
    return text + "."


def main() -> None:
    options = harness.begin(__doc__, "oom")
    device = the_device(options)
    if device is None:
        print(
            "oom: on the CPU this demo needs a memory limit to run into, or it would fill the "
            "machine's RAM: run it as `torchtop demo oom` (it emulates a "
            f"{CPU_MEMORY_LIMIT} device) or add --memory-limit SIZE",
            file=sys.stderr,
        )
        raise SystemExit(2)
    # Narrow layers on the CPU so that the arithmetic stays quick; a GPU wants wide ones.
    width = 1024 if options.cuda else (64 if options.quick else 128)
    depth = 32
    torch.manual_seed(0)
    training = Training(width, depth, options.device)
    # Activations saved per sample: each block keeps its Linear's input and its GELU's input.
    per_sample = 2 * depth * width * 4
    free = device.capacity - device.in_use()
    start = 1 << max(4, (free // 16 // per_sample).bit_length() - 1)
    print(
        f"{depth} x (Linear({width}, {width}) + GELU): about {harness.format_bytes(per_sample)} "
        f"of saved activations per sample; {harness.format_bytes(free)} free, so the batch "
        f"starts at {start} and doubles"
    )
    fitted, failed = double_until_oom(options, device, training, width, start)
    harness.pause(options)
    ways = fit_the_batch(options, device, training, width, int(failed.extra["batch"]))
    results = [fitted, failed, *ways]
    harness.print_results(
        f"out of memory on {options.device}: {harness.format_bytes(device.capacity)}",
        results,
        conclusion(device, results),
    )
    harness.emit_json_results(results)


if __name__ == "__main__":
    main()
