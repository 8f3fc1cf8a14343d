"""The fleet simulator's frames (``benchmarks/fleet.py``): a recorded frame moved to now, its
step totals going on, and a straggler's steps longer outside backward only."""

from __future__ import annotations

import pytest

from benchmarks.fleet import as_sent, moved, ring_of
from torchtop.agent.server import LOGS, SAMPLES
from torchtop.protocol import HostStats, LogLine, Sample, StepStats


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


class Viewers:
    """What an agent's server says of its viewers: whether they all read ``host`` outside."""

    def __init__(self, outside: bool) -> None:
        self.outside = outside

    def read_outside(self, name: str) -> bool:
        return self.outside and name == "host"


def test_a_sample_carries_the_rss_alone_while_the_viewers_read_the_rest_outside() -> None:
    host = HostStats(
        rss_bytes=100, cpu_percent=50.0, threads=7, children=0, system_used_bytes=1,
        system_total_bytes=2, cpus=2, local_processes=8,
    )  # fmt: skip
    sample = Sample(t=1.0, host=host, memory=[])
    sent = as_sent(sample, Viewers(outside=True))  # type: ignore[arg-type]
    assert sent.host == HostStats(
        rss_bytes=100, cpu_percent=None, threads=None, children=None, system_used_bytes=None,
        system_total_bytes=None, cpus=2, local_processes=8,
    )  # fmt: skip
    assert as_sent(sample, Viewers(outside=False)) is sample  # type: ignore[arg-type]
