"""The device, dataloader and profiling demos run under the agent with ``--headless --quick``,
print their conclusion, and measure their effect the right way round.

As in ``test_demos.py`` the checks are directions and counts, never figures. Where a direction
is not robust on a CPU it is not asserted there: ``x.to("cpu")`` is a no-op and ``.item()``
syncs with nothing on a CPU, so the device demo is checked by what it counted (``to()`` calls,
copies and host reads per step, from torch.profiler), and its copies' speed only on CUDA.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from demo_runner import Results, run_demo, seconds, shown_results

# -- what each demo must show ----------------------------------------------------------------


def check_device(r: Results, output: str) -> None:
    every, once = r["to() every step"]["extra"], r["to() once"]["extra"]
    # model.to() each step visits every parameter (and gradient); once before the loop, none.
    assert every["to()"] > 2
    assert once["to()"] == 0
    # Three host reads a step (loss, accuracy, a NaN check), against three per loop.
    each_step, at_end = r[".item() every step"]["extra"], r[".item() at the end"]["extra"]
    assert each_step[".item()"] == 3
    assert 0 < at_end[".item()"] < 1
    if output.startswith("device: cpu"):
        # to("cpu") on a CPU tensor returns it: nothing is copied, and the GPU paragraph shows.
        assert every["copies"] == 0
        assert "On a GPU this would differ:" in output
        assert "torch.empty(4).pin_memory()" in output  # it failed, or said it did not
    else:
        assert every["copies"] >= 2  # the batch's two tensors, each step
        assert once["copies"] == 0
        # Two copies a step (and model.to()) against none. Whether fewer syncs make the loop
        # faster depends on how the GPU's time compares with the CPU's: not asserted.
        assert seconds(r, "to() once") < seconds(r, "to() every step")
        assert seconds(r, "pinned, non_blocking") < seconds(r, "pageable .to(cuda)")


def check_dataloader(r: Results, output: str) -> None:
    none, two = r["0 workers"]["extra"], r["2 workers"]["extra"]
    persistent = r["2, persistent"]["extra"]
    table = "\n".join(line for line in output.splitlines() if line.startswith(("|", "+")))
    assert two["wait %"] < none["wait %"], table
    assert persistent["wait %"] < none["wait %"], table
    assert two["samples/s"] > none["samples/s"], table
    assert persistent["samples/s"] > none["samples/s"], table
    # Every DataLoader's workers were shut down before the demo ended.
    assert "worker processes left running: 0" in output.splitlines(), output
    # Forked workers over Python dicts grew their private memory through the epoch; over the
    # same rows as a NumPy array they did not (a direction, not a figure).
    dicts, array = r["dicts, forked"]["extra"], r["array, forked"]["extra"]
    assert dicts["private/worker"] - dicts["at start"] > 2 * (
        array["private/worker"] - array["at start"]
    ), table
    assert dicts["private/worker"] > array["private/worker"], table
    assert "Forked workers reading Python dicts ended with " in output, output


def check_profiling(r: Results, output: str) -> None:
    assert seconds(r, "torch.profiler") > seconds(r, "no profiler")
    assert r["torch.profiler"]["extra"]["overhead"] > 1
    events = int(r["torch.profiler"]["extra"]["detail"].split()[0])
    assert events > 0
    # The trace the demo wrote is valid JSON with that many events.
    paths = re.findall(r"^Chrome trace: (.+)$", output, flags=re.MULTILINE)
    assert len(paths) == 1, output
    trace = json.loads(Path(paths[0]).read_text())
    assert len(trace["traceEvents"]) == events
    # The shape error was caught and traced to a line of the demo's own file.
    assert "mat1 and mat2 shapes cannot be multiplied (32x100 and 128x64)" in output
    assert re.fullmatch(r"profiling\.py:\d+", r["wrong shape (caught)"]["extra"]["detail"])
    assert "model.encoder.0 = Linear(in_features=128, out_features=64" in output


#: Every bundled demo: ``torchtop demo --list`` shows exactly these.
ALL_TOPICS = (
    "tensors",
    "broadcasting",
    "vectorization",
    "inplace",
    "autograd",
    "memory",
    "checkpointing",
    "mixed-precision",
    "device",
    "dataloader",
    "profiling",
    "oom",
    "holders",
)

#: demo name -> (the start of its conclusion line, the checks on its measured values)
DEMOS: dict[str, tuple[str, Callable[[Results, str], None]]] = {
    "device": ("to(device) once ran ", check_device),
    "dataloader": ("2 workers ", check_dataloader),
    "profiling": ("with torch.profiler the steps ran ", check_profiling),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DEMOS))
def test_demo_runs_and_measures_the_effect(name: str, tmp_path: Path) -> None:
    output = run_demo(name, tmp_path)
    conclusion_start, check = DEMOS[name]
    results = shown_results(output, conclusion_start)
    check(results, output)


def test_the_demos_are_listed_with_short_descriptions() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "torchtop", "demo", "--list", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stderr
    listed = {demo["name"]: demo["description"] for demo in json.loads(proc.stdout)}
    # The thirteen topics, each with a one-line description.
    assert sorted(listed) == sorted(ALL_TOPICS), listed
    for name in DEMOS:
        assert name in listed, listed
    for name, description in listed.items():
        assert 0 < len(description.strip()) <= 72, f"{name}: {description!r}"
