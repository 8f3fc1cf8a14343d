"""Mixed precision with autocast: memory, speed and loss against fp32.

``torch.autocast`` runs the ops that tolerate it (matrix multiplies, convolutions) in a 16-bit
floating-point type and keeps the sensitive ones (reductions, losses, softmax) in float32,
while the parameters and their gradients stay float32. The activations saved for backward are
then 16-bit: half the memory. Where the hardware has 16-bit matrix units (tensor cores on GPUs,
AMX on recent Xeons) the matrix multiplies are also much faster.

Two 16-bit types exist: float16 has more precision but a small range, so gradients can
underflow to zero and training needs ``GradScaler``; bfloat16 has float32's range with less
precision, so it needs no scaler. This demo uses bfloat16 on CPU, and on CUDA bfloat16 where
the GPU supports it, else float16 with a ``GradScaler``. It

- shows what autocast changes (the dtype of activations, not of parameters);
- measures forward+backward of the same MLP in float32 and under autocast: the activation
  memory the graph holds, the peak, and the time;
- trains both from the same weights on the same batches for a few steps and compares the loss.

Run it with ``torchtop demo mixed-precision`` to watch both phases on the memory chart, or
``--headless`` for the table only.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import torchtop
from torchtop.demos import _harness as harness


def low_precision_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on CPU and on GPUs that support it; float16 on older GPUs."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def show_the_types(device: torch.device, dtype: torch.dtype) -> None:
    """Range and precision of the three types, and what autocast casts."""
    harness.section("float32, float16, bfloat16")
    for kind in (torch.float32, torch.float16, torch.bfloat16):
        info = torch.finfo(kind)
        print(
            f"{str(kind).removeprefix('torch.'):<9} {info.bits} bits: largest {info.max:.3g}, "
            f"smallest normal {info.tiny:.3g}, precision ~{info.eps:.1g}"
        )
    print(
        "float16 overflows above 65504 and loses small gradients: it needs GradScaler. "
        "bfloat16 keeps float32's range and gives up precision instead."
    )

    layer = nn.Linear(4, 4).to(device)
    x = torch.randn(2, 4, device=device)
    with torch.autocast(device_type=device.type, dtype=dtype):
        y = layer(x)
        loss = nn.functional.mse_loss(y, torch.zeros_like(y))
    print(
        f"inside autocast({dtype}): the weight stays {layer.weight.dtype}, the input is "
        f"{x.dtype}, the Linear's output is {y.dtype}, mse_loss gives {loss.dtype}"
    )


def make_model(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    layers.append(nn.Linear(width, width))
    return nn.Sequential(*layers)


def compare(options: harness.DemoOptions) -> list[harness.PhaseResult]:
    """fp32 and autocast: forward+backward measured, then a few training steps each."""
    device = options.device
    dtype = low_precision_dtype(device)
    batch, width, depth = (2048, 128, 6) if options.quick else (4096, 256, 8)
    steps = 8 if options.quick else 20
    repeat = 7 if options.quick else 3
    # Without --quick each phase keeps running a few seconds, so it is easy to watch live.
    min_seconds = 0.0 if options.quick else 6.0
    torch.manual_seed(0)
    initial = make_model(width, depth).to(device)
    # The task: imitate a fixed random network, so the loss has somewhere to go.
    teacher = make_model(width, 1).to(device).requires_grad_(False)
    batches = [torch.randn(batch, width, device=device) for _ in range(steps)]
    with torch.no_grad():
        targets = [teacher(x) for x in batches]
    low_name = f"{str(dtype).removeprefix('torch.')} autocast"
    harness.section(
        f"training {depth} x (Linear({width}, {width}) + GELU), batch {batch}: float32 "
        f"against {low_name}"
    )

    def loss_of(model: nn.Module, low: bool, step: int) -> torch.Tensor:
        # Only the forward (and the loss) goes inside autocast; backward runs each op's
        # gradient in the dtype its forward used.
        with torch.autocast(device_type=device.type, dtype=dtype, enabled=low):
            return nn.functional.mse_loss(model(batches[step]), targets[step])

    results = []
    for name, low, description in (
        (
            "float32",
            False,
            "Every matmul and every saved activation in float32: 4 bytes a number. The "
            "baseline for memory, speed and the loss curve.",
        ),
        (
            low_name,
            True,
            f"torch.autocast runs matmuls in {str(dtype).removeprefix('torch.')} and keeps "
            "precision-sensitive ops (losses, reductions) in float32. Activations saved for "
            "backward take 2 bytes, and tensor cores (or AMX) run 16-bit math much faster.",
        ),
    ):
        model = copy.deepcopy(initial)
        # float16 gradients can underflow to zero: GradScaler multiplies the loss before
        # backward and divides the gradients back before the optimizer step, skipping steps
        # whose gradients overflowed. bfloat16 has float32's range; disabled, it does nothing.
        scaler = torch.amp.GradScaler(device.type, enabled=low and dtype == torch.float16)

        def forward_backward(
            model: nn.Module = model, low: bool = low, scaler: torch.amp.GradScaler = scaler
        ) -> None:
            model.zero_grad(set_to_none=True)
            scaler.scale(loss_of(model, low, 0)).backward()

        # What the graph holds after the forward: the activations saved for backward (and,
        # under autocast, the 16-bit copies of the weights the matmuls use).
        with harness.track_memory(device) as meter:
            loss = loss_of(model, low, 0)
            held = meter.live_bytes
        del loss

        result = harness.measure(
            name,
            forward_backward,
            device=device,
            repeat=repeat,
            min_seconds=min_seconds,
            extra={"activations": harness.Bytes(held)},
            description=description,
        )

        # A few Adam steps from the same weights on the same batches.
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        model.load_state_dict(initial.state_dict())
        losses = []
        with torchtop.phase(
            f"{name}: {steps} training steps",
            "The same Adam steps from the same weights, to check that training still "
            "converges. GradScaler guards float16 gradients against underflow; bfloat16 has "
            "float32's range and needs none.",
        ):
            for step in range(steps):
                optimizer.zero_grad(set_to_none=True)
                loss = loss_of(model, low, step)
                scaler.scale(loss).backward()
                scaler.step(optimizer)  # optimizer.step(), unless the gradients overflowed
                scaler.update()
                losses.append(loss.item())
        result.extra[f"loss @{steps}"] = losses[-1]
        print(
            f"{name}: holds {harness.format_bytes(held)} after the forward, peak "
            f"{harness.format_bytes(result.peak_bytes)}, "
            f"{harness.format_seconds(result.seconds)} a step; loss {losses[0]:.5g} at the "
            f"first training step, {losses[-1]:.5g} at step {steps}"
        )
        results.append(result)
        harness.pause(options)
    return results


def conclusion(results: list[harness.PhaseResult], device: torch.device) -> str:
    """One sentence from the measured numbers, honest about speed."""
    full, low = results
    fmt = harness.format_bytes
    loss_key = next(key for key in full.extra if key.startswith("loss"))
    full_loss, low_loss = full.extra[loss_key], low.extra[loss_key]
    difference = abs(low_loss - full_loss) / abs(full_loss) * 100 if full_loss else 0.0
    clause = harness.comparison_clause(low, full, "float32")
    where = "this CPU" if device.type == "cpu" else "this GPU"
    if clause.endswith("slower") and device.type == "cpu":
        where += (
            " (on a CPU without AMX bfloat16 units, the casts to and from bfloat16 can cost "
            "more than the 16-bit math saves)"
        )
    return (
        f"{low.name} held {fmt(low.extra['activations'])} of activations against "
        f"{fmt(full.extra['activations'])} in float32 and {clause} on {where}; after "
        f"{loss_key.removeprefix('loss @')} training steps the loss differed by "
        f"{difference:.2g}% ({full_loss:.5g} against {low_loss:.5g})."
    )


def main() -> None:
    options = harness.begin(__doc__, "mixed precision")
    show_the_types(options.device, low_precision_dtype(options.device))
    harness.pause(options)
    results = compare(options)
    harness.print_results(
        f"mixed precision on {options.device}", results, conclusion(results, options.device)
    )
    harness.emit_json_results(results)


if __name__ == "__main__":
    main()
