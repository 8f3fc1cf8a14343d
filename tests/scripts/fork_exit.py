"""Trains a few seconds, then forks a child that ends with ``sys.exit(CODE)`` (not ``os._exit``,
as multiprocessing would) and waits for it, at most 30 s. Knows nothing of torchtop.

Prints ``RESULT {"child": "exited", "code": N}``, or ``"hung"`` (the child is then killed).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--train-s", type=float, default=2.0)
parser.add_argument("--code", type=int, default=5)
args = parser.parse_args()

model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(32, 64)
end = time.monotonic() + args.train_s
while time.monotonic() < end:
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    time.sleep(0.005)

pid = os.fork()
if pid == 0:
    print("child: done", flush=True)
    sys.exit(args.code)

deadline = time.monotonic() + 30
result: dict[str, object] = {"child": "hung"}
while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        result = {"child": "exited", "code": os.waitstatus_to_exitcode(status)}
        break
    time.sleep(0.05)
else:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
print("RESULT " + json.dumps(result), flush=True)
