"""A tiny Hugging Face Trainer job: a GPT-2 built from a config (no download), trained on
random token ids for a few steps on the CPU, with the Trainer's own DataLoader. Knows nothing
of torchtop. Prints ``RESULT {"global_step": N}`` with the Trainer's own count.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402
from transformers.utils import logging  # noqa: E402


class Tokens(Dataset):
    def __init__(self, n: int, length: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    logging.set_verbosity_error()
    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(
            output_dir=out,
            max_steps=args.steps,
            per_device_train_batch_size=4,
            learning_rate=1e-3,
            logging_strategy="no",
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=training, train_dataset=Tokens(64, 32, 128))
        trainer.train()
        print("RESULT " + json.dumps({"global_step": trainer.state.global_step}), flush=True)


if __name__ == "__main__":
    main()
