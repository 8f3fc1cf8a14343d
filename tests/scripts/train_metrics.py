"""A small CPU training job for the metrics tests: steps at a steady pace through a DataLoader
that makes it wait, then idles a while so that a scraper sees its final figures.

With ``--start`` it starts the agent itself (``torchtop.start()``), as each rank of a job that
was not launched by ``torchtop run`` does.
"""

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--sleep", type=float, default=0.03, help="compute time per step")
parser.add_argument("--item-sleep", type=float, default=0.01, help="data wait per batch")
parser.add_argument("--tail", type=float, default=3.0, help="seconds to idle after training")
parser.add_argument("--start", action="store_true", help="call torchtop.start()")
args = parser.parse_args()

if args.start:
    import torchtop

    torchtop.start()


class Slow(Dataset):
    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(args.item_sleep)
        return torch.randn(32), torch.tensor(index % 4)


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loader = DataLoader(Slow(), batch_size=1, num_workers=0)
hold = []
for step, (x, y) in enumerate(loader):
    if step == args.steps:
        break
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    hold.append(torch.zeros(4096))  # memory that grows with the steps
    time.sleep(args.sleep)
print(f"trained {args.steps} steps", flush=True)
time.sleep(args.tail)
