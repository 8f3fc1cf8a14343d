"""Runs a demo as a user does (``torchtop demo NAME --headless --quick``) and reads its results."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.conftest import run_tree
from torchtop.model import JobModel
from torchtop.protocol import PhaseBegan
from torchtop.streams.recording import read_recording

RESULT_PREFIX = "TORCHTOP_DEMO_RESULT "

Results = dict[str, dict[str, Any]]


def run_demo(
    name: str, tmp_path: Path | None = None, on_record: Callable[[Path], None] | None = None
) -> str:
    """The demo's output; fails the test on a non-zero exit, with the output in the message,
    or when one of its phases has no description for the viewer's phase panel. ``on_record``
    reads the demo's recording before it goes."""
    env = {
        **os.environ,
        "PYTHONWARNINGS": "ignore",
        "TORCHTOP_DEMO_RESULT": "1",
        # On a busy 2-core CI machine, two OpenMP threads per op spin-wait on each other and
        # run many times slower than one; the checks here are directions, not speeds.
        "OMP_NUM_THREADS": "1",
    }
    if tmp_path is not None:
        env["TMPDIR"] = str(tmp_path)  # e.g. where the profiling demo leaves its Chrome trace
    with tempfile.TemporaryDirectory(dir=tmp_path) as folder:
        record = Path(folder) / f"{name}.ttr"
        command = [sys.executable, "-m", "torchtop", "demo", name, "--headless", "--quick"]
        proc = run_tree([*command, "--record", str(record)], timeout=180, env=env)
        assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        check_phase_descriptions(record)
        false = false_findings(name, record)
        assert false == [], false
        if on_record is not None:
            on_record(record)
    return proc.stdout


#: Each demo's good variants (phase names, or their beginnings) and the findings its bad
#: variants may show. Nothing else may be found, and no finding may rest on evidence taken
#: inside a good variant alone: the false-positive check of the advisor.
GOOD_VARIANTS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "tensors": (("view (no copy)", "slice "), frozenset()),
    "vectorization": (("vectorized ", "torch.matmul"), frozenset({"tiny-ops"})),
    "inplace": (("avg.mul_(", "avg.zero_()", "sigmoid() * 2"), frozenset()),
    "autograd": (("no_grad()", "inference_mode()"), frozenset({"eval-with-grad"})),
    "memory": (("del as you go", "total_loss += loss.item()"), frozenset({"memory-creep"})),
    "checkpointing": (("checkpoint ",), frozenset({"memory-pressure", "fragmentation"})),
    "mixed-precision": (
        ("bfloat16 autocast", "float16 autocast"),
        frozenset({"memory-pressure", "float32-matmuls", "low-gpu-utilization"}),
    ),
    "broadcasting": (("broadcasting", "shapes checked"), frozenset()),
    "dataloader": (
        ("2 workers", "2, persistent", "2, pinned", "array, forked"),
        frozenset({"input-bound", "worker-copy-on-write"}),
    ),
    "device": (("to() once", ".item() at the end"), frozenset({"host-syncs"})),
    # Its phases show tools, none a mistake: every one is a good variant.
    "profiling": (("no profiler", "torch.profiler", "cProfile"), frozenset()),
    # Adam's state and the saved activations are what it shows, no finding.
    "holders": (("SGD", "Adam, "), frozenset()),
    "oom": (
        ("4 micro-batches", "checkpoint ", "no_grad() eval"),
        frozenset({"memory-pressure", "fragmentation"}),
    ),
}


def false_findings(name: str, record: Path) -> list[str]:
    """The warnings and critical findings of the demo's recording, fed message by message as
    the viewer is fed, that its good variants should not have: a finding none of its bad
    variants may show, or one whose evidence window lies inside a good variant."""
    prefixes, expected = GOOD_VARIANTS[name]
    model = JobModel(mode="replay")
    seen: dict[tuple[str, float, float], str] = {}
    for message in read_recording(record).messages:
        model.apply(message)
        for f in model.advice.findings:
            if f.severity in ("warning", "critical"):
                seen[(f.name, f.window_start, f.window_end)] = f.summary
    good = [
        (p.start, p.end if p.end is not None else model.now or p.start)
        for p in model.phases
        if p.start is not None and p.name.startswith(prefixes)
    ]
    start = model.start or 0.0
    # A renamed phase must not leave its demo with nothing to check.
    false = [] if good else [f"no phase of {name} starts with any of {prefixes}"]
    for (finding, begin, end), summary in seen.items():
        inside = any(s <= begin and end <= e for s, e in good)
        if finding not in expected or inside:
            false.append(f"{finding} [{begin - start:.1f}, {end - start:.1f}] s: {summary}")
    return false


def check_phase_descriptions(record: Path) -> None:
    """Every phase the demo began carries two or three sentences for the viewer's panel."""
    began = [m for m in read_recording(record).messages if isinstance(m, PhaseBegan)]
    assert began, "the demo marked no phases"
    for phase in began:
        text = phase.description or ""
        assert 80 <= len(text) <= 320, phase


def results_of(output: str) -> Results:
    lines = [line for line in output.splitlines() if line.startswith(RESULT_PREFIX)]
    assert len(lines) == 1, output
    payload = json.loads(lines[0][len(RESULT_PREFIX) :])
    return {entry["name"]: entry for entry in payload["results"]}


def shown_results(output: str, conclusion_start: str) -> Results:
    """What every demo shows: one conclusion line (it starts with ``conclusion_start``), a
    results table within 78 columns, and a time for each phase; returns the results."""
    conclusions = [line for line in output.splitlines() if line.startswith(conclusion_start)]
    assert len(conclusions) == 1, output
    assert "peak memory" in output  # the table's header
    table = [line for line in output.splitlines() if line.startswith(("|", "+"))]
    assert table and max(len(line) for line in table) <= 78, output
    results = results_of(output)
    for entry in results.values():
        assert entry["seconds"] > 0
    return results


def peak(results: Results, name: str) -> int:
    return int(results[name]["peak_bytes"])


def seconds(results: Results, name: str) -> float:
    return float(results[name]["seconds"])
