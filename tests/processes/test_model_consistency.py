"""One fold, three readers: each recording replayed through the model, the report and the viewer
shows every figure they share as the same number.

Recordings come from real jobs under ``torchtop run --headless --record`` (DataLoaders with
workers, op windows, an out-of-memory failure under ``--memory-limit``) and from the viewer
tests' scripted CUDA job written to a file. The report reads the recording with ``torchtop
report --json`` in a subprocess, as a user would; the viewer is driven by Pilot, fed what a
replay feeds it; the model is folded here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import SCRIPTS, torchtop
from fakes.source import FakeSource
from test_tui_app import cuda_job, drained, pilot_test, static_text
from textual.widgets import Static

from torchtop.model import JobModel, SourceConnected, SourceDisconnected
from torchtop.model.connection import END_OF_RECORDING
from torchtop.protocol import Message
from torchtop.report.job import fold, render_text, report_json
from torchtop.sizes import format_bytes
from torchtop.streams.recording import RecordingWriter, read_recording
from torchtop.tui.app import TorchtopApp
from torchtop.tui.format import format_percent
from torchtop.tui.screens.oom import OomScreen
from torchtop.tui.widgets.header import JobHeader
from torchtop.tui.widgets.loaders import LoaderPanel
from torchtop.tui.widgets.memory import MemoryPanel
from torchtop.tui.widgets.ops import ops_summary
from torchtop.tui.widgets.steps import StepPanel

#: Wide enough that no figure is cut.
WIDE = (200, 60)

JOBS: dict[str, tuple[str, ...]] = {
    "loader": ("--record", "{rec}", str(SCRIPTS / "train_loader.py"), "--workers", "2", "--val"),
    "ops": ("--record", "{rec}", str(SCRIPTS / "train_ops.py"), "--seconds", "2"),
    "oom": ("--memory-limit", "256MiB", "--record", "{rec}", str(SCRIPTS / "oom_doubling.py")),
}


@pytest.fixture(scope="module")
def recordings(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("recordings")
    out: dict[str, Path] = {}
    for name, args in JOBS.items():
        rec = folder / f"{name}.ttr"
        done = torchtop("run", "--headless", *(a.format(rec=rec) for a in args), timeout=180)
        assert rec.exists(), done.stderr
        out[name] = rec
    scripted = folder / "scripted.ttr"
    writer = RecordingWriter(scripted)
    for message in cuda_job():
        if not isinstance(message, SourceConnected):
            writer.write(message)
    writer.close()
    out["scripted"] = scripted
    return out


def _report(rec: Path) -> dict[str, Any]:
    done = torchtop("report", str(rec), "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _replayed(messages: list[Message]) -> list[Message]:
    """What a replay feeds the viewer: the frames between the source's own events."""
    first = next(m.t for m in messages if isinstance(getattr(m, "t", None), float))
    last = max(m.t for m in messages if isinstance(getattr(m, "t", None), float))
    return [
        SourceConnected(first, "recording"),
        *messages,
        SourceDisconnected(last, END_OF_RECORDING),
    ]


def _model_agrees_with_report(model: JobModel, report: dict[str, Any]) -> None:
    training = model.training
    assert report["steps"] == training.total
    assert report["skipped_steps"] == training.skipped_total
    assert report["step_time_s"]["median"] == _r6(training.step_time(0.5))
    assert report["step_time_s"]["p90"] == _r6(training.step_time(0.9))
    fraction = training.run.wait_fraction
    assert report["dataloader"]["wait_fraction"] == (
        round(fraction, 4) if fraction is not None else None
    )
    assert [x["batches"] for x in report["dataloader"]["loaders"]] == [
        x.batches for x in training.loaders
    ]
    assert report["log_lines"] == model.log_total
    assert report["exit_code"] == model.exit_code
    assert report["profile_windows"] == model.ops_windows
    assert report["sync_points_per_step"] == model.op_timings.sync_points_per_step
    peaks = {d["id"]: d["peak_allocated_bytes"] for d in report["devices"]}
    assert peaks == {k: v.peak_allocated for k, v in model.memory.items()}
    ooms = {d["id"]: d["num_ooms"] for d in report["devices"]}
    assert ooms == {k: model.device_ooms(k) for k in model.memory}
    assert [e["kind"] == "oom" for e in report["events"]] == [
        e.is_oom for e in model.captures.entries
    ]


def _r6(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


@pytest.mark.parametrize("name", ["loader", "ops", "oom", "scripted"])
def test_model_report_and_viewer_show_the_same_figures(
    recordings: dict[str, Path], name: str
) -> None:
    rec = recordings[name]
    messages = read_recording(rec).messages
    report = _report(rec)
    model = fold(messages)
    assert json.loads(json.dumps(report_json(model))) | {"recording": report["recording"]} == report
    _model_agrees_with_report(model, report)
    text = _plain(render_text(report))
    if report["steps"]:
        assert f"steps {report['steps']}" in text

    @pilot_test
    async def scenario() -> None:
        app = TorchtopApp(FakeSource(_replayed(messages), mode="replay"))
        async with app.run_test(size=WIDE) as pilot:
            await drained(pilot)
            state = app.job.state
            # The viewer's model is the report's model: the same fold of the same frames.
            _model_agrees_with_report(state, report)
            header = static_text(app.job.query_one(JobHeader))
            if report["exit_code"] is not None:
                assert f"exit {report['exit_code']}" in header
            primary = state.primary_memory
            if primary is not None:
                figures = static_text(app.job.query_one(MemoryPanel).query_one("#memory-figures"))
                peak = next(
                    d["peak_allocated_bytes"]
                    for d in report["devices"]
                    if d["id"] == state.primary_device
                )
                assert f"peak {format_bytes(peak)}" in figures or (
                    f"{primary.allocated_label} {format_bytes(peak)}" in figures
                )
                ooms = next(
                    d["num_ooms"] for d in report["devices"] if d["id"] == state.primary_device
                )
                if ooms is not None and (primary.is_cuda or "emulated" in figures):
                    assert f"OOMs {ooms}" in figures, figures
            if report["steps"]:
                steps = static_text(app.job.query_one(StepPanel).query_one("#step-figures", Static))
                assert f"step {report['steps']:,}" in steps
                # The report rounds it to 4 places (0.27496 -> 0.275): the screen shows the
                # model's own figure, which agrees with the report's to that rounding.
                fraction = state.training.run.wait_fraction
                assert fraction is not None
                assert round(fraction, 4) == report["dataloader"]["wait_fraction"]
                assert f"(avg {format_percent(fraction * 100)})" in steps
            for loader in report["dataloader"]["loaders"]:
                shown = static_text(app.job.query_one(LoaderPanel).query_one(Static))
                assert f"{loader['index']} {loader['dataset']} · batch" in shown
            if report["profile_windows"]:
                everything = ops_summary(state, cumulative=True).plain
                windows = report["profile_windows"]
                assert f"all {windows} window" in everything
            ooms = [e for e in report["events"] if e["kind"] == "oom"]
            if ooms:
                assert isinstance(app.screen, OomScreen)
                banner = static_text(app.screen.query_one("#oom-banner", Static))
                assert ooms[-1]["verdict"].split(":")[0] in banner
                if ooms[-1]["phase"]:
                    assert f"phase {ooms[-1]['phase']}" in banner
                titles = [s.title for s in app.screen.suggestions]
                assert titles == [s["title"] for s in ooms[-1]["suggestions"]]
                assert all(title in text for title in titles)

    scenario()


def _plain(renderable: Any) -> str:
    import io

    from rich.console import Console

    console = Console(width=200, file=io.StringIO(), color_system=None)
    with console.capture() as capture:
        console.print(renderable)
    return capture.get()


def test_the_reports_op_table_cuts_a_long_name_rather_than_wrapping_it_at_80_columns() -> None:
    """A long op name wrapped onto a second line of empty cells; it ends in an ellipsis, one
    line an op, and every figure stays whole."""
    import io

    from rich.console import Console

    from torchtop.report.job import ops_parts

    def op(name: str) -> dict[str, Any]:
        return {"name": name, "calls": 1200, "self_cpu_s": 0.5, "total_cpu_s": 1.25,
                "avg_s": 0.0004, "self_device_s": None}  # fmt: skip

    long = "autograd::engine::evaluate_function: ScaledDotProductEfficientAttentionBackward0"
    report = {"profile_windows": 2, "profiled_steps": 8, "sync_points_per_step": None,
              "copies_per_step": None, "trace_path": None,
              "ops": [op(long), op("aten::mm")]}  # fmt: skip
    console = Console(width=80, file=io.StringIO(), color_system=None)
    with console.capture() as capture:
        for part in ops_parts(report):
            console.print(part)
    body = [line for line in capture.get().splitlines() if line.startswith("│")]
    assert len(body) == 2, capture.get()  # one line each: no row of empty cells
    assert all("1200" in line and "0.50 s" in line for line in body), body
    assert "…" in body[0]
