"""A training loop that times itself: its own steps and its own blocking on ``next()``.

It knows nothing of torchtop. Its Dataset sleeps in ``__getitem__``, so the loop waits for data
when the workers cannot keep up. At the end it prints one JSON line (``RESULT {...}``) with its
own step count, skipped steps and wait fraction, measured the way torchtop defines them:

- a step ends when ``optimizer.step()`` (or ``scaler.step()``) returns, and lasts from the end
  of the previous one, so the first step has no duration;
- the wait is the time blocked in ``next()`` on any loader, except each iterator's first batch
  (worker start-up), between the first step's end and the last step's end.
"""

import argparse
import json
import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class SleepySet(Dataset):
    """Items that take ``delay`` seconds each to load."""

    def __init__(self, n: int, delay: float) -> None:
        self.n = n
        self.delay = delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay)
        return torch.full((16,), float(i % 7)), torch.tensor(i % 3)


class ValSet(SleepySet):
    pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--start-method", default=None)
    parser.add_argument("--val-start-method", default=None, help="default: --start-method")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batches", type=int, default=24, help="training batches per epoch")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--item-sleep", type=float, default=0.002)
    parser.add_argument("--compute-sleep", type=float, default=0.004)
    parser.add_argument("--scaler", action="store_true", help="step through a GradScaler")
    parser.add_argument(
        "--skip-every", type=int, default=0, help="with --scaler: inf grads every N"
    )
    parser.add_argument("--val", action="store_true", help="a validation loader after each epoch")
    parser.add_argument("--persistent", action="store_true")
    args = parser.parse_args()

    def loader(dataset: Dataset, batch_size: int, start_method: str | None) -> DataLoader:
        options: dict = {"batch_size": batch_size, "num_workers": args.workers}
        if args.workers:
            options["multiprocessing_context"] = start_method
            options["persistent_workers"] = args.persistent
            options["prefetch_factor"] = 2
        return DataLoader(dataset, **options)

    torch.manual_seed(0)
    train = loader(
        SleepySet(args.batches * args.batch_size, args.item_sleep),
        args.batch_size,
        args.start_method,
    )
    val = loader(
        ValSet(4 * 2 * args.batch_size, args.item_sleep),
        2 * args.batch_size,
        args.val_start_method or args.start_method,
    )
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4) if args.scaler else None

    steps = 0
    skipped = 0
    step_ends: list[float] = []
    waits: list[tuple[float, float]] = []  # (end of the wait, seconds), first batches excluded
    worker_pids: set[int] = set()
    iterators: dict[int, object] = {}

    def timed_batches(dl: DataLoader):
        """Iterate ``dl``, timing each ``next()``: the training thread's own view of its waits.

        The first batch of a new iterator (worker start-up) is not a wait; an iterator that
        persistent workers reuse for the next epoch starts no workers."""
        it = iter(dl)
        first = iterators.get(id(dl)) is not it
        iterators[id(dl)] = it
        while True:
            began = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                ended = time.perf_counter()
                waits.append((ended, ended - began))
                worker_pids.update(w.pid for w in getattr(it, "_workers", []))
                return
            ended = time.perf_counter()
            if not first:
                waits.append((ended, ended - began))
            first = False
            yield batch

    for _epoch in range(args.epochs):
        for x, y in timed_batches(train):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            time.sleep(args.compute_sleep)  # the "GPU" at work
            if scaler is not None:
                scaler.scale(loss).backward()
                if args.skip_every and steps % args.skip_every == args.skip_every - 1:
                    model[0].weight.grad[0, 0] = float("inf")
                scale_before = scaler.get_scale()
                scaler.step(opt)
                scaler.update()
                if scaler.get_scale() < scale_before:
                    skipped += 1
            else:
                loss.backward()
                opt.step()
            step_ends.append(time.perf_counter())
            steps += 1
        if args.val:
            with torch.no_grad():
                for x, _y in timed_batches(val):
                    model(x)

    first_end, last_end = step_ends[0], step_ends[-1]
    wait = sum(s for end, s in waits if first_end < end <= last_end)
    result = {
        "steps": steps,
        "skipped": skipped,
        "wait_fraction": wait / (last_end - first_end),
        "wait_s": wait,
        "worker_pids": sorted(worker_pids),
        "pid": os.getpid(),
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":  # spawned workers import this file
    main()
