"""A tiny DDP job on CPU (gloo) for ``torchrun`` whose ranks write what their flight recorder saw.

Each rank trains ``--steps`` steps of a small model under DDP, reads its recorder with
:class:`torchtop.agent.collectives.CollectiveReader` and writes ``OUT/rank-R.json``:
``{"rank", "collectives": [wire dicts], "stack": "file:line in fn" | null, "buffer": env}``
(``buffer``: the ``TORCH_FR_BUFFER_SIZE`` the rank ran with).

``--slow-rank R --slow-ms MS``: rank R sleeps MS inside its backward (a hook on an activation's
gradient), so every rank's backward takes as long and only the arrivals tell them apart; with
``--slow-in forward`` it sleeps in its forward instead (the time outside backward tells it).
``--hide-recorder``: the job removes ``_dump_fr_trace_json`` and ``_dump_fr_trace`` from torch
before its process group exists, as a torch without the flight recorder would be.
``--block-rank R --block-at N``: rank R blocks before its Nth step's backward; after
``--hang-s`` seconds every rank writes its file and exits. ``--second-group``: a second process
group (ranks 0 and 1) all-reduces once per step too.
"""

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchtop.agent.collectives import CollectiveReader


def stack_line(thread_id: int) -> str | None:
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if frame.f_code.co_filename == __file__:
            return f"{Path(__file__).name}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return None


def write(out: Path, rank: int, reader: CollectiveReader, stack: str | None) -> None:
    data = {
        "rank": rank,
        "collectives": [c.as_wire() for c in reader.poll()],
        "stack": stack,
        "buffer": os.environ.get("TORCH_FR_BUFFER_SIZE"),
    }
    (out / f"rank-{rank}.json").write_text(json.dumps(data))


class SlowGrad(nn.Module):
    """Passes its input on; in backward (or in forward), sleeps ``ms`` milliseconds."""

    def __init__(self, ms: float, where: str = "backward") -> None:
        super().__init__()
        self.ms = ms
        self.where = where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ms > 0 and self.where == "forward":
            time.sleep(self.ms / 1000)
        elif self.ms > 0 and x.requires_grad:
            x.register_hook(lambda g: (time.sleep(self.ms / 1000), g)[1])
        return x


def block_here() -> None:
    while True:
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-ms", type=float, default=30.0)
    parser.add_argument("--slow-in", choices=("backward", "forward"), default="backward")
    parser.add_argument("--hide-recorder", action="store_true")
    parser.add_argument("--block-rank", type=int, default=-1)
    parser.add_argument("--block-at", type=int, default=3)
    parser.add_argument("--hang-s", type=float, default=2.0)
    parser.add_argument("--second-group", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    if args.hide_recorder:
        del torch._C._distributed_c10d._dump_fr_trace_json
        del torch._C._distributed_c10d._dump_fr_trace
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    second = dist.new_group([0, 1]) if args.second_group else None
    torch.manual_seed(0)
    slow = SlowGrad(args.slow_ms if rank == args.slow_rank else 0.0, args.slow_in)
    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(16, 16), slow, nn.ReLU(), nn.Linear(16, 1))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    reader = CollectiveReader()
    main_thread = threading.get_ident()
    if args.block_rank >= 0:

        def after_hang() -> None:
            time.sleep(args.hang_s)
            while not (out / f"blocked-{args.block_rank}").exists():
                time.sleep(0.1)
            time.sleep(args.hang_s)
            write(out, rank, reader, stack_line(main_thread))
            os._exit(0)

        threading.Thread(target=after_hang, daemon=True).start()
    x = torch.randn(8, 16)
    for step in range(args.steps):
        loss = model(x).sum()
        if rank == args.block_rank and step == args.block_at:
            (out / f"blocked-{rank}").write_text("")
            block_here()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if second is not None and rank in (0, 1):
            dist.all_reduce(torch.ones(4), group=second)
    write(out, rank, reader, None)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
