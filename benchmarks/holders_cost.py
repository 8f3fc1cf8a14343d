"""What reading "what holds the memory" costs the training thread, measured on the hook itself.

The reads happen in the agent's optimizer step pre-hook (it calls ``holders.step_seen``), in
the training thread (the agent's threads never touch the job's tensors: see
``torchtop.agent.holders``). This measures, by timing each call of
``holders.optimizer_pre_hook`` (the same reads, as a step pre-hook of their own) as torch makes
it:

- the MLP of ``benchmarks.agent_overhead`` with Adam: the hook's total time over the run's
  wall time (the share of the training thread it took), its cost per step when no read is due,
  and what one read takes;
- 10,000 parameter tensors under Adam: what one read takes, the spacing the budget gives it,
  and what the sampler's merge of that read takes (in the sampler thread, numbers only);
- the activation measurement an op window makes over its first step (module and saved-tensor
  hooks, put in and taken out): the MLP's step with it against without, alternating, medians.

    python -m benchmarks.holders_cost            # about 30 seconds
    python -m benchmarks.holders_cost --quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from benchmarks.agent_overhead import mlp
from torchtop.agent import holders


def timed_hook(spent: list[tuple[float, bool]]) -> object:
    """The holders' pre-hook, timed call by call, with whether the call read."""

    def hook(optimizer: object, args: object, kwargs: object) -> None:
        version = holders._VERSION[0]
        began = time.perf_counter()
        holders.optimizer_pre_hook(optimizer, args, kwargs)
        spent.append((time.perf_counter() - began, holders._VERSION[0] != version))

    return hook


def mlp_share(seconds: float) -> dict[str, float]:
    holders.forget_all()
    model, x, y = mlp()
    optimizer = torch.optim.Adam(model.parameters())
    spent: list[tuple[float, bool]] = []
    optimizer.register_step_pre_hook(timed_hook(spent))  # type: ignore[arg-type]
    began = time.perf_counter()
    steps = 0
    while time.perf_counter() - began < seconds:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        steps += 1
    wall = time.perf_counter() - began
    reads = [s for s, read in spent if read]
    idle = [s for s, read in spent if not read]
    holders.forget_all()
    return {
        "steps": steps,
        "step_ms": 1e3 * wall / steps,
        "hook_share_pct": 100 * sum(s for s, _ in spent) / wall,
        "reads": len(reads),
        "read_us": 1e6 * statistics.median(reads) if reads else 0.0,
        "idle_call_us": 1e6 * statistics.median(idle) if idle else 0.0,
    }


def many_tensors(count: int) -> dict[str, float]:
    holders.forget_all()
    params = [nn.Parameter(torch.zeros(4)) for _ in range(count)]
    optimizer = torch.optim.Adam(params)
    optimizer.register_step_pre_hook(holders.optimizer_pre_hook)
    for _ in range(2):  # the second step's hook reads the state the first made
        optimizer.zero_grad()
        sum(p.sum() for p in params).backward()
        optimizer.step()
    noted = holders._NOTED[optimizer]
    read = noted.read
    assert read is not None and read.devices["cpu"].optimizer_state > 0
    reader = holders.HolderReader(interval_s=0.0)
    merges = []
    for _ in range(5):
        holders._VERSION[0] += 1  # as if a step read again
        began = time.perf_counter()
        reader.read()
        merges.append(time.perf_counter() - began)
    spacing = holders.next_read_at(0.0, noted.cost_s, holders.READ_INTERVAL_S, holders.READ_BUDGET)
    holders.forget_all()
    return {
        "tensors": len(read.pointers),
        "read_ms": 1e3 * noted.cost_s,
        "spacing_s": spacing,
        "share_pct": 100 * noted.cost_s / spacing,
        "merge_ms": 1e3 * statistics.median(merges),
    }


def activation_step(rounds: int) -> dict[str, float]:
    from torchtop.agent.activations import ActivationWindow

    model, x, y = mlp()
    optimizer = torch.optim.Adam(model.parameters())

    def step() -> None:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    plain, measured = [], []
    for _ in range(rounds):
        began = time.perf_counter()
        step()
        plain.append(time.perf_counter() - began)
        began = time.perf_counter()
        window = ActivationWindow()
        window.begin()
        step()
        window.end()
        measured.append(time.perf_counter() - began)
    p, m = statistics.median(plain), statistics.median(measured)
    return {"step_ms": 1e3 * p, "with_hooks_ms": 1e3 * m, "extra_ms": 1e3 * (m - p)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    result = {
        "load": float(load),
        "mlp_adam": mlp_share(5.0 if args.quick else 30.0),
        "ten_thousand_adam": many_tensors(10_000),
        "activation_step": activation_step(20 if args.quick else 200),
    }
    if args.json:
        print(json.dumps(result))
        return
    m, t, a = result["mlp_adam"], result["ten_thousand_adam"], result["activation_step"]
    print(f"load average {result['load']}")
    print(
        f"MLP + Adam: {m['steps']} steps of {m['step_ms']:.1f} ms; the hook took "
        f"{m['hook_share_pct']:.4f}% of the time: {m['reads']} reads of "
        f"{m['read_us']:.0f} us, {m['idle_call_us']:.2f} us a step otherwise"
    )
    print(
        f"10,000 tensors + Adam ({t['tensors']} storages): a read takes {t['read_ms']:.0f} ms, "
        f"so one every {t['spacing_s']:.0f} s ({t['share_pct']:.2f}%); the sampler's merge "
        f"{t['merge_ms']:.1f} ms"
    )
    print(
        f"activations by module, one MLP step: {a['with_hooks_ms']:.2f} ms against "
        f"{a['step_ms']:.2f} ms ({a['extra_ms']:+.2f} ms, once per op window)"
    )


if __name__ == "__main__":
    main()
