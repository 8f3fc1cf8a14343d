"""Activation checkpointing: peak memory against recompute time.

In training, the forward pass saves every layer's activations for the backward pass, so the
peak grows with depth. ``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)``
runs ``block`` without keeping what it saves, only its input; during backward it runs the
block's forward again to get them back. Memory is traded for compute: the saved activations of
a whole segment of layers become one input, and each checkpointed forward runs twice.

This demo trains the same deep MLP three ways and measures forward+backward of each:

- no checkpointing: every layer's activations live until backward reaches it;
- a checkpoint around every block: only the block inputs are kept;
- a checkpoint around each of about sqrt(depth) segments: fewer stored inputs, and one
  segment's activations recomputed at a time (the classic sqrt(n) trade-off).

Run it with ``torchtop demo checkpointing`` to watch each phase on the memory chart, or
``--headless`` for the table only.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from torchtop.demos import _harness as harness


class DeepMLP(nn.Module):
    """``depth`` blocks of Linear + GELU, run with checkpoints every ``segment`` blocks."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)
        )
        self.head = nn.Linear(width, 1)
        #: Blocks per checkpoint; 0 runs without checkpointing.
        self.segment = 0

    def run_blocks(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        for block in self.blocks[start:stop]:
            x = block(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.segment == 0:
            x = self.run_blocks(x, 0, len(self.blocks))
        else:
            for start in range(0, len(self.blocks), self.segment):
                stop = min(start + self.segment, len(self.blocks))
                # Inside the checkpoint nothing is saved for backward but `x`; the blocks run
                # again during backward. use_reentrant=False is the recommended version: it
                # works with inputs that do not require grad and with torch.autograd.grad.
                out = checkpoint(self.run_blocks, x, start, stop, use_reentrant=False)
                assert isinstance(out, torch.Tensor)
                x = out
        return self.head(x)


def compare(options: harness.DemoOptions) -> list[harness.PhaseResult]:
    """Forward+backward with no checkpoints, one per block, and sqrt(depth) segments."""
    batch, width, depth = (1024, 128, 9) if options.quick else (4096, 256, 16)
    repeat = 5 if options.quick else 3
    # Without --quick each phase keeps running a few seconds, so it is easy to watch live.
    min_seconds = 0.0 if options.quick else 6.0
    torch.manual_seed(0)
    model = DeepMLP(width, depth).to(options.device)
    inputs = torch.randn(batch, width, device=options.device)
    targets = torch.randn(batch, 1, device=options.device)
    activation = batch * width * 4
    segment = max(1, round(math.sqrt(depth)))
    harness.section(
        f"forward+backward of {depth} x (Linear({width}, {width}) + GELU), batch {batch}: "
        f"one activation is {harness.format_bytes(activation)}"
    )
    print(
        "without checkpointing each block saves two: Linear its input, GELU its input "
        f"(about {harness.format_bytes(2 * activation * depth)} for the whole net)"
    )

    def train_step() -> None:
        # set_to_none: the gradients are allocated inside the step in every variant alike.
        model.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()

    results = []
    reference: list[torch.Tensor] = []
    for name, blocks_per_checkpoint, description in (
        (
            "no checkpointing",
            0,
            "Autograd saves each layer's input for the backward pass, so every block's "
            "activations stay alive until backward reaches it. The peak grows with depth "
            "times batch; nothing is computed twice.",
        ),
        (
            "checkpoint every block",
            1,
            "checkpoint(block, x, use_reentrant=False) keeps only each block's input and "
            "reruns the block's forward during backward. Saved activations shrink to one "
            "input per block, paid for with a second forward.",
        ),
        (
            f"checkpoint {math.ceil(depth / segment)} segments",
            segment,
            "One checkpoint per segment of about sqrt(depth) blocks: fewer stored inputs, "
            "and only one segment's activations rebuilt at a time during backward. The "
            "classic sqrt(n) trade of memory for recompute.",
        ),
    ):
        model.segment = blocks_per_checkpoint
        # Checkpointing changes memory and time, never the gradients.
        train_step()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        if reference:
            assert all(
                torch.allclose(a, b, atol=1e-5) for a, b in zip(grads, reference, strict=True)
            )
        else:
            reference = grads
        stored = 0 if blocks_per_checkpoint == 0 else math.ceil(depth / blocks_per_checkpoint)
        result = harness.measure(
            name,
            train_step,
            device=options.device,
            repeat=repeat,
            min_seconds=min_seconds,
            extra={"checkpoints": stored},
            description=description,
        )
        print(
            f"{name}: peak {harness.format_bytes(result.peak_bytes)}, "
            f"{harness.format_seconds(result.seconds)} a step"
        )
        results.append(result)
        harness.pause(options)
    return results


def conclusion(results: list[harness.PhaseResult]) -> str:
    """One sentence from the measured numbers."""
    plain, every_block, segments = results

    def clause(result: harness.PhaseResult) -> str:
        text = harness.comparison_clause(result, plain, "no checkpointing")
        return text + (" (the recompute)" if text.endswith("slower") else "")

    return f"checkpointing every block {clause(every_block)}; {segments.name} {clause(segments)}."


def main() -> None:
    options = harness.begin(__doc__, "checkpointing")
    results = compare(options)
    harness.print_results(
        f"activation checkpointing on {options.device}", results, conclusion(results)
    )
    harness.emit_json_results(results)


if __name__ == "__main__":
    main()
