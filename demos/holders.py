"""What holds the memory: SGD against Adam, then activation checkpointing.

A training step's memory is held by four things: the parameters, their gradients, the
optimizer's state, and the activations the forward pass saves for backward (with temporaries).
Which of them is largest decides what to change when memory runs out. This demo trains one deep
MLP three ways and measures each part:

- plain SGD keeps no state; Adam keeps two moments per parameter, twice the parameters' bytes;
- without checkpointing every block's activations live until backward reaches it; then, still
  with Adam, a checkpoint around each segment of blocks keeps only the segment inputs, and each
  segment's forward runs again during backward.

Run it with ``torchtop demo holders`` and press ``h`` to watch the split move: the optimizer
state (O) appears when Adam takes over, and the rest of allocated (A) shrinks with
checkpointing. ``--headless`` prints the table only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from torchtop.demos import _harness as harness
from torchtop.demos.checkpointing import DeepMLP


def unique_bytes(tensors: Iterable[torch.Tensor], seen: set[tuple[str, int]]) -> int:
    """The bytes of the storages of ``tensors`` not in ``seen`` (which they join): a storage
    shared by two tensors (a tied weight, a view) counts once."""
    total = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def held_by(optimizer: torch.optim.Optimizer) -> dict[str, harness.Bytes]:
    """The optimizer's parameters, their gradients and its state, in bytes (unique storages)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    seen: set[tuple[str, int]] = set()
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {
        "params": harness.Bytes(unique_bytes(params, seen)),
        "grads": harness.Bytes(unique_bytes((p.grad for p in params if p.grad is not None), seen)),
        "optimizer": harness.Bytes(unique_bytes(state, seen)),
    }


def compare(options: harness.DemoOptions) -> list[harness.PhaseResult]:
    """One model: SGD, then Adam, then Adam with a checkpoint around each segment of blocks."""
    batch, width, depth = (1024, 256, 8) if options.quick else (1024, 1024, 8)
    repeat = 3
    # Each phase runs long enough for the agent's holders read (once a second) to see it, and
    # without --quick long enough to watch.
    min_seconds = 2.0 if options.quick else 6.0
    torch.manual_seed(0)
    model = DeepMLP(width, depth).to(options.device)
    inputs = torch.randn(batch, width, device=options.device)
    targets = torch.randn(batch, 1, device=options.device)
    segment = max(1, round(math.sqrt(depth)))
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    harness.section(
        f"{depth} x (Linear({width}, {width}) + GELU), batch {batch}: "
        f"{harness.format_bytes(parameters)} of parameters"
    )
    print(
        "the gradients stay allocated between steps here (zero_grad(set_to_none=False)), so "
        "the split shows them all the time; the default, set_to_none=True, frees them"
    )

    results = []
    optimizer: torch.optim.Optimizer | None = None
    for name, make, blocks_per_checkpoint, description in (
        (
            "SGD",
            lambda: torch.optim.SGD(model.parameters(), lr=1e-3),
            0,
            "Plain SGD keeps no state: the step holds the parameters, their gradients (as "
            "many bytes again) and the activations saved for backward. Press h to see the "
            "split: P and G at the bottom, no O.",
        ),
        (
            "Adam",
            lambda: torch.optim.Adam(model.parameters(), lr=1e-3),
            0,
            "Adam keeps two moments per parameter (exp_avg and exp_avg_sq): optimizer state "
            "twice the parameters' bytes, for the whole run (O). Every block's activations "
            "are still saved for backward: most of the rest (A) at the step's peak.",
        ),
        (
            f"Adam, {math.ceil(depth / segment)} checkpoints",
            None,
            segment,
            "checkpoint(segment, x, use_reentrant=False) keeps only each segment's input and "
            "runs its forward again during backward: A shrinks at the peak, P, G and O stay, "
            "and each step pays for a second forward.",
        ),
    ):
        if make is not None:
            del optimizer  # the optimizer before (and its state) goes
            optimizer = make()
        assert optimizer is not None
        model.segment = blocks_per_checkpoint
        step_with = optimizer

        def train_step(step_with: torch.optim.Optimizer = step_with) -> None:
            step_with.zero_grad(set_to_none=False)
            loss = nn.functional.mse_loss(model(inputs), targets)
            loss.backward()
            step_with.step()

        train_step()  # Adam makes its state at its first step
        result = harness.measure(
            name,
            train_step,
            device=options.device,
            repeat=repeat,
            min_seconds=min_seconds,
            extra=held_by(optimizer),
            description=description,
        )
        held = result.extra
        print(
            f"{name}: parameters {harness.format_bytes(held['params'])}, gradients "
            f"{harness.format_bytes(held['grads'])}, optimizer state "
            f"{harness.format_bytes(held['optimizer'])}; the step's peak above them "
            f"{harness.format_bytes(result.peak_bytes)}"
        )
        results.append(result)
        harness.pause(options)
    return results


def conclusion(results: list[harness.PhaseResult]) -> str:
    """One sentence from the measured numbers."""
    sgd, adam, checkpointed = results
    fmt = harness.format_bytes
    state, params = adam.extra["optimizer"], adam.extra["params"]
    sgd_state = fmt(sgd.extra["optimizer"]) if sgd.extra["optimizer"] else "none"
    return (
        f"Adam held {fmt(state)} of optimizer state ({state / params:.1f} times the "
        f"parameters) where SGD held {sgd_state}; {checkpointed.name} "
        f"{harness.comparison_clause(checkpointed, adam, 'Adam without them')}."
    )


def main() -> None:
    options = harness.begin(__doc__, "holders")
    results = compare(options)
    harness.print_results(
        f"what holds the memory on {options.device}", results, conclusion(results)
    )
    harness.emit_json_results(results)


if __name__ == "__main__":
    main()
