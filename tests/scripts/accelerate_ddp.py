"""A tiny DDP job through Hugging Face Accelerate on CPU (gloo), as `accelerate launch` runs it;
knows nothing of torchtop. Each process prints ``RESULT {"rank": R, "steps": N}``."""

import json

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

acc = Accelerator(cpu=True)
torch.manual_seed(0)
data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loader = DataLoader(data, batch_size=4)
model, opt, loader = acc.prepare(model, opt, loader)
steps = 0
for x, y in loader:
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    acc.backward(loss)
    opt.step()
    steps += 1
print("RESULT " + json.dumps({"rank": acc.process_index, "steps": steps}), flush=True)
