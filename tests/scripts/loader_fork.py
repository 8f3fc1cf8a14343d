"""A job whose DataLoader forks workers; each worker reports whether it runs an agent."""

import os
import sys

import torch
from torch.utils.data import DataLoader, Dataset

from torchtop.agent import core


class Numbers(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        agent = core.current()
        print(f"worker pid {os.getpid()} agent {'yes' if agent is not None else 'no'}", flush=True)
        return torch.tensor([i])


if __name__ == "__main__":
    ctx = sys.argv[1] if len(sys.argv) > 1 else "fork"
    loader = DataLoader(Numbers(), batch_size=2, num_workers=2, multiprocessing_context=ctx)
    total = sum(int(b.sum()) for b in loader)
    print(f"total {total} main agent {'yes' if core.current() is not None else 'no'}", flush=True)
