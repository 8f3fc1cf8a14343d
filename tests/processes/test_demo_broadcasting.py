"""`torchtop demo broadcasting --headless --quick` runs under the agent and measures the right
way round: broadcasting's peak memory below the materializing variants'."""

from __future__ import annotations

import json
from typing import Any

import pytest
from demo_runner import run_demo

RESULT_PREFIX = "TORCHTOP_DEMO_RESULT "


@pytest.fixture(scope="module")
def demo_output() -> str:
    # As a user runs it, recorded: its phases described, its good variants found healthy.
    return run_demo("broadcasting")


def _results(output: str) -> dict[str, dict[str, Any]]:
    lines = [line for line in output.splitlines() if line.startswith(RESULT_PREFIX)]
    assert len(lines) == 1, output
    payload = json.loads(lines[0][len(RESULT_PREFIX) :])
    return {entry["name"]: entry for entry in payload["results"]}


def test_prints_the_table_and_a_conclusion(demo_output: str) -> None:
    assert "[3, 1]" in demo_output and "[1, 4]" in demo_output and "[3, 4]" in demo_output
    assert "peak memory" in demo_output
    for phase in ("repeat", "expand().contiguous()", "broadcasting", "shapes checked"):
        assert f"| {phase}" in demo_output
    conclusion = [line for line in demo_output.splitlines() if line.startswith("broadcasting used")]
    assert len(conclusion) == 1, demo_output
    assert "than repeat" in conclusion[0] and "than expand().contiguous()" in conclusion[0]


def test_table_fits_a_log_line(demo_output: str) -> None:
    table = [line for line in demo_output.splitlines() if line.startswith(("|", "+"))]
    assert table, demo_output
    assert max(len(line) for line in table) <= 78


def test_broadcasting_needs_less_peak_memory(demo_output: str) -> None:
    results = _results(demo_output)
    broadcasting = results["broadcasting"]["peak_bytes"]
    assert isinstance(broadcasting, int) and broadcasting > 0
    assert broadcasting < results["repeat"]["peak_bytes"]
    assert broadcasting < results["expand().contiguous()"]["peak_bytes"]
    for entry in results.values():
        assert entry["seconds"] > 0


def test_the_accidental_broadcast_costs_more_than_the_checked_shapes(demo_output: str) -> None:
    results = _results(demo_output)
    accidental = results["[N] - [N,1] (accidental)"]
    checked = results["shapes checked"]
    assert accidental["peak_bytes"] > checked["peak_bytes"]
    n = checked["extra"]["result"][0]
    assert accidental["extra"]["result"] == [n, n]
