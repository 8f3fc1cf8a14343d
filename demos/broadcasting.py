"""Broadcasting against repeat/expand().contiguous(): peak memory and time.

Broadcasting lets PyTorch combine tensors of different shapes without copying the smaller one:
``[3, 1] + [1, 4]`` gives ``[3, 4]`` as if both had been stretched, but nothing is stretched in
memory. This demo shows the rule on small tensors, then measures the same sum done three ways:

- ``repeat``: copy the row vector into a full matrix, then add;
- ``expand().contiguous()``: a free stretched view, made into a real matrix by ``contiguous``;
- broadcasting: just ``matrix + row``.

The first two allocate a matrix-sized copy that broadcasting never makes. Last, it shows the
other side of broadcasting: an ``[N]`` tensor against an ``[N, 1]`` one silently gives ``[N, N]``,
a wrong answer that also costs N² memory, and how a shape check catches it.

Run it with ``torchtop demo broadcasting`` to watch each phase on the memory chart, or
``--headless`` for the table only.
"""

from __future__ import annotations

import torch

from torchtop.demos import _harness as harness


def show_the_rule(device: torch.device) -> None:
    """Broadcasting on tensors small enough to print."""
    harness.section("broadcasting: [3, 1] + [1, 4]")
    column = torch.tensor([[0.0], [10.0], [20.0]], device=device)  # shape [3, 1]
    row = torch.tensor([[1.0, 2.0, 3.0, 4.0]], device=device)  # shape [1, 4]
    total = column + row
    print(f"column {list(column.shape)} + row {list(row.shape)} -> {list(total.shape)}")
    print(total.cpu())
    # The rule: line the shapes up from the right; each pair of sizes must be equal or one of
    # them 1, and a size-1 dimension is repeated to match the other.
    #
    # expand() is how broadcasting "repeats" without copying: the stretched dimension gets
    # stride 0, so every row of the view reads the same four numbers.
    stretched = row.expand(3, 4)
    print(
        f"row.expand(3, 4): shape {list(stretched.shape)}, stride {stretched.stride()}, "
        f"shares row's memory: {stretched.data_ptr() == row.data_ptr()}"
    )
    # contiguous() on that view has to lay the rows out for real: a 3x4 copy.
    copied = stretched.contiguous()
    print(
        f"row.expand(3, 4).contiguous(): stride {copied.stride()}, "
        f"a new copy: {copied.data_ptr() != row.data_ptr()}"
    )


def compare_the_three_ways(options: harness.DemoOptions) -> list[harness.PhaseResult]:
    """Add a row vector to every row of a big matrix, three ways, each a measured phase."""
    rows, cols = (2048, 4096) if options.quick else (8192, 8192)
    repeat = 5 if options.quick else 10
    # Without --quick each phase keeps running a few seconds, so it is easy to watch live.
    min_seconds = 0.0 if options.quick else 4.0
    harness.section(f"adding a row of {cols} to a {rows} x {cols} matrix, three ways")

    matrix = torch.randn(rows, cols, device=options.device)
    row = torch.randn(cols, device=options.device)
    matrix_bytes = matrix.numel() * matrix.element_size()
    print(f"the matrix and each result: {harness.format_bytes(matrix_bytes)}")

    def with_repeat() -> torch.Tensor:
        # Copies the row `rows` times: a second matrix-sized tensor exists during the add.
        return matrix + row.repeat(rows, 1)

    def with_expand_contiguous() -> torch.Tensor:
        # expand() alone would be free; contiguous() turns the view into the same full copy.
        return matrix + row.expand(rows, cols).contiguous()

    def with_broadcasting() -> torch.Tensor:
        # The add reads the row as if stretched; only the result is allocated.
        return matrix + row

    shape = (rows, cols)
    results = []
    for name, fn, description in (
        (
            "repeat",
            with_repeat,
            "row.repeat(rows, 1) copies the row into a full matrix before the add. That copy "
            "is as big as the result, so the peak is two matrices, and writing it costs as "
            "much memory traffic as the add itself.",
        ),
        (
            "expand().contiguous()",
            with_expand_contiguous,
            "expand() alone is free: a view whose stretched dimension has stride 0. "
            "contiguous() then lays the rows out for real, the same full copy as repeat.",
        ),
        (
            "broadcasting",
            with_broadcasting,
            "matrix + row: the add reads the row as if stretched and copies nothing. Only "
            "the result is allocated, so the peak is one matrix and the op reads half as much.",
        ),
    ):
        result = harness.measure(
            name,
            fn,
            device=options.device,
            repeat=repeat,
            min_seconds=min_seconds,
            extra={"result": shape},
            description=description,
        )
        print(
            f"{name}: {harness.format_seconds(result.seconds)}, "
            f"peak {harness.format_bytes(result.peak_bytes)}"
        )
        results.append(result)
        harness.pause(options)

    # All three computed the same numbers: the difference is only in memory and time.
    assert torch.equal(with_repeat(), with_broadcasting())
    assert torch.equal(with_expand_contiguous(), with_broadcasting())
    return results


def an_accidental_broadcast(options: harness.DemoOptions) -> list[harness.PhaseResult]:
    """``[N]`` against ``[N, 1]`` gives ``[N, N]``: a wrong loss, N² memory, and no error."""
    n = 2048 if options.quick else 8192
    repeat = 5 if options.quick else 10
    min_seconds = 0.0 if options.quick else 3.0
    harness.section(f"an accidental broadcast: predictions [{n}] against targets [{n}, 1]")

    predictions = torch.randn(n, device=options.device)  # e.g. a model's output, squeezed
    targets = torch.randn(n, 1, device=options.device)  # e.g. labels loaded as a column

    def mse_shapes_mismatched() -> torch.Tensor:
        # [N] - [N, 1]: lined up from the right, [N] acts as [1, N], so the difference is
        # every prediction minus every target, an N x N matrix. No error, just a wrong mean.
        return ((predictions - targets) ** 2).mean()

    def mse_shapes_checked() -> torch.Tensor:
        # The fix: make the shapes agree before subtracting.
        column = targets.squeeze(1)
        assert predictions.shape == column.shape, (predictions.shape, column.shape)
        return ((predictions - column) ** 2).mean()

    wrong_shape = (predictions - targets).shape
    print(f"predictions - targets has shape {list(wrong_shape)}, not [{n}]")
    wrong, right = mse_shapes_mismatched().item(), mse_shapes_checked().item()
    print(f"mean squared error: {wrong:.4f} with the accidental broadcast, {right:.4f} correct")

    # The check that catches it, where the shapes are still known to be wrong:
    try:
        assert predictions.shape == targets.shape, (
            f"shape mismatch: predictions {list(predictions.shape)} "
            f"vs targets {list(targets.shape)}"
        )
    except AssertionError as error:
        print(f"assert predictions.shape == targets.shape -> AssertionError: {error}")
    print("fix: targets.squeeze(1) (or predictions.unsqueeze(1)) before subtracting")

    results = []
    for name, fn, shape, description in (
        (
            "[N] - [N,1] (accidental)",
            mse_shapes_mismatched,
            tuple(wrong_shape),
            "Shapes line up from the right, so [N] acts as [1, N] against [N, 1]: the "
            "difference is an N x N matrix. No error is raised; the loss is wrong and costs "
            "N squared memory.",
        ),
        (
            "shapes checked",
            mse_shapes_checked,
            (n,),
            "targets.squeeze(1) makes both shapes [N] before subtracting, and an assert on "
            "the shapes catches the mismatch early. The difference has N elements: the right "
            "loss, for N-sized memory.",
        ),
    ):
        result = harness.measure(
            name,
            fn,
            device=options.device,
            repeat=repeat,
            min_seconds=min_seconds,
            extra={"result": shape},
            description=description,
        )
        results.append(result)
        harness.pause(options)
    return results


def main() -> None:
    options = harness.begin(__doc__, "broadcasting")
    show_the_rule(options.device)
    harness.pause(options)
    three_ways = compare_the_three_ways(options)
    accidental = an_accidental_broadcast(options)

    repeat, expand_contiguous, broadcasting = three_ways
    mismatched, checked = accidental
    conclusion = (
        harness.ratio_sentence(broadcasting, repeat, expand_contiguous)
        + "; the accidental [N] - [N,1] broadcast took "
        + f"{harness.format_bytes(mismatched.peak_bytes)} of memory for a wrong loss, "
        + f"against {harness.format_bytes(checked.peak_bytes)} with the shapes checked."
    )
    harness.print_results(
        f"broadcasting on {options.device}", [*three_ways, *accidental], conclusion
    )
    harness.emit_json_results([*three_ways, *accidental])


if __name__ == "__main__":
    main()
