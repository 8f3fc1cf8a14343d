"""The activation memory a step holds, by module, against torch's own MemTracker."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from torchtop.agent.activations import ActivationWindow, ModuleActivations, top_modules


class Block(nn.Module):
    def __init__(self, width: int, expand: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, expand * width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(expand * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(64, 2), Block(64, 8), Block(64, 4))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _memtracker_blocks(model: nn.Module, x: torch.Tensor) -> dict[str, int]:
    """Activation bytes each block added by the end of its forward, by MemTracker."""
    from torch.distributed._tools.mem_tracker import MemTracker, _ModState

    optimizer = torch.optim.Adam(model.parameters())
    tracker = MemTracker()
    tracker.track_external(model, optimizer, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tracker:
            _step(model, optimizer, x)
    out = {}
    for stats in tracker.memory_tracking.values():
        pre, post = stats.snapshots[_ModState.PRE_FW][0], stats.snapshots[_ModState.POST_FW][0]
        (device,) = post
        added = post[device].get("Activation", 0) - pre[device].get("Activation", 0)
        out[stats.mod_fqn] = added
    return out


def test_blocks_and_the_top_module_agree_with_memtracker_within_ten_percent() -> None:
    model, x = _model(), torch.randn(256, 64)
    expected = _memtracker_blocks(model, x)
    optimizer = torch.optim.Adam(model.parameters())
    window = ActivationWindow()
    window.begin()
    try:
        _step(model, optimizer, x)
    finally:
        top = window.end()
    blocks = ["Sequential.1", "Sequential.2", "Sequential.0"]
    assert [m.path for m in top] == blocks  # the widest block first
    assert max(blocks, key=lambda path: expected[path]) == "Sequential.1"  # as MemTracker
    for module in top:
        assert module.bytes == pytest.approx(expected[module.path], rel=0.10), module
    # The whole step's activations: what MemTracker counts at the end of the forward.
    assert sum(m.bytes for m in top) == pytest.approx(expected["Sequential"], rel=0.10)
    # Shares are of everything saved in the step: the loss's pow saves the model's output too.
    held = sum(m.bytes for m in top)
    assert sum(m.share for m in top) == pytest.approx(held / (held + 256 * 64 * 4))


def test_weights_are_not_activations_and_the_hooks_are_gone_after() -> None:
    from torch.nn.modules import module as nn_module

    hooks = (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks))
    layer = nn.Linear(32, 32, bias=False)
    window = ActivationWindow()
    window.begin()
    try:
        layer(torch.randn(4, 32)).sum().backward()  # addmm saves the input and the weight
    finally:
        (only,) = window.end()
    assert only == ModuleActivations("Linear", 4 * 32 * 4, 1.0)  # the input, not the weight
    assert (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks)) == hooks
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        pass  # no hooks of ours left in this thread's stack: a new one enters cleanly


def test_top_modules_look_into_the_one_module_that_holds_nearly_all() -> None:
    own = {"embed": 5, "layers.0.mlp": 40, "layers.0.attn": 10, "layers.1.mlp": 45, "head": 0}
    top = top_modules(own)
    assert [(m.path, m.bytes) for m in top] == [("layers.0", 50), ("layers.1", 45)]
    assert top_modules({}) == []


def test_two_models_in_one_step_are_named_apart() -> None:
    """A backbone and a head called one after the other: two roots, each named after its
    class; the one that holds the most is listed first."""
    backbone = nn.Sequential(nn.Linear(16, 128), nn.ReLU())
    head = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 4))
    window = ActivationWindow()
    window.begin()
    try:
        head(backbone(torch.randn(8, 16))).sum().backward()
    finally:
        top = window.end()
    # The backbone saves its input and ReLU's output; the head its ReLU's output (its input is
    # the backbone's output, counted there).
    assert [(m.path, m.bytes) for m in top] == [
        ("Sequential", 8 * (16 + 128) * 4),
        ("Sequential#2", 8 * 64 * 4),
    ]
