"""The sampler's pause (the overhead benchmark's "off" blocks): the time paused is left out
of its schedule, so that the sampling in the blocks between pauses is as dense as a job's."""

from __future__ import annotations

import time

from torchtop.agent.sampler import Sampler


class _Host:
    """No figures: the schedule alone is under test."""

    def read(self) -> None:
        return None

    read_rss = read


class _NoMemory:
    def read(self, rss: int | None) -> None:
        return None


def _sampler(
    interval_s: float, resumed: list[float] | None = None, training: object | None = None
) -> Sampler:
    """A sampler of no figures; ``resumed`` takes each pause's length, ``training`` is its
    training monitor."""
    return Sampler(
        lambda message: None,
        host=_Host(),
        cpu_memory=_NoMemory(),
        cuda_memory=None,
        nvml=None,
        interval_s=interval_s,
        on_resumed=None if resumed is None else resumed.append,
        training=training,
    )


def _wait_for(predicate, limit_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, "the sampler did not tick"
        time.sleep(0.005)


def test_after_a_pause_the_ticks_go_on_from_where_they_were() -> None:
    """Paused 0.1 s after a tick, for 0.4 s, at a 0.5 s interval: the next tick comes 0.4 s
    after the resume (the rest of the interval), not at once, and what is scheduled in
    sampling time moves on by the pause."""
    resumed: list[float] = []
    sampler = _sampler(0.5, resumed)
    sampler.start()
    try:
        _wait_for(lambda: len(sampler.ticks) >= 1)
        last_began = sampler.ticks[-1][0]
        time.sleep(0.1)
        stats_due = sampler._next_stats
        paused_at = time.perf_counter()
        sampler.pause()
        time.sleep(0.4)
        sampler.resume()
        resumed_at = time.perf_counter()
        _wait_for(lambda: len(sampler.ticks) >= 2)
        next_began = sampler.ticks[1][0]
    finally:
        sampler.stop()
    # The sampler may tick late, never early; 0.2 s of slack for a late first tick.
    rest = 0.5 - (paused_at - last_began)
    assert next_began - resumed_at >= rest - 0.2
    assert len(resumed) == 1 and resumed[0] >= 0.4
    assert sampler._next_stats >= stats_due + 0.4


def test_a_pause_without_a_resume_stops_the_ticks_and_a_second_pause_changes_nothing() -> None:
    resumed: list[float] = []
    sampler = _sampler(0.02, resumed)
    sampler.start()
    try:
        _wait_for(lambda: len(sampler.ticks) >= 1)
        sampler.pause()
        began = sampler._paused_at
        time.sleep(0.1)  # a tick under way when paused may end meanwhile
        ticks = len(sampler.ticks)
        sampler.pause()
        assert sampler._paused_at == began
        time.sleep(0.2)
        assert len(sampler.ticks) == ticks
        sampler.resume()
        _wait_for(lambda: len(sampler.ticks) > ticks)
    finally:
        sampler.stop()
    assert len(resumed) == 1 and resumed[0] >= 0.3


class _Training:
    """A training monitor whose ticks meet a backward pass every other time, and then fail."""

    def __init__(self) -> None:
        self.asked: list[float] = []
        self.ticked = 0

    def before_tick(self, interval_s: float) -> bool:
        self.asked.append(interval_s)
        if len(self.asked) > 4:
            raise RuntimeError("odd")
        return len(self.asked) % 2 == 0

    def tick(self, now: float) -> list[object]:
        self.ticked += 1
        return []


def test_each_tick_first_asks_to_meet_the_jobs_backward_pass_and_counts_when_it_did() -> None:
    training = _Training()
    sampler = _sampler(0.01, training=training)
    sampler.start()
    try:
        _wait_for(lambda: training.ticked >= 8)  # a failing wait leaves the ticks as they were
    finally:
        sampler.stop()
    assert training.asked[:4] == [0.01] * 4
    assert sampler.stats.met_backward == 2


def test_a_pause_that_comes_while_a_tick_waits_for_a_backward_pass_holds_that_tick() -> None:
    """The benchmark's "off" block may begin while the sampler waits for the job's backward
    pass: the tick it waited for does not run in the block."""
    import threading

    waiting, paused = threading.Event(), threading.Event()

    class Training(_Training):
        def before_tick(self, interval_s: float) -> bool:
            if not paused.is_set():
                waiting.set()
                paused.wait(5.0)  # the pause comes meanwhile
            return False

    training = Training()
    sampler = _sampler(0.01, training=training)
    sampler.start()
    try:
        assert waiting.wait(5.0)
        sampler.pause()
        paused.set()
        time.sleep(0.2)
        assert training.ticked == 0
        sampler.resume()
        _wait_for(lambda: training.ticked >= 1)
    finally:
        sampler.stop()
