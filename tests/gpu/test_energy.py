"""Energy per step from NVML's total energy counter, through the probe, the wire, the model, the
report, the exporter, the viewer's GPU line and ``compare``: the fake NVML backend keeps the
counter as NVML does (monotonic millijoules since driver load, on a 100 ms grid, none on MIG
instances or the consumer card), the steps end between its readings as a job's do, and the
frames are folded in the agent's order (a tick's GPU reading before its steps)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from tests.fakes.nvml import FakeNvmlBackend
from torchtop.agent.probes.nvml import NvmlProbe
from torchtop.export.families import families
from torchtop.export.figures import figures_of
from torchtop.model import JobModel
from torchtop.model.compare import NOISE, compare_jobs
from torchtop.model.energy import NOT_SUPPORTED
from torchtop.protocol import GpuSample, Hello, StepStats, decode, encode
from torchtop.report.job import report_json
from torchtop.tui.widgets.device import device_text

T0 = 1_700_000_000.0
TICK_S = 0.1
NVML_EVERY = 10  # ticks: one NVML read a second


def hello() -> Hello:
    return Hello(
        protocol=1, pid=4242, argv=["train.py"], cwd="/", started_at=T0, python="3.11",
        torch="2.3", devices=[], interval_s=TICK_S, hostname="node1",
    )  # fmt: skip


def run(
    backend: FakeNvmlBackend, seconds: float, step_s: float, offset_s: float = 0.03
) -> tuple[JobModel, list[tuple[float, list[int | None]]]]:
    """A job whose steps end every ``step_s`` (from ``offset_s``), sampled as the agent does:
    each tick an NVML read when due, then a ``steps`` frame with the steps that ended since.
    Every frame goes through the wire. Returns the model and each read's (t, counters)."""
    model = JobModel(mode="replay")
    model.apply(hello())
    probe = NvmlProbe(backend)
    readings = []
    next_end, total, last_t = offset_s, 0, 0.0
    for tick in range(1, round(seconds / TICK_S) + 1):
        now = tick * TICK_S
        for gpu in backend.gpus:
            gpu.clock_s = now
            for instance in gpu.mig:
                instance.clock_s = now
        if tick % NVML_EVERY == 0:
            gpus = probe.read()
            readings.append((T0 + now, [g.energy_mj for g in gpus]))
            model.apply(decode(encode(GpuSample(T0 + now, gpus))))
        ends = []
        while next_end <= now + 1e-9:
            ends.append(T0 + next_end)
            next_end += step_s
        if ends:
            durations: list[float | None] = [
                None if total + i == 0 else step_s for i in range(len(ends))
            ]
            timed = [d for d in durations if d is not None]
            total += len(ends)
            frame = StepStats(
                t=T0 + now, total=total, skipped_total=0, count=len(ends), skipped=0,
                timed=len(timed), time_s=sum(timed), wait_s=0.0, startup_s=0.0,
                optimizer_s=0.0, samples=0, ends=ends, durations=durations,
            )  # fmt: skip
            model.apply(decode(encode(frame)))
        last_t = now
    assert last_t == pytest.approx(seconds)
    return model, readings


def test_joules_per_step_is_the_counter_difference_over_the_steps_between_readings() -> None:
    backend = FakeNvmlBackend.two_h200()
    model, readings = run(backend, seconds=10.0, step_s=0.25)
    (t_first, first), (t_last, last) = readings[0], readings[-1]
    assert (t_first, t_last) == (T0 + 1.0, T0 + 10.0)
    # Steps end at 0.03, 0.28, ... : 36 of them in (1.0, 10.0].
    steps = sum(1 for k in range(41) if 1.0 < 0.03 + 0.25 * k <= 10.0)
    assert steps == 36
    report = report_json(model)["energy"]
    for index, name in enumerate(("gpu0", "gpu1")):
        counter_j = (last[index] - first[index]) / 1000  # type: ignore[operator]
        entry = report[name]
        assert entry["supported"] is True
        assert entry["steps"] == steps
        assert entry["joules"] == round(counter_j, 3)
        span = next(e for e in model.energy.values() if e.name == name).span(model.training)
        assert span is not None and span.per_step == counter_j / steps
        assert entry["joules_per_step"] == round(counter_j / steps, 4)
    # The arithmetic the fake's counter follows: 612.4 W for 9 s, over 36 steps.
    assert report["gpu0"]["joules_per_step"] == pytest.approx(612.4 * 9 / 36)
    assert report["gpu0"]["mean_power_w"] == pytest.approx(612.4)
    assert report["gpu1"]["joules_per_step"] == pytest.approx(548.9 * 9 / 36)


def test_each_interval_between_readings_counts_the_steps_that_ended_in_it() -> None:
    model, readings = run(FakeNvmlBackend.two_h200(), seconds=6.0, step_s=0.4)
    entry = next(e for e in model.energy.values() if e.name == "gpu0")
    spans = entry.intervals(model.training)
    assert len(spans) == len(readings) - 1
    # Steps ended in (1, 2], (2, 3] ...: every interval has 2 or 3 and they add up to the run.
    assert [s.steps for s in spans] == [
        sum(1 for k in range(20) if a < 0.03 + 0.4 * k <= a + 1) for a in range(1, 6)
    ]
    whole = entry.span(model.training)
    assert whole is not None
    assert sum(s.steps for s in spans) == whole.steps
    assert sum(s.joules for s in spans) == pytest.approx(whole.joules)


@pytest.mark.parametrize(
    ("scenario", "unsupported", "supported"),
    [
        (FakeNvmlBackend.power_not_supported, ["gpu1"], ["gpu0"]),
        (FakeNvmlBackend.mig_layout, ["gpu0/mig0", "gpu0/mig1"], ["gpu0", "gpu1"]),
    ],
    ids=["consumer-card", "mig"],
)
def test_a_gpu_without_the_counter_is_said_to_have_none_not_zero(
    scenario: Any, unsupported: list[str], supported: list[str]
) -> None:
    model, _ = run(scenario(), seconds=4.0, step_s=0.25)
    report = report_json(model)["energy"]
    for name in unsupported:
        assert report[name] == {"supported": False, "detail": NOT_SUPPORTED}
    for name in supported:
        assert report[name]["supported"] is True and report[name]["joules_per_step"] > 0
    # The exporter leaves them out (no series), the viewer's line says so.
    figures = figures_of(model)
    assert figures is not None
    (energy,) = [f for f in families([figures]) if f.name == "torchtop_gpu_energy_joules"]
    assert energy.kind == "counter"
    assert sorted(p.labels[4] for p in energy.points) == sorted(supported)
    lines = device_text(model).plain.splitlines()
    for line in lines[: len(unsupported) + len(supported)]:
        assert ("no energy counter" in line) != ("J/step" in line)
    assert sum("no energy counter" in line for line in lines) == len(unsupported)


def test_the_exported_counter_and_the_gpu_line_carry_the_models_figures() -> None:
    model, readings = run(FakeNvmlBackend.two_h200(), seconds=12.0, step_s=0.25)
    figures = figures_of(model)
    assert figures is not None
    (energy,) = [f for f in families([figures]) if f.name == "torchtop_gpu_energy_joules"]
    by_device = {p.labels[4]: p for p in energy.points}
    first, last = readings[0][1], readings[-1][1]
    assert by_device["gpu0"].value == (last[0] - first[0]) / 1000  # type: ignore[operator]
    assert by_device["gpu0"].labels[5] == backend_uuid(0)
    # The recent figure: the last 10 s of readings (2 .. 12 s), 40 steps.
    line = device_text(model).plain.splitlines()[0]
    assert f"612 W  {612.4 * 10 / 40:.0f} J/step  1980 MHz" in line


def backend_uuid(index: int) -> str:
    return FakeNvmlBackend.two_h200().gpus[index].uuid


def test_compare_gives_the_joules_per_step_difference_with_its_interval() -> None:
    a, _ = run(FakeNvmlBackend.two_h200(), seconds=30.0, step_s=0.25)
    lower = FakeNvmlBackend.two_h200()
    lower.gpus[0].power_w = 400.0
    b, _ = run(lower, seconds=30.0, step_s=0.25)
    again, _ = run(FakeNvmlBackend.two_h200(), seconds=30.0, step_s=0.25)
    changed = compare_jobs(a, b)
    (gpu0,) = [e for e in changed.energy if e.device == "gpu0"]
    assert gpu0.per_step.a == pytest.approx(612.4 / 4, rel=0.02)
    assert gpu0.per_step.b == pytest.approx(400.0 / 4, rel=0.02)
    assert gpu0.per_step.changed and gpu0.per_step.verdict == "lower"
    assert gpu0.per_step.ci is not None and gpu0.per_step.ci[1] < 0
    assert "energy per step gpu0" in changed.changed
    (gpu1,) = [e for e in changed.energy if e.device == "gpu1"]
    assert not gpu1.per_step.changed
    same = compare_jobs(a, again)
    assert not any(e.per_step.changed for e in same.energy)
    assert same.energy[0].per_step.verdict in (NOISE, "no change")


def test_compare_says_which_run_has_no_counter() -> None:
    a, _ = run(FakeNvmlBackend.two_h200(), seconds=8.0, step_s=0.25)
    b, _ = run(FakeNvmlBackend.power_not_supported(), seconds=8.0, step_s=0.25)
    (gpu1,) = [e for e in compare_jobs(a, b).energy if e.device == "gpu1"]
    assert gpu1.note == "not supported in B" and gpu1.per_step.b is None
    assert gpu1.per_step.verdict == "n/a"


def test_compare_json_and_text_carry_energy_per_step() -> None:
    from rich.console import Console

    from torchtop.report.compare import Side, compare, render_text

    a, _ = run(FakeNvmlBackend.two_h200(), seconds=30.0, step_s=0.25)
    lower = FakeNvmlBackend.two_h200()
    lower.gpus[0].power_w = 400.0
    b, _ = run(lower, seconds=30.0, step_s=0.25)
    report = compare(Side("a.ttr", False, [a]), Side("b.ttr", False, [b]))
    (gpu0,) = [e for e in report["energy"] if e["device"] == "gpu0"]
    per_step = gpu0["energy_per_step_j"]
    assert per_step["unit"] == "J" and per_step["verdict"] == "lower" and per_step["ci"][1] < 0
    assert "energy per step gpu0" in report["changed"]
    console = Console(width=100, record=True)
    console.print(render_text(report))
    text = console.export_text()
    assert "GPU energy per step" in text
    (row,) = [line for line in text.splitlines() if "gpu0" in line and " J" in line]
    assert "153.10 J" in row and "100.00 J" in row and "lower" in row, row


def test_the_runs_figure_starts_at_the_first_reading_once_the_kept_ones_let_it_go() -> None:
    from collections import deque

    from torchtop.model.energy import GpuEnergy, fold_gpu_energy

    model, _ = run(FakeNvmlBackend.two_h200(), seconds=10.0, step_s=0.25)
    full = next(e for e in model.energy.values() if e.name == "gpu0")
    bounded = GpuEnergy("gpu0", readings=deque(maxlen=3))
    energy = {(None, 0): bounded}
    for t, mj in full.readings:
        gpu = FakeNvmlBackend.two_h200().gpus[0]
        stats = NvmlProbe(FakeNvmlBackend([gpu])).read()[0]
        fold_gpu_energy(energy, t, [dataclasses.replace(stats, energy_mj=mj)])
    assert len(bounded.readings) == 3 and bounded.first == full.readings[0]
    assert bounded.span(model.training) == full.span(model.training)
    assert bounded.joules == full.joules


def test_each_phase_has_its_own_joules_per_step() -> None:
    from torchtop.protocol import PhaseBegan, PhaseEnded

    backend = FakeNvmlBackend.two_h200()
    model, readings = run(backend, seconds=10.0, step_s=0.25)
    model.apply(PhaseBegan(T0 + 2.5, "warm", 1))
    model.apply(PhaseEnded(T0 + 6.5, "warm", 1))
    (phase,) = report_json(model)["phases"]
    energy = phase["energy"]["gpu0"]
    # Readings at 3, 4, 5, 6 s inside the phase; steps end in (3, 6]: 12 of them.
    inside = [mj for t, mj in readings if T0 + 2.5 <= t <= T0 + 6.5]
    joules = (inside[-1][0] - inside[0][0]) / 1000  # type: ignore[operator]
    assert energy["steps"] == 12 and energy["joules"] == round(joules, 3)
    assert energy["joules_per_step"] == round(joules / 12, 4)
    assert energy["mean_power_w"] == pytest.approx(612.4)
