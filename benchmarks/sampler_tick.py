"""Where the sampler's time goes, per tick: the CPU time of each part of one tick.

A job trains a tiny model in its main thread while this script's probe-timing sampler runs
at the agent's default settings; each part of the tick (the host probe, the CPU heap probe, the
CUDA probe, NVML, the training monitor's tick, encoding and publishing) is timed with
``time.thread_time`` in the sampler thread, and the means per tick are printed.

    python -m benchmarks.sampler_tick [--seconds 10]
"""

from __future__ import annotations

import argparse
import collections
import threading
import time
from typing import Any

import torch
from torch import nn

from torchtop.agent import core
from torchtop.agent import sampler as sampler_module
from torchtop.protocol import encode


def _time_method(owner: Any, attr: str, label: str, spent: Any, calls: Any, agent: Any) -> None:
    original = getattr(owner, attr)

    def timed(*a: Any, **k: Any) -> Any:
        if threading.current_thread() is not agent.sampler._thread:
            return original(*a, **k)
        t0 = time.thread_time()
        try:
            return original(*a, **k)
        finally:
            spent[label] += time.thread_time() - t0
            calls[label] += 1

    setattr(owner, attr, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--no-ops", action="store_true", help="no op-timing windows")
    args = parser.parse_args()
    torch.set_num_threads(1)
    spent: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.defaultdict(int)

    original_call = sampler_module._Guarded.call

    def timed_call(self: Any, fn: Any, *a: Any) -> Any:
        t0 = time.thread_time()
        try:
            return original_call(self, fn, *a)
        finally:
            spent[self.name] += time.thread_time() - t0
            calls[self.name] += 1

    sampler_module._Guarded.call = timed_call  # type: ignore[method-assign]
    agent = core.start(ops=not args.no_ops)
    original_publish = agent.sampler._publish

    def timed_publish(message: Any) -> None:
        if threading.current_thread() is not agent.sampler._thread:
            original_publish(message)
            return
        t0 = time.thread_time()
        encode(message)
        t1 = time.thread_time()
        original_publish(message)
        t2 = time.thread_time()
        spent["encode (once more, alone)"] += t1 - t0
        spent["publish (encode + ring)"] += t2 - t1
        calls["publish (encode + ring)"] += 1

    agent.sampler._publish = timed_publish
    agent.sampler.tick_cpu = 0.0
    original_tick = agent.sampler.tick

    def timed_tick() -> None:
        t0 = time.thread_time()
        original_tick()
        spent["whole tick"] += time.thread_time() - t0
        calls["whole tick"] += 1

    agent.sampler.tick = timed_tick  # type: ignore[method-assign]
    training = agent.training
    parts: list[tuple[Any, str, str]] = [
        (training, "drain", "training: drain hooks"),
        (training, "try_install", "training: try_install"),
        (training.steps, "frame", "training: steps frame"),
        (training.loaders, "frame", "training: loaders frame"),
    ]
    if training.stall is not None:
        parts.append((training.stall, "check", "training: stall check"))
    if agent.ops is not None:
        parts.append((agent.ops, "tick", "training: op windows"))
    for owner, attr, label in parts:
        _time_method(owner, attr, label, spent, calls, agent)
    layers: list[nn.Module] = []
    for _ in range(48):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, 16)
    end = time.monotonic() + args.seconds
    steps = 0
    while time.monotonic() < end:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        steps += 1
    core.stop()
    ticks = max(1, calls["whole tick"])
    print(f"{ticks} ticks, {steps} steps in {args.seconds:.0f} s")
    for name, total in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {name:28s} {total / ticks * 1e6:8.1f} us/tick  ({calls[name]} calls)")


if __name__ == "__main__":
    main()
