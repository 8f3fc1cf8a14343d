"""The agent's own cost: measured per second, folded, shown, exported, and kept to a budget."""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from dataclasses import replace

import pytest

from tests.fakes.cost import agent_stats
from torchtop.agent.core import Agent, AgentConfig
from torchtop.agent.cost import (
    OVER_BUDGET_S,
    TICK_TAIL_S,
    WINDOWS_FLOOR,
    Cost,
    CostMeter,
    PausedSteps,
    TickedSteps,
    windows_budget,
)
from torchtop.agent.sampler import TICKS_KEPT, Sampler
from torchtop.agent.threads import agent_cpu_s, agent_thread
from torchtop.export.families import families
from torchtop.export.figures import figures_of
from torchtop.model.job import JobModel, agent_cost_summary
from torchtop.protocol import AgentStats, Hello, decode, encode
from torchtop.report.job import agent_cost_line, report_json
from torchtop.transport import remove_server_files
from torchtop.tui.widgets.header import agent_cost


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.cpu = 1.0
        self.steps = 0

    def tick(self, wall: float, cpu: float, steps: int) -> None:
        self.now += wall
        self.cpu += cpu
        self.steps += steps


def meter(budget: float = 0.01) -> tuple[CostMeter, Clock]:
    clock = Clock()
    return CostMeter(budget, lambda: clock.steps, lambda: clock.cpu, lambda: clock.now), clock


def test_the_meter_gives_shares_of_a_core_and_of_the_steps() -> None:
    cost, clock = meter()
    assert cost.read() == Cost(1.0, None, None)  # the first reading only starts
    clock.tick(1.0, 0.004, 50)
    reading = cost.read()
    assert reading.cpu_s == pytest.approx(1.004)
    assert reading.cpu_share == pytest.approx(0.004)
    assert reading.step_share == pytest.approx(0.004)
    clock.tick(2.0, 0.002, 0)  # no step: no share of step time
    reading = cost.read()
    assert reading.cpu_share == pytest.approx(0.001)
    assert reading.step_share is None


def test_the_meter_says_to_slow_down_after_seconds_over_budget() -> None:
    cost, clock = meter(budget=0.01)
    cost.read()
    verdicts = []
    for _ in range(OVER_BUDGET_S * 2):
        clock.tick(1.0, 0.05, 10)
        verdicts.append(cost.over_budget(cost.read()))
    assert verdicts == ([False] * (OVER_BUDGET_S - 1) + [True]) * 2
    assert cost.slowdowns == 2
    clock.tick(1.0, 0.001, 10)
    assert not cost.over_budget(cost.read())
    assert not CostMeter(0.0, lambda: 0).over_budget(Cost(1.0, 0.5, 0.5))  # no budget


def test_the_op_windows_reading_is_shown_but_left_to_its_own_budget() -> None:
    """Reading op windows (paced by ``--ops-budget``) counts in the share shown, not in the one
    this budget weighs: a job at its defaults, whose windows' reading takes a second's few
    tens of milliseconds now and then, is not slowed down for it."""
    clock = Clock()
    read = [0.0]
    cost = CostMeter(
        0.01, lambda: clock.steps, lambda: clock.cpu, lambda: clock.now, lambda: read[0]
    )
    cost.read()
    verdicts = []
    for _ in range(OVER_BUDGET_S * 2):
        clock.tick(1.0, 0.045, 10)  # 4.5% of the second: 4% of it reading a window
        read[0] += 0.04
        reading = cost.read()
        verdicts.append(cost.over_budget(reading))
    assert reading.step_share == pytest.approx(0.045)
    assert reading.budgeted_share == pytest.approx(0.005)
    assert verdicts == [False] * (OVER_BUDGET_S * 2) and cost.slowdowns == 0


def test_the_hooks_time_counts_in_the_step_share_but_not_in_the_budget() -> None:
    """The hooks run in the training thread: their time comes out of the steps and is shown,
    but a slower sampler would not make them cheaper, so the budget does not weigh it."""
    clock = Clock()
    hooks = [0.0]
    cost = CostMeter(
        0.01,
        lambda: clock.steps,
        lambda: clock.cpu,
        lambda: clock.now,
        hooks_s=lambda: hooks[0],
    )
    cost.read()
    verdicts = []
    for _ in range(OVER_BUDGET_S * 2):
        clock.tick(1.0, 0.004, 500)
        hooks[0] += 0.012  # 24 µs of hooks in each of 500 steps
        reading = cost.read()
        verdicts.append(cost.over_budget(reading))
    assert reading.hooks_share == pytest.approx(0.012)
    assert reading.step_share == pytest.approx(0.016)
    assert reading.budgeted_share == pytest.approx(0.004)
    assert verdicts == [False] * (OVER_BUDGET_S * 2) and cost.slowdowns == 0
    clock.tick(1.0, 0.001, 0)  # no step: no share of the steps, the hooks' neither
    assert cost.read().hooks_share is None


def test_the_op_windows_get_what_the_agents_budget_leaves() -> None:
    """The windows' budget is their own (0.5%) where the rest of the agent's cost leaves room
    for it in the agent's budget (1%), what is left where it does not, and a fifth of their
    own at least: op timings still come, further apart."""
    assert windows_budget(0.005, 0.01, None) == 0.005  # no reading yet
    assert windows_budget(0.005, 0.0, 0.02) == 0.005  # no agent budget
    assert windows_budget(0.005, 0.01, 0.003) == 0.005
    assert windows_budget(0.005, 0.01, 0.008) == pytest.approx(0.002)
    assert windows_budget(0.005, 0.01, 0.012) == pytest.approx(0.005 * WINDOWS_FLOOR)
    assert windows_budget(0.02, 0.01, 0.004) == pytest.approx(0.006)


def test_an_agent_whose_hooks_and_sampler_fill_its_budget_spaces_its_windows_out(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Once a second the agent sets its op windows' budget from the median of its latest
    readings of the rest of its cost (its threads' CPU without the windows' reading, and its
    hooks' time): a Python-bound job's windows come five times further apart, which it says
    once on the job's stderr, and when the rest falls again they get their own budget back."""
    agent = Agent(AgentConfig(ops=True, nvml=False, oom_capture=False))
    try:
        assert agent.ops is not None and agent.ops.budget == 0.005
        clock, hooks = Clock(), [0.0]
        agent.cost = CostMeter(
            0.01,
            lambda: clock.steps,
            lambda: clock.cpu,
            lambda: clock.now,
            hooks_s=lambda: hooks[0],
        )
        agent._agent_stats(agent.sampler.stats)  # the meter's first reading starts it
        assert agent.ops.budget == 0.005
        for _ in range(4):  # threads 0.7% of the time, hooks 0.3%: the budget is spent
            clock.tick(1.0, 0.007, 500)
            hooks[0] += 0.003
            agent._agent_stats(agent.sampler.stats)
        assert agent.ops.budget == pytest.approx(0.005 * WINDOWS_FLOOR)
        said = [line for line in capfd.readouterr().err.splitlines() if "op windows" in line]
        assert said == [
            "torchtop: the agent's sampler and hooks take 1.0% of the step time, against its"
            " budget of 1.0%: its op windows get 0.10% of the time instead of 0.50%, and come"
            " further apart (--cost-budget, --ops-budget)"
        ]
        clock.tick(1.0, 0.001, 500)  # one light second does not move the median
        agent._agent_stats(agent.sampler.stats)
        assert agent.ops.budget == pytest.approx(0.005 * WINDOWS_FLOOR)
        for _ in range(10):  # threads 0.3%, hooks 0.1%: room for the windows' own budget
            clock.tick(1.0, 0.003, 500)
            hooks[0] += 0.001
            agent._agent_stats(agent.sampler.stats)
        assert agent.ops.budget == 0.005
        for _ in range(10):  # spent again: said once a job, not each time
            clock.tick(1.0, 0.008, 500)
            hooks[0] += 0.003
            agent._agent_stats(agent.sampler.stats)
        assert agent.ops.budget == pytest.approx(0.005 * WINDOWS_FLOOR)
        assert "op windows" not in capfd.readouterr().err
    finally:
        agent.server.stop(drain_s=0)
        remove_server_files(agent.pid)


def test_the_samplers_clock_leaves_its_pauses_out() -> None:
    """The cost's shares are of the time the sampler ran: the overhead benchmark's "off"
    blocks, with the sampler paused and the hooks out, do not thin them."""
    sampler = Sampler(lambda message: None, host=None, cpu_memory=None, cuda_memory=None, nvml=None)
    began, sampled = time.monotonic(), sampler.sampling_time()
    sampler.pause()
    time.sleep(0.2)
    in_pause = sampler.sampling_time()
    sampler.resume()
    elapsed = time.monotonic() - began
    ran = sampler.sampling_time() - sampled
    assert in_pause - sampled <= elapsed - 0.2
    assert 0 <= ran <= elapsed - 0.2


def test_the_hooks_keep_their_own_time_in_a_real_training_loop() -> None:
    """Each hook adds the time it spends to ``HOOK_S``: more than nothing on every step, and
    far less than the steps themselves."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, TensorDataset

    from torchtop.agent import steps as step_hooks
    from torchtop.agent.training import TrainingMonitor

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(torch.randn(256, 8), torch.randn(256, 1)), batch_size=8)
    monitor = TrainingMonitor()
    monitor.start()
    try:
        assert monitor.installed
        before = step_hooks.HOOK_S[0]
        began = time.perf_counter()
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        spent = time.perf_counter() - began
        hooks = step_hooks.HOOK_S[0] - before
        monitor.drain()
        assert monitor.steps.total == 32
    finally:
        monitor.stop(time.time())
    assert 0 < hooks < spent / 4
    # Removed, the hooks keep no time.
    before = step_hooks.HOOK_S[0]
    for x, y in loader:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    assert step_hooks.HOOK_S[0] == before


def test_a_monitor_counts_its_own_steps_whatever_another_left_undrained() -> None:
    """A step of another optimizer left in the hooks' queue (hooks a previous monitor did not
    drain) would become the new monitor's step clock, and its first steps would go uncounted."""
    torch = pytest.importorskip("torch")
    from torchtop.agent import steps as step_hooks
    from torchtop.agent.training import TrainingMonitor

    step_hooks.PENDING.append((step_hooks.OPT_STEP, time.perf_counter(), 12345, None, 0.0))
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = TrainingMonitor()
    monitor.start()
    try:
        for _ in range(32):
            optimizer.zero_grad()
            model(torch.ones(1, 2)).sum().backward()
            optimizer.step()
        monitor.drain()
        assert monitor.steps.total == 32
    finally:
        monitor.stop(time.time())


def test_agent_threads_cpu_is_measured() -> None:
    spun, release = threading.Event(), threading.Event()

    def spin() -> None:
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass
        spun.set()
        release.wait(30)  # alive while measured: an ended thread's CPU leaves /proc

    thread = agent_thread(spin, "torchtop-test")
    before = agent_cpu_s() or 0.0
    thread.start()
    assert spun.wait(30)
    after = agent_cpu_s()
    release.set()
    thread.join()
    assert after is not None and after - before >= 0.04


def stats(t: float, cpu_s: float, step_share: float | None) -> AgentStats:
    return agent_stats(t, cpu_s, step_share or 0.002, step_share)


def hello() -> Hello:
    return Hello(
        protocol=1,
        pid=42,
        argv=["train.py"],
        cwd="/",
        started_at=1000.0,
        python="3.12",
        torch="2.5",
        devices=[],
        interval_s=0.1,
        hostname="node",
    )


def test_the_model_report_and_exporter_carry_the_cost() -> None:
    model = JobModel()
    model.apply(hello())
    model.apply(stats(1001.0, 0.004, 0.004))
    model.apply(stats(1002.0, 0.010, 0.006))
    model.apply(stats(1004.0, 0.012, None))
    summary = agent_cost_summary(model)
    assert summary is not None
    assert summary["cpu_s"] == pytest.approx(0.012)
    assert summary["core_share"] == pytest.approx(0.003)
    assert summary["mean_step_share"] == pytest.approx(0.005)
    assert report_json(model)["agent_cost"] == summary
    assert agent_cost_line(summary).startswith("torchtop's agent: 0.5% of step time (mean)")
    assert summary["hooks_step_share"] is None  # the fake agent does not time its hooks
    figures = figures_of(model)
    assert figures is not None
    exported = {f.name: f.points for f in families([figures])}
    assert exported["torchtop_agent_cpu_seconds"][0].value == pytest.approx(0.012)
    assert exported["torchtop_agent_step_time_ratio"] == []  # no step in the last second


def test_older_agents_stats_still_decode_and_fold() -> None:
    frame = encode(stats(1.0, 0.1, 0.01)).decode()
    for field in ("cpu_s", "cpu_share", "step_share", "cost_budget", "interval_s"):
        frame = frame.replace(f',"{field}":', ',"x_' + field + '":')
    old = decode(frame)
    assert isinstance(old, AgentStats) and old.cpu_s is None
    model = JobModel()
    model.apply(hello())
    model.apply(old)
    assert agent_cost_summary(model) is None
    assert report_json(model)["agent_cost"] is None


class StepClock:
    """perf_counter for :class:`PausedSteps`, and the steps a job took meanwhile."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.ends: list[tuple[float, float]] = []

    def run(self, seconds: float, step_s: float) -> None:
        end = self.now + seconds
        while self.now + step_s <= end:
            self.now += step_s
            self.ends.append((self.now, step_s))
        self.now = end


def test_pauses_measure_the_steps_against_those_around_them() -> None:
    clock = StepClock()
    paused = PausedSteps(clock=lambda: clock.now, every_s=10.0, pause_s=2.0)
    for _ in range(5):
        while not paused.due(usual_step_s=0.010):
            clock.run(0.5, 0.010)  # steps of 10 ms with the agent on
            paused.add(clock.ends)
        began = clock.now
        clock.run(2.0, 0.008)  # 8 ms in the pause: the agent cost a quarter
        paused.paused(began, clock.now, clock.ends)
        assert paused.measured() is None or paused.measured().pairs < 5
    clock.run(2.5, 0.010)
    paused.add(clock.ends)
    measured = paused.measured()
    assert measured is not None and measured.pairs == 5
    assert measured.step_share == pytest.approx(0.25)
    assert paused.pauses == 5


def test_comparisons_that_vary_more_than_the_cost_say_nothing() -> None:
    """A busy machine's pauses: steps in them 3% slower, then 4% faster, and so on. Their
    median would be a cost of 1%, no more precise than the noise: none is said until the
    comparisons agree."""
    clock = StepClock()
    paused = PausedSteps(clock=lambda: clock.now, every_s=10.0, pause_s=2.0)

    def pause(in_pause_s: float) -> None:
        while not paused.due(usual_step_s=0.010):
            clock.run(0.5, 0.010)
            paused.add(clock.ends)
        began = clock.now
        clock.run(2.0, in_pause_s)
        paused.paused(began, clock.now, clock.ends)
        clock.run(2.5, 0.010)
        paused.add(clock.ends)

    for in_pause_s in (0.0103, 0.0096, 0.0099, 0.0104, 0.0095, 0.0099):
        pause(in_pause_s)
    assert paused._ratios and len(paused._ratios) == 6
    assert paused.measured() is None
    for _ in range(9):  # then the pauses agree: 2% faster every time
        pause(0.0098)
    measured = paused.measured()
    assert measured is not None and measured.pairs == 15
    assert measured.step_share == pytest.approx(0.010 / 0.0098 - 1)


def test_no_pause_for_slow_steps_or_while_a_window_is_open() -> None:
    clock = StepClock()
    paused = PausedSteps(clock=lambda: clock.now, every_s=10.0, pause_s=2.0)
    clock.run(6.0, 0.5)
    assert not paused.due(usual_step_s=0.5)  # 4 steps a pause: too few to compare
    assert not paused.due(usual_step_s=None)
    clock.run(3.0, 0.01)
    assert not paused.due(usual_step_s=0.01, busy=True)  # then a little later
    clock.run(2.6, 0.01)
    assert paused.due(usual_step_s=0.01)


def test_a_pause_with_too_few_steps_on_a_side_is_not_counted() -> None:
    clock = StepClock()
    paused = PausedSteps(clock=lambda: clock.now, every_s=10.0, pause_s=2.0)
    clock.run(6.0, 0.010)
    began = clock.now
    clock.run(2.0, 0.5)  # the job stalled in the pause
    paused.paused(began, clock.now, clock.ends)
    clock.run(2.5, 0.010)
    paused.add(clock.ends)
    assert paused.measured() is None and paused._ratios == deque()


def ticked_job(
    seconds: float, step_s: float, tick_s: float, delay_s: float, seed: int = 0
) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """A job's steps (end, duration) and the sampler's ticks (start, end): a tick of
    ``tick_s`` every 0.1 s, and each step a tick overlaps ``delay_s`` longer. The machine's
    own noise: steps vary by 5%, and one in eight runs at half speed (in spells, as on a VM)."""
    rng = random.Random(seed)
    ticks = [(t / 10, t / 10 + tick_s) for t in range(1, int(seconds * 10))]
    ends: list[tuple[float, float]] = []
    now, spell = 0.0, 0
    j = 0
    while now < seconds:
        if spell == 0 and rng.random() < 1 / 200:
            spell = 25
        duration = step_s * rng.uniform(0.95, 1.05) * (2.0 if spell else 1.0)
        spell = max(0, spell - 1)
        while j < len(ticks) and ticks[j][1] + TICK_TAIL_S <= now:
            j += 1
        if j < len(ticks) and ticks[j][0] < now + duration:
            duration += delay_s
        now += duration
        ends.append((now, duration))
    return ends, ticks


def test_the_steps_a_tick_overlapped_measure_what_the_ticks_cost() -> None:
    """Steps of 2 ms, a 1 ms tick every 0.1 s that holds each step it overlaps up by 1 ms:
    about one step in 45 pays, 1 ms in 100 ms of steps, 1% of the time."""
    ends, ticks = ticked_job(30.0, 0.002, 0.001, 0.001)
    ticked = TickedSteps(keep=20000)
    ticked.add(ends, ticks, known_until=ends[-1][0] + 1)
    measured = ticked.measured()
    assert measured is not None
    hit = sum(1 for end, d in ends if any(b < end and e + TICK_TAIL_S > end - d for b, e in ticks))
    assert measured.pairs == ticked.overlapped == hit
    cost = 0.001 * hit / sum(d for _, d in ends)
    assert measured.step_share == pytest.approx(cost, rel=0.3)


def test_ticks_that_hold_no_step_up_measure_nothing() -> None:
    """The same ticks over steps that let go of the GIL (a C++ or CUDA step): the overlapped
    steps run as fast as the others, and the measure says so, however much CPU the ticks
    used."""
    ends, ticks = ticked_job(30.0, 0.014, 0.001, 0.0)
    ticked = TickedSteps(keep=20000)
    ticked.add(ends, ticks, known_until=ends[-1][0] + 1)
    measured = ticked.measured()
    assert measured is not None and abs(measured.step_share) < 0.003


def test_a_step_is_classed_once_every_tick_that_could_overlap_it_is_known() -> None:
    ticked = TickedSteps(every_s=0.0)
    ends = [(1.000, 0.010), (1.010, 0.010), (1.020, 0.010)]
    # The tick running now began at 1.005: the steps after it are left for the next reading.
    ticked.add(ends, [(0.900, 0.901)], known_until=1.005)
    assert list(ticked._steps) == [(0.010, False)]
    ticked.add(ends, [(0.900, 0.901), (1.005, 1.006)], known_until=1.100)
    # The tick (and the sending 2 ms after it) overlapped the second step, not the third.
    assert list(ticked._steps) == [(0.010, False), (0.010, True), (0.010, False)]
    # Nothing is classed twice; a step begun before the ticks kept start is left out.
    ends.append((1.200, 0.010))
    ticked.add(ends, [(1.195, 1.196)], known_until=1.300, known_from=1.185)
    assert len(ticked._steps) == 4 and ticked._steps[-1] == (0.010, True)
    ends.append((1.400, 0.300))
    ticked.add(ends, [(1.195, 1.196), (1.300, 1.301)], known_until=1.500, known_from=1.185)
    assert len(ticked._steps) == 4


def test_an_op_windows_steps_are_left_to_the_window() -> None:
    """Steps of 2 ms with ticks that cost nothing, and an op window every 5 s whose steps run
    at twice their time, one tick reading it: the window's steps are its own cost, which it
    measures itself, so the ticks' measure leaves them out instead of counting them twice."""
    ends, ticks = ticked_job(30.0, 0.002, 0.001, 0.0)
    windows = [(w, w + 0.03) for w in (5.05, 10.05, 15.05, 20.05, 25.05)]
    slowed = []
    for end, duration in ends:
        inside = any(b < end and end - duration < e for b, e in windows)
        slowed.append((end, duration * 2 if inside else duration))
    # The window's reading is one long tick, at its end.
    ticks = sorted(ticks + [(e - 0.02, e) for _, e in windows])
    counted = TickedSteps(keep=20000)
    counted.add(slowed, ticks, known_until=slowed[-1][0] + 1)
    left_out = TickedSteps(keep=20000)
    left_out.add(slowed, ticks, known_until=slowed[-1][0] + 1, windows=windows)
    said, measured = counted.measured(), left_out.measured()
    assert measured is not None and abs(measured.step_share) < 0.002
    assert said is None or said.step_share > measured.step_share + 0.001
    in_windows = sum(1 for end, d in ends if any(b < end and end - d < e for b, e in windows))
    assert len(left_out._steps) == len(counted._steps) - in_windows


def test_the_tick_measure_is_worked_out_again_every_ten_seconds_once_said() -> None:
    """Each reading sorts the steps kept: once said, the measure stands for ten seconds; while
    it says nothing, it is looked at again every two."""
    now = [0.0]
    ticked = TickedSteps(keep=20000, clock=lambda: now[0])
    assert ticked.measured() is None  # no step yet
    ends, ticks = ticked_job(30.0, 0.002, 0.001, 0.001)
    ticked.add(ends[:5000], ticks, known_until=ends[4999][0])
    now[0] = 1.0
    assert ticked.measured() is None  # two seconds not yet passed
    now[0] = 2.0
    first = ticked.measured()
    assert first is not None
    ticked.add(ends, ticks, known_until=ends[-1][0] + 1)
    now[0] = 11.0
    assert ticked.measured() is first
    assert ticked.measured(fresh=True) is not first
    now[0] = 12.5
    assert ticked.measured().pairs == ticked.overlapped


def test_a_pause_between_ticks_is_not_taken_for_their_spacing() -> None:
    """The paused measure stops the ticks for 2 s: the ticks' usual gap stays 0.1 s, which
    weighs the steps no tick overlapped."""
    ticks = [(0.1 * k, 0.1 * k + 0.001) for k in range(1, 6)]
    ticks += [(2.5 + 0.1 * k, 2.5 + 0.1 * k + 0.001) for k in range(5)]
    ends = [(0.01 * k, 0.01) for k in range(1, 300)]
    ticked = TickedSteps()
    ticked.add(ends, ticks, known_until=3.0)
    assert ticked._period_s == pytest.approx(0.1)


def test_too_few_overlapped_steps_say_nothing() -> None:
    ends, ticks = ticked_job(1.0, 0.002, 0.001, 0.001)  # about 10 ticks
    ticked = TickedSteps()
    ticked.add(ends, ticks, known_until=ends[-1][0] + 1)
    assert 0 < ticked.overlapped < 50 and ticked.measured() is None


def test_the_sampler_keeps_its_ticks_times_without_its_pauses() -> None:
    sampler = Sampler(lambda message: None, host=None, cpu_memory=None, cuda_memory=None, nvml=None)
    sampler._record_tick(1.0, 1.001)
    sampler._pause = (1.1005, 3.1005)
    sampler._record_tick(1.100, 3.101)
    assert list(sampler.ticks) == [(1.0, 1.001), (1.100, 1.1005), (3.1005, 3.101)]
    sampler.tick_began = 3.2
    ticks, known_from, known_until = sampler.known_ticks()
    assert ticks is sampler.ticks and known_from == float("-inf") and known_until == 3.2
    for k in range(TICKS_KEPT):
        sampler._record_tick(4.0 + k, 4.5 + k)
    assert sampler.known_ticks()[1] == 4.0


def test_the_measured_cost_by_ticks_is_reported_as_such() -> None:
    model = JobModel()
    model.apply(hello())
    measured = {"measured_step_share": 0.004, "measured_by": "ticks", "measured_steps": 812}
    model.apply(
        replace(stats(1001.0, 0.004, 0.008), measured_pairs=1, windows_share=0.001, **measured)
    )
    summary = agent_cost_summary(model)
    assert summary is not None and summary["measured_by"] == "ticks"
    assert (
        "0.4% of step time measured on 812 steps its ticks overlapped (its op windows 0.1% of it)"
        in agent_cost_line(summary)
    )
    assert agent_cost(model) == "torchtop 0.4% of step"
    # A recording's negative share reads as none, as the measured share itself does.
    summary["windows_share"] = -0.002
    assert "(its op windows 0.0% of it)" in agent_cost_line(summary)
    # A recording's word for it that is neither is not carried.
    model.apply(
        replace(stats(1002.0, 0.004, 0.008), measured_step_share=0.004, measured_by="\x1b[2J")
    )
    summary = agent_cost_summary(model)
    assert summary is not None and summary["measured_by"] is None
    assert "measured over" in agent_cost_line(summary)


def test_the_measured_cost_is_shown_reported_and_exported() -> None:
    model = JobModel()
    model.apply(hello())
    model.apply(replace(stats(1001.0, 0.004, 0.004), measured_step_share=0.031, measured_pairs=4))
    summary = agent_cost_summary(model)
    assert summary is not None
    assert summary["measured_step_share"] == 0.031 and summary["measured_pairs"] == 4
    assert "3.1% of step time measured over 4 pauses" in agent_cost_line(summary)
    assert agent_cost(model) == "torchtop 3.1% of step"
    figures = figures_of(model)
    assert figures is not None
    exported = {f.name: f.points for f in families([figures])}
    assert exported["torchtop_agent_measured_step_time_ratio"][0].value == pytest.approx(0.031)


def test_the_hooks_part_of_the_cost_is_reported() -> None:
    model = JobModel()
    model.apply(hello())
    model.apply(replace(stats(1001.0, 0.004, 0.010), hooks_share=0.006))
    model.apply(replace(stats(1002.0, 0.008, 0.014), hooks_share=0.008))
    summary = agent_cost_summary(model)
    assert summary is not None
    assert summary["mean_step_share"] == pytest.approx(0.012)
    assert summary["hooks_step_share"] == pytest.approx(0.007)
    assert agent_cost_line(summary).startswith(
        "torchtop's agent: 1.2% of step time (mean; its hooks in the training thread 0.7%)"
    )
    # The job's last second took no step: the mean and the hooks' part of it stand.
    model.apply(stats(1003.0, 0.009, None))
    assert agent_cost_summary(model)["hooks_step_share"] == pytest.approx(0.007)  # type: ignore[index]
