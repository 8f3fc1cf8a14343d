"""What the step and DataLoader hooks cost the training thread, per call, in microseconds.

Two views, each the median of many alternating rounds:

- the hooks alone: the optimizer pre/post hooks as torch calls them, the ``__next__``
  wrapper around a ``__next__`` that returns a ready batch, and the ``torch.autograd.backward``
  wrapper around a function that returns at once (each wrapper's cost over the bare call):
  what the training thread pays, and nothing else;
- end to end: ``optimizer.step()`` of a one-parameter SGD, ``next()`` on an in-memory
  DataLoader, and ``loss.backward()`` of a one-parameter loss, with the hooks installed
  against without them (the difference per call).

The events the hooks leave are drained between rounds, outside the timing, as the agent's
sampler thread does.

    python -m benchmarks.hook_cost            # about 30 seconds
    python -m benchmarks.hook_cost --quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from torch.utils.data import DataLoader, Dataset

from torchtop.agent import holders
from torchtop.agent import steps as step_hooks
from torchtop.agent.loaders import wrap_next
from torchtop.agent.steps import PENDING
from torchtop.agent.training import TrainingMonitor


def per_call_us(fn: Callable[[], None], calls: int) -> float:
    """Microseconds per call of ``fn`` over ``calls`` calls (the loop's own cost included)."""
    began = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - began) / calls * 1e6


def paired(
    with_: Callable[[], None], without: Callable[[], None], calls: int, rounds: int
) -> dict[str, float]:
    """Alternate rounds of the two; the median per-call times and their median difference."""
    on: list[float] = []
    off: list[float] = []
    for _ in range(rounds):
        off.append(per_call_us(without, calls))
        on.append(per_call_us(with_, calls))
        PENDING.clear()
    diffs = [a - b for a, b in zip(on, off, strict=True)]
    return {
        "with_us": statistics.median(on),
        "without_us": statistics.median(off),
        "cost_us": statistics.median(diffs),
    }


class Ready(Dataset):
    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.zeros(1)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rounds = 5 if args.quick else 41
    calls = 20_000

    results: dict[str, dict[str, float]] = {}
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    call_args: tuple[object, ...] = ()
    call_kwargs: dict[str, object] = {}

    def hooks() -> None:
        step_hooks.optimizer_pre_hook(opt, call_args, call_kwargs)
        step_hooks.optimizer_post_hook(opt, call_args, call_kwargs)

    # The pre hook calls the holders' read as the agent installs it (not due, once a second).
    step_hooks.BEFORE_STEP[0] = holders.step_seen
    try:
        results["optimizer hooks (pre + post)"] = paired(hooks, lambda: None, calls, rounds)
    finally:
        step_hooks.BEFORE_STEP[0] = None
        holders.forget_all()

    batch = (torch.zeros(8, 4), torch.zeros(8))

    class Iterator:
        def __next__(self) -> object:
            return batch

    it = Iterator()
    bare = Iterator.__next__
    wrapped = wrap_next(bare)
    results["__next__ wrapper"] = paired(lambda: wrapped(it), lambda: bare(it), calls, rounds)

    def returns() -> None:
        return None

    backward = step_hooks.wrap_backward(returns)
    results["backward wrapper"] = paired(backward, returns, calls, rounds)

    # End to end, with the real classes patched and unpatched.
    monitor = TrainingMonitor()
    monitor.start()
    loader_it = iter(DataLoader(Ready(), batch_size=None))
    end_to_end: dict[str, list[float]] = {
        "step_on": [],
        "step_off": [],
        "next_on": [],
        "next_off": [],
        "backward_on": [],
        "backward_off": [],
    }
    weight = torch.nn.Parameter(torch.ones(1))

    def loss_backward() -> None:
        (weight * 2.0).sum().backward()

    for _ in range(rounds):
        monitor.remove()
        end_to_end["step_off"].append(per_call_us(opt.step, calls // 4))
        end_to_end["next_off"].append(per_call_us(lambda: next(loader_it), calls // 4))
        end_to_end["backward_off"].append(per_call_us(loss_backward, calls // 4))
        monitor.reinstall()
        end_to_end["step_on"].append(per_call_us(opt.step, calls // 4))
        end_to_end["next_on"].append(per_call_us(lambda: next(loader_it), calls // 4))
        end_to_end["backward_on"].append(per_call_us(loss_backward, calls // 4))
        monitor.drain()
        monitor.steps.take_records()
    monitor.stop(0.0)
    for name, key in (
        ("optimizer.step() end to end", "step"),
        ("next(DataLoader) end to end", "next"),
        ("loss.backward() end to end", "backward"),
    ):
        on, off = end_to_end[f"{key}_on"], end_to_end[f"{key}_off"]
        results[name] = {
            "with_us": statistics.median(on),
            "without_us": statistics.median(off),
            "cost_us": statistics.median([a - b for a, b in zip(on, off, strict=True)]),
        }

    for name, r in results.items():
        print(
            f"{name:32s} {r['cost_us']:6.2f} µs per call"
            f"  ({r['with_us']:.2f} with, {r['without_us']:.2f} without)",
            flush=True,
        )
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
