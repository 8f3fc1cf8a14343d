"""A job that starts the agent itself with one line, then trains until told to stop."""

import sys
import time

import torch

import torchtop

torchtop.start()
print("agent started", flush=True)
with torchtop.phase("work"):
    x = torch.zeros(1 << 20)
    end = time.time() + float(sys.argv[1])
    while time.time() < end:
        x.add_(1)
        time.sleep(0.01)
print("done", flush=True)
