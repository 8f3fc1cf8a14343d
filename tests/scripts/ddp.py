"""A tiny DDP job on CPU (gloo) that knows nothing of torchtop, for ``torchrun``.

Each rank trains ``--steps`` steps of a small linear model on batches from a DataLoader. With
``--pids DIR`` each rank and each DataLoader worker writes a file there named by its role and
pid (``rank-PID``, ``worker-PID``), holding the rank, so tests can tell which processes ran.
At the end each rank prints ``RESULT {"rank": R, "steps": N}``.

To make one rank misbehave: ``--slow-rank R --slow-ms MS --slow-in data|forward`` (rank R
sleeps MS more per step in its batch collation or its forward); ``--sleep-ms MS`` (every rank
sleeps MS in its forward: a step long enough that CPU noise is small beside it);
``--block-rank R --block-at N`` (rank R blocks forever before its Nth backward, whose
all-reduce the others then wait in). ``--say N``: each rank first writes N lines of its own to
stdout (``rank R says I``) and to stderr (``rank R warns I``).

Other launchers: ``--spawn N`` starts N ranks itself with ``torch.multiprocessing.spawn`` (the
PyTorch DDP tutorial's shape: each calls ``init_process_group("gloo", rank=, world_size=)``) and
only waits for them. ``--tasks slurm|mpi --world N`` starts N tasks with ``subprocess``, each
with the scheduler's variables naming its rank, as ``srun`` or ``mpirun`` would; a task trains
alone, with no process group (``--alone``), so that only those variables say which it is.
"""

import argparse
import functools
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset


def note(folder: str | None, role: str, rank: int, *_args: object) -> None:
    if folder:
        Path(folder, f"{role}-{os.getpid()}").write_text(str(rank))


class Slept(nn.Module):
    """A linear layer whose forward first sleeps ``ms`` milliseconds."""

    def __init__(self, ms: float) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 1)
        self.ms = ms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ms:
            time.sleep(self.ms / 1000)
        return self.linear(x)


def slow_collate(ms: float, batch: list) -> object:
    time.sleep(ms / 1000)
    return torch.utils.data.default_collate(batch)


#: What ``srun`` and ``mpirun`` set in each task, by rank and world size.
TASK_ENV = {
    "slurm": lambda r, n: {
        "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r), "SLURM_NTASKS": str(n),
        "SLURM_NODEID": "0", "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0",
    },
    "mpi": lambda r, n: {
        "OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_RANK": str(r),
        "OMPI_COMM_WORLD_SIZE": str(n),
    },
}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_tasks(kind: str, world: int) -> int:
    """Each task this script again, alone, with its rank in the scheduler's variables."""
    tasks = [
        subprocess.Popen(
            [sys.executable, __file__, *sys.argv[1:], "--alone"],
            env={**os.environ, **TASK_ENV[kind](r, world)},
        )
        for r in range(world)
    ]
    return max(task.wait() for task in tasks)


def task_rank() -> int:
    for name in ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spawn", type=int, default=0)
    parser.add_argument("--tasks", choices=sorted(TASK_ENV), default=None)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--alone", action="store_true")
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--start-method", default=None)
    parser.add_argument("--pids", default=None)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-ms", type=float, default=30.0)
    parser.add_argument("--slow-in", choices=("data", "forward"), default="data")
    parser.add_argument("--sleep-ms", type=float, default=0.0)
    parser.add_argument("--block-rank", type=int, default=-1)
    parser.add_argument("--block-at", type=int, default=5)
    parser.add_argument("--say", type=int, default=0)
    args = parser.parse_args()
    if args.alone:
        train(task_rank(), args, group=False)
    elif args.tasks:
        sys.exit(start_tasks(args.tasks, args.world))
    elif args.spawn:
        port = free_port()
        torch.multiprocessing.spawn(spawned, args=(args, args.spawn, port), nprocs=args.spawn)
    else:
        dist.init_process_group("gloo")
        train(dist.get_rank(), args)


def spawned(rank: int, args: argparse.Namespace, world: int, port: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    train(rank, args)


def train(rank: int, args: argparse.Namespace, group: bool = True) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    slow = rank == args.slow_rank
    note(args.pids, "rank", rank)
    for i in range(args.say):
        print(f"rank {rank} says {i}", flush=True)
        print(f"rank {rank} warns {i}", file=sys.stderr, flush=True)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(args.steps * 4, 8), torch.randn(args.steps * 4, 1))
    loader = DataLoader(
        data,
        batch_size=4,
        num_workers=args.workers,
        multiprocessing_context=args.start_method if args.workers else None,
        worker_init_fn=functools.partial(note, args.pids, "worker", rank) if args.workers else None,
        collate_fn=functools.partial(slow_collate, args.slow_ms)
        if slow and args.slow_in == "data"
        else None,
    )
    extra = args.slow_ms if slow and args.slow_in == "forward" else 0.0
    module = Slept(args.sleep_ms + extra)
    model = DistributedDataParallel(module) if group else module
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = 0
    for x, y in loader:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        if rank == args.block_rank and steps == args.block_at:
            threading.Event().wait()  # BLOCKS HERE: the others wait in the all-reduce below
        loss.backward()
        optimizer.step()
        steps += 1
    if rank == args.fail_rank:
        sys.exit(f"rank {rank} fails on purpose")
    if group:
        dist.barrier()
    print("RESULT " + json.dumps({"rank": rank, "steps": steps}), flush=True)
    if group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
