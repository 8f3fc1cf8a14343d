"""``benchmarks.agent_overhead``'s pairing of blocks, run with its A/A stand-in (``--aa``: no
agent in either arm)."""

from __future__ import annotations

import math
from typing import cast

from benchmarks.agent_overhead import (
    _NoAgent,
    against_benchmark,
    alternating,
    mean_interval95,
    summarize,
)
from torchtop.agent import core


def test_pairs_alternate_their_order_and_an_aa_run_pauses_nothing() -> None:
    calls: list[int] = []

    def run_block() -> list[float]:
        calls.append(len(calls))
        return [1.0 + len(calls) / 100]

    agent = cast(core.Agent, _NoAgent())
    blocks: list[tuple[list[float], list[float]]] = []
    off, on, ratios = alternating(agent, run_block, 4, False, blocks)
    # off on | on off | off on | on off: the k-th block returned 1 + (k + 1) / 100.
    assert off == [1.01, 1.04, 1.05, 1.08]
    assert on == [1.02, 1.03, 1.06, 1.07]
    assert [(b_on[0], b_off[0]) for b_on, b_off in blocks] == [
        (1.02, 1.01), (1.03, 1.04), (1.06, 1.05), (1.07, 1.08),
    ]  # fmt: skip
    assert math.isclose(ratios[0], 1.02 / 1.01) and math.isclose(ratios[1], 1.03 / 1.04)
    low, high = mean_interval95(blocks)
    assert low <= sum(on) / sum(off) <= high


def test_an_aa_summary_has_no_agent_figures() -> None:
    agent = cast(core.Agent, _NoAgent())
    result = summarize("tiny-ops", agent, [1.0, 1.0], [1.0, 1.0], [1.0], 0.5)
    assert result["ratio"] == 1.0 and result["op_windows"] == 0
    assert math.isnan(result["interval_s"])


def test_the_agents_figure_is_set_beside_the_benchmarks() -> None:
    """What the agent shows (its pauses' measure where they agreed, else its ticks', each
    with its hooks and op windows) as a multiple of the benchmark's mean and median excess."""
    result = {
        "self_measured_step_share": 0.012,
        "self_measured_ticks_step_share": 0.009,
        "mean_ratio": 1.008,
        "median_pair_ratio": 1.004,
    }
    line = against_benchmark(result)
    assert "figure 1.20%" in line and "mean excess 0.80% (1.5x)" in line
    assert "paired median excess 0.40% (3x)" in line
    # The pauses said nothing: the ticks' figure is the one shown.
    line = against_benchmark({**result, "self_measured_step_share": math.nan})
    assert "figure 0.90%" in line and "(1.1x)" in line
    # No excess to compare with.
    assert "n/a: no excess" in against_benchmark({**result, "mean_ratio": 0.998})
