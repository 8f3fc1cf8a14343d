"""A training thread and a second thread reading what holds the memory, as hard as possible.

``--way sampler-reads``: the second thread walks the optimizer itself (parameters, ``.grad``,
state), as the agent's sampler thread once did. ``--way agent``: the agent's way, the step
pre-hook reads in the training thread (here at every step) and the second thread only merges
(``HolderReader``) and takes the capture's split (``read_now``). ``--tracker`` runs the job under
the tensor tracker of ``--memory-limit`` (a finalizer on every storage). The switch interval is
1 us so that the threads interleave at every chance. Prints one JSON line when it survives.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import threading

import torch
from torch import nn

from torchtop.agent import holders
from torchtop.agent.tensor_tracker import TensorTracker


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--way", choices=("sampler-reads", "agent"), required=True)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--tracker", action="store_true")
    args = parser.parse_args()
    faulthandler.enable()
    sys.setswitchinterval(1e-6)
    if args.tracker:
        TensorTracker().__enter__()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)])
    optimizer = torch.optim.Adam(model.parameters())
    stop = threading.Event()
    reads = [0]
    if args.way == "agent":
        holders.READ_INTERVAL_S, holders.READ_BUDGET = 0.0, 1.0  # a read at every step
        optimizer.register_step_pre_hook(holders.optimizer_pre_hook)
        reader = holders.HolderReader(interval_s=0.0)

        def other_thread() -> None:
            while not stop.is_set():
                reader.read()
                holders.read_now()
                reads[0] += 1

    else:

        def other_thread() -> None:
            while not stop.is_set():
                try:
                    holders.read_holders([optimizer])
                except RuntimeError:  # a dictionary changed meanwhile
                    pass
                reads[0] += 1

    thread = threading.Thread(target=other_thread, daemon=True)
    thread.start()
    for _ in range(args.steps):
        optimizer.zero_grad()  # set_to_none=True, torch's default
        model(torch.randn(4, 16)).pow(2).mean().backward()
        optimizer.step()
    stop.set()
    thread.join()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    last = reader.last if args.way == "agent" else holders.read_holders([optimizer])
    held = last.devices["cpu"] if last is not None else None
    print(
        json.dumps(
            {
                "steps": args.steps,
                "reads": reads[0],
                "parameter_bytes": params,
                "parameters": held.parameters if held else None,
                "gradients": held.gradients if held else None,
            }
        )
    )


if __name__ == "__main__":
    main()
