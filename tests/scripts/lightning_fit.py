"""A tiny Lightning job as users write one: ``Trainer.fit`` with a train and a validation
DataLoader (2 workers each), CPU only, no logger and no checkpoints. Knows nothing of torchtop.

Lightning calls ``optimizer.step(closure)``: forward and backward run inside the step. The
model's forward sleeps ``--forward-sleep`` seconds so that compute is most of each step.
Prints ``RESULT {"global_step": N, "val_batches": M}`` with Lightning's own counts.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

warnings.filterwarnings("ignore")


class TrainSet(Dataset):
    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(16, generator=g), torch.randn(2, generator=g)


class ValSet(TrainSet):
    def __len__(self) -> int:
        return 32


class Regressor(L.LightningModule):
    def __init__(self, forward_sleep: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
        self.forward_sleep = forward_sleep
        self.val_batches = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.forward_sleep)
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> None:
        x, y = batch
        self.val_batches += 1
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--forward-sleep", type=float, default=0.01)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    model = Regressor(args.forward_sleep)
    trainer = L.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    train = DataLoader(TrainSet(), batch_size=8, num_workers=args.workers)
    val = DataLoader(ValSet(), batch_size=8, num_workers=args.workers)
    trainer.fit(model, train, val)
    result = {"global_step": trainer.global_step, "val_batches": model.val_batches}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
