"""A training job that knows nothing of torchtop, for ``torchtop attach PID`` to find running.

It trains until ``--stop-file`` appears (or ``--seconds`` pass), optionally from a DataLoader
with workers in short epochs (a new iterator each epoch). Its output is the same however long
it runs: one line when the first step is done, one at the end; then it exits with
``--exit-code``. With ``--times FILE`` it writes the end time and duration of each of its own
steps (JSON), so a benchmark can compare its step time before and after attaches.
"""

import argparse
import json
import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Items(Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((128,), float(i % 5)), torch.tensor(i % 10)


def batches(args: argparse.Namespace):
    if args.workers:
        loader = DataLoader(Items(), batch_size=8, num_workers=args.workers)
        while True:
            yield from loader  # a new iterator (and new workers) each short epoch
    x = torch.randn(64, 128)
    y = torch.randint(0, 10, (64,))
    while True:
        yield x, y


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stop-file", default=None)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--exit-code", type=int, default=0)
    parser.add_argument("--sleep", type=float, default=0.01)
    parser.add_argument("--times", default=None)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--threads", type=int, default=0, help="torch's threads (0: its own)")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    deadline = time.monotonic() + args.seconds
    times = []
    last = time.perf_counter()
    for step, (x, y) in enumerate(batches(args)):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        now = time.perf_counter()
        times.append((time.time(), now - last))
        last = now
        if step == 0:
            print("first step done", flush=True)
        if args.sleep:
            time.sleep(args.sleep)
        if time.monotonic() > deadline or (args.stop_file and os.path.exists(args.stop_file)):
            break
    if args.times:
        with open(args.times, "w") as f:
            json.dump(times, f)
    print("training done", flush=True)
    print("stderr is the job's own", file=sys.stderr, flush=True)
    return args.exit_code


if __name__ == "__main__":
    sys.exit(main())
