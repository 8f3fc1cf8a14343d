"""The cost of ``torchtop run --memory-limit``: the tensor tracker with allocation sites.

One process trains each model through alternating blocks of about a second: plain (no
dispatch mode), under the bare :class:`TensorTracker` (exact live bytes, no sites), and under
:class:`MemoryLimitTracker` with its limit out of reach (sites and history recorded, the limit
checked on every new storage). Alternating short blocks spreads machine noise over all arms.
It reports median step times and their ratios to plain, and checks on the way that the tracker's
live bytes come back to where they started after every step (nothing leaks in the count).

    python -m benchmarks.tracker_overhead            # about a minute
    python -m benchmarks.tracker_overhead --quick    # a smoke run

The CUDA side, ``torch.cuda.memory._record_memory_history(stacks="python", context="alloc")``,
needs a GPU to measure; see the README for the bound PyTorch documents.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from benchmarks.agent_overhead import mlp, tiny_ops
from torchtop.agent.memory_limit import MemoryLimitTracker
from torchtop.agent.tensor_tracker import TensorTracker


def conv() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )
    return model, torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))


MODELS: dict[str, Callable[[], tuple[nn.Module, torch.Tensor, torch.Tensor]]] = {
    "MLP (3 layers, batch 128)": mlp,
    "conv net (2 conv, 32x32, batch 32)": conv,
    "97 tiny ops (16-wide, batch 8)": tiny_ops,
}
ARMS = ("plain", "tracker", "tracker + sites + limit")


def _arm(name: str) -> contextlib.AbstractContextManager[object]:
    if name == "plain":
        return contextlib.nullcontext()
    if name == "tracker":
        return TensorTracker()
    return MemoryLimitTracker(limit_bytes=1 << 50, on_oom=None, trace_entries=10_000)


def measure(
    build: Callable[[], tuple[nn.Module, torch.Tensor, torch.Tensor]],
    seconds: float,
    block_s: float,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Step times per arm, and the median of each block (for ratios of neighbouring blocks)."""
    torch.manual_seed(0)
    model, x, y = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    blocks: dict[str, list[float]] = {arm: [] for arm in ARMS}
    leaks: dict[str, int] = {}
    for arm in ARMS:  # warm up each arm once
        with _arm(arm):
            for _ in range(3):
                step()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for arm in ARMS:
            block: list[float] = []
            with _arm(arm) as tracker:
                end = time.monotonic() + block_s
                while time.monotonic() < end:
                    start = time.perf_counter()
                    step()
                    block.append(time.perf_counter() - start)
                opt.zero_grad(set_to_none=True)
                if isinstance(tracker, TensorTracker):
                    # Everything the block made is gone again: the count is exact, no leak.
                    leaks[arm] = max(leaks.get(arm, 0), tracker.live_bytes)
            times[arm].extend(block)
            blocks[arm].append(statistics.median(block))
    if any(leaks.values()):
        raise AssertionError(f"live bytes left after the steps: {leaks}")
    return times, blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (default 1: steadier)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    seconds, block_s = (3.0, 0.3) if args.quick else (18.0, 1.0)
    result = []
    print(f"{'model':36} {'plain':>9} {'tracker':>17} {'+ sites + limit':>17}")
    for name, build in MODELS.items():
        times, blocks = measure(build, seconds, block_s)
        medians = {arm: statistics.median(t) for arm, t in times.items()}
        # The ratio of each block to the plain block next to it, then the median of those:
        # a machine that slows down for a while slows both sides of a pair.
        paired = {
            arm: statistics.median(
                a / p for a, p in zip(blocks[arm], blocks["plain"], strict=False)
            )
            for arm in ARMS
        }
        plain = medians["plain"]
        print(
            f"{name:36} {plain * 1e3:7.2f}ms"
            f" {medians['tracker'] * 1e3:8.2f}ms {paired['tracker']:6.2f}x"
            f" {medians[ARMS[2]] * 1e3:8.2f}ms {paired[ARMS[2]]:6.2f}x"
        )
        result.append(
            {
                "model": name,
                "plain_ms": plain * 1e3,
                "tracker_ms": medians["tracker"] * 1e3,
                "tracker_ratio": paired["tracker"],
                "limit_ms": medians[ARMS[2]] * 1e3,
                "limit_ratio": paired[ARMS[2]],
                "blocks": len(blocks["plain"]),
            }
        )
    print("ratios: each block against the plain block beside it, median over the blocks")
    print("BENCH " + json.dumps(result))


if __name__ == "__main__":
    main()
