"""A tiny DDP job on CPU (gloo) that knows nothing of torchtop, for ``torchrun``.

Each rank trains ``--steps`` steps of a small linear model on batches from a DataLoader. With
``--pids DIR`` each rank and each DataLoader worker writes a file there named by its role and
pid (``rank-PID``, ``worker-PID``), holding the rank, so tests can tell which processes ran.
At the end each rank prints ``RESULT {"rank": R, "steps": N}``.
"""

import argparse
import functools
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset


def note(folder: str | None, role: str, rank: int, *_args: object) -> None:
    if folder:
        Path(folder, f"{role}-{os.getpid()}").write_text(str(rank))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--start-method", default=None)
    parser.add_argument("--pids", default=None)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    note(args.pids, "rank", rank)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(args.steps * 4, 8), torch.randn(args.steps * 4, 1))
    loader = DataLoader(
        data,
        batch_size=4,
        num_workers=args.workers,
        multiprocessing_context=args.start_method if args.workers else None,
        worker_init_fn=functools.partial(note, args.pids, "worker", rank) if args.workers else None,
    )
    model = DistributedDataParallel(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = 0
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        steps += 1
    dist.barrier()
    print("RESULT " + json.dumps({"rank": rank, "steps": steps}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
