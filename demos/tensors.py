"""Tensor basics, and which reshapes and indexes copy memory.

A tensor is a view onto a block of memory (its *storage*) plus the shape, strides and offset
that say how to read it. Many operations only make a new view of the same storage: they cost
nothing, however big the tensor. Others have to lay the numbers out again in a new storage:
they cost a full copy in time and memory. This demo

- creates tensors with ``torch.tensor``, ``torch.zeros`` and ``torch.randn`` and reads their
  ``shape``, ``dtype``, ``device`` and ``requires_grad``;
- compares ``view``, ``reshape`` and ``permute`` + ``contiguous``, checking which share storage
  with ``untyped_storage().data_ptr()``;
- compares slicing (a view) with advanced indexing by a tensor of indices (always a copy);
- measures both pairs on a big tensor: the views take no memory, the copies a tensor's worth.

Run it with ``torchtop demo tensors`` to watch the copies rise on the memory chart, or
``--headless`` for the table only.
"""

from __future__ import annotations

import torch

from torchtop.demos import _harness as harness


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` read the same block of memory (one is a view of the other)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def show_creation(device: torch.device) -> None:
    """The usual ways to make a tensor, and the attributes every tensor carries."""
    harness.section("creating tensors")
    # From Python data: the dtype is inferred (int64 for ints, float32 for floats).
    ints = torch.tensor([[1, 2], [3, 4]], device=device)
    # Filled with a value, or random: float32 unless told otherwise.
    zeros = torch.zeros(2, 3, device=device)
    noise = torch.randn(2, 3, device=device, dtype=torch.float64)
    # A tensor that autograd will compute gradients for (floating point only).
    weights = torch.randn(3, requires_grad=True, device=device)
    for name, t in (
        ("torch.tensor([[1, 2], [3, 4]])", ints),
        ("torch.zeros(2, 3)", zeros),
        ("torch.randn(2, 3, dtype=float64)", noise),
        ("torch.randn(3, requires_grad=True)", weights),
    ):
        print(
            f"{name:<36} shape {list(t.shape)}, dtype {t.dtype}, device {t.device}, "
            f"requires_grad {t.requires_grad}"
        )
    # .to() converts dtype or device, and copies only when something changes.
    halves = zeros.to(torch.float16)
    print(
        f"zeros.to(float16): {halves.element_size()} bytes an element instead of "
        f"{zeros.element_size()}; zeros.to(float32) is zeros itself: "
        f"{zeros.to(torch.float32) is zeros}"
    )


def show_views_and_copies(device: torch.device) -> None:
    """view, reshape, permute and contiguous on a 3 x 4 tensor: which ones share storage."""
    harness.section("view, reshape, permute: which ones copy?")
    x = torch.arange(12, device=device).view(3, 4)
    print(f"x = torch.arange(12).view(3, 4): stride {x.stride()}, contiguous {x.is_contiguous()}")

    # view() reinterprets the same storage with a new shape: free, and writes show through.
    v = x.view(4, 3)
    print(f"x.view(4, 3): shares x's storage: {shares_storage(v, x)}")
    v[0, 0] = 100
    print(f"after v[0, 0] = 100, x[0, 0] is {x[0, 0].item()} (same memory)")
    x[0, 0] = 0

    # permute() (and .t(), .transpose()) only swaps strides: still a view, but the elements
    # are no longer in row-major order in memory, so the result is not contiguous.
    p = x.permute(1, 0)
    print(
        f"x.permute(1, 0): shares storage: {shares_storage(p, x)}, stride {p.stride()}, "
        f"contiguous {p.is_contiguous()}"
    )
    # view() needs strides it can express without moving data; on a permuted tensor it fails.
    try:
        p.view(12)
    except RuntimeError as error:
        print(f"x.permute(1, 0).view(12) -> RuntimeError: {str(error).splitlines()[0]}")
    # reshape() is view() when it can be and a copy when it must: it hides the copy from you.
    print(f"x.reshape(12) shares storage: {shares_storage(x.reshape(12), x)} (a view)")
    print(
        f"x.permute(1, 0).reshape(12) shares storage: "
        f"{shares_storage(p.reshape(12), x)} (a silent copy)"
    )
    # contiguous() makes the copy explicit: a new storage laid out in the permuted order.
    c = p.contiguous()
    print(
        f"x.permute(1, 0).contiguous(): shares storage: {shares_storage(c, x)}, "
        f"stride {c.stride()}, and now c.view(12) works: {c.view(12).tolist()}"
    )


def show_slicing_and_indexing(device: torch.device) -> None:
    """Basic slicing returns views; indexing with a tensor (or a list, or a mask) copies."""
    harness.section("slicing (a view) against advanced indexing (a copy)")
    x = torch.arange(12, device=device).view(3, 4)
    sliced = x[:, ::2]  # start:stop:step slices only change offset and strides
    evens = torch.tensor([0, 2], device=device)
    indexed = x[:, evens]  # the same numbers, gathered into new memory
    print(f"x[:, ::2]   = {sliced.tolist()}, shares x's storage: {shares_storage(sliced, x)}")
    print(f"x[:, [0,2]] = {indexed.tolist()}, shares x's storage: {shares_storage(indexed, x)}")
    masked = x[x > 5]  # a boolean mask is advanced indexing too: always a copy
    print(f"x[x > 5]    = {masked.tolist()}, shares x's storage: {shares_storage(masked, x)}")
    # The flip side of a view: writing to it writes to x. A copy is independent.
    sliced[0, 0] = -1
    indexed[0, 1] = -2
    print(f"after sliced[0, 0] = -1 and indexed[0, 1] = -2: x[0] is {x[0].tolist()}")


def measure_views_and_copies(options: harness.DemoOptions) -> list[harness.PhaseResult]:
    """The same pairs on a big tensor, each a measured phase: views are free, copies are not."""
    channels, height, width = (64, 256, 256) if options.quick else (128, 512, 512)
    repeat = 9 if options.quick else 10
    # Without --quick each phase keeps running a few seconds, so it is easy to watch live.
    min_seconds = 0.0 if options.quick else 5.0
    big = torch.randn(channels, height, width, device=options.device)
    big_bytes = big.numel() * big.element_size()
    harness.section(
        f"on a [{channels}, {height}, {width}] float32 tensor ({harness.format_bytes(big_bytes)})"
    )
    evens = torch.arange(0, width, 2, device=options.device)

    def view() -> torch.Tensor:
        # A new shape over the same storage: no data moves.
        return big.view(channels, height * width)

    def permute_contiguous() -> torch.Tensor:
        # channels-last order, made real: every element is copied to its new place.
        return big.permute(1, 2, 0).contiguous()

    def slice_every_other() -> torch.Tensor:
        # Every other column, as a view with doubled stride.
        return big[:, :, ::2]

    def index_every_other() -> torch.Tensor:
        # The same columns picked by an index tensor: gathered into a new storage.
        return big[:, :, evens]

    assert torch.equal(slice_every_other(), index_every_other())
    results = []
    for name, fn, description in (
        (
            "view (no copy)",
            view,
            "view() gives the same storage a new shape and strides: no data moves, so it "
            "costs microseconds and no memory whatever the tensor's size.",
        ),
        (
            "permute().contiguous() (copy)",
            permute_contiguous,
            "permute() only swaps strides, but contiguous() lays every element out in the "
            "new order: a full copy, as big as the tensor, and time that grows with its size.",
        ),
        (
            "slice [:, :, ::2] (no copy)",
            slice_every_other,
            "Basic slicing (start:stop:step) is a view: a new offset and a doubled stride over "
            "the same storage. Free, and writes to it show through in the original.",
        ),
        (
            "index [:, :, evens] (copy)",
            index_every_other,
            "Indexing with a tensor, a list or a mask is advanced indexing: the chosen elements "
            "are gathered into new memory. Same values as the slice, half the tensor copied.",
        ),
    ):
        out = fn()
        copied = not shares_storage(out, big)
        del out
        result = harness.measure(
            name,
            fn,
            device=options.device,
            repeat=repeat,
            min_seconds=min_seconds,
            extra={"copies": "yes" if copied else "no"},
            description=description,
        )
        print(
            f"{name}: {harness.format_seconds(result.seconds)}, "
            f"new memory {harness.format_bytes(result.peak_bytes)}"
        )
        results.append(result)
        harness.pause(options)
    return results


def conclusion(results: list[harness.PhaseResult]) -> str:
    """One sentence from the measured numbers."""
    view, permuted, sliced, indexed = results
    fmt = harness.format_bytes
    return (
        f"view took {fmt(view.peak_bytes)} of new memory and "
        f"{harness.speed_clause(view, permuted, 'permute().contiguous()')}, which copied "
        f"{fmt(permuted.peak_bytes)}; the slice took {fmt(sliced.peak_bytes)} and "
        f"{harness.speed_clause(sliced, indexed, 'advanced indexing')}, which copied "
        f"{fmt(indexed.peak_bytes)} for the same columns."
    )


def main() -> None:
    options = harness.begin(__doc__, "tensors")
    show_creation(options.device)
    show_views_and_copies(options.device)
    show_slicing_and_indexing(options.device)
    harness.pause(options)
    results = measure_views_and_copies(options)
    harness.print_results(f"views and copies on {options.device}", results, conclusion(results))
    harness.emit_json_results(results)


if __name__ == "__main__":
    main()
