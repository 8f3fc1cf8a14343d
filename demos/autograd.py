"""Autograd basics; grad on vs no_grad() vs inference_mode() at inference.

When a tensor has ``requires_grad=True``, every operation on it records a node in a graph,
and each node saves the tensors its gradient will need (a ``Linear`` saves its input, a
``ReLU`` its output). ``backward()`` walks that graph from the loss to the leaves and fills
their ``.grad``. This demo

- computes a few gradients on numbers small enough to check by hand;
- runs the same model forward three ways, as an evaluation loop would: with grad on (the
  default, and a common mistake in evaluation code), under ``torch.no_grad()`` and under
  ``torch.inference_mode()``, and measures the memory the graph holds after the forward and
  the time each takes.

Run it with ``torchtop demo autograd`` to watch each phase on the memory chart, or
``--headless`` for the table only.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

from torchtop.demos import _harness as harness


def show_gradients(device: torch.device) -> None:
    """requires_grad, grad_fn, backward and .grad on tensors small enough to print."""
    harness.section("requires_grad and backward")
    x = torch.tensor(2.0, device=device, requires_grad=True)
    y = x**3 + 2 * x  # dy/dx = 3x^2 + 2 = 14 at x = 2
    print(f"x = 2 (a leaf: {x.is_leaf}), y = x**3 + 2*x = {y.item():.0f}")
    print(f"y.grad_fn = {type(y.grad_fn).__name__}: the last op recorded in y's graph")
    y.backward()
    assert x.grad is not None
    print(f"y.backward(): x.grad = {x.grad.item():.0f} (3x^2 + 2 at x = 2)")

    # Gradients accumulate: a second backward adds to .grad, which is why training loops
    # call optimizer.zero_grad() (or set .grad to None) before each backward.
    (x**3 + 2 * x).backward()
    print(f"backward again without zeroing: x.grad = {x.grad.item():.0f} (14 + 14)")
    x.grad = None

    # A linear model and a squared error: the gradient of each parameter.
    w = torch.tensor([1.0, -2.0], device=device, requires_grad=True)
    b = torch.tensor(0.5, device=device, requires_grad=True)
    features = torch.tensor([3.0, 1.0], device=device)  # data: no gradient needed
    target = torch.tensor(2.0, device=device)
    prediction = (w * features).sum() + b  # 3 - 2 + 0.5 = 1.5
    loss = (prediction - target) ** 2  # 0.25
    loss.backward()
    assert w.grad is not None and b.grad is not None
    # d loss / d w = 2 (prediction - target) * features = -1 * [3, 1]; d loss / d b = -1
    print(
        f"loss = (w . features + b - target)^2 = {loss.item():.2f}: "
        f"w.grad = {w.grad.tolist()}, b.grad = {b.grad.item():.1f}, "
        f"features.requires_grad = {features.requires_grad} (so no grad for it)"
    )


def make_model(width: int, depth: int, device: torch.device) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers).to(device)


def compare_inference_modes(options: harness.DemoOptions) -> list[harness.PhaseResult]:
    """The same forward pass three ways, each a measured phase."""
    batch, width, depth = (512, 512, 6) if options.quick else (4096, 512, 6)
    repeat = 7 if options.quick else 5
    # Without --quick each phase keeps running a few seconds, so it is easy to watch live.
    min_seconds = 0.0 if options.quick else 6.0
    torch.manual_seed(0)
    model = make_model(width, depth, options.device)
    inputs = torch.randn(batch, width, device=options.device)
    activation = batch * width * 4
    harness.section(
        f"a forward pass: {depth} x (Linear({width}, {width}) + ReLU), batch {batch}; "
        f"one activation is {harness.format_bytes(activation)}"
    )

    def forward_in(context: Callable[[], AbstractContextManager[object]]) -> torch.Tensor:
        with context():
            return model(inputs)

    results = []
    for name, context, note, description in (
        (
            "grad on",
            nullcontext,
            "the default: records the graph and saves activations",
            "With grad on, every op records a node in the autograd graph and saves the "
            "tensors its backward needs. The output keeps all those activations alive, for a "
            "backward that inference never runs.",
        ),
        (
            "no_grad()",
            torch.no_grad,
            "records nothing, saves nothing",
            "torch.no_grad() records no graph and saves nothing, so each activation is freed "
            "as soon as the next layer has read it. The standard way to evaluate or predict.",
        ),
        (
            "inference_mode()",
            torch.inference_mode,
            "like no_grad, and skips version counters and view tracking too",
            "torch.inference_mode() is no_grad and more: its tensors skip version counters "
            "and view tracking, shaving per-op overhead. They cannot be used in autograd later.",
        ),
    ):

        def fn(context: Callable[[], AbstractContextManager[object]] = context) -> torch.Tensor:
            return forward_in(context)

        # What the output keeps alive once the forward is done: the output itself and,
        # with grad on, every tensor the graph saved for a backward that never comes.
        with harness.track_memory(options.device) as meter:
            output = fn()
        held = meter.live_bytes
        has_graph = output.grad_fn is not None
        del output
        result = harness.measure(
            name,
            fn,
            device=options.device,
            repeat=repeat,
            min_seconds=min_seconds,
            extra={"held after": harness.Bytes(held), "graph": "yes" if has_graph else "no"},
            description=description,
        )
        print(
            f"{name}: {note}; holds {harness.format_bytes(held)} after the forward "
            f"(= {held / activation:.0f} activation{'' if held == activation else 's'}), "
            f"{harness.format_seconds(result.seconds)}"
        )
        results.append(result)
        harness.pause(options)

    # All three compute the same numbers.
    with torch.no_grad():
        expected = model(inputs)
    assert torch.allclose(forward_in(nullcontext), expected)
    assert torch.allclose(forward_in(torch.inference_mode), expected)
    return results


def conclusion(results: list[harness.PhaseResult]) -> str:
    """One sentence from the measured numbers."""
    grad, no_grad, inference = results

    def held(result: harness.PhaseResult) -> str:
        return harness.format_bytes(result.extra["held after"])

    return (
        f"after the forward, grad on held {held(grad)} (the graph's saved activations), "
        f"no_grad() {held(no_grad)} and inference_mode() {held(inference)}; "
        f"no_grad() {harness.comparison_clause(no_grad, grad, 'grad on')}, and "
        f"inference_mode() {harness.comparison_clause(inference, grad, 'grad on')}."
    )


def main() -> None:
    options = harness.begin(__doc__, "autograd")
    show_gradients(options.device)
    harness.pause(options)
    results = compare_inference_modes(options)
    harness.print_results(f"inference on {options.device}", results, conclusion(results))
    harness.emit_json_results(results)


if __name__ == "__main__":
    main()
