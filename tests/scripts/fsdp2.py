"""A tiny FSDP2 job (``fully_shard``) on CPU with gloo, its 2 ranks started by
``torch.multiprocessing.spawn``; knows nothing of torchtop. Each rank prints
``RESULT {"rank": R, "steps": N}``."""

import json
import socket
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard


def worker(rank: int, world: int, port: int, steps: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        x, y = torch.randn(16, 64), torch.randn(16, 1)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    print("RESULT " + json.dumps({"rank": rank, "steps": steps}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    torch.multiprocessing.spawn(worker, args=(2, port, steps), nprocs=2)
