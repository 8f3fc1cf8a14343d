"""The cost of the allocator history torchtop records on CUDA (needs a GPU; says so without).

The agent calls ``torch.cuda.memory._record_memory_history(enabled="all", context="alloc",
stacks="python", max_entries=10000)`` when the job initializes CUDA, and never switches it off
(``enabled=None`` would leave the allocator's hooks behind). So the two arms run in separate
processes, alternated three times: plain, and with that exact call before the first allocation.
Each trains a model of many small layers (where per-allocation costs show most) and a larger
MLP, and reports median step times and their ratio.

    python -m benchmarks.cuda_history_overhead
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time


def child(arm: str, model_name: str) -> None:
    import torch
    from torch import nn

    torch.cuda.init()
    if arm == "history":
        torch.cuda.memory._record_memory_history(
            enabled="all", context="alloc", stacks="python", max_entries=10_000
        )
    if model_name == "small layers":
        layers: list[nn.Module] = []
        for _ in range(48):
            layers += [nn.Linear(256, 256), nn.GELU()]
        model = nn.Sequential(*layers).cuda()
        x = torch.randn(64, 256, device="cuda")
    else:
        model = nn.Sequential(
            nn.Linear(4096, 8192), nn.GELU(), nn.Linear(8192, 8192), nn.GELU(), nn.Linear(8192, 16)
        ).cuda()
        x = torch.randn(512, 4096, device="cuda")
    opt = torch.optim.AdamW(model.parameters())
    times = []
    for i in range(260):
        torch.cuda.synchronize()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
        torch.cuda.synchronize()
        if i >= 60:
            times.append(time.perf_counter() - start)
    print(json.dumps({"median_s": statistics.median(times)}))


def main() -> None:
    if len(sys.argv) == 3:
        child(sys.argv[1], sys.argv[2])
        return
    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU here: nothing to measure (the README gives PyTorch's documented bound)")
        return
    for model_name in ("small layers", "large MLP"):
        results: dict[str, list[float]] = {"plain": [], "history": []}
        for _ in range(3):
            for arm in results:
                out = subprocess.run(
                    [sys.executable, "-m", "benchmarks.cuda_history_overhead", arm, model_name],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                results[arm].append(json.loads(out.stdout.splitlines()[-1])["median_s"])
        plain = statistics.median(results["plain"])
        history = statistics.median(results["history"])
        print(
            f"{model_name:14} plain {plain * 1e3:8.3f} ms   history {history * 1e3:8.3f} ms"
            f"   ratio {history / plain:.3f}"
        )


if __name__ == "__main__":
    main()
