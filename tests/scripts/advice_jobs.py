"""Small CPU training jobs with a common problem, and the same jobs with it fixed.

It knows nothing of torchtop. ``--case`` picks the job:

- ``input-bound``: batches made in the training thread (``num_workers=0``) from a Dataset that
  sleeps 10 ms an item; ``input-ok``: the same data from four workers that keep ahead.
- ``creep``: each step also sums a held-out loss with ``total_loss += loss`` under autograd,
  which keeps every step's graph and activations; ``creep-fixed``: ``loss.item()``.
- ``workers``: a healthy CPU job fed by two DataLoader workers from a dataset that takes 2 ms
  an item (its memory climbs while the workers start and the allocator warms up, then holds);
  ``workers-leak``: the same job keeping every step's held-out loss with its graph.
- ``eval-grad``: a validation pass between two epochs with autograd on; ``eval-nograd``: the
  same pass under ``torch.no_grad()``.
- ``threads``: ``torch.set_num_threads`` at four times the CPUs, beside two DataLoader workers
  that compute their items; ``threads-fixed``: one worker and the CPUs it leaves as threads.
- ``fp32-matmuls`` (CUDA): an MLP trained in float32; ``bf16-autocast``: the same under bf16
  autocast. ``--device cpu`` runs them where there is no GPU (the advice needs one).
- ``cow``: a dataset held as a list of Python dicts (about 300 MB) read by two forked workers:
  each read writes a reference count and copies its page into the worker; ``cow-numpy``: the
  same rows as one NumPy array, which stays shared.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Items(Dataset):
    """``n`` items that take ``delay`` seconds each to load."""

    def __init__(self, n: int, delay: float) -> None:
        self.n = n
        self.delay = delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay:
            time.sleep(self.delay)
        return torch.full((64,), float(i % 7)), torch.tensor(i % 3)


def input_job(workers: int) -> None:
    options = {"num_workers": workers}
    if workers:
        options.update(persistent_workers=True, prefetch_factor=4)
    loader = DataLoader(Items(4 * 60, 0.01), batch_size=4, **options)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        time.sleep(0.08)  # the "GPU" at work: 8x what four workers need per batch
        opt.step()


#: Creep is growth held for at least 10 s after the first 20 s of steps (the warm-up, when a
#: healthy job's memory climbs too): the creep jobs run 36 s.
CREEP_SECONDS = 36.0


def creep_job(fixed: bool, workers: int = 0) -> None:
    model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # Each step's graph kept alive holds about 2 MiB (256 x 1024 floats, twice): past the
    # advisor's 20 s warm-up the RSS must rise 64 MiB and 10% in ~15 s, even on a loaded machine.
    held_out = torch.randn(256, 64)
    if workers:
        # Batches from a dataset that takes 2 ms an item, made ahead by worker processes.
        options = {"num_workers": workers, "persistent_workers": True}
        batches = iter(DataLoader(Items(100_000, 0.002), batch_size=16, **options))
    else:
        x = torch.randn(256, 64)
        y = torch.randint(0, 3, (256,))
    total_loss: float | torch.Tensor = 0.0
    steps = 0
    end = time.monotonic() + CREEP_SECONDS
    while time.monotonic() < end:
        if workers:
            x, y = next(batches)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        loss = nn.functional.cross_entropy(model(held_out), y[:1].expand(256))
        if fixed:
            total_loss += loss.item()
        else:
            total_loss += loss  # keeps this step's graph alive
        steps += 1
        time.sleep(0.04)
    print(f"mean loss {float(total_loss) / steps:.4f}")


def eval_job(no_grad: bool) -> None:
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    train = DataLoader(Items(4 * 60, 0.0), batch_size=4)
    # 200 batches of 20 ms: 4 s of evaluation. The advisor reads a loader's counts about once a
    # second and takes its first report as a start, so it needs two readings inside one pass
    # with no training step between them; 2 s passes left that to chance on a loaded machine.
    held_out = DataLoader(Items(8 * 200, 0.0), batch_size=8)
    for _epoch in range(2):
        for x, y in train:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            time.sleep(0.01)
        with torch.no_grad() if no_grad else torch.enable_grad():
            for x, _y in held_out:
                model(x)
                time.sleep(0.02)


class Computed(Dataset):
    """Items that take about ``cpu_s`` of CPU each to make."""

    def __init__(self, cpu_s: float) -> None:
        self.cpu_s = cpu_s

    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = time.process_time() + self.cpu_s
        while time.process_time() < end:
            pass
        return torch.full((256,), float(i % 7)), torch.tensor(i % 3)


def threads_job(fixed: bool, seconds: float = 9.0) -> None:
    cpus = len(os.sched_getaffinity(0))
    workers = 1 if fixed else 2
    torch.set_num_threads(max(1, cpus - workers) if fixed else 4 * cpus)
    loader = DataLoader(Computed(0.0005), batch_size=4, num_workers=workers, prefetch_factor=8)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    end = time.monotonic() + seconds
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x.repeat(16, 1)), y.repeat(16)).backward()
        opt.step()
        time.sleep(0.08)  # the "GPU" at work: 8x what four workers need per batch
        if time.monotonic() > end:
            break


def matmul_job(autocast: bool, device: str, seconds: float = 8.0) -> None:
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(256, 1024, device=device)
    y = torch.randint(0, 10, (256,), device=device)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        opt.zero_grad()
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=autocast):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        time.sleep(0.01)


class Rows(Dataset):
    """Blocks of ``ROWS_PER_BLOCK`` rows, each row a dict (in a list) or one array row."""

    def __init__(self, rows: Any) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows) // ROWS_PER_BLOCK

    def __getitem__(self, i: int) -> torch.Tensor:
        block = self.rows[i * ROWS_PER_BLOCK : (i + 1) * ROWS_PER_BLOCK]
        if isinstance(block, list):
            return torch.tensor([(r["x"], float(r["y"])) for r in block])
        return torch.from_numpy(block.copy())


ROWS_PER_BLOCK = 1000


def cow_job(numpy: bool, blocks: int = 1200) -> None:
    """One epoch of ``blocks`` blocks, ~10 ms a step, from two forked workers."""
    n = blocks * ROWS_PER_BLOCK
    if numpy:
        import numpy as np

        rows: Any = np.stack([np.arange(n, dtype=np.float64), np.arange(n) % 7.0], axis=1)
    else:
        rows = [{"x": float(i), "y": i % 7, "name": f"row {i}"} for i in range(n)]
    loader = DataLoader(Rows(rows), batch_size=None, num_workers=2, shuffle=False)
    weight = torch.zeros(2, requires_grad=True)
    for block in loader:
        (block.float() @ weight).sum().backward()
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--case",
        required=True,
        choices=[
            "input-bound",
            "input-ok",
            "creep",
            "creep-fixed",
            "workers",
            "workers-leak",
            "eval-grad",
            "eval-nograd",
            "threads",
            "threads-fixed",
            "fp32-matmuls",
            "bf16-autocast",
            "cow",
            "cow-numpy",
        ],
    )
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    case = args.case
    torch.manual_seed(0)
    if case.startswith("input"):
        input_job(0 if case == "input-bound" else 4)
    elif case.startswith("creep"):
        creep_job(case == "creep-fixed")
    elif case.startswith("workers"):
        creep_job(case == "workers", workers=2)
    elif case.startswith("cow"):
        cow_job(case == "cow-numpy")
    elif case.startswith("threads"):
        threads_job(case == "threads-fixed")
    elif case in ("fp32-matmuls", "bf16-autocast"):
        matmul_job(case == "bf16-autocast", args.device)
    else:
        eval_job(case == "eval-nograd")
    print("done")


if __name__ == "__main__":
    main()
