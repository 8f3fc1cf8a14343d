"""The model's own parts: the whole run's step sample, several jobs side by side, op timings."""

from __future__ import annotations

from test_tui_app import T0, hello

from torchtop.model import JobIdentity, JobModel, RunModel
from torchtop.model.training import StepHistory, weighted_quantile
from torchtop.protocol import Hello, ProbeStatus, Sample


def test_step_history_is_exact_until_full_then_an_even_sample() -> None:
    history = StepHistory(capacity=64)
    durations = [float(i % 10) for i in range(1000)]
    for i, d in enumerate(durations):
        history.add(float(i), d, 1)
    assert history.halvings > 0 and len(history) <= 64
    # Counts stay exact, over the run and over any range.
    assert history.count() == 1000
    assert history.count(100.0, 199.0) in range(90, 111)
    # Percentiles are those of an even sample: every value still weighs a tenth.
    sampled = history.durations()
    assert {d for d, _ in sampled} == set(range(10))
    assert weighted_quantile(sampled, 0.5) in (4.0, 5.0)


def test_a_step_history_below_capacity_keeps_every_step() -> None:
    history = StepHistory(capacity=64)
    for i in range(50):
        history.add(float(i), float(i), 1)
    assert history.halvings == 0 and history.durations(10.0, 19.0) == [
        (float(i), 1) for i in range(10, 20)
    ]


def test_a_run_keeps_jobs_side_by_side_by_identity() -> None:
    run = RunModel()
    first = hello(cuda=False)
    second = Hello(**{**first.__dict__, "pid": 4343, "hostname": "node-2"})
    run.apply("a", first)
    run.apply("b", second)
    run.apply("a", Sample(T0, None, []))
    assert len(run) == 2
    jobs = run.by_identity()
    assert set(jobs) == {JobIdentity("", 4242), JobIdentity("node-2", 4343)}
    assert (
        jobs[JobIdentity("", 4242)].samples == 1 and jobs[JobIdentity("node-2", 4343)].samples == 0
    )
    assert str(JobIdentity("node-2", 4343, rank=3)) == "node-2:4343 rank 3"


def test_op_timings_keep_periods_without_them() -> None:
    model = JobModel()
    model.apply(ProbeStatus(T0, "ops", False, "op sampling is off (--no-ops)"))
    model.apply(ProbeStatus(T0 + 5, "ops", True, ""))
    model.apply(ProbeStatus(T0 + 9, "ops", False, "the job profiles"))
    periods = model.op_timings.unavailable
    assert [(p.start, p.end, p.reason) for p in periods] == [
        (T0, T0 + 5, "op sampling is off (--no-ops)"),
        (T0 + 9, None, "the job profiles"),
    ]
