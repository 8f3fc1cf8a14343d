"""The fleet simulator's frames (``benchmarks/fleet.py``): a recorded frame moved to now, its
step totals going on, and a straggler's steps longer outside backward only."""

from __future__ import annotations

import pytest

from benchmarks.fleet import moved, ring_of
from torchtop.agent.server import LOGS, SAMPLES
from torchtop.protocol import LogLine, StepStats


def steps(t: float = 100.0) -> StepStats:
    return StepStats(
        t=t, total=20, skipped_total=0, count=2, skipped=0, timed=2, time_s=0.3, wait_s=0.0,
        startup_s=0.0, optimizer_s=0.01, samples=0, ends=[t - 0.15, t],
        durations=[0.1, 0.2], backward_s=0.1, backwards=[0.04, 0.06],
    )  # fmt: skip


def test_times_move_and_step_totals_go_on() -> None:
    out = moved(steps(), 1000.0, 40)
    assert isinstance(out, StepStats)
    assert out.t == 1100.0 and out.ends == [1099.85, 1100.0]
    assert out.total == 60 and out.durations == [0.1, 0.2]


def test_a_stragglers_steps_are_longer_outside_backward_only() -> None:
    out = moved(steps(), 0.0, 0, slow=2.0)
    assert isinstance(out, StepStats)
    assert out.time_s == pytest.approx(0.1 + 0.2 * 2)
    assert out.durations == pytest.approx([0.04 + 0.06 * 2, 0.06 + 0.14 * 2])
    assert out.backward_s == 0.1 and out.backwards == [0.04, 0.06]


def test_frames_go_to_the_rings_an_agent_keeps_them_in() -> None:
    assert ring_of(steps()) == SAMPLES
    assert ring_of(LogLine(t=1.0, stream="stdout", text="x")) == LOGS


def test_a_rank_held_back_by_a_straggler_waits_for_it_inside_backward() -> None:
    """A synchronous job: the others' steps last as long as the straggler's, the extra time
    inside backward (at the all-reduce), so the straggler is the rank with the least there."""
    straggler = moved(steps(), 0.0, 0, slow=2.0)
    held = moved(steps(), 0.0, 0, held=2.0)
    assert isinstance(straggler, StepStats) and isinstance(held, StepStats)
    assert held.time_s == pytest.approx(straggler.time_s)
    assert held.durations == pytest.approx(straggler.durations)
    assert held.backward_s == pytest.approx(0.1 + 0.2)
    assert held.backwards == pytest.approx([0.04 + 0.06, 0.06 + 0.14])
    assert held.backward_s - straggler.backward_s == pytest.approx(0.2)
