"""A Python loop vs a vectorized op vs torch.matmul: the time ratio.

Every PyTorch operation called from Python pays a fixed cost before any arithmetic happens:
argument parsing, dispatch, allocating the result, launching the kernel (on a GPU, a launch of
a few microseconds). A loop that calls a small op once per row pays it once per row, and the
kernel inside does almost nothing each time. The same work written as one operation over the
whole tensor pays it once, and the kernel can use every core and SIMD lane.

This demo computes a matrix-vector product ``A @ x`` three ways:

- a Python loop: ``torch.dot(A[i], x)`` for each row ``i``, one op per row;
- vectorized: ``(A * x).sum(dim=1)``, two ops in all, but with an ``A``-sized temporary;
- ``torch.matmul(A, x)``: one op, straight to the optimized BLAS kernel, no temporary.

Run it with ``torchtop demo vectorization`` to watch each phase live, or ``--headless`` for
the table only.
"""

from __future__ import annotations

import torch

from torchtop.demos import _harness as harness


def show_the_idea(device: torch.device) -> None:
    """The three ways on a matrix small enough to print, giving the same answer."""
    harness.section("the same product, three ways, on a 3 x 4 matrix")
    a = torch.arange(12.0, device=device).view(3, 4)
    x = torch.tensor([1.0, 0.0, -1.0, 2.0], device=device)
    looped = torch.stack([torch.dot(a[i], x) for i in range(a.shape[0])])
    vectorized = (a * x).sum(dim=1)  # x broadcasts against every row
    multiplied = a @ x  # torch.matmul
    print(f"loop over rows:        {looped.tolist()}  (3 x (select + dot) + a stack)")
    print(f"(A * x).sum(dim=1):    {vectorized.tolist()}  (2 ops)")
    print(f"torch.matmul(A, x):    {multiplied.tolist()}  (1 op)")


def compare(options: harness.DemoOptions) -> list[harness.PhaseResult]:
    """A big matrix-vector product, three ways, each a measured phase."""
    rows, cols = (4096, 512) if options.quick else (32768, 256)
    repeat = 5 if options.quick else 3
    # Without --quick each phase keeps running a few seconds, so it is easy to watch live.
    min_seconds = 0.0 if options.quick else 6.0
    harness.section(f"A @ x with A of {rows} x {cols}, x of {cols}")
    a = torch.randn(rows, cols, device=options.device)
    x = torch.randn(cols, device=options.device)
    print(
        f"A: {harness.format_bytes(a.numel() * a.element_size())}. The loop pays a fixed cost "
        f"per row ({rows} rows), (A * x).sum(1) an A-sized temporary, matmul neither."
    )

    def python_loop() -> torch.Tensor:
        # One dot product per row: `rows` trips through Python and the dispatcher, each doing
        # only `cols` multiply-adds. a[i] and out[i] are ops too (select), and the write is a
        # copy_: four ops a row, plus the empty() before the loop.
        out = torch.empty(rows, device=options.device)
        for i in range(rows):
            out[i] = torch.dot(a[i], x)
        return out

    def vectorized() -> torch.Tensor:
        # Broadcasting multiplies every row by x at once; sum reduces each row. Two ops, but
        # the product A * x is a full A-sized temporary.
        return (a * x).sum(dim=1)

    def matmul() -> torch.Tensor:
        # One call into the BLAS matrix-vector kernel: no temporary, best memory access.
        return torch.matmul(a, x)

    reference = matmul()
    results = []
    for name, fn, ops, description in (
        (
            "Python loop over rows",
            python_loop,
            4 * rows + 1,
            "One dot product per row: every row pays Python and dispatcher overhead (a few "
            "microseconds an op) for a tiny amount of math. The fixed cost per op dominates.",
        ),
        (
            "vectorized (A * x).sum(1)",
            vectorized,
            2,
            "Two ops over the whole matrix: broadcasting multiplies every row by x, then sum "
            "reduces each row. Overhead is paid twice, not per row, but A * x is an A-sized "
            "temporary.",
        ),
        (
            "torch.matmul",
            matmul,
            1,
            "One call into the BLAS matrix-vector kernel: no temporary, and memory read in "
            "order once. The library does what the loop did, in optimized native code.",
        ),
    ):
        # Float sums in a different order differ in the last bits, hence allclose.
        assert torch.allclose(fn(), reference, rtol=1e-4, atol=1e-3)
        result = harness.measure(
            name,
            fn,
            device=options.device,
            repeat=repeat,
            min_seconds=min_seconds,
            extra={"ops called": ops},
            description=description,
        )
        print(
            f"{name}: {harness.format_seconds(result.seconds)} with {ops} ops, "
            f"peak {harness.format_bytes(result.peak_bytes)}"
        )
        results.append(result)
        harness.pause(options)
    return results


def conclusion(results: list[harness.PhaseResult]) -> str:
    """One sentence from the measured numbers."""
    loop, vectorized, matmul = results
    return (
        f"the vectorized version {harness.speed_clause(vectorized, loop, 'the Python loop')} "
        f"and torch.matmul {harness.speed_clause(matmul, loop, 'the loop')}; matmul also "
        f"{harness.speed_clause(matmul, vectorized, 'the vectorized version')}, which needed "
        f"{harness.format_bytes(vectorized.peak_bytes)} of temporary memory against "
        f"{harness.format_bytes(matmul.peak_bytes)}."
    )


def main() -> None:
    options = harness.begin(__doc__, "vectorization")
    show_the_idea(options.device)
    harness.pause(options)
    results = compare(options)
    harness.print_results(
        f"matrix-vector product on {options.device}", results, conclusion(results)
    )
    harness.emit_json_results(results)


if __name__ == "__main__":
    main()
