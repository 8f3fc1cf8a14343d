"""Trains in two stages, each with its own optimizer (a head first with SGD, then the whole
model with SGD and momentum), and prints how many steps it took: ``RESULT {"steps": N}``.
Knows nothing of torchtop."""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--stage1", type=int, default=50)
parser.add_argument("--stage2", type=int, default=200)
parser.add_argument("--sleep", type=float, default=0.01)
args = parser.parse_args()

body, head = nn.Linear(32, 32), nn.Linear(32, 4)
model = nn.Sequential(body, nn.ReLU(), head)
stages = [
    (torch.optim.SGD(head.parameters(), lr=0.01), args.stage1),
    (torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9), args.stage2),
]
x, y = torch.randn(16, 32), torch.randn(16, 4)
steps = 0
for opt, count in stages:
    for _ in range(count):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        steps += 1
        time.sleep(args.sleep)
print("RESULT " + json.dumps({"steps": steps}), flush=True)
