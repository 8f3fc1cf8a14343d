"""A CPU training script for the op-timing tests. It knows nothing of torchtop.

``--item`` reads the loss with ``.item()`` once per step (one host sync per step).
``--own-profiler-at K --own-profiler-steps P`` profiles steps K..K+P-1 with the script's own
``torch.profiler.profile()`` and prints what it recorded as ``OWN_PROFILE {json}``: a complete
profile has exactly P optimizer steps and 2·P ``aten::addmm`` (two Linear layers).
``--no-optimizer`` runs forward passes only (``--backward``: and backward), with no step hook
to align windows to.
"""

import argparse
import json
import time

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--seconds", type=float, default=0.0, help="run at least this long")
parser.add_argument("--item", action="store_true")
parser.add_argument("--own-profiler-at", type=int, default=-1)
parser.add_argument("--own-profiler-steps", type=int, default=5)
parser.add_argument("--no-optimizer", action="store_true")
parser.add_argument("--backward", action="store_true", help="with --no-optimizer: backward too")
parser.add_argument("--sleep", type=float, default=0.0)
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(32, 128)
y = torch.randint(0, 10, (32,))


def train_step() -> torch.Tensor:
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


own = None
start = time.monotonic()
step = 0
while step < args.steps or time.monotonic() - start < args.seconds:
    if args.no_optimizer:
        if args.backward:
            model.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
        else:
            with torch.no_grad():
                model(x).sum()
    else:
        if step == args.own_profiler_at:
            own = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            own.__enter__()
        loss = train_step()
        if args.item:
            loss.item()
        if own is not None and step == args.own_profiler_at + args.own_profiler_steps - 1:
            own.__exit__(None, None, None)
            names = [e.name for e in own.events()]
            result = {
                "optimizer_steps": sum(1 for n in names if n.startswith("Optimizer.step#")),
                "addmm": names.count("aten::addmm"),
                "events": len(names),
            }
            print("OWN_PROFILE " + json.dumps(result), flush=True)
            own = None
    if args.sleep:
        time.sleep(args.sleep)
    step += 1
print(f"done {step} steps", flush=True)
