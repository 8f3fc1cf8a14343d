"""Memory hygiene: del, empty_cache, and the total_loss += loss leak.

A tensor's memory is freed when the last reference to it goes: a Python name, a list entry,
or an autograd graph that saved it for backward. Most "PyTorch uses too much memory" stories
are a reference kept longer than needed. This demo

- measures the peak of a function that keeps every intermediate in its own name against the
  same function with ``del`` (or one reused name) as it goes;
- shows what ``torch.cuda.empty_cache()`` does (on CUDA: reserved against allocated memory; on
  CPU there is no caching allocator, and the process's resident memory is shown instead);
- runs an evaluation loop that sums its losses with ``total_loss += loss``, which keeps every
  batch's graph and activations alive, against ``total_loss += loss.item()``, and measures
  the live memory after each step of both.

Run it with ``torchtop demo memory`` to watch the leak climb on the memory chart, or
``--headless`` for the table only.
"""

from __future__ import annotations

import gc
import itertools
import os
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import torchtop
from torchtop.demos import _harness as harness


def measure_del(options: harness.DemoOptions) -> list[harness.PhaseResult]:
    """Intermediates kept in names against intermediates deleted: the peak of each."""
    numel = 2 * 1024 * 1024 if options.quick else 16 * 1024 * 1024
    repeat = 9 if options.quick else 10
    # Without --quick each phase keeps running a few seconds, so it is easy to watch live.
    min_seconds = 0.0 if options.quick else 4.0
    x = torch.randn(numel, device=options.device)
    buffer_bytes = numel * 4
    harness.section(f"four steps on {numel:,} floats ({harness.format_bytes(buffer_bytes)} a step)")

    def keep_everything() -> torch.Tensor:
        # Each name keeps its tensor alive until the function returns: four buffers at once.
        scaled = x * 2
        squashed = scaled.tanh()
        shifted = squashed + 1
        rooted = shifted.sqrt()
        return rooted.mean()

    def delete_as_you_go() -> torch.Tensor:
        # del drops the name, and with it the last reference: at most two buffers at once.
        # Reusing one name (h = h.tanh()) has the same effect.
        scaled = x * 2
        squashed = scaled.tanh()
        del scaled
        shifted = squashed + 1
        del squashed
        rooted = shifted.sqrt()
        del shifted
        return rooted.mean()

    assert torch.equal(keep_everything(), delete_as_you_go())
    results = []
    for name, fn, description in (
        (
            "intermediates kept",
            keep_everything,
            "Each intermediate has its own name, and a name keeps its tensor alive until the "
            "function returns. All four buffers are live at once at the end.",
        ),
        (
            "del as you go",
            delete_as_you_go,
            "del drops a name as soon as the next step has read it, and with the last "
            "reference the memory is freed (reusing one name does the same). At most two "
            "buffers are live at once: the same result, a lower peak.",
        ),
    ):
        result = harness.measure(
            name,
            fn,
            device=options.device,
            repeat=repeat,
            min_seconds=min_seconds,
            description=description,
        )
        print(
            f"{name}: peak {harness.format_bytes(result.peak_bytes)} "
            f"({result.peak_bytes / buffer_bytes:.0f} buffers alive at once)"
        )
        results.append(result)
        harness.pause(options)
    return results


def _resident_bytes() -> int | None:
    """This process's resident memory (Linux), or None where it cannot be read."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def show_empty_cache(options: harness.DemoOptions) -> None:
    """Reserved against allocated on CUDA; on CPU, the process's resident memory."""
    size = (64 if options.quick else 256) * 1024 * 1024
    fmt = harness.format_bytes
    with torchtop.phase(
        "empty_cache",
        "On CUDA a freed block goes back to PyTorch's caching allocator, not the driver: "
        "reserved stays up so the next allocation is fast. empty_cache() hands unused cached "
        "blocks back; it frees no live tensor and gives PyTorch no extra room.",
    ):
        if options.cuda:
            harness.section("torch.cuda.empty_cache(): allocated against reserved")
            device = options.device

            def report(when: str) -> None:
                print(
                    f"{when:<34} allocated {fmt(torch.cuda.memory_allocated(device)):>10}, "
                    f"reserved {fmt(torch.cuda.memory_reserved(device)):>10}"
                )

            report("before")
            big = torch.empty(size, dtype=torch.uint8, device=device)
            report(f"after allocating {fmt(size)}")
            del big
            # The block goes back to PyTorch's cache, not to the driver: the next allocation
            # of that size reuses it without a slow cudaMalloc. nvidia-smi still counts it.
            report("after del")
            torch.cuda.empty_cache()
            # Unused cached blocks go back to the driver, for other processes. It frees no
            # live tensor, gives PyTorch itself no more room, and in a loop it only makes
            # every later allocation slow.
            report("after torch.cuda.empty_cache()")
        else:
            harness.section("empty_cache on CPU: there is no cache to empty")
            print(
                "PyTorch's CPU tensors come straight from the C heap (malloc); there is no "
                "caching allocator, so no reserved memory and nothing for empty_cache to free."
            )
            print(
                "Large blocks are mapped from the OS for each tensor and unmapped when it is "
                "freed, so the process's resident memory follows the live tensors:"
            )
            before = _resident_bytes()
            if before is None:
                print("(resident memory cannot be read on this system)")
                return
            big = torch.ones(size, dtype=torch.uint8)  # ones(): the pages are really touched
            after_alloc = _resident_bytes() or 0
            del big
            gc.collect()
            after_del = _resident_bytes() or 0
            print(f"resident before:               {fmt(before):>10}")
            print(f"after torch.ones({fmt(size)}):   {fmt(after_alloc):>10}")
            print(f"after del:                     {fmt(after_del):>10}")
            print(
                "(small tensors come from malloc's arenas, which keep freed memory for reuse: "
                "resident memory may not drop for those)"
            )
    harness.pause(options)


def _nothing() -> None:
    pass


def measure_the_leak(options: harness.DemoOptions) -> list[harness.PhaseResult]:
    """An evaluation loop summing its losses two ways: live memory after every step."""
    batch, width, depth, steps = (512, 128, 3, 8) if options.quick else (1024, 256, 4, 40)
    repeat = 7 if options.quick else 5
    min_seconds = 0.0 if options.quick else 6.0
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers).to(options.device)
    batches = [torch.randn(batch, width, device=options.device) for _ in range(steps)]
    targets = [torch.randn(batch, width, device=options.device) for _ in range(steps)]
    harness.section(
        f"an evaluation loop without no_grad: {steps} batches of {batch} through "
        f"{depth} x Linear({width}, {width}) + ReLU"
    )
    print(
        "each loss carries its graph (loss.grad_fn -> ... -> every Linear and ReLU), and the "
        "graph holds the activations saved for a backward that never comes"
    )

    def loss_of(step: int) -> torch.Tensor:
        return nn.functional.mse_loss(model(batches[step]), targets[step])

    def sum_tensors(after_step: Callable[[], None] = _nothing) -> float:
        total_loss: torch.Tensor | float = 0.0
        for step in range(steps):
            loss = loss_of(step)
            # The leak: total_loss is now a tensor whose graph links to this loss's graph,
            # and to every earlier one. Nothing is freed until total_loss goes.
            total_loss += loss
            after_step()
        return float(total_loss) / steps

    def sum_numbers(after_step: Callable[[], None] = _nothing) -> float:
        total_loss = 0.0
        for step in range(steps):
            loss = loss_of(step)
            # .item() copies the value out as a Python float; the graph dies with `loss`
            # when the next step rebinds the name.
            total_loss += loss.item()
            after_step()
        return total_loss / steps

    results = []
    for name, fn, description in (
        (
            "total_loss += loss",
            sum_tensors,
            "total_loss becomes a tensor whose graph links to every loss so far, and each "
            "graph holds the activations saved for backward. Nothing is freed until "
            "total_loss goes: live memory climbs batch after batch.",
        ),
        (
            "total_loss += loss.item()",
            sum_numbers,
            ".item() copies the value out as a Python float, so the graph dies with loss when "
            "the next step rebinds the name. Live memory stays flat (no_grad would also skip "
            "the graph).",
        ),
    ):
        # One pass with the live bytes read after every step.
        live: list[int] = []
        with (
            torchtop.phase(f"{name} (step by step)", description),
            harness.track_memory(options.device) as meter,
        ):

            def record(meter: harness.MemoryMeter = meter, live: list[int] = live) -> None:
                live.append(meter.live_bytes)
                torchtop.step()  # a step on torchtop's timeline
                if not options.quick:
                    time.sleep(0.1)  # slow enough to watch the line climb live

            fn(record)
        # The typical step's growth: a leak grows every step; one graph that happens to
        # outlive its step (the collector's timing) is not growth a step.
        growth = (
            int(statistics.median(b - a for a, b in itertools.pairwise(live)))
            if len(live) > 1
            else 0
        )
        result = harness.measure(
            name,
            fn,
            device=options.device,
            repeat=repeat,
            min_seconds=min_seconds,
            extra={"at end": harness.Bytes(live[-1]), "per step": harness.Bytes(growth)},
            description=description,
        )
        shown = ", ".join(harness.format_bytes(b) for b in live[:4])
        print(
            f"{name}: live after each step {shown}, ... {harness.format_bytes(live[-1])}: "
            f"{harness.format_bytes(growth)} a step"
        )
        results.append(result)
        harness.pause(options)
    print(
        "in a training loop, loss.backward() frees the saved activations each step, so "
        "total_loss += loss there leaks only the graph's nodes: slower, but still a leak"
    )
    print("the fix for evaluation is both: torch.no_grad() (no graph at all) and .item()")
    return results


def conclusion(results: list[harness.PhaseResult]) -> str:
    """One sentence from the measured numbers."""
    kept, deleted, leaky, flat = results
    fmt = harness.format_bytes
    return (
        f"del as you go {harness.comparison_clause(deleted, kept, 'keeping the intermediates')}"
        f"; total_loss += loss grew live memory by {fmt(leaky.extra['per step'])} a step "
        f"(to {fmt(leaky.extra['at end'])}), while total_loss += loss.item() grew it by "
        f"{fmt(flat.extra['per step'])} a step (flat at {fmt(flat.extra['at end'])})."
    )


def main() -> None:
    options = harness.begin(__doc__, "memory")
    del_results = measure_del(options)
    show_empty_cache(options)
    leak_results = measure_the_leak(options)
    results = [*del_results, *leak_results]
    harness.print_results(f"memory hygiene on {options.device}", results, conclusion(results))
    harness.emit_json_results(results)


if __name__ == "__main__":
    main()
