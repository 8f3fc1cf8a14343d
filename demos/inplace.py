"""In-place ops against out-of-place: memory, and when autograd objects.

An op whose name ends in ``_`` changes its tensor in place: ``x.add_(1)`` writes into ``x``'s own
memory instead of allocating a result. For buffers you own (running averages, optimizer
state, accumulators) that saves a tensor-sized allocation per op. This demo

- shows that an in-place op keeps the storage and bumps the tensor's version counter;
- measures a running-average update and a reset, out of place and in place;
- shows the catch: autograd saves some tensors for the backward pass, and overwriting one of
  them in place makes ``backward()`` fail with "one of the variables needed for gradient
  computation has been modified by an inplace operation". The error is caught, printed and
  explained, with the fix.

Run it with ``torchtop demo inplace`` to watch each phase on the memory chart, or
``--headless`` for the table only.
"""

from __future__ import annotations

import torch

from torchtop.demos import _harness as harness

#: The start of PyTorch's message when backward finds a saved tensor changed in place.
INPLACE_ERROR = "one of the variables needed for gradient computation has been modified"


def show_what_inplace_means(device: torch.device) -> None:
    """Same storage, new version: what ``_`` ops do to a tensor."""
    harness.section("what an in-place op does")
    x = torch.ones(4, device=device)
    address = x.untyped_storage().data_ptr()
    print(f"x = torch.ones(4): version {x._version}")
    y = x.add_(1)  # returns x itself, so calls can be chained: x.mul_(2).add_(1)
    print(
        f"x.add_(1) -> {x.tolist()}: same storage {x.untyped_storage().data_ptr() == address}, "
        f"returns x itself {y is x}, version now {x._version}"
    )
    z = x + 1
    print(
        f"x + 1 -> a new tensor: same storage "
        f"{z.untyped_storage().data_ptr() == address}, x unchanged {x.tolist()}"
    )
    # The version counter is how autograd notices in-place changes (see the last section).


def measure_updates(options: harness.DemoOptions) -> list[harness.PhaseResult]:
    """A running-average update and a reset, out of place and in place, each a phase."""
    numel = 4 * 1024 * 1024 if options.quick else 16 * 1024 * 1024
    repeat = 9 if options.quick else 10
    # Without --quick each phase keeps running a few seconds, so it is easy to watch live.
    min_seconds = 0.0 if options.quick else 4.0
    state = {
        "avg": torch.zeros(numel, device=options.device),
        "new": torch.randn(numel, device=options.device),
    }
    buffer_bytes = numel * 4
    harness.section(
        f"updating a running average of {numel:,} floats ({harness.format_bytes(buffer_bytes)})"
    )

    def update_out_of_place() -> None:
        # avg * 0.9, new * 0.1 and their sum are three new buffers; the old avg is freed only
        # after the name is rebound.
        state["avg"] = state["avg"] * 0.9 + state["new"] * 0.1

    def update_in_place() -> None:
        # Both steps write into avg's memory; add_'s alpha scales `new` inside the kernel.
        state["avg"].mul_(0.9).add_(state["new"], alpha=0.1)

    def reset_out_of_place() -> None:
        state["avg"] = torch.zeros_like(state["avg"])  # a new buffer, then the old one freed

    def reset_in_place() -> None:
        state["avg"].zero_()  # fills the existing buffer

    results = []
    for name, fn, description in (
        (
            "avg = avg * 0.9 + new * 0.1",
            update_out_of_place,
            "Out of place: avg * 0.9, new * 0.1 and their sum are each a new buffer, and the "
            "old avg is freed only once the name is rebound. Several buffers live at the peak, "
            "and each is written to memory and read back.",
        ),
        (
            "avg.mul_(0.9).add_(new, alpha=0.1)",
            update_in_place,
            "In place: both steps write into avg's own memory, and add_ scales new by alpha "
            "inside its kernel. No new buffer at all, and less memory traffic.",
        ),
        (
            "avg = torch.zeros_like(avg)",
            reset_out_of_place,
            "zeros_like allocates a fresh buffer and fills it; the old one is freed after the "
            "name moves. Two buffers live for a moment.",
        ),
        (
            "avg.zero_()",
            reset_in_place,
            "zero_() fills the existing buffer: nothing is allocated. Optimizers reset their "
            "state and gradients this way.",
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
        buffers = result.peak_bytes / buffer_bytes
        print(
            f"{name}: {harness.format_seconds(result.seconds)}, "
            f"peak {harness.format_bytes(result.peak_bytes)} "
            f"({buffers:.0f} new buffer{'' if round(buffers) == 1 else 's'})"
        )
        results.append(result)
        harness.pause(options)
    return results


def show_the_autograd_error(device: torch.device) -> None:
    """Overwriting a tensor that backward needs: the error, why, and the fix."""
    harness.section("in place on a tensor autograd saved: the error")
    x = torch.randn(5, device=device, requires_grad=True)
    y = x.sigmoid()
    # sigmoid's gradient is y * (1 - y): autograd saves the output y to compute it later,
    # and remembers y's version (0) at the time.
    print(f"y = x.sigmoid(): y._version = {y._version} (saved for backward at version 0)")
    y.mul_(2)  # overwrites y: the saved value is gone
    print(f"y.mul_(2): y._version = {y._version}")
    try:
        y.sum().backward()
    except RuntimeError as error:
        message = str(error).split(" Hint:")[0]
        print(f"y.sum().backward() -> RuntimeError: {message}")
        print(
            "why: backward would compute sigmoid's gradient from the doubled values and give a "
            "wrong answer, so autograd checks the version and refuses"
        )
    else:
        raise AssertionError("expected autograd to reject the in-place change")

    # The fix: out of place, so the saved output stays intact (one more buffer).
    y = x.sigmoid() * 2
    y.sum().backward()
    assert x.grad is not None
    expected = 2 * x.sigmoid() * (1 - x.sigmoid())
    print(
        f"fix: y = x.sigmoid() * 2 -> backward works, grad correct: "
        f"{torch.allclose(x.grad, expected.detach())}"
    )
    # In place is fine where backward does not need the old value: x * 3 saves nothing of
    # its output, so add_ on it is safe. That is why nn.ReLU(inplace=True) is usually fine,
    # and why optimizers update parameters in place under torch.no_grad().
    h = (x * 3).add_(1)
    h.sum().backward()
    print("(x * 3).add_(1) -> backward works: mul by a number does not save its output")


def measure_the_autograd_pair(options: harness.DemoOptions) -> list[harness.PhaseResult]:
    """The forward and backward of both versions: in place saves a buffer, and breaks."""
    numel = 1024 * 1024 if options.quick else 8 * 1024 * 1024
    repeat = 9 if options.quick else 10
    min_seconds = 0.0 if options.quick else 3.0
    x = torch.randn(numel, device=options.device, requires_grad=True)
    harness.section(f"the same on {numel:,} floats, measured")

    def out_of_place() -> str:
        x.grad = None
        (x.sigmoid() * 2).sum().backward()
        return "ok"

    def in_place() -> str:
        y = x.sigmoid()
        y.mul_(2)
        try:
            y.sum().backward()
        except RuntimeError as error:
            if INPLACE_ERROR not in str(error):
                raise
            return "RuntimeError"
        return "ok"

    results = []
    for name, fn, description in (
        (
            "sigmoid() * 2, backward",
            out_of_place,
            "sigmoid saves its output for backward (its gradient is y * (1 - y)). Multiplying "
            "out of place keeps that saved output intact, at the cost of one more buffer.",
        ),
        (
            "sigmoid().mul_(2), backward",
            in_place,
            "mul_ overwrites the output autograd saved, bumping its version counter. Backward "
            "sees the change and raises a RuntimeError rather than compute a wrong gradient.",
        ),
    ):
        outcome = fn()
        result = harness.measure(
            name,
            fn,
            device=options.device,
            repeat=repeat,
            min_seconds=min_seconds,
            extra={"backward": outcome},
            description=description,
        )
        print(f"{name}: peak {harness.format_bytes(result.peak_bytes)}, backward: {outcome}")
        results.append(result)
        harness.pause(options)
    return results


def conclusion(results: list[harness.PhaseResult]) -> str:
    """One sentence from the measured numbers."""
    update_out, update_in, reset_out, reset_in, fixed, broken = results
    return (
        f"the in-place update {harness.comparison_clause(update_in, update_out, 'out of place')}"
        f"; zero_() {harness.comparison_clause(reset_in, reset_out, 'zeros_like()')}; but mul_ "
        f"on sigmoid's saved output broke backward ({broken.extra['backward']}), and the "
        f"out-of-place fix costs "
        f"{harness.format_bytes(max(0, fixed.peak_bytes - broken.peak_bytes))} more at peak."
    )


def main() -> None:
    options = harness.begin(__doc__, "inplace")
    show_what_inplace_means(options.device)
    harness.pause(options)
    updates = measure_updates(options)
    show_the_autograd_error(options.device)
    harness.pause(options)
    autograd_pair = measure_the_autograd_pair(options)
    results = [*updates, *autograd_pair]
    harness.print_results(
        f"in place against out of place on {options.device}", results, conclusion(results)
    )
    harness.emit_json_results(results)


if __name__ == "__main__":
    main()
