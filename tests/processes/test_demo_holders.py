"""``torchtop demo holders --headless --quick`` runs under the agent: the parameters, gradients
and optimizer state it measures equal the arithmetic from its model, checkpointing lowers the
step's peak, and the split the viewer draws from its recording (the model's one fold) shows
the optimizer state appear with Adam, to the byte."""

from __future__ import annotations

from pathlib import Path

import pytest
from demo_runner import Results, peak, run_demo, shown_results

from torchtop.model import JobModel
from torchtop.streams.recording import read_recording
from torchtop.tui.widgets.held import held_view

pytestmark = pytest.mark.slow

#: The quick demo's model: 8 blocks of Linear(256, 256) + GELU, and a Linear(256, 1) head.
WIDTH, DEPTH = 256, 8
PARAMS = 4 * (DEPTH * (WIDTH * WIDTH + WIDTH) + WIDTH + 1)
#: Parameter tensors: a weight and a bias per Linear.
TENSORS = 2 * (DEPTH + 1)
#: Adam: two float32 moments per parameter, and a float32 step count per parameter tensor.
ADAM_STATE = 2 * PARAMS + 4 * TENSORS


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, JobModel]:
    model = JobModel(mode="replay")

    def fold(record: Path) -> None:
        for message in read_recording(record).messages:
            model.apply(message)

    output = run_demo("holders", tmp_path_factory.mktemp("holders"), on_record=fold)
    return output, model


def test_the_demo_measures_each_holder_to_the_byte(demo: tuple[str, JobModel]) -> None:
    output, _ = demo
    results: Results = shown_results(output, "Adam held ")
    sgd, adam = results["SGD"]["extra"], results["Adam"]["extra"]
    checkpointed = results["Adam, 3 checkpoints"]["extra"]
    for held in (sgd, adam, checkpointed):
        assert held["params"] == held["grads"] == PARAMS
    assert sgd["optimizer"] == 0
    assert adam["optimizer"] == checkpointed["optimizer"] == ADAM_STATE
    # Saved activations: two per block (Linear's input, GELU's input), batch x width floats
    # each, against one input per segment and one segment rebuilt at a time.
    assert peak(results, "Adam") >= 2 * DEPTH * 1024 * WIDTH * 4
    assert peak(results, "Adam, 3 checkpoints") < peak(results, "Adam") * 0.7
    assert "where SGD held none; Adam, 3 checkpoints used" in output


def test_the_viewer_s_split_moves_with_the_optimizer(demo: tuple[str, JobModel]) -> None:
    """What the viewer draws: the samples of each phase, split by the holders the agent read."""
    _, model = demo
    phases = {p.name: p for p in model.phases}
    series = model.memory["cpu"].series

    def splits(name: str) -> list[dict[str, int]]:
        phase = phases[name]
        assert phase.start is not None and phase.end is not None
        inside = [p.by_category for p in series if phase.start <= p.t <= phase.end]
        return [split for split in inside if split is not None]

    sgd, adam, checkpointed = splits("SGD"), splits("Adam"), splits("Adam, 3 checkpoints")
    assert sgd and adam and checkpointed, "a phase without a holders read"
    for split in sgd:
        assert (split["parameters"], split["gradients"]) == (PARAMS, PARAMS)
        assert split["optimizer_state"] == 0
    # The read in a phase's first second may still be the phase before's.
    assert max(split["optimizer_state"] for split in adam) == ADAM_STATE
    assert all(split["optimizer_state"] == ADAM_STATE for split in checkpointed)
    # And the view says so, in its key.
    view = held_view(model, 76, 20).plain
    assert "O optim 4.02 MiB" in view and "SGD" in view, view
