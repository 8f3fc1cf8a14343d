"""Runs out of memory with one holder dominating. Knows nothing of torchtop.

``--kind adam``: a wide MLP whose Adam state (two moments per parameter) fills the memory in
the first step; ``--kind activations``: a narrow MLP fed a batch whose activations fill it.
Meant for ``torchtop run --memory-limit 280MiB``: the update after the state is made needs
temporaries the size of a weight, over the limit.
"""

import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--kind", choices=("adam", "activations"), default="adam")
args = parser.parse_args()

torch.manual_seed(0)
if args.kind == "adam":
    # 4 x 2048 x 2048 float32: 64 MiB of parameters, 64 of gradients, 128 of Adam state.
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)])
    opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters())
    batches = [8, 8]
else:
    # 4 MiB of parameters; 16384 x 1024 float32 activations are 64 MiB each.
    model = nn.Sequential(
        nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [8, 16384]

for step, batch in enumerate(batches):
    x = torch.randn(batch, model[0].in_features)
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    opt.step()
    print(f"step {step} batch {batch}", flush=True)
print("no OOM", flush=True)
