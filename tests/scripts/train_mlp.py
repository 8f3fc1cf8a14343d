"""A small CPU training script used by the integration tests. It knows nothing of torchtop."""

import argparse
import sys

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--exit-code", type=int, default=0)
parser.add_argument("--raise-at", type=int, default=-1)
parser.add_argument("--sleep", type=float, default=0.0)
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(64, 256)
y = torch.randint(0, 10, (64,))
for step in range(args.steps):
    if step == args.raise_at:
        raise RuntimeError(f"boom at step {step}")
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    if step % 10 == 0:
        print(f"step {step} loss {loss.item():.4f}", flush=True)
    if args.sleep:
        import time

        time.sleep(args.sleep)
print("training done", file=sys.stderr)
sys.exit(args.exit_code)
