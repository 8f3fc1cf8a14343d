"""Doubles its batch each step until it runs out of memory. Knows nothing of torchtop.

Under ``torchtop run --memory-limit 256MiB`` the emulated device fills up in a few steps.
"""

import argparse
import time

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--batch", type=int, default=4096)
parser.add_argument("--steps", type=int, default=6)  # at most 512 MiB of input
parser.add_argument("--sleep", type=float, default=0.1)
parser.add_argument("--eval", action="store_true", help="fail in an eval phase with grad on")
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)


def make_batch(n: int) -> torch.Tensor:
    return torch.randn(n, 1024)


def train_step(x: torch.Tensor) -> float:
    opt.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    return float(loss)


batch = args.batch
for step in range(args.steps):
    x = make_batch(batch)
    if args.eval:
        import torchtop

        with torchtop.phase("eval"):
            print(f"step {step} batch {batch} out {float(model(x).mean()):.4f}", flush=True)
    else:
        print(f"step {step} batch {batch} loss {train_step(x):.4f}", flush=True)
    batch *= 2
    time.sleep(args.sleep)
print("no OOM: all steps ran")
